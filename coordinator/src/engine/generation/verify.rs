//! The target's verify of a round's block, with the replay that survives a lost session.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use crate::error::{Error, Result};
use tandem_runtime::TokenLog;

use crate::engine::Engine;
use crate::nodes::links::{NodeSession, Target};
use crate::nodes::steps::{DraftQ, TargetVerdict};
use crate::nodes::{TARGET_BACKOFF, TARGET_BACKOFF_MAX, call_deadline, jittered, session_lost};

/// Verifies `drafts` on the target, within a deadline derived from what the policy expects
/// of it ([`call_deadline`]). A lost target session (the node stopped, restarted, did not
/// answer in time, or dropped the stream: [`session_lost`]) is rebuilt by replaying the log
/// and the same verify asked again, with backoff and jitter, until [`Engine::target_retry`]
/// has passed; only then does the generation fail, UNAVAILABLE. The log is canonical and
/// the verify deterministic, so a generation that survives is the one it would have been.
pub(super) async fn on_target(
    engine: &Engine,
    target: &mut NodeSession<Target>,
    log: &TokenLog,
    block: (&[u32], &[DraftQ], &[u32]),
    expected: Option<f64>,
) -> Result<TargetVerdict> {
    let give_up = Instant::now() + engine.target_retry;
    let home = target.replica;
    let mut backoff = TARGET_BACKOFF;
    for attempt in 0u32.. {
        // A replay prefills the whole log: it may take what is left of the retry time.
        let deadline = if attempt == 0 {
            call_deadline(engine.call_floor, expected)
        } else {
            give_up
                .saturating_duration_since(Instant::now())
                .max(engine.call_floor)
        };
        // The same replica first (it may be back), then the next, and so on.
        let replica = match attempt {
            0 => home,
            n => (home + n as usize - 1) % engine.targets.len(),
        };
        let id = target.session_id().to_string();
        let received = target.replies_received();
        let error = {
            let call = async {
                if attempt > 0 {
                    let moved = async {
                        let channel = engine.targets.recheck(replica).await?.channel.clone();
                        target.rebind(replica, channel);
                        target.replay(log).await
                    };
                    moved.await.map_err(|e| engine.targets.failed(replica, e))?;
                    let to = if replica == home { "same" } else { "other" };
                    engine.metrics.target_replays.add(to, 1);
                }
                target.verify(log, block).await
            };
            tokio::pin!(call);
            let mut late = Late::default();
            loop {
                match tokio::time::timeout(deadline, &mut call).await {
                    Ok(Ok(verdict)) => return Ok(verdict),
                    Ok(Err(e)) if !session_lost(&e) => return Err(e),
                    Ok(Err(e)) => break e,
                    Err(_) if late.waited_for(engine, replica, &id, &received).await => {}
                    Err(_) => {
                        let what = format!("a verify within {deadline:?}");
                        engine.targets.missed(replica, &what);
                        break Error::TimedOut {
                            node: "target-node",
                            secs: deadline.as_secs_f64(),
                        };
                    }
                }
            }
        };
        // The last attempt falls at the deadline: a node back just before it is not missed.
        let left = give_up.saturating_duration_since(Instant::now());
        let wait = jittered(backoff, target.session_id(), attempt).min(left);
        if left.is_zero() {
            return Err(Error::Unavailable {
                node: "target-node",
                endpoint: engine.targets.endpoints(),
                reason: format!(
                    "the session was lost and the node did not come back within {} s \
                     (--target-retry-secs): {}",
                    engine.target_retry.as_secs(),
                    tandem_proto::error_chain(&error)
                ),
            });
        }
        tracing::warn!(error = %tandem_proto::error_chain(&error), attempt, retry_in = ?wait,
            "target session lost: replaying the log");
        target.repairs += 1;
        tokio::time::sleep(wait).await;
        backoff = (backoff * 2).min(TARGET_BACKOFF_MAX);
    }
    unreachable!("the attempts are unbounded")
}

/// A verify past its deadline: what its node said of it so far.
#[derive(Debug, Default)]
struct Late {
    /// The node had answered it, its reply not yet arrived.
    reply_awaited: bool,
}

impl Late {
    /// Whether the verify is waited for one more deadline, not taken for lost: its node, asked
    /// in time, works on it (queued behind other sessions' work: many opening at once), or has
    /// answered it and its reply is on its way (more answered on the stream than `received`:
    /// it arrives within a deadline, or was dropped on the way, so this is waited for once).
    /// Late is not lost: a call abandoned there would be replayed into a node already behind.
    async fn waited_for(
        &mut self,
        engine: &Engine,
        replica: usize,
        session: &str,
        received: &AtomicU32,
    ) -> bool {
        // Read before asking: a reply that arrives while the node answers is not missed.
        let before = received.load(Ordering::Relaxed);
        let Some(info) = engine.targets.info_on(replica, session).await else {
            return false;
        };
        let on_its_way = !self.reply_awaited && info.session_answered > before;
        if info.session_working {
            tracing::info!("target-node late but working");
        } else if on_its_way {
            self.reply_awaited = true;
            tracing::info!("target-node answered: its reply is on its way");
        } else {
            return false;
        }
        engine.metrics.target_late_calls.inc_by(1);
        true
    }
}
