//! The AVX-512 (F, BW, VNNI) kernel of [`super::rows`] for the blocks of 32: two blocks per
//! 64-byte register. Weights are decoded to unsigned bytes (q + offset); `vpdpbusd` sums their
//! products with the activations in 32-bit lanes (no saturation, no sign tricks), and the offset
//! or the minimum is folded in through the activations' block sums. Callers check the features
//! ([`super::rows::Path::detect`]) and an even block count per row.

#![allow(
    unsafe_code,
    reason = "SIMD intrinsics need the CPU features checked by the caller, and load from raw pointers"
)]

use std::arch::x86_64::*;

use super::rows::{Block, QK, TILE, layout};
use super::x86::f16c;

/// 64 activations (two blocks) quantized to signed bytes, their groups of 4 interleaved (group
/// k of the register from block k mod 2, so that 32-bit lane k sums block k mod 2), with each
/// block's scale and its sum (scale · Σq) / 8 (each block spans 8 lanes).
#[derive(Debug, Clone, Copy)]
#[repr(C, align(16))]
pub(crate) struct Q8Pair {
    qs: [i8; 2 * QK],
    d: [f32; 2],
    s: [f32; 2],
}

impl Default for Q8Pair {
    fn default() -> Self {
        Self {
            qs: [0; 2 * QK],
            d: [0.0; 2],
            s: [0.0; 2],
        }
    }
}

/// Quantizes a row (a multiple of 64 long) as [`super::rows::quantize`] does, in pairs.
pub(crate) fn quantize(x: &[f32], out: &mut [Q8Pair]) {
    let mut blocks = [super::rows::Q8::default(); 2];
    for (xs, p) in x.chunks_exact(2 * QK).zip(out.iter_mut()) {
        super::rows::quantize(xs, &mut blocks);
        for (k, group) in p.qs.chunks_exact_mut(4).enumerate() {
            group.copy_from_slice(&blocks[k % 2].qs[4 * (k / 2)..][..4]);
        }
        p.d = [blocks[0].d, blocks[1].d];
        p.s = [blocks[0].s / 8.0, blocks[1].s / 8.0];
    }
}

/// Two weight blocks decoded to 64 unsigned bytes: the stored quants (Q8_0's plus 128).
pub(crate) trait DecodePair {
    /// # Safety
    /// The CPU must have AVX-512 F and BW.
    unsafe fn decode_pair(a: &Self, b: &Self) -> __m512i;
}

/// Blocks a (`lo`) and b (`hi`), their groups of 4 bytes interleaved as [`Q8Pair`]'s.
#[target_feature(enable = "avx512f,avx512bw")]
fn join(lo: __m256i, hi: __m256i) -> __m512i {
    let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
    let idx = _mm512_set_epi32(15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
    _mm512_permutexvar_epi32(idx, both)
}

/// Element j < 16 the low nibble of byte j, element j + 16 its high nibble, of one block.
#[target_feature(enable = "avx512f,avx512bw")]
fn nibbles(qs: &[u8; 16]) -> __m256i {
    // SAFETY: 16 bytes are read from a 16-byte array.
    let q = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    let both = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(q), _mm_srli_epi16::<4>(q));
    _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
}

/// Adds 16 to element j of a block where bit j of its `qh` is set.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn fifth_bits(q: __m256i, qh: [u8; 4]) -> __m256i {
    _mm256_mask_add_epi8(q, u32::from_le_bytes(qh), q, _mm256_set1_epi8(16))
}

impl DecodePair for layout::Q4_0 {
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn decode_pair(a: &Self, b: &Self) -> __m512i {
        join(nibbles(&a.qs), nibbles(&b.qs))
    }
}

impl DecodePair for layout::Q4_1 {
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn decode_pair(a: &Self, b: &Self) -> __m512i {
        join(nibbles(&a.qs), nibbles(&b.qs))
    }
}

impl DecodePair for layout::Q5_0 {
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn decode_pair(a: &Self, b: &Self) -> __m512i {
        join(
            fifth_bits(nibbles(&a.qs), a.qh),
            fifth_bits(nibbles(&b.qs), b.qh),
        )
    }
}

impl DecodePair for layout::Q5_1 {
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn decode_pair(a: &Self, b: &Self) -> __m512i {
        join(
            fifth_bits(nibbles(&a.qs), a.qh),
            fifth_bits(nibbles(&b.qs), b.qh),
        )
    }
}

impl DecodePair for layout::Q8_0 {
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn decode_pair(a: &Self, b: &Self) -> __m512i {
        // SAFETY: 32 bytes are read from 32-byte arrays.
        let (a, b) = unsafe {
            (
                _mm256_loadu_si256(a.qs.as_ptr().cast()),
                _mm256_loadu_si256(b.qs.as_ptr().cast()),
            )
        };
        // q + 128: the sign bit flipped.
        _mm512_xor_si512(join(a, b), _mm512_set1_epi8(-128))
    }
}

/// Two f32 values in alternate lanes.
#[target_feature(enable = "avx512f,avx512dq")]
fn alternate(a: f32, b: f32) -> __m512 {
    _mm512_broadcast_f32x2(_mm_set_ps(0.0, 0.0, b, a))
}

/// Two f32 values read from memory, in alternate lanes.
#[target_feature(enable = "avx512f,avx512dq")]
fn alternate_at(v: &[f32; 2]) -> __m512 {
    // SAFETY: 8 bytes are read from an 8-byte array.
    _mm512_broadcast_f32x2(unsafe { _mm_castpd_ps(_mm_load_sd(v.as_ptr().cast())) })
}

/// One weight row against activation rows `r0..r0 + T`. A row's operations do not depend on
/// `T` or `r0`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,f16c")]
unsafe fn tile<B: Block, const T: usize>(wrow: &[B], x: &[Q8Pair], r0: usize, out: &mut [f32]) {
    let np = wrow.len() / 2;
    let xs: [&[Q8Pair]; T] = std::array::from_fn(|i| &x[(r0 + i) * np..][..np]);
    let mut acc = [_mm512_setzero_ps(); T];
    // What the decoded (unsigned) quants carry: the stored offset, or 128 for Q8_0's signs.
    let offset = if B::BITS == 8 {
        128.0
    } else {
        f32::from(B::OFFSET)
    };
    for (p, w) in wrow.chunks_exact(2).enumerate() {
        let (a, b) = (&w[0], &w[1]);
        // SAFETY: the features are enabled here.
        let u = unsafe { B::decode_pair(a, b) };
        let (da, db) = (f16c(a.d()), f16c(b.d()));
        let scale = alternate(da, db);
        // The offset's share, and the minimum where there is one, per unit of activation sum.
        let corr = alternate(f16c(a.m()) - offset * da, f16c(b.m()) - offset * db);
        for i in 0..T {
            let xp = &xs[i][p];
            // SAFETY: 64 bytes are read from the 64-byte quants.
            let q = unsafe { _mm512_loadu_si512(xp.qs.as_ptr().cast()) };
            let (d, s) = (alternate_at(&xp.d), alternate_at(&xp.s));
            let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, q);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, d), acc[i]);
            acc[i] = _mm512_fmadd_ps(corr, s, acc[i]);
        }
    }
    for i in 0..T {
        out[r0 + i] = _mm512_reduce_add_ps(acc[i]);
    }
}

/// The kernel: `out` gets `rows` results per weight row.
///
/// # Safety
/// The CPU has AVX-512 F, BW, DQ, VL and VNNI and F16C ([`super::rows::Path::Avx512`]).
pub(crate) unsafe fn blocks<B: Block>(w: &[B], x: &[Q8Pair], rows: usize, out: &mut [f32]) {
    let nb = 2 * (x.len() / rows);
    for (wrow, out) in w.chunks_exact(nb).zip(out.chunks_exact_mut(rows)) {
        let mut r0 = 0;
        // SAFETY (each call): the caller checked AVX-512 F, BW, VNNI, DQ and F16C.
        while rows - r0 >= TILE {
            unsafe { tile::<B, TILE>(wrow, x, r0, out) };
            r0 += TILE;
        }
        match rows - r0 {
            3 => unsafe { tile::<B, 3>(wrow, x, r0, out) },
            2 => unsafe { tile::<B, 2>(wrow, x, r0, out) },
            1 => unsafe { tile::<B, 1>(wrow, x, r0, out) },
            _ => {}
        }
    }
}
