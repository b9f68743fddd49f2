//! The kernels against the reference (dequantize, then an f64 dot product), on every path this
//! CPU runs, and their batch invariance.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use super::kquants;
use super::matmul::cast;
use super::rows::{self, Path, layout};

/// A (out, in) weight and (rows, in) activations of fixed pseudo-random values.
fn data(out_dim: usize, in_dim: usize, rows: usize) -> (Vec<f32>, Vec<f32>) {
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let w = (0..out_dim * in_dim).map(|_| next()).collect();
    let x = (0..rows * in_dim).map(|_| next()).collect();
    (w, x)
}

/// The kernel for `dtype` on `path`: (rows × out) results.
fn run(dtype: GgmlDType, path: Path, w: &[f32], x: &[f32], mkn: (usize, usize, usize)) -> Vec<f32> {
    let (rows, in_dim, out_dim) = mkn;
    let mut dst = vec![0f32; rows * out_dim];
    if dtype == GgmlDType::F32 {
        rows::matmul_dense(path, w, mkn, x, &mut dst);
        return dst;
    }
    let t = Tensor::from_slice(w, (out_dim, in_dim), &Device::Cpu).expect("tensor");
    let q = QTensor::quantize(&t, dtype).expect("quantize");
    let bytes = q.data().expect("data");
    macro_rules! go {
        ($ty:ty) => {
            rows::matmul_blocks(path, cast::<$ty>(&bytes).expect("blocks"), mkn, x, &mut dst)
        };
    }
    match dtype {
        GgmlDType::Q4K => kquants::matmul(
            path,
            cast::<kquants::layout::Q4K>(&bytes).expect("blocks"),
            mkn,
            x,
            &mut dst,
        ),
        GgmlDType::Q6K => kquants::matmul(
            path,
            cast::<kquants::layout::Q6K>(&bytes).expect("blocks"),
            mkn,
            x,
            &mut dst,
        ),
        GgmlDType::Q4_0 => go!(layout::Q4_0),
        GgmlDType::Q4_1 => go!(layout::Q4_1),
        GgmlDType::Q5_0 => go!(layout::Q5_0),
        GgmlDType::Q5_1 => go!(layout::Q5_1),
        GgmlDType::Q8_0 => go!(layout::Q8_0),
        other => panic!("no kernel for {other:?}"),
    }
    dst
}

/// The weight as the file holds it: quantized, then dequantized.
fn dequantized(dtype: GgmlDType, w: &[f32], out_dim: usize, in_dim: usize) -> Vec<f32> {
    if dtype == GgmlDType::F32 {
        return w.to_vec();
    }
    let t = Tensor::from_slice(w, (out_dim, in_dim), &Device::Cpu).expect("tensor");
    let q = QTensor::quantize(&t, dtype).expect("quantize");
    let d = q.dequantize(&Device::Cpu).expect("dequantize");
    d.flatten_all().expect("flat").to_vec1().expect("vec")
}

const TYPES: [GgmlDType; 8] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
    GgmlDType::F32,
    GgmlDType::Q4K,
    GgmlDType::Q6K,
];

/// The paths that run `dtype`: the K-quants have an AVX-512 kernel only.
fn paths(dtype: GgmlDType) -> Vec<Path> {
    let all = Path::available();
    if matches!(dtype, GgmlDType::Q4K | GgmlDType::Q6K) {
        let paths: Vec<Path> = all.into_iter().filter(|p| *p == Path::Avx512).collect();
        if paths.is_empty() {
            eprintln!("{dtype:?}: no AVX-512 on this CPU, its kernel is not tested here");
        }
        paths
    } else {
        all
    }
}

#[test]
fn every_kernel_matches_the_dequantized_product() {
    // 320 inputs (10 blocks; for f32 324, a tail past the 16-wide body; for K-quants 512, two
    // super-blocks), 37 outputs, 6 rows.
    let (rows, out_dim) = (6, 37);
    for dtype in TYPES {
        let in_dim = match dtype {
            GgmlDType::F32 => 324,
            GgmlDType::Q4K | GgmlDType::Q6K => 512,
            _ => 320,
        };
        let (w, x) = data(out_dim, in_dim, rows);
        let reference = dequantized(dtype, &w, out_dim, in_dim);
        for path in paths(dtype) {
            let got = run(dtype, path, &w, &x, (rows, in_dim, out_dim));
            for r in 0..rows {
                for o in 0..out_dim {
                    let (wr, xr) = (
                        &reference[o * in_dim..][..in_dim],
                        &x[r * in_dim..][..in_dim],
                    );
                    let exact: f64 = wr.iter().zip(xr).map(|(a, b)| f64::from(a * b)).sum();
                    let scale: f64 = wr
                        .iter()
                        .zip(xr)
                        .map(|(a, b)| f64::from((a * b).abs()))
                        .sum();
                    // Activations quantized to 8 bits: each product is off by at most half a
                    // step of 1/127 of its block's largest activation.
                    let tolerance = if dtype == GgmlDType::F32 { 1e-5 } else { 1e-2 };
                    let err = (f64::from(got[r * out_dim + o]) - exact).abs();
                    assert!(
                        err <= tolerance * scale + 1e-6,
                        "{dtype:?} {path:?} row {r} column {o}: {} against {exact} (scale {scale})",
                        got[r * out_dim + o]
                    );
                }
            }
        }
    }
}

#[test]
fn a_row_gets_the_same_bits_in_a_block_of_any_size() {
    let (in_dim, out_dim) = (512, 300);
    let (w, x) = data(out_dim, in_dim, 9);
    for dtype in TYPES {
        for path in paths(dtype) {
            let block = run(dtype, path, &w, &x, (9, in_dim, out_dim));
            for r in 0..9 {
                let alone = run(
                    dtype,
                    path,
                    &w,
                    &x[r * in_dim..][..in_dim],
                    (1, in_dim, out_dim),
                );
                assert!(
                    alone
                        .iter()
                        .zip(&block[r * out_dim..][..out_dim])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{dtype:?} {path:?}: row {r} alone differs from row {r} of 9"
                );
            }
        }
    }
}
