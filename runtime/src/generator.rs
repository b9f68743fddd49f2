//! The in-process speculative generator: draft and target in one process, the round loop of
//! docs/architecture.md, stop conditions and statistics. `draft_tokens == 0` (or no draft model) is plain
//! target-only decoding through the same verify path.

use serde::Serialize;

use crate::model::Model;
use crate::sampling::SamplingParams;
use crate::speculative::{Drafter, Proposal, Verifier, timed};
use crate::tokenizer::Tokenizer;
use crate::transcript::Transcript;
use crate::{Error, Result};

/// Largest block a round may draft.
pub const MAX_DRAFT_TOKENS: usize = 64;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Prompt token ids, BOS included when the model expects it.
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// K, the block drafted per round; 0 decodes with the target alone.
    pub draft_tokens: usize,
    /// Token ids that end the generation (not included in the output).
    pub stop_token_ids: Vec<u32>,
    /// Texts that end the generation (cut from the output).
    pub stop_strings: Vec<String>,
}

/// What a request is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    pub vocab_size: usize,
    /// Largest prompt plus new tokens.
    pub context: usize,
    pub max_draft_tokens: usize,
    /// Appended to the K message to say where the limit comes from (may be empty).
    pub draft_limit_source: &'static str,
}

impl GenerateRequest {
    /// Checks every field against `limits`, naming the first that is out of range.
    pub fn check(&self, limits: &RequestLimits) -> Result<()> {
        if self.prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        self.sampling.validate()?;
        if self.draft_tokens > limits.max_draft_tokens {
            return Err(Error::invalid(
                "draft_tokens",
                self.draft_tokens,
                format!(
                    "must be at most {}{}",
                    limits.max_draft_tokens, limits.draft_limit_source
                ),
            ));
        }
        let vocab_size = limits.vocab_size;
        if let Some(&token) = self.prompt.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(Error::TokenOutOfRange { token, vocab_size });
        }
        if self.prompt.len() + self.max_new_tokens > limits.context {
            return Err(Error::PromptTooLong {
                len: self.prompt.len(),
                max_new: self.max_new_tokens,
                limit: limits.context,
            });
        }
        Ok(())
    }
}

pub use crate::transcript::FinishReason;

/// Counters and timings of one generation.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct GenerationStats {
    pub generated_tokens: usize,
    pub rounds: usize,
    pub drafted: usize,
    pub accepted: usize,
    pub prefill_seconds: f64,
    pub draft_seconds: f64,
    pub target_seconds: f64,
    /// Decode wall time (every round, prefill excluded).
    pub decode_seconds: f64,
}

impl GenerationStats {
    /// Counts one round that drafted `drafted` tokens and accepted `accepted` of them.
    pub fn record_round(&mut self, drafted: usize, accepted: usize) {
        self.rounds += 1;
        self.drafted += drafted;
        self.accepted += accepted;
    }

    /// Accepted drafts over drafted tokens (α); 0 when nothing was drafted.
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// Tokens committed per round: accepted drafts plus the correction or bonus token.
    pub fn mean_accepted_length(&self) -> f64 {
        if self.rounds == 0 {
            0.0
        } else {
            (self.accepted + self.rounds) as f64 / self.rounds as f64
        }
    }

    /// Generated tokens per second of decoding (prefill excluded).
    pub fn tokens_per_second(&self) -> f64 {
        if self.decode_seconds == 0.0 {
            0.0
        } else {
            self.generated_tokens as f64 / self.decode_seconds
        }
    }
}

/// The result of one generation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Generation {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub finish_reason: FinishReason,
    pub stats: GenerationStats,
}

/// Draft and target models in one process.
#[derive(Debug)]
pub struct SpeculativeGenerator<'a> {
    target: &'a Model,
    draft: Option<&'a Model>,
    tokenizer: &'a Tokenizer,
}

impl<'a> SpeculativeGenerator<'a> {
    /// `draft` must share the target's vocabulary: check tokenizers with
    /// [`Tokenizer::check_compatible`]; this checks that the logits line up.
    pub fn new(
        target: &'a Model,
        draft: Option<&'a Model>,
        tokenizer: &'a Tokenizer,
    ) -> Result<Self> {
        if let Some(d) = draft {
            let (dv, tv) = (d.config().vocab_size, target.config().vocab_size);
            if dv != tv {
                return Err(Error::VocabularyMismatch(format!(
                    "the draft model has {dv} logits per position, the target {tv}"
                )));
            }
        }
        Ok(Self {
            target,
            draft,
            tokenizer,
        })
    }

    /// Checks a request against the models' limits.
    pub fn validate(&self, request: &GenerateRequest) -> Result<()> {
        request.check(&RequestLimits {
            vocab_size: self.target.config().vocab_size,
            context: self.context_limit(),
            max_draft_tokens: MAX_DRAFT_TOKENS,
            draft_limit_source: "",
        })
    }

    fn context_limit(&self) -> usize {
        let t = self.target.config().max_context;
        self.draft.map_or(t, |d| t.min(d.config().max_context))
    }

    /// Runs one generation; `on_tokens` sees each round's committed tokens as they come.
    pub fn generate(
        &self,
        request: &GenerateRequest,
        mut on_tokens: impl FnMut(&[u32]),
    ) -> Result<Generation> {
        self.validate(request)?;
        let k_max = if self.draft.is_some() {
            request.draft_tokens
        } else {
            0
        };
        let mut verifier = Verifier::new(self.target, request.sampling.clone());
        let mut drafter = self
            .draft
            .filter(|_| k_max > 0)
            .map(|d| Drafter::new(d, request.sampling.clone()));
        let mut stats = GenerationStats::default();
        let (prefilled, prefill_seconds) = timed(|| -> Result<()> {
            verifier.prefill(&request.prompt)?;
            if let Some(d) = drafter.as_mut() {
                d.prefill(&request.prompt)?;
            }
            Ok(())
        });
        prefilled?;
        stats.prefill_seconds = prefill_seconds;

        let mut log = request.prompt.clone();
        let mut transcript = Transcript::new(
            self.tokenizer,
            &request.stop_token_ids,
            &request.stop_strings,
            request.max_new_tokens,
        );
        let decode_start = std::time::Instant::now();
        let finish = loop {
            if let Some(finish) = transcript.finish_reason() {
                break finish;
            }
            // A round commits at most k + 1 tokens: never draft past what may be emitted.
            let k = k_max.min(transcript.remaining() - 1);
            let proposal = match drafter.as_mut().filter(|_| k > 0) {
                Some(d) => {
                    let (p, secs) = timed(|| d.propose(&log, k));
                    stats.draft_seconds += secs;
                    p?
                }
                None => Proposal::default(),
            };
            let (verified, secs) =
                timed(|| verifier.verify(&log, &proposal.tokens, &proposal.q, k));
            stats.target_seconds += secs;
            // The draft is this process's own: a refusal (a bug) still only costs the round.
            let verdict = verified?.verdict;
            stats.record_round(proposal.tokens.len(), verdict.accepted);
            let commit = transcript.commit(&verdict.committed(&proposal.tokens))?;
            log.extend_from_slice(&commit.tokens);
            on_tokens(&commit.tokens);
        };
        stats.decode_seconds = decode_start.elapsed().as_secs_f64();
        let (text, output) = transcript.into_output();
        stats.generated_tokens = output.len();
        Ok(Generation {
            text,
            token_ids: output,
            finish_reason: finish,
            stats,
        })
    }
}

/// The stop tokens a model's files declare: its EOS ids, the tokenizer's EOS, and BOS (the
/// TinyStories models end a story by emitting BOS; no model emits BOS mid-text).
pub fn default_stop_tokens(model: &Model, tokenizer: &Tokenizer) -> Vec<u32> {
    let config = model.config();
    let mut ids = config.eos_token_ids.clone();
    ids.extend(tokenizer.eos_id());
    ids.extend(config.bos_token_id.or(tokenizer.bos_id()));
    ids.sort_unstable();
    ids.dedup();
    ids
}
