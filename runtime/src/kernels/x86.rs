//! Helpers the x86-64 kernels share. Callers check the features
//! ([`super::rows::Path::detect`]) before calling in.

#![allow(
    unsafe_code,
    reason = "SIMD intrinsics need the CPU features checked by the caller, and load from raw pointers"
)]

use std::arch::x86_64::*;

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
