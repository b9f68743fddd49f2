//! The round loop over gRPC (docs/architecture.md "Data flow of one round"): the coordinator keeps each
//! session's canonical log, asks the draft-node for K tokens, has the target-node verify them in
//! one pass, commits the verdict and streams it. Losing the draft costs speed, not output: the
//! loop goes on target-only. A lost target session is rebuilt by replaying the log.
//!
//! A draft's block is never trusted: the target-node refuses one that fails its checks and runs
//! the round as a plain target step; more drafts than asked for are refused here. After
//! [`MAX_REFUSED_BLOCKS`] refused blocks the draft is detached from the generation, which goes
//! on target-only. A bad draft never fails a request.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tandem_proto::tls::ClientTls;
use tandem_proto::v1;
use tandem_proto::{Error, Result};
use tandem_runtime::{Constraint, DraftRefusal, RefusalReason, TokenLog, Tokenizer, Transcript};
use tracing::Instrument;

use crate::constraints::Grammars;
use crate::drafting::drafters::{Ask, ModelDrafter, Proposal, fixed_drafter, ngram_proposal};
use crate::drafting::policy::{Drafter, KPolicy, NgramOffer, Plan, RoundCosts};
use crate::drafting::shadow::{Shadow, shadow_len};
pub use crate::engine::job::{CommitSink, Discard, Job, MAX_STOP_TOKEN_IDS, Outcome};
use crate::engine::learnt::Learnt;
use crate::engine::metrics::{CoordinatorMetrics, Counted};
pub use crate::engine::stats::Stats;
pub use crate::nodes::NodeHandle;
use crate::nodes::health::{DRAFT_GRACE, open_draft};
use crate::nodes::links::{SessionSpec, Target};
use crate::nodes::replicas::Replicas;
use crate::nodes::{CALL_FLOOR, LateDraft};

/// Refused blocks after which a generation detaches its draft.
pub const MAX_REFUSED_BLOCKS: u32 = 3;

/// Default generation length when a request names none.
pub const DEFAULT_MAX_TOKENS: usize = 256;

/// One adaptive generation in this many opens a draft that could not pay, to time it again (a
/// link that got faster)...
const RETIME_EVERY: usize = 8;
/// ...or in this many where the draft runs on the target's cores: no link there, the costs are
/// the machine's, and each retime's session and background steps slowed the target (on the
/// embedded pair, one generation in 8 cost the median a per cent).
const RETIME_EVERY_SHARING_CORES: usize = 64;

/// The coordinator's view of one target and an optional draft.
#[derive(Debug)]
pub struct Engine {
    /// The target-node's replicas (one, unless `--target` was given several times).
    pub targets: Replicas,
    /// The draft-node, once it has answered ([`LateDraft`]).
    pub draft: LateDraft,
    pub tokenizer: Tokenizer,
    /// K of a request that names none; `None`: chosen each round (adaptive).
    pub default_draft_tokens: Option<usize>,
    pub metrics: CoordinatorMetrics,
    /// Whether the draft-node runs on the target's cores (the all-in-one mode): background draft
    /// steps are then spaced out ([`crate::drafting::shadow`]), a hopeless draft is retimed more
    /// rarely, and K = auto does not count on drafting ahead during the verify (two models that
    /// each use every core gain nothing by running at once); on a CPU target nothing is drafted
    /// ahead ([`Self::passes_take_turns`]).
    pub draft_shares_cores: bool,
    /// Adaptive K speculates only while at most this many generations run here: beyond, the
    /// target's batch of plain steps is already compute-bound and drafts cost it more than they
    /// save (vLLM's disable-by-batch-size). `None`: no limit. Default: 1 for a CPU target whose
    /// draft-node runs on its cores ([`crate::nodes::shares_cores`]), else none.
    pub max_speculating: Option<usize>,
    /// How long a lost target is waited for (its session replayed) before a generation fails.
    pub target_retry: Duration,
    /// Added to a draft step's deadline (8 times its expected time): a step later than that is
    /// abandoned, its round decoded by the target alone.
    pub draft_step_slack: Duration,
    /// How long a generation's draft session is waited for once its target session is open, at
    /// least ([`open_draft`]): past it the generation starts with the target alone.
    pub draft_open_grace: Duration,
    /// A target call's deadline floor ([`call_deadline`]): a call later than that, on a node
    /// that is not working on it, is taken for lost and its session replayed.
    pub call_floor: Duration,
    /// What the last session at each load learnt of the nodes' costs and the draft's acceptance.
    learnt: Learnt,
    /// Adaptive generations that started with a draft that could not pay.
    hopeless: AtomicUsize,
    /// Compiles requests' grammars to check them (built at the first one).
    pub(super) grammars: Grammars,
    active: AtomicUsize,
    next_id: AtomicUsize,
}

impl Engine {
    /// Connects to the nodes (TLS for `https://` URLs), fetches the target's tokenizer, and refuses a draft whose
    /// vocabulary differs from the target's.
    pub async fn connect(
        targets: &[String],
        drafts: &[String],
        default_draft_tokens: Option<usize>,
        tls: &ClientTls,
    ) -> Result<Self> {
        let targets = Replicas::connect("target-node", targets, tls).await?;
        let target = targets.primary().clone();
        let cpu_target = target.info.device.starts_with("cpu");
        let draft = match drafts {
            [] => LateDraft::default(),
            urls => LateDraft::connect(urls, &target, tls).await?,
        };
        // What the nodes say of their machine and CPUs where the draft answered; else the URLs.
        let shares_cores = match (draft.get(), drafts.first()) {
            (_, None) => true,
            (Some(d), Some(url)) => crate::nodes::shares_cores(&target.info, &d.primary().info)
                .unwrap_or_else(|| crate::nodes::same_machine(&target.endpoint, url)),
            (None, Some(url)) => crate::nodes::same_machine(&target.endpoint, url),
        };
        let reply = v1::node_service_client::NodeServiceClient::new(target.channel.clone())
            .max_decoding_message_size(tandem_proto::MAX_MESSAGE_BYTES)
            .tokenizer(v1::TokenizerRequest {})
            .await
            .map_err(|status| Error::Remote {
                node: "target-node",
                status,
            })?
            .into_inner();
        let tokenizer = Tokenizer::from_json(
            &reply.tokenizer_json,
            reply.bos_id,
            reply.eos_id,
            reply.chat_template,
            &target.endpoint,
        )?;
        Ok(Self {
            targets,
            draft,
            tokenizer,
            default_draft_tokens,
            metrics: CoordinatorMetrics::default(),
            draft_shares_cores: false,
            // A CPU target gains nothing from speculation once it batches other sessions when
            // the draft runs on its cores; a draft on other cores or another machine keeps paying
            // (docs/benchmarks/concurrency.md, unpinned and pinned).
            max_speculating: (cpu_target && shares_cores).then_some(1),
            target_retry: Duration::from_secs(30),
            draft_step_slack: crate::drafting::drafters::DEFAULT_STEP_SLACK,
            draft_open_grace: DRAFT_GRACE,
            call_floor: CALL_FLOOR,
            learnt: Learnt::default(),
            hopeless: AtomicUsize::new(0),
            grammars: Grammars::default(),
            active: AtomicUsize::new(0),
            next_id: AtomicUsize::new(0),
        })
    }

    /// The target replica whose info is the model's.
    pub fn target(&self) -> &NodeHandle {
        self.targets.primary()
    }

    /// The coordinator's `/metrics` page.
    pub fn exposition(&self) -> String {
        let mut round_trips = Vec::new();
        let nodes = std::iter::once(("target-node", &self.targets))
            .chain(self.draft.get().map(|d| ("draft-node", d)));
        for (node, replicas) in nodes {
            for (endpoint, rtt) in replicas.round_trips() {
                round_trips.extend(rtt.map(|seconds| (node, endpoint, seconds)));
            }
        }
        self.metrics.exposition(self.active(), &round_trips)
    }

    /// Generations running now.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Whether the draft's and the target's passes take turns on the same cores (both models on
    /// this process's CPU: [`tandem_runtime::kernels::Cores`]): a block drafted during the verify
    /// then runs after it, one pass longer than the block the next round would draft (K + 1
    /// tokens under the guess of the bonus token), and a wrong guess wastes it. Fixed K too
    /// drafts no block ahead there: 8 sessions at K = 4 in one process, 268.6 tokens/s without
    /// against 247.2 with, one session 100.1 against 96.7 (docs/benchmarks/concurrency.md).
    fn passes_take_turns(&self) -> bool {
        let cpu = |info: &v1::NodeInfo| info.device.starts_with("cpu");
        self.draft_shares_cores
            && cpu(&self.target().info)
            && self.draft.get().is_some_and(|d| cpu(&d.primary().info))
    }

    /// Whether more generations run than adaptive K speculates for ([`Self::max_speculating`]).
    fn crowded(&self) -> bool {
        self.max_speculating.is_some_and(|n| self.active() > n)
    }

    /// Checks a request against the nodes' limits, naming the field and the limit: a request of
    /// the tenant of all that name none ([`Self::prepare_for`]).
    pub fn prepare(&self, request: &v1::GenerateRequest) -> Result<Job> {
        self.prepare_for(request, &[])
    }

    /// [`Self::prepare`] for a request of the tenant whose salt is `tenant` (its API key's,
    /// [`crate::engine::job::tenant_salt`]; empty: the tenant of all): its generation finds only
    /// its tenant's entries of the nodes' prefix caches, or those of the request's `cache_salt`
    /// where it gives one.
    pub fn prepare_for(&self, request: &v1::GenerateRequest, tenant: &[u8]) -> Result<Job> {
        self.check(request, tenant)
            .inspect_err(|e| self.count_error(e))
    }

    fn count_error(&self, e: &Error) {
        self.metrics.errors.add(&format!("{:?}", e.code()), 1);
    }

    /// Runs one generation. `sink` sees each round's commit as it happens (a slow client slows
    /// the generation down rather than buffering it) and answers false when the client has
    /// gone, which cancels the generation and frees both sessions.
    #[tracing::instrument(name = "generate", skip_all, fields(
        prompt_tokens = job.prompt.len(),
        max_tokens = job.max_new_tokens,
        k = job.draft_tokens,
    ))]
    pub async fn generate(&self, job: &Job, sink: &mut impl CommitSink) -> Result<Outcome> {
        self.metrics.requests.inc();
        self.metrics.prompt_tokens.inc_by(job.prompt.len() as u64);
        let start = Instant::now();
        let outcome = self.run(job, sink).await;
        match &outcome {
            Ok(o) => self.metrics.finished(o, start.elapsed().as_secs_f64()),
            Err(e) => self.count_error(e),
        }
        outcome
    }

    async fn run(&self, job: &Job, sink: &mut impl CommitSink) -> Result<Outcome> {
        self.active.fetch_add(1, Ordering::Relaxed);
        let _active = ActiveGuard(&self.active);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let spec = SessionSpec {
            session_id: format!("gen-{id}"),
            sampling: job.sampling.clone(),
            max_len: job.prompt.len() + job.max_new_tokens,
            top_logprobs: job.top_logprobs,
            constraint: job.constraint.clone(),
            cache_salt: job.cache_salt.clone(),
        };
        let mut log = TokenLog::new(&job.prompt);
        let mut grammar = self.grammars.state(job.constraint.as_ref())?;
        let mut logprobs = Vec::new();
        let mut stats = Stats {
            seed: job.sampling.seed,
            ..Stats::default()
        };
        let prefill_start = Instant::now();
        // The costs and acceptance of the last session at this load, or (the first time) priors;
        // a first probe of the draft is then expected to cost about what opening its session
        // did. The load the session runs at, summed over its rounds (and its start).
        let active = self.active();
        let mut policy = self.learnt.start(active, job.draft_tokens);
        let mut load = (active, 1usize);
        policy.set_pipelining(
            job.pipeline && !(self.passes_take_turns() || job.adaptive && self.draft_shares_cores),
        );
        // A draft that could not pay at the costs of the last session at this load even if always
        // right is left out of adaptive generations but one in [`RETIME_EVERY`] (or
        // [`RETIME_EVERY_SHARING_CORES`]), which opens it and times it again: its session, its
        // background steps and their gRPC work on the coordinator's core cost a fast target a
        // few per cent for nothing.
        let retime = job.adaptive && !policy.model_could_pay();
        let use_draft = self.draft.get().filter(|_| {
            job.draft_tokens > 0
                && job.max_new_tokens > 1
                && job.drafter.uses_model()
                && (!retime
                    || self
                        .hopeless
                        .fetch_add(1, Ordering::Relaxed)
                        .is_multiple_of(if self.draft_shares_cores {
                            RETIME_EVERY_SHARING_CORES
                        } else {
                            RETIME_EVERY
                        }))
        });
        // Each session on the least loaded replica of its node, counted there until the end.
        let opening = Counted::new(&self.metrics.waiting);
        let target_opened = tokio::sync::Notify::new();
        let (target, draft) = tokio::join!(
            async {
                let i = self.targets.pick_for(&spec.cache_salt, log.tokens());
                let opened = self.targets.open::<Target>(i, &spec, &log).await;
                target_opened.notify_one();
                opened
            },
            async {
                let d = use_draft?;
                let grace = self.draft_open_grace;
                Some(open_draft(d, (&spec, &log), &target_opened, grace).await)
            }
        );
        drop(opening);
        let mut target = target.session?;
        self.metrics.queue_time.observe(target.queued.as_secs_f64());
        stats.cached_tokens = target.cached_tokens;
        let _lease = self.targets.lease(target.replica);
        let _draft_lease = draft.as_ref().zip(use_draft).and_then(|((o, _), d)| {
            let session = o.session.as_ref().ok()?;
            Some(d.lease(session.replica))
        });
        let (mut model, draft) = match (draft, use_draft) {
            (Some((opened, secs)), Some(d)) => (
                Some(ModelDrafter::new(
                    d.fallbacks(&opened.handle),
                    spec.clone(),
                    None,
                    self.draft_step_slack,
                )),
                Some((opened.session, secs)),
            ),
            _ => (None, None),
        };
        // Drafts the draft-node accepts per step (0 without one).
        let max_draft = use_draft.map_or(0, |d| d.primary().limits().max_draft_tokens as usize);
        let shadow_k = |remaining| shadow_len(job.draft_tokens.min(max_draft), remaining);
        match (draft, model.as_mut()) {
            (Some((Ok(session), open_secs)), Some(m)) => {
                m.session = Some(session);
                policy.set_first_probe_cost(open_secs);
                // A draft-node never timed (or timed again) is timed beside the first rounds,
                // which do not wait.
                let k = shadow_k(job.max_new_tokens);
                if job.adaptive && (retime || !policy.draft_timed()) && k > 0 && !self.crowded() {
                    m.time_in_background(&log, k);
                }
            }
            // Down, or not open in time beside the target's session: logged where found.
            (Some((Err(e @ (Error::NotReady(_) | Error::TimedOut { .. })), _)), Some(m)) => {
                tracing::debug!(error = %e, "draft-node unavailable: decoding without it");
                stats.lose_draft(format!("the draft-node was unavailable: {e}"));
                m.reattach_later(&log);
            }
            (Some((Err(e), _)), Some(m)) => {
                tracing::warn!(error = %e, "draft-node unavailable: decoding without it");
                stats.lose_draft(format!("the draft-node was unavailable: {e}"));
                m.reattach_later(&log);
            }
            _ => {}
        }
        stats.base.prefill_seconds = prefill_start.elapsed().as_secs_f64();
        self.metrics
            .prefill_time
            .observe(stats.base.prefill_seconds);
        let mut last_commit: Option<Instant> = None;

        let mut shadow = Shadow::new(
            job.adaptive && job.sampling.is_greedy(),
            self.draft_shares_cores,
        );
        let mut transcript = Transcript::new(
            &self.tokenizer,
            &job.stop_token_ids,
            &job.stop_strings,
            job.max_new_tokens,
        );
        let decode_start = Instant::now();
        let mut ahead: Option<Proposal> = None;
        let result = loop {
            if let Some(finish) = transcript.finish_reason() {
                break Ok(finish);
            }
            if let Some(t) = model.as_mut().and_then(|m| m.poll(&log)) {
                policy.observe_timing(&t);
                shadow.drafted(&t);
            }
            let attached = model.as_ref().is_some_and(|m| m.session.is_some());
            let (plan, ngram) = self.plan(
                job,
                &mut policy,
                (&log, grammar.as_mut()),
                attached,
                transcript.remaining(),
            );
            tracing::debug!(?plan, policy = %policy.summary(), "round planned");
            let round_start = Instant::now();
            let round = tracing::info_span!("round", n = stats.base.rounds + 1, k = plan.k);
            // A block the draft drafted during the last verify, when a guess of the bonus token
            // was right: this round's drafts (what was under that guess), ready without asking.
            let ready = ahead
                .take()
                .filter(|_| plan.drafter == Some(Drafter::Model));
            let drafted_ahead = ready.is_some();
            // Sibling leaves beside the model's drafts (a token tree): the request's, or as
            // many as the policy expects to pay.
            let room = max_draft.saturating_sub(plan.k).min(plan.k);
            let branches = match (plan.drafter, job.branches) {
                (Some(Drafter::Model), Some(b)) => b.min(room),
                (Some(Drafter::Model), None) => policy.branches(plan.k, room),
                // The n-gram drafter's tree is the target's alone to take (the request's count,
                // checked against its limit).
                (Some(Drafter::Ngram), Some(b)) => b.min(plan.k),
                _ => 0,
            };
            let min_confidence = job.stop_below(&policy, plan.k);
            let ask = Ask {
                k: plan.k,
                branches,
                min_confidence,
            };
            let proposal = match plan.drafter {
                Some(Drafter::Model) if let Some(ready) = ready => {
                    stats.pipeline_hits += 1;
                    ready.truncated(plan.k + branches)
                }
                Some(Drafter::Model) => {
                    let m = model.as_mut().expect("attached");
                    let expected = policy.expected_draft_seconds(plan.k);
                    match m
                        .step(&log, ask, expected)
                        .instrument(tracing::info_span!(parent: &round, "draft", k = plan.k))
                        .await
                    {
                        Ok(p) => {
                            stats.draft_node_tokens += p.tokens.len() as u32;
                            p
                        }
                        Err(e) => {
                            stats.draft_failed(e, m, &mut policy, plan.k);
                            Proposal::default()
                        }
                    }
                }
                // A tree (a fixed request's branches) is looked up at the round's K already.
                Some(Drafter::Ngram) if !ngram.parents.is_empty() => ngram,
                Some(Drafter::Ngram) => ngram.truncated(plan.k),
                None => Proposal::default(),
            };
            let Proposal {
                tokens: mut drafts,
                mut q,
                mut parents,
                confidence,
                compute_secs: draft_secs,
                wall_secs: draft_wall,
            } = proposal;
            // More drafts than asked for: refused here, the round is a plain target step.
            if drafts.len() > plan.k + branches {
                let refusal = DraftRefusal::new(
                    plan.k + branches,
                    RefusalReason::TooManyDrafts,
                    format!("{} drafts, {} asked for", drafts.len(), plan.k + branches),
                );
                tracing::info!(%refusal, "draft block refused");
                self.refused(&mut stats, &mut model, refusal.reason.as_str(), || {
                    refusal.to_string()
                });
                (drafts, q, parents) = (Vec::new(), Vec::new(), Vec::new());
            }
            stats.base.draft_seconds += draft_secs;
            let expected_verify = policy.expected_verify_seconds(drafts.len() + 1);
            let verify_start = Instant::now();
            // The verify's own time, whatever the draft-node does meanwhile.
            let verify = async {
                let verdict = self
                    .verify(&mut target, &log, (&drafts, &q, &parents), expected_verify)
                    .instrument(
                        tracing::info_span!(parent: &round, "verify", drafts = drafts.len()),
                    )
                    .await;
                (verdict, verify_start.elapsed().as_secs_f64())
            };
            // While the target verifies, the draft-node drafts the block that follows if every
            // draft of the chain (a tree's drafts before its first sibling) is accepted, of this
            // block's shape (docs/architecture.md "Pipelined"), when it fits in the verify's time and in
            // what the generation has left, and where it is expected to pay (a poor draft's
            // chain is seldom accepted whole): at least this round's K (a chain cut short too),
            // and one longer where K is adaptive ([`KPolicy::ahead_len`]); the next round takes
            // the part it planned, so rounds fall where they would without drafting ahead. The
            // drafts go back to the draft-node unverified: ids outside the vocabulary (a lying
            // draft) would make it refuse the step, so such a block is not drafted past.
            let k = crate::drafting::drafters::chain_len(&parents, drafts.len());
            let want = k.max(plan.k);
            let vocab = self.target().info.vocab_size;
            let next = policy.ahead_len(want);
            let next =
                if job.adaptive { next } else { next.min(want) }.min(max_draft.saturating_sub(1));
            // Sampled, a tree drafted ahead would not be the tree the next step grows (its nodes
            // beside the chain are the best of a larger tree): a seeded generation would then
            // depend on when drafting ahead paid. A chain drafted ahead is the chain the step
            // draws.
            let ahead_k = Some(next).filter(|&next| {
                k > 0
                    && (branches == 0 || job.sampling.is_greedy())
                    && next >= want
                    && transcript.remaining() >= k + next + 2
                    && drafts[..k].iter().all(|&t| t < vocab)
            });
            let (verdict, drafted_next) = match (model.as_mut(), ahead_k) {
                (Some(m), Some(next))
                    if plan.drafter == Some(Drafter::Model) && m.session.is_some() =>
                {
                    let expected = policy.expected_draft_seconds(next + 1);
                    // Drafted whole: the part under the right guess is cut as the step would have
                    // cut it (below), so that blocks end where they would without drafting ahead.
                    let shape = Ask {
                        k: next + 1,
                        branches: (branches.min(next + 1)).min(max_draft.saturating_sub(next + 1)),
                        min_confidence: 0.0,
                    };
                    let (v, drafted) =
                        tokio::join!(verify, m.step_ahead(&log, &drafts[..k], shape, expected));
                    (v, Some((next, drafted)))
                }
                _ => (verify.await, None),
            };
            let (verdict, verify_wall) = verdict;
            let round_wall = round_start.elapsed().as_secs_f64();
            let verdict = match verdict {
                Ok(v) => v,
                Err(e) => break Err(e),
            };
            let verify_secs = verdict.compute_micros as f64 * 1e-6;
            stats.base.target_seconds += verify_secs;
            let accepted = verdict.accepted as usize;
            let tree = match super::tree::committed(&drafts, &parents, &verdict) {
                Ok(t) => t,
                Err(e) => break Err(e),
            };
            if let Some(right) = tree.sibling {
                let past_chain = if right { accepted - tree.chain.1 } else { 0 };
                policy.observe_sibling(past_chain);
            }
            if !parents.is_empty() {
                stats.tree_rounds += 1;
                stats.sibling_hits += u32::from(tree.sibling == Some(true));
            }
            if let Some(r) = &verdict.draft_refused {
                self.refused(&mut stats, &mut model, &r.reason, || r.message.clone());
            }
            // A block drafted ahead that failed or stalled was priced by `observe_stall`: the
            // round's wall time says nothing more about the drafter's cost.
            let ahead_tokens = match drafted_next {
                Some((next, Ok(_))) => next + 1,
                _ => 0,
            };
            let ahead_failed = matches!(drafted_next, Some((_, Err(_))));
            let drafted_next = match (drafted_next, model.as_mut()) {
                (Some((_, Ok(next))), _) => Some(next),
                (Some((next, Err(e))), Some(m)) => {
                    stats.draft_failed(e, m, &mut policy, next + 1);
                    None
                }
                _ => None,
            };
            // The draft's compute the round waited for: its step, and of a block drafted during
            // the verify what ran past the verdict.
            let mut draft_waited = draft_secs;
            if let Some(next) = drafted_next {
                stats.pipeline_rounds += 1;
                stats.draft_node_tokens += next.tokens.len() as u32;
                stats.base.draft_seconds += next.compute_secs;
                draft_waited += (next.compute_secs - verify_wall).max(0.0);
                if tree.chain == (k, k) && accepted == k {
                    let under = next.under(verdict.next_token);
                    policy.observe_guess(under.is_some());
                    ahead = under
                        .map(|p| p.cut(min_confidence))
                        .filter(|p| !p.tokens.is_empty());
                }
            }
            let drafter = plan.drafter.filter(|_| !drafts.is_empty());
            load = (load.0 + self.active(), load.1 + 1);
            match drafter {
                Some(Drafter::Model) => stats.model_rounds += 1,
                Some(Drafter::Ngram) => stats.ngram_rounds += 1,
                None => stats.target_only_rounds += 1,
            }
            // The policy learns the chain's acceptance by depth (siblings: observe_sibling), and
            // by the draft's confidence.
            let (chain, chain_accepted) = tree.chain;
            if drafter == Some(Drafter::Model) && parents.is_empty() && confidence.len() == chain {
                policy.observe_confidence(&confidence, chain_accepted);
            }
            policy.observe(
                Plan { drafter, k: chain },
                &RoundCosts {
                    drafted: chain,
                    siblings: drafts.len() - chain,
                    drafted_ahead,
                    drafted_next: ahead_tokens,
                    accepted: chain_accepted,
                    draft_wall,
                    draft_compute: draft_secs,
                    verify_wall,
                    round_wall: if ahead_failed { 0.0 } else { round_wall },
                },
            );
            stats.base.record_round(drafts.len(), accepted);
            stats.draft_waited_seconds += draft_waited;
            let wall = round_start.elapsed().as_secs_f64();
            self.metrics.round(
                drafter,
                (drafts.len(), accepted),
                wall,
                draft_waited,
                verify_secs,
            );
            let commit = match transcript.commit(&tree.tokens) {
                Ok(c) => c,
                Err(e) => break Err(e.into()),
            };
            log.extend(&commit.tokens);
            shadow.compare(&log, &mut policy);
            if plan.drafter != Some(Drafter::Model)
                && !(job.adaptive && self.crowded())
                && let Some(m) = model.as_mut()
            {
                if shadow.due(policy.model_could_pay()) {
                    let k = shadow_k(transcript.remaining());
                    if k > 0 {
                        m.time_in_background(&log, k);
                    }
                } else if policy.catch_up_soon(!self.draft_shares_cores) {
                    m.catch_up_in_background(&log);
                }
            }
            let n = commit.tokens.len().min(verdict.logprobs.len());
            logprobs.extend_from_slice(&verdict.logprobs[..n]);
            if !sink.send(&commit, &verdict.logprobs[..n]).await {
                break Err(Error::Cancelled);
            }
            self.metrics
                .streamed(&mut last_commit, prefill_start, commit.tokens.len());
        };
        stats.base.decode_seconds = decode_start.elapsed().as_secs_f64();
        // Fixed-K sessions measure the same costs and acceptance: every session teaches.
        self.learnt.keep(load.0 as f64 / load.1 as f64, policy);
        stats.settle(&target);
        target.close();
        if let Some(m) = model.as_mut() {
            stats.draft_reattached = m.reattached;
            if let Some(d) = m.detach() {
                stats.settle(&d);
                d.close();
            }
        }
        let finish_reason = result?;
        let (text, token_ids) = transcript.into_output();
        stats.base.generated_tokens = token_ids.len();
        Ok(Outcome {
            text,
            token_ids,
            finish_reason,
            stats,
            logprobs,
        })
    }

    /// This round's drafter and K (the request's fixed K, or the policy's choice), and the
    /// n-gram lookup's proposal when n-gram drafting was considered (looked up once: the choice
    /// weighs its length, the round uses its tokens).
    fn plan(
        &self,
        job: &Job,
        policy: &mut KPolicy,
        (log, grammar): (&TokenLog, Option<&mut Constraint>),
        attached: bool,
        remaining: usize,
    ) -> (Plan, Proposal) {
        let cap = job.draft_tokens.min(remaining.saturating_sub(1));
        if !job.adaptive {
            let plan = match cap {
                0 => Plan::TARGET_ONLY,
                k => Plan {
                    drafter: Some(fixed_drafter(job.drafter, attached)),
                    k,
                },
            };
            let ngram = match plan.drafter {
                // A fixed request's siblings: the n-gram drafter's other continuations.
                Some(Drafter::Ngram) => {
                    ngram_proposal(log, (cap, job.branches.unwrap_or(0).min(cap)), grammar).0
                }
                _ => Proposal::default(),
            };
            return (plan, ngram);
        }
        if self.crowded() {
            return (Plan::TARGET_ONLY, Proposal::default());
        }
        let (ngram, matched) = if job.drafter.uses_ngram() {
            ngram_proposal(log, (cap, 0), grammar)
        } else {
            (Proposal::default(), 0)
        };
        let plan = policy.choose(
            attached && job.drafter.uses_model(),
            NgramOffer {
                len: ngram.tokens.len(),
                matched,
            },
            remaining,
        );
        (plan, ngram)
    }

    /// Counts a refused block; at [`MAX_REFUSED_BLOCKS`] the draft is detached for good.
    fn refused(
        &self,
        stats: &mut Stats,
        model: &mut Option<ModelDrafter>,
        reason: &str,
        message: impl FnOnce() -> String,
    ) {
        self.metrics.draft_blocks_refused.add(reason, 1);
        stats.draft_blocks_refused += 1;
        if stats.draft_blocks_refused >= MAX_REFUSED_BLOCKS
            && let Some(mut m) = model.take()
        {
            let why = format!(
                "{} drafted blocks refused, the last: {}",
                stats.draft_blocks_refused,
                message()
            );
            tracing::warn!(reason = %why, "detaching the draft: going on without it");
            stats.draft_reattached = m.reattached;
            if let Some(d) = m.detach() {
                stats.settle(&d);
                d.close();
            }
            stats.lose_draft(why);
        }
    }
}

mod verify;

struct ActiveGuard<'a>(&'a AtomicUsize);

impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
