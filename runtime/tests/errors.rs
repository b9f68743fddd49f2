//! Bad input gets a typed error naming the file, field or limit: never a panic.

mod common;

use common::*;
use tandem_runtime::quantize::QuantType;
use tandem_runtime::{
    Error, GenerateRequest, LoadOptions, Logits, Model, SamplingParams, SpeculativeGenerator,
    Tokenizer,
};

fn load_err(path: &std::path::Path) -> Error {
    Model::load(path, &LoadOptions::default()).expect_err("load must fail")
}

#[test]
fn missing_files_name_the_file() {
    let dir = tempfile::tempdir().expect("tmp");
    let e = load_err(&dir.path().join("nope"));
    assert!(matches!(e, Error::MissingFile { .. }), "{e}");
    let e = load_err(dir.path());
    assert!(e.to_string().contains("config.json"), "{e}");
    std::fs::copy(
        stories_dir().join("config.json"),
        dir.path().join("config.json"),
    )
    .expect("copy");
    let e = load_err(dir.path());
    assert!(e.to_string().contains("model.safetensors"), "{e}");
    let e = Tokenizer::for_model(dir.path()).expect_err("no tokenizer");
    assert!(e.to_string().contains("tokenizer.json"), "{e}");
}

#[test]
fn unsupported_architecture_is_named() {
    let dir = tempfile::tempdir().expect("tmp");
    let config = std::fs::read_to_string(stories_dir().join("config.json")).expect("read");
    std::fs::write(
        dir.path().join("config.json"),
        config.replace("\"llama\"", "\"gpt2\""),
    )
    .expect("write");
    let e = load_err(dir.path());
    assert!(
        matches!(e, Error::UnsupportedArchitecture { ref found, .. } if found == "gpt2"),
        "{e}"
    );
    assert!(e.to_string().contains("supported: llama"), "{e}");
}

#[test]
fn malformed_config_and_gguf_are_reported() {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(dir.path().join("config.json"), "{ not json").expect("write");
    assert!(matches!(load_err(dir.path()), Error::InvalidFile { .. }));
    let bad = dir.path().join("bad.gguf");
    std::fs::write(&bad, b"definitely not gguf").expect("write");
    let e = load_err(&bad);
    assert!(e.to_string().contains("GGUF"), "{e}");
}

/// Patches the type code of the first tensor of a GGUF file to one candle cannot read.
fn with_tensor_type(src: &std::path::Path, dst: &std::path::Path, code: u32) {
    let mut bytes = std::fs::read(src).expect("read");
    let name = b"blk.0.attn_k.weight";
    let at = bytes
        .windows(name.len())
        .position(|w| w == name)
        .expect("tensor name");
    // name, then n_dims (u32), dims (u64 each), then the type (u32).
    let dims_at = at + name.len();
    let n_dims = u32::from_le_bytes(bytes[dims_at..dims_at + 4].try_into().expect("u32")) as usize;
    let type_at = dims_at + 4 + 8 * n_dims;
    bytes[type_at..type_at + 4].copy_from_slice(&code.to_le_bytes());
    std::fs::write(dst, bytes).expect("write");
}

#[test]
fn a_truncated_gguf_names_the_tensor_it_cuts() {
    let dir = tempfile::tempdir().expect("tmp");
    let bytes = std::fs::read(stories_gguf(QuantType::Q8_0)).expect("read");
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 100]).expect("write");
    let msg = load_err(&cut).to_string();
    for w in ["cut.gguf", "truncated", "tensor `", "ends at byte"] {
        assert!(msg.contains(w), "{msg:?} lacks {w:?}");
    }
}

#[test]
fn unsupported_gguf_tensor_type_is_named() {
    let dir = tempfile::tempdir().expect("tmp");
    let bad = dir.path().join("iq.gguf");
    // 16 is IQ2_XXS in ggml, which candle does not implement.
    with_tensor_type(&stories_gguf(QuantType::Q8_0), &bad, 16);
    let e = load_err(&bad);
    let msg = e.to_string();
    assert!(
        msg.contains("unknown dtype") && msg.contains("supported tensor types: F32"),
        "{msg}"
    );
}

fn generator_error(req: &GenerateRequest) -> Error {
    let model = load(&stories_dir());
    let tok = tokenizer();
    let generator = SpeculativeGenerator::new(&model, None, &tok).expect("generator");
    generator
        .generate(req, |_| {})
        .expect_err("must be refused")
}

fn valid_request() -> GenerateRequest {
    GenerateRequest {
        prompt: vec![1, 403, 407],
        max_new_tokens: 10,
        sampling: SamplingParams::greedy(),
        draft_tokens: 4,
        stop_token_ids: vec![],
        stop_strings: vec![],
    }
}

#[test]
fn request_limits_are_enforced_with_named_fields() {
    let e = generator_error(&GenerateRequest {
        prompt: vec![],
        ..valid_request()
    });
    assert!(matches!(e, Error::EmptyPrompt), "{e}");

    let e = generator_error(&GenerateRequest {
        prompt: vec![1, 9999],
        ..valid_request()
    });
    assert!(
        matches!(
            e,
            Error::TokenOutOfRange {
                token: 9999,
                vocab_size: 512
            }
        ),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "token id 9999 is out of range: the vocabulary has 512 tokens"
    );

    let e = generator_error(&GenerateRequest {
        prompt: vec![1; 500],
        max_new_tokens: 20,
        ..valid_request()
    });
    assert!(
        matches!(
            e,
            Error::PromptTooLong {
                len: 500,
                max_new: 20,
                limit: 512
            }
        ),
        "{e}"
    );

    let e = generator_error(&GenerateRequest {
        draft_tokens: 65,
        ..valid_request()
    });
    assert!(
        e.to_string().contains("`draft_tokens` = 65") && e.to_string().contains("at most 64"),
        "{e}"
    );

    for (sampling, field) in [
        (
            SamplingParams {
                temperature: -0.5,
                ..Default::default()
            },
            "temperature",
        ),
        (
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            },
            "temperature",
        ),
        (
            SamplingParams {
                top_p: 1.5,
                ..Default::default()
            },
            "top_p",
        ),
        (
            SamplingParams {
                min_p: -0.1,
                ..Default::default()
            },
            "min_p",
        ),
        (
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
            "repetition_penalty",
        ),
    ] {
        let e = generator_error(&GenerateRequest {
            sampling,
            ..valid_request()
        });
        assert!(
            matches!(e, Error::InvalidParameter { field: f, .. } if f == field),
            "{field}: {e}"
        );
    }
}

#[test]
fn forward_refuses_out_of_range_tokens_and_a_full_context() {
    let model = load(&stories_dir());
    let mut cache = model.new_cache();
    let e = model
        .forward(&[1, 512], &mut cache, Logits::Last)
        .expect_err("out of range");
    assert!(
        matches!(e, Error::TokenOutOfRange { token: 512, .. }),
        "{e}"
    );
    assert_eq!(
        cache.len(),
        0,
        "a refused forward leaves the cache untouched"
    );
    model
        .forward(&[1; 510], &mut cache, Logits::Last)
        .expect("fits");
    let e = model
        .forward(&[1; 3], &mut cache, Logits::Last)
        .expect_err("over the context");
    assert!(
        matches!(
            e,
            Error::ContextFull {
                len: 513,
                limit: 512
            }
        ),
        "{e}"
    );
    assert_eq!(cache.len(), 510);
    let e = cache.truncate(600).expect_err("beyond length");
    assert!(
        matches!(
            e,
            Error::TruncateBeyondLength {
                requested: 600,
                len: 510
            }
        ),
        "{e}"
    );
}

#[test]
fn mismatched_vocabularies_are_refused_with_what_differs() {
    let stories = tokenizer();
    let llama2 = Tokenizer::for_model(&fixtures().join("llama2-tokenizer")).expect("llama2");
    let e = Tokenizer::check_compatible(&llama2, &stories).expect_err("sizes differ");
    assert!(
        e.to_string().contains("vocabulary size 32000") && e.to_string().contains("vs 512"),
        "{e}"
    );

    let dir = tempfile::tempdir().expect("tmp");
    let json = std::fs::read_to_string(stories_dir().join("tokenizer.json")).expect("read");
    // A byte-fallback piece: no merge refers to it, so the patched file still loads.
    let patched = json.replacen("\"<0x7E>\"", "\"<tilde>\"", 1);
    assert_ne!(json, patched);
    std::fs::write(dir.path().join("tokenizer.json"), patched).expect("write");
    let other = Tokenizer::for_model(dir.path()).expect("patched tokenizer");
    let e = Tokenizer::check_compatible(&other, &stories).expect_err("a token differs");
    assert!(
        e.to_string()
            .contains("\"<tilde>\" in the draft and \"<0x7E>\" in the target"),
        "{e}"
    );

    let target = load(&stories_dir());
    let wide = tempfile::tempdir().expect("tmp");
    tandem_runtime::synthetic::write_random_llama(
        wide.path(),
        &tandem_runtime::synthetic::SyntheticSpec {
            num_layers: 1,
            ..tandem_runtime::synthetic::SyntheticSpec::tiny(1)
        },
        &fixtures().join("llama2-tokenizer"),
    )
    .expect("write");
    let draft = load(wide.path());
    let e =
        SpeculativeGenerator::new(&target, Some(&draft), &stories).expect_err("logit sizes differ");
    assert!(
        e.to_string()
            .contains("32000 logits per position, the target 512"),
        "{e}"
    );
}
