//! The kernels against the reference (dequantize, then an f64 dot product), on every path this
//! CPU runs, and their batch invariance.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use super::kpanels::KPanels;
use super::panels::{Blocks, Dense};
use super::rows::Path;

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
        Dense::new(path, w.to_vec(), out_dim, in_dim).matmul(x, rows, &mut dst);
        return dst;
    }
    let t = Tensor::from_slice(w, (out_dim, in_dim), &Device::Cpu).expect("tensor");
    let q = QTensor::quantize(&t, dtype).expect("quantize");
    if matches!(dtype, GgmlDType::F16 | GgmlDType::BF16) {
        Dense::half(path, &q)
            .expect("dense")
            .matmul(x, rows, &mut dst);
        return dst;
    }
    match dtype {
        GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K => KPanels::new(path, &q)
            .expect("panels")
            .matmul(x, rows, &mut dst),
        _ => Blocks::new(path, Arc::new(q))
            .expect("blocks")
            .matmul(x, rows, &mut dst)
            .expect("matmul"),
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

/// A GGUF tensor of `dtype` and `shape` (out, in) from its bytes.
fn from_bytes(bytes: Vec<u8>, dtype: GgmlDType, shape: (usize, usize)) -> QTensor {
    let storage = candle_core::quantized::QStorage::from_data(
        std::borrow::Cow::Owned(bytes),
        &Device::Cpu,
        dtype,
    )
    .expect("storage");
    QTensor::new(storage, shape).expect("qtensor")
}

/// Whether two results are the same bit for bit (and as long).
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

const TYPES: [GgmlDType; 11] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
    GgmlDType::F32,
    GgmlDType::F16,
    GgmlDType::BF16,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

/// The paths that run `dtype`: the K-quants have two kernels, the AVX2 panels (on AVX-512 CPUs
/// without VNNI too) and their products by VNNI.
fn paths(dtype: GgmlDType) -> Vec<Path> {
    let all = Path::available();
    if matches!(dtype, GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K) {
        let paths: Vec<Path> = all
            .into_iter()
            .filter(|p| matches!(p, Path::Avx2 | Path::Avx512Vnni))
            .collect();
        if paths.is_empty() {
            eprintln!("{dtype:?}: no AVX2 on this CPU, its kernels are not tested here");
        }
        paths
    } else {
        all
    }
}

/// Asserts that every path running `dtype` gives `w` · `x` as the dequantized weight does, within
/// the rounding of the activations (8 bits for the quantized types, none for the dense ones).
fn check_against_the_reference(dtype: GgmlDType, w: &[f32], x: &[f32], mkn: (usize, usize, usize)) {
    let (rows, in_dim, out_dim) = mkn;
    let reference = dequantized(dtype, w, out_dim, in_dim);
    // Quantized activations: each product is off by at most half a step of 1/127 of its
    // block's largest activation. Dense types keep f32 activations: only the sums' rounding.
    let dense = matches!(dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
    let tolerance = if dense { 1e-5 } else { 1e-2 };
    for path in paths(dtype) {
        let got = run(dtype, path, w, x, mkn);
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

#[test]
fn every_kernel_matches_the_dequantized_product() {
    // 320 inputs (10 blocks; for f32 324, a tail past the 16-wide body; for K-quants 512, two
    // super-blocks), 37 outputs, 6 rows.
    let (rows, out_dim) = (6, 37);
    for dtype in TYPES {
        let in_dim = match dtype {
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => 324,
            GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K => 512,
            _ => 320,
        };
        let (w, x) = data(out_dim, in_dim, rows);
        check_against_the_reference(dtype, &w, &x, (rows, in_dim, out_dim));
    }
}

#[test]
fn the_largest_quants_and_activations_do_not_saturate() {
    // In each block of 32 inputs one weight −1 and the others +1 (every type's largest quant
    // for all but one), every activation +1 in one row and −1 in the other: the integer sums
    // of the kernels (16 bits before they widen) reach their bounds. Two rows and one (the
    // decode tiles), 324 inputs for the dense types (two-panel tiles over a chunk's tail).
    for dtype in TYPES {
        let in_dim = match dtype {
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => 324,
            _ => 512,
        };
        let out_dim = 37;
        let w: Vec<f32> = (0..out_dim * in_dim)
            .map(|i| if i % 32 == 0 { -1.0 } else { 1.0 })
            .collect();
        let x: Vec<f32> = (0..2 * in_dim)
            .map(|i| if i < in_dim { 1.0 } else { -1.0 })
            .collect();
        for rows in [1, 2] {
            check_against_the_reference(dtype, &w, &x[..rows * in_dim], (rows, in_dim, out_dim));
        }
    }
}

#[test]
fn the_activation_quantizer_gives_the_same_bytes_on_every_path() {
    // With max |x| = 127 the scale is 1, so every value is rounded as written: halves (away
    // from zero), the floats just beside them, zeros of both signs, the extremes.
    let mut xs = vec![127.0f32, -126.5, 0.5, -0.5, 2.5, -2.5, 0.0, -0.0];
    let beside = |v: f32| {
        [
            f32::from_bits(v.to_bits() - 1),
            f32::from_bits(v.to_bits() + 1),
        ]
    };
    for v in [0.5f32, 1.5, 2.5, 63.5, 126.5] {
        xs.extend(beside(v));
        xs.extend(beside(-v));
    }
    xs.resize(64, 3.25);
    let (_, random) = data(0, 256, 3);
    let scaled: Vec<f32> = random.iter().map(|v| v * 0.01).collect();
    let tiny: Vec<f32> = random.iter().map(|v| v * 1e-38).collect();
    for case in [&xs[..], &random, &scaled, &tiny, &[0.0; 32]] {
        let mut portable = vec![0i8; case.len()];
        let d = super::rows::portable_quantize_bytes(case, &mut portable);
        let mut fast = vec![0i8; case.len()];
        assert_eq!(
            super::rows::quantize_bytes(case, &mut fast).to_bits(),
            d.to_bits()
        );
        assert_eq!(fast, portable);
    }
    let mut q = vec![0i8; 64];
    super::rows::quantize_bytes(&xs, &mut q);
    assert_eq!(q[..6], [127, -127, 1, -1, 3, -3], "halves away from zero");
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
                    same_bits(&alone, &block[r * out_dim..][..out_dim]),
                    "{dtype:?} {path:?}: row {r} alone differs from row {r} of 9"
                );
            }
        }
    }
}

#[test]
fn blocks_past_a_tile_split_across_threads_keep_each_rows_bits() {
    // 1,100 outputs of 768 inputs: enough work for the rows to be split across threads, and
    // two chunks of inputs for the f32 panels. Blocks of 3, 7 and 17 rows leave partial tiles
    // (of 4 rows, 6 for f32, 16 for the K-quants).
    let (in_dim, out_dim) = (768, 1100);
    let (w, x) = data(out_dim, in_dim, 17);
    for dtype in TYPES {
        for path in paths(dtype) {
            let alone: Vec<Vec<f32>> = (0..17)
                .map(|r| {
                    let row = &x[r * in_dim..][..in_dim];
                    run(dtype, path, &w, row, (1, in_dim, out_dim))
                })
                .collect();
            for rows in [3, 7, 17] {
                let block = run(
                    dtype,
                    path,
                    &w,
                    &x[..rows * in_dim],
                    (rows, in_dim, out_dim),
                );
                for (r, alone) in alone.iter().enumerate().take(rows) {
                    let same = same_bits(alone, &block[r * out_dim..][..out_dim]);
                    assert!(same, "{dtype:?} {path:?}: row {r} of {rows} differs");
                }
            }
        }
    }
}

/// Causal attention in f64: (n, heads · d) for queries `q` (heads, n, d) at positions
/// `pos..pos + n` over keys and values (kv_heads, pos + n, d).
fn attention_reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: [usize; 5],
    span: super::Span,
) -> Vec<f64> {
    let [heads, kv_heads, n, pos, d] = dims;
    let seen_all = pos + n;
    let mut out = vec![0f64; n * heads * d];
    for h in 0..heads {
        let kv = h / (heads / kv_heads);
        for i in 0..n {
            let qr = &q[(h * n + i) * d..][..d];
            let first = (pos + i + 1).saturating_sub(span.window);
            let scores: Vec<f64> = (first..=pos + i)
                .map(|j| {
                    let kr = &k[(kv * seen_all + j) * d..][..d];
                    qr.iter()
                        .zip(kr)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum::<f64>()
                        * f64::from(span.scale)
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = weights.iter().sum();
            for (j, w) in (first..).zip(&weights) {
                for c in 0..d {
                    let value = f64::from(v[(kv * seen_all + j) * d + c]);
                    out[(i * heads + h) * d + c] += w / sum * value;
                }
            }
        }
    }
    out
}

#[test]
fn attention_reads_the_cache_in_place_and_matches_the_reference() {
    // A cache allocated for 40 positions holding 23 (20 before a block of 3), and one long
    // enough for the rows to be split across threads; 4 query heads sharing 2 kv heads of 16;
    // every position seen, or a sliding window (Gemma's local layers) with another scale.
    let all = super::Span {
        scale: 0.25,
        window: usize::MAX,
    };
    let window = |window| super::Span { scale: 0.2, window };
    for (capacity, pos, span) in [
        (40, 20, all),
        (1600, 1400, all),
        (40, 20, window(7)),
        (1600, 1400, window(300)),
    ] {
        attention_case(capacity, pos, span);
    }
}

fn attention_case(capacity: usize, pos: usize, span: super::Span) {
    let (heads, kv_heads, d, n) = (4, 2, 16, 3);
    let seen = pos + n;
    let (kv, qv) = data(2 * kv_heads * capacity, d, heads * n);
    let device = Device::Cpu;
    let cache = Tensor::from_slice(&kv, (2, kv_heads, capacity, d), &device).expect("cache");
    let view = |i: usize| {
        cache
            .narrow(0, i, 1)
            .and_then(|t| t.narrow(2, 0, seen))
            .expect("view")
    };
    let (k, v) = (view(0), view(1));
    let q = Tensor::from_slice(&qv, (1, heads, n, d), &device).expect("q");
    let got = super::attention_cpu(&[(q.clone(), vec![(k.clone(), v.clone())])], &[], span)
        .expect("attention");
    let got: Vec<f32> = got.flatten_all().and_then(|t| t.to_vec1()).expect("vec");
    let flat = |t: &Tensor| -> Vec<f32> { t.flatten_all().and_then(|t| t.to_vec1()).expect("vec") };
    let reference = attention_reference(
        &qv,
        &flat(&k),
        &flat(&v),
        [heads, kv_heads, n, pos, d],
        span,
    );
    for (i, (a, b)) in got.iter().zip(&reference).enumerate() {
        assert!(
            (f64::from(*a) - b).abs() < 1e-5,
            "{pos}, {i}: {a} against {b}"
        );
    }
    // Each row as a decode step over the positions it sees: the same bits, alone and with the
    // other rows' steps as the sequences of one batched call.
    let steps: Vec<_> = (0..n)
        .map(|i| {
            let q_row = q.narrow(2, i, 1).expect("row");
            let k_row = k.narrow(2, 0, pos + i + 1).expect("keys");
            let v_row = v.narrow(2, 0, pos + i + 1).expect("values");
            (q_row, vec![(k_row, v_row)])
        })
        .collect();
    for (i, step) in steps.iter().enumerate() {
        let alone = super::attention_cpu(std::slice::from_ref(step), &[], span).expect("attention");
        let alone: Vec<f32> = alone.flatten_all().and_then(|t| t.to_vec1()).expect("vec");
        let in_block = &got[i * heads * d..][..heads * d];
        assert!(
            same_bits(&alone, in_block),
            "row {i} alone differs from row {i} of the block"
        );
    }
    let batched = super::attention_cpu(&steps, &[], span).expect("attention");
    let batched: Vec<f32> = batched
        .flatten_all()
        .and_then(|t| t.to_vec1())
        .expect("vec");
    assert!(
        same_bits(&batched, &got),
        "the rows as a batch of sequences differ from the block"
    );
}

#[test]
fn a_long_prefill_gives_its_scratch_back() {
    // 1,100 rows of a 4,096-wide output: 18 MB of column-major results during the call, as a
    // long prefill's matmuls need.
    let (rows, in_dim, out_dim) = (1100, 64, 4096);
    let (w, x) = data(out_dim, in_dim, rows);
    let dst = run(
        GgmlDType::F32,
        Path::detect(),
        &w,
        &x,
        (rows, in_dim, out_dim),
    );
    assert_eq!(dst.len(), rows * out_dim);
    // Kept through the forward (each matmul of a prefill reuses it), given back at its end.
    assert!(super::scratch_bytes() > 16 << 20);
    super::trim_scratch();
    let kept = super::scratch_bytes();
    assert!(
        kept <= 16 << 20,
        "{kept} bytes of scratch kept after the forward"
    );
}

#[test]
fn tiles_of_a_fixed_row_count_give_the_whole_product() {
    // The GPU's tiled product (exercised here on the CPU): every row count, a tile's edge
    // included, and a leading batch axis, as candle's one product of all rows.
    let (out_dim, in_dim) = (24, 40);
    let (w, x) = data(out_dim, in_dim, 130);
    let w = Tensor::from_vec(w, (out_dim, in_dim), &Device::Cpu).expect("weight");
    let tiled = super::Matmul::Tiled(w.clone());
    for rows in [1, 63, 64, 65, 130] {
        let xs = Tensor::from_vec(x[..rows * in_dim].to_vec(), (1, rows, in_dim), &Device::Cpu)
            .expect("rows");
        let got = tiled.forward(&xs).expect("tiled");
        assert_eq!(got.dims(), &[1, rows, out_dim]);
        let want = xs.broadcast_matmul(&w.t().expect("t")).expect("product");
        let diff = (got - want)
            .expect("diff")
            .abs()
            .expect("abs")
            .flatten_all()
            .expect("flat")
            .max(0)
            .expect("max")
            .to_scalar::<f32>()
            .expect("scalar");
        assert!(diff < 1e-4, "{rows} rows: max |Δ| = {diff}");
    }
}

#[test]
fn blocks_on_vnni_give_the_avx2_panels_bits() {
    // The VNNI kernels' integer sums are exact and their float operations the AVX2 panels': the
    // same bits for every row, whether it ran alone, in the decode tile (of as many panels as
    // this CPU reads best at a time) or the multi-row tiles (1,100 outputs: a remainder past
    // the panels of four; 9 rows: tiles of 5 and 4). For Q8_0, weights of −128 (a file may hold them; the quantizer never writes
    // them) included.
    if Path::detect() < Path::Avx512Vnni {
        eprintln!("no AVX-512 VNNI on this CPU: its block kernels are not tested here");
        return;
    }
    let (in_dim, out_dim) = (768, 1100);
    let (w, x) = data(out_dim, in_dim, 9);
    let t = Tensor::from_slice(&w, (out_dim, in_dim), &Device::Cpu).expect("tensor");
    for dtype in [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
    ] {
        let q = QTensor::quantize(&t, dtype).expect("quantize");
        let mut bytes = q.data().expect("bytes").to_vec();
        if dtype == GgmlDType::Q8_0 {
            // Block 0 of every row (34 bytes a block: the scale, then 32 quants): its first
            // quant −128.
            for row in 0..out_dim {
                bytes[row * (in_dim / 32) * 34 + 2] = 0x80;
            }
        }
        let q = Arc::new(from_bytes(bytes, dtype, (out_dim, in_dim)));
        let product = |path: Path, rows: usize| {
            let mut dst = vec![0f32; rows * out_dim];
            Blocks::new(path, q.clone())
                .expect("blocks")
                .matmul(&x[..rows * in_dim], rows, &mut dst)
                .expect("matmul");
            dst
        };
        for rows in [1, 2, 9] {
            assert!(
                same_bits(&product(Path::Avx2, rows), &product(Path::Avx512Vnni, rows)),
                "{dtype:?}, {rows} rows: the VNNI kernel differs from the AVX2 panels"
            );
        }
    }
}

#[test]
fn k_quants_on_vnni_give_the_avx2_panels_bits() {
    // `vpdpbusd`'s 32-bit sums are the AVX2 kernels' 16-bit pair sums, exactly: the same bits
    // for every row, in tiles of 4 and their remainders (1 to 9 rows), over two super-blocks,
    // split across threads (1,100 outputs), with the largest quants (a weight of ±1 in every
    // block of 32) in one of the cases.
    if Path::detect() < Path::Avx512Vnni {
        eprintln!("no AVX-512 VNNI on this CPU: its K-quant kernels are not tested here");
        return;
    }
    let (in_dim, out_dim) = (512, 1100);
    let (w, x) = data(out_dim, in_dim, 9);
    let extreme: Vec<f32> = (0..out_dim * in_dim)
        .map(|i| if i % 32 == 0 { -1.0 } else { 1.0 })
        .collect();
    for dtype in [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K] {
        for w in [&w, &extreme] {
            for rows in [1, 2, 3, 4, 5, 9] {
                let mkn = (rows, in_dim, out_dim);
                let x = &x[..rows * in_dim];
                assert!(
                    same_bits(
                        &run(dtype, Path::Avx2, w, x, mkn),
                        &run(dtype, Path::Avx512Vnni, w, x, mkn)
                    ),
                    "{dtype:?}, {rows} rows: the VNNI kernel differs from the AVX2 panels"
                );
            }
        }
    }
}

#[test]
#[cfg(target_arch = "x86_64")]
#[allow(
    unsafe_code,
    reason = "calls the x86 block kernels on the paths this CPU runs"
)]
fn a_one_row_tile_gives_the_same_bits_however_many_panels_it_reads() {
    // The panels a one-row tile reads at a time are measured per CPU (`panels::decode_panels`): both
    // choices give every output the same bits, for every block type (1,100 outputs: panels
    // past the last whole group of four).
    let (in_dim, out_dim) = (768, 1100);
    let (w, x) = data(out_dim, in_dim, 1);
    let mut xq = vec![super::rows::Q8::default(); in_dim / 32];
    super::rows::quantize(&x, &mut xq);
    let t = Tensor::from_slice(&w, (out_dim, in_dim), &Device::Cpu).expect("tensor");
    for path in [Path::Avx2, Path::Avx512Vnni] {
        if Path::detect() < path {
            eprintln!("{path:?}: not on this CPU, its one-row tiles are not tested here");
            continue;
        }
        let (lanes, many) = if path == Path::Avx2 {
            (8, super::x86_panels::DECODE_PANELS)
        } else {
            (16, super::x86_vnni::DECODE_PANELS)
        };
        let panels = out_dim.div_ceil(lanes);
        for dtype in [GgmlDType::Q4_0, GgmlDType::Q5_1, GgmlDType::Q8_0] {
            let q = Arc::new(QTensor::quantize(&t, dtype).expect("quantize"));
            let b = Blocks::new(path, q).expect("blocks");
            let data = b.panels().expect("panels");
            let run = |streams: usize| {
                let mut out = vec![0f32; panels * lanes];
                let (nb, xq) = (in_dim / 32, &xq[..]);
                macro_rules! run {
                    ($m:ident, $b:ty) => {
                        // SAFETY: the CPU runs `path` (checked above); whole panels, one row.
                        unsafe {
                            super::$m::blocks::<$b>(streams, data, nb, 0..panels, xq, 1, &mut out)
                        }
                    };
                }
                use super::rows::layout::{Q4_0, Q5_1, Q8_0};
                match (path, dtype) {
                    (Path::Avx2, GgmlDType::Q4_0) => run!(x86_panels, Q4_0),
                    (Path::Avx2, GgmlDType::Q5_1) => run!(x86_panels, Q5_1),
                    (Path::Avx2, _) => run!(x86_panels, Q8_0),
                    (_, GgmlDType::Q4_0) => run!(x86_vnni, Q4_0),
                    (_, GgmlDType::Q5_1) => run!(x86_vnni, Q5_1),
                    _ => run!(x86_vnni, Q8_0),
                }
                out
            };
            assert!(
                same_bits(&run(1), &run(many)),
                "{path:?} {dtype:?}: one panel at a time differs from {many}"
            );
        }
    }
}

#[test]
fn a_fused_weight_gives_each_parts_own_bits() {
    // Layers that read the same input fused when a model loads (their GGUF bytes in turn): each
    // output is its own layer's, bit for bit, for every type and kernel, one row and a block.
    // 37 + 64 + 21 outputs: the parts' edges fall inside the panels.
    let (in_dim, dims) = (512, [37, 64, 21]);
    let total: usize = dims.iter().sum();
    let (w, x) = data(total, in_dim, 9);
    let x = Tensor::from_vec(x, (1, 9, in_dim), &Device::Cpu).expect("rows");
    for dtype in TYPES {
        let mut parts = Vec::new();
        let mut bytes = Vec::new();
        let mut at = 0;
        for d in dims {
            let t = Tensor::from_slice(
                &w[at * in_dim..(at + d) * in_dim],
                (d, in_dim),
                &Device::Cpu,
            )
            .expect("part");
            let q = QTensor::quantize(&t, dtype).expect("quantize");
            bytes.extend_from_slice(&q.data().expect("bytes"));
            parts.push(super::Matmul::quantized(Arc::new(q)).expect("part"));
            at += d;
        }
        let fused = from_bytes(bytes, dtype, (total, in_dim));
        let fused = super::Matmul::quantized(Arc::new(fused)).expect("fused");
        for rows in [1, 9] {
            let xs = x.narrow(1, 0, rows).expect("rows");
            let all = fused.forward(&xs).expect("fused product");
            let mut at = 0;
            for (part, d) in parts.iter().zip(dims) {
                let own = part.forward(&xs).expect("part product");
                let flat = |t: &Tensor| {
                    t.flatten_all()
                        .expect("flat")
                        .to_vec1::<f32>()
                        .expect("vec")
                };
                let mine = all
                    .narrow(2, at, d)
                    .expect("narrow")
                    .contiguous()
                    .expect("copy");
                assert!(
                    same_bits(&flat(&own), &flat(&mine)),
                    "{dtype:?}, {rows} rows: outputs {at}..{} differ from their own layer's",
                    at + d
                );
                at += d;
            }
        }
    }
}

#[test]
fn dense_weights_on_avx512_give_the_avx2_panels_bits() {
    // One 16-lane fused multiply-add per input where AVX2 runs two of 8, in the same order from
    // zero: the same bits for every row, in the two-panel tiles of every row (up to 6 rows), the
    // two-panel tiles of 7 to 12 and their remainders (13 rows), a last panel alone, over a
    // chunk's tail (200 inputs) and split across threads (1,100 outputs).
    if Path::detect() < Path::Avx512 {
        eprintln!("no AVX-512 on this CPU: its dense kernels are not tested here");
        return;
    }
    let (in_dim, out_dim) = (200, 1100);
    let (w, x) = data(out_dim, in_dim, 13);
    for dtype in [GgmlDType::F32, GgmlDType::F16, GgmlDType::BF16] {
        for rows in [1, 3, 7, 13] {
            let mkn = (rows, in_dim, out_dim);
            let x = &x[..rows * in_dim];
            assert!(
                same_bits(
                    &run(dtype, Path::Avx2, &w, x, mkn),
                    &run(dtype, Path::Avx512, &w, x, mkn)
                ),
                "{dtype:?}, {rows} rows: the AVX-512 tiles differ from the AVX2 panels"
            );
        }
    }
}

#[test]
fn the_isa_cap_holds_the_kernels_below_it() {
    // The path is chosen once per process: this test runs itself again, capped at each path,
    // and there (the variable set) checks the path and that no kernel above it is chosen.
    const NAME: &str = "kernels::tests::the_isa_cap_holds_the_kernels_below_it";
    if let Ok(value) = std::env::var(super::MAX_CPU_ISA) {
        let cap = Path::named(&value).expect("a cap the parent names");
        assert_eq!(Path::detect(), cap.min(Path::cpu()), "{value}");
        assert_eq!(super::cpu_path(), Path::detect().name());
        // Q8_0 in a shape candle repacks: candle's VNNI kernel only where the cap allows VNNI.
        let t = Tensor::zeros((32, 256), candle_core::DType::F32, &Device::Cpu).expect("zeros");
        let q = QTensor::quantize(&t, GgmlDType::Q8_0).expect("quantize");
        let matmul = super::Matmul::quantized(Arc::new(q)).expect("matmul");
        if cap < Path::Avx512Vnni {
            assert!(
                !matches!(matmul, super::Matmul::Repacked(_)),
                "{value}: candle's VNNI"
            );
        }
        return;
    }
    for path in Path::ALL {
        for name in [path.name().to_string(), path.name().to_uppercase()] {
            assert_eq!(Path::named(&name), Some(path), "{name}");
            let out = std::process::Command::new(std::env::current_exe().expect("exe"))
                .args(["--exact", NAME, "--test-threads", "1"])
                .env(super::MAX_CPU_ISA, &name)
                .output()
                .expect("the test binary again");
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && stdout.contains("1 passed"),
                "capped at {name}: {stdout}{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    assert_eq!(Path::named("avx-512"), None);
}

#[cfg(target_arch = "x86_64")]
#[test]
fn a_group_of_heads_in_registers_has_the_portable_rows_bits() {
    use super::attention::{QRows, Rows, attend_each};
    if Path::detect() == Path::Portable {
        eprintln!("no AVX2 and FMA on this CPU: the register rows never run here");
        return;
    }
    // Head sizes of 1, 4, 5 and 8 registers of values (the 64-column blocks and the 8s); groups
    // of 1, 3 and 7 heads, their query rows a stride apart; keys in two pieces (a shared prefix,
    // then the sequence's own) of a part tile and of tiles and a remainder, neither a multiple
    // of the keys scored together; a zero key (a score of ±0).
    for (d, group) in [(16, 1), (64, 7), (80, 3), (128, 3)] {
        // Keys then values, 37 + 130 rows each; the query rows.
        let (mut kv, q) = data(2 * (37 + 130), d, group * 3);
        kv[5 * d..6 * d].fill(0.0);
        let (k, v) = kv.split_at(167 * d);
        let ((k1, k2), (v1, v2)) = (k.split_at(37 * d), v.split_at(37 * d));
        let q = QRows {
            first: &q,
            stride: 3 * d,
            d,
        };
        let pieces = [(k1, v1), (k2, v2)];
        let rows = Rows {
            pieces: &pieces,
            d,
            scale: 0.125,
        };
        let (mut portable, mut registers) = (vec![0f32; group * d], vec![0f32; group * d]);
        let mut scores = Vec::new();
        attend_each::<true>(q, rows, &mut scores, &mut portable);
        // SAFETY: Path::detect found AVX2 and FMA; d and the group fit; the pieces are whole
        // rows.
        #[allow(unsafe_code, reason = "a target-feature function, features checked")]
        unsafe {
            super::x86_attention::attend(q, rows, &mut scores, &mut registers)
        };
        assert!(
            same_bits(&registers, &portable),
            "head size {d}, {group} heads"
        );
    }
}
