//! A per-sequence KV cache: preallocated per layer, grown by doubling, truncated in O(layers).
//! Sliding-window layers (Gemma 3's local ones) keep their window and a slack for rollbacks,
//! not the whole history.

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
        }
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

    /// Bytes allocated for keys and values.
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
        self.len = len;
        Ok(())
    }

    /// Empties the cache, keeping its memory.
    pub fn clear(&mut self) {
        self.len = 0;
        self.base = 0;
    }

    /// Makes room for `n` more positions, growing storage by doubling; windowed layers drop the
    /// positions no row will see first.
    pub(crate) fn reserve(&mut self, n: usize) -> Result<()> {
        let needed = self.len + n;
        if needed > self.shape.max_len {
            return Err(Error::ContextFull {
                len: needed,
                limit: self.shape.max_len,
            });
        }
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
            let (capacity, from, to) = if self.windowed(i) {
                (windowed, self.base, base)
            } else {
                (full, 0, 0)
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
    /// all positions up to the end of the block. Call [`KvCache::advance`] once all layers are
    /// written.
    pub(crate) fn append(&self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let n = k.dim(2)?;
        let from = if self.windowed(layer) { self.base } else { 0 };
        let (ck, cv) = &self.layers[layer];
        ck.slice_set(k, 2, self.len - from)?;
        cv.slice_set(v, 2, self.len - from)?;
        Ok((
            ck.narrow(2, 0, self.len - from + n)?,
            cv.narrow(2, 0, self.len - from + n)?,
        ))
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
