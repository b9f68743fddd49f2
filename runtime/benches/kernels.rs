//! The CPU matmul kernels alone, per GGUF type, at a Qwen2.5-1.5B MLP shape (1536 → 8960): µs
//! per product and GB/s of weights read, for 1 row (a decode step) and 9 (a verify block of
//! K = 8), Tandem's kernels against candle's own (`QMatMul`), alternated, medians.
//!
//! And what stands between nine rows and the time of one: this machine's peak multiply rate,
//! measured first (x86-64 with AVX2: f32 `fmadd` and u8 × i8 `maddubs` in registers, every
//! thread at once), bounds the time of a 9-row product from below (its products over that
//! rate); over the measured time of one row (the weights read once) that is the least 9 / 1
//! ratio this machine allows, whatever the kernel. "of peak" is that bound over the measured
//! 9-row time. The peak is measured between the kernel's runs (this machine's rate moves with
//! its neighbours' load): "peak G/s" is their median, f32 multiply-adds for f32 and u8 × i8
//! products for the quantized types, Q8_0's with the instructions a signed weight adds
//! ([`peaks::Peak`]).
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
        .unwrap_or_else(|_| "q4_0,q4_1,q5_0,q5_1,q8_0,q4k,q5k,q6k,f32,f16,bf16".into());
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
        "| type | MB | rows | Tandem µs | GB/s | candle µs | Tandem / candle | Tandem 9 rows / 1 row | peak G/s | 9-row bound µs | least 9 / 1 | of peak |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
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
            "f16" => GgmlDType::F16,
            "bf16" => GgmlDType::BF16,
            other => anyhow::bail!("BENCH_TYPES: unknown type {other}"),
        };
        let q = Arc::new(QTensor::quantize(&w, dtype)?);
        let bytes = q.storage_size_in_bytes() as f64;
        let ours = Linear::new(q.clone())?;
        let theirs = QMatMul::from_arc(q)?;
        let mut one_row = 0.0;
        for rows in [1, 9] {
            let x = Tensor::randn(0f32, 1.0, (rows, in_dim), &dev)?;
            let (mut a, mut b, mut peak) = (Vec::new(), Vec::new(), Vec::new());
            for i in 0..iters + 3 {
                if rows == 9 {
                    // The kernels' pool spins a while after a product before it parks: a peak
                    // measured meanwhile shares the cores with it and reads low (by up to half).
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    peak.extend(peaks::rate(match dtype {
                        GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => peaks::Peak::Fmadd,
                        GgmlDType::Q8_0 => peaks::Peak::SignedMaddubs,
                        _ => peaks::Peak::Maddubs,
                    }));
                }
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
            let nine = match peak.is_empty() {
                false => {
                    let peak = median(peak);
                    // The least time of these rows' products at the machine's peak rate.
                    let bound = (rows * in_dim * out_dim) as f64 / peak;
                    format!(
                        "{:.2} | {:.1} | {:.0} | {:.2} | {:.0} % |",
                        a / one_row,
                        peak / 1e9,
                        bound * 1e6,
                        (bound / one_row).max(1.0),
                        100.0 * bound / a
                    )
                }
                true if rows == 9 => format!("{:.2} | | | | |", a / one_row),
                true => " | | | | |".into(),
            };
            println!(
                "| {name} | {:.1} | {rows} | {:.0} | {:.1} | {:.0} | {:.2} | {nine}",
                bytes / 1e6,
                a * 1e6,
                bytes / a / 1e9,
                b * 1e6,
                a / b,
            );
        }
    }
    Ok(())
}

/// This machine's peak multiply rates, every thread at once.
mod peaks {
    /// The instructions a product goes through.
    #[derive(Clone, Copy)]
    pub enum Peak {
        /// f32: 8 multiply-adds per AVX2 `fmadd`.
        Fmadd,
        /// An unsigned 4-, 5- or 6-bit weight: 32 u8 × i8 products per `maddubs`, their 16-bit
        /// sums added.
        Maddubs,
        /// A signed 8-bit weight (Q8_0): `maddubs` takes one unsigned operand, so each of its 32
        /// products needs the weight's magnitude and the activation's sign moved (`abs`, `sign`),
        /// and its sums, which may fill 16 bits, widened at once (`madd`).
        SignedMaddubs,
    }

    /// Per second, all threads together, over a few milliseconds: f32 multiply-adds or u8 × i8
    /// products. `None` where the CPU has no AVX2 and FMA.
    pub fn rate(peak: Peak) -> Option<f64> {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let (per_call, f): (f64, unsafe fn(u64) -> u64) = match peak {
                Peak::Fmadd => (12.0 * 8.0, x86::fmadd),
                Peak::Maddubs => (12.0 * 32.0, x86::maddubs),
                Peak::SignedMaddubs => (12.0 * 32.0, x86::signed_maddubs),
            };
            let calls = 2_000_000;
            let start = std::time::Instant::now();
            std::thread::scope(|s| {
                for _ in 0..threads {
                    // SAFETY: AVX2 and FMA were detected above.
                    #[allow(unsafe_code, reason = "calls the AVX2 loops the CPU was checked for")]
                    s.spawn(move || std::hint::black_box(unsafe { f(calls) }));
                }
            });
            return Some(
                per_call * (calls * threads as u64) as f64 / start.elapsed().as_secs_f64(),
            );
        }
        None
    }
    #[cfg(target_arch = "x86_64")]
    #[allow(
        unsafe_code,
        reason = "SIMD intrinsics need the CPU features checked by the caller"
    )]
    mod x86 {
        use std::arch::x86_64::*;

        /// `n` rounds of 12 independent `fmadd` chains (enough to hide their latency).
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn fmadd(n: u64) -> u64 {
            // Opaque to the compiler, and distinct chains: none may be folded or merged.
            let (w, x) = std::hint::black_box((_mm256_set1_ps(0.999), _mm256_set1_ps(1e-3)));
            let mut acc: [__m256; 12] = std::array::from_fn(|j| _mm256_set1_ps(j as f32));
            for _ in 0..n {
                for a in &mut acc {
                    *a = _mm256_fmadd_ps(*a, w, x);
                }
            }
            let acc = std::hint::black_box(acc);
            acc.iter().map(|a| _mm256_cvtss_f32(*a) as u64).sum()
        }

        /// Twelve registers of bytes, read anew each round (so the products cannot be hoisted
        /// out of the loop; from L1, as a kernel's are).
        #[repr(align(32))]
        struct Registers([[i8; 32]; 12]);
        static BYTES: Registers = {
            let mut b = [[0i8; 32]; 12];
            let mut i = 0;
            while i < 12 * 32 {
                b[i / 32][i % 32] = (i * 7 % 51) as i8 - 25;
                i += 1;
            }
            Registers(b)
        };

        /// The `j`-th register of [`BYTES`] (a macro: a call would not be inlined).
        macro_rules! bytes {
            ($j:expr) => {
                // SAFETY: a whole element of a static array aligned to 32 bytes.
                unsafe { std::ptr::read_volatile(BYTES.0[$j].as_ptr().cast::<__m256i>()) }
            };
        }

        /// `n` rounds of 12 independent `maddubs` of a loaded register, their 16-bit sums added.
        #[target_feature(enable = "avx2")]
        pub unsafe fn maddubs(n: u64) -> u64 {
            let y = std::hint::black_box(_mm256_set1_epi8(3));
            let mut acc = [_mm256_setzero_si256(); 12];
            for _ in 0..n {
                for (j, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_add_epi16(*a, _mm256_maddubs_epi16(y, bytes!(j)));
                }
            }
            let acc = std::hint::black_box(acc);
            acc.iter()
                .map(|a| _mm256_extract_epi16::<0>(*a) as u64)
                .sum()
        }

        /// `n` rounds of 12 independent signed byte products as Q8_0's kernel makes them: `abs`,
        /// `sign`, `maddubs`, `madd` to 32 bits, added.
        #[target_feature(enable = "avx2")]
        pub unsafe fn signed_maddubs(n: u64) -> u64 {
            let (y, ones) = std::hint::black_box((_mm256_set1_epi8(3), _mm256_set1_epi16(1)));
            let mut acc = [_mm256_setzero_si256(); 12];
            for _ in 0..n {
                for (j, a) in acc.iter_mut().enumerate() {
                    let w = bytes!(j);
                    let p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(y, w));
                    *a = _mm256_add_epi32(*a, _mm256_madd_epi16(p, ones));
                }
            }
            let acc = std::hint::black_box(acc);
            acc.iter()
                .map(|a| _mm256_extract_epi32::<0>(*a) as u64)
                .sum()
        }
    }
}
