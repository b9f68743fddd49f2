//! Q8_0 weights on AVX-512 with VNNI ([`super::rows::Path::Avx512Vnni`]): panels of
//! [`VLANES`] outputs, one 512-bit register of 32-bit sums, multiplied by `vpdpbusd` (64 byte
//! products summed into 16 lanes by one instruction). The AVX2 panels ([`super::x86_panels`])
//! need four instructions (sign, abs, `maddubs`, `madd`) and an add for a quarter of that;
//! candle's repacked Q8_0 kernel, which Q8_0 ran on before on these CPUs, took 68 % of a
//! 110M-shape Q8_0 model's decode step.
//!
//! `vpdpbusd` multiplies unsigned bytes by signed ones: the weights are stored as q + 128
//! (unsigned), and each block's sum starts from −128 · Σ(activation quants), computed once per
//! activation block ([`Q8::bias`]). The integer sums are exact, so the result is the AVX2 panels'
//! to the bit: the same sum per block and row, then the same float operations (one conversion,
//! the two scales' product, one fused multiply-add, in block order).

#![allow(
    unsafe_code,
    reason = "SIMD intrinsics need the CPU features checked by the caller, and load from raw pointers"
)]

use std::arch::x86_64::*;
use std::ops::Range;

use super::rows::{Q8, QK, layout};

/// Outputs per panel: one register of 16 32-bit sums.
pub(crate) const VLANES: usize = 16;

/// Bytes of one block of a panel: the [`VLANES`] outputs' f16 scales, then their quants
/// ([`write_block`]).
pub(crate) const BLOCK_BYTES: usize = 2 * VLANES + VLANES * QK;

/// Activation rows in a tile of one panel: a float accumulator and an integer sum per row, with
/// the weights' register and a broadcast, in 32 registers.
const MAX_ROWS: usize = 8;

/// Blocks ahead of the one a tile reads that its first rows ask the memory for.
const BLOCKS_AHEAD: usize = 4;

/// Writes one block of a panel's outputs (`None`: padding, a zero scale): the scales, then
/// "group" g for g in 0..8 as 64 bytes, byte i holding output i / 4's input 4g + i % 4 as
/// q + 128 (the layout of a register `vpdpbusd` multiplies by four broadcast activations).
pub(crate) fn write_block(blocks: &[Option<&layout::Q8_0>; VLANES], dst: &mut [u8]) {
    let (head, quants) = dst.split_at_mut(2 * VLANES);
    for (i, blk) in blocks.iter().enumerate() {
        let d = blk.map_or(0, |blk| blk.d);
        head[2 * i..][..2].copy_from_slice(&d.to_le_bytes());
    }
    for (g, group) in quants.chunks_exact_mut(4 * VLANES).enumerate() {
        for (i, byte) in group.iter_mut().enumerate() {
            let q = blocks[i / 4].map_or(0, |blk| blk.qs[4 * g + i % 4]);
            *byte = (i16::from(q) + 128) as u8;
        }
    }
}

/// Four activation quants `qs[4g..4g + 4]` in every 32-bit lane (one broadcast load).
#[target_feature(enable = "avx512f")]
fn group(qs: &[i8; QK], g: usize) -> __m512i {
    let q = &qs[4 * g..][..4];
    // SAFETY: four bytes in bounds, read unaligned.
    _mm512_set1_epi32(unsafe { q.as_ptr().cast::<i32>().read_unaligned() })
}

/// One 32-bit value in every lane (one broadcast load).
#[target_feature(enable = "avx512f")]
fn splat(v: &i32) -> __m512i {
    _mm512_set1_epi32(*v)
}

/// `P` panels (`w`: theirs `nb` blocks each) × activation rows `r0..r0 + T` (`x`: `nb` blocks
/// per row): `out` (`[panel][row][VLANES]`, `rows` rows) gets the sums. A row's operations do
/// not depend on `P`, `T` or `r0`.
///
/// # Safety
/// AVX-512 F, BW and VNNI, F16C; `w` holds `P` panels, `x` rows `r0..r0 + T`, `out` `P`
/// panels of `rows` rows (the callers' asserts).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn tile<const P: usize, const T: usize>(
    w: &[u8],
    nb: usize,
    x: &[Q8],
    (rows, r0): (usize, usize),
    out: &mut [f32],
) {
    let xs: [&[Q8]; T] = std::array::from_fn(|t| &x[(r0 + t) * nb..][..nb]);
    // Few rows: each sum in two chains (even and odd groups), more multiplies in flight.
    let chains = if P * T <= 4 { 2 } else { 1 };
    let mut acc = [[_mm512_setzero_ps(); T]; P];
    let prefetch = r0 == 0 && BLOCKS_AHEAD > 0;
    for b in 0..nb {
        for (p, acc) in acc.iter_mut().enumerate() {
            let blk = &w[(p * nb + b) * BLOCK_BYTES..][..BLOCK_BYTES];
            if prefetch {
                let ahead = blk.as_ptr().wrapping_add(BLOCKS_AHEAD * BLOCK_BYTES);
                super::x86::prefetch(ahead, 0..BLOCK_BYTES);
            }
            // SAFETY (the loads): within the block's bytes.
            let d = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(blk.as_ptr().cast()) });
            let q = &blk[2 * VLANES..];
            // The stored q + 128: each sum starts from −128 · Σ activation quants.
            let mut sums: [[__m512i; 2]; T] =
                std::array::from_fn(|t| [splat(&xs[t][b].bias), _mm512_setzero_si512()]);
            for g in 0..8 {
                let wq = unsafe { _mm512_loadu_si512(q[64 * g..][..64].as_ptr().cast()) };
                for (sum, xs) in sums.iter_mut().zip(&xs) {
                    let s = &mut sum[g % chains];
                    *s = _mm512_dpbusd_epi32(*s, wq, group(&xs[b].qs, g));
                }
            }
            for ((a, sum), xs) in acc.iter_mut().zip(&sums).zip(&xs) {
                let sum = if chains == 2 {
                    _mm512_add_epi32(sum[0], sum[1])
                } else {
                    sum[0]
                };
                let scale = _mm512_mul_ps(d, _mm512_set1_ps(xs[b].d));
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, *a);
            }
        }
    }
    for (p, acc) in acc.iter().enumerate() {
        for (t, a) in acc.iter().enumerate() {
            let o = &mut out[(p * rows + r0 + t) * VLANES..][..VLANES];
            // SAFETY: VLANES values are written to a slice of VLANES.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), *a) };
        }
    }
}

/// Panels `panels` of `w` (Q8_0 in panels of [`VLANES`]: [`write_block`]) against `rows`
/// activation rows `x` (`nb` quantized blocks each): `out` gets `[panel][row][VLANES]` for those
/// panels.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI and F16C ([`super::rows::Path::Avx512Vnni`]).
pub(crate) unsafe fn q8_0(
    w: &[u8],
    nb: usize,
    panels: Range<usize>,
    x: &[Q8],
    rows: usize,
    out: &mut [f32],
) {
    let per_panel = nb * BLOCK_BYTES;
    assert!(panels.end * per_panel <= w.len(), "panels past the weight");
    assert!(x.len() >= rows * nb, "fewer activations than rows");
    assert!(out.len() >= panels.len() * rows * VLANES, "a short output");
    let w = &w[panels.start * per_panel..panels.end * per_panel];
    let mut p = 0;
    // SAFETY (each call): the caller checked the features; the panels, the rows and their
    // outputs are in bounds (above).
    while p < panels.len() {
        let (wp, op) = (&w[p * per_panel..], &mut out[p * rows * VLANES..]);
        // One row: four panels at a time, four streams of weights in flight (1536 → 60000
        // from DRAM: 2.76 ms against 3.31 for one panel and 3.11–3.24 for two).
        if rows == 1 && panels.len() - p >= 4 {
            unsafe { tile::<4, 1>(wp, nb, x, (1, 0), op) };
            p += 4;
            continue;
        }
        let mut r0 = 0;
        while r0 < rows {
            let t = MAX_ROWS.min(rows - r0);
            let at = (rows, r0);
            unsafe {
                match t {
                    1 => tile::<1, 1>(wp, nb, x, at, op),
                    2 => tile::<1, 2>(wp, nb, x, at, op),
                    3 => tile::<1, 3>(wp, nb, x, at, op),
                    4 => tile::<1, 4>(wp, nb, x, at, op),
                    5 => tile::<1, 5>(wp, nb, x, at, op),
                    6 => tile::<1, 6>(wp, nb, x, at, op),
                    7 => tile::<1, 7>(wp, nb, x, at, op),
                    _ => tile::<1, MAX_ROWS>(wp, nb, x, at, op),
                }
            }
            r0 += t;
        }
        p += 1;
    }
}
