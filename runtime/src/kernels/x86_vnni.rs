//! Weights in blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) on AVX-512 with VNNI
//! ([`super::rows::Path::Avx512Vnni`]): panels of [`VLANES`] outputs, one 512-bit register of
//! 32-bit sums, multiplied by `vpdpbusd` (64 byte products summed into 16 lanes by one
//! instruction). The AVX2 panels ([`super::x86_panels`]) need `maddubs`, `madd` and adds (and
//! for 8 bits the signs taken apart) for a quarter of that: their one-row products were bound
//! by the instructions (a 1536 → 60000 Q4_0 product read its weights at 23 GB/s, against
//! 32-35 for Q8_0 here); candle's repacked Q8_0 kernel, which Q8_0 ran on before on these CPUs,
//! took 68 % of a 110M-shape Q8_0 model's decode step.
//!
//! `vpdpbusd` multiplies unsigned bytes by signed ones: the stored quants below 8 bits are
//! unsigned already (the offset is left to the scale, as on AVX2); Q8_0's are stored as q + 128,
//! and each block's sum starts from −128 · Σ(activation quants), computed once per activation
//! block ([`Q8::bias`]). The integer sums are exact, so the result is the AVX2 panels' to the
//! bit: the same sum per block and row, then the same float operations (one conversion, the two
//! scales' product, one fused multiply-add, and the offset's or minimum's through the
//! activations' block sum, in block order).

#![allow(
    unsafe_code,
    reason = "SIMD intrinsics need the CPU features checked by the caller, and load from raw pointers"
)]

use std::arch::x86_64::*;
use std::ops::Range;

use super::panels::{VLANES, panel_bytes};
use super::rows::{Block, Q8, QK};

/// Activation rows in a tile of one panel: a float accumulator and two integer sums per row,
/// with the weights' registers and a broadcast, in 32 registers.
const MAX_ROWS: usize = 8;

/// Blocks ahead of the one a tile reads that its first rows ask the memory for.
const BLOCKS_AHEAD: usize = 4;

/// Panels a one-row tile may read at a time (as many streams of weights in flight), where this
/// CPU reads that faster than one (`super::panels::decode_panels`).
pub(crate) const DECODE_PANELS: usize = 4;

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

/// 16 in each byte whose bit `g` of `qh` is set, else 0 (the fifth bits of a group).
#[target_feature(enable = "avx512f,avx512bw")]
fn fifth(qh: __m512i, g: usize) -> __m512i {
    // Bit g to bit 4 (a 16-bit shift moves no other byte's bit to a bit 4: see the mask).
    let moved = if g <= 4 {
        _mm512_sll_epi16(qh, _mm_cvtsi32_si128(4 - g as i32))
    } else {
        _mm512_srl_epi16(qh, _mm_cvtsi32_si128(g as i32 - 4))
    };
    _mm512_and_si512(moved, _mm512_set1_epi8(0x10))
}

/// `P` panels (`w`: theirs `nb` blocks each) × activation rows `r0..r0 + T` (`x`: `nb` blocks
/// per row): `out` (`[panel][row][VLANES]`, `rows` rows) gets the sums. A row's operations do
/// not depend on `P`, `T` or `r0`.
///
/// # Safety
/// AVX-512 F, BW and VNNI, F16C; `w` holds `P` panels, `x` rows `r0..r0 + T`, `out` `P`
/// panels of `rows` rows (the callers' asserts).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn tile<B: Block, const P: usize, const T: usize>(
    w: &[u8],
    nb: usize,
    x: &[Q8],
    (rows, r0): (usize, usize),
    out: &mut [f32],
) {
    let size = panel_bytes::<B, VLANES>();
    let head = 2 * VLANES * (1 + B::MIN as usize);
    let xs: [&[Q8]; T] = std::array::from_fn(|t| &x[(r0 + t) * nb..][..nb]);
    // Few rows: each sum in two chains (even and odd groups), more multiplies in flight.
    let chains = if P * T <= 4 { 2 } else { 1 };
    let low = _mm512_set1_epi8(0x0f);
    let off = _mm512_set1_ps(-f32::from(B::OFFSET));
    let mut acc = [[_mm512_setzero_ps(); T]; P];
    let prefetch = r0 == 0;
    for b in 0..nb {
        for (p, acc) in acc.iter_mut().enumerate() {
            let blk = &w[(p * nb + b) * size..][..size];
            if prefetch {
                super::x86::prefetch(blk.as_ptr().wrapping_add(BLOCKS_AHEAD * size), 0..size);
            }
            // SAFETY (the loads): within the block's bytes.
            let d = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(blk.as_ptr().cast()) });
            // The offset's and the minimum's share per unit of activation sum: m − offset · d.
            let corr = if B::MIN {
                let m = blk[2 * VLANES..].as_ptr().cast();
                _mm512_fmadd_ps(off, d, _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(m) }))
            } else {
                _mm512_mul_ps(off, d)
            };
            let q = &blk[head..];
            let load = |i: usize| unsafe { _mm512_loadu_si512(q[64 * i..][..64].as_ptr().cast()) };
            // Q8_0's stored q + 128: its sums start from −128 · Σ activation quants.
            let mut sums: [[__m512i; 2]; T] = std::array::from_fn(|t| {
                let start = if B::BITS == 8 {
                    splat(&xs[t][b].bias)
                } else {
                    _mm512_setzero_si512()
                };
                [start, _mm512_setzero_si512()]
            });
            let mut add = |g: usize, wq: __m512i| {
                for (sum, xs) in sums.iter_mut().zip(&xs) {
                    let s = &mut sum[g % chains];
                    *s = _mm512_dpbusd_epi32(*s, wq, group(&xs[b].qs, g));
                }
            };
            if B::BITS == 8 {
                for g in 0..8 {
                    add(g, load(g));
                }
            } else {
                let qh = if B::BITS == 5 {
                    load(4)
                } else {
                    _mm512_setzero_si512()
                };
                for j in 0..4 {
                    let raw = load(j);
                    let mut lo = _mm512_and_si512(raw, low);
                    let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low);
                    if B::BITS == 5 {
                        lo = _mm512_or_si512(lo, fifth(qh, 2 * j));
                        hi = _mm512_or_si512(hi, fifth(qh, 2 * j + 1));
                    }
                    add(2 * j, lo);
                    add(2 * j + 1, hi);
                }
            }
            for ((a, sum), xs) in acc.iter_mut().zip(&sums).zip(&xs) {
                let xb = &xs[b];
                let sum = if chains == 2 {
                    _mm512_add_epi32(sum[0], sum[1])
                } else {
                    sum[0]
                };
                let scale = _mm512_mul_ps(d, _mm512_set1_ps(xb.d));
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, *a);
                if B::MIN || B::OFFSET != 0 {
                    *a = _mm512_fmadd_ps(corr, _mm512_set1_ps(xb.s), *a);
                }
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

/// Panels `panels` of `w` (blocks of 32 in panels of [`VLANES`]:
/// [`super::panels::write_blocks`]) against `rows` activation rows `x` (`nb` quantized blocks
/// each): `out` gets `[panel][row][VLANES]` for those panels. One row `streams` panels at a time
/// ([`DECODE_PANELS`] or 1, whichever this CPU reads faster: `super::panels::decode_panels`),
/// more in tiles of up to [`MAX_ROWS`].
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI and F16C ([`super::rows::Path::Avx512Vnni`]).
pub(crate) unsafe fn blocks<B: Block>(
    streams: usize,
    w: &[u8],
    nb: usize,
    panels: Range<usize>,
    x: &[Q8],
    rows: usize,
    out: &mut [f32],
) {
    let per_panel = nb * panel_bytes::<B, VLANES>();
    // SAFETY (each tile): the caller checked the features; `block_tiles` hands each tile its
    // panels, the rows of `x` and their outputs (asserted there).
    unsafe {
        super::x86::block_tiles(
            (w, per_panel, VLANES),
            panels,
            (x, nb),
            (rows, streams, MAX_ROWS),
            out,
            |n, t, wp, x, at, op| match (n, t) {
                (DECODE_PANELS, _) => tile::<B, DECODE_PANELS, 1>(wp, nb, x, at, op),
                (_, 1) => tile::<B, 1, 1>(wp, nb, x, at, op),
                (_, 2) => tile::<B, 1, 2>(wp, nb, x, at, op),
                (_, 3) => tile::<B, 1, 3>(wp, nb, x, at, op),
                (_, 4) => tile::<B, 1, 4>(wp, nb, x, at, op),
                (_, 5) => tile::<B, 1, 5>(wp, nb, x, at, op),
                (_, 6) => tile::<B, 1, 6>(wp, nb, x, at, op),
                (_, 7) => tile::<B, 1, 7>(wp, nb, x, at, op),
                _ => tile::<B, 1, MAX_ROWS>(wp, nb, x, at, op),
            },
        )
    }
}
