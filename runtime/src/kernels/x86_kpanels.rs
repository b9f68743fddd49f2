//! The AVX2 kernels over Q4_K, Q5_K and Q6_K weights in panels ([`super::kpanels`]): per
//! super-block and activation row, integer sums of the 8 outputs (u8 × i8 pair products summed
//! in 16 bits within what cannot saturate, then scaled by each sub-block's scale in one `madd`),
//! converted to float once. Callers check the features ([`super::rows::Path::Avx2`]).

#![allow(
    unsafe_code,
    reason = "SIMD intrinsics need the CPU features checked by the caller, and load from raw pointers"
)]

use std::arch::x86_64::*;
use std::ops::Range;

use candle_core::quantized::GgmlDType;

use super::kpanels::{Q4K_BYTES, Q5K_BYTES, Q6K_BYTES, Q8S};
use super::panels::QLANES;
use super::x86::{fifth, group};

/// Activation rows in a tile at most (16 registers: each row holds three).
const ROWS: usize = 4;
/// Activation rows in a VNNI tile at most (32 registers).
const VNNI_ROWS: usize = 8;

/// 32 bytes of `b` at `at`.
#[target_feature(enable = "avx2")]
pub(super) fn load(b: &[u8], at: usize) -> __m256i {
    // SAFETY: 32 bytes are read from a slice of 32.
    unsafe { _mm256_loadu_si256(b[at..][..32].as_ptr().cast()) }
}

/// 16 bytes of `b` at `at`, each widened to 16 bits (`signed`: as i8, else as u8).
#[target_feature(enable = "avx2")]
pub(super) fn widen(b: &[u8], at: usize, signed: bool) -> __m256i {
    // SAFETY: 16 bytes are read from a slice of 16.
    let v = unsafe { _mm_loadu_si128(b[at..][..16].as_ptr().cast()) };
    if signed {
        _mm256_cvtepi8_epi16(v)
    } else {
        _mm256_cvtepu8_epi16(v)
    }
}

/// 8 f16 values of `b` at `at`, as f32.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn halves(b: &[u8], at: usize) -> __m256 {
    // SAFETY: 16 bytes are read from a slice of 16.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(b[at..][..16].as_ptr().cast()) })
}

/// Two i16 values (`v[at]`, `v[at + 1]`) in every 32-bit lane.
#[target_feature(enable = "avx2")]
pub(super) fn pair(v: &[i16], at: usize) -> __m256i {
    let lo = v[at] as u16 as u32;
    _mm256_set1_epi32((lo | ((v[at + 1] as u16 as u32) << 16)) as i32)
}

/// Pairs (a, b) of i16 per 32-bit lane → (a, a) (`h` = 0) or (b, b) (`h` = 1).
#[target_feature(enable = "avx2")]
pub(super) fn dup(v: __m256i, h: usize) -> __m256i {
    if h == 0 {
        _mm256_blend_epi16::<0b1010_1010>(v, _mm256_slli_epi32::<16>(v))
    } else {
        _mm256_blend_epi16::<0b1010_1010>(_mm256_srli_epi32::<16>(v), v)
    }
}

/// Bits 2f..2f + 2 of each byte of `qh`, moved to bits 4..6.
#[target_feature(enable = "avx2")]
pub(super) fn high2(qh: __m256i, f: usize) -> __m256i {
    let moved = match f {
        0 => _mm256_slli_epi16::<4>(qh),
        1 => _mm256_slli_epi16::<2>(qh),
        2 => qh,
        _ => _mm256_srli_epi16::<2>(qh),
    };
    _mm256_and_si256(moved, _mm256_set1_epi8(0x30))
}

/// Super-blocks ahead of the one a tile reads that its first rows ask the memory for.
const AHEAD: usize = 2;

/// Asks the memory for part `j` of 8 of the super-block [`AHEAD`] past `blk` (`size` bytes):
/// spread over the super-block's sub-blocks, the requests overlap its arithmetic.
#[target_feature(enable = "avx2")]
pub(super) fn prefetch(blk: &[u8], size: usize, j: usize) {
    let ahead = blk.as_ptr().wrapping_add(AHEAD * size);
    super::x86::prefetch(ahead, j * size / 8..(j + 1) * size / 8);
}

/// Low and high nibbles of a register of packed quants.
#[target_feature(enable = "avx2")]
pub(super) fn nibbles(raw: __m256i) -> (__m256i, __m256i) {
    let low = _mm256_set1_epi8(0x0f);
    (
        _mm256_and_si256(raw, low),
        _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low),
    )
}

/// One Q4_K panel (`FIVE`: Q5_K; `w`: `nsb` super-blocks) × activation rows `r0..r0 + T`: `out`
/// (`[row][QLANES]`, `rows` rows) gets the sums. A row's operations do not depend on `T` or `r0`.
///
/// # Safety
/// AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_tile<const FIVE: bool, const T: usize>(
    w: &[u8],
    nsb: usize,
    x: &[Q8S],
    r0: usize,
    out: &mut [f32],
) {
    let size = if FIVE { Q5K_BYTES } else { Q4K_BYTES };
    let xs: [&[Q8S]; T] = std::array::from_fn(|t| &x[(r0 + t) * nsb..][..nsb]);
    let mut acc = [_mm256_setzero_ps(); T];
    for (s, blk) in w.chunks_exact(size).take(nsb).enumerate() {
        let mut sums = [_mm256_setzero_si256(); T];
        for j in 0..8 {
            if r0 == 0 {
                prefetch(blk, size, j);
            }
            let sc = dup(widen(blk, 32 + 16 * (j / 2), false), j % 2);
            let qh = if FIVE {
                load(blk, Q4K_BYTES + 32 * j)
            } else {
                _mm256_setzero_si256()
            };
            // Pair products of 4-bit quants: 8 of them stay below 2^15; of 5-bit quants, 4.
            let mut s16 = [_mm256_setzero_si256(); T];
            for jj in 0..4 {
                let (mut lo, mut hi) = nibbles(load(blk, 160 + 128 * j + 32 * jj));
                if FIVE {
                    lo = _mm256_or_si256(lo, fifth(qh, 2 * jj));
                    hi = _mm256_or_si256(hi, fifth(qh, 2 * jj + 1));
                    if jj == 2 {
                        for (sum, s16) in sums.iter_mut().zip(&mut s16) {
                            *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(*s16, sc));
                            *s16 = _mm256_setzero_si256();
                        }
                    }
                }
                for (acc, xs) in s16.iter_mut().zip(&xs) {
                    let p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, group(&xs[s].qs, 32 * j + 8 * jj)),
                        _mm256_maddubs_epi16(hi, group(&xs[s].qs, 32 * j + 8 * jj + 4)),
                    );
                    *acc = _mm256_add_epi16(*acc, p);
                }
            }
            for (sum, s16) in sums.iter_mut().zip(&s16) {
                *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(*s16, sc));
            }
        }
        k4_close(blk, &xs, s, &sums, &mut acc);
    }
    store(&acc, r0, out);
}

/// Closes a Q4_K or Q5_K super-block `blk` (the `s`-th) of the rows `xs`, whose integer sums
/// (each sub-block's products times its scale) are `sums`: `acc` gets `d · dx · sum − dmin · dx
/// · Σ minimum · the activations' sum per 32`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn k4_close<const T: usize>(
    blk: &[u8],
    xs: &[&[Q8S]; T],
    s: usize,
    sums: &[__m256i; T],
    acc: &mut [__m256; T],
) {
    let (d, dmin) = (halves(blk, 0), halves(blk, 16));
    let mut mins = [_mm256_setzero_si256(); T];
    for i in 0..4 {
        let m = widen(blk, 96 + 16 * i, false);
        for (acc, xs) in mins.iter_mut().zip(xs) {
            *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(m, pair(&xs[s].s32, 2 * i)));
        }
    }
    for (((a, sum), min), xs) in acc.iter_mut().zip(sums).zip(&mins).zip(xs) {
        let dx = _mm256_set1_ps(xs[s].d);
        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(*sum), _mm256_mul_ps(d, dx), *a);
        *a = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(*min), _mm256_mul_ps(dmin, dx), *a);
    }
}

/// Writes rows `r0..r0 + T`' sums `acc` to `out` (`[row][QLANES]`).
#[target_feature(enable = "avx2")]
pub(super) fn store<const T: usize>(acc: &[__m256; T], r0: usize, out: &mut [f32]) {
    for (t, a) in acc.iter().enumerate() {
        let o = &mut out[(r0 + t) * QLANES..][..QLANES];
        // SAFETY: QLANES values are written to a slice of QLANES.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), *a) };
    }
}

/// One Q6_K panel (`w`: `nsb` super-blocks) × activation rows `r0..r0 + T`: `out`
/// (`[row][QLANES]`, `rows` rows) gets the sums. A row's operations do not depend on `T` or `r0`.
///
/// # Safety
/// AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_tile<const T: usize>(w: &[u8], nsb: usize, x: &[Q8S], r0: usize, out: &mut [f32]) {
    let xs: [&[Q8S]; T] = std::array::from_fn(|t| &x[(r0 + t) * nsb..][..nsb]);
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
                let sc = dup(scales, h);
                let qh = load(blk, 1168 + 64 * j + 32 * h);
                for jj in 2 * h..2 * h + 2 {
                    let raw = load(blk, 144 + 128 * j + 32 * jj);
                    let (g0, g1) = (2 * jj, 2 * jj + 1);
                    let lo = _mm256_or_si256(_mm256_and_si256(raw, low), high2(qh, g0 - 4 * h));
                    let hi = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low),
                        high2(qh, g1 - 4 * h),
                    );
                    // Pair products of 6-bit quants: two of them stay below 2^15.
                    for (sum, xs) in sums.iter_mut().zip(&xs) {
                        let p = _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo, group(&xs[s].qs, 32 * j + 4 * g0)),
                            _mm256_maddubs_epi16(hi, group(&xs[s].qs, 32 * j + 4 * g1)),
                        );
                        *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(p, sc));
                    }
                }
            }
        }
        q6k_close(blk, &xs, s, &sums, &mut acc);
    }
    store(&acc, r0, out);
}

/// Closes a Q6_K super-block `blk` (the `s`-th) of the rows `xs`, whose integer sums (each
/// sub-block's products of the stored quants times its scale) are `sums`: the offset 32 taken
/// through the activations' sums per 16, `acc` gets `d · dx · total`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q6k_close<const T: usize>(
    blk: &[u8],
    xs: &[&[Q8S]; T],
    s: usize,
    sums: &[__m256i; T],
    acc: &mut [__m256; T],
) {
    let d = halves(blk, 0);
    // The offset 32: Σ over sub-blocks of scale · 32 · the activations' sum.
    let mut offs = [_mm256_setzero_si256(); T];
    for i in 0..8 {
        let sc = widen(blk, 16 + 16 * i, true);
        for (acc, xs) in offs.iter_mut().zip(xs) {
            *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(sc, pair(&xs[s].s16, 2 * i)));
        }
    }
    for (((a, sum), off), xs) in acc.iter_mut().zip(sums).zip(&offs).zip(xs) {
        let total = _mm256_sub_epi32(*sum, _mm256_slli_epi32::<5>(*off));
        let scale = _mm256_mul_ps(d, _mm256_set1_ps(xs[s].d));
        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), scale, *a);
    }
}

/// Panels `panels` of `w` (Q4_K, Q5_K or Q6_K as `dtype` says, in panels of `nsb`
/// super-blocks) against `rows` activation rows `x` (`nsb` quantized super-blocks each): `out`
/// gets `[panel][row][QLANES]` for those panels; by `vpdpbusd` where `vnni`
/// ([`super::x86_kvnni`]), the same bits.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C ([`super::rows::Path::Avx2`]); where `vnni`, AVX-512 F, VL,
/// BW and VNNI too ([`super::rows::Path::Avx512Vnni`]).
pub(crate) unsafe fn matmul(
    (dtype, vnni): (GgmlDType, bool),
    w: &[u8],
    nsb: usize,
    panels: Range<usize>,
    x: &[Q8S],
    rows: usize,
    out: &mut [f32],
) {
    let per_panel = nsb
        * match dtype {
            GgmlDType::Q4K => Q4K_BYTES,
            GgmlDType::Q5K => Q5K_BYTES,
            _ => Q6K_BYTES,
        };
    assert!(panels.end * per_panel <= w.len(), "panels past the weight");
    assert!(x.len() >= rows * nsb, "fewer activations than rows");
    assert!(out.len() >= panels.len() * rows * QLANES, "a short output");
    let w = &w[panels.start * per_panel..panels.end * per_panel];
    for (wp, op) in w
        .chunks_exact(per_panel)
        .zip(out.chunks_exact_mut(rows * QLANES))
    {
        for (r0, t) in super::x86::tiles(rows, if vnni { VNNI_ROWS } else { ROWS }) {
            use super::{x86_kpanels as avx2, x86_kvnni as vnni512};
            macro_rules! tile {
                ($kernels:ident, $t:literal) => {
                    match dtype {
                        GgmlDType::Q4K => $kernels::k4_tile::<false, $t>(wp, nsb, x, r0, op),
                        GgmlDType::Q5K => $kernels::k4_tile::<true, $t>(wp, nsb, x, r0, op),
                        _ => $kernels::q6k_tile::<$t>(wp, nsb, x, r0, op),
                    }
                };
            }
            // SAFETY: the caller checked AVX2, FMA and F16C, and the VNNI path's features
            // where `vnni`; the panel, the rows and their outputs are in bounds (above).
            unsafe {
                match (vnni, t) {
                    (false, 1) => tile!(avx2, 1),
                    (false, 2) => tile!(avx2, 2),
                    (false, 3) => tile!(avx2, 3),
                    (false, _) => tile!(avx2, 4),
                    (true, 1) => tile!(vnni512, 1),
                    (true, 2) => tile!(vnni512, 2),
                    (true, 3) => tile!(vnni512, 3),
                    (true, 4) => tile!(vnni512, 4),
                    (true, 5) => tile!(vnni512, 5),
                    (true, 6) => tile!(vnni512, 6),
                    (true, 7) => tile!(vnni512, 7),
                    (true, _) => tile!(vnni512, 8),
                }
            }
        }
    }
}
