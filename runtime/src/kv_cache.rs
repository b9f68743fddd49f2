//! A per-sequence KV cache: preallocated per layer, grown by doubling, truncated in O(layers).

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
}

/// Smallest allocation, in positions, so that short sequences do not regrow at every token.
const MIN_CAPACITY: usize = 64;

/// Keys and values of every layer of one sequence.
///
/// Storage per layer is `(1, kv_heads, capacity, head_dim)`; new entries are copied in place at
/// the current length and reads are views of the first `len` positions. Growing doubles the
/// capacity (amortised O(1) per token); [`KvCache::truncate`] only moves the length.
#[derive(Debug)]
pub struct KvCache {
    shape: CacheShape,
    layers: Vec<(Tensor, Tensor)>,
    capacity: usize,
    len: usize,
}

impl KvCache {
    /// An empty cache; memory is allocated on the first forward.
    pub fn new(shape: CacheShape) -> Self {
        Self {
            shape,
            layers: Vec::new(),
            capacity: 0,
            len: 0,
        }
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
        self.bytes_per_position() * self.capacity
    }

    /// Drops every position at or after `len`. O(1): nothing is recomputed or copied.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len {
            return Err(Error::TruncateBeyondLength {
                requested: len,
                len: self.len,
            });
        }
        self.len = len;
        Ok(())
    }

    /// Empties the cache, keeping its memory.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Makes room for `n` more positions, growing storage by doubling.
    pub(crate) fn reserve(&mut self, n: usize) -> Result<()> {
        let needed = self.len + n;
        if needed > self.shape.max_len {
            return Err(Error::ContextFull {
                len: needed,
                limit: self.shape.max_len,
            });
        }
        if needed <= self.capacity {
            return Ok(());
        }
        let capacity = needed
            .max(2 * self.capacity)
            .max(MIN_CAPACITY)
            .min(self.shape.max_len);
        let s = &self.shape;
        let dims = (1, s.num_kv_heads, capacity, s.head_dim);
        let mut layers = Vec::with_capacity(s.num_layers);
        for i in 0..s.num_layers {
            let k = Tensor::zeros(dims, s.dtype, &s.device)?;
            let v = Tensor::zeros(dims, s.dtype, &s.device)?;
            if let Some((old_k, old_v)) = self.layers.get(i)
                && self.len > 0
            {
                k.slice_set(&old_k.narrow(2, 0, self.len)?.contiguous()?, 2, 0)?;
                v.slice_set(&old_v.narrow(2, 0, self.len)?.contiguous()?, 2, 0)?;
            }
            layers.push((k, v));
        }
        self.layers = layers;
        self.capacity = capacity;
        Ok(())
    }

    /// Writes the block's keys and values of `layer` at the current length and returns views of
    /// all positions up to the end of the block. Call [`KvCache::advance`] once all layers are
    /// written.
    pub(crate) fn append(&self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let n = k.dim(2)?;
        let (ck, cv) = &self.layers[layer];
        ck.slice_set(k, 2, self.len)?;
        cv.slice_set(v, 2, self.len)?;
        Ok((
            ck.narrow(2, 0, self.len + n)?,
            cv.narrow(2, 0, self.len + n)?,
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
