//! The CUDA path's batch-invariant attention: a kernel of our own (`attention.cu`, compiled
//! with NVRTC when a model first runs), where candle's ops would multiply a block's rows by the
//! keys with different matrix shapes (so different cuBLAS kernels and summation orders) than a
//! decode step's, and mask the keys a row does not see instead of leaving them out.

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use candle_core::cuda_backend::cudarc::nvrtc;
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp3, DType, Device, Layout, Shape, Storage, Tensor,
};
use half::{bf16, f16};

use crate::Result;

const SOURCE: &str = include_str!("attention.cu");
const MODULE: &str = "tandem_attention";
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

/// Which stored keys each row of one sequence's block sees, in order, on the device (built once
/// per forward, read by every layer): the cached keys `start..end`, then (a token tree's row)
/// its path's keys.
pub(crate) struct KeyTables {
    /// (n, 3) u32: start, end, path length.
    rows: Tensor,
    /// (n, max_path) u32 storage indices; at least one entry.
    paths: Tensor,
    max_path: usize,
}

impl KeyTables {
    /// The tables of a block of `n` rows whose keys are stored after `stored` others: each row
    /// sees the keys before it within `window`, or a tree row ([`super::TreePaths`]: the tree
    /// rows it sees, its ancestors and itself) the keys stored before the tree and its path.
    pub(crate) fn new(
        n: usize,
        stored: usize,
        window: usize,
        paths: Option<&super::TreePaths>,
        device: &Device,
    ) -> Result<Self> {
        let as_u32 = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
        let mut rows = Vec::with_capacity(3 * n);
        let mut table = Vec::new();
        let mut max_path = 1;
        match paths {
            None => {
                for i in 0..n {
                    let end = stored + i + 1;
                    rows.extend([as_u32(end.saturating_sub(window)), as_u32(end), 0]);
                }
                table.push(0);
            }
            Some(tree) => {
                let base = stored - tree.earlier;
                max_path = tree.paths.iter().map(Vec::len).max().unwrap_or(1).max(1);
                for path in &tree.paths {
                    rows.extend([0, as_u32(base), as_u32(path.len())]);
                    let mut row: Vec<u32> = path.iter().map(|&r| as_u32(base + r)).collect();
                    row.resize(max_path, 0);
                    table.extend(row);
                }
            }
        }
        let paths_len = table.len();
        Ok(Self {
            rows: Tensor::from_vec(rows, 3 * n, device)?,
            paths: Tensor::from_vec(table, paths_len, device)?,
            max_path,
        })
    }
}

/// One sequence's attention of q (1, heads, n, d) over its stored keys and values
/// (1, kv_heads, total, d; a key head's rows adjacent, the heads at any stride), the block's
/// rows the last n of them, as (1, n, heads · d), in q's dtype (f32, bf16 or f16).
pub(crate) fn attention_cuda(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    keys: &KeyTables,
    scale: f32,
) -> Result<Tensor> {
    let op = Attend { keys, scale };
    Ok(q.contiguous()?.apply_op3_no_bwd(k, v, &op)?)
}

struct Attend<'a> {
    keys: &'a KeyTables,
    scale: f32,
}

impl Attend<'_> {
    /// Launches the kernel for element type `T` (`name`).
    #[allow(unsafe_code, reason = "launching a CUDA kernel is an FFI call")]
    fn launch<T: CudaDType + DeviceRepr + ValidAsZeroBits>(
        &self,
        name: &str,
        (q, lq): (&CudaStorage, &Layout),
        (k, lk): (&CudaStorage, &Layout),
        (v, lv): (&CudaStorage, &Layout),
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (_, heads, n, d) = lq.shape().dims4()?;
        let (_, kv_heads, _, kd) = lk.shape().dims4()?;
        let rows_adjacent = |l: &Layout| l.stride()[2] == d && l.stride()[3] == 1;
        if kd != d
            || lv.shape() != lk.shape()
            || lv.stride() != lk.stride()
            || d > MAX_HEAD_DIM
            || heads % kv_heads != 0
            || !lq.is_contiguous()
            || !rows_adjacent(lk)
        {
            candle_core::bail!(
                "{MODULE}: q {:?}, k {:?} (strides {:?}), v {:?} (heads up to {MAX_HEAD_DIM} wide)",
                lq.shape(),
                lk.shape(),
                lk.stride(),
                lv.shape()
            );
        }
        let dev = q.device();
        let q = q.as_cuda_slice::<T>()?.slice(lq.start_offset()..);
        let k = k.as_cuda_slice::<T>()?.slice(lk.start_offset()..);
        let v = v.as_cuda_slice::<T>()?.slice(lv.start_offset()..);
        let (rows, rows_layout) = self.keys.rows.storage_and_layout();
        let (paths, paths_layout) = self.keys.paths.storage_and_layout();
        let (Storage::Cuda(rows), Storage::Cuda(paths)) = (&*rows, &*paths) else {
            candle_core::bail!("{MODULE}: its key tables are not on the GPU");
        };
        let rows = rows
            .as_cuda_slice::<u32>()?
            .slice(rows_layout.start_offset()..);
        let paths = paths
            .as_cuda_slice::<u32>()?
            .slice(paths_layout.start_offset()..);
        let out = dev.alloc_zeros::<T>(n * heads * d)?;
        let func = dev.get_or_load_custom_func(name, MODULE, ptx()?)?;
        let dims = [n, heads, kv_heads].map(|x| u32::try_from(x).unwrap_or(u32::MAX));
        let kv_stride = lk.stride()[1] as u64;
        let (d, max_path) = (d as u32, self.keys.max_path as u32);
        let mut launch = func.builder();
        launch
            .arg(&q)
            .arg(&k)
            .arg(&v)
            .arg(&rows)
            .arg(&paths)
            .arg(&out);
        launch
            .arg(&dims[0])
            .arg(&dims[1])
            .arg(&dims[2])
            .arg(&kv_stride);
        launch.arg(&d).arg(&max_path).arg(&self.scale);
        let cfg = LaunchConfig {
            grid_dim: (dims[1], dims[0], 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature (q, k, v of the shapes and strides
        // checked above, the row table of 3n and the path table of n × max_path entries, the
        // output of n · heads · d, then n, heads, kv_heads, the key heads' stride, d, max_path
        // and the scale), and every key index the kernel reads is below the stored keys' count
        // (the tables are built from it).
        unsafe { launch.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((1, n, heads * d as usize)),
        ))
    }
}

impl CustomOp3 for Attend<'_> {
    fn name(&self) -> &'static str {
        MODULE
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
        candle_core::bail!("{MODULE} runs on CUDA devices only")
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        lq: &Layout,
        k: &CudaStorage,
        lk: &Layout,
        v: &CudaStorage,
        lv: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let args = ((q, lq), (k, lk), (v, lv));
        match q.dtype() {
            DType::F32 => self.launch::<f32>("tandem_attention_f32", args.0, args.1, args.2),
            DType::BF16 => self.launch::<bf16>("tandem_attention_bf16", args.0, args.1, args.2),
            DType::F16 => self.launch::<f16>("tandem_attention_f16", args.0, args.1, args.2),
            other => candle_core::bail!("{MODULE}: no kernel for {other:?}"),
        }
    }
}
