//! Each model family against its references (issue 28), on small random-weight checkpoints
//! written as Hugging Face folders and converted to GGUF (f32 and Q8_0) by `coordinator
//! quantize`'s converter:
//! - llama.cpp (through llama-cpp-python, which vendors it; `tests/references/llama_cpp_logits.py`)
//!   reads the f32 file; its answers are recorded in `tests/references/llama_cpp/` for the exact
//!   files (llama-cpp-python builds llama.cpp from source: ~6 minutes on every run) and recorded
//!   anew with `TANDEM_REFRESH_LLAMA_CPP=1`;
//! - Hugging Face transformers (`tests/references/transformers_logits.py`) reads the folder and
//!   both files; its answers are recorded in `tests/references/transformers/` for the exact
//!   checkpoints (torch is ~3 GB of wheels: too much to install on every run) and recorded anew
//!   with `TANDEM_REFRESH_TRANSFORMERS=1`.
//!
//! Tandem's logits of the story's positions agree with each reference's within a tolerance, and
//! its greedy continuation is the reference's token for token up to the first near-tie of its
//! top two logits.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tandem_runtime::model::Architecture;
use tandem_runtime::quantize::{QuantType, quantize_to_gguf};
use tandem_runtime::synthetic::{SyntheticSpec, write_random_llama};
use tandem_runtime::{Logits, Model};
use tandem_tests::python::transformers_answer;
use tandem_tests::recorded;
use tandem_tests::reference::{self, Ours, Reference};
use tandem_tests::*;

/// Largest |Δlogit| allowed between Tandem and a reference on the same f32 weights, relative to
/// the largest |logit| (the two sum in different orders).
const TOLERANCE: f64 = 2e-4;
/// The same on Q8_0 weights: Tandem's kernels quantize the activations to 8 bits as well (as
/// llama.cpp's do), where transformers multiplies the dequantized weights in f32 (or the
/// folder's, where it cannot read the file). Seen: 0.6–4.4 % on these 64-wide models.
const Q8_TOLERANCE: f64 = 6e-2;
/// Greedy tokens compared.
const GREEDY: usize = 64;
/// Top-two gap under which a greedy step is a near-tie: there either answer is right, and the
/// comparison stops (the continuations may part there).
const NEAR_TIE: f32 = 1e-3;
/// The same where the logits may differ by up to [`Q8_TOLERANCE`].
const Q8_NEAR_TIE: f32 = 0.5;

/// The story every model reads.
fn story() -> Vec<u32> {
    tokenizer(&stories())
        .encode("Once upon a time, there was a little girl named Lily. She loved to play outside.")
        .expect("encode")
}

/// llama.cpp's answer for `family`'s f32 file, as recorded in `tests/references/llama_cpp/`.
fn llama_cpp(family: &Family, n_ctx: usize) -> Reference {
    let name = format!("{}-f32", family.name);
    reference::llama_cpp(&name, &family.f32, &story(), GREEDY, n_ctx, &positions())
}

/// Tandem's answer for `model` on the story.
fn ours(model: &Model) -> Ours {
    reference::ours(model, &tokenizer(&stories()), &story(), GREEDY)
}

/// The story's positions whose logits the references record: every fourth, and the last.
fn positions() -> Vec<usize> {
    reference::positions(story().len())
}

/// A checkpoint in its three forms: the Hugging Face folder, and GGUF files in f32 and Q8_0.
struct Family {
    name: String,
    folder: PathBuf,
    f32: PathBuf,
    q8_0: PathBuf,
    /// Whether transformers' GGUF reader knows every setting of this checkpoint. Where it does
    /// not (it reads no partial rope or LongRoPE for Phi-3, no YaRN for Qwen3), Tandem's GGUF forms are checked
    /// against transformers' answer on the folder: the same weights (Q8_0: before they were
    /// quantized).
    gguf_in_transformers: bool,
    /// Whether llama.cpp runs this checkpoint as transformers does (it leaves Phi-3's sliding
    /// window off).
    in_llama_cpp: bool,
}

/// A random checkpoint of `architecture` (tweaked by `spec`) with stories260K's vocabulary.
fn family(dir: &Path, name: &str, spec: SyntheticSpec) -> Family {
    family_with(dir, name, spec, serde_json::json!({}))
}

/// [`family`], with `config` merged into its config.json.
fn family_with(dir: &Path, name: &str, spec: SyntheticSpec, config: serde_json::Value) -> Family {
    let folder = dir.join(name);
    write_random_llama(&folder, &spec, &stories()).expect("write");
    let path = folder.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    if let (Some(json), Some(extra)) = (json.as_object_mut(), config.as_object()) {
        json.extend(extra.clone());
    }
    std::fs::write(&path, json.to_string()).expect("write");
    let gguf = |ty: QuantType, suffix: &str| {
        let file = dir.join(format!("{name}-{suffix}.gguf"));
        quantize_to_gguf(&folder, &file, ty).expect("quantize");
        file
    };
    Family {
        name: name.to_string(),
        f32: gguf(QuantType::F32, "f32"),
        q8_0: gguf(QuantType::Q8_0, "q8_0"),
        folder,
        gguf_in_transformers: true,
        in_llama_cpp: true,
    }
}

/// Checks `family` against llama.cpp (on the f32 file) and transformers (on every form).
fn check(family: &Family) {
    let what = |form: &str| format!("{} ({form})", family.name);
    let f32 = load(&family.f32);
    let n_ctx = f32.config().max_context;
    let f32 = ours(&f32);
    if family.in_llama_cpp {
        reference::compare(
            &what("f32 GGUF"),
            &f32,
            &llama_cpp(family, n_ctx),
            TOLERANCE,
            NEAR_TIE,
        );
    }
    let recorded = transformers(family);
    let forms = [
        ("folder", ours(&load(&family.folder)), TOLERANCE, NEAR_TIE),
        ("f32 GGUF", f32, TOLERANCE, NEAR_TIE),
        (
            "Q8_0 GGUF",
            ours(&load(&family.q8_0)),
            Q8_TOLERANCE,
            Q8_NEAR_TIE,
        ),
    ];
    for (form, ours, tolerance, near_tie) in &forms {
        let read = if family.gguf_in_transformers {
            form
        } else {
            &"folder"
        };
        let reference = recorded
            .get(*read)
            .unwrap_or_else(|| panic!("{}: no {read} recorded", family.name));
        reference::compare(&what(form), ours, reference, *tolerance, *near_tie);
    }
}

/// transformers' answers for `family`'s three forms, as recorded in
/// `tests/references/transformers/NAME.json` for the exact checkpoint (its files' SHA-256). With
/// `TANDEM_REFRESH_TRANSFORMERS=1` they are recorded anew first: the tests' venv gets
/// transformers and torch, runs `tests/references/transformers_logits.py` on each form, and the
/// file is rewritten.
fn transformers(family: &Family) -> BTreeMap<String, Reference> {
    let key = serde_json::json!({"checkpoint_sha256": recorded::folder_sha256(&family.folder)});
    let forms = recorded::recorded(
        &recorded::record_path("transformers", &family.name),
        key,
        recorded::REFRESH_TRANSFORMERS,
        || {
            let positions = positions();
            let request =
                serde_json::json!({"tokens": story(), "greedy": GREEDY, "positions": positions});
            let forms = [
                ("folder", &family.folder),
                ("f32 GGUF", &family.f32),
                ("Q8_0 GGUF", &family.q8_0),
            ];
            let read = if family.gguf_in_transformers { 3 } else { 1 };
            let mut recorded = serde_json::Map::new();
            for (form, model) in &forms[..read] {
                let mut answer = transformers_answer(model, &request);
                answer["positions"] = serde_json::json!(positions);
                recorded.insert(form.to_string(), answer);
            }
            recorded.into()
        },
    );
    let field = |answer: &serde_json::Value, key: &str| answer[key].clone();
    forms
        .as_object()
        .expect("forms")
        .iter()
        .map(|(form, answer)| {
            let reference = Reference {
                positions: serde_json::from_value(field(answer, "positions")).expect("positions"),
                logits: serde_json::from_value(field(answer, "logits")).expect("logits"),
                greedy: serde_json::from_value(field(answer, "greedy")).expect("greedy"),
                name: format!(
                    "transformers {} (torch {})",
                    answer["transformers"].as_str().unwrap_or("?"),
                    answer["torch"].as_str().unwrap_or("?")
                ),
            };
            (form.clone(), reference)
        })
        .collect()
}

fn spec(architecture: Architecture, seed: u64) -> SyntheticSpec {
    SyntheticSpec {
        architecture,
        ..SyntheticSpec::tiny(seed)
    }
}

#[test]
fn llama_and_qwen2_match_the_references() {
    let tmp = tempfile::tempdir().expect("tmp");
    check(&family(tmp.path(), "llama", spec(Architecture::Llama, 41)));
    check(&family(tmp.path(), "qwen2", spec(Architecture::Qwen2, 42)));
}

/// Heads of 128, Qwen3's own width and wider than hidden / heads (transformers' GGUF reader
/// reads no key length: it takes Qwen3's default, 128).
#[test]
fn qwen3_matches_the_references() {
    let tmp = tempfile::tempdir().expect("tmp");
    let qwen3 = SyntheticSpec {
        head_dim: Some(128),
        ..spec(Architecture::Qwen3, 43)
    };
    check(&family(tmp.path(), "qwen3", qwen3));
}

/// YaRN over an original context of 64 positions, 4× longer: the story's positions pass it.
#[test]
fn qwen3_with_yarn_matches_the_references() {
    let tmp = tempfile::tempdir().expect("tmp");
    let qwen3 = SyntheticSpec {
        head_dim: Some(128),
        ..spec(Architecture::Qwen3, 46)
    };
    let yarn = serde_json::json!({
        "max_position_embeddings": 64,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    });
    let qwen3 = family_with(tmp.path(), "qwen3-yarn", qwen3, yarn);
    check(&Family {
        gguf_in_transformers: false,
        ..qwen3
    });
}

/// Heads of 256, Gemma 3's own (transformers' GGUF reader takes the query scale, 1/√256, by
/// default).
#[test]
fn gemma3_matches_the_references() {
    let tmp = tempfile::tempdir().expect("tmp");
    let gemma3 = SyntheticSpec {
        num_layers: 6,
        num_kv_heads: 1,
        head_dim: Some(256),
        ..spec(Architecture::Gemma3, 44)
    };
    check(&family(tmp.path(), "gemma3", gemma3));
}

/// LongRoPE over an original context of 16 positions: the story passes it, so transformers
/// takes the long factors (it chooses by the positions seen; Tandem and llama.cpp by the
/// context served, 512 here).
#[test]
fn phi3_matches_the_references() {
    let tmp = tempfile::tempdir().expect("tmp");
    // Not named "phi3": llama.cpp then looks for Phi-3's own special tokens by name
    // (`general.name`), which stories260K's vocabulary lacks.
    let original = serde_json::json!({"original_max_position_embeddings": 16});
    let phi = family_with(
        tmp.path(),
        "tiny-phi",
        spec(Architecture::Phi3, 45),
        original,
    );
    check(&Family {
        gguf_in_transformers: false,
        ..phi
    });
}

/// Phi-3 with a sliding window of 8 positions on every layer (Phi-3-mini-4k's is 2047): the
/// story and the 64 tokens after it pass it many times. Against transformers only: llama.cpp
/// reads Phi-3's window and leaves it off.
#[test]
fn phi3_with_a_sliding_window_matches_transformers() {
    let tmp = tempfile::tempdir().expect("tmp");
    let config = serde_json::json!({"original_max_position_embeddings": 16, "sliding_window": 8});
    let phi = family_with(
        tmp.path(),
        "tiny-phi-window",
        spec(Architecture::Phi3, 47),
        config,
    );
    assert_eq!(load(&phi.folder).config().local_layers, [true, true]);
    assert_eq!(load(&phi.q8_0).config().sliding_window, 8);
    // The window is in force: the same weights without it read the story otherwise.
    let unwindowed = serde_json::json!({"original_max_position_embeddings": 16});
    let whole = family_with(
        tmp.path(),
        "tiny-phi-whole",
        spec(Architecture::Phi3, 47),
        unwindowed,
    );
    let last = |f: &Family| {
        let model = load(&f.f32);
        model
            .forward(&story(), &mut model.new_cache(), Logits::Last)
            .expect("forward")
            .remove(0)
    };
    assert_ne!(
        last(&phi),
        last(&whole),
        "the window changes the last position's logits"
    );
    check(&Family {
        gguf_in_transformers: false,
        in_llama_cpp: false,
        ..phi
    });
}
