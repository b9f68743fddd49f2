//! A per-sequence KV cache: preallocated per layer, grown by doubling, truncated in O(layers).
//! Sliding-window layers (Gemma 3's local ones) keep their window and a slack for rollbacks,
//! not the whole history. A cache may start with a [`KvPrefix`]: keys and values of its first
//! positions held read-only in [`Segment`]s that other sequences share (a prefix cache's
//! entries); its own storage holds the positions after them.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::{Error, Result};

/// The geometry a cache is allocated for; taken from the model it serves.
#[derive(Debug, Clone)]
pub struct CacheShape {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub max_len: usize,
    pub dtype: DType,
    pub device: Device,
    /// The sliding window of the windowed layers (`None`: every layer keeps every position),
    /// and which layers they are.
    pub window: Option<(usize, Vec<bool>)>,
}

/// Positions a windowed layer keeps beyond its window, so that a rollback of up to this many
/// (a rejected draft block, a short prefix repair) finds every position its rows see.
pub const WINDOW_SLACK: usize = 256;

/// Smallest allocation, in positions, so that short sequences do not regrow at every token.
const MIN_CAPACITY: usize = 64;

/// Keys and values of every layer of one sequence.
///
/// Storage per layer is `(1, kv_heads, capacity, head_dim)`; new entries are copied in place at
/// the current length and reads are views of the first `len` positions. Growing doubles the
/// capacity (amortised O(1) per token); [`KvCache::truncate`] only moves the length. A windowed
/// layer's storage holds positions `base..len` only: when it is full, the positions no row can
/// see any more (all but the last window + [`WINDOW_SLACK`]) are dropped and the rest moved to
/// its start.
#[derive(Debug)]
pub struct KvCache {
    shape: CacheShape,
    layers: Vec<(Tensor, Tensor)>,
    capacity: usize,
    /// The windowed layers' storage, in positions, and the first position it holds.
    windowed_capacity: usize,
    base: usize,
    len: usize,
    /// The shared positions `0..prefix.len()` this cache starts with; its own storage holds
    /// `own_start()..len` (windowed models have none).
    prefix: Option<KvPrefix>,
}

/// Keys and values of positions `start..start + tokens.len()` of a token sequence, and those
/// tokens: read-only once made, shared by every cache that starts with them. Its positions
/// before `start` are its parent's.
#[derive(Debug)]
pub struct Segment {
    parent: Option<KvPrefix>,
    start: usize,
    tokens: Vec<u32>,
    /// Per layer, (1, kv_heads, tokens.len(), head_dim), contiguous.
    layers: Vec<(Tensor, Tensor)>,
    bytes: usize,
}

/// The first `len` positions of a chain of [`Segment`]s: what a cache starts with. Cloning
/// shares the segments.
#[derive(Debug, Clone)]
pub struct KvPrefix {
    segment: Arc<Segment>,
    len: usize,
}

impl KvPrefix {
    /// Positions it holds.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its tokens, in order.
    pub fn tokens(&self) -> Vec<u32> {
        let mut tokens = Vec::with_capacity(self.len);
        for (segment, rows) in self.segments() {
            tokens.extend_from_slice(&segment.tokens[..rows]);
        }
        tokens
    }

    /// Bytes its segment holds, not counting its parent's (each segment is counted once by
    /// whoever holds it).
    pub fn segment_bytes(&self) -> usize {
        self.segment.bytes
    }

    /// Each segment it reads (an id, the same for every prefix that holds that segment) and the
    /// bytes it holds: what counts its memory once however many prefixes share it.
    pub fn held(&self) -> Vec<(usize, usize)> {
        self.segments()
            .into_iter()
            .map(|(segment, _)| (std::ptr::from_ref(segment) as usize, segment.bytes))
            .collect()
    }

    /// Whether `other` holds the same segment (the same memory).
    pub fn same_segment(&self, other: &KvPrefix) -> bool {
        Arc::ptr_eq(&self.segment, &other.segment)
    }

    /// Its first `len` positions (all, if it holds fewer), without the segments past them;
    /// None for none.
    pub fn first(&self, len: usize) -> Option<KvPrefix> {
        let mut at = self.clone();
        at.len = at.len.min(len);
        while at.len <= at.segment.start {
            let parent = at.segment.parent.clone()?;
            at = KvPrefix {
                len: parent.len.min(at.len),
                segment: parent.segment,
            };
        }
        (at.len > 0).then_some(at)
    }

    /// Its segments from the first, with the rows of each it holds.
    fn segments(&self) -> Vec<(&Segment, usize)> {
        let mut chain = Vec::new();
        let (mut segment, mut len) = (&*self.segment, self.len);
        loop {
            chain.push((segment, len - segment.start));
            match &segment.parent {
                Some(parent) => (segment, len) = (&*parent.segment, parent.len.min(segment.start)),
                None => break,
            }
        }
        chain.reverse();
        chain
    }
}

impl KvCache {
    /// An empty cache; memory is allocated on the first forward.
    pub fn new(shape: CacheShape) -> Self {
        Self {
            shape,
            layers: Vec::new(),
            capacity: 0,
            windowed_capacity: 0,
            base: 0,
            len: 0,
            prefix: None,
        }
    }

    /// The first position this cache's own storage holds (the length of its shared prefix).
    fn own_start(&self) -> usize {
        self.prefix.as_ref().map_or(0, KvPrefix::len)
    }

    /// The shared prefix this cache starts with, if any.
    pub fn prefix(&self) -> Option<&KvPrefix> {
        self.prefix.as_ref()
    }

    /// Starts this empty cache with `prefix`'s positions, shared, not copied.
    pub fn attach(&mut self, prefix: &KvPrefix) -> Result<()> {
        let s = &self.shape;
        let fits = prefix.segment.layers.len() == s.num_layers
            && prefix.segment.layers.first().is_none_or(|(k, _)| {
                k.dims().get(1) == Some(&s.num_kv_heads)
                    && k.dims().get(3) == Some(&s.head_dim)
                    && k.dtype() == s.dtype
            });
        if self.len > 0 || self.shape.window.is_some() || !fits || prefix.len > s.max_len {
            return Err(Error::SharedPrefix(
                "a shared prefix starts only an empty cache of the same geometry, without \
                 sliding-window layers"
                    .into(),
            ));
        }
        self.prefix = Some(prefix.clone());
        self.len = prefix.len;
        Ok(())
    }

    /// Whether its positions can be shared ([`Self::share`]): not with sliding-window layers.
    pub fn can_share(&self) -> bool {
        self.shape.window.is_none()
    }

    /// Whether one more segment on this cache's shared prefix would be more pieces than
    /// attention reads (its segments and a cache's own storage).
    fn chain_full(&self) -> bool {
        let segments = self.prefix.as_ref().map_or(0, |p| p.segments().len());
        segments + 2 > crate::kernels::MAX_PIECES
    }

    /// Every position held, as a prefix other caches can start with: the shared prefix this
    /// cache starts with, extended by a new segment with a copy of its own positions, each
    /// matching one of `tokens` (the tokens of the positions after the shared prefix).
    pub fn share(&self, tokens: &[u32]) -> Result<KvPrefix> {
        let start = self.own_start();
        let rows = self.len - start;
        if self.shape.window.is_some() || tokens.len() != rows {
            return Err(Error::SharedPrefix(
                "a prefix is shared from a cache without sliding-window layers, one token per \
                 position"
                    .into(),
            ));
        }
        if rows == 0 {
            return self.prefix.clone().ok_or_else(|| {
                Error::SharedPrefix("an empty cache has no positions to share".into())
            });
        }
        // A chain as long as attention reads (one piece per segment, and the own storage's) is
        // copied into one segment instead of growing.
        let chain = self.prefix.as_ref().map_or(Vec::new(), KvPrefix::segments);
        let flatten = self.chain_full();
        let layers = (0..self.layers.len())
            .map(|layer| {
                let own = &self.layers[layer];
                let mut pieces = vec![(own.0.narrow(2, 0, rows)?, own.1.narrow(2, 0, rows)?)];
                if flatten {
                    let shared = chain.iter().map(|(segment, held)| {
                        let (k, v) = &segment.layers[layer];
                        Ok((k.narrow(2, 0, *held)?, v.narrow(2, 0, *held)?))
                    });
                    pieces = shared
                        .chain(pieces.into_iter().map(Ok))
                        .collect::<Result<_>>()?;
                }
                let (ks, vs): (Vec<Tensor>, Vec<Tensor>) = pieces.into_iter().unzip();
                // Copies: the segment must not share storage the cache goes on writing.
                let copy = |ts: &[Tensor]| -> Result<Tensor> { Ok(Tensor::cat(ts, 2)?.copy()?) };
                Ok((copy(&ks)?, copy(&vs)?))
            })
            .collect::<Result<Vec<_>>>()?;
        let (parent, start, tokens) = match &self.prefix {
            Some(prefix) if flatten => (None, 0, [prefix.tokens(), tokens.to_vec()].concat()),
            _ => (self.prefix.clone(), start, tokens.to_vec()),
        };
        let segment = Segment {
            parent,
            start,
            bytes: tokens.len() * self.bytes_per_position(),
            tokens,
            layers,
        };
        Ok(KvPrefix {
            segment: Arc::new(segment),
            len: self.len,
        })
    }

    /// Makes every position held a shared prefix ([`Self::share`]: its own positions copied
    /// once into a segment), which this cache then goes on from, its own storage empty: other
    /// caches start with them while this one lives (a prompt prefilled, published for
    /// sessions that share it).
    pub fn publish(&mut self, tokens: &[u32]) -> Result<KvPrefix> {
        let prefix = self.share(tokens)?;
        self.layers = Vec::new();
        self.capacity = 0;
        self.prefix = Some(prefix.clone());
        Ok(prefix)
    }

    fn windowed(&self, layer: usize) -> bool {
        self.shape
            .window
            .as_ref()
            .is_some_and(|(_, layers)| layers.get(layer).copied().unwrap_or(false))
    }

    /// Positions a windowed layer keeps when it drops older ones.
    fn keep(&self) -> Option<usize> {
        let (window, _) = self.shape.window.as_ref()?;
        Some(window.saturating_sub(1).saturating_add(WINDOW_SLACK))
    }

    /// The first position the windowed layers hold (0 without any): their views start there.
    pub fn base(&self) -> usize {
        self.base
    }

    /// Number of positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Longest sequence this cache may hold.
    pub fn max_len(&self) -> usize {
        self.shape.max_len
    }

    /// Caps the positions this cache may ever hold (and allocate) at `max_len`, or at what it
    /// holds already if that is more: a node sizes each session's cache to what it admitted.
    pub fn limit(&mut self, max_len: usize) {
        self.shape.max_len = self.shape.max_len.min(max_len.max(self.len));
    }

    /// Bytes one position takes, keys and values of every layer.
    pub fn bytes_per_position(&self) -> usize {
        let s = &self.shape;
        2 * s.num_layers * s.num_kv_heads * s.head_dim * s.dtype.size_in_bytes()
    }

    /// Every position held, as a prefix, this cache's own storage becoming its last segment
    /// without a copy (nothing writes to it any more): what a finished sequence leaves to a
    /// prefix cache. `tokens` are those of the positions after its shared prefix. None for a
    /// cache that holds nothing or has sliding-window layers.
    pub fn into_prefix(self, tokens: &[u32]) -> Option<KvPrefix> {
        let start = self.own_start();
        let rows = self.len - start;
        if self.shape.window.is_some() || tokens.len() != rows || self.len == 0 {
            return None;
        }
        if rows == 0 {
            return self.prefix.clone();
        }
        if self.chain_full() {
            // As long a chain as attention reads: copied into one segment ([`Self::share`]).
            return self.share(tokens).ok();
        }
        let bytes = self.bytes();
        let layers = self
            .layers
            .iter()
            .map(|(k, v)| Some((k.narrow(2, 0, rows).ok()?, v.narrow(2, 0, rows).ok()?)))
            .collect::<Option<Vec<_>>>()?;
        let segment = Segment {
            parent: self.prefix.clone(),
            start,
            tokens: tokens.to_vec(),
            layers,
            // Its storage is kept whole: what it allocated is what it holds.
            bytes,
        };
        Some(KvPrefix {
            segment: Arc::new(segment),
            len: self.len,
        })
    }

    /// Bytes allocated for keys and values of its own (a shared prefix's are its segments').
    pub fn bytes(&self) -> usize {
        self.layer_bytes(self.capacity, self.windowed_capacity)
    }

    /// Bytes of every layer's keys and values, full layers holding `full` positions and
    /// windowed ones `windowed`.
    fn layer_bytes(&self, full: usize, windowed: usize) -> usize {
        let per_layer = self.bytes_per_position() / self.shape.num_layers.max(1);
        (0..self.shape.num_layers)
            .map(|l| per_layer * if self.windowed(l) { windowed } else { full })
            .sum()
    }

    /// Bytes a sequence of `positions` needs at most: what admission reserves. Windowed layers
    /// hold no more than twice what they keep (a prefill chunk longer than that aside).
    pub fn bytes_for(&self, positions: usize) -> usize {
        let windowed = self
            .keep()
            .map_or(positions, |keep| positions.min(2 * keep));
        self.layer_bytes(positions, windowed)
    }

    /// Drops every position at or after `len`. O(1): nothing is recomputed or copied.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len {
            return Err(Error::TruncateBeyondLength {
                requested: len,
                len: self.len,
            });
        }
        // A row at `len` sees the window - 1 positions before it.
        if let Some((window, _)) = &self.shape.window
            && self.base > 0
            && len + 1 < self.base + window
        {
            return Err(Error::TruncateBeyondWindow {
                requested: len,
                held_from: self.base,
                window: *window,
            });
        }
        if len < self.own_start() {
            // Into the shared prefix: it is read, never written, so it is only cut; the own
            // storage holds the positions from there on.
            self.prefix = self.prefix.as_ref().and_then(|p| p.first(len));
        }
        self.len = len;
        Ok(())
    }

    /// Of the positions from `base` on (a token tree's rows, appended in row order), keeps
    /// those of `rows` (one path through the tree, ascending) at `base..base + rows.len()` and
    /// drops the rest: the cache then holds the path as if it had been fed as a chain. Only
    /// the own storage's positions move.
    pub fn keep_rows(&mut self, base: usize, rows: &[usize]) -> Result<()> {
        let own = self.own_start();
        let ascending = rows.windows(2).all(|w| w[0] < w[1]);
        let inside = rows.last().is_none_or(|&r| base + r < self.len);
        if self.shape.window.is_some() || base < own || !ascending || !inside {
            return Err(Error::invalid(
                "rows",
                format!("{rows:?} from {base}"),
                format!(
                    "ascending rows of the {} positions after {base}, in the own storage of a \
                     cache without sliding-window layers",
                    self.len.saturating_sub(base)
                ),
            ));
        }
        for (k, v) in &self.layers {
            for (to, &from) in rows.iter().enumerate() {
                if from != to {
                    let at = |r: usize| base - own + r;
                    k.slice_set(&k.narrow(2, at(from), 1)?.contiguous()?.copy()?, 2, at(to))?;
                    v.slice_set(&v.narrow(2, at(from), 1)?.contiguous()?.copy()?, 2, at(to))?;
                }
            }
        }
        self.len = base + rows.len();
        Ok(())
    }

    /// Empties the cache, keeping its memory.
    pub fn clear(&mut self) {
        self.len = 0;
        self.base = 0;
        self.prefix = None;
    }

    /// Makes room for `n` more positions, growing storage by doubling; windowed layers drop the
    /// positions no row will see first.
    pub(crate) fn reserve(&mut self, n: usize) -> Result<()> {
        if self.len + n > self.shape.max_len {
            return Err(Error::ContextFull {
                len: self.len + n,
                limit: self.shape.max_len,
            });
        }
        // The own storage's positions (a shared prefix's are not in it).
        let needed = self.len - self.own_start() + n;
        let full = if needed <= self.capacity {
            self.capacity
        } else {
            needed
                .max(2 * self.capacity)
                .max(MIN_CAPACITY)
                .min(self.shape.max_len)
        };
        let (mut windowed, mut base) = (self.windowed_capacity, self.base);
        if let Some(keep) = self.keep()
            && self.len - self.base + n > self.windowed_capacity
        {
            base = self.len - (self.len - self.base).min(keep);
            windowed = (self.len - base + n)
                .max(2 * keep)
                .max(MIN_CAPACITY)
                .min(self.shape.max_len);
        }
        if (full, windowed, base) == (self.capacity, self.windowed_capacity, self.base) {
            return Ok(());
        }
        let s = &self.shape;
        let mut layers = Vec::with_capacity(s.num_layers);
        for i in 0..s.num_layers {
            // Where this layer's storage starts now and from where it is to start.
            let own = self.own_start();
            let (capacity, from, to) = if self.windowed(i) {
                (windowed, self.base, base)
            } else {
                (full, own, own)
            };
            let unchanged = if self.windowed(i) {
                (windowed, base) == (self.windowed_capacity, self.base)
            } else {
                full == self.capacity
            };
            if let Some(old) = self.layers.get(i).filter(|_| unchanged) {
                layers.push(old.clone());
                continue;
            }
            let dims = (1, s.num_kv_heads, capacity, s.head_dim);
            let k = Tensor::zeros(dims, s.dtype, &s.device)?;
            let v = Tensor::zeros(dims, s.dtype, &s.device)?;
            if let Some((old_k, old_v)) = self.layers.get(i)
                && self.len > to
            {
                let kept = |t: &Tensor| t.narrow(2, to - from, self.len - to)?.contiguous();
                k.slice_set(&kept(old_k)?, 2, 0)?;
                v.slice_set(&kept(old_v)?, 2, 0)?;
            }
            layers.push((k, v));
        }
        self.layers = layers;
        self.capacity = full;
        self.windowed_capacity = windowed;
        self.base = base;
        Ok(())
    }

    /// Writes the block's keys and values of `layer` at the current length and returns views of
    /// all positions up to the end of the block, in order: the shared prefix's segments, then
    /// the own storage's. Call [`KvCache::advance`] once all layers are written.
    pub(crate) fn append(
        &self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Vec<(Tensor, Tensor)>> {
        let n = k.dim(2)?;
        let from = if self.windowed(layer) {
            self.base
        } else {
            self.own_start()
        };
        let (ck, cv) = &self.layers[layer];
        ck.slice_set(k, 2, self.len - from)?;
        cv.slice_set(v, 2, self.len - from)?;
        let mut views = Vec::new();
        if let Some(prefix) = &self.prefix {
            for (segment, rows) in prefix.segments() {
                let (sk, sv) = &segment.layers[layer];
                views.push((sk.narrow(2, 0, rows)?, sv.narrow(2, 0, rows)?));
            }
        }
        views.push((
            ck.narrow(2, 0, self.len - from + n)?,
            cv.narrow(2, 0, self.len - from + n)?,
        ));
        Ok(views)
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }
}

/// A session's cache is dropped where the session ends: often a server's async thread, not the
/// thread that runs the model. CUDA frees memory in the context current on the dropping thread
/// (cudarc's `CudaSlice` drop does not make it current, and records the failure for the next
/// call on any thread to return: requests failed with CUDA_ERROR_INVALID_CONTEXT), so the
/// cache's device context is made current here first.
#[cfg(feature = "cuda")]
impl Drop for KvCache {
    fn drop(&mut self) {
        if let Device::Cuda(device) = &self.shape.device {
            let ctx = device.cuda_stream().context().clone();
            // `bind_to_thread` first returns (and clears) an error recorded earlier, without
            // binding: bind again, then record that error again for the call it was meant for.
            if let Err(pending) = ctx.bind_to_thread() {
                let bound = ctx.bind_to_thread();
                ctx.record_err(Err::<(), _>(pending));
                ctx.record_err(bound);
            }
        }
    }
}
