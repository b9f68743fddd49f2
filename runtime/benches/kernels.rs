//! The CPU matmul kernels alone, per GGUF type, at a Qwen2.5-1.5B MLP shape (1536 → 8960): µs
//! per product and GB/s of weights read, for 1 row (a decode step) and 9 (a verify block of
//! K = 8), Tandem's kernels against candle's own (`QMatMul`), alternated, medians.
//!
//! `cargo bench -p tandem-runtime --bench kernels` (BENCH_ITERS, default 40; BENCH_TYPES;
//! BENCH_SHAPE, `in,out`, default `1536,8960`).

use std::sync::Arc;
use std::time::Instant;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use tandem_runtime::kernels::Linear;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    tandem_runtime::init_cpu_threads();
    let iters: usize = std::env::var("BENCH_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let types = std::env::var("BENCH_TYPES")
        .unwrap_or_else(|_| "q4_0,q4_1,q5_0,q5_1,q8_0,q4k,q6k,f32".into());
    let shape: Vec<usize> = std::env::var("BENCH_SHAPE")
        .unwrap_or_else(|_| "1536,8960".into())
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let [in_dim, out_dim] = shape[..] else {
        anyhow::bail!("BENCH_SHAPE: in,out");
    };
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 0.02, (out_dim, in_dim), &dev)?;
    println!(
        "threads: {}",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "| type | MB | rows | Tandem µs | GB/s | candle µs | Tandem / candle | Tandem 9 rows / 1 row |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for name in types.split(',') {
        let dtype = match name {
            "q4_0" => GgmlDType::Q4_0,
            "q4_1" => GgmlDType::Q4_1,
            "q5_0" => GgmlDType::Q5_0,
            "q5_1" => GgmlDType::Q5_1,
            "q8_0" => GgmlDType::Q8_0,
            "q4k" => GgmlDType::Q4K,
            "q5k" => GgmlDType::Q5K,
            "q6k" => GgmlDType::Q6K,
            "f32" => GgmlDType::F32,
            other => anyhow::bail!("BENCH_TYPES: unknown type {other}"),
        };
        let q = Arc::new(QTensor::quantize(&w, dtype)?);
        let bytes = q.storage_size_in_bytes() as f64;
        let ours = Linear::new(q.clone())?;
        let theirs = QMatMul::from_arc(q)?;
        let mut one_row = 0.0;
        for rows in [1, 9] {
            let x = Tensor::randn(0f32, 1.0, (rows, in_dim), &dev)?;
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for i in 0..iters + 3 {
                let start = Instant::now();
                std::hint::black_box(ours.forward(&x)?);
                let t_ours = start.elapsed().as_secs_f64();
                let start = Instant::now();
                std::hint::black_box(theirs.forward(&x)?);
                let t_theirs = start.elapsed().as_secs_f64();
                if i >= 3 {
                    a.push(t_ours);
                    b.push(t_theirs);
                }
            }
            let (a, b) = (median(a), median(b));
            if rows == 1 {
                one_row = a;
            }
            println!(
                "| {name} | {:.1} | {rows} | {:.0} | {:.1} | {:.0} | {:.2} | {} |",
                bytes / 1e6,
                a * 1e6,
                bytes / a / 1e9,
                b * 1e6,
                a / b,
                if rows == 9 {
                    format!("{:.2}", a / one_row)
                } else {
                    "".into()
                },
            );
        }
    }
    Ok(())
}
