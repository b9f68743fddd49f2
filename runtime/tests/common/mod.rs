//! Fixtures shared by the runtime's integration tests: the stories260K checkpoint, its GGUF
//! copies, and random-weight models written once per test binary.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tandem_runtime::quantize::{QuantType, quantize_to_gguf};
use tandem_runtime::synthetic::{SyntheticSpec, write_random_llama};
use tandem_runtime::{LoadOptions, Logits, Model, Tokenizer};

pub const REFERENCE_STORY: &str = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball. She wanted to play with it, but it was too high.";

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

pub fn stories_dir() -> PathBuf {
    fixtures().join("stories260K")
}

fn scratch() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"))
        .path()
}

/// A GGUF copy of stories260K, written once per test binary and quantization.
pub fn stories_gguf(quant: QuantType) -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().expect("fixture lock");
    let path = scratch().join(format!("stories260K-{quant:?}.gguf"));
    if !path.exists() {
        quantize_to_gguf(&stories_dir(), &path, quant).expect("quantize stories260K");
    }
    path
}

/// A tiny random-weight model with the stories260K tokenizer.
pub fn tiny_random(seed: u64) -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().expect("fixture lock");
    let dir = scratch().join(format!("tiny-{seed}"));
    if !dir.exists() {
        write_random_llama(&dir, &SyntheticSpec::tiny(seed), &stories_dir())
            .expect("write random model");
    }
    dir
}

pub fn load(path: &Path) -> Model {
    Model::load(path, &LoadOptions::default()).expect("load model")
}

pub fn tokenizer() -> Tokenizer {
    Tokenizer::for_model(&stories_dir()).expect("stories tokenizer")
}

/// Largest absolute difference between two logit rows.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Tokens of a real story: the positions the anchors below compare.
pub fn story_tokens() -> Vec<u32> {
    tokenizer().encode(REFERENCE_STORY).expect("encode")
}

/// Logits of every position of `tokens` from an empty cache in one block.
pub fn fresh_logits(model: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    model
        .forward(tokens, &mut cache, Logits::All)
        .expect("forward")
}

/// Tolerance for logits computed along different paths (block shapes change the gemm
/// summation order); logits of these models are O(1)–O(10).
pub const TOL: f32 = 1e-4;

/// After the story's first 10 tokens, its next 8 as one block and one by one on another cache:
/// each position's (block row, single-token row).
pub fn block_and_single_rows(model: &Model) -> Vec<(Vec<f32>, Vec<f32>)> {
    let tokens = story_tokens();
    let (prefix, block) = (&tokens[..10], &tokens[10..18]);
    let mut block_cache = model.new_cache();
    model
        .forward(prefix, &mut block_cache, Logits::Last)
        .expect("prefix");
    let rows = model
        .forward(block, &mut block_cache, Logits::All)
        .expect("block");
    assert_eq!(rows.len(), block.len());
    let mut single_cache = model.new_cache();
    model
        .forward(prefix, &mut single_cache, Logits::Last)
        .expect("prefix");
    let singles: Vec<Vec<f32>> = block
        .iter()
        .map(|&t| {
            let mut single = model
                .forward(&[t], &mut single_cache, Logits::Last)
                .expect("single");
            single.remove(0)
        })
        .collect();
    assert_eq!(block_cache.len(), single_cache.len());
    rows.into_iter().zip(singles).collect()
}

/// Feeds a wrong continuation after 20 tokens of the story (as a rejected draft block would),
/// rolls it back and feeds the story: every row as a fresh forward's.
pub fn assert_truncate_then_reforward(model: &Model) {
    let tokens = story_tokens();
    let fresh = fresh_logits(model, &tokens);
    let keep = 20;
    let mut cache = model.new_cache();
    // Feed a wrong continuation (as a rejected draft block would), then roll it back.
    let mut wrong = tokens[..keep].to_vec();
    wrong.extend([7u32, 8, 9, 10, 11, 12]);
    model
        .forward(&wrong, &mut cache, Logits::All)
        .expect("forward");
    cache.truncate(keep).expect("truncate");
    assert_eq!(cache.len(), keep);
    let again = model
        .forward(&tokens[keep..], &mut cache, Logits::All)
        .expect("forward");
    for (i, row) in again.iter().enumerate() {
        let d = max_diff(row, &fresh[keep + i]);
        assert!(d < TOL, "position {}: max |Δlogit| = {d}", keep + i);
    }
}

/// Asserts that each of [`block_and_single_rows`] agrees bit for bit: greedy speculative
/// decoding equals target-only decoding only if a block row and a single forward agree
/// exactly, not merely closely.
pub fn assert_block_equals_singles(model: &Model, what: &str) {
    for (i, (rows, single)) in block_and_single_rows(model).iter().enumerate() {
        assert_eq!(
            single,
            rows,
            "{what}: block position {i}: max |Δlogit| = {}",
            max_diff(single, rows)
        );
    }
}

/// Pearson chi-square of `counts` against exact probabilities, pooling cells whose expected
/// count is under 5. Returns (statistic, degrees of freedom).
pub fn chi_square(counts: &HashMap<u32, u64>, p: &[f32], n: u64) -> (f64, usize) {
    let (mut stat, mut cells) = (0.0, 0usize);
    let (mut pooled_obs, mut pooled_exp) = (0.0, 0.0);
    for (id, &prob) in p.iter().enumerate() {
        let expected = f64::from(prob) * n as f64;
        let observed = counts.get(&(id as u32)).copied().unwrap_or(0) as f64;
        if expected >= 5.0 {
            stat += (observed - expected).powi(2) / expected;
            cells += 1;
        } else {
            pooled_obs += observed;
            pooled_exp += expected;
        }
    }
    if pooled_exp > 0.0 {
        stat += (pooled_obs - pooled_exp).powi(2) / pooled_exp.max(1e-9);
        cells += 1;
    }
    (stat, cells - 1)
}

/// The 0.999 quantile of chi-square with `df` degrees of freedom (Wilson–Hilferty).
pub fn chi_square_critical(df: usize) -> f64 {
    let d = df as f64;
    let z = 3.09;
    d * (1.0 - 2.0 / (9.0 * d) + z * (2.0 / (9.0 * d)).sqrt()).powi(3)
}

/// The target's distribution of the token after `context` under `sampling` (what speculative
/// sampling must follow), from a fresh forward.
pub fn target_distribution(
    target: &Model,
    sampling: &tandem_runtime::SamplingParams,
    context: &[u32],
) -> Vec<f32> {
    let rows = target
        .forward(context, &mut target.new_cache(), Logits::Last)
        .expect("forward");
    match tandem_runtime::sampling::distribution(&rows[0], sampling, context)
        .expect("finite logits")
    {
        tandem_runtime::Distribution::Dense(p) => p,
        other => panic!("expected dense, got {other:?}"),
    }
}

/// Chi-square tests (at 0.999) of sampled pairs of first and second generated tokens: the first
/// against `exact(prompt)`, and the second, after the most frequent first, against
/// `exact(prompt + that token)`. `label` names the case in a failure.
pub fn assert_first_two_follow(
    pairs: &[(u32, u32)],
    prompt: &[u32],
    exact: impl Fn(&[u32]) -> Vec<f32>,
    label: &str,
) {
    let mut first: HashMap<u32, u64> = HashMap::new();
    for &(a, _) in pairs {
        *first.entry(a).or_default() += 1;
    }
    let (stat, df) = chi_square(&first, &exact(prompt), pairs.len() as u64);
    assert!(df >= 3, "{label}: too few cells: {df}");
    assert!(
        stat < chi_square_critical(df),
        "{label}, first token: chi-square {stat} with {df} df"
    );
    let (&mode, _) = first.iter().max_by_key(|(_, c)| **c).expect("samples");
    let mut second: HashMap<u32, u64> = HashMap::new();
    for &(a, b) in pairs {
        if a == mode {
            *second.entry(b).or_default() += 1;
        }
    }
    let m: u64 = second.values().sum();
    let context = [prompt, &[mode]].concat();
    let (stat, df) = chi_square(&second, &exact(&context), m);
    assert!(df >= 2, "{label}: too few cells: {df}");
    assert!(
        stat < chi_square_critical(df),
        "{label}, second token: chi-square {stat} with {df} df over {m} samples"
    );
}
