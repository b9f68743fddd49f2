//! The K-quant panels ([`super::kpanels`]) on AVX-512 with VNNI
//! ([`super::rows::Path::Avx512Vnni`]): the AVX2 kernels' layout, tiles and float operations
//! ([`super::x86_kpanels`]), but each sub-block's byte products summed straight into 32 bits by
//! `vpdpbusd` on 256-bit registers (AVX-512 VL), then times the sub-block's scale. The AVX2
//! kernels need two `maddubs`, a 16-bit add and a share of a `madd` for what one `vpdpbusd`
//! does: their verify blocks were bound by those instructions (the Qwen2.5-Coder 1.5B Q4_K_M
//! target on one AVX-512 core: each position past the first 15 ms, against a 39 ms decode
//! step). The integer sums are exact in both (no product or partial sum saturates), so a row's
//! sums are the AVX2 kernels' to the bit, and so is everything after them (the same closing
//! code).

#![allow(
    unsafe_code,
    reason = "SIMD intrinsics need the CPU features checked by the caller, and load from raw pointers"
)]

use std::arch::x86_64::*;

use super::kpanels::{Q4K_BYTES, Q5K_BYTES, Q6K_BYTES, Q8S};
use super::x86::{fifth, group};
use super::x86_kpanels::{high2, k4_close, load, nibbles, prefetch, q6k_close, store, widen};

/// A sub-block's scale per output as 32-bit lanes, from the scales of sub-blocks 2i and 2i + 1
/// widened to 16 bits in pairs (`pairs`): the first (`h` = 0) or the second; `signed`: Q6_K's.
#[target_feature(enable = "avx2")]
fn scale32(pairs: __m256i, h: usize, signed: bool) -> __m256i {
    match (h, signed) {
        (0, false) => _mm256_and_si256(pairs, _mm256_set1_epi32(0xffff)),
        (0, true) => _mm256_srai_epi32::<16>(_mm256_slli_epi32::<16>(pairs)),
        (_, false) => _mm256_srli_epi32::<16>(pairs),
        (_, true) => _mm256_srai_epi32::<16>(pairs),
    }
}

/// The chain the high nibbles' products go to in a tile of `t` rows: few rows, a second one (more
/// products in flight); many, the same as the low ones' (each row a chain of its own already, and
/// a second one per row spilt registers: 8 rows ran a verify of 8 positions 10 % slower).
const fn chain(t: usize) -> usize {
    if t >= 4 { 0 } else { 1 }
}

/// One Q4_K panel (`FIVE`: Q5_K; `w`: `nsb` super-blocks) × activation rows `r0..r0 + T`: `out`
/// (`[row][QLANES]`) gets the sums, [`super::x86_kpanels`]' bits. A row's operations do not
/// depend on `T` or `r0`.
///
/// # Safety
/// AVX2, FMA, F16C and AVX-512 F, VL, BW and VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) unsafe fn k4_tile<const FIVE: bool, const T: usize>(
    w: &[u8],
    nsb: usize,
    x: &[Q8S],
    r0: usize,
    out: &mut [f32],
) {
    let size = if FIVE { Q5K_BYTES } else { Q4K_BYTES };
    let xs: [&[Q8S]; T] = std::array::from_fn(|t| &x[(r0 + t) * nsb..][..nsb]);
    let hi_chain = chain(T);
    let mut acc = [_mm256_setzero_ps(); T];
    for (s, blk) in w.chunks_exact(size).take(nsb).enumerate() {
        let mut sums = [_mm256_setzero_si256(); T];
        for j in 0..8 {
            if r0 == 0 {
                prefetch(blk, size, j);
            }
            let sc = scale32(widen(blk, 32 + 16 * (j / 2), false), j % 2, false);
            let qh = if FIVE {
                load(blk, Q4K_BYTES + 32 * j)
            } else {
                _mm256_setzero_si256()
            };
            let mut dots = [[_mm256_setzero_si256(); 2]; T];
            for jj in 0..4 {
                let (mut lo, mut hi) = nibbles(load(blk, 160 + 128 * j + 32 * jj));
                if FIVE {
                    lo = _mm256_or_si256(lo, fifth(qh, 2 * jj));
                    hi = _mm256_or_si256(hi, fifth(qh, 2 * jj + 1));
                }
                for (dot, xs) in dots.iter_mut().zip(&xs) {
                    let at = 32 * j + 8 * jj;
                    dot[0] = _mm256_dpbusd_epi32(dot[0], lo, group(&xs[s].qs, at));
                    dot[hi_chain] =
                        _mm256_dpbusd_epi32(dot[hi_chain], hi, group(&xs[s].qs, at + 4));
                }
            }
            for (sum, dot) in sums.iter_mut().zip(&dots) {
                let dot = _mm256_add_epi32(dot[0], dot[1]);
                *sum = _mm256_add_epi32(*sum, _mm256_mullo_epi32(dot, sc));
            }
        }
        k4_close(blk, &xs, s, &sums, &mut acc);
    }
    store(&acc, r0, out);
}

/// One Q6_K panel (`w`: `nsb` super-blocks) × activation rows `r0..r0 + T`: `out`
/// (`[row][QLANES]`) gets the sums, [`super::x86_kpanels`]' bits. A row's operations do not
/// depend on `T` or `r0`.
///
/// # Safety
/// AVX2, FMA, F16C and AVX-512 F, VL, BW and VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) unsafe fn q6k_tile<const T: usize>(
    w: &[u8],
    nsb: usize,
    x: &[Q8S],
    r0: usize,
    out: &mut [f32],
) {
    let xs: [&[Q8S]; T] = std::array::from_fn(|t| &x[(r0 + t) * nsb..][..nsb]);
    let hi_chain = chain(T);
    let low = _mm256_set1_epi8(0x0f);
    let mut acc = [_mm256_setzero_ps(); T];
    for (s, blk) in w.chunks_exact(Q6K_BYTES).take(nsb).enumerate() {
        let mut sums = [_mm256_setzero_si256(); T];
        for j in 0..8 {
            if r0 == 0 {
                prefetch(blk, Q6K_BYTES, j);
            }
            let scales = widen(blk, 16 + 16 * j, true);
            for h in 0..2 {
                let sc = scale32(scales, h, true);
                let qh = load(blk, 1168 + 64 * j + 32 * h);
                let mut dots = [[_mm256_setzero_si256(); 2]; T];
                for jj in 2 * h..2 * h + 2 {
                    let raw = load(blk, 144 + 128 * j + 32 * jj);
                    let (g0, g1) = (2 * jj, 2 * jj + 1);
                    let lo = _mm256_or_si256(_mm256_and_si256(raw, low), high2(qh, g0 - 4 * h));
                    let hi = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low),
                        high2(qh, g1 - 4 * h),
                    );
                    for (dot, xs) in dots.iter_mut().zip(&xs) {
                        let g = group(&xs[s].qs, 32 * j + 4 * g0);
                        dot[0] = _mm256_dpbusd_epi32(dot[0], lo, g);
                        let g = group(&xs[s].qs, 32 * j + 4 * g1);
                        dot[hi_chain] = _mm256_dpbusd_epi32(dot[hi_chain], hi, g);
                    }
                }
                for (sum, dot) in sums.iter_mut().zip(&dots) {
                    let dot = _mm256_add_epi32(dot[0], dot[1]);
                    *sum = _mm256_add_epi32(*sum, _mm256_mullo_epi32(dot, sc));
                }
            }
        }
        q6k_close(blk, &xs, s, &sums, &mut acc);
    }
    store(&acc, r0, out);
}
