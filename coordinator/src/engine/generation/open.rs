//! How a generation starts: its sessions opened on both nodes at once, each on the least loaded
//! replica of its node; the draft-node's waited for no longer than the target's took (a silent
//! link costs a generation nothing: it starts target-only and attaches later), and left out
//! where it cannot pay.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use tandem_runtime::{TokenLog, Transcript};
use tokio::sync::Notify;

use super::Generation;
use crate::drafting::Drafters;
use crate::drafting::model::ModelDrafter;
use crate::drafting::ngram::NgramDrafter;
use crate::drafting::shadow::Shadow;
use crate::engine::metrics::Counted;
use crate::engine::{Engine, Job, Stats};
use crate::nodes::links::{Draft, NodeSession, SessionSpec, Target};
use crate::nodes::replicas::{Opened, Replicas};

/// One adaptive generation in this many opens a draft that could not pay, to time it again (a
/// link that got faster)...
const RETIME_EVERY: usize = 8;
/// ...or in this many where the draft runs on the target's cores: no link there, the costs are
/// the machine's, and each retime's session and background steps slowed the target (on the
/// embedded pair, one generation in 8 cost the median a per cent).
const RETIME_EVERY_SHARING_CORES: usize = 64;

/// The draft-node's session as it opened (or why not), and how long it took.
type DraftOpened = Option<(Opened<Draft>, f64)>;

impl<'e> Generation<'e> {
    /// Opens `job`'s sessions and starts its generation; an error where the target's session
    /// cannot open (the draft's costs only speed).
    pub(in crate::engine) async fn open(engine: &'e Engine, job: &'e Job) -> Result<Self> {
        let id = engine.next_id.fetch_add(1, Ordering::Relaxed);
        let spec = SessionSpec {
            session_id: format!("gen-{id}"),
            sampling: job.sampling.clone(),
            max_len: job.prompt.len() + job.max_new_tokens,
            top_logprobs: job.top_logprobs,
            constraint: job.constraint.clone(),
            cache_salt: job.cache_salt.clone(),
        };
        let log = TokenLog::new(&job.prompt);
        let grammar = engine.grammars.state(job.constraint.as_ref())?;
        let prefill_start = Instant::now();
        // The costs and acceptance of the last session at this load, or (the first time) priors;
        // a first probe of the draft is then expected to cost about what opening its session
        // did.
        let active = engine.active();
        let mut policy = engine.learnt.start(active, job.draft_tokens);
        policy.set_pipelining(
            job.pipeline
                && !(engine.passes_take_turns() || job.adaptive && engine.draft_shares_cores),
        );
        // A draft that could not pay at the costs of the last session at this load even if
        // always right is left out of adaptive generations but one in [`RETIME_EVERY`] (or
        // [`RETIME_EVERY_SHARING_CORES`]), which opens it and times it again: its session, its
        // background steps and their gRPC work on the coordinator's core cost a fast target a
        // few per cent for nothing.
        let retime = job.adaptive && !policy.model_could_pay();
        let drafts = engine
            .draft
            .get()
            .filter(|_| uses_draft(engine, job, retime));
        let (target, draft) = open_sessions(engine, drafts, &spec, &log).await;
        let target = target.session?;
        engine
            .metrics
            .queue_time
            .observe(target.queued.as_secs_f64());
        let leases = (
            engine.targets.lease(target.replica),
            draft.as_ref().zip(drafts).and_then(|((o, _), d)| {
                let session = o.session.as_ref().ok()?;
                Some(d.lease(session.replica))
            }),
        );
        let model = draft.as_ref().zip(drafts).map(|((opened, _), d)| {
            let fallbacks = d.fallbacks(&opened.handle);
            ModelDrafter::new(fallbacks, spec.clone(), None, engine.draft_step_slack)
        });
        let mut generation = Self {
            engine,
            job,
            stats: Stats {
                seed: job.sampling.seed,
                cached_tokens: target.cached_tokens,
                ..Stats::default()
            },
            target,
            _leases: leases,
            drafters: Drafters {
                model,
                // The tenant's earlier outputs, where n-gram lookup may draft and what it drafts
                // may differ from run to run.
                ngram: NgramDrafter::with_history(
                    (job.drafter.uses_ngram() && job.blocks_may_vary())
                        .then(|| engine.history.of(&job.cache_salt))
                        .flatten(),
                ),
            },
            policy,
            load: (active, 1),
            log,
            grammar,
            transcript: Transcript::new(
                &engine.tokenizer,
                &job.stop_token_ids,
                &job.stop_strings,
                job.max_new_tokens,
            ),
            shadow: Shadow::new(
                job.adaptive && job.sampling.is_greedy(),
                engine.draft_shares_cores,
            ),
            max_draft: drafts.map_or(0, |d| d.primary().limits().max_draft_tokens as usize),
            logprobs: Vec::new(),
            prefill_start,
            decode_start: prefill_start,
            last_commit: None,
        };
        generation.attach(draft.map(|(opened, secs)| (opened.session, secs)), retime);
        let prefill = prefill_start.elapsed().as_secs_f64();
        generation.stats.base.prefill_seconds = prefill;
        engine.metrics.prefill_time.observe(prefill);
        generation.decode_start = Instant::now();
        Ok(generation)
    }

    /// Attaches the draft-node's session where it opened (timed beside the first rounds where
    /// it never was, or is timed again); where it did not, the generation starts target-only
    /// and attaches it in the background.
    fn attach(&mut self, draft: Option<(Result<NodeSession<Draft>>, f64)>, retime: bool) {
        let (Some((session, open_secs)), Some(m)) = (draft, self.drafters.model.as_mut()) else {
            return;
        };
        match session {
            Ok(session) => {
                m.session = Some(session);
                self.policy.set_first_probe_cost(open_secs);
                // A draft-node never timed (or timed again) is timed beside the first rounds,
                // which do not wait.
                let k = self.shadow_k(self.job.max_new_tokens);
                let untimed = retime || !self.policy.draft_timed();
                if self.job.adaptive && untimed && k > 0 && !self.engine.crowded() {
                    let m = self.drafters.model.as_mut().expect("attached above");
                    m.time_in_background(&self.log, k);
                }
            }
            Err(e) => {
                // Down, or not open in time beside the target's session: logged where found.
                if matches!(e, Error::NotReady(_) | Error::TimedOut { .. }) {
                    tracing::debug!(error = %e, "draft-node unavailable: decoding without it");
                } else {
                    tracing::warn!(error = %e, "draft-node unavailable: decoding without it");
                }
                m.reattach_later(&self.log);
                (self.stats).lose_draft(format!("the draft-node was unavailable: {e}"));
            }
        }
    }
}

/// Whether `job` opens a draft session: it drafts with the model, and (`retime`: a draft that
/// could not pay) this is the generation in [`RETIME_EVERY`] that times it again.
fn uses_draft(engine: &Engine, job: &Job, retime: bool) -> bool {
    let every = if engine.draft_shares_cores {
        RETIME_EVERY_SHARING_CORES
    } else {
        RETIME_EVERY
    };
    job.draft_tokens > 0
        && job.max_new_tokens > 1
        && job.drafter.uses_model()
        && (!retime
            || engine
                .hopeless
                .fetch_add(1, Ordering::Relaxed)
                .is_multiple_of(every))
}

/// Opens the target's session and (where `drafts` is given) the draft's at once, each on the
/// least loaded replica of its node, counted as waiting until both are done.
async fn open_sessions(
    engine: &Engine,
    drafts: Option<&Replicas>,
    spec: &SessionSpec,
    log: &TokenLog,
) -> (Opened<Target>, DraftOpened) {
    let _waiting = Counted::new(&engine.metrics.waiting);
    let target_opened = Notify::new();
    tokio::join!(
        async {
            let i = engine.targets.pick_for(&spec.cache_salt, log.tokens());
            let opened = engine.targets.open::<Target>(i, spec, log).await;
            target_opened.notify_one();
            opened
        },
        async {
            let d = drafts?;
            // Beside the target in this process (the all-in-one mode) there is no link to go
            // silent, and the draft's open competes with the target's for the same cores: it is
            // waited for, within its own deadline.
            let grace = (!engine.draft_shares_cores).then_some(engine.draft_open_grace);
            Some(open_draft(d, (spec, log), &target_opened, grace).await)
        }
    )
}

/// The least a draft session's open is waited for once the target's has opened (the engine's
/// `draft_open_grace` unless set).
pub const DRAFT_GRACE: Duration = Duration::from_millis(250);

/// Opens a generation's draft session beside its target session, and how long that took in
/// seconds. Where every draft replica is down, it fails at once (`NotReady`, no call made); once
/// the target's session is open (`target_opened` notified), the draft's is waited for at most as
/// long again as the target's took, and at least `grace` ([`DRAFT_GRACE`]; `None`: no cut but
/// the open's own deadline); past that it is abandoned (`TimedOut`): the generation starts with
/// the target alone and attaches the draft in the background. A generation so never waits on a
/// silent draft-node.
async fn open_draft(
    drafts: &Replicas,
    (spec, log): (&SessionSpec, &TokenLog),
    target_opened: &Notify,
    grace: Option<Duration>,
) -> (Opened<Draft>, f64) {
    let i = drafts.pick_for(&spec.cache_salt, log.tokens());
    if let Some(why) = drafts.all_down() {
        return (drafts.refused(i, Error::NotReady(why)), 0.0);
    }
    let start = Instant::now();
    let cut = async {
        target_opened.notified().await;
        let Some(grace) = grace else {
            return std::future::pending().await;
        };
        let grace = start.elapsed().max(grace);
        tokio::time::sleep(grace).await;
        grace
    };
    let opened = tokio::select! {
        opened = drafts.open::<Draft>(i, spec, log) => opened,
        grace = cut => {
            let e = Error::TimedOut { node: "draft-node", secs: start.elapsed().as_secs_f64() };
            tracing::info!(?grace, "draft session not open in time: starting with the target alone");
            drafts.refused(i, e)
        }
    };
    (opened, start.elapsed().as_secs_f64())
}
