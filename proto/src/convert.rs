//! Conversions between wire and runtime types shared by every service. Incoming values are
//! checked here, so a malformed message becomes a clear INVALID_ARGUMENT, never a panic.

use tandem_runtime::{Distribution, DraftRefusal, Grammar, Prefix, RefusalReason, SamplingParams};

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
            seed: Some(s.seed),
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
        }
    }
}

impl v1::GenerationStats {
    /// Decode time outside the nodes' compute that the rounds waited for: the network, the
    /// queues and the bookkeeping (drafting done during a verify is not in it twice).
    pub fn overhead_seconds(&self) -> f64 {
        self.decode_seconds - self.draft_waited_seconds - self.target_seconds
    }
}

impl v1::SamplingParams {
    /// The runtime's parameters, zero meaning "default" where zero is not a meaningful value,
    /// checked against their ranges. No seed gets a random one.
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
            seed: self.seed.unwrap_or_else(random_seed),
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
        };
        s.validate()?;
        Ok(s)
    }
}

/// The longest grammar a request may carry (a JSON schema's, a Lark grammar's or a regex's text):
/// OpenAI caps a schema's names and values at 120,000 characters; compiling and masking grow
/// with the grammar, and one request's must not hold a node's threads.
pub const MAX_GRAMMAR_BYTES: usize = 256 << 10;

impl v1::Constraint {
    /// The runtime's grammar; `None` for a constraint that names none. A JSON schema that is not
    /// JSON is an invalid argument naming the parse error; a grammar over [`MAX_GRAMMAR_BYTES`]
    /// is refused.
    pub fn grammar(&self) -> Result<Option<Grammar>> {
        use v1::constraint::Kind;
        let size = match &self.kind {
            Some(Kind::JsonSchema(text) | Kind::Lark(text) | Kind::Regex(text)) => text.len(),
            _ => 0,
        };
        if size > MAX_GRAMMAR_BYTES {
            return Err(tandem_runtime::Error::Grammar(format!(
                "the grammar is {size} bytes: at most {MAX_GRAMMAR_BYTES} are accepted"
            ))
            .into());
        }
        Ok(match &self.kind {
            None => None,
            Some(Kind::JsonObject(false)) => None,
            Some(Kind::JsonObject(true)) => Some(Grammar::JsonObject),
            Some(Kind::JsonSchema(text)) => {
                Some(Grammar::JsonSchema(serde_json::from_str(text).map_err(
                    |e| tandem_runtime::Error::invalid("constraint.json_schema", "the text", e),
                )?))
            }
            Some(Kind::Lark(lark)) => Some(Grammar::Lark(lark.clone())),
            Some(Kind::Regex(rx)) => Some(Grammar::Regex(rx.clone())),
        })
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

/// A seed for a request that named none: the standard library's per-process random keys,
/// hashed with the time so that each call differs.
pub fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// Decodes the q of draft `position` over a vocabulary of `vocab_size`. What does not decode
/// (no kind, a wrong size, ids out of range) is a refusal of the block, not an error: the values
/// themselves are checked with the block ([`tandem_runtime::draft_check`]).
pub fn distribution_from_wire(
    d: &v1::Distribution,
    vocab_size: usize,
    position: usize,
) -> std::result::Result<Distribution, DraftRefusal> {
    use v1::distribution::Kind;
    let malformed = |detail: String| DraftRefusal::new(position, RefusalReason::MalformedQ, detail);
    let check_id = |id: u32| {
        if id as usize >= vocab_size {
            Err(malformed(format!(
                "q names token {id}: ids must be below the vocabulary size {vocab_size}"
            )))
        } else {
            Ok(())
        }
    };
    match d.kind.as_ref() {
        None => Err(malformed("q has no kind".into())),
        Some(Kind::OneHot(t)) => {
            check_id(*t)?;
            Ok(Distribution::OneHot(*t))
        }
        Some(Kind::Sparse(s)) => {
            if s.vocab_size as usize != vocab_size || s.ids.len() != s.probs.len() {
                return Err(malformed(format!(
                    "sparse q with {} ids and {} probs over {}: needs as many ids as probs over \
                     the vocabulary size {vocab_size}",
                    s.ids.len(),
                    s.probs.len(),
                    s.vocab_size
                )));
            }
            let mut p = vec![0.0; vocab_size];
            for (&id, &x) in s.ids.iter().zip(&s.probs) {
                check_id(id)?;
                p[id as usize] += x;
            }
            Ok(Distribution::Dense(p))
        }
        Some(Kind::DenseF32(bytes)) => {
            if bytes.len() != 4 * vocab_size {
                return Err(malformed(format!(
                    "dense q of {} bytes: needs 4 × {vocab_size}",
                    bytes.len()
                )));
            }
            Ok(Distribution::Dense(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ))
        }
    }
}

/// A token's log-probabilities on the wire.
pub fn logprobs_to_wire(l: &tandem_runtime::sampling::TokenLogprobs) -> v1::TokenLogprobs {
    v1::TokenLogprobs {
        token: l.token,
        logprob: l.logprob,
        top_ids: l.top.iter().map(|t| t.0).collect(),
        top_logprobs: l.top.iter().map(|t| t.1).collect(),
    }
}

/// A token's log-probabilities from the wire (alternatives past the shorter of the two lists
/// dropped).
pub fn logprobs_from_wire(l: &v1::TokenLogprobs) -> tandem_runtime::sampling::TokenLogprobs {
    tandem_runtime::sampling::TokenLogprobs {
        token: l.token,
        logprob: l.logprob,
        top: l
            .top_ids
            .iter()
            .copied()
            .zip(l.top_logprobs.iter().copied())
            .collect(),
    }
}

/// Longest `session_id` a node accepts.
pub const MAX_SESSION_ID_BYTES: usize = 128;

/// A `session_id` is checked before it reaches a log or a span: at most
/// [`MAX_SESSION_ID_BYTES`], of ASCII letters, digits and `-_.:/` only (no control characters,
/// no log injection). The refusal quotes at most 32 characters of it, escaped.
pub fn check_session_id(id: &str) -> Result<(), tandem_runtime::Error> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-_.:/".contains(c);
    if id.is_empty() || id.len() > MAX_SESSION_ID_BYTES || !id.chars().all(allowed) {
        let shown: String = id.chars().take(32).collect();
        return Err(tandem_runtime::Error::invalid(
            "session_id",
            format!("{shown:?} ({} bytes)", id.len()),
            format!("1 to {MAX_SESSION_ID_BYTES} bytes of ASCII letters, digits and `-_.:/`"),
        ));
    }
    Ok(())
}

/// Longest `OpenSession.cache_salt` a node accepts (the coordinator sends 32 bytes).
pub const MAX_CACHE_SALT_BYTES: usize = 64;

/// A session's `cache_salt` is checked before the prefix cache hashes it: at most
/// [`MAX_CACHE_SALT_BYTES`]. Its bytes are never quoted.
pub fn check_cache_salt(salt: &[u8]) -> Result<(), tandem_runtime::Error> {
    if salt.len() > MAX_CACHE_SALT_BYTES {
        return Err(tandem_runtime::Error::invalid(
            "cache_salt",
            format!("{} bytes", salt.len()),
            format!("at most {MAX_CACHE_SALT_BYTES} bytes"),
        ));
    }
    Ok(())
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
            assert_eq!(distribution_from_wire(&wire, 100, 0).expect("decode"), d);
        }
        let wire = distribution_to_wire(&Distribution::OneHot(100));
        let err = distribution_from_wire(&wire, 100, 2).expect_err("id out of range");
        assert_eq!((err.position, err.reason), (2, RefusalReason::MalformedQ));
        let wire = distribution_to_wire(&Distribution::Dense(vec![0.5; 10]));
        let err = distribution_from_wire(&wire, 100, 0).expect_err("wrong size");
        assert!(err.to_string().contains("4 × 100"), "{err}");
        let err =
            distribution_from_wire(&v1::Distribution { kind: None }, 100, 0).expect_err("no kind");
        assert_eq!(err.reason, RefusalReason::MalformedQ);
    }

    #[test]
    fn logprobs_round_trip_and_mismatched_alternatives_are_cut_to_the_shorter() {
        use super::{logprobs_from_wire, logprobs_to_wire};
        use tandem_runtime::sampling::TokenLogprobs;
        let l = TokenLogprobs {
            token: 7,
            logprob: -0.5,
            top: vec![(7, -0.5), (3, -1.25)],
        };
        assert_eq!(logprobs_from_wire(&logprobs_to_wire(&l)), l);
        let mut wire = logprobs_to_wire(&l);
        wire.top_logprobs.pop();
        assert_eq!(logprobs_from_wire(&wire).top, [(7, -0.5)]);
    }

    #[test]
    fn a_request_without_a_seed_gets_a_fresh_one() {
        let unseeded = v1::SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let seeds: std::collections::HashSet<u64> = (0..8)
            .map(|_| unseeded.to_runtime().expect("valid").seed)
            .collect();
        assert_eq!(seeds.len(), 8, "{seeds:?}");
        let seeded = v1::SamplingParams {
            seed: Some(5),
            ..unseeded
        };
        assert_eq!(seeded.to_runtime().expect("valid").seed, 5);
    }

    #[test]
    fn a_session_id_is_bounded_in_length_and_characters() {
        use super::{MAX_SESSION_ID_BYTES, check_session_id};
        check_session_id("gen-42").expect("the coordinator's ids");
        check_session_id("tenant.a/req:7_x").expect("punctuation that logs safely");
        for bad in [
            String::new(),
            "a".repeat(MAX_SESSION_ID_BYTES + 1),
            "gen-1\n2026-01-01 INFO forged line".into(),
            "gen\u{1b}[31m".into(),
            "gén".into(),
        ] {
            let e = check_session_id(&bad).expect_err(&bad);
            let text = e.to_string();
            assert!(text.contains("session_id"), "{text}");
            assert!(!text.contains('\n') && !text.contains('\u{1b}'), "{text}");
            assert!(text.len() < 200, "quotes a bounded part: {text}");
        }
    }

    #[test]
    fn a_cache_salt_is_bounded_and_never_quoted() {
        use super::{MAX_CACHE_SALT_BYTES, check_cache_salt};
        check_cache_salt(&[]).expect("no salt");
        check_cache_salt(&[7; MAX_CACHE_SALT_BYTES]).expect("the largest");
        let e = check_cache_salt(&[b'z'; MAX_CACHE_SALT_BYTES + 1]).expect_err("one more");
        let text = e.to_string();
        assert!(
            text.contains("cache_salt") && text.contains("at most 64"),
            "{text}"
        );
        assert!(!text.contains("zzz"), "{text}");
    }
}
