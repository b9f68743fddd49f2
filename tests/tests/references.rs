//! Each model family against llama.cpp (issue 28), on small random-weight checkpoints written as
//! Hugging Face folders and converted to GGUF by `coordinator quantize`: llama.cpp (through
//! llama-cpp-python, which vendors it; `tests/references/llama_cpp_logits.py`) reads the same file,
//! and its logits of every position of a story agree with Tandem's within a tolerance, and its
//! greedy continuation is Tandem's token for token wherever the top two logits are not a
//! near-tie.

use std::path::{Path, PathBuf};

use tandem_runtime::model::Architecture;
use tandem_runtime::quantize::{QuantType, quantize_to_gguf};
use tandem_runtime::synthetic::{SyntheticSpec, write_random_llama};
use tandem_runtime::{GenerateRequest, Logits, SamplingParams, SpeculativeGenerator};
use tandem_tests::python::llama_cpp_answer;
use tandem_tests::*;

/// Largest |Δlogit| allowed between Tandem and llama.cpp on one f32 file, relative to the
/// largest |logit| (the two sum in different orders).
const TOLERANCE: f64 = 2e-4;
/// Greedy tokens compared.
const GREEDY: usize = 64;
/// Top-two gap under which a greedy step is a near-tie: there either answer is right, and the
/// comparison stops (the continuations may part there).
const NEAR_TIE: f64 = 1e-3;

struct Reference {
    logits: Vec<Vec<f64>>,
    greedy: Vec<u32>,
    version: String,
}

fn llama_cpp(gguf: &Path, tokens: &[u32], n_ctx: usize) -> Reference {
    let request = serde_json::json!({"tokens": tokens, "greedy": GREEDY, "n_ctx": n_ctx});
    let answer = llama_cpp_answer("llama_cpp_logits.py", gguf, &request);
    let rows = |v: &serde_json::Value| -> Vec<Vec<f64>> {
        serde_json::from_value(v.clone()).expect("logit rows")
    };
    Reference {
        logits: rows(&answer["logits"]),
        greedy: serde_json::from_value(answer["greedy"].clone()).expect("ids"),
        version: answer["llama_cpp"].as_str().unwrap_or("?").to_string(),
    }
}

/// A random checkpoint of `architecture` (tweaked by `spec`) with stories260K's vocabulary,
/// converted to an f32 GGUF file.
fn family(dir: &Path, name: &str, spec: SyntheticSpec) -> PathBuf {
    family_with(dir, name, spec, serde_json::json!({}))
}

/// [`family`], with `config` merged into its config.json.
fn family_with(dir: &Path, name: &str, spec: SyntheticSpec, config: serde_json::Value) -> PathBuf {
    let folder = dir.join(name);
    write_random_llama(&folder, &spec, &stories()).expect("write");
    let path = folder.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    if let (Some(json), Some(extra)) = (json.as_object_mut(), config.as_object()) {
        json.extend(extra.clone());
    }
    std::fs::write(&path, json.to_string()).expect("write");
    let gguf = dir.join(format!("{name}.gguf"));
    quantize_to_gguf(&folder, &gguf, QuantType::F32).expect("quantize");
    gguf
}

fn check(gguf: &Path) {
    let model = load(gguf);
    let tok = tokenizer(&stories());
    let tokens = tok
        .encode("Once upon a time, there was a little girl named Lily. She loved to play outside.")
        .expect("encode");
    let n_ctx = model.config().max_context;
    let reference = llama_cpp(gguf, &tokens, n_ctx);
    let ours = model
        .forward(&tokens, &mut model.new_cache(), Logits::All)
        .expect("forward");
    assert_eq!(ours.len(), reference.logits.len());
    let (mut worst, mut scale) = (0f64, 0f64);
    for (a, b) in ours.iter().zip(&reference.logits) {
        for (x, y) in a.iter().zip(b) {
            worst = worst.max((f64::from(*x) - y).abs());
            scale = scale.max(y.abs());
        }
    }
    eprintln!(
        "{}: max |Δlogit| {worst:.2e} (largest |logit| {scale:.1}) against llama.cpp {}",
        gguf.display(),
        reference.version
    );
    assert!(
        worst < TOLERANCE * scale,
        "{}: max |Δlogit| {worst} over logits up to {scale} against llama.cpp {}",
        gguf.display(),
        reference.version
    );
    // Greedy, target alone, after the same tokens.
    let out = SpeculativeGenerator::new(&model, None, &tok)
        .expect("generator")
        .generate(
            &GenerateRequest {
                prompt: tokens.clone(),
                max_new_tokens: GREEDY,
                sampling: SamplingParams::greedy(),
                draft_tokens: 0,
                stop_token_ids: vec![],
                stop_strings: vec![],
            },
            |_| {},
        )
        .expect("generate");
    let mut cache = model.new_cache();
    let mut row = model
        .forward(&tokens, &mut cache, Logits::Last)
        .expect("forward")
        .remove(0);
    for (step, (&ours, &theirs)) in out.token_ids.iter().zip(&reference.greedy).enumerate() {
        let mut sorted = row.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if f64::from(sorted[0] - sorted[1]) < NEAR_TIE {
            eprintln!(
                "{}: near-tie at step {step}: compared up to it",
                gguf.display()
            );
            break;
        }
        assert_eq!(
            ours,
            theirs,
            "{}: greedy step {step} (llama.cpp {})",
            gguf.display(),
            reference.version
        );
        row = model
            .forward(&[ours], &mut cache, Logits::Last)
            .expect("forward")
            .remove(0);
    }
}

fn spec(architecture: Architecture, seed: u64) -> SyntheticSpec {
    SyntheticSpec {
        architecture,
        ..SyntheticSpec::tiny(seed)
    }
}

#[test]
fn llama_and_qwen2_match_llama_cpp() {
    let tmp = tempfile::tempdir().expect("tmp");
    check(&family(tmp.path(), "llama", spec(Architecture::Llama, 41)));
    check(&family(tmp.path(), "qwen2", spec(Architecture::Qwen2, 42)));
}

#[test]
fn qwen3_matches_llama_cpp() {
    let tmp = tempfile::tempdir().expect("tmp");
    let qwen3 = SyntheticSpec {
        head_dim: Some(32),
        ..spec(Architecture::Qwen3, 43)
    };
    check(&family(tmp.path(), "qwen3", qwen3));
}

/// YaRN over an original context of 64 positions, 4× longer: the story's positions pass it.
#[test]
fn qwen3_with_yarn_matches_llama_cpp() {
    let tmp = tempfile::tempdir().expect("tmp");
    let qwen3 = SyntheticSpec {
        head_dim: Some(32),
        ..spec(Architecture::Qwen3, 46)
    };
    let yarn = serde_json::json!({
        "max_position_embeddings": 64,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    });
    check(&family_with(tmp.path(), "qwen3-yarn", qwen3, yarn));
}

#[test]
fn gemma3_matches_llama_cpp() {
    let tmp = tempfile::tempdir().expect("tmp");
    let gemma3 = SyntheticSpec {
        num_layers: 6,
        num_kv_heads: 1,
        head_dim: Some(32),
        ..spec(Architecture::Gemma3, 44)
    };
    check(&family(tmp.path(), "gemma3", gemma3));
}

#[test]
fn phi3_matches_llama_cpp() {
    let tmp = tempfile::tempdir().expect("tmp");
    // Not named "phi3": llama.cpp then looks for Phi-3's own special tokens by name
    // (`general.name`), which stories260K's vocabulary lacks.
    check(&family(
        tmp.path(),
        "tiny-phi",
        spec(Architecture::Phi3, 45),
    ));
}
