//! Where a round's drafts come from: the draft-node's model over its session stream, or n-gram
//! lookup in the coordinator ([`crate::drafting::ngram`]). A draft-node that fails or misses its deadline
//! is dropped for the round (never awaited) and attached again in the background, with backoff,
//! by replaying the log into a new session; meanwhile the rounds run on n-gram drafts or the
//! target alone.

use std::time::{Duration, Instant};

use tandem_proto::v1;
use tandem_proto::{Error, Result};
use tandem_runtime::{Constraint, TokenLog};
use tokio::sync::oneshot;

use crate::constraints::cut;
use crate::drafting::policy::{DrafterKind, Timing};
use crate::nodes::Reachable;
use crate::nodes::links::{Draft, NodeSession, SessionSpec};

/// Who may draft, per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DrafterChoice {
    /// The draft-node, and n-gram lookup where it pays more (or when the draft-node is lost).
    #[default]
    Auto,
    /// The draft-node only.
    Model,
    /// N-gram lookup only: no draft-node session is opened.
    Ngram,
}

impl DrafterChoice {
    /// Parses the request's `drafter` field, naming the accepted values when it is unknown.
    pub fn parse(value: &str) -> Result<Self> {
        match value {
            "" | "auto" => Ok(Self::Auto),
            "model" => Ok(Self::Model),
            "ngram" => Ok(Self::Ngram),
            other => Err(tandem_runtime::Error::invalid(
                "drafter",
                format!("{other:?}"),
                "expected \"auto\", \"model\" or \"ngram\"",
            )
            .into()),
        }
    }

    pub fn uses_model(self) -> bool {
        self != Self::Ngram
    }

    pub fn uses_ngram(self) -> bool {
        self != Self::Model
    }
}

/// Why a draft-node step gave no drafts.
#[derive(Debug)]
pub enum StepFailure {
    /// It failed (the node or the link).
    Failed(Error),
    /// It did not answer within its deadline.
    Stalled(Duration),
}

impl std::fmt::Display for StepFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Failed(e) => write!(f, "{e}"),
            Self::Stalled(d) => write!(f, "no drafts within the deadline of {d:?}"),
        }
    }
}

/// A round's drafts.
#[derive(Debug, Default)]
pub struct DraftBlock {
    pub tokens: Vec<u32>,
    pub q: Vec<v1::Distribution>,
    /// A token tree's parents (`v1::VerifyBlock::parents`); empty for a chain.
    pub parents: Vec<u32>,
    /// A chain's: the draft model's confidence at each draft (`v1::Proposal::confidence`);
    /// empty for a tree and for n-gram lookup.
    pub confidence: Vec<f32>,
    /// The drafter's compute (the node's report; the lookup's own time).
    pub compute_secs: f64,
    /// From asking to having the drafts.
    pub wall_secs: f64,
}

impl DraftBlock {
    /// The first `k` drafts (and their q; a tree stays one, its parents before its children).
    pub fn truncated(mut self, k: usize) -> Self {
        self.tokens.truncate(k);
        self.q.truncate(k);
        self.parents.truncate(k);
        self.confidence.truncate(k);
        self
    }

    /// A chain cut where the draft was unsure, as the draft-node cuts the chains it drafts
    /// (`v1::DraftStep::min_confidence`): before its first draft past the first whose
    /// confidence is below `bound`. A tree, or a block without confidences, stays whole.
    pub fn cut(self, bound: f32) -> Self {
        if !self.parents.is_empty() || self.confidence.len() != self.tokens.len() {
            return self;
        }
        let n = self.tokens.len();
        let keep = (1..n).find(|&i| self.confidence[i] < bound).unwrap_or(n);
        self.truncated(keep)
    }

    /// Where a first draft (a chain's, or any of a tree's at its first depth) is `token`: the
    /// drafts under it, as a block of their own (its children first-depth drafts; a block that
    /// is one path a chain). `None` where no first draft is `token` or the block is malformed.
    pub fn under(&self, token: u32) -> Option<Self> {
        let n = self.tokens.len();
        let tree = !self.parents.is_empty();
        if self.q.len() != n || (tree && self.parents.len() != n) {
            return None;
        }
        // A node's parent in wire form: 0 the block's root, i + 1 the node i.
        let parent = |i: usize| if tree { self.parents[i] as usize } else { i };
        let at = (0..n).find(|&i| parent(i) == 0 && self.tokens[i] == token)?;
        let mut below = Self::default();
        // Each node's index in the new block, where it is under `at`.
        let mut index: Vec<Option<u32>> = vec![None; n];
        for i in at + 1..n {
            let p = parent(i);
            let new_parent = if p == at + 1 {
                Some(0)
            } else {
                p.checked_sub(1)
                    .filter(|&p| p < i)
                    .and_then(|p| index[p])
                    .map(|j| j + 1)
            };
            if let Some(new_parent) = new_parent {
                index[i] = Some(below.tokens.len() as u32);
                below.tokens.push(self.tokens[i]);
                below.q.push(self.q[i].clone());
                below.parents.push(new_parent);
                below.confidence.extend(self.confidence.get(i));
            }
        }
        if chain_len(&below.parents, below.tokens.len()) == below.tokens.len() {
            below.parents.clear();
        }
        Some(below)
    }
}

/// How many of a block's `drafts` (`parents` in wire form, empty for a chain) are its chain:
/// the drafts before the first that is not the child of the one before it.
pub fn chain_len(parents: &[u32], drafts: usize) -> usize {
    if parents.is_empty() {
        return drafts;
    }
    parents
        .iter()
        .enumerate()
        .take_while(|&(i, &p)| p as usize == i)
        .count()
}

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

/// A session back from a background task, with the step it ran when it timed one (and the
/// length of the log it drafted past).
type Lent = (NodeSession<Draft>, Option<(usize, DraftBlock)>);

/// What a draft step asks for: `k` drafts, `branches` more nodes (a token tree), and where the
/// chain stops early (`v1::DraftStep::min_confidence`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ask {
    pub k: usize,
    pub branches: usize,
    pub min_confidence: f32,
}

impl Ask {
    /// A chain of `k` drafts, never cut short.
    pub fn chain(k: usize) -> Self {
        Self {
            k,
            ..Self::default()
        }
    }
}

/// A draft step asking for `ask` after feeding `new_tokens` past `committed`.
fn draft_step(committed: v1::Prefix, new_tokens: Vec<u32>, ask: Ask) -> v1::DraftRequest {
    v1::DraftRequest {
        kind: Some(v1::draft_request::Kind::Step(v1::DraftStep {
            committed: Some(committed),
            new_tokens,
            k: ask.k as u32,
            branches: ask.branches as u32,
            min_confidence: ask.min_confidence,
        })),
    }
}

/// A draft-node at least this many committed tokens behind is worth catching up.
const CATCH_UP_LAG: usize = 2;
/// A background task (a re-attachment, a catch-up, a timing) that has not answered in this long,
/// plus [`BACKGROUND_PER_TOKEN`] for each token it may have to feed, is a loss.
const BACKGROUND_DEADLINE: Duration = Duration::from_secs(10);
/// A re-attachment replays the whole log: on a CPU draft of 0.5B parameters prefill runs at a
/// few hundred tokens/s, so a long prompt alone can take longer than the flat deadline.
const BACKGROUND_PER_TOKEN: Duration = Duration::from_millis(20);

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
        }
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
                return step.map(|(from, p)| Timing {
                    k: p.tokens.len(),
                    wall_secs: p.wall_secs,
                    compute_secs: p.compute_secs,
                    from,
                    tokens: p.tokens,
                });
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
        let lagging = self
            .session
            .as_ref()
            .is_some_and(|s| log.len().saturating_sub(s.held_len()) >= CATCH_UP_LAG);
        if lagging {
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
        let from = log.len();
        // A timed step is priced as a round's step: the gap since the session last drafted (a
        // few target-only rounds' tokens, more where steps are spaced out) is fed first, untimed,
        // so that the step feeds one token, as a step after a target-only round does.
        let behind = (kind == Background::Time
            && from.saturating_sub(session.held_len()) >= CATCH_UP_LAG)
            .then(|| TokenLog::new(&log.tokens()[..from - 1]));
        let deadline = background_deadline(from.saturating_sub(session.held_len()) + k);
        let health = self.channels.get(self.current).map(|r| r.health.clone());
        tokio::spawn(async move {
            let run = async {
                if let Some(behind) = &behind {
                    session
                        .call(behind, |c, new| draft_step(c, new, Ask::default()))
                        .await?;
                }
                let start = Instant::now();
                let p = session
                    .call(&log, |c, new| draft_step(c, new, Ask::chain(k)))
                    .await?;
                Ok::<_, Error>((p, start.elapsed().as_secs_f64()))
            };
            let result = match tokio::time::timeout(deadline, run).await {
                Ok(Ok((mut p, wall_secs))) => Ok((
                    session,
                    (kind == Background::Time).then(|| {
                        // A draft-node that sends more than asked is not believed past `k`.
                        p.tokens.truncate(k);
                        let step = DraftBlock {
                            compute_secs: p.compute_micros as f64 * 1e-6,
                            wall_secs,
                            tokens: p.tokens,
                            ..DraftBlock::default()
                        };
                        (from, step)
                    }),
                )),
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
    pub async fn step(
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
        let call = session.call(log, |committed, new_tokens| {
            draft_step(committed, new_tokens, ask)
        });
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
                Ok(DraftBlock {
                    tokens: p.tokens,
                    q: p.q,
                    parents: p.parents,
                    confidence: p.confidence,
                    compute_secs: p.compute_micros as f64 * 1e-6,
                    wall_secs: start.elapsed().as_secs_f64(),
                })
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
        self.session.take()
    }
}

/// N-gram drafts with one-hot q: exact under the acceptance rule, whatever the sampling, cut
/// before the first one the generation's grammar forbids; and the length of the match they
/// continue. With `branches`, a token tree of other earlier continuations (none under a
/// grammar: it checks the chain).
pub fn ngram_proposal(
    log: &TokenLog,
    (k, branches): (usize, usize),
    grammar: Option<&mut Constraint>,
) -> (DraftBlock, usize) {
    let start = Instant::now();
    let branches = if grammar.is_some() { 0 } else { branches };
    let crate::drafting::ngram::Lookup {
        mut tokens,
        matched,
        parents,
    } = crate::drafting::ngram::propose_tree(log.tokens(), k, branches);
    // A grammar state that cannot follow the log proposes nothing (the target decides).
    let valid = cut(grammar, log.tokens(), &tokens).unwrap_or(0);
    tokens.truncate(valid);
    let q = tokens
        .iter()
        .map(|&t| v1::Distribution {
            kind: Some(v1::distribution::Kind::OneHot(t)),
        })
        .collect();
    let secs = start.elapsed().as_secs_f64();
    let proposal = DraftBlock {
        tokens,
        q,
        parents,
        compute_secs: secs,
        wall_secs: secs,
        ..DraftBlock::default()
    };
    (proposal, matched)
}

/// Which drafter a fixed-K round uses.
pub fn fixed_drafter(choice: DrafterChoice, model_attached: bool) -> DrafterKind {
    match choice {
        DrafterChoice::Ngram => DrafterKind::Ngram,
        DrafterChoice::Model | DrafterChoice::Auto if model_attached => DrafterKind::Model,
        // The draft-node is lost (or never came): n-gram lookup stands in.
        _ => DrafterKind::Ngram,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(tokens: &[u32], parents: &[u32]) -> DraftBlock {
        let q = tokens
            .iter()
            .map(|&t| v1::Distribution {
                kind: Some(v1::distribution::Kind::OneHot(t)),
            })
            .collect();
        DraftBlock {
            tokens: tokens.to_vec(),
            q,
            parents: parents.to_vec(),
            ..DraftBlock::default()
        }
    }

    #[test]
    fn the_drafts_under_the_right_guess_are_a_block_of_their_own() {
        // A chain: what follows its first draft, when that was the guess.
        let chain = block(&[5, 6, 7], &[]);
        let under = chain.under(5).expect("the guess");
        assert_eq!((under.tokens, under.parents), (vec![6, 7], vec![]));
        assert_eq!(under.q.len(), 2);
        assert!(chain.under(6).is_none(), "6 is not a first draft");
        assert_eq!(block(&[5], &[]).under(5).map(|p| p.tokens), Some(vec![]));
        // Under the guess, a chain drafted whole is cut as the draft-node would have cut it.
        let mut sure = block(&[5, 6, 7, 8], &[]);
        sure.confidence = vec![0.1, 0.9, 0.3, 0.9];
        let under = |bound| sure.under(5).expect("the guess").cut(bound);
        assert_eq!(under(0.0).confidence, [0.9, 0.3, 0.9]);
        assert_eq!(under(0.5).tokens, [6]);
        assert_eq!(under(0.2).tokens, [6, 7, 8]);
        assert_eq!(under(0.95).tokens, [6], "the first draft is always kept");
        // A tree: guesses 5 and 9 at the first depth; under 5 a chain 6, 7 and 8 beside 6;
        // under 9 the path 10, 11.
        let tree = block(&[5, 6, 7, 9, 8, 10, 11], &[0, 1, 2, 0, 1, 4, 6]);
        let under = tree.under(5).expect("the first guess");
        assert_eq!(
            (under.tokens, under.parents),
            (vec![6, 7, 8], vec![0, 1, 0])
        );
        let under = tree.under(9).expect("the second guess");
        assert_eq!((under.tokens, under.parents), (vec![10, 11], vec![]));
        assert!(tree.under(6).is_none(), "6 is under 5, not a guess");
        // Malformed: parents that do not fit, a node's parent after it.
        assert!(block(&[5, 6], &[0]).under(5).is_none());
        let forward = block(&[5, 6, 7], &[0, 3, 1]);
        assert_eq!(forward.under(5).map(|p| p.tokens), Some(vec![7]));
    }
}
