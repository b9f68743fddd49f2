//! What a verify block costs against a decode step, for a whole model: the wall time of one
//! forward over n positions (logits for each, as verification asks) over that of one position,
//! alternated, medians. Issue 11's goal is ≤ 1.3 at n = 9.
//!
//! `BENCH_MODEL=path.gguf cargo bench -p tandem-runtime --bench verify` (BENCH_ROWS, default
//! `1,5,9`; BENCH_ITERS, default 10; BENCH_CONTEXT, the positions before the block, default 64).
//! BENCH_SEQS (e.g. `8`): also one forward over that many sequences of one position each, every
//! one on its own cache (a decode batch of as many sessions: [`Model::forward_batch`]), or of
//! BENCH_SEQ_ROWS positions each (`5`: the verify blocks of as many sessions at K = 4).
//! `BENCH_MODEL=random-110m` writes and measures the benchmarks' random 110M-shape f32 model,
//! `random-1.5b` one of the Qwen2.5 1.5B's shape (28 layers of 1536, 12 query heads to 2 key
//! heads, 8960-wide MLP; the Llama 2 vocabulary); without BENCH_MODEL, the Qwen2.5-Coder 1.5B
//! target in ~/.cache/tandem/models if it is there. BENCH_DEVICE (`cpu`, `cuda`) and
//! BENCH_DTYPE (`f32`, `bf16`, `f16`; default the device's) place the model. Pinned to one
//! core, give it one thread: `RAYON_NUM_THREADS=1 CANDLE_NUM_THREADS=1 taskset -c 0 cargo bench
//! …` (cargo's `.cargo/config.toml` sets 2 for tests and benches, and two threads spinning on one
//! core ran the Qwen target's step at 410 ms instead of 76).

use std::path::PathBuf;
use std::time::Instant;

use tandem_runtime::model::{Architecture, parse_device, parse_dtype};
use tandem_runtime::synthetic::{SyntheticSpec, write_random_llama};
use tandem_runtime::{LoadOptions, Logits, Model};

/// A random-weight f32 model of `spec`'s shape, written once to the system's temporary
/// directory as `name`.
fn random(name: &str, spec: &SyntheticSpec) -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("tandem-bench-{name}"));
    if !dir.join("config.json").exists() {
        let tokenizer =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/llama2-tokenizer");
        write_random_llama(&dir, spec, &tokenizer)?;
    }
    Ok(dir)
}

/// The Qwen2.5 1.5B's shape.
fn qwen_1_5b() -> SyntheticSpec {
    SyntheticSpec {
        hidden_size: 1536,
        intermediate_size: 8960,
        num_layers: 28,
        num_heads: 12,
        num_kv_heads: 2,
        head_dim: Some(128),
        architecture: Architecture::Qwen2,
        ..SyntheticSpec::stories110m(15)
    }
}

fn main() -> anyhow::Result<()> {
    tandem_runtime::init_cpu_threads();
    let model = match std::env::var_os("BENCH_MODEL") {
        Some(p) if p == "random-110m" => random("random-110m", &SyntheticSpec::stories110m(110))?,
        Some(p) if p == "random-1.5b" => random("random-1.5b", &qwen_1_5b())?,
        Some(p) => PathBuf::from(p),
        None => {
            let home = std::env::var_os("HOME").unwrap_or_default();
            PathBuf::from(home).join(".cache/tandem/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
        }
    };
    if !model.exists() {
        println!("{} not found: set BENCH_MODEL", model.display());
        return Ok(());
    }
    let iters: usize = std::env::var("BENCH_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let rows: Vec<usize> = std::env::var("BENCH_ROWS")
        .unwrap_or_else(|_| "1,5,9".into())
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let dtype = match std::env::var("BENCH_DTYPE") {
        Ok(spec) => Some(parse_dtype(&spec)?),
        Err(_) => None,
    };
    let options = LoadOptions {
        device: parse_device(&std::env::var("BENCH_DEVICE").unwrap_or_else(|_| "cpu".into()))?,
        dtype,
        max_context: None,
        // A draft's vocabulary: the ids below this.
        logit_ids: std::env::var("BENCH_LOGITS_BELOW")
            .ok()
            .map(|n| n.parse().map(|n: u32| (0..n).collect()))
            .transpose()?,
    };
    let m = Model::load(&model, &options)?;
    let mut cache = m.new_cache();
    let context: u32 = std::env::var("BENCH_CONTEXT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64);
    let prompt: Vec<u32> = (0..context).map(|i| 100 + (i * 7) % 1000).collect();
    m.forward(&prompt, &mut cache, Logits::Last)?;
    let base = cache.len();
    let seqs: Option<usize> = std::env::var("BENCH_SEQS")
        .ok()
        .map(|s| s.parse())
        .transpose()?;
    let seq_rows: std::num::NonZeroU32 = std::env::var("BENCH_SEQ_ROWS")
        .ok()
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(std::num::NonZeroU32::MIN);
    let seq_block: Vec<u32> = (0..seq_rows.get()).map(|j| 200 + j).collect();
    let mut caches = Vec::new();
    for _ in 0..seqs.unwrap_or(0) {
        let mut c = m.new_cache();
        m.forward(&prompt, &mut c, Logits::Last)?;
        caches.push(c);
    }
    let mut batched = Vec::new();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); rows.len()];
    for i in 0..iters + 2 {
        if !caches.is_empty() {
            let mut items: Vec<_> = caches
                .iter_mut()
                .map(|c| (&seq_block[..], c, Logits::All))
                .collect();
            let start = Instant::now();
            m.forward_batch(&mut items)?;
            if i >= 2 {
                batched.push(start.elapsed().as_secs_f64());
            }
            for c in &mut caches {
                c.truncate(base)?;
            }
        }
        for (n, t) in rows.iter().zip(times.iter_mut()) {
            let block: Vec<u32> = (0..*n as u32).map(|j| 200 + j).collect();
            let start = Instant::now();
            m.forward(&block, &mut cache, Logits::All)?;
            if i >= 2 {
                t.push(start.elapsed().as_secs_f64());
            }
            cache.truncate(base)?;
        }
    }
    println!("{} on {:?}", model.display(), options.device);
    println!("| positions | ms | / one position |");
    println!("|---|---|---|");
    let medians: Vec<f64> = times
        .into_iter()
        .map(|mut t| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        })
        .collect();
    for (n, t) in rows.iter().zip(&medians) {
        println!("| {n} | {:.1} | {:.2} |", t * 1e3, t / medians[0]);
    }
    if let Some(seqs) = seqs {
        batched.sort_by(f64::total_cmp);
        let t = batched[batched.len() / 2];
        println!(
            "| {seqs} sequences × {seq_rows} | {:.1} | {:.2} |",
            t * 1e3,
            t / medians[0]
        );
    }
    Ok(())
}
