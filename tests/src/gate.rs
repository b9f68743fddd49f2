//! A gate on a node's work messages, for tests driven by events rather than by the clock: it
//! lets a set number of verify blocks (or draft steps) through and holds the next one until the
//! test releases it. A fault injected while a message is held lands mid-generation however fast
//! or slow the machine is: the generation cannot finish before the test lets it.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

/// How long a test waits for a generation to reach the gate before it fails saying so.
const REACH: Duration = Duration::from_secs(120);
/// The verify blocks a generation gets through before [`with_fault`] holds it.
pub const HOLD_AT: usize = 10;

#[derive(Debug, Default)]
struct Counts {
    /// Work messages that have reached the gate.
    arrived: usize,
    /// Work messages let through.
    passed: usize,
    /// How many may pass in all; `None`: open.
    allowed: Option<usize>,
}

/// The gate, shared by the proxy that applies it and the test that drives it. Open when made.
#[derive(Debug, Clone, Default)]
pub struct Gate(Arc<watch::Sender<Counts>>);

impl Gate {
    /// Lets the next `n` work messages through, then holds.
    pub fn hold_after(&self, n: usize) {
        self.0.send_modify(|c| c.allowed = Some(c.passed + n));
    }

    /// Lets `n` more work messages through (after [`Self::hold_after`]).
    pub fn release(&self, n: usize) {
        self.0
            .send_modify(|c| c.allowed = Some(c.allowed.unwrap_or(c.passed) + n));
    }

    /// Lets everything through from now on.
    pub fn open(&self) {
        self.0.send_modify(|c| c.allowed = None);
    }

    /// Work messages let through so far.
    pub fn passed(&self) -> usize {
        self.0.borrow().passed
    }

    /// Waits until the gate holds: all it allows have passed and a work message waits; panics,
    /// saying so, if that does not happen in [`REACH`] (the generation ended or stalled before).
    pub async fn held(&self) {
        let mut counts = self.0.subscribe();
        let reached = counts.wait_for(|c| c.allowed == Some(c.passed) && c.arrived > c.passed);
        match tokio::time::timeout(REACH, reached).await {
            Ok(Ok(_)) => {}
            _ => panic!(
                "no work message reached the gate within {REACH:?} ({:?})",
                *self.0.borrow()
            ),
        }
    }

    /// Called by the proxy for each work message: returns once the message may pass.
    pub async fn pass(&self) {
        let mut counts = self.0.subscribe();
        // Arrived and passed in one change when the gate is open: a message that is let
        // through is never seen held.
        let mut arriving = true;
        loop {
            let mut passed = false;
            // Watchers are told of an arrival and of a pass; the message goes on only when it
            // passed (an arrival at a closed gate waits for a release).
            self.0.send_if_modified(|c| {
                let open = c.allowed.is_none_or(|a| c.passed < a);
                c.arrived += usize::from(arriving);
                if open {
                    c.passed += 1;
                }
                passed = open;
                std::mem::take(&mut arriving) || open
            });
            // A change made after `subscribe` (a release) wakes this; none is missed.
            if passed || counts.changed().await.is_err() {
                return;
            }
        }
    }
}

/// Streams `req` from the coordinator at `url` with `fault` injected mid-generation: `gate`
/// holds the generation's verify block number [`HOLD_AT`] + 1 while `fault` runs, then opens.
pub async fn with_fault(
    url: &str,
    req: tandem_proto::v1::GenerateRequest,
    gate: &Gate,
    fault: impl AsyncFnOnce(),
) -> (
    Vec<u32>,
    Result<tandem_proto::v1::GenerateDone, tonic::Status>,
) {
    gate.hold_after(HOLD_AT);
    let generation = tokio::spawn(crate::stream(url.to_string(), req));
    gate.held().await;
    fault().await;
    gate.open();
    crate::within("the end of the generation after the fault", generation)
        .await
        .expect("the generation's task")
}

/// Lets the generation held at `gate` go on one verify block at a time until `done` holds.
/// Between blocks it gives `done` a quarter of a second to come true by itself: the
/// coordinator's background work (a re-attachment after a backoff) runs meanwhile, and is
/// picked up at a round's start. A slow machine costs rounds, not the test.
pub async fn rounds_until(gate: &Gate, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let quarter = std::time::Instant::now() + Duration::from_millis(250);
        while std::time::Instant::now() < quarter {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within 120 s"
        );
        gate.release(1);
        gate.held().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_message_at_a_closed_gate_waits_until_it_is_released() {
        let gate = Gate::default();
        gate.hold_after(1);
        gate.pass().await;
        let g = gate.clone();
        let mut waiting = tokio::spawn(async move { g.pass().await });
        gate.held().await;
        // However long it is given, the held message does not pass by itself.
        let early = tokio::time::timeout(Duration::from_millis(200), &mut waiting).await;
        assert!(early.is_err(), "a message passed a closed gate");
        assert_eq!(gate.passed(), 1);
        gate.release(1);
        waiting.await.expect("the released message's task");
        assert_eq!(gate.passed(), 2);
        // Open: everything passes.
        gate.open();
        gate.pass().await;
        assert_eq!(gate.passed(), 3);
    }
}
