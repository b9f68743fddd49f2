//! Reading GGUF files (llama.cpp's format): hyper-parameters from metadata, quantized tensors,
//! and a SentencePiece-style tokenizer rebuilt from `tokenizer.ggml.*`.

use std::collections::HashMap;
use std::path::Path;

use candle_core::Device;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_transformers::quantized_var_builder::VarBuilder as QVarBuilder;
use serde_json::json;

use super::config::{Architecture, ModelConfig, RopeScaling};
use super::weights::Weights;
use crate::{Error, Result};

const SUPPORTED_TYPES: &str =
    "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K";

/// An open GGUF file: metadata plus every tensor, loaded onto `device`.
pub(crate) struct GgufModel {
    pub(crate) config: ModelConfig,
    pub(crate) weights: Weights,
}

fn invalid(path: &Path, reason: impl Into<String>) -> Error {
    Error::InvalidFile {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

pub(crate) fn load(path: &Path, device: &Device) -> Result<GgufModel> {
    let mut file = std::fs::File::open(path).map_err(Error::io(path))?;
    let content = Content::read(&mut file).map_err(|e| {
        let msg = e.to_string();
        if msg.contains("unknown dtype") {
            invalid(
                path,
                format!("{msg}; supported tensor types: {SUPPORTED_TYPES}"),
            )
        } else {
            invalid(path, format!("not a readable GGUF file: {msg}"))
        }
    })?;
    let tensors = QVarBuilder::from_gguf(path, device).map_err(|e| invalid(path, e.to_string()))?;
    let meta = Meta {
        path,
        metadata: &content.metadata,
    };
    let arch_name = meta.string("general.architecture")?;
    let architecture = Architecture::parse(arch_name, path)?;
    let a = arch_name;
    let hidden_size = meta.usize(&format!("{a}.embedding_length"))?;
    let num_heads = meta.usize(&format!("{a}.attention.head_count"))?;
    let vocab_size = match tensors.get_no_shape("token_embd.weight") {
        Ok(t) => t.shape().dims()[0],
        Err(_) => {
            return Err(Error::MissingTensor {
                path: path.to_path_buf(),
                name: "token_embd.weight".into(),
            });
        }
    };
    let rope_scaling = if let Ok(freqs) = tensors.get_no_shape("rope_freqs.weight") {
        RopeScaling::Factors(freqs.dequantize(&Device::Cpu)?.to_vec1::<f32>()?)
    } else if meta.opt_string(&format!("{a}.rope.scaling.type")) == Some("linear") {
        RopeScaling::Linear {
            factor: meta.f64(&format!("{a}.rope.scaling.factor"))?,
        }
    } else {
        RopeScaling::None
    };
    let config = ModelConfig {
        architecture,
        hidden_size,
        intermediate_size: meta.usize(&format!("{a}.feed_forward_length"))?,
        num_layers: meta.usize(&format!("{a}.block_count"))?,
        num_heads,
        num_kv_heads: meta
            .opt_usize(&format!("{a}.attention.head_count_kv"))
            .unwrap_or(num_heads),
        head_dim: meta
            .opt_usize(&format!("{a}.rope.dimension_count"))
            .unwrap_or(hidden_size / num_heads.max(1)),
        vocab_size,
        max_context: meta.usize(&format!("{a}.context_length"))?,
        rms_norm_eps: meta.f64(&format!("{a}.attention.layer_norm_rms_epsilon"))?,
        rope_theta: meta
            .opt_f64(&format!("{a}.rope.freq_base"))
            .unwrap_or(10_000.0),
        rope_scaling,
        // llama.cpp permutes llama q/k rows for interleaved rope; qwen2 keeps the halves layout.
        rope_interleaved: architecture == Architecture::Llama,
        tie_word_embeddings: !tensors.contains_key("output.weight"),
        qkv_bias: tensors.contains_key("blk.0.attn_q.bias"),
        o_bias: tensors.contains_key("blk.0.attn_output.bias"),
        bos_token_id: meta
            .opt_usize("tokenizer.ggml.bos_token_id")
            .map(|v| v as u32),
        eos_token_ids: meta
            .opt_usize("tokenizer.ggml.eos_token_id")
            .map(|v| vec![v as u32])
            .unwrap_or_default(),
    };
    config.validate(path)?;
    Ok(GgufModel {
        config,
        weights: Weights::Gguf {
            path: path.to_path_buf(),
            tensors,
        },
    })
}

/// Typed access to GGUF metadata with errors naming the key.
struct Meta<'a> {
    path: &'a Path,
    metadata: &'a HashMap<String, Value>,
}

fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::U8(x) => Some(u64::from(*x)),
        Value::U16(x) => Some(u64::from(*x)),
        Value::U32(x) => Some(u64::from(*x)),
        Value::U64(x) => Some(*x),
        Value::I8(x) => u64::try_from(*x).ok(),
        Value::I16(x) => u64::try_from(*x).ok(),
        Value::I32(x) => u64::try_from(*x).ok(),
        Value::I64(x) => u64::try_from(*x).ok(),
        _ => None,
    }
}

impl Meta<'_> {
    fn get(&self, key: &str) -> Result<&Value> {
        self.metadata
            .get(key)
            .ok_or_else(|| invalid(self.path, format!("missing metadata key `{key}`")))
    }

    fn opt_usize(&self, key: &str) -> Option<usize> {
        self.metadata.get(key).and_then(as_u64).map(|v| v as usize)
    }

    fn usize(&self, key: &str) -> Result<usize> {
        let v = self.get(key)?;
        as_u64(v).map(|v| v as usize).ok_or_else(|| {
            invalid(
                self.path,
                format!("metadata `{key}` is {v:?}, expected an integer"),
            )
        })
    }

    fn opt_f64(&self, key: &str) -> Option<f64> {
        match self.metadata.get(key)? {
            Value::F32(x) => Some(f64::from(*x)),
            Value::F64(x) => Some(*x),
            _ => None,
        }
    }

    fn f64(&self, key: &str) -> Result<f64> {
        self.get(key)?;
        self.opt_f64(key)
            .ok_or_else(|| invalid(self.path, format!("metadata `{key}` is not a float")))
    }

    fn opt_string(&self, key: &str) -> Option<&str> {
        match self.metadata.get(key)? {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    fn string(&self, key: &str) -> Result<&str> {
        self.get(key)?;
        self.opt_string(key)
            .ok_or_else(|| invalid(self.path, format!("metadata `{key}` is not a string")))
    }

    fn array(&self, key: &str) -> Result<&[Value]> {
        match self.get(key)? {
            Value::Array(a) => Ok(a),
            other => Err(invalid(
                self.path,
                format!("metadata `{key}` is {other:?}, expected an array"),
            )),
        }
    }
}

/// SentencePiece token types as llama.cpp stores them.
const TOKEN_NORMAL: i64 = 1;
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

/// Rebuilds a Hugging Face `tokenizer.json` from a GGUF's SentencePiece (`llama`) vocabulary.
///
/// The merges are derived from piece scores as Hugging Face's SentencePiece converter does: every
/// split of a piece into two pieces of the vocabulary is a merge, ranked by the piece's score.
pub(crate) fn tokenizer_json(path: &Path, metadata: &HashMap<String, Value>) -> Result<String> {
    let meta = Meta { path, metadata };
    let model = meta.string("tokenizer.ggml.model")?;
    if model != "llama" {
        return Err(invalid(
            path,
            format!(
                "tokenizer.ggml.model `{model}` cannot be rebuilt from metadata (supported: llama); \
                 put the model's tokenizer.json beside the .gguf file"
            ),
        ));
    }
    let tokens: Vec<&str> = meta
        .array("tokenizer.ggml.tokens")?
        .iter()
        .map(|v| match v {
            Value::String(s) => Ok(s.as_str()),
            _ => Err(invalid(path, "tokenizer.ggml.tokens holds a non-string")),
        })
        .collect::<Result<_>>()?;
    let scores: Vec<f32> = match metadata.get("tokenizer.ggml.scores") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| if let Value::F32(x) = v { *x } else { 0.0 })
            .collect(),
        _ => vec![0.0; tokens.len()],
    };
    let types: Vec<i64> = match metadata.get("tokenizer.ggml.token_type") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| as_u64(v).map(|x| x as i64).unwrap_or(TOKEN_NORMAL))
            .collect(),
        _ => vec![TOKEN_NORMAL; tokens.len()],
    };
    let vocab: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    let mut merges: Vec<(f32, usize, usize, usize)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if !matches!(
            types.get(id),
            Some(&TOKEN_NORMAL) | Some(&TOKEN_USER_DEFINED)
        ) {
            continue;
        }
        for (split, _) in piece.char_indices().skip(1) {
            if let (Some(&l), Some(&r)) = (vocab.get(&piece[..split]), vocab.get(&piece[split..])) {
                merges.push((scores.get(id).copied().unwrap_or(0.0), id, l, r));
            }
        }
    }
    // Highest score first; within a piece, by the ids of its halves (a stable, total order).
    merges.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then((a.1, a.2, a.3).cmp(&(b.1, b.2, b.3)))
    });
    let merges: Vec<String> = merges
        .iter()
        .map(|(_, _, l, r)| format!("{} {}", tokens[*l], tokens[*r]))
        .collect();
    let added: Vec<serde_json::Value> = tokens
        .iter()
        .enumerate()
        .filter(|(id, _)| types.get(*id) == Some(&TOKEN_CONTROL) || *id == 0)
        .map(|(id, t)| {
            json!({"id": id, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let bos = meta.opt_usize("tokenizer.ggml.bos_token_id");
    let add_bos = !matches!(
        metadata.get("tokenizer.ggml.add_bos_token"),
        Some(Value::Bool(false))
    );
    let post_processor = match bos {
        Some(b) if add_bos => {
            let bos_text = tokens.get(b).copied().unwrap_or("<s>");
            json!({
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos_text, "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos_text, "type_id": 0}},
                         {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos_text: {"id": bos_text, "ids": [b], "tokens": [bos_text]}}
            })
        }
        _ => serde_json::Value::Null,
    };
    let unk = meta
        .opt_usize("tokenizer.ggml.unknown_token_id")
        .and_then(|id| tokens.get(id).copied())
        .unwrap_or("<unk>");
    let vocab_json: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| ((*t).to_string(), json!(i)))
        .collect();
    let doc = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}
        ]},
        "pre_tokenizer": null,
        "post_processor": post_processor,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        ]},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": unk,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab_json, "merges": merges
        }
    });
    Ok(doc.to_string())
}
