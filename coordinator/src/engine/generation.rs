//! One generation's rounds (docs/architecture.md "Data flow of one round"). A [`Generation`]
//! owns one request's state: its sessions on both nodes, the canonical log, the policy that
//! chooses each round's drafter and K, the transcript. It opens both sessions ([`open`]), then
//! runs each round as five phases:
//!
//! 1. [`Generation::plan`]: the drafter and K, the block's shape;
//! 2. [`Generation::propose`]: the drafter's block (the draft-node's model, n-gram lookup, or a
//!    block the draft-node drafted during the last verify);
//! 3. [`Generation::verify`]: the target's verdict on it ([`verify`]), the draft-node drafting
//!    the next block meanwhile;
//! 4. [`Generation::learn`]: the policy learns the round's costs and acceptance, the
//!    statistics and metrics record them;
//! 5. [`Generation::commit`]: the transcript, the log and the client take the committed tokens.
//!
//! Losing the draft costs speed, not output: the generation goes on target-only. A lost target
//! session is rebuilt by replaying the log. A draft's block is never trusted: the target-node
//! refuses one that fails its checks and runs the round as a plain target step; more drafts
//! than asked for are refused here. After [`MAX_REFUSED_BLOCKS`] refused blocks the draft is
//! detached from the generation, which goes on target-only. A bad draft never fails a request.

mod committed;
mod open;
mod verify;

pub use open::DRAFT_GRACE;

use std::time::Instant;

use crate::error::{Error, Result};
use tandem_runtime::sampling::TokenLogprobs;
use tandem_runtime::{Constraint, DraftRefusal, FinishReason, RefusalReason, TokenLog, Transcript};
use tracing::Instrument;

use super::{CommitSink, Engine, Job, MAX_REFUSED_BLOCKS, Outcome, Stats};
use crate::drafting::block::{Ask, DraftBlock, StepFailure, chain_len};
use crate::drafting::ngram::NgramOffer;
use crate::drafting::policy::{KPolicy, RoundCosts, RoundPlan};
use crate::drafting::shadow::{Shadow, shadow_len};
use crate::drafting::{DrafterKind, Drafters};
use crate::nodes::links::{NodeSession, Target};
use crate::nodes::replicas::Lease;
use crate::nodes::steps::TargetVerdict;
use committed::Committed;

/// One generation: its sessions, its log, its policy and its transcript.
#[derive(Debug)]
pub struct Generation<'e> {
    engine: &'e Engine,
    job: &'e Job,
    target: NodeSession<Target>,
    /// The replicas' counts of this generation (the target's, the draft's), given back at its end.
    _leases: (Lease, Option<Lease>),
    /// The draft-node's model (while it is attached) and n-gram lookup.
    drafters: Drafters,
    policy: KPolicy,
    /// The load the generation ran at, summed over its rounds (and its start), and their count.
    load: (usize, usize),
    log: TokenLog,
    grammar: Option<Constraint>,
    transcript: Transcript<'e>,
    shadow: Shadow,
    /// Drafts the draft-node accepts per step (0 without one).
    max_draft: usize,
    logprobs: Vec<TokenLogprobs>,
    stats: Stats,
    prefill_start: Instant,
    decode_start: Instant,
    last_commit: Option<Instant>,
}

/// A round as planned: who drafts, how many, of what shape.
#[derive(Debug)]
struct Round {
    plan: RoundPlan,
    /// Sibling leaves beside the chain (a token tree).
    branches: usize,
    /// Where the draft's chain stops.
    min_confidence: f32,
    /// Whether the draft-node computed in the background as the round began.
    beside_background: bool,
    start: Instant,
    span: tracing::Span,
}

/// A round's block as verified.
#[derive(Debug)]
struct Verified {
    verdict: TargetVerdict,
    /// What the verdict committed, and the block's chain length.
    tree: Committed,
    chain: usize,
    /// The verify's own time and the round's, from its plan to the verdict.
    verify_wall: f64,
    round_wall: f64,
    /// The block drafted during the verify: its length (K + 1) and what came of it.
    drafted_next: Option<(usize, std::result::Result<DraftBlock, StepFailure>)>,
}

impl<'e> Generation<'e> {
    /// Runs the rounds until the transcript finishes (or a round fails, or the client leaves),
    /// then closes both sessions.
    pub(super) async fn run(mut self, sink: &mut impl CommitSink) -> Result<Outcome> {
        let result = loop {
            if let Some(finish) = self.transcript.finish_reason() {
                break Ok(finish);
            }
            let round = self.plan();
            let block = self.propose(&round).await;
            let mut verified = match self.verify(&round, &block).await {
                Ok(v) => v,
                Err(e) => break Err(e),
            };
            self.learn(&round, &block, &mut verified);
            if let Err(e) = self.commit(&round, verified, sink).await {
                break Err(e);
            }
        };
        self.finish(result)
    }

    /// Phase 1: this round's drafter and K (the request's fixed K, or the policy's choice), and
    /// the block's shape.
    fn plan(&mut self) -> Round {
        let model = self.drafters.model.as_mut();
        if let Some(t) = model.and_then(|m| m.poll(&self.log)) {
            self.policy.observe_timing(&t);
            self.shadow.drafted(&t, &mut self.policy);
        }
        let plan = self.choose();
        tracing::debug!(?plan, policy = %self.policy.summary(), "round planned");
        let start = Instant::now();
        let span = tracing::info_span!("round", n = self.stats.base.rounds + 1, k = plan.k);
        // A block drafted ahead is the model's next drafts only where the model drafts next.
        if plan.drafter != Some(DrafterKind::Model)
            && let Some(m) = self.drafters.model.as_mut()
        {
            m.hold_ahead(None);
            if self.policy.catch_up_wanted() {
                m.catch_up_in_background(&self.log);
            }
        }
        // Sibling leaves beside the model's drafts (a token tree): the request's, or as many as
        // the policy expects to pay.
        let room = self.max_draft.saturating_sub(plan.k).min(plan.k);
        let branches = match (plan.drafter, self.job.branches) {
            (Some(DrafterKind::Model), Some(b)) => b.min(room),
            (Some(DrafterKind::Model), None) => {
                let greedy = self.job.sampling.is_greedy();
                self.policy.branches(plan.k, room, greedy)
            }
            // The n-gram drafter's tree is the target's alone to take (the request's count,
            // checked against its limit).
            (Some(DrafterKind::Ngram), Some(b)) => b.min(plan.k),
            _ => 0,
        };
        let model = self.drafters.model.as_ref();
        Round {
            min_confidence: self.job.stop_below(&self.policy, plan.k),
            beside_background: model.is_some_and(|m| m.working_in_background()),
            plan,
            branches,
            start,
            span,
        }
    }

    /// The drafter and K of [`Self::plan`]; n-gram lookup looks up its drafts where it may
    /// draft (once: the choice weighs their length, the round uses them).
    fn choose(&mut self) -> RoundPlan {
        let (job, remaining) = (self.job, self.transcript.remaining());
        let attached = self.drafters.model_attached();
        let (log, grammar, ngram) = (&self.log, self.grammar.as_mut(), &mut self.drafters.ngram);
        let cap = job.draft_tokens.min(remaining.saturating_sub(1));
        if !job.adaptive {
            if cap == 0 {
                return RoundPlan::TARGET_ONLY;
            }
            let drafter = job.drafter.fixed(attached);
            if drafter == DrafterKind::Ngram {
                // A fixed request's siblings: the n-gram drafter's other continuations.
                ngram.look_up(log, (cap, job.branches.unwrap_or(0).min(cap)), grammar);
            }
            return RoundPlan {
                drafter: Some(drafter),
                k: cap,
            };
        }
        if self.engine.crowded() {
            return RoundPlan::TARGET_ONLY;
        }
        let offer = if job.drafter.uses_ngram() {
            ngram.look_up(log, (cap, 0), grammar)
        } else {
            NgramOffer::default()
        };
        let model = attached && job.drafter.uses_model();
        let drafter = self.drafters.model.as_ref();
        let held = drafter.map_or(0, |m| m.held());
        // Where the draft shares the target's cores, a catch-up slows the target's round as
        // much as a model round's feeding the gap would: the model round feeds it, as measured.
        let own_cores = !self.engine.draft_shares_cores;
        self.policy
            .set_model_behind(own_cores && drafter.is_some_and(|m| m.behind(log)));
        self.policy.choose(model, held, offer, remaining)
    }

    /// Phase 2: the round's block, from the drafter the plan chose ([`crate::drafting::Propose`]).
    /// More drafts than asked for are refused here: the round is then a plain target step.
    async fn propose(&mut self, round: &Round) -> DraftBlock {
        let (k, branches) = (round.plan.k, round.branches);
        let ask = Ask {
            k,
            branches,
            min_confidence: round.min_confidence,
        };
        let expected = self.policy.expected_draft_seconds(k);
        let drafter = round.plan.drafter.and_then(|kind| self.drafters.get(kind));
        let mut proposal = match drafter {
            Some(drafter) => {
                let span = tracing::info_span!(parent: &round.span, "draft", k);
                match drafter
                    .propose(&self.log, ask, expected)
                    .instrument(span)
                    .await
                {
                    Ok(p) if p.drafted_ahead => {
                        self.stats.pipeline_hits += 1;
                        p
                    }
                    Ok(p) => {
                        if round.plan.drafter == Some(DrafterKind::Model) {
                            self.stats.draft_node_tokens += p.tokens.len() as u32;
                        }
                        p
                    }
                    Err(e) => {
                        self.draft_failed(e, k);
                        DraftBlock::default()
                    }
                }
            }
            None => DraftBlock::default(),
        };
        if proposal.tokens.len() > k + branches {
            let refusal = DraftRefusal::new(
                k + branches,
                RefusalReason::TooManyDrafts,
                format!(
                    "{} drafts, {} asked for",
                    proposal.tokens.len(),
                    k + branches
                ),
            );
            tracing::info!(%refusal, "draft block refused");
            self.refused(refusal.reason.as_str(), || refusal.to_string());
            proposal.tokens.clear();
            proposal.q.clear();
            proposal.parents.clear();
        }
        self.stats.base.draft_seconds += proposal.compute_secs;
        proposal
    }

    /// Phase 3: the target's verdict on `block`. While the target verifies, the draft-node
    /// drafts the block that follows if every draft of the chain (a tree's drafts before its
    /// first sibling) is accepted, of this block's shape (docs/architecture.md "Pipelined"),
    /// when it fits in the verify's time and in what the generation has left, and where it is
    /// expected to pay (a poor draft's chain is seldom accepted whole): at least this round's K
    /// (a chain cut short too), and one longer where K is adaptive ([`KPolicy::ahead_len`]); the
    /// next round takes the part it planned, so rounds fall where they would without drafting
    /// ahead. The drafts go back to the draft-node unverified: ids outside the vocabulary (a
    /// lying draft) would make it refuse the step, so such a block is not drafted past.
    async fn verify(&mut self, round: &Round, block: &DraftBlock) -> Result<Verified> {
        let (drafts, parents) = (&block.tokens, &block.parents);
        let expected = self.policy.expected_verify_seconds(drafts.len() + 1);
        let chain = chain_len(parents, drafts.len());
        let ahead = self.ahead_len(round, block, chain);
        let start = Instant::now();
        // The verify's own time, whatever the draft-node does meanwhile.
        let span = tracing::info_span!(parent: &round.span, "verify", drafts = drafts.len());
        let (engine, target, log) = (self.engine, &mut self.target, &self.log);
        let verify = async move {
            let block = (&drafts[..], &block.q[..], &parents[..]);
            let verdict = verify::on_target(engine, target, log, block, expected)
                .instrument(span)
                .await;
            (verdict, start.elapsed().as_secs_f64())
        };
        let model = self.drafters.model.as_mut();
        let ((verdict, verify_wall), drafted_next) = match (model, ahead) {
            (Some(m), Some(shape)) => {
                let expected = self.policy.expected_draft_seconds(shape.k);
                let next = m.step_ahead(&self.log, &drafts[..chain], shape, expected);
                let (v, drafted) = tokio::join!(verify, next);
                (v, Some((shape.k, drafted)))
            }
            _ => (verify.await, None),
        };
        let round_wall = round.start.elapsed().as_secs_f64();
        let verdict = verdict?;
        let tree = committed::committed(drafts, parents, &verdict)?;
        Ok(Verified {
            verdict,
            tree,
            chain,
            verify_wall,
            round_wall,
            drafted_next,
        })
    }

    /// The shape of the block to draft during the verify of `block` (whose chain is `chain`
    /// long), where one is drafted ([`Self::verify`]).
    fn ahead_len(&self, round: &Round, block: &DraftBlock, chain: usize) -> Option<Ask> {
        if round.plan.drafter != Some(DrafterKind::Model) || !self.drafters.model_attached() {
            return None;
        }
        let want = chain.max(round.plan.k);
        let vocab = self.engine.target().info.vocab_size;
        let next = self.policy.ahead_len(want);
        let next = if self.job.adaptive {
            next
        } else {
            next.min(want)
        }
        .min(self.max_draft.saturating_sub(1));
        // Sampled, a tree drafted ahead would not be the tree the next step grows (its nodes
        // beside the chain are the best of a larger tree): a seeded generation would then depend
        // on when drafting ahead paid. A chain drafted ahead is the chain the step draws.
        let drafts = &block.tokens;
        let fits = chain > 0
            && (round.branches == 0 || self.job.sampling.is_greedy())
            && next >= want
            && self.transcript.remaining() >= chain + next + 2
            && drafts[..chain].iter().all(|&t| t < vocab);
        // Drafted whole: the part under the right guess is cut as the step would have cut it
        // ([`Self::learn`]), so that blocks end where they would without drafting ahead.
        fits.then(|| Ask {
            k: next + 1,
            branches: (round.branches.min(next + 1)).min(self.max_draft.saturating_sub(next + 1)),
            min_confidence: 0.0,
        })
    }

    /// Phase 4: what the round teaches the policy, and what the statistics and metrics record.
    fn learn(&mut self, round: &Round, block: &DraftBlock, verified: &mut Verified) {
        // A block drafted ahead that failed or stalled was priced by `observe_stall`: the
        // round's wall time says nothing more about the drafter's cost.
        let (drafted_next, ahead_failed) = match &verified.drafted_next {
            Some((next, Ok(_))) => (*next, false),
            Some((_, Err(_))) => (0, true),
            None => (0, false),
        };
        if let Some(r) = verified.verdict.refused.take() {
            self.refused(&r.reason, || r.message.clone());
        }
        // The block drafted during the verify, for the round's debug line (taken just below).
        let next_k = verified.drafted_next.as_ref().map_or(0, |(k, _)| *k);
        let next_secs = match &verified.drafted_next {
            Some((_, Ok(b))) => b.wall_secs,
            _ => 0.0,
        };
        // The draft's compute the round waited for: its step, and of a block drafted during the
        // verify what ran past the verdict.
        let draft_waited = block.compute_secs + self.drafted_ahead(round, verified);
        let Verified { verdict, tree, .. } = &*verified;
        let (drafts, accepted) = (block.tokens.len(), verdict.accepted);
        let verify_secs = verdict.compute_secs;
        self.stats.base.target_seconds += verify_secs;
        if let Some(right) = tree.sibling {
            let past_chain = if right { accepted - tree.chain.1 } else { 0 };
            self.policy.observe_sibling(past_chain);
        }
        if !block.parents.is_empty() {
            self.stats.tree_rounds += 1;
            self.stats.sibling_hits += u32::from(tree.sibling == Some(true));
        }
        let drafter = round.plan.drafter.filter(|_| drafts > 0);
        self.load = (self.load.0 + self.engine.active(), self.load.1 + 1);
        match drafter {
            Some(DrafterKind::Model) => self.stats.model_rounds += 1,
            Some(DrafterKind::Ngram) => {
                self.stats.ngram_rounds += 1;
                let earlier = self.drafters.ngram.proposed_from_history();
                self.stats.history_rounds += u32::from(earlier);
            }
            None => {
                self.stats.target_only_rounds += 1;
                let beside = round.beside_background;
                self.policy
                    .observe_target_step(beside, verified.verify_wall);
            }
        }
        // The policy learns the chain's acceptance by depth (siblings: observe_sibling), and by
        // the draft's confidence.
        let (chain, chain_accepted) = tree.chain;
        let confidence = &block.confidence;
        if drafter == Some(DrafterKind::Model)
            && block.parents.is_empty()
            && confidence.len() == chain
        {
            self.policy.observe_confidence(confidence, chain_accepted);
        }
        self.policy.observe(
            RoundPlan { drafter, k: chain },
            &RoundCosts {
                drafted: chain,
                siblings: drafts - chain,
                drafted_ahead: block.drafted_ahead,
                drafted_next,
                accepted: chain_accepted,
                draft_wall: block.wall_secs,
                draft_compute: block.compute_secs,
                verify_wall: verified.verify_wall,
                round_wall: if ahead_failed {
                    0.0
                } else {
                    verified.round_wall
                },
            },
        );
        self.stats.base.record_round(drafts, accepted);
        if drafts > 0 {
            let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
            self.stats.steps.push([count(drafts), count(accepted)]);
        }
        self.stats.draft_waited_seconds += draft_waited;
        let wall = round.start.elapsed().as_secs_f64();
        tracing::debug!(
            ?drafter,
            drafts,
            accepted,
            wall,
            verify = verify_secs,
            draft = block.wall_secs,
            draft_waited,
            ahead = block.drafted_ahead,
            next_k,
            next_secs,
            verify_wall = verified.verify_wall,
            "round done"
        );
        let counts = (drafts, accepted);
        (self.engine.metrics).round(drafter, counts, wall, draft_waited, verify_secs);
    }

    /// What came of the block drafted during the verify: kept for the next round where the
    /// whole chain was accepted and the guess of the bonus token was right. Returns the draft's
    /// compute of it that ran past the verdict (the round waited for it).
    fn drafted_ahead(&mut self, round: &Round, verified: &mut Verified) -> f64 {
        let next = match verified.drafted_next.take() {
            Some((_, Ok(next))) => next,
            Some((k, Err(e))) if self.drafters.model.is_some() => {
                self.draft_failed(e, k);
                return 0.0;
            }
            _ => return 0.0,
        };
        self.stats.pipeline_rounds += 1;
        self.stats.draft_node_tokens += next.tokens.len() as u32;
        self.stats.base.draft_seconds += next.compute_secs;
        let waited = (next.compute_secs - verified.verify_wall).max(0.0);
        let chain = verified.chain;
        if verified.tree.chain == (chain, chain) && verified.verdict.accepted == chain {
            let under = next.under(verified.verdict.next_token);
            // One guess (a chain drafted ahead, not a tree's): draft `chain + 1`'s acceptance.
            let sole_greedy = next.parents.is_empty() && self.job.sampling.is_greedy();
            (self.policy).observe_guess_after(chain, under.is_some(), sole_greedy);
            if let Some(m) = self.drafters.model.as_mut() {
                m.hold_ahead(under.map(|p| p.cut(round.min_confidence)));
            }
        }
        waited
    }

    /// Phase 5: the committed tokens into the transcript, the log and the client; the draft-node
    /// timed or caught up in the background where it did not draft. An error where the client
    /// has gone (CANCELLED).
    async fn commit(
        &mut self,
        round: &Round,
        verified: Verified,
        sink: &mut impl CommitSink,
    ) -> Result<()> {
        let commit = self.transcript.commit(&verified.tree.tokens)?;
        self.log.extend(&commit.tokens);
        self.shadow.compare(&self.log, &mut self.policy);
        let crowded = self.job.adaptive && self.engine.crowded();
        let k = self.shadow_k(self.transcript.remaining());
        if round.plan.drafter != Some(DrafterKind::Model)
            && !crowded
            && let Some(m) = self.drafters.model.as_mut()
        {
            let fed = m.fed_before_step(&self.log);
            let task = self.policy.background_task_seconds(k, fed).unwrap_or(0.0);
            let (could_pay, credit) = (self.policy.model_could_pay(), self.policy.explore_credit());
            let affordable = self.policy.background_affordable(task);
            if self.shadow.due(could_pay, credit, task, affordable) {
                if k > 0 {
                    m.time_in_background(&self.log, k);
                }
            } else if self.policy.catch_up_soon(!self.engine.draft_shares_cores) {
                m.catch_up_in_background(&self.log);
            }
        }
        let logprobs = &verified.verdict.logprobs;
        let n = commit.tokens.len().min(logprobs.len());
        self.logprobs.extend_from_slice(&logprobs[..n]);
        if !sink.send(&commit, &logprobs[..n]).await {
            return Err(Error::Cancelled);
        }
        let metrics = &self.engine.metrics;
        metrics.streamed(
            &mut self.last_commit,
            self.prefill_start,
            commit.tokens.len(),
        );
        Ok(())
    }

    /// The length of a background timing step with `remaining` tokens left to generate.
    fn shadow_k(&self, remaining: usize) -> usize {
        shadow_len(self.job.draft_tokens.min(self.max_draft), remaining)
    }

    /// Ends the generation: what it learnt kept for the next at its load, both sessions closed,
    /// the outcome (or the error that ended it).
    fn finish(mut self, result: Result<FinishReason>) -> Result<Outcome> {
        self.stats.base.decode_seconds = self.decode_start.elapsed().as_secs_f64();
        // Fixed-K sessions measure the same costs and acceptance: every session teaches.
        let load = self.load.0 as f64 / self.load.1 as f64;
        self.engine.learnt.keep(load, self.policy);
        self.stats.settle(&self.target);
        self.target.close();
        if let Some(m) = self.drafters.model.as_mut() {
            self.stats.draft_reattached = m.reattached;
            if let Some(d) = m.detach() {
                self.stats.settle(&d);
                d.close();
            }
        }
        let finish_reason = result?;
        let (text, token_ids) = self.transcript.into_output();
        self.drafters.ngram.remember(&token_ids);
        self.stats.base.generated_tokens = token_ids.len();
        Ok(Outcome {
            text,
            token_ids,
            finish_reason,
            stats: self.stats,
            logprobs: self.logprobs,
        })
    }

    /// A draft step that failed or stalled: counted, priced (a stall cost at least its
    /// deadline: so priced, it is not chosen again at once), and the draft-node's session
    /// dropped (the drafter re-attaches it in the background).
    fn draft_failed(&mut self, failure: StepFailure, k: usize) {
        tracing::warn!(error = %failure, "dropped the draft-node: going on without it until it is attached again");
        match failure {
            StepFailure::Stalled(deadline) => {
                self.stats.draft_stalls += 1;
                self.policy.observe_stall(k, deadline.as_secs_f64());
            }
            StepFailure::Failed(e) => self.stats.lose_draft(format!("the draft-node failed: {e}")),
        }
        if let Some(d) = self.drafters.model.as_mut().and_then(|m| m.session.take()) {
            self.stats.settle(&d);
        }
    }

    /// Counts a refused block; at [`MAX_REFUSED_BLOCKS`] the draft is detached for good.
    fn refused(&mut self, reason: &str, message: impl FnOnce() -> String) {
        self.engine.metrics.draft_blocks_refused.add(reason, 1);
        self.stats.draft_blocks_refused += 1;
        if self.stats.draft_blocks_refused >= MAX_REFUSED_BLOCKS
            && let Some(mut m) = self.drafters.model.take()
        {
            let why = format!(
                "{} drafted blocks refused, the last: {}",
                self.stats.draft_blocks_refused,
                message()
            );
            tracing::warn!(reason = %why, "detaching the draft: going on without it");
            self.stats.draft_reattached = m.reattached;
            if let Some(d) = m.detach() {
                self.stats.settle(&d);
                d.close();
            }
            self.stats.lose_draft(why);
        }
    }
}
