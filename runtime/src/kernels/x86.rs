//! The AVX2 + FMA + F16C kernels of [`super::rows`] (x86-64). Callers check the features
//! ([`super::rows::Path::detect`]) before calling in.

#![allow(
    unsafe_code,
    reason = "SIMD intrinsics need the CPU features checked by the caller, and load from raw pointers"
)]

use std::arch::x86_64::*;

use super::rows::{Block, Q8, TILE, layout};

/// A weight block decoded to 32 signed bytes (q − offset) in one register.
pub(crate) trait Decode {
    /// # Safety
    /// The CPU must have AVX2.
    unsafe fn decode(&self) -> __m256i;
}

/// Element j < 16 is the low nibble of byte j, element j + 16 its high nibble.
#[target_feature(enable = "avx2")]
unsafe fn nibbles(qs: &[u8; 16]) -> __m256i {
    // SAFETY: 16 bytes are read from a 16-byte array.
    let low = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    let both = _mm256_insertf128_si256::<1>(_mm256_castsi128_si256(low), _mm_srli_epi16(low, 4));
    _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
}

/// 0xff in byte j where bit j of `qh` is set, else 0.
#[target_feature(enable = "avx2")]
fn fifth_bits(qh: [u8; 4]) -> __m256i {
    let word = _mm256_set1_epi32(i32::from_le_bytes(qh));
    // Byte j takes byte j / 8 of the word, then tests its bit j % 8.
    let spread = _mm256_shuffle_epi8(
        word,
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
    _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1))
}

impl Decode for layout::Q4_0 {
    #[target_feature(enable = "avx2")]
    unsafe fn decode(&self) -> __m256i {
        // SAFETY: AVX2 is enabled here.
        _mm256_sub_epi8(unsafe { nibbles(&self.qs) }, _mm256_set1_epi8(8))
    }
}

impl Decode for layout::Q4_1 {
    #[target_feature(enable = "avx2")]
    unsafe fn decode(&self) -> __m256i {
        // SAFETY: AVX2 is enabled here.
        unsafe { nibbles(&self.qs) }
    }
}

impl Decode for layout::Q5_0 {
    #[target_feature(enable = "avx2")]
    unsafe fn decode(&self) -> __m256i {
        // q − 16: where the fifth bit is clear, the byte is the nibble with 0xf0 set.
        let high = _mm256_andnot_si256(fifth_bits(self.qh), _mm256_set1_epi8(-16));
        // SAFETY: AVX2 is enabled here.
        _mm256_or_si256(unsafe { nibbles(&self.qs) }, high)
    }
}

impl Decode for layout::Q5_1 {
    #[target_feature(enable = "avx2")]
    unsafe fn decode(&self) -> __m256i {
        let high = _mm256_and_si256(fifth_bits(self.qh), _mm256_set1_epi8(0x10));
        // SAFETY: AVX2 is enabled here.
        _mm256_or_si256(unsafe { nibbles(&self.qs) }, high)
    }
}

impl Decode for layout::Q8_0 {
    #[target_feature(enable = "avx2")]
    unsafe fn decode(&self) -> __m256i {
        // SAFETY: 32 bytes are read from a 32-byte array.
        unsafe { _mm256_loadu_si256(self.qs.as_ptr().cast()) }
    }
}

#[target_feature(enable = "f16c")]
pub(crate) fn f16c(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

#[target_feature(enable = "avx2,fma")]
fn hsum(x: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// `W` weight rows against activation rows `r0..r0 + T`: W · T accumulators, each weight block
/// decoded once (several weight rows at once keep several loads in flight). The operations for
/// one (weight row, activation row) pair do not depend on `W`, `T` or `r0`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn blocks_tile<B: Block, const W: usize, const T: usize>(
    wrows: &[B],
    x: &[Q8],
    rows: usize,
    r0: usize,
    out: &mut [f32],
) {
    let nb = wrows.len() / W;
    let ws: [&[B]; W] = std::array::from_fn(|j| &wrows[j * nb..][..nb]);
    let xs: [&[Q8]; T] = std::array::from_fn(|i| &x[(r0 + i) * nb..][..nb]);
    let (mut acc, mut macc) = ([[_mm256_setzero_ps(); T]; W], [[0f32; T]; W]);
    let ones = _mm256_set1_epi16(1);
    for b in 0..nb {
        for j in 0..W {
            let wb = &ws[j][b];
            // SAFETY: AVX2 is enabled here.
            let q = unsafe { wb.decode() };
            let aq = _mm256_sign_epi8(q, q);
            let (d, m) = (f16c(wb.d()), f16c(wb.m()));
            for i in 0..T {
                let xb = &xs[i][b];
                // SAFETY: 32 bytes are read from a 32-byte array.
                let y = unsafe { _mm256_loadu_si256(xb.qs.as_ptr().cast()) };
                // |q| · (y with q's sign): u8 × i8 pairs, then pairs of i16 to i32.
                let dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(y, q)), ones);
                acc[j][i] =
                    _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), _mm256_cvtepi32_ps(dot), acc[j][i]);
                if B::MIN {
                    macc[j][i] += m * xb.s;
                }
            }
        }
    }
    for j in 0..W {
        for i in 0..T {
            out[j * rows + r0 + i] = hsum(acc[j][i]) + macc[j][i];
        }
    }
}

/// Weight rows `wrows` (`W` of them) against every activation row, in tiles of [`TILE`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn blocks_group<B: Block, const W: usize>(
    wrows: &[B],
    x: &[Q8],
    rows: usize,
    out: &mut [f32],
) {
    let mut r0 = 0;
    // SAFETY (each call): the features are enabled here.
    while rows - r0 >= TILE {
        unsafe { blocks_tile::<B, W, TILE>(wrows, x, rows, r0, out) };
        r0 += TILE;
    }
    match rows - r0 {
        3 => unsafe { blocks_tile::<B, W, 3>(wrows, x, rows, r0, out) },
        2 => unsafe { blocks_tile::<B, W, 2>(wrows, x, rows, r0, out) },
        1 => unsafe { blocks_tile::<B, W, 1>(wrows, x, rows, r0, out) },
        _ => {}
    }
}

/// Weight rows taken together by the block kernel.
const GROUP: usize = 4;

/// [`super::rows`]'s block kernel: `out` gets `rows` results per weight row.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C ([`super::rows::Path::Avx2`]).
pub(crate) unsafe fn blocks<B: Block>(w: &[B], x: &[Q8], rows: usize, out: &mut [f32]) {
    let nb = x.len() / rows;
    let groups = w.chunks_exact(nb * GROUP);
    let rest = groups.remainder();
    let mut outs = out.chunks_exact_mut(rows * GROUP);
    // SAFETY (each call): the caller checked AVX2, FMA and F16C (Path::Avx2).
    for (wrows, out) in groups.zip(&mut outs) {
        unsafe { blocks_group::<B, GROUP>(wrows, x, rows, out) };
    }
    let out = outs.into_remainder();
    for (wrow, out) in rest.chunks_exact(nb).zip(out.chunks_exact_mut(rows)) {
        unsafe { blocks_group::<B, 1>(wrow, x, rows, out) };
    }
}

/// One dense weight row against activation rows `r0..r0 + T`, two accumulators per row.
#[target_feature(enable = "avx2,fma")]
unsafe fn dense_tile<const T: usize>(wrow: &[f32], x: &[f32], r0: usize, out: &mut [f32]) {
    let k = wrow.len();
    let xs: [&[f32]; T] = std::array::from_fn(|i| &x[(r0 + i) * k..][..k]);
    let (mut a0, mut a1) = ([_mm256_setzero_ps(); T], [_mm256_setzero_ps(); T]);
    let body = k / 16 * 16;
    let mut j = 0;
    while j < body {
        // SAFETY: j + 16 <= k for the weight row and every activation row.
        unsafe {
            let w0 = _mm256_loadu_ps(wrow.as_ptr().add(j));
            let w1 = _mm256_loadu_ps(wrow.as_ptr().add(j + 8));
            for i in 0..T {
                let p = xs[i].as_ptr().add(j);
                a0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(p), a0[i]);
                a1[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(p.add(8)), a1[i]);
            }
        }
        j += 16;
    }
    for i in 0..T {
        let tail: f32 = wrow[body..]
            .iter()
            .zip(&xs[i][body..])
            .map(|(a, b)| a * b)
            .sum();
        out[r0 + i] = hsum(_mm256_add_ps(a0[i], a1[i])) + tail;
    }
}

/// [`super::rows`]'s dense kernel: `out` gets `rows` results per weight row.
///
/// # Safety
/// The CPU has AVX2 and FMA ([`super::rows::Path::Avx2`]).
pub(crate) unsafe fn dense(w: &[f32], x: &[f32], rows: usize, out: &mut [f32]) {
    let k = x.len() / rows;
    for (wrow, out) in w.chunks_exact(k).zip(out.chunks_exact_mut(rows)) {
        let mut r0 = 0;
        // SAFETY (each call): the caller checked AVX2 and FMA (Path::Avx2).
        while rows - r0 >= TILE {
            unsafe { dense_tile::<TILE>(wrow, x, r0, out) };
            r0 += TILE;
        }
        match rows - r0 {
            3 => unsafe { dense_tile::<3>(wrow, x, r0, out) },
            2 => unsafe { dense_tile::<2>(wrow, x, r0, out) },
            1 => unsafe { dense_tile::<1>(wrow, x, r0, out) },
            _ => {}
        }
    }
}
