//! Random-weight Llama-family checkpoints (Llama, Qwen2, Qwen3), written deterministically from a seed as a Hugging Face
//! folder. Tests use tiny ones; benchmarks build pairs of realistic cost (the stories110M shape)
//! without downloading anything.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use serde_json::json;

use crate::model::Architecture;
use crate::sampling::rng::Rng;
use crate::{Error, Result};

/// The shape and seed of a random-weight model.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticSpec {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub max_context: usize,
    /// Standard deviation of embedding entries; larger gives peakier next-token distributions.
    pub embed_std: f32,
    /// A head's width; `None`: hidden_size / num_heads.
    pub head_dim: Option<usize>,
    /// Llama; Qwen2 adds q/k/v biases; Qwen3 an RMSNorm over each head of q and k; Gemma 3
    /// its norms, GeGLU and local layers (five in six) of `sliding_window` positions.
    pub architecture: Architecture,
    pub sliding_window: usize,
    pub seed: u64,
}

impl SyntheticSpec {
    /// A few-thousand-parameter model for tests.
    pub fn tiny(seed: u64) -> Self {
        Self {
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            max_context: 512,
            embed_std: 0.5,
            head_dim: None,
            architecture: Architecture::Llama,
            sliding_window: 8,
            seed,
        }
    }

    /// The stories110M / Llama-2-style 110M shape: dim 768, 12 layers, 12 heads.
    pub fn stories110m(seed: u64) -> Self {
        Self {
            hidden_size: 768,
            intermediate_size: 2048,
            num_layers: 12,
            num_heads: 12,
            num_kv_heads: 12,
            max_context: 1024,
            embed_std: 0.5,
            head_dim: None,
            architecture: Architecture::Llama,
            sliding_window: 512,
            seed,
        }
    }
}

/// Seeded standard-normal tensor (Box–Muller over [`Rng`]).
fn normal(rng: &mut Rng, dims: &[usize], std: f32) -> Result<Tensor> {
    let n: usize = dims.iter().product();
    let mut values = Vec::with_capacity(n + 1);
    while values.len() < n {
        let u1 = rng.uniform().max(f64::MIN_POSITIVE);
        let u2 = rng.uniform();
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u2;
        values.push((r * theta.cos()) as f32 * std);
        values.push((r * theta.sin()) as f32 * std);
    }
    values.truncate(n);
    Ok(Tensor::from_vec(values, dims, &Device::Cpu)?)
}

/// Replaces the layer `parts` of block `p` by one layer `fused` whose rows are theirs in turn.
fn fuse(
    tensors: &mut HashMap<String, Tensor>,
    p: &str,
    fused: &str,
    parts: &[String],
) -> Result<()> {
    let weights: Vec<Tensor> = parts
        .iter()
        .filter_map(|part| tensors.remove(&format!("{p}.{part}.weight")))
        .collect();
    tensors.insert(format!("{p}.{fused}.weight"), Tensor::cat(&weights, 0)?);
    Ok(())
}

/// The `config.json` of a model of `spec` (heads `head_dim` wide) with `tokenizer`'s
/// vocabulary, as transformers writes it for the architecture.
fn config_json(
    spec: &SyntheticSpec,
    head_dim: usize,
    tokenizer: &crate::tokenizer::Tokenizer,
) -> serde_json::Value {
    let (class, model_type) = match spec.architecture {
        Architecture::Llama => ("LlamaForCausalLM", "llama"),
        Architecture::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
        Architecture::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
        Architecture::Gemma3 => ("Gemma3ForCausalLM", "gemma3_text"),
        Architecture::Phi3 => ("Phi3ForCausalLM", "phi3"),
    };
    let config = json!({
        "architectures": [class],
        "model_type": model_type,
        "hidden_size": spec.hidden_size,
        "head_dim": head_dim,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "vocab_size": tokenizer.vocab_size(),
        "max_position_embeddings": spec.max_context,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": true,
        "bos_token_id": tokenizer.bos_id(),
        "eos_token_id": tokenizer.eos_id(),
        "pad_token_id": tokenizer.eos_id(),
    });
    let mut config = config;
    if spec.architecture == Architecture::Gemma3 {
        let gemma = json!({
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": head_dim,
            "sliding_window": spec.sliding_window,
            "sliding_window_pattern": 6,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
        });
        if let (Some(c), Some(g)) = (config.as_object_mut(), gemma.as_object()) {
            c.extend(g.clone());
        }
    }
    if spec.architecture == Architecture::Phi3 {
        // Phi-4-mini's rope over 3/4 of each head, and LongRoPE over a context 4× the
        // original (the long factors, rising with the wavelength, as trained ones do).
        let rotary = head_dim * 3 / 4;
        let factors =
            |step: f64| -> Vec<f64> { (0..rotary / 2).map(|i| 1.0 + step * i as f64).collect() };
        let phi = json!({
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": spec.max_context / 4,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": factors(0.01),
                "long_factor": factors(0.5),
            },
        });
        if let (Some(c), Some(f)) = (config.as_object_mut(), phi.as_object()) {
            c.extend(f.clone());
        }
    }
    config
}

/// Writes `config.json`, `model.safetensors` (f32) and the tokenizer files of `tokenizer_dir`
/// into `dir`: a random-weight model with that tokenizer's vocabulary.
pub fn write_random_llama(dir: &Path, spec: &SyntheticSpec, tokenizer_dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(Error::io(dir))?;
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        let src = tokenizer_dir.join(file);
        if src.exists() {
            std::fs::copy(&src, dir.join(file)).map_err(Error::io(&src))?;
        }
    }
    let tokenizer = crate::tokenizer::Tokenizer::for_model(dir)?;
    let vocab = tokenizer.vocab_size();
    let (h, i) = (spec.hidden_size, spec.intermediate_size);
    let head_dim = spec.head_dim.unwrap_or(h / spec.num_heads);
    let (q, kv) = (spec.num_heads * head_dim, spec.num_kv_heads * head_dim);
    let mut rng = Rng::new(spec.seed);
    let mut tensors = HashMap::new();
    let mut add = |name: String, t: Tensor| {
        tensors.insert(name, t);
    };
    let linear =
        |rng: &mut Rng, out: usize, inp: usize| normal(rng, &[out, inp], 1.0 / (inp as f32).sqrt());
    add(
        "model.embed_tokens.weight".into(),
        normal(&mut rng, &[vocab, h], spec.embed_std)?,
    );
    add(
        "model.norm.weight".into(),
        Tensor::ones(h, candle_core::DType::F32, &Device::Cpu)?,
    );
    for l in 0..spec.num_layers {
        let p = format!("model.layers.{l}");
        add(
            format!("{p}.self_attn.q_proj.weight"),
            linear(&mut rng, q, h)?,
        );
        add(
            format!("{p}.self_attn.k_proj.weight"),
            linear(&mut rng, kv, h)?,
        );
        add(
            format!("{p}.self_attn.v_proj.weight"),
            linear(&mut rng, kv, h)?,
        );
        add(
            format!("{p}.self_attn.o_proj.weight"),
            linear(&mut rng, h, q)?,
        );
        match spec.architecture {
            // Phi-3 fuses q, k and v into one layer, and the MLP's gate and up (below).
            Architecture::Llama | Architecture::Phi3 => {}
            Architecture::Qwen2 => {
                for (name, size) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                    add(
                        format!("{p}.self_attn.{name}.bias"),
                        normal(&mut rng, &[size], 0.1)?,
                    );
                }
            }
            // Weights around 1, as trained ones are: each head's norm matters, not its scale.
            Architecture::Qwen3 => {
                for name in ["q_norm", "k_norm"] {
                    let w = (normal(&mut rng, &[head_dim], 0.2)? + 1.0)?;
                    add(format!("{p}.self_attn.{name}.weight"), w);
                }
            }
            // Gemma's norms scale by 1 + w: w around 0.
            Architecture::Gemma3 => {
                for name in ["q_norm", "k_norm"] {
                    let w = normal(&mut rng, &[head_dim], 0.2)?;
                    add(format!("{p}.self_attn.{name}.weight"), w);
                }
                for name in ["pre_feedforward_layernorm", "post_feedforward_layernorm"] {
                    add(format!("{p}.{name}.weight"), normal(&mut rng, &[h], 0.1)?);
                }
            }
        }
        add(format!("{p}.mlp.gate_proj.weight"), linear(&mut rng, i, h)?);
        add(format!("{p}.mlp.up_proj.weight"), linear(&mut rng, i, h)?);
        add(format!("{p}.mlp.down_proj.weight"), linear(&mut rng, h, i)?);
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            add(
                format!("{p}.{norm}.weight"),
                Tensor::ones(h, candle_core::DType::F32, &Device::Cpu)?,
            );
        }
    }
    if spec.architecture == Architecture::Phi3 {
        for l in 0..spec.num_layers {
            let p = format!("model.layers.{l}");
            let parts = ["q_proj", "k_proj", "v_proj"].map(|n| format!("self_attn.{n}"));
            fuse(&mut tensors, &p, "self_attn.qkv_proj", &parts)?;
            let parts = ["gate_proj", "up_proj"].map(|n| format!("mlp.{n}"));
            fuse(&mut tensors, &p, "mlp.gate_up_proj", &parts)?;
        }
    }
    let config = config_json(spec, head_dim, &tokenizer);
    let config_path = dir.join("config.json");
    std::fs::write(
        &config_path,
        serde_json::to_string_pretty(&config).unwrap_or_default(),
    )
    .map_err(Error::io(&config_path))?;
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
    Ok(())
}
