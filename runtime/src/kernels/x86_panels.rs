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

use super::panels::LANES;

/// Activation rows in a tile of one panel: two registers per row (16 lanes), `2 · MAX_ROWS`
/// accumulators, the panel's weights and a broadcast fit in the 16 registers of AVX2.
const MAX_ROWS: usize = 6;
/// Up to this many rows, tiles of two panels (more chains in flight for a decode step).
const TWO_PANEL_ROWS: usize = 3;
/// Inputs per chunk: a panel over a chunk (512 · 64 bytes) stays in L1/L2 while the tiles of
/// more than [`MAX_ROWS`] rows read it again.
const CHUNK: usize = 512;

/// Inputs ahead that the first tile of a chunk asks the memory for (one cache line of a panel
/// per input): the hardware prefetcher alone leaves a compute-bound tile waiting on DRAM.
const AHEAD: usize = 128;

/// `P` panels (`w`: `[panel][input][lane]`, `k` inputs each) × activation rows `r0..r0 + T` over
/// inputs `ks`, added to what `out` (`[panel][row][lane]`, `rows` rows) holds, or to zero for
/// the first chunk. A lane's operations (one fused multiply-add per input, in input order) do not
/// depend on `P`, `T`, `r0` or the chunks.
///
/// # Safety
/// AVX2 and FMA; `w` holds `P` panels of `k` inputs, `x` `rows` rows of `k`, `out` `P` panels of
/// `rows` rows, `ks` ⊆ 0..k, `r0 + T` ≤ `rows` (the caller checks).
#[target_feature(enable = "avx2,fma")]
unsafe fn dense_tile<const P: usize, const T: usize>(
    w: *const f32,
    k: usize,
    x: *const f32,
    (rows, r0): (usize, usize),
    ks: Range<usize>,
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
    let prefetch = r0 == 0 && T >= 4;
    for i in ks {
        if prefetch {
            for p in 0..P {
                // A hint, never a fault, wherever it points.
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((p * k + i + AHEAD) * LANES).cast());
            }
        }
        // SAFETY (the loads): in `w` and `x` (the caller's bounds).
        let wv: [[__m256; 2]; P] = std::array::from_fn(|p| {
            std::array::from_fn(|h| unsafe { _mm256_loadu_ps(w.add((p * k + i) * LANES + 8 * h)) })
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

/// `dense_tile::<P, T>` for a `T` known only at run time (1..=[`MAX_ROWS`]).
macro_rules! by_rows {
    ($f:ident::<$p:literal>($t:expr)($($arg:expr),*)) => {
        match $t {
            1 => $f::<$p, 1>($($arg),*),
            2 => $f::<$p, 2>($($arg),*),
            3 => $f::<$p, 3>($($arg),*),
            4 => $f::<$p, 4>($($arg),*),
            5 => $f::<$p, 5>($($arg),*),
            6 => $f::<$p, 6>($($arg),*),
            t => unreachable!("{t} rows in a tile"),
        }
    };
}

/// Panels `panels` of `w` (`[panel][input][lane]`, `k` inputs) against `rows` activation rows
/// `x` (rows × k): `out` gets `[panel][row][lane]` for those panels.
///
/// # Safety
/// The CPU has AVX2 and FMA ([`super::rows::Path::Avx2`]).
pub(crate) unsafe fn dense(
    w: &[f32],
    k: usize,
    panels: Range<usize>,
    x: &[f32],
    rows: usize,
    out: &mut [f32],
) {
    let per_panel = k * LANES;
    assert!(panels.end * per_panel <= w.len(), "panels past the weight");
    assert!(x.len() >= rows * k, "fewer activations than rows");
    assert!(out.len() >= panels.len() * rows * LANES, "a short output");
    let two = rows <= TWO_PANEL_ROWS;
    let mut p = 0;
    while p < panels.len() {
        let n = if two { 2.min(panels.len() - p) } else { 1 };
        let wp = w[(panels.start + p) * per_panel..].as_ptr();
        let op = out[p * rows * LANES..].as_mut_ptr();
        for k0 in (0..k).step_by(CHUNK) {
            let ks = k0..(k0 + CHUNK).min(k);
            let mut r0 = 0;
            while r0 < rows {
                let t = if two { rows } else { MAX_ROWS.min(rows - r0) };
                let args = (rows, r0);
                // SAFETY: n panels from panels.start + p are in `w` and their rows in `out`,
                // r0 + t ≤ rows (asserted and computed above); the caller checked AVX2 and FMA.
                unsafe {
                    if n == 2 {
                        by_rows!(dense_tile::<2>(t)(wp, k, x.as_ptr(), args, ks.clone(), op));
                    } else {
                        by_rows!(dense_tile::<1>(t)(wp, k, x.as_ptr(), args, ks.clone(), op));
                    }
                }
                r0 += t;
            }
        }
        p += n;
    }
}
