//! Loading a Llama-family model from a Hugging Face folder or a GGUF file, and running it.

mod config;
pub(crate) use config::read_json;
pub(crate) mod gguf;
pub(crate) mod gguf_tokenizer;
pub mod hub;
mod llama;
pub(crate) mod weights;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device};

pub use config::{Architecture, ModelConfig, RopeScaling};
pub use llama::Logits;

use crate::kv_cache::{CacheShape, KvCache};
use crate::{Error, Result};

/// How a model is placed in memory.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub device: Device,
    /// Weights and activations type of dense checkpoints; default f32 on the CPU, bf16 on CUDA.
    pub dtype: Option<DType>,
    /// Caps the context below the model's own, which sizes the rope tables and the caches.
    pub max_context: Option<usize>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            dtype: None,
            max_context: None,
        }
    }
}

/// Parses a device name: `cpu`, `cuda` or `cuda:N` (the latter need the `cuda` feature).
pub fn parse_device(spec: &str) -> Result<Device> {
    let bad = |limit: &str| Error::invalid("device", spec, limit);
    match spec {
        "cpu" => Ok(Device::Cpu),
        s => {
            let ordinal = s
                .strip_prefix("cuda")
                .map(|rest| rest.trim_start_matches(':'))
                .ok_or_else(|| bad("expected cpu, cuda or cuda:N"))?;
            let ordinal: usize = if ordinal.is_empty() {
                0
            } else {
                ordinal
                    .parse()
                    .map_err(|_| bad("expected cpu, cuda or cuda:N"))?
            };
            Ok(Device::new_cuda(ordinal)?)
        }
    }
}

/// The on-disk format a model came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFormat {
    Safetensors,
    Gguf,
}

/// A loaded model: immutable weights shared by any number of sequences, each with its own
/// [`KvCache`]. Cloning is cheap: clones share the weights.
#[derive(Clone)]
pub struct Model {
    config: ModelConfig,
    llama: Arc<llama::Llama>,
    path: PathBuf,
    format: ModelFormat,
    dtype: DType,
    device: Device,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("path", &self.path)
            .field("format", &self.format)
            .field("dtype", &self.dtype)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Model {
    /// Loads a Hugging Face folder (`config.json` + safetensors) or a `.gguf` file.
    pub fn load(path: &Path, options: &LoadOptions) -> Result<Self> {
        if !path.exists() {
            return Err(Error::MissingFile {
                path: path.to_path_buf(),
                what: "expected a Hugging Face model folder or a .gguf file",
            });
        }
        let device = &options.device;
        let cap = |mut config: ModelConfig| {
            if let Some(max) = options.max_context {
                config.max_context = config.max_context.min(max);
            }
            config
        };
        if path.is_dir() {
            let config = cap(ModelConfig::from_hf_dir(path)?);
            let dtype = options.dtype.unwrap_or(if device.is_cpu() {
                DType::F32
            } else {
                DType::BF16
            });
            let weights = weights::Weights::from_safetensors(path, dtype, device)?;
            let llama = Arc::new(llama::Llama::load(
                weights::Vb::new(&weights),
                &config,
                dtype,
                device,
            )?);
            Ok(Self {
                config,
                llama,
                path: path.to_path_buf(),
                format: ModelFormat::Safetensors,
                dtype,
                device: device.clone(),
            })
        } else {
            let gguf = gguf::load(path, device)?;
            let config = cap(gguf.config);
            // Quantized matmuls take f32 activations.
            let dtype = DType::F32;
            let llama = Arc::new(llama::Llama::load(
                weights::Vb::new(&gguf.weights),
                &config,
                dtype,
                device,
            )?);
            Ok(Self {
                config,
                llama,
                path: path.to_path_buf(),
                format: ModelFormat::Gguf,
                dtype,
                device: device.clone(),
            })
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn format(&self) -> ModelFormat {
        self.format
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// A display name: the folder or file name.
    pub fn name(&self) -> String {
        self.path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.path.display().to_string())
    }

    /// An empty cache for one sequence of this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(CacheShape {
            num_layers: self.config.num_layers,
            num_kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            max_len: self.config.max_context,
            dtype: self.dtype,
            device: self.device.clone(),
        })
    }

    /// Runs a block of tokens at positions `cache.len()..`, appending to `cache`, and returns one
    /// row of logits per position (or only for the last, see [`Logits`]).
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        logits: Logits,
    ) -> Result<Vec<Vec<f32>>> {
        if tokens.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let vocab_size = self.config.vocab_size;
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(Error::TokenOutOfRange { token, vocab_size });
        }
        Ok(self
            .llama
            .forward(tokens, cache, logits)?
            .to_vec2::<f32>()?)
    }
}
