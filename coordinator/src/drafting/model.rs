//! The model drafter: the draft-node's model over its session stream. A draft-node that fails
//! or misses its deadline is dropped for the round (never awaited) and attached again in the
//! background, with backoff, by replaying the log into a new session; meanwhile the rounds run
//! on n-gram drafts or the target alone. Between its rounds the idle session is lent to
//! background steps (a catch-up, a timing); during a verify it drafts the next block ahead.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use tandem_runtime::TokenLog;
use tokio::sync::oneshot;

use super::block::{Ask, DraftBlock, StepFailure, chain_len};
use super::policy::Timing;
use super::{Propose, Proposing};
use crate::nodes::Reachable;
use crate::nodes::links::{Draft, NodeSession, SessionSpec};

/// First and largest wait before attaching a lost draft-node again.
const REATTACH_FIRST: Duration = Duration::from_millis(50);
const REATTACH_MAX: Duration = Duration::from_secs(10);
/// A draft step is abandoned after this multiple of its expected time, plus a slack (the
/// coordinator's `--draft-step-slack-ms`, [`DEFAULT_STEP_SLACK`] unless set). (Generous: an
/// abandoned step costs a re-attachment, a replay of the log on the draft-node.)
const DEADLINE_FACTOR: f64 = 8.0;
pub const DEFAULT_STEP_SLACK: Duration = Duration::from_millis(500);
/// Deadline of a draft step before any has been timed (the first steps warm the node up).
const FIRST_DEADLINE: Duration = Duration::from_secs(10);

/// The draft-node side of a generation: its session when attached and idle; a background task
/// holding it while it catches up, or opening a new one after a loss, when not.
#[derive(Debug)]
pub struct ModelDrafter {
    /// The draft replica the session opened on, then the others, to re-attach to when it does
    /// not answer (each only while it is not down).
    channels: Vec<Reachable>,
    /// Which of them the session is on (or was last tried).
    current: usize,
    attempts: usize,
    spec: SessionSpec,
    pub session: Option<NodeSession<Draft>>,
    pending: Option<(Background, oneshot::Receiver<Result<Lent>>)>,
    backoff: Duration,
    /// Sessions attached again after a loss.
    pub reattached: u32,
    /// Added to a timed step's deadline.
    slack: Duration,
    /// A block drafted during the last verify, when a guess of the bonus token was right: the
    /// next round's drafts, ready without asking ([`Self::hold_ahead`]).
    ahead: Option<DraftBlock>,
}

/// What a background task does with the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Background {
    /// Opens a new one, after a loss.
    Reattach,
    /// Feeds the tokens committed while the draft sat idle (a step with K = 0).
    CatchUp,
    /// Drafts K tokens nobody uses, to time the draft-node without a round waiting for it.
    Time,
}

/// A session back from a background task, with the step it timed when it ran one.
type Lent = (NodeSession<Draft>, Option<Timing>);

/// A draft-node at least this many committed tokens behind is worth catching up.
const CATCH_UP_LAG: usize = 2;
/// A background task (a re-attachment, a catch-up, a timing) that has not answered in this long,
/// plus [`BACKGROUND_PER_TOKEN`] for each token it may have to feed, is a loss.
const BACKGROUND_DEADLINE: Duration = Duration::from_secs(10);
/// A re-attachment replays the whole log: on a CPU draft of 0.5B parameters prefill runs at a
/// few hundred tokens/s, so a long prompt alone can take longer than the flat deadline.
const BACKGROUND_PER_TOKEN: Duration = Duration::from_millis(20);

/// Drafts `k` tokens past `log` on `session`, timed as a round's step is: the gap since the
/// session last drafted (a few target-only rounds' tokens, more where steps are spaced out) is
/// fed first, timed apart, so that the step feeds one token, as a step after a target-only
/// round does. A draft-node that sends more than asked is not believed past `k`. (A background
/// timing step's, and the engine's warm-up's.)
pub(crate) async fn time_step(
    session: &mut NodeSession<Draft>,
    log: &TokenLog,
    k: usize,
) -> Result<Timing> {
    let began = Instant::now();
    let from = log.len();
    let fed = fed_before_step(from, session.held_len());
    if fed > 0 {
        session
            .draft(&TokenLog::new(&log.tokens()[..from - 1]), Ask::default())
            .await?;
    }
    let start = Instant::now();
    let mut p = session.draft(log, Ask::chain(k)).await?;
    p.tokens.truncate(k);
    Ok(Timing {
        k: p.tokens.len(),
        wall_secs: start.elapsed().as_secs_f64(),
        compute_secs: p.compute_secs,
        task_secs: began.elapsed().as_secs_f64(),
        fed,
        from,
        tokens: p.tokens,
    })
}

/// Tokens a timing step past a log of `len` feeds before its step, on a session that holds
/// `held` ([`time_step`]): the gap but the last token, where it is at least [`CATCH_UP_LAG`].
fn fed_before_step(len: usize, held: usize) -> usize {
    let gap = len.saturating_sub(held);
    if gap >= CATCH_UP_LAG { gap - 1 } else { 0 }
}

/// The deadline of a background task that may feed up to `tokens` tokens.
fn background_deadline(tokens: usize) -> Duration {
    BACKGROUND_DEADLINE + BACKGROUND_PER_TOKEN * u32::try_from(tokens).unwrap_or(u32::MAX)
}

impl ModelDrafter {
    /// The draft side over `channels` (its replica first; at least one).
    /// `slack`: added to a timed step's deadline ([`DEFAULT_STEP_SLACK`]).
    pub fn new(
        channels: Vec<Reachable>,
        spec: SessionSpec,
        session: Option<NodeSession<Draft>>,
        slack: Duration,
    ) -> Self {
        Self {
            slack,
            channels,
            current: 0,
            attempts: 0,
            spec,
            session,
            pending: None,
            backoff: REATTACH_FIRST,
            reattached: 0,
            ahead: None,
        }
    }

    /// Whether the session is attached and idle: the model can draft.
    pub fn attached(&self) -> bool {
        self.session.is_some()
    }

    /// Whether the idle session is at least [`CATCH_UP_LAG`] committed tokens behind `log`: its
    /// next draft step would feed them first.
    pub fn behind(&self, log: &TokenLog) -> bool {
        self.session
            .as_ref()
            .is_some_and(|s| log.len().saturating_sub(s.held_len()) >= CATCH_UP_LAG)
    }

    /// Tokens a timing step past `log` would feed before its drafts ([`time_step`]); 0 where
    /// the session is not attached and idle.
    pub fn fed_before_step(&self, log: &TokenLog) -> usize {
        self.session
            .as_ref()
            .map_or(0, |s| fed_before_step(log.len(), s.held_len()))
    }

    /// Whether the draft-node is computing for a background task (a catch-up or a timing step;
    /// not a re-attachment, which mostly waits): a target step now runs beside it.
    pub fn working_in_background(&self) -> bool {
        self.pending
            .as_ref()
            .is_some_and(|(kind, _)| *kind != Background::Reattach)
    }

    /// Holds `block`, drafted during a verify, for the next round to take without asking; or
    /// drops the one held (`None`: the guess was wrong, or the round drafts otherwise).
    pub fn hold_ahead(&mut self, block: Option<DraftBlock>) {
        self.ahead = block.filter(|b| !b.tokens.is_empty());
    }

    /// The chain's length of the block held ready ([`Self::hold_ahead`]); 0 where none is.
    pub fn held(&self) -> usize {
        self.ahead
            .as_ref()
            .map_or(0, |b| chain_len(&b.parents, b.tokens.len()))
    }

    /// Takes back a session a background task has finished with, and the timing of the step it
    /// ran, if it timed one; a failed task (a re-attachment that could not connect, a catch-up
    /// that failed) starts a re-attachment after a longer wait.
    pub fn poll(&mut self, log: &TokenLog) -> Option<Timing> {
        let (kind, rx) = self.pending.as_mut()?;
        let kind = *kind;
        match rx.try_recv() {
            Ok(Ok((session, step))) => {
                if kind == Background::Reattach {
                    tracing::info!("draft-node attached again");
                    self.reattached += 1;
                    // The replica that answered is the one to try first next time.
                    self.attempts = self.attempts.saturating_sub(1);
                }
                self.pending = None;
                self.session = Some(session);
                return step;
            }
            Ok(Err(e)) => {
                tracing::info!(error = %e, ?kind, retry_in = ?self.backoff, "draft-node unavailable");
                self.pending = None;
                self.reattach_later(log);
            }
            Err(oneshot::error::TryRecvError::Empty) => {}
            Err(oneshot::error::TryRecvError::Closed) => {
                self.pending = None;
                self.reattach_later(log);
            }
        }
        None
    }

    /// Starts attaching the draft-node again in the background, after the current backoff: its
    /// own replica first, then the others in turn, skipping those that are down (where all are,
    /// the attempt fails at once and the next comes after a longer wait). An open that misses its
    /// deadline marks its replica down.
    pub fn reattach_later(&mut self, log: &TokenLog) {
        let wait = self.backoff;
        self.backoff = (self.backoff * 2).min(REATTACH_MAX);
        let (tx, rx) = oneshot::channel();
        let n = self.channels.len().max(1);
        self.current = self.attempts % n;
        self.attempts += 1;
        let channels = self.channels.clone();
        let first = self.current;
        let (spec, log) = (self.spec.clone(), log.clone());
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            // The generation ended, or another attempt replaced this one: open nothing.
            if tx.is_closed() {
                return;
            }
            let up = (first..first + n)
                .map(|i| &channels[i % n])
                .find(|r| !r.health.is_down());
            let Some(replica) = up else {
                let why = channels[first].health.why_down().unwrap_or_default();
                let _ = tx.send(Err(Error::NotReady(why)));
                return;
            };
            let deadline = background_deadline(log.len());
            let open = NodeSession::<Draft>::open(replica.channel.clone(), spec, &log);
            let opened = match tokio::time::timeout(deadline, open).await {
                Ok(opened) => opened,
                Err(_) => {
                    let what = format!("a draft session's open within {deadline:?}");
                    replica.health.missed(&what);
                    Err(Error::Unavailable {
                        node: "draft-node",
                        endpoint: String::new(),
                        reason: format!("no session opened within {deadline:?}"),
                    })
                }
            };
            if opened.is_ok() {
                replica.health.answered();
            }
            let _ = tx.send(opened.map(|session| (session, None)));
        });
        self.pending = Some((Background::Reattach, rx));
    }

    /// Lends the idle session to a background task that feeds it what was committed since it
    /// last drafted, when that is at least [`CATCH_UP_LAG`] tokens: the next draft step then
    /// drafts at once instead of first prefilling the gap. The round never waits for it. Called
    /// when the policy expects the model soon ([`crate::drafting::policy::KPolicy::catch_up_soon`]): where
    /// the draft shares the target's cores (the all-in-one mode) only before a probe, as
    /// catching up every few tokens would double the work.
    pub fn catch_up_in_background(&mut self, log: &TokenLog) {
        if self.behind(log) {
            self.lend(log, Background::CatchUp, 0);
        }
    }

    /// Lends the idle session to a background task that drafts `k` tokens nobody uses: the
    /// draft-node's cost is then known ([`Self::poll`] returns it) without a round having waited
    /// for it. A session starts with this when its draft-node has never been timed: a first
    /// probe in the rounds would otherwise be priced at the whole session's opening.
    pub fn time_in_background(&mut self, log: &TokenLog, k: usize) {
        self.lend(log, Background::Time, k);
    }

    /// Runs a step of `k` on the idle session in a background task.
    fn lend(&mut self, log: &TokenLog, kind: Background, k: usize) {
        let Some(mut session) = self.session.take() else {
            return;
        };
        let (tx, rx) = oneshot::channel();
        let log = log.clone();
        let deadline = background_deadline(log.len().saturating_sub(session.held_len()) + k);
        let health = self.channels.get(self.current).map(|r| r.health.clone());
        tokio::spawn(async move {
            let run = async {
                if kind == Background::Time {
                    time_step(&mut session, &log, k).await.map(Some)
                } else {
                    session.draft(&log, Ask::chain(k)).await.map(|_| None)
                }
            };
            let result = match tokio::time::timeout(deadline, run).await {
                Ok(Ok(timing)) => Ok((session, timing)),
                Ok(Err(e)) => Err(e),
                Err(_) => {
                    let what = format!("a background {kind:?} step within {deadline:?}");
                    if let Some(h) = &health {
                        h.missed(&what);
                    }
                    Err(Error::Unavailable {
                        node: "draft-node",
                        endpoint: String::new(),
                        reason: format!("no answer to a background step within {deadline:?}"),
                    })
                }
            };
            let _ = tx.send(result);
        });
        self.pending = Some((kind, rx));
    }

    /// Asks the attached draft-node for `k` drafts within a deadline `expected` seconds long
    /// times [`DEADLINE_FACTOR`], plus the slack (a first step gets [`FIRST_DEADLINE`]). On failure or timeout
    /// the session is dropped and re-attachment starts; the error says which.
    async fn step(
        &mut self,
        log: &TokenLog,
        ask: Ask,
        expected: Option<f64>,
    ) -> Result<DraftBlock, StepFailure> {
        self.step_from(log, log, ask, expected).await
    }

    /// [`Self::step`] on `log`, re-attaching from `committed` (a prefix of it) on failure.
    async fn step_from(
        &mut self,
        log: &TokenLog,
        committed: &TokenLog,
        ask: Ask,
        expected: Option<f64>,
    ) -> Result<DraftBlock, StepFailure> {
        let Some(session) = self.session.as_mut() else {
            return Err(StepFailure::Failed(Error::Unavailable {
                node: "draft-node",
                endpoint: String::new(),
                reason: "not attached".into(),
            }));
        };
        let deadline = expected.map_or(FIRST_DEADLINE, |secs| {
            Duration::from_secs_f64(secs * DEADLINE_FACTOR) + self.slack
        });
        let start = Instant::now();
        let call = session.draft(log, ask);
        let outcome = match tokio::time::timeout(deadline, call).await {
            Ok(r) => r.map_err(StepFailure::Failed),
            Err(_) => {
                if let Some(r) = self.channels.get(self.current) {
                    r.health
                        .missed(&format!("a draft step within {deadline:?}"));
                }
                Err(StepFailure::Stalled(deadline))
            }
        };
        match outcome {
            Ok(p) => {
                // The draft-node answers again: a later loss starts its backoff afresh.
                self.backoff = REATTACH_FIRST;
                Ok(DraftBlock::drafted(p, start.elapsed().as_secs_f64()))
            }
            Err(e) => {
                // The caller drops the session (counting its traffic) before the next round; a
                // new one is opened after the backoff, which doubles while the node keeps
                // failing or stalling (a node still busy with the abandoned step is not asked
                // again at once, round after round).
                self.reattach_later(committed);
                Err(e)
            }
        }
    }

    /// Drafts a block asked for by `ask` (K, and B more nodes: a tree) past `drafts` while the target
    /// verifies them (docs/architecture.md "Pipelined"): its first depth is the draft's guesses
    /// of the bonus token, the rest continue them, so that if every draft is accepted and a
    /// guess is the target's token, the next round's drafts are ready when the verdict comes
    /// ([`DraftBlock::under`]). A failure drops the session and re-attaches it from `log`, as
    /// after any failed step.
    pub async fn step_ahead(
        &mut self,
        log: &TokenLog,
        drafts: &[u32],
        ask: Ask,
        expected: Option<f64>,
    ) -> Result<DraftBlock, StepFailure> {
        let mut ahead = log.clone();
        ahead.extend(drafts);
        // On failure the session is re-attached from what is committed, not from the drafts
        // being verified.
        let proposal = self.step_from(&ahead, log, ask, expected).await?;
        if let Some(session) = self.session.as_mut() {
            session.hold_at_most(log.prefix());
        }
        // A q per token, or the block is not usable (a malformed reply).
        Ok(if proposal.q.len() == proposal.tokens.len() {
            proposal
        } else {
            DraftBlock::default()
        })
    }

    /// Detaches the session for good (a lying draft): no re-attachment.
    pub fn detach(&mut self) -> Option<NodeSession<Draft>> {
        self.pending = None;
        self.ahead = None;
        self.session.take()
    }
}

impl Propose for ModelDrafter {
    /// The block drafted during the last verify, where one is held (cut to the ask's size);
    /// else a step on the draft-node ([`Self::step`]).
    fn propose<'a>(
        &'a mut self,
        log: &'a TokenLog,
        ask: Ask,
        expected: Option<f64>,
    ) -> Proposing<'a> {
        if let Some(mut ready) = self.ahead.take() {
            ready.drafted_ahead = true;
            return Box::pin(std::future::ready(
                Ok(ready.truncated(ask.k + ask.branches)),
            ));
        }
        Box::pin(self.step(log, ask, expected))
    }
}
