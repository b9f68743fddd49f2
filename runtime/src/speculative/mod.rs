//! Per-sequence building blocks of speculative decoding, shared by the in-process generator and
//! the nodes: a [`Drafter`] proposes K tokens with their distributions q, a [`Verifier`] scores
//! them in one forward pass and applies the acceptance rule. Both keep a KV cache in step with a
//! canonical token log they are handed: what they cached beyond the log's common prefix is
//! truncated, never recomputed. The acceptance rule itself is [`acceptance`], and what a
//! verifier refuses of a draft's block is [`draft_check`].

pub mod acceptance;
pub mod draft_check;
pub mod tree;

use std::time::Instant;

use crate::constraint::Constraint;
use crate::kv_cache::{KvCache, KvPrefix};
use crate::model::{Logits, Model};
use crate::sampling::rng::Draws;
use crate::sampling::{Distribution, SamplingParams, TokenLogprobs, distribution};
use crate::speculative::acceptance::Verdict;
use crate::speculative::draft_check::DraftRefusal;
use crate::{Error, Result};

mod batch;
mod growth;

use batch::one;
pub use batch::{BlockVerified, ProposeJob, VerifyJob};

/// Stream separation so that the draft's and the target's draws never coincide.
const DRAFT_STREAM: u64 = 0x5eed_d4af_7000_0001;
const TARGET_STREAM: u64 = 0x5eed_7a46_e700_0002;

/// A model's cache with the tokens it holds (`tokens.len() == cache.len()`).
#[derive(Debug)]
struct CachedSequence {
    cache: KvCache,
    tokens: Vec<u32>,
}

impl CachedSequence {
    /// Truncates to the longest prefix shared with `log`, keeping at least one token of `log`
    /// uncached so that the next forward yields its logits. Returns the tokens to feed.
    fn sync<'a>(&mut self, log: &'a [u32]) -> Result<&'a [u32]> {
        let common =
            crate::token_log::common_len(&self.tokens, log).min(log.len().saturating_sub(1));
        self.cache.truncate(common)?;
        self.tokens.truncate(common);
        Ok(&log[common..])
    }

    fn forward(&mut self, model: &Model, tokens: &[u32], logits: Logits) -> Result<Vec<Vec<f32>>> {
        let rows = model.forward(tokens, &mut self.cache, logits)?;
        self.tokens.extend_from_slice(tokens);
        Ok(rows)
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        self.cache.truncate(len)?;
        self.tokens.truncate(len);
        Ok(())
    }
}

/// What each side of a sequence holds: its model, cache, sampling parameters and draws; a
/// [`Drafter`] and a [`Verifier`] are one each, and share these methods.
#[derive(Debug)]
pub struct SequenceState {
    model: Model,
    seq: CachedSequence,
    params: SamplingParams,
    draws: Draws,
    /// A verifier's: report each committed token's log-probability and this many alternatives.
    logprobs: Option<usize>,
    /// The grammar the output follows, if any: p (or q) is masked to what it allows.
    constraint: Option<Constraint>,
}

impl SequenceState {
    fn new(model: &Model, params: SamplingParams, stream: u64) -> Self {
        Self {
            model: model.clone(),
            seq: CachedSequence {
                cache: model.new_cache(),
                tokens: Vec::new(),
            },
            draws: Draws::new(params.seed, stream),
            params,
            logprobs: None,
            constraint: None,
        }
    }

    /// Restricts the output to `constraint`'s grammar from here on (its state follows the log it
    /// is handed, from the position it was compiled for).
    pub fn constrain(&mut self, constraint: Constraint) {
        self.constraint = Some(constraint);
    }

    /// The sampling distribution at the position after `context`: masked to the grammar's
    /// tokens there when the sequence has one (its state brought to `context` first).
    fn distribution(&mut self, logits: &[f32], context: &[u32]) -> Result<Distribution> {
        let Some(c) = self.constraint.as_mut() else {
            return distribution(logits, &self.params, context);
        };
        c.sync(context)?;
        let mut masked = logits.to_vec();
        c.mask()?.apply(&mut masked);
        distribution(&masked, &self.params, context)
    }

    /// Feeds all but the last prompt token, so that the first step feeds exactly one token.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<()> {
        while !self.prefill_chunk(prompt, usize::MAX)? {}
        Ok(())
    }

    /// One chunk of [`Self::prefill`], at most `max` tokens (chunked prefill: a node runs other
    /// sessions' work between chunks); true once the prefill is complete.
    pub fn prefill_chunk(&mut self, prompt: &[u32], max: usize) -> Result<bool> {
        Self::prefill_batch(&mut [(self, prompt)], max)
            .pop()
            .expect("one result per sequence")
    }

    /// The part of `prompt`'s head (all but its last token) the cache has yet to be fed, once
    /// the cache is brought in step with it; empty when the prefill is complete.
    fn unfed(&mut self, prompt: &[u32]) -> Result<std::ops::Range<usize>> {
        if prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let limit = self.model.config().max_context;
        if prompt.len() > limit {
            return Err(Error::ContextFull {
                len: prompt.len(),
                limit,
            });
        }
        self.seq.sync(prompt)?;
        let head = prompt.len() - 1;
        Ok(self.seq.tokens.len().min(head)..head)
    }

    /// Caps the positions this sequence's cache may hold ([`KvCache::limit`]).
    pub fn limit_cache(&mut self, max_len: usize) {
        self.seq.cache.limit(max_len);
    }

    /// Every position this sequence holds, as a prefix other sequences of the same model can
    /// start with: its shared prefix's segments, and one more with a copy of its own positions.
    pub fn share_prefix(&self) -> Result<KvPrefix> {
        let shared = self.seq.cache.prefix().map_or(0, KvPrefix::len);
        self.seq.cache.share(&self.seq.tokens[shared..])
    }

    /// Every position this sequence holds made a shared prefix it goes on from
    /// ([`KvCache::publish`]): live sequences with the same start share them.
    pub fn publish(&mut self) -> Result<KvPrefix> {
        let shared = self.shared_tokens();
        self.seq.cache.publish(&self.seq.tokens[shared..])
    }

    /// Starts this sequence, empty, with `prefix`'s positions (shared, not copied): its prefill
    /// computes only the prompt's tokens after them, or from the first that differs.
    pub fn start_with(&mut self, prefix: &KvPrefix) -> Result<()> {
        if !self.seq.tokens.is_empty() {
            return Err(Error::SharedPrefix(
                "only an empty sequence starts with a shared prefix".into(),
            ));
        }
        self.seq.cache.attach(prefix)?;
        self.seq.tokens = prefix.tokens();
        Ok(())
    }

    /// Every position this sequence holds, as a prefix, its cache's storage kept without a copy
    /// ([`KvCache::into_prefix`]): what it leaves to a prefix cache when it ends.
    pub fn into_prefix(self) -> Option<KvPrefix> {
        let shared = self.seq.cache.prefix().map_or(0, KvPrefix::len);
        let tokens = self.seq.tokens[shared..].to_vec();
        self.seq.cache.into_prefix(&tokens)
    }

    /// The positions of this sequence's shared prefix.
    pub fn shared_tokens(&self) -> usize {
        self.seq.cache.prefix().map_or(0, KvPrefix::len)
    }

    /// Bytes held by this sequence's cache.
    pub fn cache_bytes(&self) -> usize {
        self.seq.cache.bytes()
    }

    /// Positions in this sequence's cache.
    pub fn cached_tokens(&self) -> usize {
        self.seq.cache.len()
    }
}

/// The shared methods of a [`Drafter`] or a [`Verifier`] are those of its [`SequenceState`].
macro_rules! sequence_side {
    ($side:ty) => {
        impl std::ops::Deref for $side {
            type Target = SequenceState;
            fn deref(&self) -> &SequenceState {
                &self.0
            }
        }

        impl std::ops::DerefMut for $side {
            fn deref_mut(&mut self) -> &mut SequenceState {
                &mut self.0
            }
        }

        impl $side {
            /// [`SequenceState::into_prefix`].
            pub fn into_prefix(self) -> Option<KvPrefix> {
                self.0.into_prefix()
            }
        }
    };
}
sequence_side!(Drafter);
sequence_side!(Verifier);

/// K drafted tokens and the distributions they were sampled from.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    pub q: Vec<Distribution>,
    /// A token tree's parents in wire form ([`tree::DraftTree::new`]: 0 for a child of the
    /// committed tokens, j + 1 for a child of draft j); empty for a chain.
    pub parents: Vec<u32>,
    /// A chain's: the draft's confidence at each draft (its softmax's largest probability
    /// there), what the coordinator learns a stop from ([`ProposeJob::min_confidence`]); empty
    /// for a tree and under a grammar.
    pub confidence: Vec<f32>,
}

/// The draft side of one sequence.
#[derive(Debug)]
pub struct Drafter(SequenceState);

impl Drafter {
    pub fn new(model: &Model, params: SamplingParams) -> Self {
        Self(SequenceState::new(model, params, DRAFT_STREAM))
    }

    /// Proposes `k` tokens continuing `log`, the committed tokens so far. `k == 0` only catches
    /// the cache up with `log` (all but its last token, which the next proposal feeds), so that
    /// a draft left idle for many rounds drafts at once when asked again.
    pub fn propose(&mut self, log: &[u32], k: usize) -> Result<Proposal> {
        let mut jobs = [ProposeJob {
            drafter: self,
            log,
            k,
            branches: 0,
            min_confidence: 0.0,
        }];
        one(Self::propose_batch(&mut jobs))
    }
}

/// A verified block: the verdict, and why the draft's block was refused when it was (the verdict
/// is then one plain target step: nothing accepted, `next` sampled from p).
#[derive(Debug, Clone, PartialEq)]
pub struct Verified {
    pub verdict: Verdict,
    pub refused: Option<DraftRefusal>,
    /// With [`Verifier::report_logprobs`]: one per committed token (the accepted drafts, then
    /// the next token), from the target's logits.
    pub logprobs: Vec<TokenLogprobs>,
}

/// The target side of one sequence.
#[derive(Debug)]
pub struct Verifier(SequenceState);

impl Verifier {
    pub fn new(model: &Model, params: SamplingParams) -> Self {
        Self(SequenceState::new(model, params, TARGET_STREAM))
    }

    /// Reports each committed token's log-probability and its `top` alternatives
    /// ([`crate::sampling::logprobs`]); `None` (the default) reports none.
    pub fn report_logprobs(&mut self, top: Option<usize>) {
        self.0.logprobs = top;
    }

    /// Checks the drafted block ([`crate::speculative::draft_check::check_block`]: at most `max_drafts`,
    /// valid q) and scores `[uncached tail of log, drafts…]` in one forward pass with the acceptance rule. A block
    /// that fails the checks is not scored: the round is one plain target step and the refusal
    /// says why. Afterwards the cache holds the log plus the accepted drafts: everything
    /// committed except the returned next token.
    pub fn verify(
        &mut self,
        log: &[u32],
        drafts: &[u32],
        q: &[Distribution],
        max_drafts: usize,
    ) -> Result<Verified> {
        let mut jobs = [VerifyJob {
            verifier: self,
            log,
            drafts,
            q,
            max_drafts,
            refused: None,
            tree: None,
        }];
        match one(Self::verify_batch(&mut jobs))? {
            BlockVerified::Chain(verified) => Ok(verified),
            BlockVerified::Tree(_) => Err(batch::failed("a chain was verified as a tree")),
        }
    }
}

/// Wall-clock seconds of a closure, with its result.
pub(crate) fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let start = Instant::now();
    let out = f();
    (out, start.elapsed().as_secs_f64())
}
