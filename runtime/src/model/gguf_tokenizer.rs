//! The tokenizer of a GGUF file rebuilt from its `tokenizer.ggml.*` metadata as a Hugging Face
//! `tokenizer.json`, so that a folder holding only a `.gguf` runs: SentencePiece vocabularies
//! (`tokenizer.ggml.model` = `llama`: Llama 1/2, Mistral, TinyLlama) and byte-level BPE ones
//! (`gpt2`: Qwen2/2.5/3, Llama 3, Phi-4-mini, SmolLM, GPT-2), with the pre-tokenizer named by
//! `tokenizer.ggml.pre`. The pre-tokenizers are the ones the models' own tokenizer.json files
//! declare (the same splits as llama.cpp's `llama-vocab.cpp`).

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use serde_json::{Value as Json, json};

use super::config::Architecture;
use super::gguf::{Meta, as_u64, invalid};
use crate::Result;

/// Token types as llama.cpp stores them.
const TOKEN_NORMAL: i64 = 1;
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

/// The `tokenizer.ggml.pre` values this module can rebuild.
pub(crate) const SUPPORTED_PRE: &str =
    "qwen2, llama-bpe (llama3), gpt-4o (Phi-4-mini's o200k), smollm, gpt2, default";

/// Qwen2's split: contractions, letters with one leading non-letter, single digits,
/// punctuation runs, newlines, spaces.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's split: as Qwen2's, digits in runs of up to three.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-4o's split (o200k, Phi-4-mini's vocabulary): cased words with their contractions, digits
/// in runs of up to three, punctuation runs with trailing newlines or slashes, newlines, spaces.
const O200K_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The special tokens of Phi-3's vocabulary that keep the whitespace after them.
const PHI3_KEEPS_SPACE: [&str; 3] = ["<unk>", "<s>", "<|endoftext|>"];

/// Rebuilds the tokenizer.json of a GGUF file's vocabulary.
pub(crate) fn tokenizer_json(path: &Path, metadata: &HashMap<String, Value>) -> Result<String> {
    let meta = Meta { path, metadata };
    let vocab = Vocab::read(&meta)?;
    let doc = match meta.string("tokenizer.ggml.model")? {
        "llama" => sentencepiece(&meta, &vocab),
        "gpt2" => byte_level_bpe(&meta, &vocab)?,
        model => {
            return Err(invalid(
                path,
                format!(
                    "tokenizer.ggml.model `{model}` cannot be rebuilt from metadata (supported: \
                     llama, gpt2); put the model's tokenizer.json beside the .gguf file"
                ),
            ));
        }
    };
    Ok(doc.to_string())
}

/// Token texts and types.
struct Vocab<'a> {
    tokens: Vec<&'a str>,
    types: Vec<i64>,
}

impl<'a> Vocab<'a> {
    fn read(meta: &'a Meta<'a>) -> Result<Self> {
        let tokens = strings(meta, "tokenizer.ggml.tokens")?;
        let types = match meta.metadata.get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| as_u64(v).map_or(TOKEN_NORMAL, |x| x as i64))
                .collect(),
            Some(other) => {
                return Err(invalid(
                    meta.path,
                    format!(
                        "metadata `tokenizer.ggml.token_type` is {}, expected an array of integers",
                        kind(other)
                    ),
                ));
            }
            None => vec![TOKEN_NORMAL; tokens.len()],
        };
        Ok(Self { tokens, types })
    }

    fn kind(&self, id: usize) -> i64 {
        self.types.get(id).copied().unwrap_or(TOKEN_NORMAL)
    }

    /// `{token: id}`.
    fn map(&self) -> serde_json::Map<String, Json> {
        self.tokens
            .iter()
            .enumerate()
            .map(|(i, t)| ((*t).to_string(), json!(i)))
            .collect()
    }

    /// Control tokens (special, skipped when decoding), user-defined ones (matched whole in
    /// text, kept when decoding), and whatever `extra` says must be special too; those `rstrip`
    /// names swallow the whitespace after them.
    fn added(&self, extra: impl Fn(usize) -> bool, rstrip: impl Fn(&str) -> bool) -> Vec<Json> {
        self.tokens
            .iter()
            .enumerate()
            .filter_map(|(id, t)| {
                let kind = self.kind(id);
                let special = kind == TOKEN_CONTROL || extra(id);
                (special || kind == TOKEN_USER_DEFINED).then(|| {
                    json!({"id": id, "content": t, "single_word": false, "lstrip": false,
                           "rstrip": rstrip(t), "normalized": false, "special": special})
                })
            })
            .collect()
    }
}

/// A metadata array of strings, naming the first entry that is not one.
fn strings<'a>(meta: &'a Meta<'a>, key: &str) -> Result<Vec<&'a str>> {
    meta.array(key)?
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::String(s) => Ok(s.as_str()),
            other => Err(invalid(
                meta.path,
                format!(
                    "metadata `{key}`[{i}] is {}, expected a string",
                    kind(other)
                ),
            )),
        })
        .collect()
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Bool(_) => "a bool",
        Value::F32(_) | Value::F64(_) => "a float",
        _ => "an integer",
    }
}

/// Prepends BOS when the metadata asks for it (`add_bos_token`, default `default_add`).
fn post_processor(meta: &Meta, vocab: &Vocab, default_add: bool) -> Json {
    let add_bos = match meta.metadata.get("tokenizer.ggml.add_bos_token") {
        Some(Value::Bool(b)) => *b,
        _ => default_add,
    };
    let bos = meta
        .opt_usize("tokenizer.ggml.bos_token_id")
        .and_then(|b| Some((b, *vocab.tokens.get(b)?)));
    match bos {
        Some((id, text)) if add_bos => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": text, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": text, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {text: {"id": text, "ids": [id], "tokens": [text]}}
        }),
        _ => Json::Null,
    }
}

/// A SentencePiece (`llama`) vocabulary. The merges are derived from piece scores as Hugging
/// Face's SentencePiece converter does: every split of a piece into two pieces of the
/// vocabulary is a merge, ranked by the piece's score.
fn sentencepiece(meta: &Meta, vocab: &Vocab) -> Json {
    let tokens = &vocab.tokens;
    let scores: Vec<f32> = match meta.metadata.get("tokenizer.ggml.scores") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| if let Value::F32(x) = v { *x } else { 0.0 })
            .collect(),
        _ => vec![0.0; tokens.len()],
    };
    let ids: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    let mut merges: Vec<(f32, usize, usize, usize)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if !matches!(vocab.kind(id), TOKEN_NORMAL | TOKEN_USER_DEFINED) {
            continue;
        }
        for (split, _) in piece.char_indices().skip(1) {
            if let (Some(&l), Some(&r)) = (ids.get(&piece[..split]), ids.get(&piece[split..])) {
                merges.push((scores.get(id).copied().unwrap_or(0.0), id, l, r));
            }
        }
    }
    // Highest score first; within a piece, by the ids of its halves (a stable, total order).
    merges.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then((a.1, a.2, a.3).cmp(&(b.1, b.2, b.3)))
    });
    // As pairs, not "left right" strings: user-defined pieces may hold spaces (Gemma 3's runs
    // of spaces, as llama.cpp's converter writes them), which a string cannot split.
    let merges: Vec<[&str; 2]> = merges
        .iter()
        .map(|(_, _, l, r)| [tokens[*l], tokens[*r]])
        .collect();
    let unk = meta
        .opt_usize("tokenizer.ggml.unknown_token_id")
        .and_then(|id| tokens.get(id).copied())
        .unwrap_or("<unk>");
    // Llama's SentencePiece puts a space before the text (and strips it when decoding);
    // Gemma's does not (`add_space_prefix` false).
    let space_prefix = !matches!(
        meta.metadata.get("tokenizer.ggml.add_space_prefix"),
        Some(Value::Bool(false))
    );
    // Phi-3's markup tokens strip the whitespace after them in its tokenizer.json (`<|user|>\nHi`
    // is `<|user|>`, `▁Hi`); llama.cpp knows such a file by its name, Tandem by its architecture
    // as well.
    let name = meta.opt_string("general.name").unwrap_or("").to_lowercase();
    let phi3 = meta
        .opt_string("general.architecture")
        .and_then(|a| Architecture::parse(a, meta.path).ok())
        == Some(Architecture::Phi3)
        || ["phi3", "phi-3"].iter().any(|p| name.contains(p));
    let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
    let normalizer = if space_prefix {
        json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"}, replace
        ]})
    } else {
        replace
    };
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if space_prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        // Token 0 (<unk>) is special too, as in the models' own tokenizer.json.
        "added_tokens": vocab.added(|id| id == 0, |token| phi3 && !PHI3_KEEPS_SPACE.contains(&token)),
        "normalizer": normalizer,
        "pre_tokenizer": null,
        "post_processor": post_processor(meta, vocab, true),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": unk,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab.map(), "merges": merges
        }
    })
}

/// The byte-level stage of a pre-tokenizer (`use_regex`: GPT-2's own split first).
fn byte_level(trim_offsets: bool, use_regex: bool) -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": trim_offsets,
           "use_regex": use_regex})
}

fn split_then_bytes(pattern: &str, trim_offsets: bool) -> Json {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
        byte_level(trim_offsets, false)
    ]})
}

/// The normalizer, pre-tokenizer and `ignore_merges` of a byte-level BPE whose pre-tokenizer
/// llama.cpp names `pre` (`tokenizer.ggml.pre`), as that family's tokenizer.json has them.
fn byte_level_stages(pre: &str) -> Option<(Json, Json, bool)> {
    Some(match pre {
        "qwen2" => (
            json!({"type": "NFC"}),
            split_then_bytes(QWEN2_SPLIT, false),
            false,
        ),
        "llama-bpe" | "llama3" => (Json::Null, split_then_bytes(LLAMA3_SPLIT, true), true),
        "gpt-4o" => (Json::Null, split_then_bytes(O200K_SPLIT, false), false),
        "smollm" => (
            Json::Null,
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true, true)
            ]}),
            false,
        ),
        "gpt2" | "gpt-2" | "default" => (Json::Null, byte_level(true, true), false),
        _ => return None,
    })
}

/// The llama.cpp name of a byte-level tokenizer.json's pre-tokenizer (what the GGUF converter
/// writes as `tokenizer.ggml.pre`): the name whose stages split text the same way.
pub(crate) fn pre_tokenizer_name(normalizer: &Json, pre_tokenizer: &Json) -> Option<&'static str> {
    let want = (normalizer["type"].clone(), splits(pre_tokenizer));
    ["qwen2", "llama-bpe", "gpt-4o", "smollm", "gpt2"]
        .into_iter()
        .find(|name| {
            byte_level_stages(name).is_some_and(|(n, p, _)| (n["type"].clone(), splits(&p)) == want)
        })
}

/// What decides a pre-tokenizer's pieces: its regex splits (a `Split` that removes what its
/// pattern does not match, inverted, keeps the same pieces as one that isolates the matches when
/// the pattern matches every character, as these do), digit splits and GPT-2's own regex.
fn splits(pre: &Json) -> Vec<String> {
    let steps = match pre["pretokenizers"].as_array() {
        Some(steps) => steps.clone(),
        None => vec![pre.clone()],
    };
    steps
        .iter()
        .map(|step| match step["type"].as_str() {
            Some("Split") => format!("split {}", step["pattern"]["Regex"]),
            Some("Digits") => format!("digits {}", step["individual_digits"]),
            Some("ByteLevel") => format!("bytes {}", step["use_regex"]),
            other => format!("{other:?}"),
        })
        .collect()
}

/// A byte-level BPE (`gpt2`) vocabulary with the merges stored in the metadata.
fn byte_level_bpe(meta: &Meta, vocab: &Vocab) -> Result<Json> {
    let pre = meta.opt_string("tokenizer.ggml.pre").unwrap_or("default");
    let Some((normalizer, pre_tokenizer, ignore_merges)) = byte_level_stages(pre) else {
        return Err(invalid(
            meta.path,
            format!(
                "unknown pre-tokenizer `tokenizer.ggml.pre` = `{pre}`; supported: \
                 {SUPPORTED_PRE}; or put the model's tokenizer.json beside the .gguf file"
            ),
        ));
    };
    let merges = strings(meta, "tokenizer.ggml.merges")?;
    let bytes = byte_level(false, false);
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": vocab.added(|_| false, |_| false),
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor(meta, vocab, false),
        "decoder": bytes,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
            "vocab": vocab.map(), "merges": merges
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr as _;

    /// The pre-tokenizers of Qwen2.5's and GPT-4o's tokenizer.json files (GPT-4o's as Xenova's
    /// conversion writes it: the matches kept by removing the rest, inverted) get llama.cpp's
    /// names; another regex gets none.
    #[test]
    fn byte_level_pre_tokenizers_get_llama_cpp_names() {
        let split = |pattern: &str, behavior: &str, invert: bool| {
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": behavior,
                 "invert": invert},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
                 "use_regex": false}
            ]})
        };
        let nfc = json!({"type": "NFC"});
        let name = |n: &Json, p: &Json| pre_tokenizer_name(n, p);
        assert_eq!(
            name(&nfc, &split(QWEN2_SPLIT, "Isolated", false)),
            Some("qwen2")
        );
        assert_eq!(
            name(&Json::Null, &split(QWEN2_SPLIT, "Isolated", false)),
            None
        );
        assert_eq!(
            name(&Json::Null, &split(LLAMA3_SPLIT, "Isolated", false)),
            Some("llama-bpe")
        );
        assert_eq!(
            name(&Json::Null, &split(O200K_SPLIT, "Removed", true)),
            Some("gpt-4o")
        );
        assert_eq!(name(&Json::Null, &split(r"\w+", "Isolated", false)), None);
        assert_eq!(name(&Json::Null, &byte_level(true, true)), Some("gpt2"));
    }

    /// A SentencePiece vocabulary with or without Llama's space before the text (Gemma's has
    /// none: `add_space_prefix` false).
    #[test]
    fn sentencepiece_adds_the_space_prefix_unless_told_not_to() {
        let pieces = [
            "<unk>",
            "<s>",
            "</s>",
            "\u{2581}",
            "H",
            "i",
            "Hi",
            "\u{2581}Hi",
        ];
        let mut metadata = HashMap::from([
            (
                "tokenizer.ggml.model".to_string(),
                Value::String("llama".into()),
            ),
            (
                "tokenizer.ggml.tokens".to_string(),
                Value::Array(pieces.iter().map(|p| Value::String((*p).into())).collect()),
            ),
            (
                "tokenizer.ggml.scores".to_string(),
                Value::Array((0..pieces.len()).map(|i| Value::F32(i as f32)).collect()),
            ),
            (
                "tokenizer.ggml.add_bos_token".to_string(),
                Value::Bool(false),
            ),
        ]);
        let encode = |metadata: &HashMap<String, Value>| {
            let json = tokenizer_json(Path::new("t.gguf"), metadata).expect("json");
            let tok = tokenizers::Tokenizer::from_str(&json).expect("tokenizer");
            let ids = tok.encode("Hi", false).expect("encode").get_ids().to_vec();
            (ids.clone(), tok.decode(&ids, false).expect("decode"))
        };
        assert_eq!(encode(&metadata), (vec![7], "Hi".to_string()));
        metadata.insert(
            "tokenizer.ggml.add_space_prefix".to_string(),
            Value::Bool(false),
        );
        assert_eq!(encode(&metadata), (vec![6], "Hi".to_string()));
    }
}
