//! Model hyper-parameters: read from a Hugging Face `config.json` (plus `generation_config.json`)
//! or from GGUF metadata, normalised into one [`ModelConfig`].

use std::path::Path;

use serde::Deserialize;

use crate::{Error, Result};

/// The model families the runtime implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 1/2/3, TinyLlama, SmolLM, Mistral (no bias, optional GQA and rope scaling).
    Llama,
    /// Qwen2 / Qwen2.5: Llama with q/k/v biases.
    Qwen2,
    /// Qwen3 (dense): Llama with an RMSNorm over each head of q and k, before rope.
    Qwen3,
    /// Gemma 3 (text): embeddings scaled by √hidden, RMSNorms of (1 + w) before and after
    /// attention and the MLP, GeGLU (tanh GELU), q/k head norms, sliding-window local layers
    /// with a rope base of their own between global ones.
    Gemma3,
    /// Phi-3 / Phi-4-mini: fused qkv and gate/up projections, rope over part of each head
    /// (Phi-4-mini: 3/4), LongRoPE factors.
    Phi3,
}

pub(crate) const SUPPORTED: &str = "llama, mistral, qwen2, qwen3, gemma3 (text), phi3 (Phi-3, Phi-4-mini) (and their GGUF \
     equivalents)";

impl Architecture {
    pub(crate) fn parse(name: &str, path: &Path) -> Result<Self> {
        match name {
            "llama" | "mistral" | "LlamaForCausalLM" | "MistralForCausalLM" => Ok(Self::Llama),
            "qwen2" | "Qwen2ForCausalLM" => Ok(Self::Qwen2),
            "qwen3" | "Qwen3ForCausalLM" => Ok(Self::Qwen3),
            "gemma3" | "gemma3_text" | "Gemma3ForCausalLM" => Ok(Self::Gemma3),
            "phi3" | "Phi3ForCausalLM" => Ok(Self::Phi3),
            other => Err(Error::UnsupportedArchitecture {
                path: path.to_path_buf(),
                found: other.to_string(),
                supported: SUPPORTED,
            }),
        }
    }

    /// Its name in GGUF metadata (`general.architecture`, and the prefix of its keys).
    pub(crate) fn gguf_name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Gemma3 => "gemma3",
            Self::Phi3 => "phi3",
        }
    }
}

/// Rotary position embedding frequencies.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain rope: inv_freq_i = theta^(-2i/d).
    None,
    /// Positions divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1 frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// Per-frequency divisors stored with the model (GGUF `rope_freqs.weight`).
    Factors(Vec<f32>),
    /// Phi-3's LongRoPE: per-frequency divisors, the long ones where the context served is
    /// longer than `original` (as llama.cpp chooses), cos and sin scaled by `attention_factor`.
    LongRope {
        short: Vec<f32>,
        long: Vec<f32>,
        original: usize,
        attention_factor: f64,
    },
    /// YaRN (Qwen2.5 and Qwen3 long context): frequencies that turn fewer than `beta_slow` times
    /// over the original context are divided by `factor`, those that turn more than `beta_fast`
    /// times are kept, a linear ramp between; cos and sin are scaled by `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
    },
}

impl RopeScaling {
    /// YaRN with the defaults of transformers and llama.cpp: β 32 and 1, and the attention
    /// factor [`Self::yarn_mscale`].
    pub fn yarn(
        factor: f64,
        original_max_position_embeddings: usize,
        beta: Option<(f64, f64)>,
        attention_factor: Option<f64>,
    ) -> Self {
        let (beta_fast, beta_slow) = beta.unwrap_or((32.0, 1.0));
        Self::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor: attention_factor.unwrap_or_else(|| Self::yarn_mscale(factor)),
        }
    }

    /// YaRN's default attention factor, 0.1 · ln(factor) + 1 (llama.cpp's `rope.scaling.
    /// attn_factor` multiplies it).
    pub(crate) fn yarn_mscale(factor: f64) -> f64 {
        if factor <= 1.0 {
            1.0
        } else {
            0.1 * factor.ln() + 1.0
        }
    }

    /// What cos and sin are multiplied by.
    pub(crate) fn attention_factor(&self) -> f64 {
        match self {
            Self::Yarn {
                attention_factor, ..
            }
            | Self::LongRope {
                attention_factor, ..
            } => *attention_factor,
            _ => 1.0,
        }
    }
}

/// The MLP's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU (Llama, Qwen).
    Silu,
    /// GeGLU with the tanh approximation of GELU (Gemma).
    GeluTanh,
}

/// Normalised hyper-parameters of a Llama-family model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// The leading dimensions of each head that rope turns (head_dim, or Phi-4-mini's 3/4).
    pub rotary_dim: usize,
    pub vocab_size: usize,
    /// Longest sequence (prompt plus generated tokens) the model accepts.
    pub max_context: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// GGUF llama checkpoints store q/k rows permuted for interleaved rope.
    pub rope_interleaved: bool,
    pub tie_word_embeddings: bool,
    /// Bias on the q, k and v projections (Qwen2, Llama with `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama with `attention_bias`).
    pub o_bias: bool,
    /// An RMSNorm over each head of q and of k, before rope (Qwen3, Gemma 3).
    pub qk_norm: bool,
    pub activation: Activation,
    /// What q·k is multiplied by: 1/√head_dim, or Gemma's 1/√query_pre_attn_scalar.
    pub attention_scale: f64,
    /// Which layers attend only to the last `sliding_window` positions (their own included),
    /// with rope base `rope_local_theta` and no scaling (Gemma 3's local layers); empty: none.
    pub local_layers: Vec<bool>,
    pub sliding_window: usize,
    pub rope_local_theta: f64,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    fn into_vec(self) -> Vec<u32> {
        match self {
            Self::One(id) => vec![id],
            Self::Many(ids) => ids,
        }
    }
}

#[derive(Debug, Deserialize)]
struct HfRopeScaling {
    #[serde(alias = "type")]
    rope_type: String,
    factor: Option<f64>,
    beta_fast: Option<f64>,
    beta_slow: Option<f64>,
    attention_factor: Option<f64>,
    short_factor: Option<Vec<f32>>,
    long_factor: Option<Vec<f32>>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
}

#[derive(Debug, Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    architectures: Option<Vec<String>>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    #[serde(default = "default_context")]
    max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    rope_theta: f64,
    rope_scaling: Option<HfRopeScaling>,
    #[serde(default)]
    tie_word_embeddings: bool,
    attention_bias: Option<bool>,
    hidden_act: Option<String>,
    /// Gemma's name for the activation.
    hidden_activation: Option<String>,
    query_pre_attn_scalar: Option<f64>,
    sliding_window: Option<usize>,
    sliding_window_pattern: Option<usize>,
    layer_types: Option<Vec<String>>,
    rope_local_base_freq: Option<f64>,
    partial_rotary_factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<TokenIds>,
}

#[derive(Debug, Deserialize)]
struct HfGenerationConfig {
    bos_token_id: Option<u32>,
    eos_token_id: Option<TokenIds>,
}

/// Gemma 3's layers: five local ones, then a global one.
pub(crate) const GEMMA3_PATTERN: usize = 6;

fn default_context() -> usize {
    2048
}
fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10_000.0
}

pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(Error::io(path))?;
    serde_json::from_str(&text).map_err(|e| Error::InvalidFile {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

impl ModelConfig {
    /// Reads `config.json` and, when present, `generation_config.json` from a model folder.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        if !path.exists() {
            return Err(Error::MissingFile {
                path,
                what: "a Hugging Face model folder needs config.json",
            });
        }
        let json: serde_json::Value = read_json(&path)?;
        if json.get("text_config").is_some() {
            return Err(Error::InvalidFile {
                path,
                reason: "a multimodal checkpoint (its text model under `text_config`): serve \
                         its text-only form (Gemma3ForCausalLM) or a GGUF file of it"
                    .into(),
            });
        }
        let hf: HfConfig = serde_json::from_value(json).map_err(|e| Error::InvalidFile {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let arch_name = hf
            .model_type
            .clone()
            .or_else(|| hf.architectures.as_ref().and_then(|a| a.first().cloned()))
            .unwrap_or_default();
        let architecture = Architecture::parse(&arch_name, &path)?;
        let activation = hf_activation(&hf, architecture, &path)?;
        let head_dim = hf
            .head_dim
            .unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1));
        let local_layers = hf_local_layers(&hf, architecture);
        let (bos_token_id, eos_token_ids) = hf_special_tokens(dir, &hf)?;
        let rope_scaling = match hf.rope_scaling {
            None => RopeScaling::None,
            Some(s) => rope_scaling_from_hf(
                s,
                hf.max_position_embeddings,
                hf.original_max_position_embeddings,
                &path,
            )?,
        };
        let attention_bias = hf.attention_bias.unwrap_or(false);
        let config = Self {
            architecture,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_layers: hf.num_hidden_layers,
            num_heads: hf.num_attention_heads,
            num_kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim,
            rotary_dim: (head_dim as f64 * hf.partial_rotary_factor.unwrap_or(1.0)) as usize,
            vocab_size: hf.vocab_size,
            // With YaRN the context is the original one times the factor (vLLM reads it so; a
            // Qwen2.5 config.json keeps 32768 beside a factor of 4).
            max_context: match rope_scaling {
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings,
                    ..
                } => hf
                    .max_position_embeddings
                    .max((original_max_position_embeddings as f64 * factor) as usize),
                _ => hf.max_position_embeddings,
            },
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta: hf.rope_theta,
            rope_scaling,
            rope_interleaved: false,
            tie_word_embeddings: hf.tie_word_embeddings,
            qkv_bias: architecture == Architecture::Qwen2 || attention_bias,
            o_bias: attention_bias,
            qk_norm: matches!(architecture, Architecture::Qwen3 | Architecture::Gemma3),
            activation,
            attention_scale: 1.0 / hf.query_pre_attn_scalar.unwrap_or(head_dim as f64).sqrt(),
            sliding_window: hf.sliding_window.unwrap_or(usize::MAX),
            local_layers,
            rope_local_theta: hf.rope_local_base_freq.unwrap_or(10_000.0),
            bos_token_id,
            eos_token_ids,
        };
        config.validate(&path)?;
        Ok(config)
    }

    /// Checks the shape relations the forward pass relies on.
    pub(crate) fn validate(&self, path: &Path) -> Result<()> {
        let fail = |reason: String| {
            Err(Error::InvalidFile {
                path: path.to_path_buf(),
                reason,
            })
        };
        if self.num_heads == 0 || self.num_kv_heads == 0 || self.num_layers == 0 {
            return fail(
                "num_attention_heads, num_key_value_heads and num_hidden_layers must be positive"
                    .into(),
            );
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return fail(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_dim {
            return fail(format!(
                "rope turns {} of the head's {} dimensions: it must be an even number of them",
                self.rotary_dim, self.head_dim
            ));
        }
        if !self.local_layers.is_empty() && self.local_layers.len() != self.num_layers {
            return fail(format!(
                "{} layer types for {} layers",
                self.local_layers.len(),
                self.num_layers
            ));
        }
        if self.vocab_size == 0 || self.max_context == 0 {
            return fail("vocab_size and max_position_embeddings must be positive".into());
        }
        Ok(())
    }

    /// Inverse rope frequencies, one per pair of head dimensions, with scaling applied.
    pub(crate) fn inv_freq(&self) -> Vec<f32> {
        let d = self.rotary_dim;
        let base: Vec<f64> = (0..d / 2)
            .map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / d as f64))
            .collect();
        let scaled: Vec<f64> = match &self.rope_scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::LongRope {
                short,
                long,
                original,
                ..
            } => base
                .iter()
                .zip(if self.max_context > *original {
                    long
                } else {
                    short
                })
                .map(|(f, s)| f / f64::from(*s))
                .collect(),
            RopeScaling::Factors(factors) => base
                .iter()
                .zip(factors.iter().chain(std::iter::repeat(&1.0)))
                .map(|(f, s)| f / f64::from(*s))
                .collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = *original_max_position_embeddings as f64;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                ..
            } => {
                // The dimension (of d) whose frequency turns `turns` times over the original
                // context; the ramp runs between those of β fast and β slow, whole dimensions.
                let dim_of = |turns: f64| {
                    d as f64
                        * (*original_max_position_embeddings as f64
                            / (turns * 2.0 * std::f64::consts::PI))
                            .ln()
                        / (2.0 * self.rope_theta.ln())
                };
                let low = dim_of(*beta_fast).floor().max(0.0);
                let high = dim_of(*beta_slow).ceil().min(d as f64 - 1.0);
                let span = if high == low { 0.001 } else { high - low };
                base.iter()
                    .enumerate()
                    .map(|(i, &f)| {
                        // 1: kept (extrapolated), 0: divided by the factor (interpolated).
                        let keep = 1.0 - ((i as f64 - low) / span).clamp(0.0, 1.0);
                        f / factor * (1.0 - keep) + f * keep
                    })
                    .collect()
            }
        };
        scaled.into_iter().map(|f| f as f32).collect()
    }
}

/// The MLP's activation a Hugging Face config names (`hidden_activation` or `hidden_act`).
fn hf_activation(hf: &HfConfig, architecture: Architecture, path: &Path) -> Result<Activation> {
    match hf.hidden_activation.as_deref().or(hf.hidden_act.as_deref()) {
        None if architecture == Architecture::Gemma3 => Ok(Activation::GeluTanh),
        None | Some("silu") => Ok(Activation::Silu),
        Some("gelu_pytorch_tanh") => Ok(Activation::GeluTanh),
        Some(act) => Err(Error::InvalidFile {
            path: path.to_path_buf(),
            reason: format!(
                "hidden_act `{act}` is not supported; supported: silu, gelu_pytorch_tanh"
            ),
        }),
    }
}

/// Which layers attend within the sliding window (empty: none).
fn hf_local_layers(hf: &HfConfig, architecture: Architecture) -> Vec<bool> {
    // Gemma 3's local layers: `layer_types`, or every layer but each `pattern`-th.
    match (architecture, &hf.layer_types, hf.sliding_window_pattern) {
        (Architecture::Gemma3, Some(types), _) => {
            types.iter().map(|t| t == "sliding_attention").collect()
        }
        (Architecture::Gemma3, None, pattern) => {
            let pattern = pattern.unwrap_or(GEMMA3_PATTERN);
            (0..hf.num_hidden_layers)
                .map(|i| !(i + 1).is_multiple_of(pattern))
                .collect()
        }
        // Phi-3's window covers every layer (Phi-3-mini-4k: 2047 of 4096; the later ones name
        // one longer than their context, i.e. none).
        (Architecture::Phi3, _, _)
            if hf
                .sliding_window
                .is_some_and(|w| w < hf.max_position_embeddings) =>
        {
            vec![true; hf.num_hidden_layers]
        }
        _ => Vec::new(),
    }
}

/// The BOS token and the EOS tokens: the config's, overridden by `generation_config.json` where
/// the folder has one.
fn hf_special_tokens(dir: &Path, hf: &HfConfig) -> Result<(Option<u32>, Vec<u32>)> {
    let mut bos_token_id = hf.bos_token_id;
    let mut eos_token_ids = (hf.eos_token_id.clone())
        .map(TokenIds::into_vec)
        .unwrap_or_default();
    let gen_path = dir.join("generation_config.json");
    if gen_path.exists() {
        let generation: HfGenerationConfig = read_json(&gen_path)?;
        bos_token_id = generation.bos_token_id.or(bos_token_id);
        if let Some(eos) = generation.eos_token_id {
            eos_token_ids = eos.into_vec();
        }
    }
    Ok((bos_token_id, eos_token_ids))
}

fn rope_scaling_from_hf(
    s: HfRopeScaling,
    max_position_embeddings: usize,
    original: Option<usize>,
    path: &Path,
) -> Result<RopeScaling> {
    let missing = |field: &str| Error::InvalidFile {
        path: path.to_path_buf(),
        reason: format!("rope_scaling of type `{}` needs `{field}`", s.rope_type),
    };
    match s.rope_type.as_str() {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: s.factor.ok_or_else(|| missing("factor"))?,
        }),
        // Phi-3's LongRoPE ("su" in its first configs), as transformers computes it: the factor
        // is the context's growth over the original.
        "longrope" | "su" => {
            let original = original.unwrap_or(max_position_embeddings);
            let growth = max_position_embeddings as f64 / original as f64;
            Ok(RopeScaling::LongRope {
                short: s
                    .short_factor
                    .clone()
                    .ok_or_else(|| missing("short_factor"))?,
                long: s
                    .long_factor
                    .clone()
                    .ok_or_else(|| missing("long_factor"))?,
                original,
                attention_factor: s.attention_factor.unwrap_or(if growth <= 1.0 {
                    1.0
                } else {
                    (1.0 + growth.ln() / (original as f64).ln()).sqrt()
                }),
            })
        }
        "yarn" => Ok(RopeScaling::yarn(
            s.factor.ok_or_else(|| missing("factor"))?,
            s.original_max_position_embeddings
                .unwrap_or(max_position_embeddings),
            s.beta_fast.zip(s.beta_slow),
            s.attention_factor,
        )),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: s.factor.ok_or_else(|| missing("factor"))?,
            low_freq_factor: s
                .low_freq_factor
                .ok_or_else(|| missing("low_freq_factor"))?,
            high_freq_factor: s
                .high_freq_factor
                .ok_or_else(|| missing("high_freq_factor"))?,
            original_max_position_embeddings: s
                .original_max_position_embeddings
                .ok_or_else(|| missing("original_max_position_embeddings"))?,
        }),
        other => Err(Error::InvalidFile {
            path: path.to_path_buf(),
            reason: format!(
                "rope_scaling type `{other}` is not supported; supported: default, linear, \
                 llama3, yarn, longrope"
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(rope_scaling: RopeScaling) -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Llama,
            hidden_size: 4096,
            intermediate_size: 14336,
            num_layers: 1,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            rotary_dim: 128,
            vocab_size: 128_256,
            max_context: 8192,
            rms_norm_eps: 1e-5,
            rope_theta: 500_000.0,
            rope_scaling,
            rope_interleaved: false,
            tie_word_embeddings: false,
            qkv_bias: false,
            o_bias: false,
            qk_norm: false,
            activation: Activation::Silu,
            attention_scale: 1.0 / 128f64.sqrt(),
            local_layers: Vec::new(),
            sliding_window: usize::MAX,
            rope_local_theta: 10_000.0,
            bos_token_id: None,
            eos_token_ids: vec![],
        }
    }

    /// Llama 3.1's scaling keeps high frequencies, divides low ones by `factor`, and blends
    /// in between (values of the reference implementation's formula).
    #[test]
    fn llama3_rope_scaling() {
        let plain = config(RopeScaling::None).inv_freq();
        let scaled = config(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        })
        .inv_freq();
        assert_eq!(plain.len(), 64);
        assert_eq!(scaled[0], plain[0], "wavelength 2π < 2048: unchanged");
        assert!(
            (scaled[63] - plain[63] / 8.0).abs() < 1e-12,
            "longest wavelength: divided by 8"
        );
        let mid = (0..64)
            .find(|&i| {
                let wavelen = 2.0 * std::f32::consts::PI / plain[i];
                wavelen > 2048.0 && wavelen < 8192.0
            })
            .expect("a blended frequency");
        assert!(scaled[mid] < plain[mid] && scaled[mid] > plain[mid] / 8.0);
        let linear = config(RopeScaling::Linear { factor: 2.0 }).inv_freq();
        assert!((linear[5] - plain[5] / 2.0).abs() < 1e-9);
    }

    #[test]
    fn hf_config_reads_rope_scaling_and_generation_config() {
        let dir = tempfile::tempdir().expect("tmp");
        let cfg = serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 100, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "eos_token_id": 2,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        });
        std::fs::write(dir.path().join("config.json"), cfg.to_string()).expect("write");
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"eos_token_id": [2, 7], "bos_token_id": 1}"#,
        )
        .expect("write");
        let c = ModelConfig::from_hf_dir(dir.path()).expect("config");
        assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
        assert_eq!(
            (c.eos_token_ids.clone(), c.bos_token_id, c.head_dim),
            (vec![2, 7], Some(1), 16)
        );
        let bad = cfg.to_string().replace("llama3", "dynamic");
        std::fs::write(dir.path().join("config.json"), bad).expect("write");
        let e = ModelConfig::from_hf_dir(dir.path()).expect_err("dynamic");
        assert!(
            e.to_string()
                .contains("rope_scaling type `dynamic` is not supported"),
            "{e}"
        );
    }

    /// YaRN as transformers and llama.cpp compute it (Qwen2.5's 4× over 32768, head 128,
    /// base 10⁶): the dimensions that turn more than 32 times over the original context keep
    /// their frequency, those that turn less than once are divided by 4, a linear ramp between
    /// whole dimensions; cos and sin are scaled by 0.1 · ln 4 + 1.
    #[test]
    fn yarn_rope_scaling() {
        let qwen = |scaling| ModelConfig {
            head_dim: 128,
            rope_theta: 1_000_000.0,
            rope_scaling: scaling,
            ..config(RopeScaling::None)
        };
        let plain = qwen(RopeScaling::None).inv_freq();
        let yarn = RopeScaling::yarn(4.0, 32768, None, None);
        assert!((yarn.attention_factor() - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
        let scaled = qwen(yarn).inv_freq();
        // Turns over 32768 positions: 32768 · f / 2π.
        let turns = |f: f32| 32768.0 * f64::from(f) / (2.0 * std::f64::consts::PI);
        for (i, (&p, &s)) in plain.iter().zip(&scaled).enumerate() {
            if turns(p) > 32.0 * 1.2 {
                assert_eq!(s, p, "dimension {i} turns {} times: kept", turns(p));
            } else if turns(p) < 1.0 / 1.2 {
                assert!(
                    (s - p / 4.0).abs() <= 1e-6 * p,
                    "dimension {i}: divided by 4"
                );
            } else {
                assert!(
                    s <= p && s >= p / 4.0 * (1.0 - 1e-6),
                    "dimension {i}: between"
                );
            }
        }
        // The ramp's ends, whole dimensions: ⌊d · ln(32768 / 2π·32) / 2 ln 10⁶⌋ = ⌊23.6⌋ and
        // ⌈d · ln(32768 / 2π) / 2 ln 10⁶⌉ = ⌈39.7⌉.
        assert_eq!(scaled[23], plain[23]);
        assert!(scaled[24] < plain[24] && scaled[39] > plain[39] / 4.0);
        assert!((scaled[40] - plain[40] / 4.0).abs() <= 1e-6 * plain[40]);
        assert_eq!(RopeScaling::None.attention_factor(), 1.0);
    }

    #[test]
    fn hf_config_reads_yarn_and_extends_the_context() {
        let dir = tempfile::tempdir().expect("tmp");
        let cfg = serde_json::json!({
            "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 100, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
        });
        std::fs::write(dir.path().join("config.json"), cfg.to_string()).expect("write");
        let c = ModelConfig::from_hf_dir(dir.path()).expect("config");
        assert_eq!(c.rope_scaling, RopeScaling::yarn(4.0, 32768, None, None));
        assert_eq!(
            c.max_context, 131_072,
            "the original context times the factor"
        );
    }
}
