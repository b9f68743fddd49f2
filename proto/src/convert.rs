//! Conversions between wire and runtime types shared by every service. Incoming values are
//! checked here, so a malformed message becomes a clear INVALID_ARGUMENT, never a panic.

use tandem_runtime::{Distribution, Prefix, SamplingParams};

use crate::v1;
use crate::{Error, Result};

pub fn prefix_to_wire(p: Prefix) -> v1::Prefix {
    v1::Prefix {
        len: p.len as u32,
        hash: p.hash,
    }
}

pub fn prefix_from_wire(p: Option<v1::Prefix>) -> Result<Prefix> {
    let p = p.ok_or(Error::MissingField("committed"))?;
    Ok(Prefix {
        len: p.len as usize,
        hash: p.hash,
    })
}

impl From<&SamplingParams> for v1::SamplingParams {
    fn from(s: &SamplingParams) -> Self {
        Self {
            temperature: s.temperature,
            top_k: s.top_k as u32,
            top_p: s.top_p,
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
            repeat_last_n: s.repeat_last_n as u32,
            seed: s.seed,
        }
    }
}

impl v1::SamplingParams {
    /// The runtime's parameters, zero meaning "default" where zero is not a meaningful value,
    /// checked against their ranges.
    pub fn to_runtime(&self) -> Result<SamplingParams> {
        let d = SamplingParams::default();
        let or = |v: f32, default: f32| if v == 0.0 { default } else { v };
        let s = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k as usize,
            top_p: or(self.top_p, d.top_p),
            min_p: self.min_p,
            repetition_penalty: or(self.repetition_penalty, d.repetition_penalty),
            repeat_last_n: if self.repeat_last_n == 0 {
                d.repeat_last_n
            } else {
                self.repeat_last_n as usize
            },
            seed: self.seed,
        };
        s.validate()?;
        Ok(s)
    }
}

/// Encodes a distribution in the smallest exact form: one-hot, the non-zero entries, or every
/// probability.
pub fn distribution_to_wire(d: &Distribution) -> v1::Distribution {
    use v1::distribution::Kind;
    let kind = match d {
        Distribution::OneHot(t) => Kind::OneHot(*t),
        Distribution::Dense(p) => {
            let nonzero = p.iter().filter(|&&x| x != 0.0).count();
            // A sparse entry costs 8 bytes, a dense one 4.
            if nonzero * 2 < p.len() {
                let (ids, probs) = p
                    .iter()
                    .enumerate()
                    .filter(|(_, x)| **x != 0.0)
                    .map(|(i, x)| (i as u32, *x))
                    .unzip();
                Kind::Sparse(v1::SparseProbs {
                    vocab_size: p.len() as u32,
                    ids,
                    probs,
                })
            } else {
                Kind::DenseF32(p.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
        }
    };
    v1::Distribution { kind: Some(kind) }
}

/// Decodes a draft distribution over a vocabulary of `vocab_size`, refusing ids out of range,
/// a wrong size, and negative or non-finite probabilities.
pub fn distribution_from_wire(d: &v1::Distribution, vocab_size: usize) -> Result<Distribution> {
    use v1::distribution::Kind;
    let bad = |value: String, limit: String| {
        Error::from(tandem_runtime::Error::invalid("q", value, limit))
    };
    let check_id = |id: u32| {
        if id as usize >= vocab_size {
            Err(bad(
                format!("token {id}"),
                format!("ids must be below the vocabulary size {vocab_size}"),
            ))
        } else {
            Ok(())
        }
    };
    let probs = match d.kind.as_ref().ok_or(Error::MissingField("q.kind"))? {
        Kind::OneHot(t) => {
            check_id(*t)?;
            return Ok(Distribution::OneHot(*t));
        }
        Kind::Sparse(s) => {
            if s.vocab_size as usize != vocab_size || s.ids.len() != s.probs.len() {
                return Err(bad(
                    format!(
                        "{} ids, {} probs over {}",
                        s.ids.len(),
                        s.probs.len(),
                        s.vocab_size
                    ),
                    format!("needs as many ids as probs over the vocabulary size {vocab_size}"),
                ));
            }
            let mut p = vec![0.0; vocab_size];
            for (&id, &x) in s.ids.iter().zip(&s.probs) {
                check_id(id)?;
                p[id as usize] = x;
            }
            p
        }
        Kind::DenseF32(bytes) => {
            if bytes.len() != 4 * vocab_size {
                return Err(bad(
                    format!("{} bytes", bytes.len()),
                    format!("dense q needs 4 × {vocab_size} bytes"),
                ));
            }
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        }
    };
    if let Some(x) = probs.iter().find(|x| !(x.is_finite() && **x >= 0.0)) {
        return Err(bad(
            format!("probability {x}"),
            "must be finite and non-negative".into(),
        ));
    }
    Ok(Distribution::Dense(probs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distributions_round_trip_exactly_in_their_smallest_form() {
        let mut peaked = vec![0.0f32; 100];
        peaked[3] = 0.25;
        peaked[97] = 0.75;
        let flat: Vec<f32> = (0..100).map(|i| (i as f32 + 0.5) / 5000.0).collect();
        for d in [
            Distribution::OneHot(42),
            Distribution::Dense(peaked),
            Distribution::Dense(flat),
        ] {
            let wire = distribution_to_wire(&d);
            assert_eq!(distribution_from_wire(&wire, 100).expect("decode"), d);
        }
        let wire = distribution_to_wire(&Distribution::OneHot(100));
        assert!(
            distribution_from_wire(&wire, 100).is_err(),
            "id out of range"
        );
        let wire = distribution_to_wire(&Distribution::Dense(vec![0.5; 10]));
        let err = distribution_from_wire(&wire, 100).expect_err("wrong size");
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.to_string().contains("`q`"), "{err}");
    }
}
