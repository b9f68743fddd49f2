//! A model's output projection: the logits of every token, or of some tokens only (a draft's
//! vocabulary: [`crate::LoadOptions::logit_ids`]), whose rows alone it reads.

use candle_core::{DType, Tensor};

use super::config::ModelConfig;
use super::weights::Vb;
use crate::Result;
use crate::kernels::Matmul;

pub(crate) struct Head {
    matmul: Matmul,
    /// Where some tokens' logits only are computed: the token id of each output.
    ids: Option<Vec<u32>>,
    vocab_size: usize,
}

impl Head {
    /// The projection `head` holds (its `weight`, vocabulary × hidden), over the tokens `ids`
    /// where given (ids below the vocabulary size).
    pub(crate) fn load(head: Vb, cfg: &ModelConfig, ids: Option<Vec<u32>>) -> Result<Self> {
        let vocab_size = cfg.vocab_size;
        if let Some(&id) = ids.iter().flatten().find(|&&id| id as usize >= vocab_size) {
            return Err(crate::Error::invalid(
                "logit_ids",
                id,
                format!("ids must be below the vocabulary size {vocab_size}"),
            ));
        }
        let ids = ids.filter(|ids| ids.len() < vocab_size);
        let matmul = match &ids {
            Some(ids) => head.matmul_rows(vocab_size, cfg.hidden_size, ids)?,
            None => head.matmul(vocab_size, cfg.hidden_size)?,
        };
        Ok(Self {
            matmul,
            ids,
            vocab_size,
        })
    }

    /// The f32 logits of the rows of `xs` (1, rows, hidden): (rows, vocabulary), -inf for
    /// every token whose logits are not computed.
    pub(crate) fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let logits = self.matmul.forward(xs)?.squeeze(0)?.to_dtype(DType::F32)?;
        let Some(ids) = &self.ids else {
            return Ok(logits);
        };
        let rows = logits.to_vec2::<f32>()?;
        let mut full = vec![f32::NEG_INFINITY; rows.len() * self.vocab_size];
        for (out, row) in full.chunks_exact_mut(self.vocab_size).zip(&rows) {
            for (&id, &x) in ids.iter().zip(row) {
                out[id as usize] = x;
            }
        }
        Ok(Tensor::from_vec(
            full,
            (rows.len(), self.vocab_size),
            logits.device(),
        )?)
    }
}
