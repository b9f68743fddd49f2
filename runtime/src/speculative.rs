//! Per-sequence building blocks of speculative decoding, shared by the in-process generator and
//! the nodes: a [`Drafter`] proposes K tokens with their distributions q, a [`Verifier`] scores
//! them in one forward pass and applies the acceptance rule. Both keep a KV cache in step with a
//! canonical token log they are handed: what they cached beyond the log's common prefix is
//! truncated, never recomputed.

use std::time::Instant;

use crate::acceptance::{self, Verdict};
use crate::draft_check::{BlockRules, DraftRefusal, check_block};
use crate::kv_cache::KvCache;
use crate::model::{Logits, Model};
use crate::rng::{Draws, SAMPLE_DRAW};
use crate::sampling::{Distribution, SamplingParams, distribution, draft_support};
use crate::{Error, Result};

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
        let common = self
            .tokens
            .iter()
            .zip(log)
            .take_while(|(a, b)| a == b)
            .count()
            .min(log.len().saturating_sub(1));
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

/// What each side of a sequence holds: its model, cache, sampling parameters and draws.
#[derive(Debug)]
struct SequenceState {
    model: Model,
    seq: CachedSequence,
    params: SamplingParams,
    draws: Draws,
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
        }
    }

    /// Feeds all but the last prompt token, so that the first step feeds exactly one token.
    fn prefill(&mut self, prompt: &[u32]) -> Result<()> {
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
        let head = &prompt[..prompt.len() - 1];
        self.seq.sync(prompt)?;
        if self.seq.tokens.len() < head.len() {
            let rest = head[self.seq.tokens.len()..].to_vec();
            self.seq.forward(&self.model, &rest, Logits::Last)?;
        }
        Ok(())
    }
}

/// K drafted tokens and the distributions they were sampled from.
#[derive(Debug, Clone, PartialEq)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    pub q: Vec<Distribution>,
}

/// The draft side of one sequence.
#[derive(Debug)]
pub struct Drafter(SequenceState);

impl Drafter {
    pub fn new(model: &Model, params: SamplingParams) -> Self {
        Self(SequenceState::new(model, params, DRAFT_STREAM))
    }

    pub fn prefill(&mut self, prompt: &[u32]) -> Result<()> {
        self.0.prefill(prompt)
    }

    /// Proposes `k` tokens continuing `log`, the committed tokens so far. `k == 0` only catches
    /// the cache up with `log` (all but its last token, which the next proposal feeds), so that
    /// a draft left idle for many rounds drafts at once when asked again.
    pub fn propose(&mut self, log: &[u32], k: usize) -> Result<Proposal> {
        let mut context = log.to_vec();
        let st = &mut self.0;
        let mut feed = st.seq.sync(log)?.to_vec();
        let mut proposal = Proposal {
            tokens: Vec::with_capacity(k),
            q: Vec::with_capacity(k),
        };
        if k == 0 {
            if let Some((_, behind)) = feed.split_last().filter(|(_, b)| !b.is_empty()) {
                st.seq.forward(&st.model, behind, Logits::Last)?;
            }
            return Ok(proposal);
        }
        for _ in 0..k {
            let rows = st.seq.forward(&st.model, &feed, Logits::Last)?;
            let q = draft_support(distribution(&rows[0], &st.params, &context)?);
            let token = q.sample(st.draws.uniform(context.len(), SAMPLE_DRAW));
            context.push(token);
            proposal.tokens.push(token);
            proposal.q.push(q);
            feed = vec![token];
        }
        Ok(proposal)
    }

    /// Bytes held by this sequence's cache.
    pub fn cache_bytes(&self) -> usize {
        self.0.seq.cache.bytes()
    }

    /// Positions in this sequence's cache.
    pub fn cached_tokens(&self) -> usize {
        self.0.seq.cache.len()
    }
}

/// A verified block: the verdict, and why the draft's block was refused when it was (the verdict
/// is then one plain target step: nothing accepted, `next` sampled from p).
#[derive(Debug, Clone, PartialEq)]
pub struct Verified {
    pub verdict: Verdict,
    pub refused: Option<DraftRefusal>,
}

/// The target side of one sequence.
#[derive(Debug)]
pub struct Verifier(SequenceState);

impl Verifier {
    pub fn new(model: &Model, params: SamplingParams) -> Self {
        Self(SequenceState::new(model, params, TARGET_STREAM))
    }

    pub fn prefill(&mut self, prompt: &[u32]) -> Result<()> {
        self.0.prefill(prompt)
    }

    /// Checks the drafted block ([`check_block`]: at most `max_drafts`, valid q) and scores
    /// `[uncached tail of log, drafts…]` in one forward pass with the acceptance rule. A block
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
        }];
        one(Self::verify_batch(&mut jobs))
    }

    /// One plain target step in place of a block refused before it reached the verifier (one
    /// that did not decode).
    pub fn step(&mut self, log: &[u32], refusal: DraftRefusal) -> Result<Verified> {
        let mut jobs = [VerifyJob {
            verifier: self,
            log,
            drafts: &[],
            q: &[],
            max_drafts: 0,
            refused: Some(refusal),
        }];
        one(Self::verify_batch(&mut jobs))
    }

    /// [`Self::verify`] (or [`Self::step`]) for the blocks of several sequences in one forward
    /// pass over all their rows. Each job's result is what it would be alone: a job that
    /// cannot run (its block over the context) fails alone, before the forward.
    pub fn verify_batch(jobs: &mut [VerifyJob<'_>]) -> Vec<Result<Verified>> {
        let mut results: Vec<Option<Result<Verified>>> = jobs.iter().map(|_| None).collect();
        // The block each job feeds, and the drafts it scores (none where it was refused).
        let mut blocks: Vec<Option<(Vec<u32>, Option<DraftRefusal>)>> = Vec::new();
        for (job, result) in jobs.iter_mut().zip(&mut results) {
            let prepared = job.prepare();
            blocks.push(match prepared {
                Ok(b) => Some(b),
                Err(e) => {
                    *result = Some(Err(e));
                    None
                }
            });
        }
        // All sessions of a node share one model; a job on other weights runs in its own batch.
        while let Some(first) = blocks.iter().position(Option::is_some) {
            let model = jobs[first].verifier.0.model.clone();
            let mut members = Vec::new();
            let mut items: Vec<(&[u32], &mut KvCache, Logits)> = Vec::new();
            for (i, (job, block)) in jobs.iter_mut().zip(&mut blocks).enumerate() {
                if block.is_none() || !job.verifier.0.model.same_weights(&model) {
                    continue;
                }
                let (feed, refused) = block.take().expect("prepared");
                let logits = if refused.is_some() || job.drafts.is_empty() {
                    Logits::Last
                } else {
                    Logits::All
                };
                members.push((i, feed, refused));
                items.push((&[], &mut job.verifier.0.seq.cache, logits));
            }
            for (item, (_, feed, _)) in items.iter_mut().zip(&members) {
                item.0 = feed.as_slice();
            }
            let rows = model.forward_batch(&mut items);
            drop(items);
            match rows {
                Ok(rows) => {
                    for ((i, feed, refused), rows) in members.into_iter().zip(rows) {
                        results[i] = Some(jobs[i].finish(&feed, refused, &rows));
                    }
                }
                Err(e) => {
                    let message = e.to_string();
                    for (i, _, _) in members {
                        results[i] = Some(Err(Error::Candle(candle_core::Error::Msg(
                            format!("a batched forward failed: {message}"),
                        ))));
                    }
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.expect("every job answered"))
            .collect()
    }

    /// Bytes held by this sequence's cache.
    pub fn cache_bytes(&self) -> usize {
        self.0.seq.cache.bytes()
    }
}

/// One block of a batch of verifies ([`Verifier::verify_batch`]).
#[derive(Debug)]
pub struct VerifyJob<'a> {
    pub verifier: &'a mut Verifier,
    /// The committed tokens so far.
    pub log: &'a [u32],
    pub drafts: &'a [u32],
    pub q: &'a [Distribution],
    /// The most drafts the block may hold.
    pub max_drafts: usize,
    /// Set when the block was refused before it reached the verifier (its q did not decode):
    /// the job is one plain target step.
    pub refused: Option<DraftRefusal>,
}

impl VerifyJob<'_> {
    /// Checks the block and brings the cache in step with the log: returns the tokens to feed
    /// and the refusal, if the block is refused (then only the log's tail is fed).
    fn prepare(&mut self) -> Result<(Vec<u32>, Option<DraftRefusal>)> {
        let st = &mut self.verifier.0;
        let rules = BlockRules {
            vocab_size: st.model.config().vocab_size,
            max_drafts: self.max_drafts,
            greedy: st.params.is_greedy(),
        };
        let refused = match self.refused.take() {
            Some(r) => Some(r),
            None => check_block(self.drafts, self.q, &rules).err(),
        };
        let mut feed = st.seq.sync(self.log)?.to_vec();
        if refused.is_none() {
            feed.extend_from_slice(self.drafts);
        }
        st.model.check_block(&feed, &st.seq.cache)?;
        Ok((feed, refused))
    }

    /// The acceptance rule on the logits of the block `feed` (the last rows: one per draft
    /// scored, plus one); the cache keeps the log and the accepted drafts.
    fn finish(
        &mut self,
        feed: &[u32],
        refused: Option<DraftRefusal>,
        rows: &[Vec<f32>],
    ) -> Result<Verified> {
        let st = &mut self.verifier.0;
        st.seq.tokens.extend_from_slice(feed);
        let (drafts, q) = match refused {
            Some(_) => (&[][..], &[][..]),
            None => (self.drafts, self.q),
        };
        let rows = &rows[rows.len() - (drafts.len() + 1)..];
        let mut context = self.log.to_vec();
        let mut p = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter().enumerate() {
            p.push(distribution(row, &st.params, &context)?);
            if let Some(&d) = drafts.get(i) {
                context.push(d);
            }
        }
        let verdict = acceptance::verify(drafts, q, &p, &st.draws, self.log.len());
        st.seq.truncate(self.log.len() + verdict.accepted)?;
        Ok(Verified { verdict, refused })
    }
}

/// The result of a batch of one.
fn one(mut results: Vec<Result<Verified>>) -> Result<Verified> {
    results.pop().unwrap_or_else(|| {
        Err(Error::Candle(candle_core::Error::Msg(
            "an empty batch".to_string(),
        )))
    })
}

/// Wall-clock seconds of a closure, with its result.
pub(crate) fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let start = Instant::now();
    let out = f();
    (out, start.elapsed().as_secs_f64())
}
