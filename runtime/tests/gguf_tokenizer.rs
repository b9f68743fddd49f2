//! Byte-level BPE tokenizers rebuilt from GGUF metadata alone (no tokenizer.json): Qwen2.5's
//! vocabulary against reference ids produced by Hugging Face's tokenizer
//! (fixtures/qwen2.5-vocab/README.md says how), special tokens in text, decoding, the chat
//! template from the metadata, and clear errors for metadata that cannot be rebuilt.

mod common;

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Content, Value};
use common::fixtures;
use tandem_runtime::Tokenizer;

fn vocab_gguf() -> PathBuf {
    fixtures().join("qwen2.5-vocab/qwen2.5-vocab.gguf")
}

fn qwen() -> Tokenizer {
    Tokenizer::for_model(&vocab_gguf()).expect("tokenizer from GGUF metadata")
}

#[test]
fn qwen2_encoding_equals_the_reference_tokenizer() {
    let dir = fixtures().join("qwen2.5-vocab");
    let inputs = std::fs::read_to_string(dir.join("reference.inp")).expect("inputs");
    let outputs = std::fs::read_to_string(dir.join("reference.out")).expect("outputs");
    let cases: Vec<&str> = inputs.split("\n__ggml_vocab_test__\n").collect();
    let expected: Vec<&str> = outputs.split('\n').collect();
    assert_eq!(cases.len(), expected.len());
    assert!(cases.len() > 40);
    let tok = qwen();
    let mut failures = Vec::new();
    for (text, ids) in cases.iter().zip(&expected).filter(|(t, _)| !t.is_empty()) {
        let want: Vec<u32> = ids
            .split_whitespace()
            .map(|x| x.parse().expect("id"))
            .collect();
        let got = tok.encode(text).expect("encode");
        if got != want {
            failures.push(format!("{text:?}: got {got:?}, want {want:?}"));
        }
        assert_eq!(tok.decode(&got).expect("decode"), *text, "round trip");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn special_tokens_in_text_code_and_ids() {
    let tok = qwen();
    assert_eq!(
        tok.vocab_size(),
        151_936,
        "the model's embedding rows, padding included"
    );
    assert_eq!(tok.bos_id(), Some(151_643), "<|endoftext|>");
    assert_eq!(tok.eos_id(), Some(151_645), "<|im_end|>");
    let code = "fn main() {\n    let x = 42;\n\tprintln!(\"{x}\");\n}\n";
    let inner = format!("user\n{code}");
    let ids = tok
        .encode(&format!("<|im_start|>{inner}<|im_end|>"))
        .expect("encode");
    let body = tok.encode(&inner).expect("encode");
    assert_eq!(ids.first(), Some(&151_644), "<|im_start|> is one token");
    assert_eq!(ids.last(), Some(&151_645), "<|im_end|> is one token");
    assert_eq!(&ids[1..ids.len() - 1], body.as_slice());
    // Control tokens are skipped when decoding; the text in between is intact.
    assert_eq!(tok.decode(&ids).expect("decode"), inner);
    // A user-defined token (not special) is matched whole and kept when decoding.
    let tool = tok.encode("<tool_call>").expect("encode");
    assert_eq!(tool.len(), 1, "{tool:?}");
    assert_eq!(tok.decode(&tool).expect("decode"), "<tool_call>");
    // Digits are split one by one (Qwen2's pre-tokenizer).
    assert_eq!(tok.encode("2024").expect("encode").len(), 4);
    let template = tok
        .chat_template()
        .expect("chat template from the metadata");
    assert!(template.contains("<|im_start|>"), "{template}");
}

/// A copy of the vocabulary GGUF with one metadata key replaced (or removed with `None`).
fn with_metadata(dst: &Path, key: &str, value: Option<Value>) {
    let mut file = std::fs::File::open(vocab_gguf()).expect("open");
    let content = Content::read(&mut file).expect("read");
    let mut metadata = content.metadata;
    match value {
        Some(v) => metadata.insert(key.to_string(), v),
        None => metadata.remove(key),
    };
    let entries: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::fs::File::create(dst).expect("create");
    gguf_file::write(&mut out, &entries, &[]).expect("write");
}

#[test]
fn metadata_that_cannot_be_rebuilt_is_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cases: Vec<(&str, Option<Value>, &[&str])> = vec![
        (
            "tokenizer.ggml.pre",
            Some(Value::String("mystery".into())),
            &["`tokenizer.ggml.pre` = `mystery`", "qwen2", "llama-bpe"],
        ),
        (
            "tokenizer.ggml.model",
            Some(Value::String("rwkv".into())),
            &["tokenizer.ggml.model `rwkv`", "llama, gpt2"],
        ),
        (
            "tokenizer.ggml.merges",
            Some(Value::Array(vec![Value::U32(1), Value::U32(2)])),
            &["`tokenizer.ggml.merges`[0]", "expected a string"],
        ),
        (
            "tokenizer.ggml.tokens",
            Some(Value::U32(7)),
            &["`tokenizer.ggml.tokens`", "expected an array"],
        ),
        (
            "tokenizer.ggml.merges",
            None,
            &["missing metadata key `tokenizer.ggml.merges`"],
        ),
    ];
    for (i, (key, value, words)) in cases.into_iter().enumerate() {
        let path = dir.path().join(format!("bad-{i}.gguf"));
        with_metadata(&path, key, value);
        let err = Tokenizer::for_model(&path)
            .expect_err("refused")
            .to_string();
        assert!(
            err.contains(&format!("bad-{i}.gguf")),
            "names the file: {err}"
        );
        for w in words {
            assert!(err.contains(w), "{err:?} lacks {w:?}");
        }
    }
}
