//! Where a model's tensors come from. Models name tensors once, in Hugging Face layout, through
//! [`Vb::pp`]; GGUF files are read through the same names, mapped to llama.cpp's.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};

use super::config::Architecture;
use crate::kernels::Matmul;
use crate::{Error, Result};

/// A model's tensors: dense (safetensors) or quantized (GGUF).
pub(crate) enum Weights {
    Dense {
        path: PathBuf,
        vb: candle_nn::VarBuilder<'static>,
    },
    Gguf {
        path: PathBuf,
        tensors: candle_transformers::quantized_var_builder::VarBuilder,
        /// Whose tensor names (llama.cpp names a few per architecture).
        architecture: Architecture,
    },
}

impl Weights {
    /// Memory-maps the safetensors files of a Hugging Face folder.
    #[allow(
        unsafe_code,
        reason = "memory-mapping safetensors, as every candle loader does"
    )]
    pub(crate) fn from_safetensors(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let files = safetensors_files(dir)?;
        // SAFETY: the files are opened read-only; a concurrent writer could change the mapped
        // bytes, which the model folders this reads are not expected to have.
        let vb = unsafe { candle_nn::VarBuilder::from_mmaped_safetensors(&files, dtype, device) }
            .map_err(|e| Error::InvalidFile {
            path: dir.to_path_buf(),
            reason: e.to_string(),
        })?;
        Ok(Self::Dense {
            path: dir.to_path_buf(),
            vb,
        })
    }

    fn path(&self) -> &Path {
        match self {
            Self::Dense { path, .. } | Self::Gguf { path, .. } => path,
        }
    }

    fn missing(&self, name: &str) -> Error {
        let name = match self {
            Self::Dense { .. } => name.to_string(),
            Self::Gguf { architecture, .. } => gguf_name(name, *architecture),
        };
        Error::MissingTensor {
            path: self.path().to_path_buf(),
            name,
        }
    }

    fn check_shape(&self, name: &str, found: &[usize], expected: &[usize]) -> Result<()> {
        if found == expected {
            return Ok(());
        }
        Err(Error::InvalidFile {
            path: self.path().to_path_buf(),
            reason: format!("tensor `{name}` has shape {found:?}, the config implies {expected:?}"),
        })
    }

    fn qtensor(&self, name: &str, shape: &[usize]) -> Result<Arc<QTensor>> {
        let Self::Gguf {
            tensors,
            architecture,
            ..
        } = self
        else {
            unreachable!("qtensor is only called on GGUF weights")
        };
        let gguf = gguf_name(name, *architecture);
        if !tensors.contains_key(&gguf) {
            return Err(self.missing(name));
        }
        let t = tensors.get_no_shape(&gguf)?;
        self.check_shape(name, t.shape().dims(), shape)?;
        Ok(t)
    }

    fn dense(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        match self {
            Self::Dense { vb, .. } => {
                if !vb.contains_tensor(name) {
                    return Err(self.missing(name));
                }
                vb.get(shape, name).map_err(|e| Error::InvalidFile {
                    path: self.path().to_path_buf(),
                    reason: format!("tensor `{name}`: {e}"),
                })
            }
            Self::Gguf { tensors, .. } => {
                Ok(self.qtensor(name, shape)?.dequantize(tensors.device())?)
            }
        }
    }
}

/// A prefix into [`Weights`], in candle's `VarBuilder` style, and the model's dtype (what a GGUF
/// file's dense tensors become, and off the CPU its dequantized weights).
#[derive(Clone)]
pub(crate) struct Vb<'a> {
    weights: &'a Weights,
    prefix: String,
    dtype: DType,
}

impl<'a> Vb<'a> {
    pub(crate) fn new(weights: &'a Weights, dtype: DType) -> Self {
        Self {
            weights,
            prefix: String::new(),
            dtype,
        }
    }

    pub(crate) fn pp(&self, name: impl std::fmt::Display) -> Self {
        let prefix = if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        };
        Self {
            weights: self.weights,
            prefix,
            dtype: self.dtype,
        }
    }

    /// Whether the tensors come from a GGUF file (whose Gemma norms llama.cpp stored as 1 + w).
    pub(crate) fn is_gguf(&self) -> bool {
        matches!(self.weights, Weights::Gguf { .. })
    }

    fn name(&self, leaf: &str) -> String {
        format!("{}.{leaf}", self.prefix)
    }

    /// A dense tensor (norm weights, biases, embeddings), dequantized if stored quantized.
    pub(crate) fn tensor(&self, leaf: &str, shape: &[usize]) -> Result<Tensor> {
        Ok(self
            .weights
            .dense(&self.name(leaf), shape)?
            .to_dtype(self.dtype)?)
    }

    /// The `weight`s of the linear layers `names` (of `dims[i]` outputs each, `in_dim` inputs)
    /// that read the same input, as one weight whose outputs are theirs in turn: one product,
    /// one quantization of the input and one round of the pool's threads instead of one each.
    /// Each output is what its own layer's product gives, bit for bit (the CPU kernels compute
    /// every output alone). Where that holds and pays: on the CPU, f32 or all of one GGUF
    /// type; None elsewhere (each layer is then loaded alone).
    pub(crate) fn fused_matmul(
        &self,
        names: &[&str],
        dims: &[usize],
        in_dim: usize,
    ) -> Result<Option<Matmul>> {
        let names: Vec<String> = names.iter().map(|n| self.pp(n).name("weight")).collect();
        let total = dims.iter().sum::<usize>();
        match self.weights {
            Weights::Dense { vb, .. } if vb.device().is_cpu() && self.dtype == DType::F32 => {
                let parts = names
                    .iter()
                    .zip(dims)
                    .map(|(name, &d)| self.weights.dense(name, &[d, in_dim]))
                    .collect::<Result<Vec<_>>>()?;
                Ok(Some(Matmul::dense(Tensor::cat(&parts, 0)?)?))
            }
            Weights::Gguf { tensors, .. } if tensors.device().is_cpu() => {
                let parts = names
                    .iter()
                    .zip(dims)
                    .map(|(name, &d)| self.weights.qtensor(name, &[d, in_dim]))
                    .collect::<Result<Vec<_>>>()?;
                let dtype = parts[0].dtype();
                if parts.iter().any(|t| t.dtype() != dtype) {
                    return Ok(None);
                }
                // A GGUF tensor's rows are contiguous runs of blocks: the fused weight's bytes
                // are the parts' in turn.
                let mut bytes = Vec::new();
                for t in &parts {
                    bytes.extend_from_slice(&t.data()?);
                }
                Ok(Some(quantized_from_bytes(bytes, dtype, (total, in_dim))?))
            }
            _ => Ok(None),
        }
    }

    /// The rows `rows` (token ids below `out_dim`) of the `weight` of a linear layer of shape
    /// (out, in), as one weight whose outputs are theirs in turn: a GGUF tensor's rows are
    /// contiguous runs of blocks, copied as they are (each output is what the whole weight's
    /// product gives for it, bit for bit, as for [`Self::fused_matmul`]).
    pub(crate) fn matmul_rows(
        &self,
        out_dim: usize,
        in_dim: usize,
        rows: &[u32],
    ) -> Result<Matmul> {
        let name = self.name("weight");
        match self.weights {
            Weights::Gguf { tensors, .. } if tensors.device().is_cpu() => {
                let t = self.weights.qtensor(&name, &[out_dim, in_dim])?;
                let data = t.data()?;
                let row = data.len() / out_dim;
                let mut bytes = Vec::with_capacity(row * rows.len());
                for &r in rows {
                    bytes.extend_from_slice(&data[r as usize * row..][..row]);
                }
                quantized_from_bytes(bytes, t.dtype(), (rows.len(), in_dim))
            }
            _ => {
                let w = self.tensor("weight", &[out_dim, in_dim])?;
                let ids = Tensor::new(rows, w.device())?;
                Matmul::dense(w.index_select(&ids, 0)?)
            }
        }
    }

    /// The `weight` of a linear layer of shape (out, in), kept quantized where it is.
    pub(crate) fn matmul(&self, out_dim: usize, in_dim: usize) -> Result<Matmul> {
        let name = self.name("weight");
        match self.weights {
            Weights::Dense { .. } => Matmul::dense(self.weights.dense(&name, &[out_dim, in_dim])?),
            // Off the CPU a quantized weight is dequantized once, to the model's dtype.
            Weights::Gguf { tensors, .. } if !tensors.device().is_cpu() => {
                Matmul::dense(self.tensor("weight", &[out_dim, in_dim])?)
            }
            Weights::Gguf { .. } => {
                Matmul::quantized(self.weights.qtensor(&name, &[out_dim, in_dim])?)
            }
        }
    }
}

/// A CPU weight of `dtype` and `shape` (out, in) from its GGUF bytes, rows in turn: a fused
/// layer's ([`Vb::fused_matmul`]) or some rows of one ([`Vb::matmul_rows`]).
fn quantized_from_bytes(
    bytes: Vec<u8>,
    dtype: candle_core::quantized::GgmlDType,
    shape: (usize, usize),
) -> Result<Matmul> {
    let storage = candle_core::quantized::QStorage::from_data(
        std::borrow::Cow::Owned(bytes),
        &Device::Cpu,
        dtype,
    )?;
    Matmul::quantized(Arc::new(QTensor::new(storage, shape)?))
}

/// Maps a Hugging Face tensor name of an `architecture` model to llama.cpp's GGUF name.
pub(crate) fn gguf_name(hf: &str, architecture: Architecture) -> String {
    // Gemma's norms around attention and the MLP: its `post_attention_layernorm` follows the
    // attention, where Llama's precedes the MLP.
    const GEMMA_PARTS: [(&str, &str); 3] = [
        ("post_attention_layernorm", "post_attention_norm"),
        ("pre_feedforward_layernorm", "ffn_norm"),
        ("post_feedforward_layernorm", "post_ffw_norm"),
    ];
    const LAYER_PARTS: [(&str, &str); 13] = [
        ("input_layernorm", "attn_norm"),
        ("post_attention_layernorm", "ffn_norm"),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("self_attn.qkv_proj", "attn_qkv"),
        ("mlp.gate_up_proj", "ffn_up"),
        ("self_attn.q_norm", "attn_q_norm"),
        ("self_attn.k_norm", "attn_k_norm"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
    ];
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    if let Some(rest) = hf.strip_prefix("model.layers.")
        && let Some((layer, part)) = rest.split_once('.')
        && let Some((module, leaf)) = part.rsplit_once('.')
        && let Some((_, gguf)) = (architecture == Architecture::Gemma3)
            .then_some(&GEMMA_PARTS[..])
            .into_iter()
            .chain([&LAYER_PARTS[..]])
            .flatten()
            .find(|(h, _)| *h == module)
    {
        return format!("blk.{layer}.{gguf}.{leaf}");
    }
    hf.to_string()
}

pub(crate) fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        return Err(Error::MissingFile {
            path: single,
            what: "weights must be model.safetensors or shards listed in model.safetensors.index.json",
        });
    }
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: HashMap<String, String>,
    }
    let index_json: Index = super::config::read_json(&index)?;
    let mut shards: Vec<String> = index_json.weight_map.into_values().collect();
    shards.sort();
    shards.dedup();
    let files: Vec<PathBuf> = shards.iter().map(|s| dir.join(s)).collect();
    if let Some(missing) = files.iter().find(|f| !f.exists()) {
        return Err(Error::MissingFile {
            path: missing.clone(),
            what: "a shard listed in model.safetensors.index.json",
        });
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::gguf_name;
    use crate::model::Architecture::{Gemma3, Llama};

    #[test]
    fn maps_hf_names_to_gguf() {
        assert_eq!(
            gguf_name("model.embed_tokens.weight", Llama),
            "token_embd.weight"
        );
        assert_eq!(
            gguf_name("model.layers.3.self_attn.q_proj.bias", Llama),
            "blk.3.attn_q.bias"
        );
        assert_eq!(
            gguf_name("model.layers.11.mlp.down_proj.weight", Llama),
            "blk.11.ffn_down.weight"
        );
        assert_eq!(
            gguf_name("model.layers.0.post_attention_layernorm.weight", Llama),
            "blk.0.ffn_norm.weight"
        );
        assert_eq!(
            gguf_name("model.layers.2.self_attn.k_norm.weight", Llama),
            "blk.2.attn_k_norm.weight"
        );
        assert_eq!(
            gguf_name("model.layers.0.post_attention_layernorm.weight", Gemma3),
            "blk.0.post_attention_norm.weight"
        );
        assert_eq!(
            gguf_name("model.layers.4.pre_feedforward_layernorm.weight", Gemma3),
            "blk.4.ffn_norm.weight"
        );
        assert_eq!(
            gguf_name("model.layers.4.post_feedforward_layernorm.weight", Gemma3),
            "blk.4.post_ffw_norm.weight"
        );
        assert_eq!(
            gguf_name("model.layers.1.mlp.up_proj.weight", Gemma3),
            "blk.1.ffn_up.weight"
        );
    }
}
