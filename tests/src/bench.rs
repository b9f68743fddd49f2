//! What the benchmarks share: their model pairs (built deterministically, nothing downloaded),
//! environment knobs and medians.

use std::path::Path;
use std::path::PathBuf;

use tandem_runtime::quantize::{QuantType, quantize_to_gguf};
use tandem_runtime::synthetic::{SyntheticSpec, write_random_llama};

use crate::{fixtures, stories};

/// A target and a draft sharing a vocabulary, and how many tokens to generate with them.
#[derive(Debug)]
pub struct Pair {
    pub name: &'static str,
    pub target: PathBuf,
    pub draft: PathBuf,
    pub max_new_tokens: usize,
    /// What to generate from.
    pub prompt: &'static str,
}

/// The prompt of the story pairs.
pub const PROMPT: &str = "Once upon a time";

/// The real Qwen pair's prompts, and how many tokens each generates: prose; a rename in a short
/// function, where a draft (and an n-gram drafter) has the most to copy but the answer's
/// explanation is a third of it; a rename in a longer function, the shape of a code edit as an
/// editor asks for it (the answer mostly the code again).
pub const QWEN_PROMPTS: [(&str, &str, &str, usize); 3] = [
    (
        "qwen-prose",
        "Qwen2.5-Coder 1.5B Q4_K_M / 0.5B (prose)",
        "The capital of France is",
        64,
    ),
    (
        "qwen-code",
        "Qwen2.5-Coder 1.5B Q4_K_M / 0.5B (code)",
        "<|im_start|>user\nRename `total` to `sum` in this function and return it:\n```python\n\
         def add_all(values):\n    total = 0\n    for v in values:\n        total += v\n    \
         return total\n```<|im_end|>\n<|im_start|>assistant\n",
        64,
    ),
    (
        "qwen-edit",
        "Qwen2.5-Coder 1.5B Q4_K_M / 0.5B (code edit, 160 tokens)",
        "<|im_start|>user\nRename `report` to `rows` in this function and return it:\n```python\n\
         def summarize(orders):\n    totals = {}\n    counts = {}\n    for order in orders:\n        \
         customer = order[\"customer\"]\n        amount = order[\"amount\"]\n        \
         if customer not in totals:\n            totals[customer] = 0\n            \
         counts[customer] = 0\n        totals[customer] += amount\n        \
         counts[customer] += 1\n    report = []\n    for customer in sorted(totals):\n        \
         average = totals[customer] / counts[customer]\n        \
         report.append((customer, totals[customer], average))\n    return report\n```\
         <|im_end|>\n<|im_start|>assistant\n",
        160,
    ),
];

pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        xs[n / 2]
    } else {
        0.5 * (xs[n / 2 - 1] + xs[n / 2])
    }
}

/// The geometric mean of `ratios` (1 where there are none).
pub fn geometric_mean(ratios: &[f64]) -> f64 {
    (ratios.iter().map(|r| r.ln()).sum::<f64>() / ratios.len().max(1) as f64).exp()
}

/// A comma-separated list from the environment, or `default`.
pub fn env_list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// [`env_list`], each item parsed: an error names the variable and the item.
pub fn env_parsed<T: std::str::FromStr>(name: &str, default: &str) -> anyhow::Result<Vec<T>>
where
    T::Err: std::fmt::Display,
{
    env_list(name, default)
        .iter()
        .map(|s| s.parse().map_err(|e| anyhow::anyhow!("{name}: `{s}`: {e}")))
        .collect()
}

/// More arguments of the benchmarks' target-nodes, from BENCH_TARGET_ARGS (whitespace-separated,
/// e.g. `--device cuda`).
pub fn target_args() -> Vec<String> {
    std::env::var("BENCH_TARGET_ARGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// The number in environment variable `name`, or `default` when it is unset or not one.
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// `BENCH_REPS` (default 5).
pub fn reps() -> usize {
    env_usize("BENCH_REPS", 5)
}

/// `BENCH_K` (default 4,8).
pub fn ks() -> anyhow::Result<Vec<usize>> {
    env_parsed("BENCH_K", "4,8")
}

/// The pairs named in `wanted`: `stories260k` (the real stories260K, f32, with a Q8_0 copy as
/// the draft), `110m-q8_0` / `110m-q4_0` (a random-weight model of the stories110M shape,
/// 768 × 12 layers × the 32k Llama 2 vocabulary, f32, seed 110, with its own Q8_0 / Q4_0 copy)
/// and `qwen-prose` / `qwen-code` (the real Qwen2.5-Coder pair, fetched by .ci/run), each
/// generating its own number of tokens, or `BENCH_TOKENS` where set.
pub fn pairs(scratch: &Path, wanted: &[String]) -> anyhow::Result<Vec<Pair>> {
    let mut pairs = Vec::new();
    if wanted.iter().any(|w| w == "stories260k") {
        let draft = scratch.join("stories260K-q8_0.gguf");
        quantize_to_gguf(&stories(), &draft, QuantType::Q8_0)?;
        pairs.push(Pair {
            name: "stories260K f32 / Q8_0",
            target: stories(),
            draft,
            max_new_tokens: 256,
            prompt: PROMPT,
        });
    }
    let big: Vec<(QuantType, &'static str)> = [
        ("110m-q8_0", QuantType::Q8_0, "110M-shape f32 / Q8_0"),
        ("110m-q4_0", QuantType::Q4_0, "110M-shape f32 / Q4_0"),
    ]
    .into_iter()
    .filter(|(key, _, _)| wanted.iter().any(|w| w == key))
    .map(|(_, quant, name)| (quant, name))
    .collect();
    if !big.is_empty() {
        let target = scratch.join("random-110m");
        eprintln!(
            "writing a random-weight 110M-shape model to {}",
            target.display()
        );
        write_random_llama(
            &target,
            &SyntheticSpec::stories110m(110),
            &fixtures().join("llama2-tokenizer"),
        )?;
        for (quant, name) in big {
            let draft = scratch.join(format!("random-110m-{quant:?}.gguf"));
            quantize_to_gguf(&target, &draft, quant)?;
            pairs.push(Pair {
                name,
                target: target.clone(),
                draft,
                max_new_tokens: 64,
                prompt: PROMPT,
            });
        }
    }
    for (key, name, prompt, max_new_tokens) in QWEN_PROMPTS {
        if wanted.iter().any(|w| w == key) {
            let (target, draft) = crate::qwen_pair(key)
                .ok_or_else(|| anyhow::anyhow!("{key}: the Qwen pair is not fetched"))?;
            pairs.push(Pair {
                name,
                target,
                draft,
                max_new_tokens,
                prompt,
            });
        }
    }
    if let Some(tokens) = std::env::var("BENCH_TOKENS")
        .ok()
        .and_then(|t| t.parse().ok())
    {
        for pair in &mut pairs {
            pair.max_new_tokens = tokens;
        }
    }
    Ok(pairs)
}
