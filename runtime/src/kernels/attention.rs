//! Causal attention row by row on the CPU: each query row attends to exactly the positions it
//! sees, with dot products, the softmax and the weighted sum in a fixed order, so that a row's
//! output is the same in a block of any size. Keys and values are read where the cache holds
//! them, in one piece or in several (a shared prefix's segments, then the sequence's own
//! storage): nothing is copied or concatenated per call, whatever the context's length, and a
//! key's score, the softmax and the sum are the same whichever piece holds it.

use std::cell::RefCell;

use candle_core::{Layout, Storage, Tensor};

use super::rows::{Path, on_pool};
use crate::Result;

/// The sizes of one attention call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    /// Query rows, at positions `pos..pos + n`.
    pub n: usize,
    pub pos: usize,
    pub head_dim: usize,
    /// Elements from one query head's first row to the next one's in `q`.
    pub q_stride: usize,
}

/// Keys and values of consecutive positions, from `start` on, `rows` of them: one piece of a
/// sequence's cache. `stride`: elements from one kv head's first row to the next one's (≥ rows
/// · head_dim: storage allocated for more positions than it holds).
#[derive(Clone, Copy)]
struct Piece<'a> {
    k: &'a [f32],
    v: &'a [f32],
    stride: usize,
    start: usize,
    rows: usize,
}

/// How a layer's query rows attend: the scale of q·k, and how many of the latest positions a
/// row sees, its own included (`usize::MAX`: all; a sliding window otherwise).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Span {
    pub scale: f32,
    pub window: usize,
}

/// The attention of the sequences of a batch, each `(q, pieces)`: `q` (1, heads, n, d), and the
/// pieces of its keys and values in order, each `(k, v)` (1, kv_heads, rows, d), together
/// pos + n positions; f32 on the CPU, under `span`. Returns (1, Σ n, heads · d): every
/// sequence's rows in turn, as their concatenation. The rows of all sequences are split across
/// the threads together (one sequence's decode row alone is too little work for two). Views
/// whose rows are contiguous (those of a preallocated cache) are read in place; others are
/// copied first.
///
/// A sequence's block may be a token tree's rows: `paths[s]`, when given, says for each of
/// sequence s's query rows the tree rows it sees ([`TreePaths`]); it sees every position before
/// the tree too. Such a row's keys are those of its path read as one sequence would hold them,
/// so its output is the same bits as that path's alone. (`paths` empty: no tree; the span's
/// window is not applied to trees.)
pub(crate) fn attention_cpu(
    seqs: &[(Tensor, Vec<(Tensor, Tensor)>)],
    paths: &[Option<&TreePaths>],
    span: Span,
) -> Result<Tensor> {
    let rows = |t: &Tensor| -> Result<Tensor> {
        let contiguous_rows = t.stride()[3] == 1 && t.stride()[2] == t.dim(3)?;
        Ok(if contiguous_rows {
            t.clone()
        } else {
            t.contiguous()?
        })
    };
    let tensors = seqs
        .iter()
        .map(|(q, pieces)| {
            let pieces = pieces
                .iter()
                .map(|(k, v)| Ok([rows(k)?, rows(v)?]))
                .collect::<Result<Vec<_>>>()?;
            Ok((rows(q)?, pieces))
        })
        .collect::<Result<Vec<_>>>()?;
    let guards: Vec<_> = tensors
        .iter()
        .map(|(q, pieces)| {
            let pieces: Vec<_> = pieces
                .iter()
                .map(|p| p.each_ref().map(|t| t.storage_and_layout()))
                .collect();
            (q.storage_and_layout(), pieces)
        })
        .collect();
    let bad = |what: &str| -> crate::Error { candle_core::Error::Msg(what.into()).into() };
    let mut calls = Vec::with_capacity(seqs.len());
    let (mut heads, mut head_dim, mut rows_out) = (0, 0, 0);
    for (index, ((q, kv), ((qs, ql), piece_guards))) in tensors.iter().zip(&guards).enumerate() {
        let (_, h, n, d) = q.dims4()?;
        if calls.is_empty() {
            (heads, head_dim) = (h, d);
        } else if (h, d) != (heads, head_dim) {
            return Err(bad("sequences of different head shapes"));
        }
        let (q, q_stride) = elements(qs, ql)?;
        let mut pieces = Vec::with_capacity(kv.len());
        let (mut seen, mut kv_heads) = (0, 0);
        for ([k, _], [(ks, kl), (vs, vl)]) in kv.iter().zip(piece_guards) {
            let (_, heads_here, rows, _) = k.dims4()?;
            let (k, stride) = elements(ks, kl)?;
            let (v, v_stride) = elements(vs, vl)?;
            if v_stride != stride || (kv_heads != 0 && heads_here != kv_heads) {
                return Err(bad("keys and values laid out differently"));
            }
            kv_heads = heads_here;
            pieces.push(Piece {
                k,
                v,
                stride,
                start: seen,
                rows,
            });
            seen += rows;
        }
        if seen < n || kv_heads == 0 {
            return Err(bad("fewer keys than query rows"));
        }
        let rows_paths = paths.get(index).copied().flatten();
        if rows_paths.is_some_and(|t| !t.fit(n, seen - n)) {
            return Err(bad("a tree's paths do not fit its block"));
        }
        let s = AttentionShape {
            heads,
            kv_heads,
            n,
            pos: seen - n,
            head_dim,
            q_stride,
        };
        calls.push(Call {
            q,
            pieces,
            s,
            paths: rows_paths,
        });
        rows_out += n;
    }
    let ys = attention(&calls, span);
    let device = seqs
        .first()
        .map_or(&candle_core::Device::Cpu, |(q, ..)| q.device());
    Ok(Tensor::from_vec(
        ys,
        (1, rows_out, heads * head_dim),
        device,
    )?)
}

/// A CPU f32 tensor's elements from the start of its view, and the distance between its heads
/// (axis 1).
fn elements<'a>(storage: &'a Storage, layout: &Layout) -> Result<(&'a [f32], usize)> {
    let Storage::Cpu(cpu) = storage else {
        return Err(
            candle_core::Error::Msg("CPU attention on a tensor not on the CPU".into()).into(),
        );
    };
    Ok((
        &cpu.as_slice::<f32>()?[layout.start_offset()..],
        layout.stride()[1],
    ))
}

thread_local! {
    /// One row's scores, reused: no allocation per row once the context stops growing.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// One sequence's attention: `q` heads of `n` rows; the pieces of its keys and values, kv heads
/// of `pos + n` rows together (see [`AttentionShape`] for the strides).
struct Call<'a> {
    q: &'a [f32],
    pieces: Vec<Piece<'a>>,
    s: AttentionShape,
    /// A token tree's rows: the tree rows each sees ([`attention_cpu`]).
    paths: Option<&'a TreePaths>,
}

/// Every call's (n, heads · d) rows, one call after the other (the calls share `heads` and
/// `head_dim`). A unit of work is one row's group of query heads that share a kv head
/// ([`head_group`]): each key and value is read from memory once for all of them.
fn attention(calls: &[Call<'_>], span: Span) -> Vec<f32> {
    let Some(first) = calls.first() else {
        return Vec::new();
    };
    let (heads, d) = (first.s.heads, first.s.head_dim);
    let group = head_group(calls, heads);
    let units_per_row = heads / group;
    // The first unit of each call.
    let starts: Vec<usize> = calls
        .iter()
        .scan(0, |at, c| {
            let start = *at;
            *at += c.s.n * units_per_row;
            Some(start)
        })
        .collect();
    let total: usize = calls.iter().map(|c| c.s.n * heads).sum();
    let scale = span.scale;
    let mut out = vec![0f32; total * d];
    #[cfg(target_arch = "x86_64")]
    let fused = Path::detect() != Path::Portable;
    let one = |(index, out_group): (usize, &mut [f32])| {
        let c = starts.partition_point(|&s| s <= index) - 1;
        let Call {
            q,
            pieces,
            s,
            paths,
        } = &calls[c];
        // Unit u of row i of a call: heads u · group.., output chunks i · heads + u · group...
        let local = index - starts[c];
        let (i, h) = (local / units_per_row, local % units_per_row * group);
        let q_rows = QRows {
            first: &q[h * s.q_stride + i * d..],
            stride: s.q_stride,
            d,
        };
        let kv = h / (heads / s.kv_heads);
        // The positions the row sees, in order, piece by piece.
        let mut seen_pieces = [(&[][..], &[][..]); MAX_PIECES + MAX_TREE_DEPTH + 1];
        let mut count = 0;
        let mut take = |first: usize, seen: usize| {
            for p in pieces {
                let (from, to) = (first.max(p.start), seen.min(p.start + p.rows));
                if from >= to {
                    continue;
                }
                let at = kv * p.stride + (from - p.start) * d;
                let len = (to - from) * d;
                seen_pieces[count] = (&p.k[at..][..len], &p.v[at..][..len]);
                count += 1;
            }
        };
        match paths {
            None => {
                let seen = s.pos + i + 1;
                take(seen.saturating_sub(span.window), seen);
            }
            Some(tree) => {
                // Everything before the tree, then the row's path in runs of adjacent rows.
                let base = s.pos - tree.earlier;
                take(0, base);
                let path = &tree.paths[i];
                let mut k = 0;
                while k < path.len() {
                    let start = path[k];
                    let mut end = start + 1;
                    k += 1;
                    while path.get(k) == Some(&end) {
                        end += 1;
                        k += 1;
                    }
                    take(base + start, base + end);
                }
            }
        }
        let rows = Rows {
            pieces: &seen_pieces[..count],
            d,
            scale,
        };
        SCORES.with_borrow_mut(|scores| {
            #[cfg(target_arch = "x86_64")]
            if fused {
                // SAFETY: `Path::detect` found AVX2 and FMA on this CPU.
                #[allow(unsafe_code, reason = "a target-feature function, features checked")]
                unsafe {
                    attend_fma(q_rows, rows, scores, out_group)
                };
                return;
            }
            attend_each::<false>(q_rows, rows, scores, out_group);
        });
    };
    // Threads pay off sooner here than in a matmul: a decode row's keys and values come from
    // memory (the weights streamed through since evicted them), and two threads read them
    // faster (the 110M model's decode step at 65 and 900 positions: 2-3 % faster). Tiny models
    // stay on one. How the rows are split never changes a row's result.
    let work: usize = calls
        .iter()
        .map(|c| c.s.n * heads * (c.s.pos + c.s.n) * d)
        .sum();
    if work >= PARALLEL_WORK / 16 {
        on_pool(&mut out, group * d, |i, part| one((i, part)));
    } else {
        out.chunks_mut(group * d).enumerate().for_each(one);
    }
    out
}

/// How many query heads one unit of [`attention`]'s work attends: those sharing a kv head
/// (grouped-query attention: 6 on the Qwen2.5-Coder 1.5B target, 7 on its 0.5B draft), halved
/// while that leaves fewer units than the pool has threads (a decode step of a model with one
/// kv head would run on one); 1 where the calls' groups differ.
fn head_group(calls: &[Call<'_>], heads: usize) -> usize {
    let shared = |c: &Call<'_>| (heads / c.s.kv_heads).max(1);
    let mut group = calls
        .iter()
        .map(shared)
        .reduce(|a, b| if a == b { a } else { 1 })
        .unwrap_or(1);
    let rows: usize = calls.iter().map(|c| c.s.n).sum();
    let threads = candle_core::utils::get_num_threads().max(1);
    while group.is_multiple_of(2) && rows * heads / group < threads {
        group /= 2;
    }
    group
}

/// The query rows of a group of heads at one position: head g's at `first[g · stride..][..d]`.
#[derive(Clone, Copy)]
pub(super) struct QRows<'a> {
    pub(super) first: &'a [f32],
    pub(super) stride: usize,
    pub(super) d: usize,
}

impl<'a> QRows<'a> {
    pub(super) fn row(&self, g: usize) -> &'a [f32] {
        &self.first[g * self.stride..][..self.d]
    }
}

/// A token tree's query rows: for each, the tree rows it sees (its ancestors and itself,
/// ascending), counted from the tree's first row, which is `earlier` positions before the block:
/// rows an earlier forward fed and the cache kept (0: the whole tree is in the block).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TreePaths {
    pub(crate) paths: Vec<Vec<usize>>,
    pub(crate) earlier: usize,
}

impl TreePaths {
    /// Whether these are the paths of a block of `n` rows after `pos` positions: one per row,
    /// each within the tree's rows and no deeper than the attention reads.
    pub(crate) fn fit(&self, n: usize, pos: usize) -> bool {
        let rows = self.earlier + n;
        self.earlier <= pos
            && self.paths.len() == n
            && (self.paths.iter())
                .all(|p| p.len() <= MAX_TREE_DEPTH + 1 && p.iter().all(|&r| r < rows))
    }
}

/// The keys and values one query row sees, in pieces (each (keys, values) of the same
/// positions), and the scale of its scores.
#[derive(Clone, Copy)]
pub(super) struct Rows<'a> {
    pub(super) pieces: &'a [(&'a [f32], &'a [f32])],
    pub(super) d: usize,
    pub(super) scale: f32,
}

/// The most pieces a sequence's keys come in: a shared prefix's segments (one per turn of a
/// chat that extended the last) and its own storage. A longer chain is copied into one segment.
pub(crate) const MAX_PIECES: usize = 16;

/// The deepest path through a token tree a row may attend over (besides its root).
pub(crate) const MAX_TREE_DEPTH: usize = 32;

/// `acc` + a · b, in one rounding where `FUSED` (FMA).
#[inline(always)]
fn madd<const FUSED: bool>(a: f32, b: f32, acc: f32) -> f32 {
    if FUSED {
        a.mul_add(b, acc)
    } else {
        acc + a * b
    }
}

/// Keys whose scores are computed together.
const KEYS: usize = 4;

/// `out_row` = softmax(q · kᵀ · scale) · v over `rows`, in a fixed order: each score a dot product
/// in 16 lanes then the lanes pairwise, the values summed position by position. `FUSED` makes
/// each multiply-add one rounding (FMA): the same order, so a row's result is still the same
/// alone or in a block on a given CPU.
#[inline(always)]
fn attend<const FUSED: bool>(
    q_row: &[f32],
    rows: Rows,
    scores: &mut Vec<f32>,
    out_row: &mut [f32],
) {
    let Rows { pieces, d, scale } = rows;
    scores.clear();
    for (keys, _) in pieces {
        let mut groups = keys.chunks_exact(KEYS * d);
        for group in &mut groups {
            scores.extend(key_scores::<FUSED, KEYS>(q_row, group, d, scale));
        }
        for key in groups.remainder().chunks_exact(d) {
            scores.extend(key_scores::<FUSED, 1>(q_row, key, d, scale));
        }
    }
    let sum = exp_scores(scores);
    let values = pieces.iter().flat_map(|(_, values)| values.chunks_exact(d));
    for (w, value) in scores.iter().zip(values) {
        for (o, x) in out_row.iter_mut().zip(value) {
            *o = madd::<FUSED>(*w, *x, *o);
        }
    }
    let inv = 1.0 / sum;
    out_row.iter_mut().for_each(|o| *o *= inv);
}

/// [`attend`] for each head of a group in turn (`out_group`: their rows).
#[inline(always)]
pub(super) fn attend_each<const FUSED: bool>(
    q: QRows,
    rows: Rows,
    scores: &mut Vec<f32>,
    out_group: &mut [f32],
) {
    for (g, out_row) in out_group.chunks_mut(rows.d).enumerate() {
        attend::<FUSED>(q.row(g), rows, scores, out_row);
    }
}

/// Each score to exp(score − the largest), in order; their sum, added in order.
#[inline]
pub(super) fn exp_scores(scores: &mut [f32]) -> f32 {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for w in scores.iter_mut() {
        *w = (*w - max).exp();
        sum += *w;
    }
    sum
}

/// The scores of `G` consecutive keys (`keys`: G · d). Each key's operations are those it has
/// alone; interleaving the keys overlaps their chains of dependent multiply-adds.
#[inline(always)]
fn key_scores<const FUSED: bool, const G: usize>(
    q_row: &[f32],
    keys: &[f32],
    d: usize,
    scale: f32,
) -> [f32; G] {
    // Plain loops: iterator adapters may be left out of line, compiled without FMA.
    let body = d - d % 16;
    let mut lanes = [[0f32; 16]; G];
    for c in (0..body).step_by(16) {
        let q = &q_row[c..][..16];
        for (j, lanes) in lanes.iter_mut().enumerate() {
            let key = &keys[j * d + c..][..16];
            for l in 0..16 {
                lanes[l] = madd::<FUSED>(q[l], key[l], lanes[l]);
            }
        }
    }
    let mut scores = [0f32; G];
    for (j, (score, lanes)) in scores.iter_mut().zip(&mut lanes).enumerate() {
        let key = &keys[j * d..][..d];
        let mut tail = 0f32;
        for c in body..d {
            tail = madd::<FUSED>(q_row[c], key[c], tail);
        }
        // The lanes summed pairwise (a fixed tree: 4 dependent adds, not 15).
        for width in [8, 4, 2, 1] {
            for l in 0..width {
                lanes[l] += lanes[l + width];
            }
        }
        *score = (lanes[0] + tail) * scale;
    }
    scores
}

/// [`attend`] with fused multiply-adds for each of a group of heads (`out_group`: their rows) on
/// AVX2 and FMA: [`super::x86_attention`]'s where the head size and the group fit it, else the
/// portable row compiled for these features, head by head.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn attend_fma(q: QRows, rows: Rows, scores: &mut Vec<f32>, out_group: &mut [f32]) {
    let group = out_group.len() / rows.d;
    if super::x86_attention::fits(rows.d, group) {
        // SAFETY: AVX2 and FMA enabled here; `rows.d` and the group fit; the rows are whole
        // (`attention`), `q` holds the group's rows.
        #[allow(unsafe_code, reason = "a target-feature function, features checked")]
        unsafe {
            super::x86_attention::attend(q, rows, scores, out_group)
        };
    } else {
        attend_each::<true>(q, rows, scores, out_group);
    }
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
