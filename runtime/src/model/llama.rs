//! The Llama-family forward pass (Llama 1/2/3, Mistral, TinyLlama, SmolLM, Qwen2, Qwen3,
//! Gemma 3) over a truncatable [`KvCache`], returning logits for every position of a block or
//! only the last.

use candle_core::{DType, Device, Tensor};

use super::config::{Activation, Architecture, ModelConfig, RopeScaling};
use super::head::Head;
use super::weights::Vb;
use crate::Result;
use crate::kernels::{Gate, Matmul, Span, TreePaths, attention_cpu, gated};
use crate::kv_cache::KvCache;

/// A linear layer whose weight may be quantized, with an optional bias.
struct Linear {
    weight: Matmul,
    bias: Option<Tensor>,
}

impl Linear {
    fn load(vb: Vb, out_dim: usize, in_dim: usize, bias: bool) -> Result<Self> {
        let weight = vb.matmul(out_dim, in_dim)?;
        let bias = if bias {
            Some(vb.tensor("bias", &[out_dim])?)
        } else {
            None
        };
        Ok(Self { weight, bias })
    }

    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let ys = self.weight.forward(xs)?;
        Ok(match &self.bias {
            Some(b) => ys.broadcast_add(b)?,
            None => ys,
        })
    }
}

/// Projections that read the same input: one linear layer each, or one fused layer (Phi-3's own,
/// or theirs fused when the model loads: [`Vb::fused_matmul`])
/// whose output columns are theirs in turn.
enum Projections<const N: usize> {
    Separate([Linear; N]),
    Fused(Linear, [usize; N]),
}

impl<const N: usize> Projections<N> {
    /// `names` and output widths `dims`, or the `fused` layer where the model has it, or their
    /// weights fused where that pays.
    fn load(
        vb: &Vb,
        fused: Option<&str>,
        names: [&str; N],
        dims: [usize; N],
        in_dim: usize,
        bias: bool,
    ) -> Result<Self> {
        if let Some(fused) = fused {
            let total = dims.iter().sum();
            return Ok(Self::Fused(
                Linear::load(vb.pp(fused), total, in_dim, bias)?,
                dims,
            ));
        }
        if let Some(weight) = vb.fused_matmul(&names, &dims, in_dim)? {
            let bias = if bias {
                let parts = names
                    .iter()
                    .zip(dims)
                    .map(|(name, dim)| vb.pp(name).tensor("bias", &[dim]))
                    .collect::<Result<Vec<_>>>()?;
                Some(Tensor::cat(&parts, 0)?)
            } else {
                None
            };
            return Ok(Self::Fused(Linear { weight, bias }, dims));
        }
        let mut layers = Vec::with_capacity(N);
        for (name, dim) in names.into_iter().zip(dims) {
            layers.push(Linear::load(vb.pp(name), dim, in_dim, bias)?);
        }
        Ok(Self::Separate(
            layers
                .try_into()
                .unwrap_or_else(|_| unreachable!("one layer per name")),
        ))
    }

    fn forward(&self, xs: &Tensor) -> Result<[Tensor; N]> {
        let outputs = match self {
            Self::Separate(layers) => layers
                .iter()
                .map(|l| l.forward(xs))
                .collect::<Result<Vec<_>>>()?,
            Self::Fused(layer, dims) => {
                let ys = layer.forward(xs)?;
                let mut start = 0;
                dims.iter()
                    .map(|&dim| {
                        let part = ys.narrow(2, start, dim)?;
                        start += dim;
                        Ok(part)
                    })
                    .collect::<Result<Vec<_>>>()?
            }
        };
        Ok(outputs
            .try_into()
            .unwrap_or_else(|_| unreachable!("one output per projection")))
    }
}

struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    /// A norm of `cfg`'s model: Gemma's scale by 1 + w, which llama.cpp's files store as such
    /// (a Hugging Face checkpoint stores w).
    fn load(vb: Vb, size: usize, cfg: &ModelConfig) -> Result<Self> {
        let weight = vb.tensor("weight", &[size])?;
        let weight = if cfg.architecture == Architecture::Gemma3 && !vb.is_gguf() {
            (weight + 1.0)?
        } else {
            weight
        };
        Ok(Self {
            weight,
            eps: cfg.rms_norm_eps as f32,
        })
    }

    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(xs, &self.weight, self.eps)?)
    }
}

struct Attention {
    qkv: Projections<3>,
    o_proj: Linear,
    /// Qwen3's and Gemma's RMSNorm over each head of q and of k (weights of one head's width).
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    /// Which rope table and span the layer uses: a local (sliding-window) layer's, or not.
    local: bool,
    span: Span,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    /// The leading dimensions of a head that rope turns.
    rotary_dim: usize,
    interleaved: bool,
}

impl Attention {
    fn load(vb: Vb, cfg: &ModelConfig, local: bool) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let q_dim = cfg.num_heads * d;
        let kv_dim = cfg.num_kv_heads * d;
        Ok(Self {
            qkv: Projections::load(
                &vb,
                (cfg.architecture == Architecture::Phi3).then_some("qkv_proj"),
                ["q_proj", "k_proj", "v_proj"],
                [q_dim, kv_dim, kv_dim],
                h,
                cfg.qkv_bias,
            )?,
            o_proj: Linear::load(vb.pp("o_proj"), h, q_dim, cfg.o_bias)?,
            qk_norm: if cfg.qk_norm {
                Some((
                    RmsNorm::load(vb.pp("q_norm"), d, cfg)?,
                    RmsNorm::load(vb.pp("k_norm"), d, cfg)?,
                ))
            } else {
                None
            },
            local,
            span: Span {
                scale: cfg.attention_scale as f32,
                window: if local {
                    cfg.sliding_window
                } else {
                    usize::MAX
                },
            },
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: d,
            rotary_dim: cfg.rotary_dim,
            interleaved: cfg.rope_interleaved,
        })
    }

    /// Splits (1, n, heads * d) into (1, heads, n, d), normalises each head with `norm` and
    /// applies rope.
    fn heads(
        &self,
        xs: Tensor,
        heads: usize,
        norm: Option<&RmsNorm>,
        rope: Option<&Rope>,
    ) -> Result<Tensor> {
        let n = xs.dim(1)?;
        let xs = xs.reshape((1, n, heads, self.head_dim))?;
        let xs = match norm {
            Some(norm) => norm.forward(&xs)?,
            None => xs,
        };
        let xs = xs.transpose(1, 2)?.contiguous()?;
        let Some(r) = rope else {
            return Ok(xs);
        };
        let turn = |xs: &Tensor| -> Result<Tensor> {
            Ok(if self.interleaved {
                candle_nn::rotary_emb::rope_i(xs, &r.cos, &r.sin)?
            } else {
                candle_nn::rotary_emb::rope(xs, &r.cos, &r.sin)?
            })
        };
        if self.rotary_dim == self.head_dim {
            return turn(&xs);
        }
        // Rope turns the head's leading dimensions; the rest pass through (Phi-4-mini).
        let turned = turn(&xs.narrow(3, 0, self.rotary_dim)?.contiguous()?)?;
        let kept = xs.narrow(3, self.rotary_dim, self.head_dim - self.rotary_dim)?;
        Ok(Tensor::cat(&[turned, kept], 3)?.contiguous()?)
    }

    /// The attention of every sequence of a batch: one projection over all rows, then each
    /// sequence's rows against its own cache.
    fn forward(&self, xs: &Tensor, layer: usize, seqs: &[SeqRows<'_>]) -> Result<Tensor> {
        let [q_all, k_all, v_all] = self.qkv.forward(xs)?;
        // On the CPU the attention of all sequences runs as one call (their rows split across
        // the threads together); elsewhere sequence by sequence.
        let cpu = cpu_kernel(xs.device(), xs.dtype());
        let (mut on_cpu, mut out) = (Vec::new(), Vec::new());
        let paths: Vec<Option<&TreePaths>> = seqs.iter().map(|s| s.paths.as_ref()).collect();
        for seq in seqs {
            let rows = |t: &Tensor| t.narrow(1, seq.offset, seq.n);
            let (q_norm, k_norm) = self.qk_norm.as_ref().map(|(q, k)| (q, k)).unzip();
            let rope = &seq.rope[usize::from(self.local)];
            let q = self.heads(rows(&q_all)?, self.num_heads, q_norm, Some(rope))?;
            let k = self.heads(rows(&k_all)?, self.num_kv_heads, k_norm, Some(rope))?;
            let v = self.heads(rows(&v_all)?, self.num_kv_heads, None, None)?;
            let pieces = seq.cache.append(layer, &k, &v)?;
            if cpu {
                on_cpu.push((q, pieces));
                continue;
            }
            // candle's ops and the CUDA kernel take the keys and values in one piece.
            let (ks, vs): (Vec<Tensor>, Vec<Tensor>) = pieces.into_iter().unzip();
            let (k, v) = (Tensor::cat(&ks, 2)?, Tensor::cat(&vs, 2)?);
            #[cfg(feature = "cuda")]
            if let Some(keys) = &seq.keys[usize::from(self.local)] {
                out.push(crate::kernels::attention_cuda(
                    &q,
                    &k,
                    &v,
                    keys,
                    self.span.scale,
                )?);
                continue;
            }
            out.push(self.attend(&q, &k, &v, seq.masks[usize::from(self.local)].as_ref())?);
        }
        // Rows past the sequences' (whole tiles on a GPU) stay zero.
        let pad = xs.dim(1)? - seqs.iter().map(|s| s.n).sum::<usize>();
        if pad > 0 {
            let width = self.num_heads * self.head_dim;
            out.push(Tensor::zeros((1, pad, width), xs.dtype(), xs.device())?);
        }
        let ys = if cpu {
            attention_cpu(&on_cpu, &paths, self.span)?
        } else if out.len() == 1 {
            out.pop().expect("one sequence")
        } else {
            Tensor::cat(&out, 1)?
        };
        self.o_proj.forward(&ys)
    }

    /// One sequence's attention of q (1, heads, n, d) over its cached k and v, as
    /// (1, n, heads · d), where neither [`attention_cpu`] nor the CUDA kernel runs ([`masked`]).
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let n = q.dim(2)?;
        let total = k.dim(2)?;
        // Grouped-query attention without copying keys: the query heads that share a kv head
        // are stacked along the row axis, (1, kv_heads, group * n, d).
        let group = self.num_heads / self.num_kv_heads;
        let q = q.reshape((1, self.num_kv_heads, group * n, self.head_dim))?;
        let att = (q.matmul(&k.t()?)? * f64::from(self.span.scale))?;
        let att = match mask {
            None => att,
            Some(mask) => att
                .reshape((1, self.num_kv_heads, group, n, total))?
                .broadcast_add(mask)?
                .reshape((1, self.num_kv_heads, group * n, total))?,
        };
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        Ok(att
            .matmul(v)?
            .reshape((1, self.num_heads, n, self.head_dim))?
            .transpose(1, 2)?
            .reshape((1, n, self.num_heads * self.head_dim))?)
    }
}

struct Mlp {
    gate_up: Projections<2>,
    down_proj: Linear,
    activation: Activation,
}

impl Mlp {
    fn load(vb: Vb, cfg: &ModelConfig) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            gate_up: Projections::load(
                &vb,
                (cfg.architecture == Architecture::Phi3).then_some("gate_up_proj"),
                ["gate_proj", "up_proj"],
                [i, i],
                h,
                false,
            )?,
            down_proj: Linear::load(vb.pp("down_proj"), h, i, false)?,
            activation: cfg.activation,
        })
    }

    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let [gate, up] = self.gate_up.forward(xs)?;
        let act = match self.activation {
            Activation::Silu => Gate::Silu,
            Activation::GeluTanh => Gate::GeluTanh,
        };
        self.down_proj.forward(&gated(&gate, &up, act)?)
    }
}

/// A decoder layer: a norm before attention and one before the MLP, and Gemma's norms after
/// each (`sandwich`).
struct Block {
    attn_norm: RmsNorm,
    self_attn: Attention,
    mlp_norm: RmsNorm,
    mlp: Mlp,
    sandwich: Option<(RmsNorm, RmsNorm)>,
}

impl Block {
    fn load(vb: Vb, cfg: &ModelConfig, layer: usize) -> Result<Self> {
        let h = cfg.hidden_size;
        let norm = |name: &str| RmsNorm::load(vb.pp(name), h, cfg);
        let local = cfg.local_layers.get(layer).copied().unwrap_or(false);
        let gemma = cfg.architecture == Architecture::Gemma3;
        Ok(Self {
            attn_norm: norm("input_layernorm")?,
            self_attn: Attention::load(vb.pp("self_attn"), cfg, local)?,
            // Llama's `post_attention_layernorm` precedes the MLP; Gemma's follows attention.
            mlp_norm: norm(if gemma {
                "pre_feedforward_layernorm"
            } else {
                "post_attention_layernorm"
            })?,
            mlp: Mlp::load(vb.pp("mlp"), cfg)?,
            sandwich: if gemma {
                Some((
                    norm("post_attention_layernorm")?,
                    norm("post_feedforward_layernorm")?,
                ))
            } else {
                None
            },
        })
    }

    fn forward(&self, xs: &Tensor, layer: usize, seqs: &[SeqRows<'_>]) -> Result<Tensor> {
        let after = |norm: Option<&RmsNorm>, ys: Tensor| match norm {
            Some(norm) => norm.forward(&ys),
            None => Ok(ys),
        };
        let (post_attn, post_mlp) = self.sandwich.as_ref().map(|(a, m)| (a, m)).unzip();
        let attn = self
            .self_attn
            .forward(&self.attn_norm.forward(xs)?, layer, seqs)?;
        let xs = (xs + after(post_attn, attn)?)?;
        let mlp = self.mlp.forward(&self.mlp_norm.forward(&xs)?)?;
        Ok((xs + after(post_mlp, mlp)?)?)
    }
}

/// Whether attention runs on the CPU kernel ([`attention_cpu`]: f32 on the CPU, causal by
/// construction).
fn cpu_kernel(device: &Device, dtype: DType) -> bool {
    matches!(device, Device::Cpu) && dtype == DType::F32
}

/// Whether attention runs on candle's ops, which take a mask: neither the CPU kernel nor the
/// CUDA one (which read each row's keys by construction) runs.
fn masked(device: &Device, dtype: DType) -> bool {
    !cpu_kernel(device, dtype) && !device.is_cuda()
}

/// cos/sin rows of the positions of one block.
struct Rope {
    cos: Tensor,
    sin: Tensor,
}

/// One sequence of a batched forward: its rows of the batch, their rotary embeddings and mask,
/// and its cache.
struct SeqRows<'a> {
    offset: usize,
    n: usize,
    /// The global layers' rotary embeddings and mask, then the local layers' (if any).
    rope: Vec<Rope>,
    masks: Vec<Option<Tensor>>,
    /// A token tree's rows: the tree rows each sees, its ancestors and itself.
    paths: Option<TreePaths>,
    /// On a GPU, the keys each row sees (global layers', then local layers'), for the CUDA
    /// attention kernel.
    #[cfg(feature = "cuda")]
    keys: Vec<Option<crate::kernels::KeyTables>>,
    cache: &'a KvCache,
}

/// One sequence of a batch: the tokens it feeds at positions `cache.len()..`, its cache, and
/// which of its positions get logits.
pub(crate) struct BatchItem<'a> {
    pub(crate) tokens: &'a [u32],
    pub(crate) cache: &'a mut KvCache,
    pub(crate) logits: Logits,
    /// A token tree: each tree row's parent row (none: the row follows the cache before the
    /// tree), parents before children. The tree's first rows may be the cache's last (an
    /// earlier forward's, kept): `parents` then holds theirs first, then the block's. None for
    /// a plain block (each row after the one before).
    pub(crate) parents: Option<&'a [Option<usize>]>,
}

/// Which positions of a block get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Every position: verification of a drafted block.
    All,
    /// Only the last position: drafting and plain decoding.
    Last,
}

pub(crate) struct Llama {
    embed_tokens: Tensor,
    /// What embeddings are multiplied by (Gemma: √hidden).
    embed_scale: Option<f64>,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Head,
    /// cos and sin of every position: the global layers' table, then the local layers' (their
    /// own base, no scaling) where the model has local layers, with their window.
    tables: Vec<Rope>,
    windows: Vec<usize>,
    dtype: DType,
}

/// cos/sin of every position up to `cfg.max_context`, scaled by the rope's attention factor.
fn rope_table(cfg: &ModelConfig, dtype: DType, device: &Device) -> Result<Rope> {
    let inv_freq = cfg.inv_freq();
    let half = inv_freq.len();
    let inv_freq = Tensor::from_vec(inv_freq, (1, half), device)?;
    let positions = Tensor::arange(0u32, cfg.max_context as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((cfg.max_context, 1))?;
    let freqs = positions.broadcast_mul(&inv_freq)?;
    let scale = cfg.rope_scaling.attention_factor();
    Ok(Rope {
        cos: (freqs.cos()? * scale)?.to_dtype(dtype)?,
        sin: (freqs.sin()? * scale)?.to_dtype(dtype)?,
    })
}

impl Llama {
    pub(crate) fn load(
        vb: Vb,
        cfg: &ModelConfig,
        dtype: DType,
        device: &Device,
        logit_ids: Option<Vec<u32>>,
    ) -> Result<Self> {
        let m = vb.pp("model");
        let embed_tokens = m
            .pp("embed_tokens")
            .tensor("weight", &[cfg.vocab_size, cfg.hidden_size])?
            .to_dtype(dtype)?;
        let layers = (0..cfg.num_layers)
            .map(|i| Block::load(m.pp("layers").pp(i), cfg, i))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(m.pp("norm"), cfg.hidden_size, cfg)?;
        // Tied embeddings reuse the embedding matrix, kept quantized in GGUF files.
        let head = if cfg.tie_word_embeddings {
            m.pp("embed_tokens")
        } else {
            vb.pp("lm_head")
        };
        let lm_head = Head::load(head, cfg, logit_ids)?;
        let mut tables = vec![rope_table(cfg, dtype, device)?];
        let mut windows = vec![usize::MAX];
        if cfg.local_layers.contains(&true) {
            // Gemma 3's local layers rotate with a rope of their own; Phi-3's windowed ones
            // with the model's.
            let local = match cfg.architecture {
                Architecture::Gemma3 => ModelConfig {
                    rope_theta: cfg.rope_local_theta,
                    rope_scaling: RopeScaling::None,
                    ..cfg.clone()
                },
                _ => cfg.clone(),
            };
            tables.push(rope_table(&local, dtype, device)?);
            windows.push(cfg.sliding_window);
        }
        let gemma = cfg.architecture == Architecture::Gemma3;
        Ok(Self {
            embed_tokens,
            // Gemma scales by √hidden rounded to the model's dtype, as its reference does.
            embed_scale: gemma.then(|| f64::from((cfg.hidden_size as f32).sqrt())),
            layers,
            norm,
            lm_head,
            tables,
            windows,
            dtype,
        })
    }

    /// Runs the tokens of every item at positions `cache.len()..` of its own cache, appending
    /// their keys and values there, as one forward pass: the rows of all items go through each
    /// matmul together (the weights are read once for the batch) and each item's rows attend
    /// over its own cache. Returns each item's f32 logits, (positions, vocab).
    pub(crate) fn forward(&self, items: &mut [BatchItem<'_>]) -> Result<Vec<Tensor>> {
        for item in items.iter_mut() {
            item.cache.reserve(item.tokens.len())?;
        }
        let device = self.embed_tokens.device();
        let ids: Vec<u32> = items
            .iter()
            .flat_map(|i| i.tokens.iter().copied())
            .collect();
        let ids = Tensor::new(ids.as_slice(), device)?;
        let mut xs = self.embed_tokens.index_select(&ids, 0)?.unsqueeze(0)?;
        if let Some(scale) = self.embed_scale {
            xs = (xs * scale)?;
        }
        // Off the CPU, zero rows to whole tiles of the products (each layer keeps them).
        let pad = crate::kernels::tile_padding(device, ids.dim(0)?);
        if pad > 0 {
            let zeros = Tensor::zeros((1, pad, xs.dim(2)?), xs.dtype(), device)?;
            xs = Tensor::cat(&[xs, zeros], 1)?;
        }
        let mut offset = 0;
        let mut seqs = Vec::with_capacity(items.len());
        for item in items.iter() {
            seqs.push(match item.parents {
                Some(parents) => self.tree_rows(item, parents, offset)?,
                None => self.chain_rows(item, offset)?,
            });
            offset += item.tokens.len();
        }
        for (i, layer) in self.layers.iter().enumerate() {
            xs = layer.forward(&xs, i, &seqs)?;
        }
        // The rows that get logits, gathered so that the output projection runs once.
        let mut kept = Vec::with_capacity(items.len());
        let mut parts = Vec::with_capacity(items.len());
        for (seq, item) in seqs.iter().zip(items.iter()) {
            let (start, len) = match item.logits {
                Logits::All => (seq.offset, seq.n),
                Logits::Last => (seq.offset + seq.n - 1, 1),
            };
            parts.push(xs.narrow(1, start, len)?);
            kept.push(len);
        }
        drop(seqs);
        for item in items.iter_mut() {
            item.cache.advance(item.tokens.len());
        }
        crate::kernels::trim_scratch();
        let xs = if parts.len() == 1 {
            parts.pop().expect("one item")
        } else {
            Tensor::cat(&parts, 1)?
        };
        let xs = self.norm.forward(&xs)?;
        let logits = self.lm_head.forward(&xs)?;
        let mut start = 0;
        kept.into_iter()
            .map(|len| {
                let rows = logits.narrow(0, start, len)?;
                start += len;
                Ok(rows)
            })
            .collect()
    }
}

impl Llama {
    /// Whether token trees run on this model: none with sliding-window layers.
    pub(crate) fn takes_trees(&self) -> bool {
        self.windows.iter().all(|&w| w == usize::MAX)
    }

    /// A chain's rows in the batch (the item's tokens after its cache, each attending to all
    /// before it): their rotary embeddings, masks where the kernel needs one, and their keys'
    /// tables on a GPU.
    fn chain_rows<'a>(&self, item: &'a BatchItem<'_>, offset: usize) -> Result<SeqRows<'a>> {
        let device = self.embed_tokens.device();
        let (n, pos) = (item.tokens.len(), item.cache.len());
        // The keys a layer holds before the block: a windowed layer's start at the cache's
        // base.
        let held = |window: usize| {
            if window == usize::MAX {
                pos
            } else {
                pos - item.cache.base()
            }
        };
        // The attention kernels mask by construction; candle's attention needs a mask (a
        // decode row of a windowed layer too).
        let masks = self
            .windows
            .iter()
            .map(|&window| {
                let held = held(window);
                let needed = (n > 1 || held + n > window) && masked(device, self.dtype);
                needed
                    .then(|| causal_mask(n, held, window, self.dtype, device))
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        let rope = self
            .tables
            .iter()
            .map(|t| {
                Ok(Rope {
                    cos: t.cos.narrow(0, pos, n)?,
                    sin: t.sin.narrow(0, pos, n)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        #[cfg(feature = "cuda")]
        let keys = self
            .windows
            .iter()
            .map(|&window| {
                device
                    .is_cuda()
                    .then(|| crate::kernels::KeyTables::new(n, held(window), window, None, device))
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SeqRows {
            offset,
            n,
            rope,
            masks,
            paths: None,
            #[cfg(feature = "cuda")]
            keys,
            cache: &*item.cache,
        })
    }

    /// A token tree's rows ([`BatchItem::parents`]): each at the position of its depth past the
    /// cache before the tree, seeing that cache and its path (its ancestors and itself). Models
    /// with sliding-window layers take no trees.
    fn tree_rows<'a>(
        &self,
        item: &'a BatchItem<'_>,
        parents: &[Option<usize>],
        offset: usize,
    ) -> Result<SeqRows<'a>> {
        let (n, pos) = (item.tokens.len(), item.cache.len());
        let bad = |why: &str| crate::Error::invalid("tree", format!("{n} rows"), why);
        let Some(earlier) = parents.len().checked_sub(n).filter(|&e| e <= pos) else {
            return Err(bad(
                "one parent per row: the cached tree rows' first, then the block's",
            ));
        };
        if !self.takes_trees() {
            return Err(bad(
                "a model with sliding-window layers verifies chains only",
            ));
        }
        let mut paths: Vec<Vec<usize>> = Vec::with_capacity(parents.len());
        for (i, parent) in parents.iter().enumerate() {
            let mut path = match parent {
                None => Vec::new(),
                Some(p) if *p < i => paths[*p].clone(),
                Some(_) => return Err(bad("parents come before their rows")),
            };
            if path.len() > crate::kernels::MAX_TREE_DEPTH {
                return Err(bad("deeper than the attention reads"));
            }
            path.push(i);
            paths.push(path);
        }
        let paths = TreePaths {
            paths: paths.split_off(earlier),
            earlier,
        };
        let base = pos - earlier;
        let device = self.embed_tokens.device();
        let positions: Vec<u32> = (paths.paths.iter())
            .map(|p| u32::try_from(base + p.len() - 1).unwrap_or(u32::MAX))
            .collect();
        let positions = Tensor::new(positions.as_slice(), device)?;
        let rope = self
            .tables
            .iter()
            .map(|t| {
                Ok(Rope {
                    cos: t.cos.index_select(&positions, 0)?,
                    sin: t.sin.index_select(&positions, 0)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mask = masked(device, self.dtype)
            .then(|| tree_mask(&paths, pos, self.dtype, device))
            .transpose()?;
        #[cfg(feature = "cuda")]
        let keys = vec![
            device
                .is_cuda()
                .then(|| crate::kernels::KeyTables::new(n, pos, usize::MAX, Some(&paths), device))
                .transpose()?,
        ];
        Ok(SeqRows {
            offset,
            n,
            rope,
            masks: vec![mask],
            paths: Some(paths),
            #[cfg(feature = "cuda")]
            keys,
            cache: &*item.cache,
        })
    }
}

/// (n, pos + n) additive mask of a token tree's rows: row i sees the cached positions before
/// the tree and the tree rows of its path.
fn tree_mask(tree: &TreePaths, pos: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let n = tree.paths.len();
    let base = pos - tree.earlier;
    let mut mask = vec![f32::NEG_INFINITY; n * (pos + n)];
    for (i, path) in tree.paths.iter().enumerate() {
        let row = &mut mask[i * (pos + n)..][..pos + n];
        row[..base].fill(0.0);
        for &r in path {
            row[base + r] = 0.0;
        }
    }
    Ok(Tensor::from_vec(mask, (n, pos + n), device)?.to_dtype(dtype)?)
}

/// (n, pos + n) additive mask: row i sees the `pos` cached positions and block positions ≤ i,
/// the last `window` of them.
fn causal_mask(
    n: usize,
    pos: usize,
    window: usize,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let total = pos + n;
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| {
            (0..total).map(move |j| {
                if j > pos + i || pos + i - j >= window {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(mask, (n, total), device)?.to_dtype(dtype)?)
}
