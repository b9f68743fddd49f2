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

use super::rows::{Path, on_pool};

/// Outputs per panel: one AVX-512 register of f32, two of AVX2.
pub(crate) const LANES: usize = 16;

/// Panels per parallel task, at least.
const TASK_PANELS: usize = 4;

thread_local! {
    /// Results panel by panel (`[panel][row][LANES]`), reused across calls.
    static OUT: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Gives back what the calling thread's scratch holds past what a verify block needs.
pub(crate) fn trim_scratch() {
    OUT.with_borrow_mut(super::rows::trim);
}

/// Bytes of the calling thread's scratch (for tests).
#[cfg(test)]
pub(crate) fn scratch_bytes() -> usize {
    OUT.with_borrow(|out| out.capacity() * std::mem::size_of::<f32>())
}

/// A dense (out, in) f32 weight, laid out for the kernel the path runs: row-major for the
/// portable kernel ([`super::rows`]), in panels for AVX2 and AVX-512.
#[derive(Debug)]
pub(crate) struct Dense {
    path: Path,
    data: Vec<f32>,
    out_dim: usize,
    in_dim: usize,
}

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
            repack(&weight, out_dim, in_dim)
        } else {
            weight
        };
        Self {
            path,
            data,
            out_dim,
            in_dim,
        }
    }

    /// (out, in).
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.out_dim, self.in_dim)
    }

    /// `dst` (rows × out) = `lhs` (rows × in) · weightᵀ.
    #[allow(unsafe_code, reason = "calls the AVX2 kernel the CPU was checked for")]
    pub(crate) fn matmul(&self, lhs: &[f32], rows: usize, dst: &mut [f32]) {
        let mkn = (rows, self.in_dim, self.out_dim);
        if self.path < Path::Avx2 {
            return super::rows::matmul_dense(self.path, &self.data, mkn, lhs, dst);
        }
        #[cfg(target_arch = "x86_64")]
        {
            let k = self.in_dim;
            let parallel = self.data.len() >= super::attention::PARALLEL_WORK;
            drive(self.out_dim, rows, parallel, dst, |panels, out| {
                // SAFETY: the CPU runs Path::Avx2 at least (`supported` in `new`).
                unsafe { super::x86_panels::dense(&self.data, k, panels, lhs, rows, out) }
            });
        }
    }
}

/// (out, in) row-major → panels of [`LANES`] outputs, input-major within a panel
/// (`[panel][input][lane]`); the last panel is padded with zero outputs.
fn repack(w: &[f32], out_dim: usize, in_dim: usize) -> Vec<f32> {
    let panels = out_dim.div_ceil(LANES);
    let mut data = vec![0f32; panels * in_dim * LANES];
    for (o, row) in w.chunks_exact(in_dim).enumerate() {
        let panel = &mut data[(o / LANES) * in_dim * LANES..][..in_dim * LANES];
        for (k, v) in row.iter().enumerate() {
            panel[k * LANES + o % LANES] = *v;
        }
    }
    data
}

/// Runs `kernel(panels, out)` over the panels of an `out_dim`-wide product, split across
/// candle's CPU pool: `out` gets the panels' results as `[panel][row][LANES]`. `dst` gets them
/// row-major (rows × out_dim).
pub(crate) fn drive(
    out_dim: usize,
    rows: usize,
    parallel: bool,
    dst: &mut [f32],
    kernel: impl Fn(Range<usize>, &mut [f32]) + Sync,
) {
    let panels = out_dim.div_ceil(LANES);
    let per_panel = LANES * rows;
    let run = |out: &mut [f32]| {
        if parallel {
            on_pool(out, TASK_PANELS * per_panel, |i, part| {
                let first = i * TASK_PANELS;
                kernel(first..first + part.len() / per_panel, part);
            });
        } else {
            kernel(0..panels, out);
        }
    };
    // One row and whole panels: the panels' layout is the row's.
    if rows == 1 && out_dim == panels * LANES {
        return run(dst);
    }
    OUT.with_borrow_mut(|out| {
        out.resize(panels * per_panel, 0.0);
        run(out);
        for (p, panel) in out.chunks_exact(per_panel).enumerate() {
            let n = LANES.min(out_dim - p * LANES);
            for (r, lanes) in panel.chunks_exact(LANES).enumerate() {
                dst[r * out_dim + p * LANES..][..n].copy_from_slice(&lanes[..n]);
            }
        }
    });
}
