//! Batch-invariant matrix products of activations (rows) with a weight (out × in), quantized or
//! dense, on the CPU; on a GPU, dense products in tiles of a fixed number of rows.

use std::sync::Arc;

use candle_core::quantized::k_quants::{
    self, BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K,
    BlockQ6K, BlockQ8_0, BlockQ8K,
};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Module, Tensor};
use half::{bf16, f16};

use super::kpanels::KPanels;
use super::kquants;
use super::panels::{Blocks, Dense};
use super::rows::{self, Path, layout};
use crate::Result;

/// Types whose candle CPU kernel on x86-64 (its repacked AVX2 / AVX-512 kernel) is the same for
/// one row and for up to [`REPACKED_ROWS`] rows, and faster than the row-by-row product: kept on
/// candle, in calls of at most that many rows (from 32 rows candle switches Q4_K to an AMX kernel
/// where the CPU has one). Q6_K is not among them (candle repacks it only for several rows), nor
/// is any type on other architectures (aarch64 tiles rows in fours). Q4_K reaches it only on an
/// x86-64 CPU without AVX2 (the panels take it everywhere else), Q8_0 only on one with AVX-VNNI
/// but not AVX-512's (the panels' VNNI kernel takes it there: 0.86-0.89× candle's time for one
/// row from DRAM, 0.76-0.82× for 9). The every-type test checks the claim on the machine that
/// runs the tests.
#[cfg(target_arch = "x86_64")]
const REPACKED: &[GgmlDType] = &[GgmlDType::Q8_0, GgmlDType::Q4K];
#[cfg(not(target_arch = "x86_64"))]
const REPACKED: &[GgmlDType] = &[];

/// Whether candle repacks this weight (as its `repack_x86::select` decides): 16 outputs to a
/// tile, inputs in super-blocks of 256, and for Q8_0 a CPU with VNNI. Otherwise candle would
/// multiply it row by row (the 0.5B Qwen's Q8_0 output projection, 896 inputs, was 10 % of a
/// decode step there): the blocks-of-32 kernels take it instead.
fn candle_repacks(t: &QTensor) -> Result<bool> {
    let (out_dim, in_dim) = t.shape().dims2()?;
    if !out_dim.is_multiple_of(16) || !in_dim.is_multiple_of(kquants::QK_K) {
        return Ok(false);
    }
    // A cap below VNNI (`TANDEM_MAX_CPU_ISA`) stands for a CPU without it: none then.
    #[cfg(target_arch = "x86_64")]
    let vnni = Path::cap().is_none_or(|cap| cap >= Path::Avx512Vnni)
        && ((std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vnni"))
            || (std::arch::is_x86_feature_detected!("avxvnni")
                && std::arch::is_x86_feature_detected!("avx2")));
    #[cfg(not(target_arch = "x86_64"))]
    let vnni = false;
    Ok(t.dtype() != GgmlDType::Q8_0 || vnni)
}

/// Rows per call of a repacked kernel.
const REPACKED_ROWS: usize = 16;

/// Rows of every product by a weight on a GPU (the last tile padded with zeros): a row's result
/// then comes from the same cuBLAS kernel, summing in the same order, whether it ran alone (a
/// decode step), in a verify block or beside other sessions' rows. A decode step pays for
/// 64 rows, which on a GPU costs what one does (the weights' reads dominate); a batch of more
/// rows reads the weights once per tile.
const GPU_ROWS: usize = 64;

/// Zero rows a forward pass of `rows` appends on `device` so that its products need no padding
/// of their own (whole [`GPU_ROWS`] tiles off the CPU; none on it).
pub(crate) fn tile_padding(device: &candle_core::Device, rows: usize) -> usize {
    if device.is_cpu() {
        0
    } else {
        rows.next_multiple_of(GPU_ROWS) - rows
    }
}

/// A linear layer's weight and the kernel that multiplies by it.
pub(crate) enum Matmul {
    /// A GGUF tensor on the CPU of a type stored in blocks of 32 ([`rows`]' or [`super::panels`]'
    /// kernels).
    Blocks(Blocks),
    /// A Q4_K, Q5_K or Q6_K tensor on a CPU with AVX2: panels.
    KPanels(KPanels),
    /// A GGUF tensor on the CPU.
    Quantized(Arc<QTensor>),
    /// A GGUF tensor on the CPU of a [`REPACKED`] type.
    Repacked(QMatMul),
    /// A dense f32, f16 or bf16 weight on the CPU.
    Dense(Dense),
    /// A dense weight on a GPU: candle's product, [`GPU_ROWS`] rows at a time.
    Tiled(Tensor),
    /// A dense f16 or bf16 weight on the CPU: candle's kernels.
    Candle(QMatMul),
}

impl Matmul {
    /// A quantized weight: batch-invariant on the CPU; on a GPU dequantized to f32 (candle's
    /// quantized products there change kernels with the number of rows).
    pub(crate) fn quantized(t: Arc<QTensor>) -> Result<Self> {
        if t.dtype() == GgmlDType::F32 || !t.device().is_cpu() {
            return Self::dense(t.dequantize(&t.device())?);
        }
        if matches!(t.dtype(), GgmlDType::F16 | GgmlDType::BF16) {
            return Ok(Self::Dense(Dense::half(Path::detect(), &t)?));
        }
        // Q8_0 on AVX-512 with VNNI: the panels' own VNNI kernel (faster than candle's there).
        let vnni_q8_0 = t.dtype() == GgmlDType::Q8_0 && Path::detect() == Path::Avx512Vnni;
        Ok(
            if Path::detect() >= Path::Avx2
                && matches!(t.dtype(), GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K)
                && t.shape().dims2()?.1 % kquants::QK_K == 0
            {
                Self::KPanels(KPanels::new(Path::detect(), &t)?)
            } else if REPACKED.contains(&t.dtype()) && !vnni_q8_0 && candle_repacks(&t)? {
                Self::Repacked(QMatMul::from_arc(t)?)
            } else if matches!(
                t.dtype(),
                GgmlDType::Q4_0
                    | GgmlDType::Q4_1
                    | GgmlDType::Q5_0
                    | GgmlDType::Q5_1
                    | GgmlDType::Q8_0
            ) && t.shape().dims2()?.1 % rows::QK == 0
            {
                Self::Blocks(Blocks::new(Path::detect(), t)?)
            } else {
                Self::Quantized(t)
            },
        )
    }

    /// A dense (out, in) weight: batch-invariant on the CPU in f32 and on a GPU.
    pub(crate) fn dense(w: Tensor) -> Result<Self> {
        if !w.device().is_cpu() {
            return Ok(Self::Tiled(w));
        }
        if w.dtype() != candle_core::DType::F32 {
            return Ok(Self::Candle(QMatMul::Tensor(w)));
        }
        let (out_dim, in_dim) = w.dims2()?;
        let weight = w.flatten_all()?.to_vec1::<f32>()?;
        Ok(Self::Dense(Dense::new(
            Path::detect(),
            weight,
            out_dim,
            in_dim,
        )))
    }

    /// `xs` (…, in) → (…, out).
    pub(crate) fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let (out_dim, in_dim) = match self {
            Self::Candle(m) => return Ok(m.forward(xs)?),
            Self::Repacked(m) => return in_tiles(xs, REPACKED_ROWS, false, |x| m.forward(x)),
            Self::Tiled(w) => {
                let wt = w.t()?;
                return in_tiles(xs, GPU_ROWS, true, |x| x.matmul(&wt));
            }
            Self::Quantized(t) => t.shape().dims2()?,
            Self::Blocks(b) => b.dims(),
            Self::KPanels(k) => k.dims(),
            Self::Dense(d) => d.dims(),
        };
        let mut dims = xs.dims().to_vec();
        let rows = xs.elem_count() / in_dim;
        let lhs = xs.flatten_all()?.to_vec1::<f32>()?;
        let mut dst = vec![0f32; rows * out_dim];
        let mkn = (rows, in_dim, out_dim);
        match self {
            Self::Quantized(t) => quantized(t, mkn, &lhs, &mut dst)?,
            Self::Blocks(b) => b.matmul(&lhs, rows, &mut dst)?,
            Self::KPanels(k) => k.matmul(&lhs, rows, &mut dst),
            Self::Dense(d) => d.matmul(&lhs, rows, &mut dst),
            Self::Candle(_) | Self::Repacked(_) | Self::Tiled(_) => unreachable!("returned above"),
        }
        if let Some(last) = dims.last_mut() {
            *last = out_dim;
        }
        Ok(Tensor::from_vec(dst, dims, xs.device())?)
    }
}

/// `product` of `xs` (…, in) at most `tile` rows at a time (exactly `tile`, the last padded with
/// zeros, where `pad`), as (…, out).
fn in_tiles(
    xs: &Tensor,
    tile: usize,
    pad: bool,
    product: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
) -> Result<Tensor> {
    let dims = xs.dims().to_vec();
    let in_dim = dims.last().copied().unwrap_or(0);
    let rows = xs.elem_count() / in_dim.max(1);
    if rows <= tile && !pad {
        return Ok(product(xs)?);
    }
    let mut flat = xs.reshape((rows, in_dim))?;
    let padded = rows.div_ceil(tile) * tile;
    if pad && padded > rows {
        let zeros = Tensor::zeros((padded - rows, in_dim), xs.dtype(), xs.device())?;
        flat = Tensor::cat(&[flat, zeros], 0)?;
    }
    let parts = (0..rows)
        .step_by(tile)
        .map(|start| {
            let len = if pad { tile } else { tile.min(rows - start) };
            product(&flat.narrow(0, start, len)?)
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let ys = Tensor::cat(&parts, 0)?.narrow(0, 0, rows)?;
    let mut out = dims;
    if let Some(last) = out.last_mut() {
        *last = ys.dim(1)?;
    }
    Ok(ys.reshape(out)?)
}

/// Runs [`rows`]' kernel for the tensor's block type.
pub(super) fn blocks(
    t: &QTensor,
    mkn: (usize, usize, usize),
    lhs: &[f32],
    dst: &mut [f32],
) -> candle_core::Result<()> {
    let data = t.data()?;
    match t.dtype() {
        GgmlDType::Q4_0 => rows::matmul_blocks(cast::<layout::Q4_0>(&data)?, mkn, lhs, dst),
        GgmlDType::Q4_1 => rows::matmul_blocks(cast::<layout::Q4_1>(&data)?, mkn, lhs, dst),
        GgmlDType::Q5_0 => rows::matmul_blocks(cast::<layout::Q5_0>(&data)?, mkn, lhs, dst),
        GgmlDType::Q5_1 => rows::matmul_blocks(cast::<layout::Q5_1>(&data)?, mkn, lhs, dst),
        GgmlDType::Q8_0 => rows::matmul_blocks(cast::<layout::Q8_0>(&data)?, mkn, lhs, dst),
        other => candle_core::bail!("no block-of-32 kernel for GGUF type {other:?}"),
    }
    Ok(())
}

/// Runs llama.cpp's row-by-row product for the tensor's block type.
fn quantized(
    t: &QTensor,
    mkn: (usize, usize, usize),
    lhs: &[f32],
    dst: &mut [f32],
) -> candle_core::Result<()> {
    let data = t.data()?;
    macro_rules! run {
        ($ty:ty) => {
            k_quants::matmul::<$ty>(mkn, lhs, cast::<$ty>(&data)?, dst)
        };
    }
    match t.dtype() {
        GgmlDType::F32 => run!(f32),
        GgmlDType::F16 => run!(f16),
        GgmlDType::BF16 => run!(bf16),
        GgmlDType::Q4_0 => run!(BlockQ4_0),
        GgmlDType::Q4_1 => run!(BlockQ4_1),
        GgmlDType::Q5_0 => run!(BlockQ5_0),
        GgmlDType::Q5_1 => run!(BlockQ5_1),
        GgmlDType::Q8_0 => run!(BlockQ8_0),
        GgmlDType::Q2K => run!(BlockQ2K),
        GgmlDType::Q3K => run!(BlockQ3K),
        GgmlDType::Q4K => run!(BlockQ4K),
        GgmlDType::Q5K => run!(BlockQ5K),
        GgmlDType::Q6K => run!(BlockQ6K),
        GgmlDType::Q8K => run!(BlockQ8K),
        other => candle_core::bail!("no CPU matmul for GGUF type {other:?}"),
    }
}

/// The blocks of a tensor's storage, as candle's block type or as its GGUF layout
/// ([`rows::layout`]).
#[allow(
    unsafe_code,
    reason = "candle stores a quantized tensor as a Vec of its block type and hands it out as bytes"
)]
pub(super) fn cast<T>(bytes: &[u8]) -> candle_core::Result<&[T]> {
    let size = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(size)
        || !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
    {
        candle_core::bail!(
            "{} bytes at {:p} are not {} blocks",
            bytes.len(),
            bytes.as_ptr(),
            std::any::type_name::<T>()
        );
    }
    // SAFETY: the bytes are the storage of a Vec<T> (checked: whole blocks, aligned), T is a
    // plain-old-data block of integers and f16 scales, valid for any bit pattern, and the slice
    // borrows the bytes' lifetime.
    Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / size) })
}
