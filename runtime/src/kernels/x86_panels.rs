//! The AVX2 kernels over weights in panels ([`super::panels`]): a tile of one or two panels × up
//! to [`MAX_ROWS`] activation rows lives in registers; for each input, one load per half panel
//! and one broadcast per row feed the tile's fused multiply-adds. The same code serves AVX-512
//! CPUs (a lane's operations, and so its bits, are those of a 16-lane register's). Callers check
//! the features ([`super::rows::Path::Avx2`]).

#![allow(
    unsafe_code,
    reason = "SIMD intrinsics need the CPU features checked by the caller, and load from raw pointers"
)]

use std::arch::x86_64::*;
use std::ops::Range;

use super::panels::{Half, LANES, QLANES, panel_bytes};
use super::rows::{Block, Q8};
use super::x86::{fifth, group};

/// Activation rows in a tile of one panel: two registers per row (16 lanes), `2 · MAX_ROWS`
/// accumulators, the panel's weights and a broadcast fit in the 16 registers of AVX2.
const MAX_ROWS: usize = 6;
/// Up to this many rows, tiles of two panels (more chains in flight for a decode step).
const TWO_PANEL_ROWS: usize = 3;
/// Inputs per chunk: the tiles of one panel × up to [`MAX_ROWS`] rows go over a panel a chunk
/// at a time, each asking the memory for the next chunk while it multiplies this one (4 KB of an
/// f32 panel): the tiles after the first read the chunk from L1, and none waits on DRAM alone.
/// Measured on a Zen 2 (1536 → 8960, 200 runs alternated): chunks of 512 with only the first
/// tile prefetching 128 inputs ahead took 1.65× one row at 9 rows and 1.60× at 8; chunks of 64
/// prefetched by every tile 1.27× and 1.24× (32: 1.22× at 9 rows, but slower for 4–6 rows).
const CHUNK: usize = 64;

/// How a dense panel's elements widen to f32, eight lanes at a time.
pub(crate) trait Lanes {
    type Elem: Copy;
    /// Eight elements from `p`, as f32.
    ///
    /// # Safety
    /// Eight elements are readable at `p`; the CPU has AVX2 and F16C (inlined into the tiles,
    /// which enable them).
    unsafe fn load8(p: *const Self::Elem) -> __m256;
}

/// f32 weights.
pub(crate) struct F32;
/// IEEE half-precision weights (GGUF F16).
pub(crate) struct F16;
/// bfloat16 weights (GGUF BF16): an f32's upper 16 bits.
pub(crate) struct Bf16;

impl Lanes for F32 {
    type Elem = f32;
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: the caller's.
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl Lanes for F16 {
    type Elem = Half;
    #[inline(always)]
    unsafe fn load8(p: *const Half) -> __m256 {
        // SAFETY: the caller's (16 bytes, F16C).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

impl Lanes for Bf16 {
    type Elem = Half;
    #[inline(always)]
    unsafe fn load8(p: *const Half) -> __m256 {
        // SAFETY: the caller's (16 bytes, AVX2): each value to the upper half of an f32.
        unsafe {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(p.cast()),
            )))
        }
    }
}

/// `P` panels (`w`: `[panel][input][lane]`, `k` inputs each) × activation rows `r0..r0 + T` over
/// inputs `ks`, added to what `out` (`[panel][row][lane]`, `rows` rows) holds, or to zero for
/// the first chunk. A lane's operations (one fused multiply-add per input, in input order) do not
/// depend on `P`, `T`, `r0` or the chunks.
///
/// # Safety
/// AVX2, FMA and F16C; `w` holds `P` panels of `k` inputs, `x` `rows` rows of `k`, `out` `P`
/// panels of `rows` rows, `ks` ⊆ 0..k, `r0 + T` ≤ `rows` (the caller checks).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dense_tile<L: Lanes, const P: usize, const T: usize>(
    w: *const L::Elem,
    k: usize,
    x: *const f32,
    (rows, r0): (usize, usize),
    ks: Range<usize>,
    ahead: usize,
    out: *mut f32,
) {
    let at = |p: usize, t: usize, h: usize| (p * rows + r0 + t) * LANES + 8 * h;
    let mut acc = [[[_mm256_setzero_ps(); 2]; T]; P];
    if ks.start > 0 {
        for (p, acc) in acc.iter_mut().enumerate() {
            for (t, acc) in acc.iter_mut().enumerate() {
                for (h, a) in acc.iter_mut().enumerate() {
                    // SAFETY: in `out` (the caller's bounds).
                    *a = unsafe { _mm256_loadu_ps(out.add(at(p, t, h))) };
                }
            }
        }
    }
    for i in ks {
        if ahead > 0 {
            for p in 0..P {
                // A hint, never a fault, wherever it points.
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((p * k + i + ahead) * LANES).cast());
            }
        }
        // SAFETY (the loads): in `w` and `x` (the caller's bounds).
        let wv: [[__m256; 2]; P] = std::array::from_fn(|p| {
            std::array::from_fn(|h| unsafe { L::load8(w.add((p * k + i) * LANES + 8 * h)) })
        });
        #[allow(
            clippy::needless_range_loop,
            reason = "one broadcast per row, used by every panel: acc is indexed [panel][row]"
        )]
        for t in 0..T {
            let xb = _mm256_set1_ps(unsafe { *x.add((r0 + t) * k + i) });
            for p in 0..P {
                for h in 0..2 {
                    acc[p][t][h] = _mm256_fmadd_ps(wv[p][h], xb, acc[p][t][h]);
                }
            }
        }
    }
    for (p, acc) in acc.iter().enumerate() {
        for (t, acc) in acc.iter().enumerate() {
            for (h, a) in acc.iter().enumerate() {
                // SAFETY: in `out` (the caller's bounds).
                unsafe { _mm256_storeu_ps(out.add(at(p, t, h)), *a) };
            }
        }
    }
}

/// `dense_tile::<L, P, T>` for a `T` known only at run time: 1..=[`MAX_ROWS`] rows for one
/// panel, 1..=[`TWO_PANEL_ROWS`] for two.
///
/// # Safety
/// As [`dense_tile`]'s.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<L: Lanes, const P: usize>(
    t: usize,
    w: *const L::Elem,
    k: usize,
    x: *const f32,
    at: (usize, usize),
    (ks, ahead): (Range<usize>, usize),
    out: *mut f32,
) {
    // SAFETY: the caller's.
    unsafe {
        match (P, t) {
            (1, 4) => dense_tile::<L, 1, 4>(w, k, x, at, ks, ahead, out),
            (1, 5) => dense_tile::<L, 1, 5>(w, k, x, at, ks, ahead, out),
            (1, 6) => dense_tile::<L, 1, 6>(w, k, x, at, ks, ahead, out),
            (_, 1) => dense_tile::<L, P, 1>(w, k, x, at, ks, ahead, out),
            (_, 2) => dense_tile::<L, P, 2>(w, k, x, at, ks, ahead, out),
            (_, 3) => dense_tile::<L, P, 3>(w, k, x, at, ks, ahead, out),
            _ => unreachable!("{t} rows in a tile of {P} panels"),
        }
    }
}

/// Panels `panels` of `w` (`[panel][input][lane]`, `k` inputs) against `rows` activation rows
/// `x` (rows × k): `out` gets `[panel][row][lane]` for those panels. Two-panel tiles of every
/// row up to [`TWO_PANEL_ROWS`] rows, else one panel × up to [`MAX_ROWS`] rows asking for the
/// next chunk.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C ([`super::rows::Path::Avx2`]).
pub(crate) unsafe fn dense<L: Lanes>(
    w: &[L::Elem],
    k: usize,
    panels: Range<usize>,
    x: &[f32],
    rows: usize,
    out: &mut [f32],
) {
    // SAFETY: `dense_tiles` hands each tile pointers to its panels, the rows of `x` and their
    // outputs (asserted there); the caller checked the features.
    unsafe {
        super::x86::dense_tiles(
            (w, k, LANES),
            panels,
            x,
            (rows, MAX_ROWS, TWO_PANEL_ROWS, 1, CHUNK),
            out,
            |n, t, wp, x, at, chunk, op| {
                if n == 2 {
                    tile::<L, 2>(t, wp, k, x, at, chunk, op);
                } else {
                    tile::<L, 1>(t, wp, k, x, at, chunk, op);
                }
            },
        )
    }
}

/// Blocks ahead of the one a tile reads that its first rows ask the memory for.
const BLOCKS_AHEAD: usize = 8;

/// Panels a one-row tile may read at a time (as many streams of weights in flight), where this
/// CPU reads that faster than one (`super::panels::decode_panels`).
pub(crate) const DECODE_PANELS: usize = 2;

/// Activation rows in a tile of a block kernel.
const BLOCK_ROWS: usize = 4;

/// `P` panels (`w`: theirs `nb` blocks each, [`panel_bytes`] a block) × activation rows
/// `r0..r0 + T` (`x`: `nb` quantized blocks per row): `out` (`[panel][row][QLANES]`, `rows`
/// rows) gets the sums. Per block and row the integer dot products of the 8 outputs (u8 × i8
/// pairs summed to 16 then 32 bits, which cannot saturate: |q| ≤ 31 below 8 bits, signs moved
/// to the activations for 8), then one scale and the offset or minimum through the
/// activations' block sum; a row's operations do not depend on `P`, `T` or `r0`.
///
/// # Safety
/// AVX2, FMA and F16C; `w` holds `P` panels, `x` rows `r0..r0 + T`, `out` `P` panels of `rows`
/// rows.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn blocks_tile<B: Block, const P: usize, const T: usize>(
    w: &[u8],
    nb: usize,
    x: &[Q8],
    (rows, r0): (usize, usize),
    out: &mut [f32],
) {
    let size = panel_bytes::<B, QLANES>();
    let head = 2 * QLANES * (1 + B::MIN as usize);
    let xs: [&[Q8]; T] = std::array::from_fn(|t| &x[(r0 + t) * nb..][..nb]);
    let (low, ones) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi16(1));
    let off = _mm256_set1_ps(-f32::from(B::OFFSET));
    let mut acc = [[_mm256_setzero_ps(); T]; P];
    let prefetch = r0 == 0;
    for b in 0..nb {
        for (p, acc) in acc.iter_mut().enumerate() {
            let blk = &w[(p * nb + b) * size..][..size];
            if prefetch {
                super::x86::prefetch(blk.as_ptr().wrapping_add(BLOCKS_AHEAD * size), 0..size);
            }
            // SAFETY (the loads here): within the block's `size` bytes.
            let d = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(blk.as_ptr().cast()) });
            // The offset's and the minimum's share per unit of activation sum: m − offset · d.
            let corr = if B::MIN {
                let m = blk[2 * QLANES..].as_ptr().cast();
                _mm256_fmadd_ps(off, d, _mm256_cvtph_ps(unsafe { _mm_loadu_si128(m) }))
            } else {
                _mm256_mul_ps(off, d)
            };
            let q = &blk[head..];
            let load = |i: usize| unsafe { _mm256_loadu_si256(q[32 * i..][..32].as_ptr().cast()) };
            let mut sums = [_mm256_setzero_si256(); T];
            if B::BITS == 8 {
                for g in 0..8 {
                    let wq = load(g);
                    let aw = _mm256_abs_epi8(wq);
                    for (sum, xs) in sums.iter_mut().zip(&xs) {
                        let p =
                            _mm256_maddubs_epi16(aw, _mm256_sign_epi8(group(&xs[b].qs, 4 * g), wq));
                        *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(p, ones));
                    }
                }
            } else {
                // 16-bit sums of up to 8 (4 bits) or 4 (5 bits) pair products, then 32 bits.
                let mut s16 = [_mm256_setzero_si256(); T];
                let qh = if B::BITS == 5 {
                    load(4)
                } else {
                    _mm256_setzero_si256()
                };
                for j in 0..4 {
                    let raw = load(j);
                    let mut lo = _mm256_and_si256(raw, low);
                    let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low);
                    if B::BITS == 5 {
                        lo = _mm256_or_si256(lo, fifth(qh, 2 * j));
                        hi = _mm256_or_si256(hi, fifth(qh, 2 * j + 1));
                    }
                    for (s, xs) in s16.iter_mut().zip(&xs) {
                        let p = _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo, group(&xs[b].qs, 8 * j)),
                            _mm256_maddubs_epi16(hi, group(&xs[b].qs, 8 * j + 4)),
                        );
                        *s = _mm256_add_epi16(*s, p);
                    }
                    if B::BITS == 5 && j == 1 {
                        for (sum, s) in sums.iter_mut().zip(&mut s16) {
                            *sum = _mm256_madd_epi16(*s, ones);
                            *s = _mm256_setzero_si256();
                        }
                    }
                }
                for (sum, s) in sums.iter_mut().zip(&s16) {
                    *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(*s, ones));
                }
            }
            for ((a, sum), xs) in acc.iter_mut().zip(&sums).zip(&xs) {
                let xb = &xs[b];
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(xb.d));
                *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(*sum), scale, *a);
                if B::MIN || B::OFFSET != 0 {
                    *a = _mm256_fmadd_ps(corr, _mm256_set1_ps(xb.s), *a);
                }
            }
        }
    }
    for (p, acc) in acc.iter().enumerate() {
        for (t, a) in acc.iter().enumerate() {
            let o = &mut out[(p * rows + r0 + t) * QLANES..][..QLANES];
            // SAFETY: QLANES values are written to a slice of QLANES.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), *a) };
        }
    }
}

/// Panels `panels` of `w` (blocks of 32 in panels: [`super::panels`]) against `rows` activation
/// rows `x` (`nb` quantized blocks each): `out` gets `[panel][row][QLANES]` for those panels. One
/// row `streams` panels at a time ([`DECODE_PANELS`] or 1, whichever this CPU reads faster:
/// `super::panels::decode_panels`), more in tiles of [`BLOCK_ROWS`].
///
/// # Safety
/// The CPU has AVX2, FMA and F16C ([`super::rows::Path::Avx2`]).
pub(crate) unsafe fn blocks<B: Block>(
    streams: usize,
    w: &[u8],
    nb: usize,
    panels: Range<usize>,
    x: &[Q8],
    rows: usize,
    out: &mut [f32],
) {
    let per_panel = nb * panel_bytes::<B, QLANES>();
    // SAFETY (each tile): the caller checked AVX2, FMA and F16C; `block_tiles` hands each tile
    // its panels, the rows of `x` and their outputs (asserted there).
    unsafe {
        super::x86::block_tiles(
            (w, per_panel, QLANES),
            panels,
            (x, nb),
            (rows, streams, BLOCK_ROWS),
            out,
            |n, t, wp, x, at, op| match (n, t) {
                (DECODE_PANELS, _) => blocks_tile::<B, DECODE_PANELS, 1>(wp, nb, x, at, op),
                (_, 1) => blocks_tile::<B, 1, 1>(wp, nb, x, at, op),
                (_, 2) => blocks_tile::<B, 1, 2>(wp, nb, x, at, op),
                (_, 3) => blocks_tile::<B, 1, 3>(wp, nb, x, at, op),
                _ => blocks_tile::<B, 1, BLOCK_ROWS>(wp, nb, x, at, op),
            },
        )
    }
}
