//! The attention of one row's group of query heads sharing a kv head ([`super::attention`]) on
//! AVX2 + FMA with every sum in registers: each key's score a dot product in 16 lanes (two 8-lane
//! registers) reduced by shuffles, the weighted sum of the values kept in registers 64 columns
//! at a time; keys and values in tiles that every head of the group reads while the tile is in
//! the L1 cache. The portable row (`attend::<true>`) compiled for these features summed its lanes
//! through the stack, stored each output column after every key, and read the keys and values
//! once per head: a step of the 0.5B draft at 700 positions took 25 ms against 18 at 64, the
//! target's verify of 4 positions at 1,500 positions 2.3 times one at 64. Each output's
//! operations and their order are the portable row's, so its bits are the same.

#![allow(
    unsafe_code,
    reason = "SIMD intrinsics need the CPU features checked by the caller, and load from raw pointers"
)]

use std::arch::x86_64::*;

use super::attention::{QRows, Rows, exp_scores};

/// Keys whose scores are computed together (their chains of multiply-adds overlap).
const KEYS: usize = 4;
/// Value columns summed in registers at once (eight 8-lane registers).
const COLUMNS: usize = 64;
/// Keys (or values) in a tile: 32 of 128 columns are 16 KB, half of Zen 4's L1 data cache.
const TILE: usize = 32;
/// The most heads of a group.
const MAX_GROUP: usize = 32;

/// Whether [`attend`] runs rows of head size `d` in groups of `group` heads: `d` a positive
/// multiple of 16, the lanes of a score.
pub(super) fn fits(d: usize, group: usize) -> bool {
    d > 0 && d.is_multiple_of(16) && (1..=MAX_GROUP).contains(&group)
}

/// `out` (the group's rows of `d`, zeroed) = softmax(q · kᵀ · scale) · v over `rows` for each
/// query row of `q`: per head the operations of the portable row, in its order.
///
/// # Safety
/// The CPU has AVX2 and FMA; `d` = `rows.d` = `q.d` and `out.len() / d` [`fits`]; `q` holds that
/// many rows; each piece's keys and values hold the same whole number of rows of `d`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn attend(q: QRows, rows: Rows, scores: &mut Vec<f32>, out: &mut [f32]) {
    let Rows { pieces, d, scale } = rows;
    let group = out.len() / d;
    let keys: usize = pieces.iter().map(|(k, _)| k.len() / d).sum();
    scores.clear();
    scores.resize(group * keys, 0.0);
    let mut at = 0;
    for tile in pieces.iter().flat_map(|(k, _)| k.chunks(TILE * d)) {
        let n = tile.len() / d;
        for g in 0..group {
            let q_row = q.row(g).as_ptr();
            let row_scores = &mut scores[g * keys + at..][..n];
            let mut quads = tile.chunks_exact(KEYS * d);
            let mut j = 0;
            for quad in &mut quads {
                // SAFETY: `quad` holds KEYS keys of `d`, `q_row` d values (the caller's).
                let s = unsafe { key_scores::<KEYS>(q_row, quad.as_ptr(), d, scale) };
                row_scores[j..j + KEYS].copy_from_slice(&s);
                j += KEYS;
            }
            for key in quads.remainder().chunks_exact(d) {
                // SAFETY: as above, one key.
                row_scores[j] = unsafe { key_scores::<1>(q_row, key.as_ptr(), d, scale) }[0];
                j += 1;
            }
        }
        at += n;
    }
    let mut inverse = [0f32; MAX_GROUP];
    for (row_scores, inverse) in scores.chunks_exact_mut(keys.max(1)).zip(&mut inverse) {
        *inverse = 1.0 / exp_scores(row_scores);
    }
    let mut at = 0;
    for tile in pieces.iter().flat_map(|(_, v)| v.chunks(TILE * d)) {
        let n = tile.len() / d;
        for (g, out_row) in out.chunks_exact_mut(d).enumerate() {
            let weights = &scores[g * keys + at..][..n];
            let mut c = 0;
            while c + COLUMNS <= d {
                // SAFETY: columns c..c + 64 of `out_row` and of each value row (c + 64 ≤ d).
                unsafe { values::<{ COLUMNS / 8 }>(weights, tile, d, c, out_row.as_mut_ptr()) };
                c += COLUMNS;
            }
            while c < d {
                // SAFETY: columns c..c + 8 (d a multiple of 16).
                unsafe { values::<1>(weights, tile, d, c, out_row.as_mut_ptr()) };
                c += 8;
            }
        }
        at += n;
    }
    for (out_row, inverse) in out.chunks_exact_mut(d).zip(inverse) {
        out_row.iter_mut().for_each(|o| *o *= inverse);
    }
}

/// The scores of `G` consecutive keys at `keys` (G · d values): per key 16 lanes of fused
/// multiply-adds over the columns in order, from zero, the lanes summed pairwise (8, 4, 2, 1
/// apart), then scaled.
///
/// # Safety
/// `q` holds `d` values and `keys` G · d, `d` a multiple of 16; the CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn key_scores<const G: usize>(
    q: *const f32,
    keys: *const f32,
    d: usize,
    scale: f32,
) -> [f32; G] {
    let mut low = [_mm256_setzero_ps(); G];
    let mut high = [_mm256_setzero_ps(); G];
    for c in (0..d).step_by(16) {
        // SAFETY (every load): within `q` and `keys` (the caller's bounds).
        let (q_low, q_high) = unsafe { (_mm256_loadu_ps(q.add(c)), _mm256_loadu_ps(q.add(c + 8))) };
        for j in 0..G {
            let key = unsafe { keys.add(j * d + c) };
            low[j] = _mm256_fmadd_ps(q_low, unsafe { _mm256_loadu_ps(key) }, low[j]);
            high[j] = _mm256_fmadd_ps(q_high, unsafe { _mm256_loadu_ps(key.add(8)) }, high[j]);
        }
    }
    std::array::from_fn(|j| {
        let eight = _mm256_add_ps(low[j], high[j]);
        let four = _mm_add_ps(
            _mm256_castps256_ps128(eight),
            _mm256_extractf128_ps::<1>(eight),
        );
        let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
        let one = _mm_add_ss(two, _mm_shuffle_ps::<1>(two, two));
        // The portable row adds the columns past the last 16 (none here) after the lanes.
        let tail = 0f32;
        (_mm_cvtss_f32(one) + tail) * scale
    })
}

/// Adds Σ w · value over the value rows of `tile` (each `d`) to columns `c..c + 8R` of `out`,
/// row by row in order, in `R` registers.
///
/// # Safety
/// Columns `c..c + 8R` lie within `d`, the row of `out` and each of `tile`'s; the CPU has AVX2
/// and FMA.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn values<const R: usize>(weights: &[f32], tile: &[f32], d: usize, c: usize, out: *mut f32) {
    // SAFETY (every load and the stores): within `out` and the value rows (the caller's).
    let mut acc: [__m256; R] =
        std::array::from_fn(|r| unsafe { _mm256_loadu_ps(out.add(c + 8 * r)) });
    for (w, value) in weights.iter().zip(tile.chunks_exact(d)) {
        let w = _mm256_set1_ps(*w);
        let value = value.as_ptr();
        for (r, acc) in acc.iter_mut().enumerate() {
            *acc = _mm256_fmadd_ps(w, unsafe { _mm256_loadu_ps(value.add(c + 8 * r)) }, *acc);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        unsafe { _mm256_storeu_ps(out.add(c + 8 * r), *acc) };
    }
}
