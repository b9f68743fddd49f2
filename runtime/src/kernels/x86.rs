//! Helpers the x86-64 kernels share. Callers check the features
//! ([`super::rows::Path::detect`]) before calling in.

#![allow(
    unsafe_code,
    reason = "SIMD intrinsics need the CPU features checked by the caller, and load from raw pointers"
)]

use std::arch::x86_64::*;
use std::ops::Range;

use super::rows::Q8;

/// Four signed bytes `qs[at..at + 4]` (a group of a panel's inputs) in every 32-bit lane.
#[target_feature(enable = "avx2")]
pub(crate) fn group(qs: &[i8], at: usize) -> __m256i {
    let q = &qs[at..][..4];
    _mm256_set1_epi32(i32::from_le_bytes([
        q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8,
    ]))
}

/// Asks the memory for the cache lines of bytes `span` past `at`: a hint, never a fault, wherever
/// it points.
pub(crate) fn prefetch(at: *const u8, span: std::ops::Range<usize>) {
    for line in span.step_by(64) {
        // SAFETY: a prefetch reads nothing and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(line).cast()) };
    }
}

/// 16 in each byte whose bit `g` of `qh` is set, else 0.
#[target_feature(enable = "avx2")]
pub(crate) fn fifth(qh: __m256i, g: usize) -> __m256i {
    // Bit g to bit 4 (a 16-bit shift moves no other byte's bit to a bit 4: see the mask).
    let moved = if g <= 4 {
        _mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - g as i32))
    } else {
        _mm256_srl_epi16(qh, _mm_cvtsi32_si128(g as i32 - 4))
    };
    _mm256_and_si256(moved, _mm256_set1_epi8(0x10))
}

/// [`super::rows::quantize_bytes`] eight lanes at a time, for `xs` a multiple of 32 long: the
/// same scale and, for finite inputs, the same bytes (`roundf`'s halves away from zero, made of
/// a truncation and the fraction it left).
#[target_feature(enable = "avx2")]
pub(crate) fn quantize_bytes(xs: &[f32], qs: &mut [i8]) -> f32 {
    assert!(
        xs.len().is_multiple_of(32) && qs.len() >= xs.len(),
        "whole groups of 32"
    );
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_setzero_ps();
    for c in xs.chunks_exact(8) {
        // SAFETY: eight floats in bounds.
        let v = unsafe { _mm256_loadu_ps(c.as_ptr()) };
        // A NaN input is passed over (the second operand is kept), as `f32::max` does.
        m = _mm256_max_ps(_mm256_andnot_ps(sign, v), m);
    }
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    if id.is_infinite() {
        // A subnormal scale: values scale to infinities and NaNs, whose conversions differ.
        return super::rows::portable_quantize_bytes(xs, qs);
    }
    let id = _mm256_set1_ps(id);
    let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    let round = |at: &[f32]| {
        // SAFETY: eight floats in bounds.
        let v = _mm256_mul_ps(unsafe { _mm256_loadu_ps(at.as_ptr()) }, id);
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
        // |v − t| ≥ ½ (exact: t is v's leading bits) steps one away from zero.
        let away = _mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_andnot_ps(sign, _mm256_sub_ps(v, t)), half);
        let step = _mm256_and_ps(away, _mm256_or_ps(_mm256_and_ps(v, sign), one));
        _mm256_cvttps_epi32(_mm256_add_ps(t, step))
    };
    // packs interleaves the 128-bit halves: the permutation puts the bytes back in order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (c, q) in xs.chunks_exact(32).zip(qs.chunks_exact_mut(32)) {
        let lo = _mm256_packs_epi32(round(&c[..8]), round(&c[8..16]));
        let hi = _mm256_packs_epi32(round(&c[16..24]), round(&c[24..]));
        let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi), order);
        // SAFETY: 32 bytes in bounds.
        unsafe { _mm256_storeu_si256(q.as_mut_ptr().cast(), bytes) };
    }
    d
}

/// Runs a dense kernel's tiles over panels `panels` of `w` (`[panel][input][lanes]`, `k` inputs)
/// against `rows` activation rows `x` (rows × k): for each panel (two at a time where `rows` ≤
/// `two_panel_rows`, then every row in one tile, streamed by the hardware prefetcher; else
/// `wide_panels` at a time), each chunk of `chunk` inputs and each tile of rows (at most
/// `max_rows`, asking for the next chunk ahead), `tile(n, t, w, x, (rows, r0), (inputs, ahead),
/// out)`: n panels × rows r0..r0 + t, `w` and `out` at the tile's first panel (`out`:
/// `[panel][row][lanes]` for `panels`), `x` at the first row.
///
/// # Safety
/// `tile` may dereference its pointers for n panels of `k` inputs, the `rows` rows of `x` and
/// their outputs: `w` holds `panels`, `x` the rows and `out` their outputs (asserted here).
pub(crate) unsafe fn dense_tiles<E>(
    (w, k, lanes): (&[E], usize, usize),
    panels: Range<usize>,
    x: &[f32],
    (rows, max_rows, two_panel_rows, wide_panels, chunk): (usize, usize, usize, usize, usize),
    out: &mut [f32],
    tile: impl Fn(usize, usize, *const E, *const f32, (usize, usize), (Range<usize>, usize), *mut f32),
) {
    let per_panel = k * lanes;
    assert!(panels.end * per_panel <= w.len(), "panels past the weight");
    assert!(x.len() >= rows * k, "fewer activations than rows");
    assert!(out.len() >= panels.len() * rows * lanes, "a short output");
    let x = x.as_ptr();
    let two = rows <= two_panel_rows;
    let mut p = 0;
    while p < panels.len() {
        let n = (if two { 2 } else { wide_panels }).min(panels.len() - p);
        let wp = w[(panels.start + p) * per_panel..].as_ptr();
        let op = out[p * rows * lanes..].as_mut_ptr();
        for k0 in (0..k).step_by(chunk) {
            let ks = k0..(k0 + chunk).min(k);
            let mut r0 = 0;
            while r0 < rows {
                let (t, ahead) = if two {
                    (rows, 0)
                } else {
                    (max_rows.min(rows - r0), chunk)
                };
                tile(n, t, wp, x, (rows, r0), (ks.clone(), ahead), op);
                r0 += t;
            }
        }
        p += n;
    }
}

/// Bytes of the weight [`decode_streams`] reads: more than the caches of the CPUs this runs on
/// hold (a Zen 4 EPYC's L3: 32 MB a CCD).
const CALIBRATION_BYTES: usize = 64 << 20;

/// The panels a block kernel's one-row tile takes at a time on this CPU: `many` (as many streams
/// of weights in flight) or one, whichever read a weight larger than the caches faster, each
/// timed three times, alternated: `kernel(panels at a time, weight, blocks per panel, panels,
/// one activation row, out)`, `(per_block, lanes)` the bytes of a panel's block and its outputs.
/// CPUs differ: on a Sapphire Rapids VM four streams read a Q8_0 product 1536 → 60000 in 2.76 ms
/// against 3.31 for one; on a Zen 4 EPYC one stream read the Qwen2.5-Coder 0.5B draft's decode
/// step in 17 ms, against 26 for four (VNNI) and 32 for two (AVX2).
pub(crate) fn decode_streams(
    many: usize,
    (per_block, lanes): (usize, usize),
    kernel: impl Fn(usize, &[u8], usize, Range<usize>, &[Q8], &mut [f32]),
) -> usize {
    // 896 inputs, as a 0.5B draft's products (their short panels part the choices most: one
    // Q8_0 896 → 151936 product read 5.1 ms one panel at a time, 8.6 four at a time on a Zen 4,
    // 1536 → 60000 3.4 and 4.5); bytes that are not a zero page.
    const NB: usize = 28;
    let w: Vec<u8> = (0..CALIBRATION_BYTES)
        .map(|i| (i ^ (i >> 12)) as u8)
        .collect();
    let panels = w.len() / (NB * per_block);
    let x = vec![Q8::default(); NB];
    let mut out = vec![0f32; panels * lanes];
    let mut best = [std::time::Duration::MAX; 2];
    for _ in 0..3 {
        for (n, best) in [1, many].into_iter().zip(&mut best) {
            let start = std::time::Instant::now();
            kernel(n, &w, NB, 0..panels, &x, &mut out);
            *best = (*best).min(start.elapsed());
        }
    }
    let chosen = if best[1] < best[0] { many } else { 1 };
    tracing::debug!(many, ?best, chosen, "panels a one-row tile reads at a time");
    chosen
}

/// `rows` split into tiles of at most `max` rows, as even as can be (sizes one apart at most),
/// as (first row, rows): a tile decodes its weights once for all its rows, so a last tile of one
/// row after full ones cost nearly a decode step of its own (the Qwen2.5-Coder 1.5B Q4_K_M
/// target on one AVX-512 core: 4 positions 66 ms, 5 positions 99 ms as tiles of 4 and 1).
pub(crate) fn tiles(rows: usize, max: usize) -> impl Iterator<Item = (usize, usize)> {
    let n = rows.div_ceil(max.max(1)).max(1);
    let (base, extra) = (rows / n, rows % n);
    (0..n)
        .map(move |i| (i * base + i.min(extra), base + usize::from(i < extra)))
        .filter(|&(_, t)| t > 0)
}

/// Runs a block kernel's tiles over panels `panels` of `w` (`per_panel` bytes each) against
/// `rows` activation rows `x` (`per_row` elements each): one row `decode_panels` panels at a time
/// (as many streams of weights in flight), more a panel at a time in tiles of at most
/// `max_rows` rows ([`tiles`]): `tile(n, t, w, x, (rows, r0), out)`, n panels × rows r0..r0 + t, `w` and
/// `out` at the tile's first panel (`out`: `[panel][row][lanes]` for `panels`).
///
/// # Safety
/// `tile`'s kernel may read n panels of `w`, the `rows` rows of `x`, and write their rows of
/// `out` (the slices it is handed hold them: asserted here).
pub(crate) unsafe fn block_tiles<X>(
    (w, per_panel, lanes): (&[u8], usize, usize),
    panels: Range<usize>,
    (x, per_row): (&[X], usize),
    (rows, decode_panels, max_rows): (usize, usize, usize),
    out: &mut [f32],
    tile: impl Fn(usize, usize, &[u8], &[X], (usize, usize), &mut [f32]),
) {
    assert!(panels.end * per_panel <= w.len(), "panels past the weight");
    assert!(x.len() >= rows * per_row, "fewer activations than rows");
    assert!(out.len() >= panels.len() * rows * lanes, "a short output");
    let w = &w[panels.start * per_panel..panels.end * per_panel];
    let mut p = 0;
    while p < panels.len() {
        let (wp, op) = (&w[p * per_panel..], &mut out[p * rows * lanes..]);
        if rows == 1 && panels.len() - p >= decode_panels {
            tile(decode_panels, 1, wp, x, (1, 0), op);
            p += decode_panels;
            continue;
        }
        for (r0, t) in tiles(rows, max_rows) {
            tile(1, t, wp, x, (rows, r0), &mut *op);
        }
        p += 1;
    }
}
