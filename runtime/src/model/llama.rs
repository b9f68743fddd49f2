//! The Llama-family forward pass (Llama 1/2/3, Mistral, TinyLlama, SmolLM, Qwen2) over a
//! truncatable [`KvCache`], returning logits for every position of a block or only the last.

use candle_core::{DType, Device, Tensor};

use super::config::ModelConfig;
use super::weights::Vb;
use crate::Result;
use crate::kernels::{Matmul, attention_cpu};
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

struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    fn load(vb: Vb, size: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: vb.tensor("weight", &[size])?,
            eps: eps as f32,
        })
    }

    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(xs, &self.weight, self.eps)?)
    }
}

struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    interleaved: bool,
}

impl Attention {
    fn load(vb: Vb, cfg: &ModelConfig) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let q_dim = cfg.num_heads * d;
        let kv_dim = cfg.num_kv_heads * d;
        Ok(Self {
            q_proj: Linear::load(vb.pp("q_proj"), q_dim, h, cfg.qkv_bias)?,
            k_proj: Linear::load(vb.pp("k_proj"), kv_dim, h, cfg.qkv_bias)?,
            v_proj: Linear::load(vb.pp("v_proj"), kv_dim, h, cfg.qkv_bias)?,
            o_proj: Linear::load(vb.pp("o_proj"), h, q_dim, cfg.o_bias)?,
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: d,
            interleaved: cfg.rope_interleaved,
        })
    }

    /// Splits (1, n, heads * d) into (1, heads, n, d) and applies rope.
    fn heads(&self, xs: Tensor, heads: usize, rope: Option<&Rope>) -> Result<Tensor> {
        let n = xs.dim(1)?;
        let xs = xs
            .reshape((1, n, heads, self.head_dim))?
            .transpose(1, 2)?
            .contiguous()?;
        match rope {
            None => Ok(xs),
            Some(r) if self.interleaved => Ok(candle_nn::rotary_emb::rope_i(&xs, &r.cos, &r.sin)?),
            Some(r) => Ok(candle_nn::rotary_emb::rope(&xs, &r.cos, &r.sin)?),
        }
    }

    fn forward(
        &self,
        xs: &Tensor,
        layer: usize,
        cache: &KvCache,
        rope: &Rope,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let n = xs.dim(1)?;
        let q = self.heads(self.q_proj.forward(xs)?, self.num_heads, Some(rope))?;
        let k = self.heads(self.k_proj.forward(xs)?, self.num_kv_heads, Some(rope))?;
        let v = self.heads(self.v_proj.forward(xs)?, self.num_kv_heads, None)?;
        let (k, v) = cache.append(layer, &k, &v)?;
        if matches!(xs.device(), Device::Cpu) && xs.dtype() == DType::F32 {
            return self.o_proj.forward(&attention_cpu(&q, &k, &v)?);
        }
        let total = k.dim(2)?;
        // Grouped-query attention without copying keys: the query heads that share a kv head
        // are stacked along the row axis, (1, kv_heads, group * n, d).
        let group = self.num_heads / self.num_kv_heads;
        let q = q.reshape((1, self.num_kv_heads, group * n, self.head_dim))?;
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let att = (q.matmul(&k.t()?)? * scale)?;
        let att = match mask {
            None => att,
            Some(mask) => att
                .reshape((1, self.num_kv_heads, group, n, total))?
                .broadcast_add(mask)?
                .reshape((1, self.num_kv_heads, group * n, total))?,
        };
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        let ys = att
            .matmul(&v)?
            .reshape((1, self.num_heads, n, self.head_dim))?
            .transpose(1, 2)?
            .reshape((1, n, self.num_heads * self.head_dim))?;
        self.o_proj.forward(&ys)
    }
}

struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn load(vb: Vb, cfg: &ModelConfig) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            gate_proj: Linear::load(vb.pp("gate_proj"), i, h, false)?,
            up_proj: Linear::load(vb.pp("up_proj"), i, h, false)?,
            down_proj: Linear::load(vb.pp("down_proj"), h, i, false)?,
        })
    }

    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let gate = self.gate_proj.forward(xs)?.silu()?;
        self.down_proj.forward(&(gate * self.up_proj.forward(xs)?)?)
    }
}

struct Block {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl Block {
    fn load(vb: Vb, cfg: &ModelConfig) -> Result<Self> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        Ok(Self {
            input_layernorm: RmsNorm::load(vb.pp("input_layernorm"), h, eps)?,
            self_attn: Attention::load(vb.pp("self_attn"), cfg)?,
            post_attention_layernorm: RmsNorm::load(vb.pp("post_attention_layernorm"), h, eps)?,
            mlp: Mlp::load(vb.pp("mlp"), cfg)?,
        })
    }

    fn forward(
        &self,
        xs: &Tensor,
        layer: usize,
        cache: &KvCache,
        rope: &Rope,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let attn =
            self.self_attn
                .forward(&self.input_layernorm.forward(xs)?, layer, cache, rope, mask)?;
        let xs = (xs + attn)?;
        let mlp = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&xs)?)?;
        Ok((xs + mlp)?)
    }
}

/// cos/sin rows of the positions of one block.
struct Rope {
    cos: Tensor,
    sin: Tensor,
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
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Matmul,
    cos: Tensor,
    sin: Tensor,
    dtype: DType,
}

impl Llama {
    pub(crate) fn load(vb: Vb, cfg: &ModelConfig, dtype: DType, device: &Device) -> Result<Self> {
        let m = vb.pp("model");
        let embed_tokens = m
            .pp("embed_tokens")
            .tensor("weight", &[cfg.vocab_size, cfg.hidden_size])?
            .to_dtype(dtype)?;
        let layers = (0..cfg.num_layers)
            .map(|i| Block::load(m.pp("layers").pp(i), cfg))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(m.pp("norm"), cfg.hidden_size, cfg.rms_norm_eps)?;
        // Tied embeddings reuse the embedding matrix, kept quantized in GGUF files.
        let lm_head = if cfg.tie_word_embeddings {
            m.pp("embed_tokens")
                .matmul(cfg.vocab_size, cfg.hidden_size)?
        } else {
            vb.pp("lm_head").matmul(cfg.vocab_size, cfg.hidden_size)?
        };
        let inv_freq = cfg.inv_freq();
        let half = inv_freq.len();
        let inv_freq = Tensor::from_vec(inv_freq, (1, half), device)?;
        let positions = Tensor::arange(0u32, cfg.max_context as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((cfg.max_context, 1))?;
        let freqs = positions.broadcast_mul(&inv_freq)?;
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
            cos: freqs.cos()?.to_dtype(dtype)?,
            sin: freqs.sin()?.to_dtype(dtype)?,
            dtype,
        })
    }

    /// Runs `tokens` at positions `cache.len()..`, appending their keys and values to `cache`.
    /// Returns f32 logits of shape (positions, vocab).
    pub(crate) fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        logits: Logits,
    ) -> Result<Tensor> {
        let n = tokens.len();
        let pos = cache.len();
        cache.reserve(n)?;
        let device = self.embed_tokens.device();
        let ids = Tensor::new(tokens, device)?;
        let mut xs = self.embed_tokens.index_select(&ids, 0)?.unsqueeze(0)?;
        let rope = Rope {
            cos: self.cos.narrow(0, pos, n)?,
            sin: self.sin.narrow(0, pos, n)?,
        };
        // The CPU attention kernel masks by construction.
        let mask = if n > 1 && !matches!(device, Device::Cpu) {
            Some(causal_mask(n, pos, self.dtype, device)?)
        } else {
            None
        };
        for (i, layer) in self.layers.iter().enumerate() {
            xs = layer.forward(&xs, i, cache, &rope, mask.as_ref())?;
        }
        cache.advance(n);
        crate::kernels::trim_scratch();
        let xs = match logits {
            Logits::All => xs,
            Logits::Last => xs.narrow(1, n - 1, 1)?,
        };
        let xs = self.norm.forward(&xs)?;
        Ok(self
            .lm_head
            .forward(&xs)?
            .squeeze(0)?
            .to_dtype(DType::F32)?)
    }
}

/// (n, pos + n) additive mask: row i sees the `pos` cached positions and block positions ≤ i.
fn causal_mask(n: usize, pos: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let total = pos + n;
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| (0..total).map(move |j| if j > pos + i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Ok(Tensor::from_vec(mask, (n, total), device)?.to_dtype(dtype)?)
}
