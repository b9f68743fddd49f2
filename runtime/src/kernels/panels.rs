//! Weights repacked, when the model loads, into panels of [`LANES`] outputs, for the kernels that
//! multiply many activation rows as cheaply as one (x86-64 with AVX2: [`super::x86_panels`]).
//!
//! A row-at-a-time kernel (a dot product per weight row and activation row) pays per activation
//! row for everything but the weight's memory traffic: decoding, scaling, reducing lanes. In a
//! panel the [`LANES`] outputs of one input sit side by side, so one register holds one input's
//! weights for 16 outputs and an activation is broadcast to it: an outer product, as a BLAS
//! micro-kernel computes, with a tile of panels × activation rows in registers. The weights are
//! read once per call whatever the number of rows, and a verify block of K + 1 rows costs the
//! decode step's memory traffic plus a little compute.
//!
//! **Batch invariance**: output (row r, column o) is one lane of one accumulator, summed over
//! the inputs in order, whatever the tile it falls in or how the inputs are split into chunks
//! (an accumulator stored and reloaded between chunks keeps its bits).

use std::cell::RefCell;
use std::ops::Range;
use std::sync::Arc;
use std::sync::OnceLock;

use candle_core::quantized::{GgmlDType, QTensor};

use super::matmul::cast;
use super::rows::{Block, Path, Q8, QK, layout, on_pool};

/// Outputs per panel of a weight in blocks of 32 on AVX-512 with VNNI: one register of 32-bit
/// sums ([`super::x86_vnni`]).
pub(crate) const VLANES: usize = 16;

/// Outputs per panel of a dense weight: one AVX-512 register of f32, two of AVX2.
pub(crate) const LANES: usize = 16;

/// Outputs per panel of a weight in blocks of 32: one AVX2 register of 32-bit sums.
pub(crate) const QLANES: usize = 8;

/// Panels per parallel task: a multiple of this (the one-row tiles take up to four at a time).
const TASK_PANELS: usize = 4;

thread_local! {
    /// Results panel by panel (`[panel][row][lane]`), reused across calls.
    static OUT: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Activations quantized for the block kernels, reused across calls.
    static XQ: RefCell<Vec<Q8>> = const { RefCell::new(Vec::new()) };
}

/// Gives back what the calling thread's scratch holds past what a verify block needs.
pub(crate) fn trim_scratch() {
    OUT.with_borrow_mut(super::rows::trim);
    XQ.with_borrow_mut(super::rows::trim);
}

/// Bytes of the calling thread's scratch (for tests).
#[cfg(test)]
pub(crate) fn scratch_bytes() -> usize {
    OUT.with_borrow(|out| out.capacity() * std::mem::size_of::<f32>())
        + XQ.with_borrow(|x| x.capacity() * std::mem::size_of::<Q8>())
}

/// A dense (out, in) weight, laid out for the kernel the path runs: f32 row-major for the
/// portable kernel ([`super::rows`]), in panels for AVX2 and AVX-512: f32, or f16 / bf16 as the
/// file holds them (half the bytes to read per token; widened to f32 in registers).
#[derive(Debug)]
pub(crate) struct Dense {
    path: Path,
    data: Data,
    out_dim: usize,
    in_dim: usize,
}

/// A dense weight's elements.
#[derive(Debug)]
enum Data {
    F32(Vec<f32>),
    F16(Vec<Half>),
    Bf16(Vec<Half>),
}

/// A 16-bit float's bits (f16 or bf16, as [`Data`] says).
#[derive(Debug, Clone, Copy, Default)]
#[repr(transparent)]
pub(crate) struct Half(pub u16);

impl Dense {
    /// `weight` (out × in, row-major) for `path` (or the fastest path the CPU runs, if less).
    pub(crate) fn new(path: Path, weight: Vec<f32>, out_dim: usize, in_dim: usize) -> Self {
        assert_eq!(
            weight.len(),
            out_dim * in_dim,
            "a dense weight of {out_dim} × {in_dim}"
        );
        let path = path.supported();
        let data = if path >= Path::Avx2 {
            repack_dense(&weight, out_dim, in_dim)
        } else {
            weight
        };
        Self {
            path,
            data: Data::F32(data),
            out_dim,
            in_dim,
        }
    }

    /// An F16 or BF16 weight: in panels of its own 16-bit values where `path` runs AVX2, else
    /// widened to f32 for the portable kernel.
    pub(crate) fn half(path: Path, t: &QTensor) -> candle_core::Result<Self> {
        let (out_dim, in_dim) = t.shape().dims2()?;
        let path = path.supported();
        if path < Path::Avx2 {
            let w = t.dequantize(&t.device())?.flatten_all()?.to_vec1::<f32>()?;
            return Ok(Self::new(path, w, out_dim, in_dim));
        }
        let bytes = t.data()?;
        let halves: Vec<Half> = bytes
            .chunks_exact(2)
            .map(|b| Half(u16::from_le_bytes([b[0], b[1]])))
            .collect();
        let panels = repack_dense(&halves, out_dim, in_dim);
        let data = match t.dtype() {
            GgmlDType::F16 => Data::F16(panels),
            GgmlDType::BF16 => Data::Bf16(panels),
            other => candle_core::bail!("{other:?} is not a 16-bit float type"),
        };
        Ok(Self {
            path,
            data,
            out_dim,
            in_dim,
        })
    }

    /// (out, in).
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.out_dim, self.in_dim)
    }

    /// `dst` (rows × out) = `lhs` (rows × in) · weightᵀ.
    #[allow(unsafe_code, reason = "calls the AVX2 kernel the CPU was checked for")]
    pub(crate) fn matmul(&self, lhs: &[f32], rows: usize, dst: &mut [f32]) {
        let mkn = (rows, self.in_dim, self.out_dim);
        if let (Data::F32(w), true) = (&self.data, self.path < Path::Avx2) {
            return super::rows::matmul_dense(w, mkn, lhs, dst);
        }
        #[cfg(target_arch = "x86_64")]
        {
            use super::x86_panels::{Bf16, F16, F32, dense};
            let k = self.in_dim;
            let parallel = self.out_dim * k >= super::attention::PARALLEL_WORK;
            let wide = self.path >= Path::Avx512;
            drive(LANES, self.out_dim, rows, parallel, dst, |panels, out| {
                use super::x86_dense512::dense as dense512;
                // SAFETY: the CPU runs Path::Avx2 at least, AVX-512 where `wide` (`supported`
                // in `new` and `half`).
                unsafe {
                    match (&self.data, wide) {
                        (Data::F32(w), false) => dense::<F32>(w, k, panels, lhs, rows, out),
                        (Data::F16(w), false) => dense::<F16>(w, k, panels, lhs, rows, out),
                        (Data::Bf16(w), false) => dense::<Bf16>(w, k, panels, lhs, rows, out),
                        (Data::F32(w), true) => dense512::<F32>(w, k, panels, lhs, rows, out),
                        (Data::F16(w), true) => dense512::<F16>(w, k, panels, lhs, rows, out),
                        (Data::Bf16(w), true) => dense512::<Bf16>(w, k, panels, lhs, rows, out),
                    }
                }
            });
        }
    }
}

/// (out, in) row-major → panels of [`LANES`] outputs, input-major within a panel
/// (`[panel][input][lane]`); the last panel is padded with zero outputs.
fn repack_dense<T: Copy + Default>(w: &[T], out_dim: usize, in_dim: usize) -> Vec<T> {
    let panels = out_dim.div_ceil(LANES);
    let mut data = vec![T::default(); panels * in_dim * LANES];
    for (o, row) in w.chunks_exact(in_dim).enumerate() {
        let panel = &mut data[(o / LANES) * in_dim * LANES..][..in_dim * LANES];
        for (k, v) in row.iter().enumerate() {
            panel[k * LANES + o % LANES] = *v;
        }
    }
    data
}

/// Runs `kernel(panels, out)` over the panels (of `lanes` outputs) of an `out_dim`-wide product,
/// split across candle's CPU pool: `out` gets the panels' results as `[panel][row][lane]`. `dst`
/// gets them row-major (rows × out_dim).
pub(super) fn drive(
    lanes: usize,
    out_dim: usize,
    rows: usize,
    parallel: bool,
    dst: &mut [f32],
    kernel: impl Fn(Range<usize>, &mut [f32]) + Sync,
) {
    let panels = out_dim.div_ceil(lanes);
    let per_panel = lanes * rows;
    let run = |out: &mut [f32]| {
        if parallel {
            // One contiguous run of panels per thread: a stream the prefetchers follow, and
            // one grab each from the pool's cursor (a thread that comes late finds its run
            // taken by the other). Against tasks of 4 panels handed out a sixteenth of them at
            // a time (candle's cursor), 110M-shape decode Q4_0 440-444 → 486-506 tok/s,
            // Q4_K_M 430-435 → 474-482, Q5_0 283-304 → 346-355, f32 65-66 → 67-70 (2 threads,
            // one run).
            let threads = candle_core::utils::get_num_threads().max(1);
            let task = panels.div_ceil(threads).next_multiple_of(TASK_PANELS);
            on_pool(out, task * per_panel, |i, part| {
                let first = i * task;
                kernel(first..first + part.len() / per_panel, part);
            });
        } else {
            kernel(0..panels, out);
        }
    };
    // One row and whole panels: the panels' layout is the row's.
    if rows == 1 && out_dim == panels * lanes {
        return run(dst);
    }
    OUT.with_borrow_mut(|out| {
        out.resize(panels * per_panel, 0.0);
        run(out);
        for (p, panel) in out.chunks_exact(per_panel).enumerate() {
            let n = lanes.min(out_dim - p * lanes);
            for (r, row) in panel.chunks_exact(lanes).enumerate() {
                dst[r * out_dim + p * lanes..][..n].copy_from_slice(&row[..n]);
            }
        }
    });
}

/// Bytes of one block of `N` outputs in a panel: their f16 scales, their f16 minimums (the `_1`
/// types), then the quants as the kernel reads them ([`write_blocks`]).
pub(crate) const fn panel_bytes<B: Block, const N: usize>() -> usize {
    let quants = match B::BITS {
        4 => 16 * N,
        5 => 20 * N,
        _ => 32 * N,
    };
    2 * N * (1 + B::MIN as usize) + quants
}

/// One block of `N` outputs of a panel (`None`: padding, zero scales), block-major within a
/// panel. "Group" g holds inputs 4g..4g + 4 of the `N` outputs (byte i: output i / 4, input
/// 4g + i % 4), the layout of a register the kernel multiplies by four broadcast activations:
/// - 8 bits: group g as 4N bytes, for g in 0..8: signed (`N` = [`QLANES`], AVX2's `maddubs`
///   takes the signs apart), or q + 128 unsigned (16 lanes, VNNI's `vpdpbusd` multiplies
///   unsigned weights by signed activations);
/// - 4 and 5 bits: 4 × 4N bytes, byte i of the j-th holding group 2j in its low nibble and
///   group 2j + 1 in its high nibble (unsigned quants, the offset left to the scale); for 5 bits
///   then 4N bytes, bit g of byte i the fifth bit of group g's byte i.
pub(super) fn write_blocks<B: Block, const N: usize>(blocks: &[Option<&B>; N], dst: &mut [u8]) {
    let (head, quants) = dst.split_at_mut(2 * N * (1 + B::MIN as usize));
    for (i, blk) in blocks.iter().enumerate() {
        let (d, m) = blk.map_or((0, 0), |blk| (blk.d(), blk.m()));
        head[2 * i..][..2].copy_from_slice(&d.to_le_bytes());
        if B::MIN {
            head[2 * (N + i)..][..2].copy_from_slice(&m.to_le_bytes());
        }
    }
    // The stored quants: unsigned below 8 bits, signed for 8.
    let raw: [[i16; QK]; N] = blocks.map(|blk| {
        blk.map_or([0; QK], |blk| {
            blk.quants().map(|q| i16::from(q) + i16::from(B::OFFSET))
        })
    });
    let at = |g: usize, i: usize| raw[i / 4][4 * g + i % 4];
    if B::BITS == 8 {
        let unsigned = N != QLANES;
        for (g, group) in quants.chunks_exact_mut(4 * N).enumerate() {
            for (i, byte) in group.iter_mut().enumerate() {
                *byte = if unsigned {
                    (at(g, i) + 128) as u8
                } else {
                    at(g, i) as i8 as u8
                };
            }
        }
        return;
    }
    let (nibbles, fifth) = quants.split_at_mut(16 * N);
    pack_nibbles(|g, i| at(g, i) as u8, nibbles);
    for (i, byte) in fifth.iter_mut().enumerate() {
        *byte = (0..8).fold(0, |acc, g| acc | ((((at(g, i) >> 4) & 1) as u8) << g));
    }
}

/// Out rows of `nb` blocks (`w`, row-major) → panels of `N` outputs, block-major within a
/// panel, `size` bytes a block: `write(blocks, dst)` lays out block b of a panel's outputs
/// (`None` past `out_dim`).
pub(super) fn repack<B, const N: usize>(
    w: &[B],
    out_dim: usize,
    nb: usize,
    size: usize,
    write: impl Fn(&[Option<&B>; N], &mut [u8]),
) -> Vec<u8> {
    let panels = out_dim.div_ceil(N);
    let mut data = vec![0u8; panels * nb * size];
    for (pb, dst) in data.chunks_exact_mut(size).enumerate() {
        let (p, b) = (pb / nb, pb % nb);
        let blocks: [Option<&B>; N] = std::array::from_fn(|i| {
            let o = p * N + i;
            (o < out_dim).then(|| &w[o * nb + b])
        });
        write(&blocks, dst);
    }
    data
}

/// The low 4 bits of 32 inputs of N outputs (`out`: 16N bytes), `q(g, i)` the quant of group
/// g's byte i (output i / 4, input 4g + i % 4), as 4 registers of 4N bytes: byte i of the j-th
/// holds group 2j in its low nibble and group 2j + 1 in its high nibble.
pub(super) fn pack_nibbles(q: impl Fn(usize, usize) -> u8, out: &mut [u8]) {
    for (j, reg) in out.chunks_exact_mut(out.len() / 4).enumerate() {
        for (i, byte) in reg.iter_mut().enumerate() {
            *byte = (q(2 * j, i) & 15) | ((q(2 * j + 1, i) & 15) << 4);
        }
    }
}

/// A GGUF weight in blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), laid out for the kernel the
/// path runs: in panels for AVX2 (Q8_0 in wider ones for AVX-512 with VNNI), as the file holds
/// it for the portable one ([`super::rows`]).
#[derive(Debug)]
pub(crate) struct Blocks {
    layout: BlocksLayout,
    /// Panels the one-row tile reads at a time ([`decode_panels`]).
    streams: usize,
    out_dim: usize,
    in_dim: usize,
}

#[derive(Debug)]
enum BlocksLayout {
    Gguf(Arc<QTensor>),
    Panels(GgmlDType, Vec<u8>),
    /// In panels of 16 outputs for AVX-512 with VNNI ([`super::x86_vnni`]).
    Vnni(GgmlDType, Vec<u8>),
}

impl Blocks {
    /// `t` (out × in, in a multiple of 32) for `path` (or the fastest path the CPU runs, if less).
    #[allow(
        unsafe_code,
        reason = "measures the x86 kernels' tiles the CPU was checked for"
    )]
    pub(crate) fn new(path: Path, t: Arc<QTensor>) -> candle_core::Result<Self> {
        let (out_dim, in_dim) = t.shape().dims2()?;
        let path = path.supported();
        let nb = in_dim / QK;
        let layout = if path >= Path::Avx2 {
            let data = t.data()?;
            let vnni = path == Path::Avx512Vnni;
            fn of<B: Block, const N: usize>(w: &[B], out_dim: usize, nb: usize) -> Vec<u8> {
                repack(w, out_dim, nb, panel_bytes::<B, N>(), write_blocks::<B, N>)
            }
            macro_rules! panels {
                ($b:ty) => {{
                    let w = cast::<$b>(&data)?;
                    if vnni {
                        of::<$b, VLANES>(w, out_dim, nb)
                    } else {
                        of::<$b, QLANES>(w, out_dim, nb)
                    }
                }};
            }
            let bytes = match t.dtype() {
                GgmlDType::Q4_0 => panels!(layout::Q4_0),
                GgmlDType::Q4_1 => panels!(layout::Q4_1),
                GgmlDType::Q5_0 => panels!(layout::Q5_0),
                GgmlDType::Q5_1 => panels!(layout::Q5_1),
                GgmlDType::Q8_0 => panels!(layout::Q8_0),
                other => candle_core::bail!("no block-of-32 kernel for GGUF type {other:?}"),
            };
            if vnni {
                BlocksLayout::Vnni(t.dtype(), bytes)
            } else {
                BlocksLayout::Panels(t.dtype(), bytes)
            }
        } else {
            BlocksLayout::Gguf(t)
        };
        let streams = match &layout {
            // SAFETY: the CPU runs `path` (`supported` above).
            #[cfg(target_arch = "x86_64")]
            BlocksLayout::Panels(..) | BlocksLayout::Vnni(..) => unsafe {
                decode_panels(matches!(layout, BlocksLayout::Vnni(..)))
            },
            _ => 1,
        };
        Ok(Self {
            layout,
            streams,
            out_dim,
            in_dim,
        })
    }

    /// (out, in).
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.out_dim, self.in_dim)
    }

    /// The repacked panels, where the weight is in panels.
    #[cfg(test)]
    pub(super) fn panels(&self) -> Option<&[u8]> {
        match &self.layout {
            BlocksLayout::Panels(_, data) | BlocksLayout::Vnni(_, data) => Some(data),
            BlocksLayout::Gguf(_) => None,
        }
    }

    /// `dst` (rows × out) = `lhs` (rows × in) · weightᵀ.
    #[allow(unsafe_code, reason = "calls the AVX2 kernel the CPU was checked for")]
    pub(crate) fn matmul(
        &self,
        lhs: &[f32],
        rows: usize,
        dst: &mut [f32],
    ) -> candle_core::Result<()> {
        let mkn = (rows, self.in_dim, self.out_dim);
        let (dtype, data, vnni) = match &self.layout {
            BlocksLayout::Gguf(t) => return super::matmul::blocks(t, mkn, lhs, dst),
            BlocksLayout::Panels(dtype, data) => (*dtype, data, false),
            BlocksLayout::Vnni(dtype, data) => (*dtype, data, true),
        };
        let (nb, streams) = (self.in_dim / QK, self.streams);
        XQ.with_borrow_mut(|x| {
            x.resize(rows * nb, Q8::default());
            for (xs, q) in lhs.chunks_exact(self.in_dim).zip(x.chunks_exact_mut(nb)) {
                super::rows::quantize(xs, q);
            }
            let x: &[Q8] = x;
            let parallel = data.len() * 2 >= super::attention::PARALLEL_WORK;
            // `$run::<the dtype's block layout>(…)`: the kernel for this weight's type.
            macro_rules! by_type {
                ($run:ident($($arg:expr),*)) => {
                    match dtype {
                        GgmlDType::Q4_0 => $run::<layout::Q4_0>($($arg),*),
                        GgmlDType::Q4_1 => $run::<layout::Q4_1>($($arg),*),
                        GgmlDType::Q5_0 => $run::<layout::Q5_0>($($arg),*),
                        GgmlDType::Q5_1 => $run::<layout::Q5_1>($($arg),*),
                        _ => $run::<layout::Q8_0>($($arg),*),
                    }
                };
            }
            #[cfg(target_arch = "x86_64")]
            if vnni {
                return drive(VLANES, self.out_dim, rows, parallel, dst, |panels, out| {
                    use super::x86_vnni::blocks as run;
                    // SAFETY: the CPU runs Path::Avx512Vnni (`supported` in `new`).
                    unsafe { by_type!(run(streams, data, nb, panels, x, rows, out)) }
                });
            }
            #[cfg(target_arch = "x86_64")]
            drive(QLANES, self.out_dim, rows, parallel, dst, |panels, out| {
                use super::x86_panels::blocks as run;
                // SAFETY: the CPU runs Path::Avx2 at least (`supported` in `new`).
                unsafe { by_type!(run(streams, data, nb, panels, x, rows, out)) }
            });
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (dtype, data, parallel, dst, vnni, streams);
        });
        Ok(())
    }
}

/// The panels the block kernels' one-row tile reads at a time on this CPU (`vnni`: the VNNI
/// kernels', else the AVX2 ones'): their [`super::x86_vnni::DECODE_PANELS`] (or
/// [`super::x86_panels::DECODE_PANELS`]) or one, whichever read a weight larger than the caches
/// faster, measured once, when the first such weight loads ([`super::x86::decode_streams`]).
///
/// # Safety
/// The CPU runs [`Path::Avx512Vnni`] where `vnni`, else [`Path::Avx2`].
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code, reason = "times the x86 kernels the CPU was checked for")]
unsafe fn decode_panels(vnni: bool) -> usize {
    use super::rows::layout::Q8_0;
    use super::{x86, x86_panels, x86_vnni};
    static VNNI: OnceLock<usize> = OnceLock::new();
    static AVX2: OnceLock<usize> = OnceLock::new();
    if vnni {
        *VNNI.get_or_init(|| {
            let block = (panel_bytes::<Q8_0, VLANES>(), VLANES);
            x86::decode_streams(x86_vnni::DECODE_PANELS, block, |n, w, nb, p, x, out| {
                // SAFETY: the caller's; whole panels of `w`, one row of `x`.
                unsafe { x86_vnni::blocks::<Q8_0>(n, w, nb, p, x, 1, out) }
            })
        })
    } else {
        *AVX2.get_or_init(|| {
            let block = (panel_bytes::<Q8_0, QLANES>(), QLANES);
            x86::decode_streams(x86_panels::DECODE_PANELS, block, |n, w, nb, p, x, out| {
                // SAFETY: the caller's; whole panels of `w`, one row of `x`.
                unsafe { x86_panels::blocks::<Q8_0>(n, w, nb, p, x, 1, out) }
            })
        })
    }
}
