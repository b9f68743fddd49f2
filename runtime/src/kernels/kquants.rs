//! Matrix products for the GGUF K-quants of the real targets (Q4_K, Q6_K), super-blocks of 256
//! weights, on x86-64 with AVX-512 (F + BW, detected at run time); other CPUs keep candle's
//! kernels (see [`super::matmul`]).
//!
//! As in [`super::rows`]: activations quantized once per row ([`Q8K`]: signed bytes, an f32
//! scale, the sums of each 16 scaled), weight rows split across candle's pool and read once per
//! call, each super-block decoded once (quants, scales, the correction for the offset or the
//! minimum) for up to [`super::rows::TILE`] activation rows, and a row's operations independent
//! of how many rows run with it (batch invariance). Within a super-block the products are
//! integers (u8 × i8 pairs, then pairs scaled by the sub-block's scale), converted to float once.

use super::rows::{self, Path};

/// Weights per super-block.
pub(crate) const QK_K: usize = 256;

/// 256 activations quantized to signed bytes: x ≈ d · q; `bs[j]` = d · Σ q over elements
/// 16j..16j + 16.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Q8K {
    pub qs: [i8; QK_K],
    pub bs: [f32; 16],
    pub d: f32,
}

impl Default for Q8K {
    fn default() -> Self {
        Self {
            qs: [0; QK_K],
            bs: [0.0; 16],
            d: 0.0,
        }
    }
}

/// The GGUF layouts (ggml's `block_q4_K`, `block_q5_K`, `block_q6_K`).
pub(crate) mod layout {
    /// w = d · sc_j · q − dmin · m_j over sub-blocks j of 32; 6-bit sc and m packed in `scales`.
    #[derive(Debug, Clone, Copy)]
    #[repr(C)]
    pub(crate) struct Q4K {
        pub d: u16,
        pub dmin: u16,
        pub scales: [u8; 12],
        pub qs: [u8; 128],
    }
    /// Q4_K's with a fifth bit per quant: bit 2i (2i + 1) of `qh[l]` is the high bit of the
    /// low (high) nibble of `qs[32i + l]`.
    #[derive(Debug, Clone, Copy)]
    #[repr(C)]
    pub(crate) struct Q5K {
        pub d: u16,
        pub dmin: u16,
        pub scales: [u8; 12],
        pub qh: [u8; 32],
        pub qs: [u8; 128],
    }
    /// w = d · sc_j · (q − 32) over sub-blocks j of 16; q's low 4 bits in `ql`, high 2 in `qh`.
    #[derive(Debug, Clone, Copy)]
    #[repr(C)]
    pub(crate) struct Q6K {
        pub ql: [u8; 128],
        pub qh: [u8; 64],
        pub scales: [i8; 16],
        pub d: u16,
    }
    const _: () = assert!(std::mem::size_of::<Q4K>() == 144);
    const _: () = assert!(std::mem::size_of::<Q5K>() == 176);
    const _: () = assert!(std::mem::size_of::<Q6K>() == 210);
}

/// Quantizes a row of activations (a multiple of 256 long): scale max|x| / 127, round to
/// nearest.
pub(crate) fn quantize(x: &[f32], out: &mut [Q8K]) {
    for (xs, b) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let d = rows::quantize_bytes(xs, &mut b.qs);
        for (s, qs) in b.bs.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = d * qs.iter().map(|&q| i32::from(q)).sum::<i32>() as f32;
        }
        b.d = d;
    }
}

/// A K-quant block type with an AVX-512 kernel.
pub(crate) trait KBlock: Copy + Sync + 'static + super::DecodeK {}
impl KBlock for layout::Q4K {}
impl KBlock for layout::Q6K {}

thread_local! {
    /// Activations quantized for the kernel, reused across calls.
    static X: std::cell::RefCell<Vec<Q8K>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Gives back what the calling thread's scratch holds past what a verify block needs.
pub(crate) fn trim_scratch() {
    X.with_borrow_mut(rows::trim);
}

/// `dst` (rows × out) = `lhs` (rows × in) · `w`ᵀ, `w` holding `out` rows of `in / 256`
/// super-blocks. `path` must be [`Path::Avx512`].
#[allow(
    unsafe_code,
    reason = "calls the AVX-512 kernel once the CPU is checked"
)]
pub(crate) fn matmul<B: KBlock>(
    path: Path,
    w: &[B],
    (rows, in_dim, out_dim): (usize, usize, usize),
    lhs: &[f32],
    dst: &mut [f32],
) {
    assert!(
        path == Path::Avx512 && path.supported() == path,
        "the K-quant kernels need AVX-512 ({path:?} asked, the CPU runs {:?})",
        Path::detect()
    );
    let blocks = in_dim / QK_K;
    let mut x = X.with(|s| std::mem::take(&mut *s.borrow_mut()));
    x.resize(rows * blocks, Q8K::default());
    for (xs, q) in lhs.chunks_exact(in_dim).zip(x.chunks_exact_mut(blocks)) {
        quantize(xs, q);
    }
    let parallel = w.len() * QK_K >= super::attention::PARALLEL_WORK;
    rows::drive(w, blocks, out_dim, rows, parallel, dst, |w, out| {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU runs Path::Avx512 (asserted above).
        unsafe {
            super::x86_kquants::matmul(w, &x, rows, out)
        };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!(
            "AVX-512 is detected on x86-64 only: {} {}",
            w.len(),
            out.len()
        );
    });
    X.with(|s| *s.borrow_mut() = x);
}
