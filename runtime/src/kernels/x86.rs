//! Helpers the x86-64 kernels share. Callers check the features
//! ([`super::rows::Path::detect`]) before calling in.

#![allow(
    unsafe_code,
    reason = "SIMD intrinsics need the CPU features checked by the caller, and load from raw pointers"
)]

use std::arch::x86_64::*;

#[target_feature(enable = "f16c")]
pub(crate) fn f16c(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

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
