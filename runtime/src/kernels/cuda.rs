//! The CUDA path's batch-invariant attention: a kernel of our own (`attention.cu`, compiled
//! with NVRTC when a model first runs), where candle's ops would multiply a block's rows by the
//! keys with different matrix shapes (so different cuBLAS kernels and summation orders) than a
//! decode step's, and mask the keys a row does not see instead of leaving them out.

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::WrapErr;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::cudarc::nvrtc;
use candle_core::{CpuStorage, CudaStorage, CustomOp3, DType, Layout, Shape, Tensor};

use super::Span;
use crate::Result;

const SOURCE: &str = include_str!("attention.cu");
const NAME: &str = "tandem_attention";
/// Threads of a block: four warps (`WARPS` in the kernel).
const THREADS: u32 = 128;
/// Widest head the kernel takes (32 lanes × `LANE_DIMS`).
const MAX_HEAD_DIM: usize = 256;

fn ptx() -> candle_core::Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        nvrtc::compile_ptx(SOURCE)
            .map(|p| p.to_src())
            .map_err(|e| e.to_string())
    })
    .as_deref()
    .map_err(|e| candle_core::Error::Msg(format!("compiling the CUDA attention kernel: {e}")))
}

/// Which stored keys each row of a block sees, in order: the cached keys `start..end`, then
/// (a token tree's row) its path's keys.
struct Attend {
    /// (n, 3): start, end, path length.
    rows: Vec<u32>,
    /// (n, max_path) storage indices; at least one entry.
    paths: Vec<u32>,
    max_path: usize,
    scale: f32,
}

/// One sequence's attention of q (1, heads, n, d) over its stored keys and values
/// (1, kv_heads, total, d), the block's rows the last n of them, as (1, n, heads · d): each row
/// over the keys before it within `span`'s window, or a tree row (`paths`: the block rows it
/// sees, its ancestors and itself) over the cache and its path.
pub(crate) fn attention_cuda(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    paths: Option<&[Vec<usize>]>,
    span: Span,
) -> Result<Tensor> {
    let (n, total) = (q.dim(2)?, k.dim(2)?);
    let stored = total - n;
    let as_u32 = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
    let mut op = Attend {
        rows: Vec::with_capacity(3 * n),
        paths: Vec::new(),
        max_path: 1,
        scale: span.scale,
    };
    match paths {
        None => {
            for i in 0..n {
                let end = stored + i + 1;
                op.rows
                    .extend([as_u32(end.saturating_sub(span.window)), as_u32(end), 0]);
            }
            op.paths.push(0);
        }
        Some(paths) => {
            op.max_path = paths.iter().map(Vec::len).max().unwrap_or(1).max(1);
            for path in paths {
                op.rows.extend([0, as_u32(stored), as_u32(path.len())]);
                let mut row: Vec<u32> = path.iter().map(|&r| as_u32(stored + r)).collect();
                row.resize(op.max_path, 0);
                op.paths.extend(row);
            }
        }
    }
    let dtype = q.dtype();
    let f32 = |t: &Tensor| -> candle_core::Result<Tensor> { t.to_dtype(DType::F32)?.contiguous() };
    let out = f32(q)?.apply_op3_no_bwd(&f32(k)?, &f32(v)?, &op)?;
    Ok(out.to_dtype(dtype)?)
}

impl CustomOp3 for Attend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("{NAME} runs on CUDA devices only")
    }

    #[allow(unsafe_code, reason = "launching a CUDA kernel is an FFI call")]
    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        lq: &Layout,
        k: &CudaStorage,
        lk: &Layout,
        v: &CudaStorage,
        lv: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (_, heads, n, d) = lq.shape().dims4()?;
        let (_, kv_heads, total, kd) = lk.shape().dims4()?;
        if kd != d || lv.shape() != lk.shape() || d > MAX_HEAD_DIM || heads % kv_heads != 0 {
            candle_core::bail!(
                "{NAME}: q {:?}, k {:?}, v {:?} (heads up to {MAX_HEAD_DIM} wide)",
                lq.shape(),
                lk.shape(),
                lv.shape()
            );
        }
        if !(lq.is_contiguous() && lk.is_contiguous() && lv.is_contiguous()) {
            candle_core::bail!("{NAME} takes contiguous tensors");
        }
        let dev = q.device();
        let stream = dev.cuda_stream();
        let q = q.as_cuda_slice::<f32>()?.slice(lq.start_offset()..);
        let k = k.as_cuda_slice::<f32>()?.slice(lk.start_offset()..);
        let v = v.as_cuda_slice::<f32>()?.slice(lv.start_offset()..);
        let rows = stream.clone_htod(&self.rows).w()?;
        let paths = stream.clone_htod(&self.paths).w()?;
        let out = dev.alloc_zeros::<f32>(n * heads * d)?;
        let func = dev.get_or_load_custom_func(NAME, NAME, ptx()?)?;
        let dims = [n, heads, kv_heads, total, d, self.max_path]
            .map(|x| u32::try_from(x).unwrap_or(u32::MAX));
        let mut launch = func.builder();
        launch
            .arg(&q)
            .arg(&k)
            .arg(&v)
            .arg(&rows)
            .arg(&paths)
            .arg(&out);
        for dim in &dims {
            launch.arg(dim);
        }
        launch.arg(&self.scale);
        let cfg = LaunchConfig {
            grid_dim: (dims[1], dims[0], 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature (three f32 tensors of the shapes
        // checked above, the row table of 3n and the path table of n × max_path entries, the
        // output of n · heads · d, six u32 and one f32), and every index the kernel reads is
        // within them (rows' ends ≤ total, paths' entries < total).
        unsafe { launch.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((1, n, heads * d)),
        ))
    }
}
