//! The work of many sequences in one forward pass (continuous batching, docs/architecture.md "Batching"):
//! draft steps and verify blocks of different sessions run together, each sequence's rows
//! attending over its own cache ([`Model::forward_batch`]), each job's result what it would be
//! alone. A job that cannot run (a block past the context) fails alone, before the forward.

use super::growth::{Growth, Softmax};
use super::tree::{DraftTree, TreeVerified};
use super::{CachedSequence, Drafter, Proposal, SequenceState, Verified, Verifier};
use crate::model::{Logits, Model, llama::BatchItem};
use crate::sampling::rng::SAMPLE_DRAW;
use crate::sampling::{Distribution, draft_support, logprobs};
use crate::speculative::acceptance::{self, TreeVerdict, verify_tree};
use crate::speculative::draft_check::{BlockRules, DraftRefusal, check_block};
use crate::{Error, Result};

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
    /// The drafts' token tree (`drafts` are its tokens); none for a chain.
    pub tree: Option<&'a DraftTree>,
}

/// What verifying a block gave: a chain's verdict or a tree's.
#[derive(Debug, Clone, PartialEq)]
pub enum BlockVerified {
    Chain(Verified),
    Tree(TreeVerified),
}

/// One step of a batch of draft steps ([`Drafter::propose_batch`]).
#[derive(Debug)]
pub struct ProposeJob<'a> {
    pub drafter: &'a mut Drafter,
    /// The committed tokens so far.
    pub log: &'a [u32],
    /// Tokens to draft; 0 only catches the cache up with the log.
    pub k: usize,
    /// The nodes to add to the `k` drafts (a token tree, [`Growth`]: grown where the draft
    /// itself is least sure, no deeper than `k`); 0 for a chain.
    pub branches: usize,
    /// A chain stops before a draft (but its first) where the draft's confidence (its softmax's
    /// largest probability there, known before it draws) is below this: the rest of the chain
    /// would most likely be rejected. 0: never. Trees, and drafts under a grammar, are not cut.
    pub min_confidence: f32,
}

/// One sequence's block in a forward pass over many.
struct Feed<'a> {
    model: &'a Model,
    tokens: &'a [u32],
    seq: &'a mut CachedSequence,
    logits: Logits,
    /// A token tree's rows' parents ([`Model::forward_tree`]); none for a plain block.
    parents: Option<&'a [Option<usize>]>,
}

/// Runs every feed's tokens on its own cache, one forward pass per set of feeds that share
/// weights (on a node: all of them). Returns each feed's logits, or its own error.
fn forward_all(feeds: &mut [Feed<'_>]) -> Vec<Result<Vec<Vec<f32>>>> {
    let mut results: Vec<Option<Result<Vec<Vec<f32>>>>> = feeds
        .iter()
        .map(|f| f.model.check_block(f.tokens, &f.seq.cache).err().map(Err))
        .collect();
    while let Some(first) = results.iter().position(Option::is_none) {
        let model = feeds[first].model.clone();
        let mut members = Vec::new();
        let mut items = Vec::new();
        for (i, (f, r)) in feeds.iter_mut().zip(&results).enumerate() {
            if r.is_none() && f.model.same_weights(&model) {
                members.push(i);
                items.push(BatchItem {
                    tokens: f.tokens,
                    cache: &mut f.seq.cache,
                    logits: f.logits,
                    parents: f.parents,
                });
            }
        }
        let rows = model.forward_items(&mut items);
        drop(items);
        match rows {
            Ok(rows) => {
                for (&i, rows) in members.iter().zip(rows) {
                    let f = &mut feeds[i];
                    f.seq.tokens.extend_from_slice(f.tokens);
                    results[i] = Some(Ok(rows));
                }
            }
            Err(e) => {
                let message = e.to_string();
                for &i in &members {
                    results[i] = Some(Err(failed(&format!("a batched forward failed: {message}"))));
                }
            }
        }
    }
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(failed("a feed was not run"))))
        .collect()
}

pub(super) fn failed(what: &str) -> Error {
    Error::Candle(candle_core::Error::Msg(what.to_string()))
}

/// The result of a batch of one.
pub(super) fn one<T>(mut results: Vec<Result<T>>) -> Result<T> {
    results
        .pop()
        .unwrap_or_else(|| Err(failed("an empty batch")))
}

impl Verifier {
    /// [`Self::verify`] (or, for a job with a tree, [`Self::verify_tree`]) for the blocks of
    /// several sequences in one forward pass over all their rows (a job with `refused` set is
    /// one plain target step).
    pub fn verify_batch(jobs: &mut [VerifyJob<'_>]) -> Vec<Result<BlockVerified>> {
        let prepared: Vec<Result<Prepared>> = jobs.iter_mut().map(VerifyJob::prepare).collect();
        let mut feeds = Vec::new();
        for (job, p) in jobs.iter_mut().zip(&prepared) {
            if let Ok(p) = p {
                let SequenceState { model, seq, .. } = &mut job.verifier.0;
                let scored = p.refused.is_none() && !job.drafts.is_empty();
                feeds.push(Feed {
                    model,
                    tokens: &p.feed,
                    seq,
                    logits: if scored { Logits::All } else { Logits::Last },
                    parents: p.parents.as_deref(),
                });
            }
        }
        // One result per prepared job, in order.
        let mut rows = forward_all(&mut feeds).into_iter();
        drop(feeds);
        jobs.iter_mut()
            .zip(prepared)
            .map(|(job, p)| {
                let p = p?;
                let rows = rows.next().unwrap_or_else(|| Err(failed("no logits")))?;
                match job.tree.filter(|_| p.refused.is_none()) {
                    Some(tree) => job.finish_tree(tree, &rows).map(BlockVerified::Tree),
                    None => job.finish(p.refused, &rows),
                }
            })
            .collect()
    }
}

/// A verify job made ready for the forward pass.
struct Prepared {
    /// The tokens to feed: the log's uncached tail, then the drafts unless they were refused.
    feed: Vec<u32>,
    refused: Option<DraftRefusal>,
    /// A tree's rows' parents: its root (the log's last token), then its nodes.
    parents: Option<Vec<Option<usize>>>,
}

impl VerifyJob<'_> {
    /// Checks the block and brings the cache in step with the log: returns the tokens to feed
    /// and the refusal, if the block is refused (then only the log's tail is fed). A tree's
    /// root is the log's last token: a longer uncached tail (after a rollback) is fed first,
    /// alone, as a chain.
    fn prepare(&mut self) -> Result<Prepared> {
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
        let mut parents = None;
        if refused.is_none() {
            if let Some(tree) = self.tree {
                if feed.len() > 1 {
                    let before = &feed[..feed.len() - 1];
                    st.seq.forward(&st.model, before, Logits::Last)?;
                    feed.drain(..feed.len() - 1);
                }
                parents = Some(
                    std::iter::once(None)
                        .chain((0..tree.len()).map(|j| Some(tree.parent(j).map_or(0, |p| p + 1))))
                        .collect(),
                );
            }
            feed.extend_from_slice(self.drafts);
        }
        Ok(Prepared {
            feed,
            refused,
            parents,
        })
    }

    /// The acceptance rule on the block's logits (the last rows: one per draft scored, plus
    /// one); the cache keeps the log and the accepted drafts. A refused tree is one plain
    /// step, answered as a tree's verdict.
    fn finish(
        &mut self,
        refused: Option<DraftRefusal>,
        rows: &[Vec<f32>],
    ) -> Result<BlockVerified> {
        let st = &mut self.verifier.0;
        let (drafts, q) = match refused {
            Some(_) => (&[][..], &[][..]),
            None => (self.drafts, self.q),
        };
        let rows = &rows[rows.len() - (drafts.len() + 1)..];
        let mut context = self.log.to_vec();
        let mut p: Vec<Distribution> = Vec::with_capacity(rows.len());
        // Drafts up to the first to which p gives nothing (a greedy target's other choice, one
        // cut by top-k, one the grammar forbids), which the rule rejects for certain, drawing the
        // correction from the residual as for any rejection: the rows after it are not needed
        // (and a grammar could not follow a forbidden token into them).
        let mut scored = drafts.len();
        for (i, row) in rows.iter().enumerate() {
            p.push(st.distribution(row, &context)?);
            if let Some(&d) = drafts.get(i) {
                if p[i].prob(d) == 0.0 {
                    scored = i + 1;
                    // The bonus distribution past a certain rejection is never read.
                    p.push(p[i].clone());
                    break;
                }
                context.push(d);
            }
        }
        let (drafts, q) = (&drafts[..scored], &q[..scored]);
        let verdict = acceptance::verify(drafts, q, &p, &st.draws, self.log.len());
        st.seq.truncate(self.log.len() + verdict.accepted)?;
        let logprobs = match st.logprobs {
            Some(top) => (0..=verdict.accepted)
                .map(|i| {
                    let token = drafts.get(i).copied().filter(|_| i < verdict.accepted);
                    logprobs(&rows[i], token.unwrap_or(verdict.next), top)
                })
                .collect(),
            None => Vec::new(),
        };
        if self.tree.is_some() {
            return Ok(BlockVerified::Tree(TreeVerified {
                verdict: TreeVerdict {
                    path: Vec::new(),
                    next: verdict.next,
                },
                committed: vec![verdict.next],
                refused,
                logprobs,
            }));
        }
        Ok(BlockVerified::Chain(Verified {
            verdict,
            refused,
            logprobs,
        }))
    }

    /// The tree's acceptance rule ([`verify_tree`]) on its rows' logits (the root's, then each
    /// node's, seeing its own path); the cache keeps the log and the accepted path, as if they
    /// had been fed as a chain.
    fn finish_tree(&mut self, tree: &DraftTree, rows: &[Vec<f32>]) -> Result<TreeVerified> {
        let st = &mut self.verifier.0;
        let log = self.log;
        let mut p = Vec::with_capacity(tree.len() + 1);
        p.push(st.distribution(&rows[0], log)?);
        for (j, row) in rows[1..].iter().enumerate() {
            let context = [log, &tree.path_tokens(j)[..]].concat();
            p.push(st.distribution(row, &context)?);
        }
        let verdict = verify_tree(tree, self.q, &p, &st.draws, log.len());
        st.seq.cache.keep_rows(log.len(), &verdict.path)?;
        let mut committed: Vec<u32> = verdict.path.iter().map(|&n| tree.tokens()[n]).collect();
        st.seq.tokens.truncate(log.len());
        st.seq.tokens.extend_from_slice(&committed);
        committed.push(verdict.next);
        // Committed token i was scored on the row of the path's node before it (the root's row
        // for the first).
        let logprobs = match st.logprobs {
            Some(top) => (committed.iter().enumerate())
                .map(|(i, &token)| {
                    let row = if i == 0 { 0 } else { verdict.path[i - 1] + 1 };
                    logprobs(&rows[row], token, top)
                })
                .collect(),
            None => Vec::new(),
        };
        Ok(TreeVerified {
            verdict,
            committed,
            refused: None,
            logprobs,
        })
    }
}

/// Where one draft step stands in a batch.
struct Drafting {
    /// The committed tokens and the drafts so far.
    context: Vec<u32>,
    /// What the next forward feeds: the log's uncached tail, then each draft, or a tree's next
    /// rows (their parents given where they are tree rows, each row's logits wanted).
    feed: Vec<u32>,
    parents: Option<Vec<Option<usize>>>,
    logits: Logits,
    proposal: Proposal,
    /// Tokens still to draft (a tree: 1 until it is grown); a catch-up step (k = 0) feeds once
    /// and samples nothing.
    left: usize,
    catch_up: bool,
    error: Option<Error>,
    /// A token tree being grown (a step with branches).
    tree: Option<Growth>,
}

impl Drafter {
    /// [`Self::propose`] for several sequences: each forward pass feeds every step that still
    /// drafts (its first the log's uncached tail, then one token each, or a tree's next rows),
    /// so that K draft tokens of many sessions cost K passes, not K per session.
    pub fn propose_batch(jobs: &mut [ProposeJob<'_>]) -> Vec<Result<Proposal>> {
        let mut steps: Vec<Drafting> = jobs.iter_mut().map(ProposeJob::start).collect();
        loop {
            let mut feeds = Vec::new();
            let mut fed = Vec::new();
            for (i, (job, step)) in jobs.iter_mut().zip(&steps).enumerate() {
                if step.error.is_none() && (step.left > 0 || step.catch_up) {
                    let SequenceState { model, seq, .. } = &mut job.drafter.0;
                    feeds.push(Feed {
                        model,
                        tokens: &step.feed,
                        seq,
                        logits: step.logits,
                        parents: step.parents.as_deref(),
                    });
                    fed.push(i);
                }
            }
            if feeds.is_empty() {
                break;
            }
            let rows = forward_all(&mut feeds);
            drop(feeds);
            for (i, rows) in fed.into_iter().zip(rows) {
                let step = &mut steps[i];
                match rows.and_then(|rows| jobs[i].sample(step, &rows)) {
                    Ok(()) => {}
                    Err(e) => step.error = Some(e),
                }
            }
        }
        steps
            .into_iter()
            .zip(jobs.iter_mut())
            .map(|(s, job)| job.finish(s))
            .collect()
    }
}

impl SequenceState {
    /// [`Self::prefill_chunk`] of several sequences in one forward pass (a node's sessions that
    /// opened together): each feeds the next part of its prompt, together at most `budget`
    /// tokens (at least one), the sequences with the least left to feed first (a short prompt
    /// opened beside a long one is not held back a pass per chunk of the long one). True for
    /// each once its prefill is complete; false for one still to feed (the budget spent before
    /// it, or more of its prompt left).
    pub fn prefill_batch(
        items: &mut [(&mut SequenceState, &[u32])],
        budget: usize,
    ) -> Vec<Result<bool>> {
        let unfed: Vec<Result<std::ops::Range<usize>>> = items
            .iter_mut()
            .map(|(st, prompt)| st.unfed(prompt))
            .collect();
        let mut order: Vec<usize> = (0..items.len())
            .filter(|&i| unfed[i].as_ref().is_ok_and(|r| !r.is_empty()))
            .collect();
        order.sort_by_key(|&i| unfed[i].as_ref().map_or(0, |r| r.len()));
        let mut take = vec![0; items.len()];
        let mut left = budget.max(1);
        for i in order {
            let len = unfed[i].as_ref().map_or(0, |r| r.len());
            take[i] = len.min(left);
            left -= take[i];
        }
        /// A sequence's answer without a forward, or the chunk it feeds (and whether that
        /// completes its prefill).
        enum Plan {
            Answer(Result<bool>),
            Feed(Vec<u32>, bool),
        }
        let plans: Vec<Plan> = unfed
            .into_iter()
            .zip(take)
            .zip(items.iter())
            .map(|((unfed, take), (_, prompt))| match unfed {
                Err(e) => Plan::Answer(Err(e)),
                Ok(unfed) if unfed.is_empty() => Plan::Answer(Ok(true)),
                Ok(_) if take == 0 => Plan::Answer(Ok(false)),
                Ok(unfed) => {
                    let end = unfed.start + take;
                    Plan::Feed(prompt[unfed.start..end].to_vec(), end == unfed.end)
                }
            })
            .collect();
        let mut feeds = Vec::new();
        for ((st, _), plan) in items.iter_mut().zip(&plans) {
            if let Plan::Feed(tokens, _) = plan {
                let SequenceState { model, seq, .. } = &mut **st;
                feeds.push(Feed {
                    model,
                    tokens,
                    seq,
                    logits: Logits::Last,
                    parents: None,
                });
            }
        }
        let mut fed = forward_all(&mut feeds).into_iter();
        drop(feeds);
        plans
            .into_iter()
            .map(|plan| match plan {
                Plan::Answer(answer) => answer,
                Plan::Feed(_, complete) => {
                    fed.next().expect("one result per feed").map(|_| complete)
                }
            })
            .collect()
    }
}

impl ProposeJob<'_> {
    /// Brings the cache in step with the log and says what the first forward feeds.
    fn start(&mut self) -> Drafting {
        let st = &self.drafter.0;
        // Trees grow deep where the model takes them and no grammar must follow each branch.
        let deep = st.model.takes_trees() && st.constraint.is_none();
        let mut step = Drafting {
            context: self.log.to_vec(),
            feed: Vec::new(),
            parents: None,
            logits: Logits::Last,
            proposal: Proposal {
                tokens: Vec::with_capacity(self.k),
                q: Vec::with_capacity(self.k),
                parents: Vec::new(),
                confidence: Vec::with_capacity(self.k),
            },
            left: self.k,
            catch_up: false,
            error: None,
            tree: (self.k > 0 && self.branches > 0)
                .then(|| Growth::new(self.k, self.branches, deep, st.params.is_greedy())),
        };
        match self.drafter.0.seq.sync(self.log) {
            Ok(feed) if self.k > 0 => step.feed = feed.to_vec(),
            // A catch-up feeds all but the log's last token (which the next proposal feeds),
            // if there is anything before it.
            Ok(feed) => {
                if let Some((_, behind)) = feed.split_last().filter(|(_, b)| !b.is_empty()) {
                    step.feed = behind.to_vec();
                    step.catch_up = true;
                }
            }
            Err(e) => step.error = Some(e),
        }
        step
    }

    /// Samples the next draft from the last forward's logits (a tree: offers the fed nodes'
    /// children and plans its next rows).
    fn sample(&mut self, step: &mut Drafting, rows: &[Vec<f32>]) -> Result<()> {
        if step.catch_up {
            step.catch_up = false;
            return Ok(());
        }
        let st = &mut self.drafter.0;
        if let Some(tree) = step.tree.as_mut() {
            let fed = tree.fed_paths();
            if fed.is_empty() {
                let row = rows.last().ok_or_else(|| failed("no logits"))?;
                let drawn = draw(st, row, self.log)?;
                tree.offer(None, row, Some(drawn));
            } else {
                for ((node, path), row) in fed.into_iter().zip(rows) {
                    let drawn = if tree.on_chain(node) {
                        Some(draw(st, row, &[self.log, &path[..]].concat())?)
                    } else {
                        None
                    };
                    tree.offer(Some(node), row, drawn);
                }
            }
            match tree.next_pass() {
                Some(tokens) => {
                    step.feed = tokens;
                    step.parents = tree.row_parents().map(<[_]>::to_vec);
                    step.logits = Logits::All;
                }
                None => step.left = 0,
            }
            return Ok(());
        }
        let row = rows.last().ok_or_else(|| failed("no logits"))?;
        // The draft's confidence here is its softmax's largest probability, known before it
        // draws: where the chain stops depends on the drafts before, never on this draw (a stop
        // that looked at the draw would send only sure draws, under a q that holds the unsure
        // ones too). Under a grammar the raw logits say nothing of it: no stop.
        let confidence = st.constraint.is_none().then(|| Softmax::of(row).top());
        if !step.proposal.tokens.is_empty() && confidence.is_some_and(|c| c < self.min_confidence) {
            // The chain ends here (the cache holds every draft sent, as after a step that
            // drafted one fewer and fed its last).
            step.left = 0;
            return Ok(());
        }
        let (token, q) = draw(st, row, &step.context)?;
        step.proposal.confidence.extend(confidence);
        step.context.push(token);
        step.proposal.tokens.push(token);
        step.proposal.q.push(q);
        step.feed = vec![token];
        step.left -= 1;
        Ok(())
    }

    /// The step's proposal. A tree's rows leave the draft's cache but for its chain (the
    /// draft's own choices, the likeliest path), kept as if fed one by one; all of them on an
    /// error.
    fn finish(&mut self, step: Drafting) -> Result<Proposal> {
        let Some(tree) = step.tree else {
            return step.error.map_or(Ok(step.proposal), Err);
        };
        let seq = &mut self.drafter.0.seq;
        let base = self.log.len();
        if let Some(e) = step.error {
            if seq.tokens.len() > base {
                seq.truncate(base)?;
            }
            return Err(e);
        }
        let (rows, tokens): (Vec<usize>, Vec<u32>) = tree.fed_chain().into_iter().unzip();
        if rows.iter().enumerate().all(|(i, &r)| i == r) {
            // The chain's rows came first (always where only the chain grows): nothing moves.
            seq.truncate(base + rows.len())?;
        } else {
            seq.cache.keep_rows(base, &rows)?;
            seq.tokens.truncate(base);
            seq.tokens.extend_from_slice(&tokens);
        }
        Ok(tree.proposal())
    }
}

/// The draft's choice at a row of its logits after `context`, and the distribution it was
/// drawn from.
fn draw(st: &mut SequenceState, row: &[f32], context: &[u32]) -> Result<(u32, Distribution)> {
    let q = draft_support(st.distribution(row, context)?);
    let token = q.sample(st.draws.uniform(context.len(), SAMPLE_DRAW));
    Ok((token, q))
}
