//! The K-quants of the real models (Q4_K, Q5_K, Q6_K) in panels of [`QLANES`] outputs for the AVX2
//! kernels ([`super::x86_kpanels`]), as [`super::panels`] does for the blocks of 32: repacked when
//! the model loads (at about the file's size), each super-block decoded once for a tile of
//! activation rows, integer products within a super-block (a sub-block's pair sums scaled by its
//! scale in one `madd`), the offset or the minimum through the activations' integer sums.

use std::cell::RefCell;

use candle_core::quantized::{GgmlDType, QTensor};

use super::kquants::{QK_K, layout};
use super::matmul::cast;
use super::panels::{QLANES, drive, pack_nibbles, repack};
use super::rows::Path;

/// 256 activations quantized to signed bytes (x ≈ d · q, scale max|x| / 127, as
/// the blocks of 32 are), with the integer sums of q per 16 and per 32.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(32))]
pub(crate) struct Q8S {
    pub qs: [i8; QK_K],
    pub d: f32,
    pub s16: [i16; 16],
    pub s32: [i16; 8],
}

impl Default for Q8S {
    fn default() -> Self {
        Self {
            qs: [0; QK_K],
            d: 0.0,
            s16: [0; 16],
            s32: [0; 8],
        }
    }
}

/// Quantizes a row (a multiple of 256 long).
pub(crate) fn quantize(x: &[f32], out: &mut [Q8S]) {
    for (xs, b) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        b.d = super::rows::quantize_bytes(xs, &mut b.qs);
        for (s, qs) in b.s16.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = qs.iter().map(|&q| i16::from(q)).sum();
        }
        for (j, s) in b.s32.iter_mut().enumerate() {
            *s = b.s16[2 * j] + b.s16[2 * j + 1];
        }
    }
}

/// Bytes of a Q4_K super-block of [`QLANES`] outputs in a panel: f16 scales `d` and `dmin`,
/// the sub-blocks' scales and minimums in pairs (sub-blocks 2i and 2i + 1 of output o at
/// 16i + 2o), then per sub-block of 32 the quants as [`pack_nibbles`] lays them out.
pub(crate) const Q4K_BYTES: usize = 16 + 16 + 64 + 64 + 8 * 128;
/// Bytes of a Q5_K super-block in a panel: Q4_K's layout of the low 4 bits, then per sub-block
/// of 32 one register of the fifth bits (bit g of byte i: the high bit of group g's byte i).
pub(crate) const Q5K_BYTES: usize = Q4K_BYTES + 8 * 32;
/// Bytes of a Q6_K super-block of [`QLANES`] outputs in a panel: f16 scales, the 16 sub-block
/// scales in pairs (as Q4_K's), per sub-block of 32 the low 4 bits as [`pack_nibbles`] lays them
/// out, then per sub-block of 32 two registers of the high 2 bits (register h: bits 2f..2f + 2
/// of byte i the high bits of group 4h + f's byte i).
pub(crate) const Q6K_BYTES: usize = 16 + 128 + 8 * 128 + 8 * 64;

/// A Q4_K or Q5_K super-block's 6-bit sub-block scales and minimums, as llama.cpp's
/// `get_scale_min_k4` reads them.
fn k4_scales(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..8 {
        (sc[j], m[j]) = if j < 4 {
            (s[j] & 63, s[j + 4] & 63)
        } else {
            (
                (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4),
                (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
            )
        };
    }
    (sc, m)
}

/// A Q4_K or Q5_K super-block's 256 low nibbles (`qs`), with the fifth bits of `qh` (Q5_K) on
/// top, as llama.cpp's `dequantize_row_q4_K` / `_q5_K` read them.
fn k4_quants(qs: &[u8; 128], qh: Option<&[u8; 32]>) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for (jj, bytes) in qs.chunks_exact(32).enumerate() {
        for (l, byte) in bytes.iter().enumerate() {
            let high = |bit: usize| qh.map_or(0, |h| ((h[l] >> bit) & 1) << 4);
            q[64 * jj + l] = (byte & 15) | high(2 * jj);
            q[64 * jj + 32 + l] = (byte >> 4) | high(2 * jj + 1);
        }
    }
    q
}

/// A Q4_K or Q5_K super-block as a panel writes it: f16 scales `d` and `dmin`, sub-block scales
/// and minimums, quants.
type K4Parts = (u16, u16, [u8; 8], [u8; 8], [u8; QK_K]);

fn q4k_parts(b: &layout::Q4K) -> K4Parts {
    let (sc, m) = k4_scales(&b.scales);
    (b.d, b.dmin, sc, m, k4_quants(&b.qs, None))
}

fn q5k_parts(b: &layout::Q5K) -> K4Parts {
    let (sc, m) = k4_scales(&b.scales);
    (b.d, b.dmin, sc, m, k4_quants(&b.qs, Some(&b.qh)))
}

/// A Q6_K super-block's 16 sub-block scales and its 256 quants (0..64, the offset 32 not
/// taken), as llama.cpp's `dequantize_row_q6_K` reads them.
fn q6k_parts(b: &layout::Q6K) -> ([i8; 16], [u8; QK_K]) {
    let mut q = [0u8; QK_K];
    for n in 0..2 {
        let (ql, qh) = (&b.ql[64 * n..], &b.qh[32 * n..]);
        for l in 0..32 {
            let y = &mut q[128 * n..];
            y[l] = (ql[l] & 15) | ((qh[l] & 3) << 4);
            y[l + 32] = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
            y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    (b.scales, q)
}

/// Writes `v[o][j]` (8 outputs × 2k values) as pairs: sub-blocks 2i and 2i + 1 of output o at
/// 16i + 2o.
fn pairs(v: &[[u8; 16]; QLANES], subs: usize, out: &mut [u8]) {
    for i in 0..subs / 2 {
        for (o, v) in v.iter().enumerate() {
            out[16 * i + 2 * o] = v[2 * i];
            out[16 * i + 2 * o + 1] = v[2 * i + 1];
        }
    }
}

/// Writes a panel's Q4_K super-block ([`Q4K_BYTES`]), or Q5_K's ([`Q5K_BYTES`]: `dst` is that
/// long); missing outputs have zero scales.
fn write_k4(parts: [Option<K4Parts>; QLANES], dst: &mut [u8]) {
    for (o, p) in parts.iter().enumerate() {
        let (d, dmin) = p.map_or((0, 0), |p| (p.0, p.1));
        dst[2 * o..][..2].copy_from_slice(&d.to_le_bytes());
        dst[16 + 2 * o..][..2].copy_from_slice(&dmin.to_le_bytes());
    }
    let widen = |v: [u8; 8]| std::array::from_fn(|j| if j < 8 { v[j] } else { 0 });
    let sc: [[u8; 16]; QLANES] = parts.map(|p| widen(p.map_or([0; 8], |p| p.2)));
    let m: [[u8; 16]; QLANES] = parts.map(|p| widen(p.map_or([0; 8], |p| p.3)));
    pairs(&sc, 8, &mut dst[32..96]);
    pairs(&m, 8, &mut dst[96..160]);
    let q = parts.map(|p| p.map_or([0; QK_K], |p| p.4));
    let at = |j: usize, g: usize, i: usize| q[i / 4][32 * j + 4 * g + i % 4];
    for (j, regs) in dst[160..Q4K_BYTES].chunks_exact_mut(128).enumerate() {
        pack_nibbles(|g, i| at(j, g, i) & 15, regs);
    }
    for (j, reg) in dst[Q4K_BYTES..].chunks_exact_mut(32).enumerate() {
        for (i, byte) in reg.iter_mut().enumerate() {
            *byte = (0..8).fold(0, |acc, g| acc | ((at(j, g, i) >> 4) << g));
        }
    }
}

/// Writes a panel's Q6_K super-block ([`Q6K_BYTES`]); missing outputs have zero scales.
fn write_q6k(blocks: &[Option<&layout::Q6K>; QLANES], dst: &mut [u8]) {
    let parts = blocks.map(|b| b.map(q6k_parts));
    for (o, b) in blocks.iter().enumerate() {
        dst[2 * o..][..2].copy_from_slice(&b.map_or(0, |b| b.d).to_le_bytes());
    }
    let sc: [[u8; 16]; QLANES] = parts.map(|p| p.map_or([0; 16], |p| p.0.map(|s| s as u8)));
    pairs(&sc, 16, &mut dst[16..144]);
    let q = parts.map(|p| p.map_or([0; QK_K], |p| p.1));
    let at = |j: usize, g: usize, i: usize| q[i / 4][32 * j + 4 * g + i % 4];
    for (j, regs) in dst[144..1168].chunks_exact_mut(128).enumerate() {
        pack_nibbles(|g, i| at(j, g, i), regs);
    }
    for (jh, reg) in dst[1168..].chunks_exact_mut(32).enumerate() {
        let (j, h) = (jh / 2, jh % 2);
        for (i, byte) in reg.iter_mut().enumerate() {
            *byte = (0..4).fold(0, |acc, f| acc | ((at(j, 4 * h + f, i) >> 4) << (2 * f)));
        }
    }
}

thread_local! {
    /// Activations quantized for the kernels, reused across calls.
    static X: RefCell<Vec<Q8S>> = const { RefCell::new(Vec::new()) };
}

/// Gives back what the calling thread's scratch holds past what a verify block needs.
pub(crate) fn trim_scratch() {
    X.with_borrow_mut(super::rows::trim);
}

/// A Q4_K, Q5_K or Q6_K weight in panels, for a CPU with AVX2, FMA and F16C.
#[derive(Debug)]
pub(crate) struct KPanels {
    dtype: GgmlDType,
    /// The products by `vpdpbusd` ([`super::x86_kvnni`]): the CPU runs [`Path::Avx512Vnni`].
    vnni: bool,
    data: Vec<u8>,
    out_dim: usize,
    in_dim: usize,
}

impl KPanels {
    /// `t` (out × in, in a multiple of 256, Q4_K, Q5_K or Q6_K), multiplied on `path` (or the
    /// fastest this CPU runs below it); the caller checked the CPU runs [`Path::Avx2`] at least.
    pub(crate) fn new(path: Path, t: &QTensor) -> candle_core::Result<Self> {
        let (out_dim, in_dim) = t.shape().dims2()?;
        let nsb = in_dim / QK_K;
        let bytes = t.data()?;
        let data = match t.dtype() {
            GgmlDType::Q4K => repack(
                cast::<layout::Q4K>(&bytes)?,
                out_dim,
                nsb,
                Q4K_BYTES,
                |b, dst| write_k4(b.map(|b| b.map(q4k_parts)), dst),
            ),
            GgmlDType::Q5K => repack(
                cast::<layout::Q5K>(&bytes)?,
                out_dim,
                nsb,
                Q5K_BYTES,
                |b, dst| write_k4(b.map(|b| b.map(q5k_parts)), dst),
            ),
            GgmlDType::Q6K => repack(
                cast::<layout::Q6K>(&bytes)?,
                out_dim,
                nsb,
                Q6K_BYTES,
                write_q6k,
            ),
            other => candle_core::bail!("no K-quant panel kernel for GGUF type {other:?}"),
        };
        Ok(Self {
            dtype: t.dtype(),
            vnni: path.supported() == Path::Avx512Vnni,
            data,
            out_dim,
            in_dim,
        })
    }

    /// (out, in).
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.out_dim, self.in_dim)
    }

    /// `dst` (rows × out) = `lhs` (rows × in) · weightᵀ.
    #[allow(unsafe_code, reason = "calls the AVX2 kernels the CPU was checked for")]
    pub(crate) fn matmul(&self, lhs: &[f32], rows: usize, dst: &mut [f32]) {
        let nsb = self.in_dim / QK_K;
        X.with_borrow_mut(|x| {
            x.resize(rows * nsb, Q8S::default());
            for (xs, q) in lhs.chunks_exact(self.in_dim).zip(x.chunks_exact_mut(nsb)) {
                quantize(xs, q);
            }
            let x: &[Q8S] = x;
            let parallel = self.data.len() * 2 >= super::attention::PARALLEL_WORK;
            let kind = (self.dtype, self.vnni);
            #[cfg(target_arch = "x86_64")]
            drive(QLANES, self.out_dim, rows, parallel, dst, |panels, out| {
                // SAFETY: the CPU runs Path::Avx2 at least (checked by the caller of `new`), and
                // Path::Avx512Vnni where `vnni` (`supported` in `new`).
                unsafe { super::x86_kpanels::matmul(kind, &self.data, nsb, panels, x, rows, out) }
            });
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (x, parallel, kind, dst);
        });
    }
}
