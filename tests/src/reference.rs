//! Tandem's answer for a model against a reference's (llama.cpp, transformers): the logits of
//! some positions of a prompt within a tolerance, and the greedy continuation token for token up
//! to the first near-tie of Tandem's top two logits.

use std::path::Path;

use tandem_runtime::{
    GenerateRequest, Logits, Model, SamplingParams, SpeculativeGenerator, Tokenizer,
};

use crate::recorded;

/// A reference's answer for one model: the logits of some positions of a prompt, and its
/// greedy continuation.
#[derive(Debug)]
pub struct Reference {
    pub positions: Vec<usize>,
    pub logits: Vec<Vec<f64>>,
    pub greedy: Vec<u32>,
    pub name: String,
}

/// What Tandem computes for a model on a prompt: every position's logits, and its greedy
/// continuation (the generator's, target alone) with the gap between the top two logits before
/// each step.
#[derive(Debug)]
pub struct Ours {
    pub logits: Vec<Vec<f32>>,
    pub greedy: Vec<u32>,
    pub gaps: Vec<f32>,
}

/// Tandem's answer for `model` on `tokens`, continued greedily by `greedy` tokens.
pub fn ours(model: &Model, tokenizer: &Tokenizer, tokens: &[u32], greedy: usize) -> Ours {
    let logits = model
        .forward(tokens, &mut model.new_cache(), Logits::All)
        .expect("forward");
    let greedy = SpeculativeGenerator::new(model, None, tokenizer)
        .expect("generator")
        .generate(
            &GenerateRequest {
                prompt: tokens.to_vec(),
                max_new_tokens: greedy,
                sampling: SamplingParams::greedy(),
                draft_tokens: 0,
                stop_token_ids: vec![],
                stop_strings: vec![],
            },
            |_| {},
        )
        .expect("generate")
        .token_ids;
    let mut cache = model.new_cache();
    let mut row = model
        .forward(tokens, &mut cache, Logits::Last)
        .expect("forward")
        .remove(0);
    let mut gaps = Vec::new();
    for &token in &greedy {
        let mut sorted = row.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        gaps.push(sorted[0] - sorted[1]);
        row = model
            .forward(&[token], &mut cache, Logits::Last)
            .expect("forward")
            .remove(0);
    }
    Ours {
        logits,
        greedy,
        gaps,
    }
}

/// llama.cpp's answer for `gguf` on `tokens` (the logits of `positions`, `greedy` tokens after
/// them, a context of `n_ctx`), as recorded under `name` ([`recorded::llama_cpp`]).
pub fn llama_cpp(
    name: &str,
    gguf: &Path,
    tokens: &[u32],
    greedy: usize,
    n_ctx: usize,
    positions: &[usize],
) -> Reference {
    let request = serde_json::json!({"tokens": tokens, "greedy": greedy, "n_ctx": n_ctx,
        "positions": positions});
    let answer = recorded::llama_cpp(name, "llama_cpp_logits.py", gguf, &request);
    Reference {
        positions: positions.to_vec(),
        logits: serde_json::from_value(answer["logits"].clone()).expect("logit rows"),
        greedy: serde_json::from_value(answer["greedy"].clone()).expect("ids"),
        name: format!("llama.cpp {}", answer["llama_cpp"].as_str().unwrap_or("?")),
    }
}

/// llama.cpp's ids for `texts` on `gguf`'s vocabulary (special tokens parsed, no BOS), as
/// recorded under `name` ([`recorded::llama_cpp`]).
pub fn llama_cpp_ids(name: &str, gguf: &Path, texts: &[&str]) -> Vec<Vec<u32>> {
    let request = serde_json::json!(texts);
    let answer = recorded::llama_cpp(name, "llama_cpp_tokenize.py", gguf, &request);
    serde_json::from_value(answer).expect("ids")
}

/// The positions of a prompt of `n` tokens whose logits the references record: every fourth,
/// and the last.
pub fn positions(n: usize) -> Vec<usize> {
    (0..n).step_by(4).chain([n - 1]).collect()
}

/// Tandem's answer on `what` against a reference's: logits within `tolerance` of the largest
/// |logit|, and the same greedy tokens up to the first step whose top two logits are nearer
/// than `near_tie` (there either answer is right, and the continuations may part). Returns the
/// greedy steps compared.
pub fn compare(
    what: &str,
    ours: &Ours,
    reference: &Reference,
    tolerance: f64,
    near_tie: f32,
) -> usize {
    let (mut worst, mut scale) = (0f64, 0f64);
    for (&p, theirs) in reference.positions.iter().zip(&reference.logits) {
        assert_eq!(ours.logits[p].len(), theirs.len(), "{what}: vocabulary");
        for (x, y) in ours.logits[p].iter().zip(theirs) {
            worst = worst.max((f64::from(*x) - y).abs());
            scale = scale.max(y.abs());
        }
    }
    assert!(!reference.logits.is_empty(), "{what}: no logits");
    eprintln!(
        "{what}: max |Δlogit| {worst:.2e} (largest |logit| {scale:.1}) against {}",
        reference.name
    );
    assert!(
        worst < tolerance * scale,
        "{what}: max |Δlogit| {worst} over logits up to {scale} against {}",
        reference.name
    );
    assert!(
        !ours.greedy.is_empty() && ours.greedy.len() <= reference.greedy.len(),
        "{what}: {} greedy tokens, {} from {}",
        ours.greedy.len(),
        reference.greedy.len(),
        reference.name
    );
    for (step, (&a, &b)) in ours.greedy.iter().zip(&reference.greedy).enumerate() {
        if ours.gaps[step] < near_tie {
            eprintln!("{what}: near-tie at greedy step {step}: compared up to it");
            return step;
        }
        assert_eq!(
            a, b,
            "{what}: greedy step {step} against {}",
            reference.name
        );
    }
    ours.greedy.len()
}
