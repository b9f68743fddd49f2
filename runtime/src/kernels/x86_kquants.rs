//! The AVX-512 (F + BW) kernels of [`super::kquants`] (x86-64). Callers check the features
//! ([`super::rows::Path::detect`]) before calling in.

#![allow(
    unsafe_code,
    reason = "SIMD intrinsics need the CPU features checked by the caller, and load from raw pointers"
)]

use std::arch::x86_64::*;

use super::kquants::{KBlock, Q8K, layout};
use super::x86::f16c;

/// A super-block decoded once for every activation row: its 256 quants as unsigned bytes in four
/// registers of 64, the sub-block scale of each pair of quants as i16 (the same four spans),
/// the super-block scale, and per 16 weights the factor of that span's activation sum (the
/// offset or the minimum).
pub(crate) struct Decoded {
    u: [__m512i; 4],
    s: [__m512i; 4],
    d: f32,
    corr: __m512,
}

/// Decodes a super-block.
pub(crate) trait DecodeK {
    /// # Safety
    /// The CPU must have AVX-512 F and BW, and F16C.
    unsafe fn decode(&self) -> Decoded;
}

/// 64 bytes from two halves of 32.
#[target_feature(enable = "avx512f,avx512bw")]
fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// Lane i of register c takes value `c · per + i / (32 / per)`: one scale per span of pairs.
const fn spans(per: usize) -> [[i16; 32]; 4] {
    let mut idx = [[0i16; 32]; 4];
    let mut c = 0;
    while c < 4 {
        let mut i = 0;
        while i < 32 {
            idx[c][i] = (c * per + i / (32 / per)) as i16;
            i += 1;
        }
        c += 1;
    }
    idx
}
/// Q4_K: two sub-blocks of 32 per register; Q6_K: four of 16.
static SPANS_2: [[i16; 32]; 4] = spans(2);
static SPANS_4: [[i16; 32]; 4] = spans(4);

/// The i16 scales `values` spread over the pairs of quants they scale.
#[target_feature(enable = "avx512f,avx512bw")]
fn spread(values: __m512i, idx: &[[i16; 32]; 4]) -> [__m512i; 4] {
    std::array::from_fn(|c| {
        // SAFETY: 64 bytes are read from a 64-byte array.
        let idx = unsafe { _mm512_loadu_si512(idx[c].as_ptr().cast()) };
        _mm512_permutexvar_epi16(idx, values)
    })
}

impl DecodeK for layout::Q4K {
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    unsafe fn decode(&self) -> Decoded {
        let (d, dmin) = (f16c(self.d), f16c(self.dmin));
        // The 6-bit scales and minimums of the 8 sub-blocks unpacked as llama.cpp does: bytes
        // 0..8 of `u` the scales, 8..16 the minimums.
        let word = |i: usize| {
            u32::from_le_bytes([
                self.scales[4 * i],
                self.scales[4 * i + 1],
                self.scales[4 * i + 2],
                self.scales[4 * i + 3],
            ])
        };
        let (w0, w1, w2) = (word(0), word(1), word(2));
        let (six, four, two) = (0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303);
        let packed = [
            w0 & six,
            (w2 & four) | (((w0 >> 6) & two) << 4),
            w1 & six,
            ((w2 >> 4) & four) | (((w1 >> 6) & two) << 4),
        ];
        // SAFETY: 16 bytes are read from a 16-byte array.
        let both = unsafe { _mm_loadu_si128(packed.as_ptr().cast()) };
        let values = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(both));
        // Each minimum twice: it applies to the two activation sums of its 32 weights.
        let mins = _mm_unpackhi_epi8(both, both);
        let corr = _mm512_mul_ps(
            _mm512_set1_ps(-dmin),
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mins)),
        );
        let nibble = _mm256_set1_epi8(0x0f);
        let u = std::array::from_fn(|c| {
            // SAFETY: 32 bytes are read at 32c < 128 − 31 of the 128-byte array.
            let q = unsafe { _mm256_loadu_si256(self.qs.as_ptr().add(32 * c).cast()) };
            join(
                _mm256_and_si256(q, nibble),
                _mm256_and_si256(_mm256_srli_epi16::<4>(q), nibble),
            )
        });
        Decoded {
            u,
            // Sub-block 2c + k (32 weights, 16 pairs) for register c: 2 scales each.
            s: spread(values, &SPANS_2),
            d,
            corr,
        }
    }
}

impl DecodeK for layout::Q6K {
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    unsafe fn decode(&self) -> Decoded {
        let d = f16c(self.d);
        let low = _mm256_set1_epi8(0x0f);
        let mut u = [_mm512_setzero_si512(); 4];
        for n in 0..2 {
            // SAFETY: 32 bytes are read at offsets 64n, 64n + 32 of `ql` (128) and 32n of `qh`
            // (64).
            let (l0, l1, h) = unsafe {
                (
                    _mm256_loadu_si256(self.ql.as_ptr().add(64 * n).cast()),
                    _mm256_loadu_si256(self.ql.as_ptr().add(64 * n + 32).cast()),
                    _mm256_loadu_si256(self.qh.as_ptr().add(32 * n).cast()),
                )
            };
            let bits = |mask: i8| _mm256_and_si256(h, _mm256_set1_epi8(mask));
            // Elements 128n + 32g + l: the low nibble of ql (g = 0, 1) or its high nibble
            // (g = 2, 3), and bits 2g, 2g + 1 of qh as bits 4, 5.
            let g0 = _mm256_or_si256(
                _mm256_and_si256(l0, low),
                _mm256_slli_epi16::<4>(bits(0x03)),
            );
            let g1 = _mm256_or_si256(
                _mm256_and_si256(l1, low),
                _mm256_slli_epi16::<2>(bits(0x0c)),
            );
            let g2 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(l0), low),
                bits(0x30),
            );
            let g3 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(l1), low),
                _mm256_srli_epi16::<2>(bits(-0x40)),
            );
            u[2 * n] = join(g0, g1);
            u[2 * n + 1] = join(g2, g3);
        }
        // SAFETY: 16 bytes are read from the 16-byte scales.
        let scales = unsafe { _mm_loadu_si128(self.scales.as_ptr().cast()) };
        let values = _mm512_cvtepi8_epi16(_mm256_zextsi128_si256(scales));
        let corr = _mm512_mul_ps(
            _mm512_set1_ps(-32.0 * d),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(scales)),
        );
        Decoded {
            u,
            // Sub-block 4c + k (16 weights, 8 pairs) for register c: 4 scales each.
            s: spread(values, &SPANS_4),
            d,
            corr,
        }
    }
}

/// Activation rows sharing one decode of each super-block (their accumulators live in memory).
const SPAN: usize = 16;

/// One (super-block, activation row) step: the products within the super-block as integers,
/// then scaled into `acc`. The same for every row count.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
fn step(dec: &Decoded, xb: &Q8K, acc: __m512) -> __m512 {
    let mut isum = _mm512_setzero_si512();
    for c in 0..4 {
        // SAFETY: 64 bytes are read at 64c of the 256-byte quants.
        let q = unsafe { _mm512_loadu_si512(xb.qs.as_ptr().add(64 * c).cast()) };
        let pairs = _mm512_maddubs_epi16(dec.u[c], q);
        isum = _mm512_add_epi32(isum, _mm512_madd_epi16(pairs, dec.s[c]));
    }
    let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(dec.d * xb.d), acc);
    // SAFETY: 64 bytes are read from the 16 sums.
    let sums = unsafe { _mm512_loadu_ps(xb.bs.as_ptr()) };
    _mm512_fmadd_ps(dec.corr, sums, acc)
}

/// One weight row against one activation row, its accumulator in a register.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn one<B: KBlock>(wrow: &[B], x: &[Q8K]) -> f32 {
    let mut acc = _mm512_setzero_ps();
    for (wb, xb) in wrow.iter().zip(x) {
        // SAFETY: the features are enabled here.
        acc = step(&unsafe { wb.decode() }, xb, acc);
    }
    _mm512_reduce_add_ps(acc)
}

/// One weight row against activation rows `r0..r0 + n` (n ≤ [`SPAN`]): each super-block decoded
/// once for all of them.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn span<B: KBlock>(wrow: &[B], x: &[Q8K], r0: usize, n: usize, out: &mut [f32]) {
    let nb = wrow.len();
    let mut acc = [_mm512_setzero_ps(); SPAN];
    for (b, wb) in wrow.iter().enumerate() {
        // SAFETY: the features are enabled here.
        let dec = unsafe { wb.decode() };
        for (i, a) in acc.iter_mut().enumerate().take(n) {
            *a = step(&dec, &x[(r0 + i) * nb + b], *a);
        }
    }
    for (o, a) in out[r0..r0 + n].iter_mut().zip(&acc) {
        *o = _mm512_reduce_add_ps(*a);
    }
}

/// [`super::kquants`]' kernel: `out` gets `rows` results per weight row.
///
/// # Safety
/// The CPU has AVX-512 F and BW and F16C ([`super::rows::Path::Avx512`]).
pub(crate) unsafe fn matmul<B: KBlock>(w: &[B], x: &[Q8K], rows: usize, out: &mut [f32]) {
    let nb = x.len() / rows;
    for (wrow, out) in w.chunks_exact(nb).zip(out.chunks_exact_mut(rows)) {
        // SAFETY (each call): the caller checked AVX-512 F and BW and F16C (Path::Avx512).
        if rows == 1 {
            out[0] = unsafe { one(wrow, x) };
            continue;
        }
        for r0 in (0..rows).step_by(SPAN) {
            unsafe { span(wrow, x, r0, SPAN.min(rows - r0), out) };
        }
    }
}
