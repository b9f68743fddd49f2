//! Causal attention row by row on the CPU: each query row attends to exactly the positions it
//! sees, with dot products, the softmax and the weighted sum in a fixed order, so that a row's
//! output is the same in a block of any size.

use rayon::prelude::*;

/// The sizes of one attention call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    /// Query rows, at positions `pos..pos + n`.
    pub n: usize,
    pub pos: usize,
    /// Rows held by `k` and `v` per kv head (≥ pos + n).
    pub kv_len: usize,
    pub head_dim: usize,
}

/// `q`: (heads, n, d); `k`, `v`: (kv_heads, kv_len, d); returns (n, heads · d).
pub(crate) fn attention(q: &[f32], k: &[f32], v: &[f32], s: AttentionShape) -> Vec<f32> {
    let d = s.head_dim;
    let group = s.heads / s.kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![0f32; s.n * s.heads * d];
    let one = |(index, out_row): (usize, &mut [f32])| {
        // Output (row i, head h) is chunk i · heads + h.
        let (i, h) = (index / s.heads, index % s.heads);
        let q_row = &q[(h * s.n + i) * d..][..d];
        let kv = h / group;
        let keys = &k[kv * s.kv_len * d..][..s.kv_len * d];
        let values = &v[kv * s.kv_len * d..][..s.kv_len * d];
        let seen = s.pos + i + 1;
        let mut scores: Vec<f32> = keys
            .chunks_exact(d)
            .take(seen)
            .map(|key| dot(q_row, key) * scale)
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for w in scores.iter_mut() {
            *w = (*w - max).exp();
            sum += *w;
        }
        for (w, value) in scores.iter().zip(values.chunks_exact(d)) {
            for (o, x) in out_row.iter_mut().zip(value) {
                *o += w * x;
            }
        }
        let inv = 1.0 / sum;
        out_row.iter_mut().for_each(|o| *o *= inv);
    };
    // Threads pay off only past a few hundred thousand multiply-adds (tiny models decode faster
    // on one); how the rows are split never changes a row's result.
    let work = s.n * s.heads * (s.pos + s.n) * d;
    if work >= PARALLEL_WORK {
        out.par_chunks_mut(d).enumerate().for_each(one);
    } else {
        out.chunks_mut(d).enumerate().for_each(one);
    }
    out
}

/// Multiply-adds above which a call is split across threads.
pub(crate) const PARALLEL_WORK: usize = 1 << 18;

/// A dot product in a fixed order: eight lanes, then the lanes in order.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a8.zip(b8) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}
