//! Reading GGUF files (llama.cpp's format): hyper-parameters from metadata and quantized
//! tensors. The tokenizer in the metadata is rebuilt by [`super::gguf_tokenizer`].

use std::collections::HashMap;
use std::path::Path;

use candle_core::Device;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_transformers::quantized_var_builder::VarBuilder as QVarBuilder;

use super::config::{Activation, Architecture, GEMMA3_PATTERN, ModelConfig, RopeScaling};
use super::weights::Weights;
use crate::{Error, Result};

const SUPPORTED_TYPES: &str =
    "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K";

/// An open GGUF file: metadata plus every tensor, loaded onto `device`.
pub(crate) struct GgufModel {
    pub(crate) config: ModelConfig,
    pub(crate) weights: Weights,
}

pub(super) fn invalid(path: &Path, reason: impl Into<String>) -> Error {
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
    check_complete(path, &file, &content)?;
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
    let context = meta.usize(&format!("{a}.context_length"))?;
    let rope_scaling = rope_scaling(&meta, &tensors, a, context)?;
    let num_layers = meta.usize(&format!("{a}.block_count"))?;
    // Phi-4-mini turns 3/4 of each head: its rope dimension count is not the head's width.
    let rotary = meta.opt_usize(&format!("{a}.rope.dimension_count"));
    let head_dim = meta
        .opt_usize(&format!("{a}.attention.key_length"))
        .or(rotary.filter(|_| architecture != Architecture::Phi3))
        .unwrap_or(hidden_size / num_heads.max(1));
    let gemma = architecture == Architecture::Gemma3;
    // 0: none (llama.cpp's converter writes Phi-3's absent window so).
    let sliding_window = meta
        .opt_usize(&format!("{a}.attention.sliding_window"))
        .filter(|&w| w > 0)
        .unwrap_or(usize::MAX);
    // llama.cpp's Gemma 3: the 27B model (62 layers) scales q·k by 1/√(hidden / heads), the
    // others by 1/√head_dim (their query_pre_attn_scalar, which the files do not carry).
    let attention_scale = if gemma && num_layers == 62 {
        1.0 / ((hidden_size / num_heads.max(1)) as f64).sqrt()
    } else {
        1.0 / (head_dim as f64).sqrt()
    };
    let config = ModelConfig {
        architecture,
        hidden_size,
        intermediate_size: meta.usize(&format!("{a}.feed_forward_length"))?,
        num_layers,
        num_heads,
        num_kv_heads: meta
            .opt_usize(&format!("{a}.attention.head_count_kv"))
            .unwrap_or(num_heads),
        // A head's width: Qwen3's and Gemma's are not hidden / heads, and their files say so
        // as the key length (llama.cpp rotates all of it).
        head_dim,
        rotary_dim: rotary.unwrap_or(head_dim),
        vocab_size,
        max_context: context,
        rms_norm_eps: meta.f64(&format!("{a}.attention.layer_norm_rms_epsilon"))?,
        rope_theta: meta
            .opt_f64(&format!("{a}.rope.freq_base"))
            .unwrap_or(10_000.0),
        rope_scaling,
        // llama.cpp permutes llama q/k rows for interleaved rope; qwen2 and qwen3 keep the
        // halves layout.
        rope_interleaved: architecture == Architecture::Llama,
        tie_word_embeddings: !tensors.contains_key("output.weight"),
        qkv_bias: tensors.contains_key("blk.0.attn_q.bias"),
        o_bias: tensors.contains_key("blk.0.attn_output.bias"),
        qk_norm: tensors.contains_key("blk.0.attn_q_norm.weight"),
        activation: if gemma {
            Activation::GeluTanh
        } else {
            Activation::Silu
        },
        attention_scale,
        // Gemma 3's layers in llama.cpp: five local, one global; the local rope base fixed.
        // Phi-3's window covers every layer where it is shorter than the context (as in
        // transformers; llama.cpp reads it and leaves it off).
        local_layers: if gemma {
            (0..num_layers)
                .map(|i| !(i + 1).is_multiple_of(GEMMA3_PATTERN))
                .collect()
        } else if architecture == Architecture::Phi3 && sliding_window < context {
            vec![true; num_layers]
        } else {
            Vec::new()
        },
        sliding_window,
        rope_local_theta: 10_000.0,
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
            architecture,
        },
    })
}

/// The rotary embedding's scaling, in llama.cpp's tensors and keys (of architecture `a`, whose
/// context is `context` long): Phi-3's LongRoPE factors, a `rope_freqs` tensor, linear or YaRN.
fn rope_scaling(
    meta: &Meta,
    tensors: &QVarBuilder,
    a: &str,
    context: usize,
) -> Result<RopeScaling> {
    let factors = |name: &str| -> Result<Option<Vec<f32>>> {
        match tensors.get_no_shape(name) {
            Ok(t) => Ok(Some(t.dequantize(&Device::Cpu)?.to_vec1::<f32>()?)),
            Err(_) => Ok(None),
        }
    };
    Ok(
        if let (Some(short), Some(long)) = (
            factors("rope_factors_short.weight")?,
            factors("rope_factors_long.weight")?,
        ) {
            // Phi-3's LongRoPE, in llama.cpp's tensors and keys.
            let original = meta
                .opt_usize(&format!("{a}.rope.scaling.original_context_length"))
                .unwrap_or(context);
            let growth = context as f64 / original as f64;
            RopeScaling::LongRope {
                short,
                long,
                original,
                attention_factor: meta
                    .opt_f64(&format!("{a}.rope.scaling.attn_factor"))
                    .unwrap_or(if growth <= 1.0 {
                        1.0
                    } else {
                        (1.0 + growth.ln() / (original as f64).ln()).sqrt()
                    }),
            }
        } else if let Ok(freqs) = tensors.get_no_shape("rope_freqs.weight") {
            RopeScaling::Factors(freqs.dequantize(&Device::Cpu)?.to_vec1::<f32>()?)
        } else {
            match meta.opt_string(&format!("{a}.rope.scaling.type")) {
                Some("linear") => RopeScaling::Linear {
                    factor: meta.f64(&format!("{a}.rope.scaling.factor"))?,
                },
                // llama.cpp's keys: its attention factor multiplies YaRN's own.
                Some("yarn") => {
                    let factor = meta.f64(&format!("{a}.rope.scaling.factor"))?;
                    let times = meta
                        .opt_f64(&format!("{a}.rope.scaling.yarn_attn_factor"))
                        .unwrap_or(1.0);
                    RopeScaling::yarn(
                        factor,
                        meta.usize(&format!("{a}.rope.scaling.original_context_length"))?,
                        meta.opt_f64(&format!("{a}.rope.scaling.yarn_beta_fast"))
                            .zip(meta.opt_f64(&format!("{a}.rope.scaling.yarn_beta_slow"))),
                        Some(times * RopeScaling::yarn_mscale(factor)),
                    )
                }
                _ => RopeScaling::None,
            }
        },
    )
}

/// Refuses a file that ends before the last byte of a tensor (an interrupted download or copy),
/// naming the tensor.
fn check_complete(path: &Path, file: &std::fs::File, content: &Content) -> Result<()> {
    let len = file.metadata().map_err(Error::io(path))?.len();
    for (name, info) in &content.tensor_infos {
        let t = info.ggml_dtype;
        let bytes = (info.shape.elem_count() / t.block_size() * t.type_size()) as u64;
        let end = content.tensor_data_offset + info.offset + bytes;
        if end > len {
            return Err(invalid(
                path,
                format!(
                    "tensor `{name}` ({t:?}, {bytes} bytes) ends at byte {end}, but the file has \
                     {len} bytes: it is truncated (an interrupted download or copy?)"
                ),
            ));
        }
    }
    Ok(())
}

/// Typed access to GGUF metadata with errors naming the key.
pub(super) struct Meta<'a> {
    pub(super) path: &'a Path,
    pub(super) metadata: &'a HashMap<String, Value>,
}

pub(super) fn as_u64(v: &Value) -> Option<u64> {
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
    pub(super) fn get(&self, key: &str) -> Result<&Value> {
        self.metadata
            .get(key)
            .ok_or_else(|| invalid(self.path, format!("missing metadata key `{key}`")))
    }

    pub(super) fn opt_usize(&self, key: &str) -> Option<usize> {
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

    pub(super) fn opt_string(&self, key: &str) -> Option<&str> {
        match self.metadata.get(key)? {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub(super) fn string(&self, key: &str) -> Result<&str> {
        self.get(key)?;
        self.opt_string(key)
            .ok_or_else(|| invalid(self.path, format!("metadata `{key}` is not a string")))
    }

    pub(super) fn array(&self, key: &str) -> Result<&[Value]> {
        match self.get(key)? {
            Value::Array(a) => Ok(a),
            other => Err(invalid(
                self.path,
                format!("metadata `{key}` is {other:?}, expected an array"),
            )),
        }
    }
}
