//! Decode speed of each model family against llama.cpp on the same file (issue 28): random-weight
//! checkpoints of the benchmarks' 110M class in each family's own layout (Llama, Qwen3 with its
//! q/k head norms and 128-wide heads, Gemma 3 with its 256-wide heads, one key-value head and
//! local layers, Phi-3 with fused projections and partial rope), written once to the system's
//! temporary directory and converted to GGUF by `coordinator quantize`'s converter. Per file,
//! llama.cpp's `llama-bench` (text generation only: `-p 0 -n N`) and Tandem's own decode (the
//! same N tokens one forward at a time after a one-token prompt, greedy, in process) alternate
//! for BENCH_ROUNDS rounds; the table gives each side's tokens/s per round and the median of the
//! per-round ratios.
//!
//! `LLAMA_BENCH=/path/to/llama-bench cargo bench -p tandem-runtime --bench families`
//! (BENCH_FAMILIES, default `llama,qwen3,gemma3,phi3`; BENCH_TYPES, default `q8_0,q4_k_m`;
//! BENCH_GGUF, GGUF files of your own to measure as well, comma-separated; BENCH_ROUNDS,
//! default 3; BENCH_TOKENS, default 64; BENCH_THREADS, default every core).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use tandem_runtime::model::Architecture;
use tandem_runtime::quantize::{QuantType, quantize_to_gguf};
use tandem_runtime::synthetic::{SyntheticSpec, write_random_llama};
use tandem_runtime::{LoadOptions, Logits, Model};

/// The 110M-class shape of `family`, in that family's own proportions.
fn shape(family: &str) -> anyhow::Result<SyntheticSpec> {
    let base = SyntheticSpec::stories110m(110);
    Ok(match family {
        "llama" => base,
        "qwen3" => SyntheticSpec {
            architecture: Architecture::Qwen3,
            num_kv_heads: 6,
            head_dim: Some(128),
            ..base
        },
        "gemma3" => SyntheticSpec {
            architecture: Architecture::Gemma3,
            num_heads: 4,
            num_kv_heads: 1,
            head_dim: Some(256),
            ..base
        },
        "phi3" => SyntheticSpec {
            architecture: Architecture::Phi3,
            num_kv_heads: 4,
            ..base
        },
        other => anyhow::bail!("BENCH_FAMILIES: {other}? (llama, qwen3, gemma3, phi3)"),
    })
}

/// `family`'s checkpoint as a GGUF file of `ty`, written once.
fn gguf(family: &str, ty: &str) -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join("tandem-bench-families");
    // The folder names the model (`general.name`): not "phi3", for which llama.cpp looks up
    // Phi-3's own special tokens by name, absent from this vocabulary.
    let folder = dir.join(format!("{}-110m", family.trim_end_matches('3')));
    if !folder.join("config.json").exists() {
        let tokenizer =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/llama2-tokenizer");
        write_random_llama(&folder, &shape(family)?, &tokenizer)?;
    }
    let file = dir.join(format!("{family}-{ty}.gguf"));
    if !file.exists() {
        let scheme: QuantType = ty.parse().map_err(|e| anyhow::anyhow!("{e}"))?;
        quantize_to_gguf(&folder, &file, scheme)?;
    }
    Ok(file)
}

/// Tandem's decode tokens/s: `tokens` greedy steps after a one-token prompt.
fn tandem(model: &Model, tokens: usize) -> anyhow::Result<f64> {
    let mut cache = model.new_cache();
    let mut next = argmax(&model.forward(&[1], &mut cache, Logits::Last)?[0]);
    let start = Instant::now();
    for _ in 0..tokens {
        next = argmax(&model.forward(&[next], &mut cache, Logits::Last)?[0]);
    }
    Ok(tokens as f64 / start.elapsed().as_secs_f64())
}

fn argmax(row: &[f32]) -> u32 {
    (0..row.len())
        .max_by(|&a, &b| row[a].total_cmp(&row[b]))
        .unwrap_or(0) as u32
}

/// llama.cpp's decode tokens/s on `file`: one `llama-bench` run of `tokens` generated tokens.
fn llama_cpp(bench: &Path, file: &Path, tokens: usize, threads: usize) -> anyhow::Result<f64> {
    let out = Command::new(bench)
        .arg("-m")
        .arg(file)
        .args([
            "-p",
            "0",
            "-n",
            &tokens.to_string(),
            "-t",
            &threads.to_string(),
        ])
        .args(["-r", "1", "-o", "json"])
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "{}: {}",
        bench.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let runs: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    runs[0]["avg_ts"]
        .as_f64()
        .ok_or_else(|| anyhow::anyhow!("no avg_ts in llama-bench's JSON"))
}

fn env_or(key: &str, default: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| default.into())
}

fn main() -> anyhow::Result<()> {
    let Some(bench) = std::env::var_os("LLAMA_BENCH").map(PathBuf::from) else {
        println!("set LLAMA_BENCH to a llama-bench binary (llama.cpp built CPU-only)");
        return Ok(());
    };
    tandem_runtime::init_cpu_threads();
    let threads: usize = match std::env::var("BENCH_THREADS") {
        Ok(n) => n.parse()?,
        Err(_) => std::thread::available_parallelism()?.get(),
    };
    let rounds: usize = env_or("BENCH_ROUNDS", "3").parse()?;
    let tokens: usize = env_or("BENCH_TOKENS", "64").parse()?;
    println!(
        "- Tandem's CPU kernels: {}\n",
        tandem_runtime::kernels::cpu_path()
    );
    println!(
        "| family | type | MB | llama.cpp tok/s | Tandem tok/s | Tandem / llama.cpp (median) |"
    );
    println!("|---|---|---|---|---|---|");
    let mut files = Vec::new();
    for family in env_or("BENCH_FAMILIES", "llama,qwen3,gemma3,phi3").split(',') {
        for ty in env_or("BENCH_TYPES", "q8_0,q4_k_m").split(',') {
            if !family.is_empty() && !ty.is_empty() {
                files.push((family.to_string(), ty.to_string(), gguf(family, ty)?));
            }
        }
    }
    // Real files too: their name in the family column.
    for path in std::env::var("BENCH_GGUF").unwrap_or_default().split(',') {
        if !path.is_empty() {
            let path = PathBuf::from(path);
            let name = path.file_stem().map(|s| s.to_string_lossy().into_owned());
            files.push((name.unwrap_or_default(), "file".into(), path));
        }
    }
    for (family, ty, file) in files {
        let model = Model::load(&file, &LoadOptions::default())?;
        tandem(&model, 8)?; // warm-up; llama-bench warms up by itself
        let (mut theirs, mut ours) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            theirs.push(llama_cpp(&bench, &file, tokens, threads)?);
            ours.push(tandem(&model, tokens)?);
        }
        let mut ratios: Vec<f64> = ours.iter().zip(&theirs).map(|(a, b)| a / b).collect();
        ratios.sort_by(f64::total_cmp);
        let list = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.1}"))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        println!(
            "| {family} | {ty} | {:.0} | {} | {} | {:.2} |",
            std::fs::metadata(&file)?.len() as f64 / 1e6,
            list(&theirs),
            list(&ours),
            ratios[ratios.len() / 2]
        );
    }
    Ok(())
}
