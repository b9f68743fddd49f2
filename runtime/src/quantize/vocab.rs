//! The `tokenizer.ggml.*` metadata written from a model's tokenizer.json, so that the GGUF file
//! runs alone, as llama.cpp's converter writes it: a SentencePiece-style BPE (byte fallback, ▁
//! for spaces: Llama 2, Mistral, Gemma 3, Phi-3) as `llama` with scores that encode the merge
//! order, a byte-level BPE (Qwen2/2.5/3, Llama 3, Phi-4-mini's o200k, GPT-2) as `gpt2` with its
//! merges and the llama.cpp name of its pre-tokenizer. [`crate::model::gguf_tokenizer`] reads
//! both back. Any other tokenizer (a pre-tokenizer llama.cpp has no name for, WordPiece, …)
//! writes nothing: its tokenizer.json must travel beside the GGUF file.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use serde::Deserialize;
use serde_json::Value as Json;

use crate::Result;
use crate::model::ModelConfig;
use crate::model::gguf_tokenizer::pre_tokenizer_name;
use crate::tokenizer::any_step;

/// Token types as llama.cpp stores them.
const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

#[derive(Deserialize)]
struct TokenizerFile {
    model: BpeModel,
    #[serde(default)]
    added_tokens: Vec<AddedToken>,
    #[serde(default)]
    normalizer: Json,
    #[serde(default)]
    pre_tokenizer: Json,
    #[serde(default)]
    post_processor: Json,
}

#[derive(Deserialize)]
struct BpeModel {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    byte_fallback: bool,
    vocab: HashMap<String, u32>,
    #[serde(default)]
    merges: Vec<Merge>,
    unk_token: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Merge {
    Joined(String),
    Pair(Vec<String>),
}

impl Merge {
    /// "left right", as GGUF stores a merge.
    fn spaced(&self) -> String {
        match self {
            Self::Joined(s) => s.clone(),
            Self::Pair(p) => p.join(" "),
        }
    }
}

#[derive(Deserialize)]
struct AddedToken {
    id: u32,
    content: String,
    #[serde(default)]
    special: bool,
}

impl TokenizerFile {
    /// Whether the text gets a `▁` before it (Llama's SentencePiece: a `Prepend` normalizer, or a
    /// `Metaspace` pre-tokenizer that prepends); Gemma's does not.
    fn space_prefix(&self) -> bool {
        any_step(&self.normalizer, &|n| {
            n["type"] == "Prepend" && n["prepend"] == "\u{2581}"
        }) || any_step(&self.pre_tokenizer, &|p| {
            p["type"] == "Metaspace"
                && (p["add_prefix_space"] == true
                    || p["prepend_scheme"].as_str().is_some_and(|s| s != "never"))
        })
    }

    /// Whether encoding puts a special token before the text (Llama 3's `<|begin_of_text|>`).
    fn adds_bos(&self) -> bool {
        any_step(&self.post_processor, &|p| {
            p["type"] == "TemplateProcessing" && p["single"][0].get("SpecialToken").is_some()
        })
    }

    /// Every id's text, `n` at least (a model's embedding may be wider than its vocabulary):
    /// the vocabulary's, then the added tokens' (Qwen's chat tokens are only there), then
    /// `filler(id)` for the ids neither names (`None` in the second list).
    fn tokens(&self, n: usize, filler: impl Fn(usize) -> String) -> (Vec<String>, Vec<bool>) {
        let last = self
            .model
            .vocab
            .values()
            .chain(self.added_tokens.iter().map(|t| &t.id))
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0);
        let n = n.max(last);
        let mut tokens: Vec<Option<String>> = vec![None; n];
        for (text, &id) in &self.model.vocab {
            tokens[id as usize] = Some(text.clone());
        }
        for t in &self.added_tokens {
            tokens[t.id as usize] = Some(t.content.clone());
        }
        let named = tokens.iter().map(Option::is_some).collect();
        let texts = tokens
            .into_iter()
            .enumerate()
            .map(|(i, t)| t.unwrap_or_else(|| filler(i)))
            .collect();
        (texts, named)
    }

    /// The ids of the added tokens, special (control) or not (user-defined).
    fn added(&self) -> (Vec<u32>, Vec<u32>) {
        let (special, plain): (Vec<&AddedToken>, Vec<&AddedToken>) =
            self.added_tokens.iter().partition(|t| t.special);
        let ids = |v: Vec<&AddedToken>| v.into_iter().map(|t| t.id).collect();
        (ids(special), ids(plain))
    }
}

fn array<T>(values: impl IntoIterator<Item = T>, f: impl Fn(T) -> Value) -> Value {
    Value::Array(values.into_iter().map(f).collect())
}

/// `tokenizer.ggml.*` for the tokenizer.json at `path`, or `None` where llama.cpp's metadata
/// cannot describe it.
pub(super) fn metadata(path: &Path, config: &ModelConfig) -> Result<Option<Vec<(String, Value)>>> {
    let file: TokenizerFile = crate::model::read_json(path)?;
    if file.model.kind != "BPE" {
        return Ok(None);
    }
    Ok(if file.model.byte_fallback {
        Some(sentencepiece(&file, config))
    } else {
        byte_level(&file, config.vocab_size)
    })
}

/// A SentencePiece-style BPE (byte fallback, ▁ for spaces).
fn sentencepiece(file: &TokenizerFile, config: &ModelConfig) -> Vec<(String, Value)> {
    let (tokens, _) = file.tokens(config.vocab_size, |i| format!("<unused{i}>"));
    let n = tokens.len();
    // A piece's score is minus the rank of the first merge that makes it: the merge order that
    // SentencePiece's scores encode, which the reader turns back into merges.
    let mut scores = vec![0f32; n];
    let mut scored = vec![false; n];
    for (rank, merge) in file.model.merges.iter().enumerate() {
        if let Some(&id) = file.model.vocab.get(&merge.spaced().replacen(' ', "", 1))
            && !scored[id as usize]
        {
            scored[id as usize] = true;
            scores[id as usize] = -(rank as f32);
        }
    }
    let unk = file
        .model
        .unk_token
        .as_deref()
        .and_then(|u| file.model.vocab.get(u))
        .copied();
    let (special, _) = file.added();
    let types = tokens.iter().enumerate().map(|(id, t)| {
        let id = id as u32;
        if Some(id) == unk {
            UNKNOWN
        } else if special.contains(&id) {
            CONTROL
        } else if t.len() == 6 && t.starts_with("<0x") && t.ends_with('>') {
            BYTE
        } else {
            NORMAL
        }
    });
    let mut m = vec![
        ("tokenizer.ggml.model".into(), Value::String("llama".into())),
        ("tokenizer.ggml.token_type".into(), array(types, Value::I32)),
        ("tokenizer.ggml.tokens".into(), array(tokens, Value::String)),
        ("tokenizer.ggml.scores".into(), array(scores, Value::F32)),
        (
            "tokenizer.ggml.add_bos_token".into(),
            Value::Bool(config.bos_token_id.is_some()),
        ),
        (
            "tokenizer.ggml.add_space_prefix".into(),
            Value::Bool(file.space_prefix()),
        ),
    ];
    if let Some(unk) = unk {
        m.push(("tokenizer.ggml.unknown_token_id".into(), Value::U32(unk)));
    }
    m
}

/// A byte-level BPE whose pre-tokenizer llama.cpp names (`None` for another), `n` ids at least.
fn byte_level(file: &TokenizerFile, n: usize) -> Option<Vec<(String, Value)>> {
    let pre = pre_tokenizer_name(&file.normalizer, &file.pre_tokenizer)?;
    // Ids past the vocabulary (a padded embedding), as llama.cpp's converter names them.
    let (tokens, named) = file.tokens(n, |i| format!("[PAD{i}]"));
    let (special, plain) = file.added();
    let types = (0..tokens.len()).map(|id| {
        let id32 = id as u32;
        if special.contains(&id32) {
            CONTROL
        } else if plain.contains(&id32) {
            USER_DEFINED
        } else if !named[id] {
            UNUSED
        } else {
            NORMAL
        }
    });
    let merges = file.model.merges.iter().map(Merge::spaced);
    Some(vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String(pre.into())),
        ("tokenizer.ggml.token_type".into(), array(types, Value::I32)),
        ("tokenizer.ggml.tokens".into(), array(tokens, Value::String)),
        ("tokenizer.ggml.merges".into(), array(merges, Value::String)),
        (
            "tokenizer.ggml.add_bos_token".into(),
            Value::Bool(file.adds_bos()),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(post_processor: Json) -> TokenizerFile {
        serde_json::from_value(serde_json::json!({
            "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]},
            "added_tokens": [
                {"id": 3, "content": "<|start|>", "special": true},
                {"id": 4, "content": "<tool>", "special": false}
            ],
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
            "post_processor": post_processor
        }))
        .expect("tokenizer.json")
    }

    #[test]
    fn a_byte_level_vocabulary_is_written_as_llama_cpp_writes_it() {
        let m: HashMap<String, Value> = byte_level(&file(Json::Null), 7)
            .expect("GPT-2's pre-tokenizer has a name")
            .into_iter()
            .collect();
        let strings = |key: &str| match &m[key] {
            Value::Array(a) => a
                .iter()
                .map(|v| match v {
                    Value::String(s) => s.clone(),
                    Value::I32(i) => i.to_string(),
                    other => format!("{other:?}"),
                })
                .collect::<Vec<_>>(),
            other => panic!("{key}: {other:?}"),
        };
        assert!(matches!(&m["tokenizer.ggml.pre"], Value::String(s) if s == "gpt2"));
        assert_eq!(
            strings("tokenizer.ggml.tokens"),
            ["a", "b", "ab", "<|start|>", "<tool>", "[PAD5]", "[PAD6]"]
        );
        assert_eq!(
            strings("tokenizer.ggml.token_type"),
            ["1", "1", "1", "3", "4", "5", "5"]
        );
        assert_eq!(strings("tokenizer.ggml.merges"), ["a b"]);
        assert!(matches!(
            m["tokenizer.ggml.add_bos_token"],
            Value::Bool(false)
        ));
    }

    #[test]
    fn a_template_that_starts_with_a_special_token_adds_bos() {
        let llama3 = serde_json::json!({"type": "Sequence", "processors": [
            {"type": "ByteLevel"},
            {"type": "TemplateProcessing", "single": [
                {"SpecialToken": {"id": "<|start|>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}}
            ]}
        ]});
        assert!(file(llama3).adds_bos());
        assert!(!file(serde_json::json!({"type": "ByteLevel"})).adds_bos());
    }

    #[test]
    fn a_pre_tokenizer_llama_cpp_has_no_name_for_writes_nothing() {
        let mut f = file(Json::Null);
        f.pre_tokenizer = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\w+"}, "behavior": "Isolated"},
            {"type": "ByteLevel", "use_regex": false}
        ]});
        assert!(byte_level(&f, 5).is_none());
    }
}
