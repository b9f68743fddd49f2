//! Writes a Hugging Face Llama folder as a GGUF file, quantized the way llama.cpp lays it out
//! (llama.cpp tensor names, q/k rows permuted for interleaved rope, the vocabulary in the
//! metadata: [`vocab`]), so drafts for edge CPUs can be made from any target checkpoint.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::model::weights::{gguf_name, safetensors_files};
use crate::model::{Architecture, ModelConfig, RopeScaling};
use crate::{Error, Result};

mod vocab;

/// Quantization schemes for [`quantize_to_gguf`]: one type for every matrix, or llama.cpp's
/// Q4_K_M mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    /// Q4_K for most matrices, Q6_K for the output, attn_v and ffn_down (llama.cpp's Q4_K_M mix).
    Q4KM,
}

/// Every scheme with its name on the command line, GGUF tensor type (Q4_K_M: the main one) and
/// llama.cpp `general.file_type` code.
const SCHEMES: [(QuantType, &str, GgmlDType, u32); 14] = [
    (QuantType::F32, "f32", GgmlDType::F32, 0),
    (QuantType::F16, "f16", GgmlDType::F16, 1),
    (QuantType::BF16, "bf16", GgmlDType::BF16, 32),
    (QuantType::Q4_0, "q4_0", GgmlDType::Q4_0, 2),
    (QuantType::Q4_1, "q4_1", GgmlDType::Q4_1, 3),
    (QuantType::Q5_0, "q5_0", GgmlDType::Q5_0, 8),
    (QuantType::Q5_1, "q5_1", GgmlDType::Q5_1, 9),
    (QuantType::Q8_0, "q8_0", GgmlDType::Q8_0, 7),
    (QuantType::Q2K, "q2_k", GgmlDType::Q2K, 10),
    (QuantType::Q3K, "q3_k", GgmlDType::Q3K, 11),
    (QuantType::Q4K, "q4_k", GgmlDType::Q4K, 14),
    (QuantType::Q5K, "q5_k", GgmlDType::Q5K, 16),
    (QuantType::Q6K, "q6_k", GgmlDType::Q6K, 18),
    (QuantType::Q4KM, "q4_k_m", GgmlDType::Q4K, 15),
];

impl std::str::FromStr for QuantType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let wanted = s.to_ascii_lowercase();
        SCHEMES
            .iter()
            .find(|(_, name, _, _)| *name == wanted)
            .map(|(q, ..)| *q)
            .ok_or_else(|| {
                let names: Vec<&str> = SCHEMES.iter().map(|(_, n, _, _)| *n).collect();
                Error::invalid(
                    "quant_type",
                    s,
                    format!("must be one of {}", names.join(", ")),
                )
            })
    }
}

impl QuantType {
    /// Every scheme.
    pub fn all() -> impl Iterator<Item = Self> {
        SCHEMES.iter().map(|(q, ..)| *q)
    }

    fn scheme(self) -> (GgmlDType, u32) {
        SCHEMES
            .iter()
            .find(|(q, ..)| *q == self)
            .map_or((GgmlDType::F32, 0), |(_, _, t, code)| (*t, *code))
    }

    fn for_tensor(self, gguf: &str) -> GgmlDType {
        let mixed_q6 = gguf == "output.weight"
            || gguf.ends_with("attn_v.weight")
            || gguf.ends_with("ffn_down.weight");
        match self {
            Self::Q4KM if mixed_q6 => GgmlDType::Q6K,
            other => other.scheme().0,
        }
    }

    /// llama.cpp's `general.file_type` code.
    fn file_type(self) -> u32 {
        self.scheme().1
    }
}

/// What [`quantize_to_gguf`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuantizeReport {
    pub tensors: usize,
    /// Matrices left in f32 because their rows do not split into whole quantization blocks.
    pub kept_f32: Vec<String>,
    pub tokenizer_in_metadata: bool,
    pub bytes: u64,
}

/// Converts the Hugging Face model folder `dir` to a GGUF file at `out`.
pub fn quantize_to_gguf(dir: &Path, out: &Path, quant: QuantType) -> Result<QuantizeReport> {
    let config = ModelConfig::from_hf_dir(dir)?;
    let tensors = read_safetensors(dir)?;
    let mut report = QuantizeReport::default();
    let mut qtensors: Vec<(String, QTensor)> = Vec::new();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    for name in names {
        if name.ends_with("rotary_emb.inv_freq") {
            continue;
        }
        let gguf = gguf_name(name, config.architecture);
        let mut t = tensors[name].to_dtype(DType::F32)?;
        match config.architecture {
            Architecture::Llama if name.contains("q_proj") => {
                t = permute_for_interleaved_rope(&t, config.num_heads)?;
            }
            Architecture::Llama if name.contains("k_proj") => {
                t = permute_for_interleaved_rope(&t, config.num_kv_heads)?;
            }
            // Gemma's norms scale by 1 + w: llama.cpp stores 1 + w.
            Architecture::Gemma3 if name.ends_with("norm.weight") => t = (t + 1.0)?,
            _ => {}
        }
        let wanted = if t.rank() == 2 {
            quant.for_tensor(&gguf)
        } else {
            GgmlDType::F32
        };
        let row = t.dims().last().copied().unwrap_or(0);
        let dtype = if row % wanted.block_size() == 0 {
            wanted
        } else {
            report.kept_f32.push(gguf.clone());
            GgmlDType::F32
        };
        qtensors.push((gguf, QTensor::quantize(&t, dtype)?));
    }
    if let RopeScaling::Llama3 { .. } = config.rope_scaling {
        let plain = ModelConfig {
            rope_scaling: RopeScaling::None,
            ..config.clone()
        };
        let factors: Vec<f32> = plain
            .inv_freq()
            .iter()
            .zip(config.inv_freq())
            .map(|(base, scaled)| base / scaled)
            .collect();
        let n = factors.len();
        let t = Tensor::from_vec(factors, n, &Device::Cpu)?;
        qtensors.push((
            "rope_freqs.weight".into(),
            QTensor::quantize(&t, GgmlDType::F32)?,
        ));
    }
    // Phi-3's LongRoPE factors, both sets, as llama.cpp's tensors.
    if let RopeScaling::LongRope { short, long, .. } = &config.rope_scaling {
        for (name, factors) in [("rope_factors_short", short), ("rope_factors_long", long)] {
            let t = Tensor::from_slice(factors, factors.len(), &Device::Cpu)?;
            qtensors.push((
                format!("{name}.weight"),
                QTensor::quantize(&t, GgmlDType::F32)?,
            ));
        }
    }
    let mut metadata = model_metadata(&config, quant, dir);
    let tokenizer_path = dir.join("tokenizer.json");
    if tokenizer_path.exists()
        && let Some(tok) = vocab::metadata(&tokenizer_path, &config)?
    {
        metadata.extend(tok);
        report.tokenizer_in_metadata = true;
    }
    let meta_refs: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> =
        qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut file = std::fs::File::create(out).map_err(Error::io(out))?;
    gguf_file::write(&mut file, &meta_refs, &tensor_refs)?;
    report.tensors = qtensors.len();
    report.bytes = std::fs::metadata(out).map_err(Error::io(out))?.len();
    Ok(report)
}

/// Every tensor of the folder's safetensors (single file or the shards its index lists).
fn read_safetensors(dir: &Path) -> Result<HashMap<String, Tensor>> {
    let files = safetensors_files(dir)?;
    let mut all = HashMap::new();
    for file in &files {
        all.extend(
            candle_core::safetensors::load(file, &Device::Cpu).map_err(|e| Error::InvalidFile {
                path: file.clone(),
                reason: e.to_string(),
            })?,
        );
    }
    if all.is_empty() {
        return Err(Error::MissingFile {
            path: dir.join("model.safetensors"),
            what: "no safetensors weights in the model folder",
        });
    }
    Ok(all)
}

/// The permutation llama.cpp's converter applies to q/k rows: from the rotate-half layout
/// (pairs i, i + d/2) to the interleaved one (pairs 2i, 2i + 1).
fn permute_for_interleaved_rope(w: &Tensor, heads: usize) -> Result<Tensor> {
    let dims = w.dims().to_vec();
    let rows = dims[0];
    let rest: usize = dims[1..].iter().product();
    Ok(w.reshape((heads, 2, rows / heads / 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)?)
}

fn model_metadata(config: &ModelConfig, quant: QuantType, dir: &Path) -> Vec<(String, Value)> {
    let a = config.architecture.gguf_name();
    let name = dir
        .file_name()
        .map_or_else(|| "model".to_string(), |n| n.to_string_lossy().into_owned());
    let u = |v: usize| Value::U32(v as u32);
    let mut m = vec![
        ("general.architecture".to_string(), Value::String(a.into())),
        ("general.name".to_string(), Value::String(name)),
        (
            "general.file_type".to_string(),
            Value::U32(quant.file_type()),
        ),
        (format!("{a}.context_length"), u(config.max_context)),
        (format!("{a}.embedding_length"), u(config.hidden_size)),
        (format!("{a}.block_count"), u(config.num_layers)),
        (
            format!("{a}.feed_forward_length"),
            u(config.intermediate_size),
        ),
        (format!("{a}.attention.head_count"), u(config.num_heads)),
        (
            format!("{a}.attention.head_count_kv"),
            u(config.num_kv_heads),
        ),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(config.rms_norm_eps as f32),
        ),
        (
            format!("{a}.rope.freq_base"),
            Value::F32(config.rope_theta as f32),
        ),
        (format!("{a}.rope.dimension_count"), u(config.rotary_dim)),
        (format!("{a}.attention.key_length"), u(config.head_dim)),
        (format!("{a}.attention.value_length"), u(config.head_dim)),
    ];
    if !config.local_layers.is_empty() {
        m.push((
            format!("{a}.attention.sliding_window"),
            u(config.sliding_window),
        ));
    }
    match config.rope_scaling {
        RopeScaling::Linear { factor } => {
            m.push((
                format!("{a}.rope.scaling.type"),
                Value::String("linear".into()),
            ));
            m.push((
                format!("{a}.rope.scaling.factor"),
                Value::F32(factor as f32),
            ));
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
        } => {
            let f = |v: f64| Value::F32(v as f32);
            m.extend([
                (
                    format!("{a}.rope.scaling.type"),
                    Value::String("yarn".into()),
                ),
                (format!("{a}.rope.scaling.factor"), f(factor)),
                (
                    format!("{a}.rope.scaling.original_context_length"),
                    u(original_max_position_embeddings),
                ),
                (format!("{a}.rope.scaling.yarn_beta_fast"), f(beta_fast)),
                (format!("{a}.rope.scaling.yarn_beta_slow"), f(beta_slow)),
                (
                    format!("{a}.rope.scaling.yarn_attn_factor"),
                    f(attention_factor / RopeScaling::yarn_mscale(factor)),
                ),
            ]);
        }
        RopeScaling::LongRope {
            original,
            attention_factor,
            ..
        } => m.extend([
            (
                format!("{a}.rope.scaling.original_context_length"),
                u(original),
            ),
            (
                format!("{a}.rope.scaling.attn_factor"),
                Value::F32(attention_factor as f32),
            ),
        ]),
        _ => {}
    }
    if let Some(bos) = config.bos_token_id {
        m.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(bos)));
    }
    if let Some(&eos) = config.eos_token_ids.first() {
        m.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(eos)));
    }
    m
}
