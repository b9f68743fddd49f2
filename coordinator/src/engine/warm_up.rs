//! Before the first request, the nodes' costs timed on a prompt of the engine's own
//! ([`Engine::warm_up`]): the target's step alone and its verify of short blocks, the
//! draft-node's step alone (and its feed of the tokens before it), and the target's step beside
//! one of the draft's. A fresh process's first generation so starts from measured costs as every
//! later one does, instead of timing the draft-node beside its own first steps: with the real
//! Qwen pair on one machine's two cores (split), that background step slowed the target's first
//! two steps from 38 to 50-60 ms, 4 % of a 19-token answer (docs/benchmarks/prompts.md, sessions
//! 30 and 31). As vLLM and text-generation-inference warm up before they report ready, the
//! coordinator's readiness waits for it.
//!
//! Only costs are kept: the warm-up's text says nothing of a tenant's acceptance (its blocks
//! are verified as target-only rounds, which teach none), and its sessions use a salt of their
//! own, so no tenant's request finds or leaves its prefix-cache entries.

use std::time::{Duration, Instant};

use tandem_runtime::{SamplingParams, TokenLog};

use super::Engine;
use super::job::tenant_salt;
use crate::drafting::block::{Ask, DraftBlock};
use crate::drafting::model::time_step;
use crate::drafting::policy::{ADAPTIVE_MAX_K, KPolicy, RoundCosts, RoundPlan};
use crate::drafting::shadow::shadow_len;
use crate::error::{Error, Result};
use crate::nodes::links::{Draft, NodeSession, SessionSpec, Target};

/// What the engine warms up on: any text does, only the costs are kept.
pub const WARM_UP_TEXT: &str = "Write a short story about a lighthouse keeper who finds a message in a \
                    bottle, then summarize it in one sentence.";
/// Target steps timed alone, after a first that is not (it may still fault weights in).
const TARGET_STEPS: usize = 2;
/// Positions of the blocks whose verify is timed after them: two of 2, which n-gram lookup
/// would otherwise probe to time (`KPolicy::choose`), and one of 4 for the slope.
const BLOCKS: [usize; 3] = [2, 2, 4];
/// A warm-up that has not ended by then is given up (a node that stopped answering): requests
/// then time the nodes as they go, as without a warm-up.
const WARM_UP_DEADLINE: Duration = Duration::from_secs(30);

/// What a warm-up did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WarmUp {
    /// Nothing to learn: no draft-node answered, requests' K is fixed, or what was learnt is
    /// already known (a policy file of this pair).
    Skipped,
    /// The costs measured, in seconds: the target's step alone and beside a draft step, and the
    /// draft-node's step of `k` tokens.
    Timed {
        target: f64,
        beside: f64,
        draft: f64,
        k: usize,
    },
}

impl Engine {
    /// Times the nodes once on the engine's own prompt, and keeps what it measured as what the
    /// last lone session learnt ([`super::learnt`]): the first adaptive generation then knows
    /// the draft-node's cost and its slowdown of the target without a background step beside
    /// its first rounds. Skipped where there is no draft-node yet, where K is fixed, or where a
    /// policy file already gave this pair's costs. An error where a node failed or did not
    /// answer within [`WARM_UP_DEADLINE`]: nothing is kept, and generations time the nodes as
    /// they go.
    pub async fn warm_up(&self) -> Result<WarmUp> {
        let Some(drafts) = self.draft.get() else {
            return Ok(WarmUp::Skipped);
        };
        // As a request's K is bounded: by both nodes' limits.
        let limit = |node: &crate::nodes::NodeHandle| node.limits().max_draft_tokens as usize;
        let max_k = ADAPTIVE_MAX_K
            .min(limit(drafts.primary()))
            .min(limit(self.target()));
        let start = self.learnt.start(1, max_k);
        if self.default_draft_tokens.is_some() || max_k == 0 || start.draft_timed() {
            return Ok(WarmUp::Skipped);
        }
        let prompt = self.tokenizer.encode(WARM_UP_TEXT)?;
        let spec = SessionSpec {
            session_id: "warm-up".to_string(),
            sampling: SamplingParams::greedy(),
            // The untimed step and blocks, the timed ones (each may commit all its positions),
            // the step beside the draft's, and the draft's last drafts past them.
            max_len: prompt.len() + 1 + TARGET_STEPS + 2 * BLOCKS.iter().sum::<usize>() + 1 + max_k,
            top_logprobs: None,
            constraint: None,
            cache_salt: tenant_salt("warm-up", "engine"),
        };
        let log = TokenLog::new(&prompt);
        let timed = async {
            let target = self
                .targets
                .open::<Target>(self.targets.pick(), &spec, &log);
            let draft = drafts.open::<Draft>(drafts.pick(), &spec, &log);
            let (target, draft) = tokio::join!(target, draft);
            let (mut target, mut draft) = (target.session?, draft.session?);
            let k = shadow_len(max_k, usize::MAX);
            let timed = time_nodes((&mut target, &mut draft), log, max_k, k).await;
            target.close();
            draft.close();
            timed
        };
        let (policy, warm) = tokio::time::timeout(WARM_UP_DEADLINE, timed)
            .await
            .map_err(|_| Error::TimedOut {
                node: "target-node or draft-node",
                secs: WARM_UP_DEADLINE.as_secs_f64(),
            })??;
        self.learnt.keep(1.0, policy);
        Ok(warm)
    }

    /// [`Self::warm_up`], its outcome logged: a failed warm-up costs only what it would have
    /// spared the first requests.
    pub async fn warm_up_logged(&self) {
        match self.warm_up().await {
            Ok(WarmUp::Skipped) => {}
            Ok(WarmUp::Timed {
                target,
                beside,
                draft,
                k,
            }) => tracing::info!(
                target_step_ms = target * 1e3,
                target_beside_draft_ms = beside * 1e3,
                draft_step_ms = draft * 1e3,
                draft_tokens = k,
                "nodes timed before the first request"
            ),
            Err(e) => {
                let error = tandem_proto::error_chain(&e);
                tracing::warn!(%error, "the nodes were not timed before the first request: the first generations time them");
            }
        }
    }
}

/// Steps both sessions past `log` and times them: the target's step alone and its verify of
/// blocks of [`BLOCKS`] positions (of fewer where `max_k` is; each size's first untimed), the
/// draft's step of `k` alone ([`time_step`]: the tokens before it fed first), then a target step
/// beside a draft step. The policy (of K up to `max_k`) that learnt those costs, and what they
/// were.
async fn time_nodes(
    (target, draft): (&mut NodeSession<Target>, &mut NodeSession<Draft>),
    mut log: TokenLog,
    max_k: usize,
    k: usize,
) -> Result<(KPolicy, WarmUp)> {
    let mut policy = KPolicy::new(max_k);
    let mut alone = 0.0;
    // Each size's first verify is untimed (it may still fault weights or scratch memory in: on
    // one machine's two cores a first block of 2 positions, timed, read 40 ms against a 26 ms
    // step and priced the model out of every later session), then the timed ones.
    let sizes = || BLOCKS.into_iter().filter(|&n| n <= max_k + 1);
    // BLOCKS is sorted: one of each size.
    let mut firsts: Vec<usize> = std::iter::once(1).chain(sizes()).collect();
    firsts.dedup();
    let warm = firsts.into_iter().map(|n| (n, false));
    let measured = std::iter::repeat_n(1, TARGET_STEPS).chain(sizes());
    for (n, timed) in warm.chain(measured.map(|n| (n, true))) {
        // Drafts the target is unlikely to accept (its own last token again): only the cost of
        // the block's verify is learnt, never an acceptance.
        let last = log.tokens().last().copied().unwrap_or_default();
        let block = DraftBlock::one_hot(vec![last; n - 1], Vec::new(), 0.0);
        let drafts = &block.tokens;
        let began = Instant::now();
        let verdict = target
            .verify(&log, (drafts, &block.q, &block.parents))
            .await?;
        let seconds = began.elapsed().as_secs_f64();
        log.extend(&drafts[..verdict.accepted.min(drafts.len())]);
        log.extend(&[verdict.next_token]);
        // A refused block was a plain step.
        if !timed || verdict.refused.is_some() {
            continue;
        }
        if n == 1 {
            alone = seconds;
            policy.observe_target_step(false, seconds);
        }
        let round = RoundCosts {
            drafted: n - 1,
            accepted: verdict.accepted,
            verify_wall: seconds,
            ..RoundCosts::default()
        };
        policy.observe(RoundPlan::TARGET_ONLY, &round);
    }
    let timing = time_step(draft, &log, k).await?;
    policy.observe_timing(&timing);
    let began = Instant::now();
    let (verified, drafted) = tokio::join!(
        async {
            let verdict = target.verify(&log, (&[], &[], &[])).await;
            (verdict, began.elapsed().as_secs_f64())
        },
        draft.draft(&log, Ask::chain(k))
    );
    let (verdict, beside) = verified;
    verdict?;
    drafted?;
    policy.observe_target_step(true, beside);
    let warm = WarmUp::Timed {
        target: alone,
        beside,
        draft: timing.wall_secs,
        k,
    };
    Ok((policy, warm))
}
