//! Matrix products of a few activation rows (a decode step: 1; a verify block: K + 1) with a
//! weight stored in blocks of 32 (GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or dense f32, on the CPU:
//! the portable kernels, with what every kernel shares (the block layouts, the activation
//! quantizer, [`Path`], the pool).
//! AVX2 multiplies weights repacked in panels instead ([`super::panels`]).
//!
//! - **The weights are read once per call**, not once per row: each thread takes a range of
//!   weight rows (output columns) and, for each weight row, decodes each block once and
//!   multiplies it with up to [`TILE`] activation rows; the weight row stays in L1 between
//!   tiles. A verify block therefore costs the decode step's memory traffic plus its compute.
//! - **Batch invariance**: output (row r, column o) is the same sequence of operations whatever
//!   the number of rows or the tile r falls in (each row has its own accumulators, summed in
//!   block order, reduced the same way), so a position's logits are bit-identical in a decode
//!   step, a verify block and a replayed prefill (see the module above).
//! - Activations are quantized once per row, as llama.cpp does ([`Q8`]: 32 signed bytes, an
//!   f32 scale, and the block's sum for the types with a minimum).
//! - The SIMD paths (detected at run time) and the portable path compute the same integer dot
//!   products; their float sums differ in order, so each machine uses one path for every call
//!   ([`Path::detect`]).

use std::cell::RefCell;
use std::sync::OnceLock;

use half::f16;

/// Activation rows decoded against one weight block at a time.
pub(crate) const TILE: usize = 4;
/// Weights per block.
pub(crate) const QK: usize = 32;

/// 32 activations quantized to signed bytes: x ≈ d · q; `s` = d · Σq; `bias` = −128 · Σq, what
/// the VNNI kernel's sums start from (its weights are stored as q + 128: [`super::x86_vnni`]).
#[derive(Debug, Clone, Copy, Default)]
#[repr(C)]
pub(crate) struct Q8 {
    pub qs: [i8; QK],
    pub d: f32,
    pub s: f32,
    pub bias: i32,
}

/// The GGUF layouts of the block types (ggml's `block_q4_0` …), read in place from a tensor's
/// bytes: an f16 scale `d`, for the `_1` types an f16 minimum `m`, for Q5 the fifth bits `qh`,
/// and the quants. A weight is d · (q − offset) (+ m).
pub(crate) mod layout {
    #[derive(Debug, Clone, Copy)]
    #[repr(C)]
    pub(crate) struct Q4_0 {
        pub d: u16,
        pub qs: [u8; 16],
    }
    #[derive(Debug, Clone, Copy)]
    #[repr(C)]
    pub(crate) struct Q4_1 {
        pub d: u16,
        pub m: u16,
        pub qs: [u8; 16],
    }
    #[derive(Debug, Clone, Copy)]
    #[repr(C)]
    pub(crate) struct Q5_0 {
        pub d: u16,
        pub qh: [u8; 4],
        pub qs: [u8; 16],
    }
    #[derive(Debug, Clone, Copy)]
    #[repr(C)]
    pub(crate) struct Q5_1 {
        pub d: u16,
        pub m: u16,
        pub qh: [u8; 4],
        pub qs: [u8; 16],
    }
    #[derive(Debug, Clone, Copy)]
    #[repr(C)]
    pub(crate) struct Q8_0 {
        pub d: u16,
        pub qs: [i8; 32],
    }
    const _: () = assert!(std::mem::size_of::<Q4_0>() == 18);
    const _: () = assert!(std::mem::size_of::<Q4_1>() == 20);
    const _: () = assert!(std::mem::size_of::<Q5_0>() == 22);
    const _: () = assert!(std::mem::size_of::<Q5_1>() == 24);
    const _: () = assert!(std::mem::size_of::<Q8_0>() == 34);
}

/// A weight block of 32: its quants as signed bytes (q − offset), its scale and minimum.
pub(crate) trait Block: Copy + Sync + 'static {
    /// Whether the block has a minimum (the `_1` types).
    const MIN: bool;
    /// Bits per quant (4, 5 or 8).
    const BITS: u32;
    /// What [`Block::quants`] takes off the stored quant (the stored value is unsigned below 8
    /// bits; Q8_0's is signed, 0).
    const OFFSET: i8;
    /// The f16 bits of the scale, and of the minimum (0 without one).
    fn d(&self) -> u16;
    fn m(&self) -> u16 {
        0
    }
    /// The 32 quants, offset removed, in element order.
    fn quants(&self) -> [i8; QK];
}

fn f16_bits(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// Element j < 16 is the low nibble of byte j, element j + 16 its high nibble.
fn nibbles(qs: &[u8; 16]) -> [u8; QK] {
    std::array::from_fn(|j| if j < 16 { qs[j] & 15 } else { qs[j - 16] >> 4 })
}

/// Adds the fifth bit of element j (bit j of `qh`) as bit 4.
fn fifth_bits(mut q: [u8; QK], qh: [u8; 4]) -> [u8; QK] {
    let bits = u32::from_le_bytes(qh);
    for (j, v) in q.iter_mut().enumerate() {
        *v |= (((bits >> j) & 1) as u8) << 4;
    }
    q
}

impl Block for layout::Q4_0 {
    const MIN: bool = false;
    const BITS: u32 = 4;
    const OFFSET: i8 = 8;
    fn d(&self) -> u16 {
        self.d
    }
    fn quants(&self) -> [i8; QK] {
        nibbles(&self.qs).map(|q| q as i8 - 8)
    }
}

impl Block for layout::Q4_1 {
    const MIN: bool = true;
    const BITS: u32 = 4;
    const OFFSET: i8 = 0;
    fn d(&self) -> u16 {
        self.d
    }
    fn m(&self) -> u16 {
        self.m
    }
    fn quants(&self) -> [i8; QK] {
        nibbles(&self.qs).map(|q| q as i8)
    }
}

impl Block for layout::Q5_0 {
    const MIN: bool = false;
    const BITS: u32 = 5;
    const OFFSET: i8 = 16;
    fn d(&self) -> u16 {
        self.d
    }
    fn quants(&self) -> [i8; QK] {
        fifth_bits(nibbles(&self.qs), self.qh).map(|q| q as i8 - 16)
    }
}

impl Block for layout::Q5_1 {
    const MIN: bool = true;
    const BITS: u32 = 5;
    const OFFSET: i8 = 0;
    fn d(&self) -> u16 {
        self.d
    }
    fn m(&self) -> u16 {
        self.m
    }
    fn quants(&self) -> [i8; QK] {
        fifth_bits(nibbles(&self.qs), self.qh).map(|q| q as i8)
    }
}

impl Block for layout::Q8_0 {
    const MIN: bool = false;
    const BITS: u32 = 8;
    const OFFSET: i8 = 0;
    fn d(&self) -> u16 {
        self.d
    }
    fn quants(&self) -> [i8; QK] {
        self.qs
    }
}

/// Which code runs the kernels, from the most portable to the fastest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Path {
    Portable,
    /// x86-64 with AVX2, FMA and F16C (AVX-512 CPUs run the same panels: measured faster there
    /// than AVX-512 kernels that decoded each block once per output row).
    Avx2,
    /// [`Path::Avx2`] and AVX-512 F: the same panels, the dense ones in 16-lane tiles
    /// ([`super::x86_dense512`]), giving the AVX2 kernels' bits.
    Avx512,
    /// [`Path::Avx512`] with BW, VL and VNNI: the blocks of 32 in panels of 16 outputs
    /// multiplied by `vpdpbusd` ([`super::x86_vnni`]), the K-quants' panels too
    /// ([`super::x86_kvnni`]), giving the AVX2 kernels' bits.
    Avx512Vnni,
}

/// The environment variable that caps the kernels' path (`portable`, `avx2`, `avx512`,
/// `avx512_vnni`), as oneDNN's `ONEDNN_MAX_CPU_ISA` does: this machine then runs what a CPU
/// with less runs (a bug or a figure seen there, reproduced here).
pub const MAX_CPU_ISA: &str = "TANDEM_MAX_CPU_ISA";

impl Path {
    /// The fastest path this CPU runs, at most the one [`MAX_CPU_ISA`] names; chosen once per
    /// process.
    pub(crate) fn detect() -> Self {
        static PATH: OnceLock<Path> = OnceLock::new();
        *PATH.get_or_init(|| match Self::cap() {
            Some(cap) => cap.min(Self::cpu()),
            None => Self::cpu(),
        })
    }

    /// The fastest path this CPU has the instructions for.
    pub(crate) fn cpu() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            if !std::arch::is_x86_feature_detected!("avx512f") {
                return Path::Avx2;
            }
            let vnni = std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx512vnni");
            return if vnni { Path::Avx512Vnni } else { Path::Avx512 };
        }
        Path::Portable
    }

    /// The cap [`MAX_CPU_ISA`] sets, if it names one (read once; a name it does not know is
    /// reported and leaves the kernels uncapped).
    pub(crate) fn cap() -> Option<Self> {
        static CAP: OnceLock<Option<Path>> = OnceLock::new();
        *CAP.get_or_init(|| {
            let value = std::env::var(MAX_CPU_ISA).ok()?;
            let cap = Self::named(&value);
            if cap.is_none() {
                let names = Self::ALL.map(Self::name).join(", ");
                tracing::warn!(
                    "{MAX_CPU_ISA}={value:?} is none of {names}: the kernels run this CPU's \
                     fastest path"
                );
            }
            cap
        })
    }

    /// Every path, from the most portable.
    pub(crate) const ALL: [Self; 4] = [Self::Portable, Self::Avx2, Self::Avx512, Self::Avx512Vnni];

    /// Its name, as [`MAX_CPU_ISA`] writes it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
            Self::Avx512Vnni => "avx512_vnni",
        }
    }

    /// The path a [`MAX_CPU_ISA`] value names, in any case.
    pub(crate) fn named(name: &str) -> Option<Self> {
        let name = name.trim().to_ascii_lowercase();
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    /// `self`, or the fastest path this CPU runs if `self` needs more: a caller (a test forcing
    /// a path) can never run code the CPU lacks.
    pub(crate) fn supported(self) -> Self {
        self.min(Self::detect())
    }

    /// Every path this CPU can run (for tests).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Self> {
        Self::ALL
            .into_iter()
            .filter(|p| *p <= Self::detect())
            .collect()
    }
}

/// Quantizes a row of activations (a multiple of 32 long) as llama.cpp's `quantize_row_q8_0`:
/// scale max|x| / 127, round to nearest.
pub(crate) fn quantize(x: &[f32], out: &mut [Q8]) {
    for (xs, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        b.d = quantize_bytes(xs, &mut b.qs);
        let sum: i32 = b.qs.iter().map(|&q| i32::from(q)).sum();
        b.s = b.d * sum as f32;
        b.bias = -128 * sum;
    }
}

/// `xs` to signed bytes `qs` (as long): scale max|x| / 127, round to nearest; returns the scale.
/// The same bytes on every path (AVX2 where the CPU has it: the quantizer runs on one thread
/// while the other waits, so it is in every matmul's serial part).
pub(crate) fn quantize_bytes(xs: &[f32], qs: &mut [i8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if xs.len().is_multiple_of(QK) && Path::detect() != Path::Portable {
        // SAFETY: `Path::detect` found AVX2 on this CPU.
        #[allow(unsafe_code, reason = "a target-feature function, features checked")]
        return unsafe { super::x86::quantize_bytes(xs, qs) };
    }
    portable_quantize_bytes(xs, qs)
}

/// [`quantize_bytes`] one value at a time.
pub(super) fn portable_quantize_bytes(xs: &[f32], qs: &mut [i8]) -> f32 {
    let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (q, v) in qs.iter_mut().zip(xs) {
        *q = (v * id).round() as i8;
    }
    d
}

/// The portable kernel: for each weight row, for each tile of activation rows, the integer dot
/// product of each block, scaled and summed in block order.
fn portable_blocks<B: Block>(w: &[B], x: &[Q8], rows: usize, out: &mut [f32]) {
    let blocks = x.len() / rows;
    for (wrow, out) in w.chunks_exact(blocks).zip(out.chunks_exact_mut(rows)) {
        for (tile, out) in out.chunks_mut(TILE).enumerate() {
            let (mut acc, mut macc) = ([0f32; TILE], [0f32; TILE]);
            for (b, wb) in wrow.iter().enumerate() {
                let (q, d, m) = (wb.quants(), f16_bits(wb.d()), f16_bits(wb.m()));
                for (i, (a, ma)) in acc.iter_mut().zip(&mut macc).take(out.len()).enumerate() {
                    let xb = &x[(tile * TILE + i) * blocks + b];
                    let dot: i32 = q
                        .iter()
                        .zip(&xb.qs)
                        .map(|(&u, &v)| i32::from(u) * i32::from(v))
                        .sum();
                    *a += d * xb.d * dot as f32;
                    if B::MIN {
                        *ma += m * xb.s;
                    }
                }
            }
            for (o, (a, m)) in out.iter_mut().zip(acc.iter().zip(&macc)) {
                *o = a + m;
            }
        }
    }
}

/// The portable f32 kernel: eight lanes summed in a fixed order, as [`super::attention`] does.
fn portable_dense(w: &[f32], x: &[f32], rows: usize, out: &mut [f32]) {
    let k = x.len() / rows;
    for (wrow, out) in w.chunks_exact(k).zip(out.chunks_exact_mut(rows)) {
        for (r, o) in out.iter_mut().enumerate() {
            *o = super::attention::dot(wrow, &x[r * k..][..k]);
        }
    }
}

/// Scratch a thread keeps after a forward, at most: a verify block's (16 rows of a 151,936-token
/// output projection) fits; a long prefill's (~150 MB for 4,096 rows of an 8,960-wide layer) is
/// given back once the forward ends (not after each matmul, which would fault it in anew).
const KEEP_BYTES: usize = 16 << 20;

/// Gives back what the calling thread's scratch holds past [`KEEP_BYTES`].
pub(crate) fn trim_scratch() {
    SCRATCH.with_borrow_mut(|(x, cols)| {
        trim(x);
        trim(cols);
    });
}

/// Gives back the part of a scratch buffer past [`KEEP_BYTES`] (its contents are dead).
pub(super) fn trim<T>(v: &mut Vec<T>) {
    let keep = KEEP_BYTES / std::mem::size_of::<T>().max(1);
    if v.capacity() > keep {
        v.clear();
        v.shrink_to(keep);
    }
}

/// Bytes of the calling thread's scratch (for tests).
#[cfg(test)]
pub(crate) fn scratch_bytes() -> usize {
    SCRATCH.with_borrow(|(x, cols)| {
        x.capacity() * std::mem::size_of::<Q8>() + cols.capacity() * std::mem::size_of::<f32>()
    })
}

thread_local! {
    /// Per-thread scratch reused across calls: quantized activations, column-major results.
    static SCRATCH: RefCell<(Vec<Q8>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Weight rows per parallel task, at least.
const MIN_TASK_ROWS: usize = 16;

/// Runs `kernel` over the weight rows, split across candle's CPU pool (the one its own matmuls
/// use: two pools spinning for work on the same cores slow both down): `kernel(weight rows,
/// out)` fills `out` with `rows` results per weight row (column-major). `dst` gets them
/// row-major.
pub(crate) fn drive<W: Sync>(
    weights: &[W],
    per_row: usize,
    out_dim: usize,
    rows: usize,
    parallel: bool,
    dst: &mut [f32],
    kernel: impl Fn(&[W], &mut [f32]) + Sync,
) {
    SCRATCH.with(|scratch| {
        let cols = &mut scratch.borrow_mut().1;
        // One row: column-major is row-major, write straight into dst.
        let out: &mut [f32] = if rows == 1 {
            dst
        } else {
            cols.resize(out_dim * rows, 0.0);
            cols
        };
        if parallel {
            let task = MIN_TASK_ROWS;
            on_pool(out, task * rows, |t, o| {
                let n = o.len() / rows;
                kernel(&weights[t * task * per_row..][..n * per_row], o);
            });
        } else {
            kernel(weights, out);
        }
        if rows > 1 {
            for (o, col) in cols.chunks_exact(rows).enumerate() {
                for (r, v) in col.iter().enumerate() {
                    dst[r * out_dim + o] = *v;
                }
            }
        }
    });
}

/// Runs `f(i, part)` on each part `i` of `out`, `part_len` elements each (the last may be
/// shorter), split across candle's CPU pool: one pool for every kernel of a forward (ours on
/// rayon's while candle's workers spun for work on the same cores cost ~2x).
#[allow(
    unsafe_code,
    reason = "the pool's tasks write disjoint parts of one buffer through a raw pointer"
)]
pub(crate) fn on_pool(out: &mut [f32], part_len: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    /// The output buffer, shared by the pool's tasks.
    struct Shared(*mut f32);
    // SAFETY: each task writes only its own part (below).
    unsafe impl Sync for Shared {}
    let len = out.len();
    if candle_core::utils::get_num_threads() <= 1 || len <= part_len {
        out.chunks_mut(part_len.max(1))
            .enumerate()
            .for_each(|(i, part)| f(i, part));
        return;
    }
    let shared = Shared(out.as_mut_ptr());
    let shared = &shared;
    candle_core::utils::barrier_pool().execute_chunked(len.div_ceil(part_len), |range| {
        for i in range {
            let first = i * part_len;
            let n = part_len.min(len - first);
            assert!(first + n <= len);
            // SAFETY: part i alone covers first..first + n of `out`, in bounds (checked), and
            // `out` outlives the pool's call.
            let part = unsafe { std::slice::from_raw_parts_mut(shared.0.add(first), n) };
            f(i, part);
        }
    });
}

/// `dst` (rows × out) = `lhs` (rows × in) · `w`ᵀ, `w` holding `out` rows of `in / 32` blocks:
/// the portable kernel (AVX2 multiplies panels: [`super::panels`]).
pub(crate) fn matmul_blocks<B: Block>(
    w: &[B],
    (rows, in_dim, out_dim): (usize, usize, usize),
    lhs: &[f32],
    dst: &mut [f32],
) {
    let blocks = in_dim / QK;
    let parallel = w.len() * QK >= super::attention::PARALLEL_WORK;
    let mut x = SCRATCH.with(|s| std::mem::take(&mut s.borrow_mut().0));
    x.resize(rows * blocks, Q8::default());
    for (xs, q) in lhs.chunks_exact(in_dim).zip(x.chunks_exact_mut(blocks)) {
        quantize(xs, q);
    }
    drive(w, blocks, out_dim, rows, parallel, dst, |w, out| {
        portable_blocks(w, &x, rows, out);
    });
    SCRATCH.with(|s| s.borrow_mut().0 = x);
}

/// `dst` (rows × out) = `lhs` (rows × in) · `w`ᵀ, `w` dense (out × in) f32: the portable kernel
/// (the SIMD paths multiply panels: [`super::panels`]).
pub(crate) fn matmul_dense(
    w: &[f32],
    (rows, in_dim, out_dim): (usize, usize, usize),
    lhs: &[f32],
    dst: &mut [f32],
) {
    let parallel = w.len() >= super::attention::PARALLEL_WORK;
    drive(w, in_dim, out_dim, rows, parallel, dst, |w, out| {
        portable_dense(w, lhs, rows, out);
    });
}
