//! The coordinator's engine: [`Engine`] holds what every generation shares (the nodes'
//! replicas, the tokenizer, the metrics, what sessions learnt) and runs [`Job`]s (the APIs check
//! each request into one: `crate::api::request`); [`generation`] runs one job's rounds in
//! phases (docs/architecture.md "Data flow of one round"). Beside them: what a generation is
//! asked and gives back ([`job`]), a generation's statistics ([`stats`]), what sessions
//! learnt for the next to start from (`learnt`), the coordinator's metrics ([`metrics`]), an
//! engine that may still be connecting ([`late_engine`]), the engine of the in-process cluster
//! ([`local`]), and the nodes timed before the first request ([`warm_up`]).
//!
//! Uses [`crate::drafting`] and [`crate::nodes`]; the APIs above it use it.

pub mod generation;
pub mod history;
pub mod job;
pub mod late_engine;
mod learnt;
pub mod local;
pub mod metrics;
pub mod stats;
pub mod warm_up;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use tandem_proto::tls::ClientTls;
use tandem_runtime::Tokenizer;

use crate::constraints::Grammars;
use crate::nodes::replicas::Replicas;
use crate::nodes::{CALL_FLOOR, LateDraft, NodeHandle};
use generation::{DRAFT_GRACE, Generation};
use history::History;
pub use job::{CommitSink, Discard, Job, MAX_STOP_TOKEN_IDS, Outcome};
pub use late_engine::LateEngine;
use learnt::Learnt;
use metrics::CoordinatorMetrics;
pub use stats::Stats;

/// Refused blocks after which a generation detaches its draft.
pub const MAX_REFUSED_BLOCKS: u32 = 3;

/// Default generation length when a request names none.
pub const DEFAULT_MAX_TOKENS: usize = 256;

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
    /// least: past it the generation starts with the target alone.
    pub draft_open_grace: Duration,
    /// A target call's deadline floor ([`crate::nodes::call_deadline`]): a call later than that, on a node
    /// that neither works on it nor has answered it, is taken for lost and its session replayed.
    pub call_floor: Duration,
    /// What the last session at each load learnt of the nodes' costs and the draft's acceptance.
    learnt: Learnt,
    /// Each tenant's earlier outputs, continued by the n-gram drafter (`--history-tokens`).
    pub history: History,
    /// Adaptive generations that started with a draft that could not pay.
    hopeless: AtomicUsize,
    /// Compiles requests' grammars to check them (built at the first one).
    pub(crate) grammars: Grammars,
    active: AtomicUsize,
    next_id: AtomicUsize,
}

impl Engine {
    /// Connects to the nodes (TLS for `https://` URLs), fetches the target's tokenizer, and
    /// refuses a draft whose vocabulary differs from the target's.
    pub async fn connect(
        targets: &[String],
        drafts: &[String],
        default_draft_tokens: Option<usize>,
        tls: &ClientTls,
    ) -> Result<Self> {
        let targets = Replicas::connect("target-node", targets, tls).await?;
        let target = targets.primary().clone();
        let cpu_target = target.on_cpu();
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
        let tokenizer = target.tokenizer("target-node").await?;
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
            draft_step_slack: crate::drafting::model::DEFAULT_STEP_SLACK,
            draft_open_grace: DRAFT_GRACE,
            call_floor: CALL_FLOOR,
            learnt: Learnt::default(),
            history: History::default(),
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

    /// Starts sessions from what `path` holds (`--policy-file`) where it was learnt on these
    /// models and machines, and saves what they learn there. Returns why it was not used, where
    /// it could not be (it is replaced at the first save).
    pub fn learn_in(&mut self, path: &std::path::Path) -> Option<String> {
        let describe = |node: &NodeHandle| {
            let info = &node.info;
            format!(
                "{} on {} ({} CPUs)",
                info.model_name,
                info.device,
                info.cpus.len()
            )
        };
        let draft = self
            .draft
            .get()
            .map_or_else(|| "none".to_string(), |d| describe(d.primary()));
        let pair = format!("target {} · draft {draft}", describe(self.target()));
        let (learnt, why) = Learnt::open(path, &pair);
        self.learnt = learnt;
        why
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
        self.draft_shares_cores
            && self.target().on_cpu()
            && self.draft.get().is_some_and(|d| d.primary().on_cpu())
    }

    /// Whether more generations run than adaptive K speculates for ([`Self::max_speculating`]).
    fn crowded(&self) -> bool {
        self.max_speculating.is_some_and(|n| self.active() > n)
    }

    pub(crate) fn count_error(&self, e: &Error) {
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
        self.active.fetch_add(1, Ordering::Relaxed);
        let _active = ActiveGuard(&self.active);
        let outcome = match Generation::open(self, job).await {
            Ok(generation) => generation.run(sink).await,
            Err(e) => Err(e),
        };
        match &outcome {
            Ok(o) => self.metrics.finished(o, start.elapsed().as_secs_f64()),
            Err(e) => self.count_error(e),
        }
        outcome
    }
}

/// Counts a generation as running while it lives.
struct ActiveGuard<'a>(&'a AtomicUsize);

impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
