//! Loading a Llama-family model from a Hugging Face folder or a GGUF file, and running it.

mod config;
pub(crate) use config::read_json;
pub(crate) mod gguf;
pub(crate) mod gguf_tokenizer;
mod head;
pub mod hub;
pub(crate) mod llama;
pub(crate) mod weights;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device};

pub use config::{Activation, Architecture, ModelConfig, RopeScaling};
pub use llama::Logits;

use crate::kv_cache::{CacheShape, KvCache};
use crate::{Error, Result};

/// How a model is placed in memory.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub device: Device,
    /// Weights and activations type; default f32 on the CPU, bf16 on CUDA. A GGUF file on the
    /// CPU keeps its types (activations f32).
    pub dtype: Option<DType>,
    /// Caps the context below the model's own, which sizes the rope tables and the caches.
    pub max_context: Option<usize>,
    /// The tokens whose logits the model computes, every other's -inf: a draft model's
    /// vocabulary, its output projection read for those rows only (docs/architecture.md "The
    /// draft's vocabulary"). None: every token (a target always).
    pub logit_ids: Option<Vec<u32>>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            dtype: None,
            max_context: None,
            logit_ids: None,
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

/// Parses a weights and activations type: `f32`, `f16` or `bf16`.
pub fn parse_dtype(spec: &str) -> Result<DType> {
    match spec {
        "f32" => Ok(DType::F32),
        "f16" => Ok(DType::F16),
        "bf16" => Ok(DType::BF16),
        _ => Err(Error::invalid("dtype", spec, "expected f32, f16 or bf16")),
    }
}

/// Memory free for new allocations on `device`, in bytes, where it can be known: the host's
/// available memory for the CPU (`MemAvailable`), the GPU's free memory for CUDA.
pub fn free_memory(device: &Device) -> Option<usize> {
    match device {
        Device::Cpu => {
            let info = std::fs::read_to_string("/proc/meminfo").ok()?;
            let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
            let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
            kib.checked_mul(1024)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(gpu) => gpu.cuda_stream().context().mem_get_info().ok().map(|m| m.0),
        #[allow(unreachable_patterns)]
        _ => None,
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

/// The bytes of a model's weights on disk: a `.gguf` file, or a folder's safetensors files.
pub fn weight_bytes(path: &Path) -> Result<u64> {
    let files = if path.is_dir() {
        weights::safetensors_files(path)?
    } else {
        vec![path.to_path_buf()]
    };
    files
        .iter()
        .map(|file| {
            std::fs::metadata(file)
                .map(|m| m.len())
                .map_err(|source| Error::Io {
                    path: file.clone(),
                    source,
                })
        })
        .sum()
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
                weights::Vb::new(&weights, dtype),
                &config,
                dtype,
                device,
                options.logit_ids.clone(),
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
            // Quantized matmuls take f32 activations on the CPU; on a GPU the weights are
            // dequantized to the model's dtype (bf16 unless asked).
            let dtype = if device.is_cpu() {
                DType::F32
            } else {
                options.dtype.unwrap_or(DType::BF16)
            };
            let llama = Arc::new(llama::Llama::load(
                weights::Vb::new(&gguf.weights, dtype),
                &config,
                dtype,
                device,
                options.logit_ids.clone(),
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
            window: self
                .config
                .local_layers
                .contains(&true)
                .then(|| (self.config.sliding_window, self.config.local_layers.clone())),
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
        let mut rows = self.forward_batch(&mut [(tokens, cache, logits)])?;
        Ok(rows.pop().unwrap_or_default())
    }

    /// [`Self::forward`] for several sequences at once, each over its own cache, in one pass
    /// whose matmuls take the rows of all of them (continuous batching: what each sequence
    /// gets is what it would get alone, up to the rounding of a matmul over more rows). A
    /// sequence that cannot run (an empty block, a token outside the vocabulary, a full cache)
    /// fails the whole batch before anything runs: callers check theirs first
    /// ([`Self::check_block`]).
    pub fn forward_batch(
        &self,
        items: &mut [(&[u32], &mut KvCache, Logits)],
    ) -> Result<Vec<Vec<Vec<f32>>>> {
        let mut batch: Vec<llama::BatchItem<'_>> = items
            .iter_mut()
            .map(|(tokens, cache, logits)| llama::BatchItem {
                tokens,
                cache,
                logits: *logits,
                parents: None,
            })
            .collect();
        self.forward_items(&mut batch)
    }

    /// [`Self::forward_batch`] where any item may be a token tree ([`Self::forward_tree`]).
    pub(crate) fn forward_items(
        &self,
        items: &mut [llama::BatchItem<'_>],
    ) -> Result<Vec<Vec<Vec<f32>>>> {
        for item in items.iter() {
            self.check_block(item.tokens, item.cache)?;
        }
        let _cores = self.device().is_cpu().then(crate::kernels::Cores::hold);
        self.llama
            .forward(items)?
            .into_iter()
            .map(|t| Ok(t.to_vec2::<f32>()?))
            .collect()
    }

    /// Runs a token tree's rows at positions from `cache.len()` on, as [`Self::forward`] runs a
    /// block: row i's parent is `parents[i]` (an earlier row; none: it follows the cache), it
    /// sits at the position of its depth and attends to the cache and its path. Each row's
    /// logits are those of its path fed alone, bit for bit (CPU). The rows' keys and values are
    /// appended in row order: [`KvCache::keep_rows`] keeps one path of them. A tree may grow
    /// over several calls: `parents` then starts with the rows an earlier call fed (the cache's
    /// last `parents.len() - tokens.len()`), and the new rows' parents count them.
    pub fn forward_tree(
        &self,
        tokens: &[u32],
        parents: &[Option<usize>],
        cache: &mut KvCache,
    ) -> Result<Vec<Vec<f32>>> {
        let mut batch = [llama::BatchItem {
            tokens,
            cache,
            logits: Logits::All,
            parents: Some(parents),
        }];
        Ok(self.forward_items(&mut batch)?.pop().unwrap_or_default())
    }

    /// Whether token trees run on this model ([`Self::forward_tree`]): none with
    /// sliding-window layers.
    pub fn takes_trees(&self) -> bool {
        self.llama.takes_trees()
    }

    /// Whether both share the same loaded weights (clones of one load).
    pub fn same_weights(&self, other: &Model) -> bool {
        Arc::ptr_eq(&self.llama, &other.llama)
    }

    /// Whether `tokens` can run on `cache`: not empty, every token in the vocabulary, room in
    /// the context.
    pub fn check_block(&self, tokens: &[u32], cache: &KvCache) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let vocab_size = self.config.vocab_size;
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(Error::TokenOutOfRange { token, vocab_size });
        }
        let len = cache.len() + tokens.len();
        if len > cache.max_len() {
            return Err(Error::ContextFull {
                len,
                limit: cache.max_len(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_and_dtypes_are_parsed_and_a_bad_one_is_named() {
        assert!(parse_device("cpu").expect("cpu").is_cpu());
        let bad = parse_device("tpu").expect_err("tpu").to_string();
        assert!(bad.contains("device") && bad.contains("tpu"), "{bad}");
        assert_eq!(parse_dtype("f16").expect("f16"), DType::F16);
        assert_eq!(parse_dtype("bf16").expect("bf16"), DType::BF16);
        let bad = parse_dtype("f8").expect_err("f8").to_string();
        assert!(
            bad.contains("dtype") && bad.contains("f32, f16 or bf16"),
            "{bad}"
        );
    }

    /// A CPU pass waits while another holds the cores, then runs: two models in one process
    /// take turns pass by pass ([`crate::kernels::Cores`]).
    #[test]
    fn a_cpu_pass_waits_for_the_pass_that_holds_the_cores() {
        let dir = tempfile::tempdir().expect("tmp");
        let tokenizer =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/stories260K");
        crate::synthetic::write_random_llama(
            dir.path(),
            &crate::synthetic::SyntheticSpec::tiny(3),
            &tokenizer,
        )
        .expect("a tiny model");
        let model = Model::load(dir.path(), &LoadOptions::default()).expect("load");
        let (done, finished) = std::sync::mpsc::channel();
        let held = crate::kernels::Cores::hold();
        let pass = std::thread::spawn(move || {
            let logits = model.forward(&[1, 2, 3], &mut model.new_cache(), Logits::Last);
            done.send(()).expect("the test waits");
            logits
        });
        // While the cores are held the pass cannot finish, however long this waits (a pass that
        // ran would send within the wait on any machine); then it does.
        assert!(
            finished
                .recv_timeout(std::time::Duration::from_millis(300))
                .is_err(),
            "a pass ran while another held the cores"
        );
        drop(held);
        finished
            .recv()
            .expect("the pass ends once the cores are free");
        let logits = pass.join().expect("no panic").expect("forward");
        assert_eq!(logits.len(), 1);
    }

    #[test]
    fn the_hosts_free_memory_is_known_on_the_cpu() {
        let free = free_memory(&Device::Cpu).expect("MemAvailable");
        assert!(free > 1 << 20, "{free}");
    }
}
