//! Dense weights (f32, f16, bf16) on AVX-512 ([`super::rows::Path::Avx512`]): the AVX2
//! panels' tiles ([`super::x86_panels`]) with one 16-lane register per panel and row instead of
//! two 8-lane ones: half the multiply-add instructions for the same lanes, and twice the rows a
//! tile keeps in registers (measured, one run alternated: a 1536 → 8960 f32 product of 9 rows
//! 2.7-2.9 against 3.2-3.6 ms on the AVX2 tiles, the 110M-shape f32 model's 40-position forward
//! 68-69 against 75 ms). Each lane's operations (one fused multiply-add per input, in input
//! order, from zero) are the AVX2 tile's, so each output's bits are theirs.

#![allow(
    unsafe_code,
    reason = "SIMD intrinsics need the CPU features checked by the caller, and load from raw pointers"
)]

use std::arch::x86_64::*;
use std::ops::Range;

use super::panels::LANES;
use super::x86_panels::{Bf16, F16, F32, Lanes};

/// Activation rows in a tile: one accumulator per panel and row, two panels' weights and a
/// broadcast fit the 32 registers of AVX-512.
const MAX_ROWS: usize = 12;
/// Up to this many rows, tiles of two panels and every row (more chains in flight for a decode
/// step); past it, tiles of two panels × up to [`MAX_ROWS`] rows: one broadcast per two
/// multiply-adds where one panel's tiles took one per multiply-add (the 110M-shape f32 model's
/// 40-position forward 47-51 against 55-60 ms, three runs alternated; 12 → 24 accumulators).
const TWO_PANEL_ROWS: usize = 6;
/// Inputs per chunk, as the AVX2 tiles' ([`super::x86_panels`]).
const CHUNK: usize = 64;

/// A dense panel's 16 lanes of one input, widened to f32.
pub(crate) trait Wide: Lanes {
    /// Sixteen elements from `p`, as f32.
    ///
    /// # Safety
    /// Sixteen elements are readable at `p`; the CPU has AVX-512 F (inlined into the tiles,
    /// which enable it).
    unsafe fn load16(p: *const Self::Elem) -> __m512;
}

impl Wide for F32 {
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        // SAFETY: the caller's.
        unsafe { _mm512_loadu_ps(p) }
    }
}

impl Wide for F16 {
    #[inline(always)]
    unsafe fn load16(p: *const super::panels::Half) -> __m512 {
        // SAFETY: the caller's (32 bytes).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
}

impl Wide for Bf16 {
    #[inline(always)]
    unsafe fn load16(p: *const super::panels::Half) -> __m512 {
        // SAFETY: the caller's (32 bytes): each value to the upper half of an f32.
        unsafe {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p.cast()),
            )))
        }
    }
}

/// `P` panels (`w`: `[panel][input][lane]`, `k` inputs each) × activation rows `r0..r0 + T` over
/// inputs `ks`, added to what `out` (`[panel][row][lane]`, `rows` rows) holds, or to zero for
/// the first chunk. A lane's operations do not depend on `P`, `T`, `r0` or the chunks.
///
/// # Safety
/// AVX-512 F; `w` holds `P` panels of `k` inputs, `x` `rows` rows of `k`, `out` `P` panels of
/// `rows` rows, `ks` ⊆ 0..k, `r0 + T` ≤ `rows` (the caller checks).
#[target_feature(enable = "avx512f")]
unsafe fn tile<L: Wide, const P: usize, const T: usize>(
    w: *const L::Elem,
    k: usize,
    x: *const f32,
    (rows, r0): (usize, usize),
    ks: Range<usize>,
    ahead: usize,
    out: *mut f32,
) {
    let at = |p: usize, t: usize| (p * rows + r0 + t) * LANES;
    let mut acc = [[_mm512_setzero_ps(); T]; P];
    if ks.start > 0 {
        for (p, acc) in acc.iter_mut().enumerate() {
            for (t, a) in acc.iter_mut().enumerate() {
                // SAFETY: in `out` (the caller's bounds).
                *a = unsafe { _mm512_loadu_ps(out.add(at(p, t))) };
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
        let wv: [__m512; P] =
            std::array::from_fn(|p| unsafe { L::load16(w.add((p * k + i) * LANES)) });
        #[allow(
            clippy::needless_range_loop,
            reason = "one broadcast per row, used by every panel: acc is indexed [panel][row]"
        )]
        for t in 0..T {
            let xb = _mm512_set1_ps(unsafe { *x.add((r0 + t) * k + i) });
            for p in 0..P {
                acc[p][t] = _mm512_fmadd_ps(wv[p], xb, acc[p][t]);
            }
        }
    }
    for (p, acc) in acc.iter().enumerate() {
        for (t, a) in acc.iter().enumerate() {
            // SAFETY: in `out` (the caller's bounds).
            unsafe { _mm512_storeu_ps(out.add(at(p, t)), *a) };
        }
    }
}

/// `tile::<L, P, T>` for a `T` known only at run time: 1..=[`MAX_ROWS`] rows of one or two
/// panels.
///
/// # Safety
/// As [`tile`]'s.
#[target_feature(enable = "avx512f")]
unsafe fn tiles<L: Wide, const P: usize>(
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
        match t {
            1 => tile::<L, P, 1>(w, k, x, at, ks, ahead, out),
            2 => tile::<L, P, 2>(w, k, x, at, ks, ahead, out),
            3 => tile::<L, P, 3>(w, k, x, at, ks, ahead, out),
            4 => tile::<L, P, 4>(w, k, x, at, ks, ahead, out),
            5 => tile::<L, P, 5>(w, k, x, at, ks, ahead, out),
            6 => tile::<L, P, 6>(w, k, x, at, ks, ahead, out),
            7 => tile::<L, P, 7>(w, k, x, at, ks, ahead, out),
            8 => tile::<L, P, 8>(w, k, x, at, ks, ahead, out),
            9 => tile::<L, P, 9>(w, k, x, at, ks, ahead, out),
            10 => tile::<L, P, 10>(w, k, x, at, ks, ahead, out),
            11 => tile::<L, P, 11>(w, k, x, at, ks, ahead, out),
            12 => tile::<L, P, 12>(w, k, x, at, ks, ahead, out),
            _ => unreachable!("{t} rows in a tile of {P} panels"),
        }
    }
}

/// Panels `panels` of `w` (`[panel][input][lane]`, `k` inputs) against `rows` activation rows
/// `x` (rows × k): `out` gets `[panel][row][lane]` for those panels, tiled as the AVX2 kernel
/// tiles ([`super::x86::dense_tiles`]) with twice its rows, two panels a tile.
///
/// # Safety
/// The CPU has AVX-512 F ([`super::rows::Path::Avx512`]).
pub(crate) unsafe fn dense<L: Wide>(
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
            (rows, MAX_ROWS, TWO_PANEL_ROWS, 2, CHUNK),
            out,
            |n, t, wp, x, at, chunk, op| {
                if n == 2 {
                    tiles::<L, 2>(t, wp, k, x, at, chunk, op);
                } else {
                    tiles::<L, 1>(t, wp, k, x, at, chunk, op);
                }
            },
        )
    }
}
