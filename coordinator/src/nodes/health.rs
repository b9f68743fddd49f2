//! Whether a node replica answers. A call to it that misses its deadline (a draft session's
//! open, step, catch-up or timing step; a verify the node neither works on nor has answered; a
//! round-trip probe) marks it **down**: new generations then neither open a session there nor
//! wait for one (the draft-node's are left out at once; a target replica that is down is picked
//! last), and the generations it served re-attach elsewhere or later. The round-trip probe of every replica
//! ([`crate::nodes::replicas`]) asks a down one again every [`DOWN_PROBE`], and any answer marks
//! it up: drafting resumes. A silent link so costs one deadline, once, not one per generation.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tonic::transport::Channel;

/// How often a replica that is down is asked again whether it answers.
pub const DOWN_PROBE: Duration = Duration::from_millis(500);

/// One replica's health.
#[derive(Debug)]
pub struct Health {
    node: &'static str,
    endpoint: String,
    /// Since when it is down, and why; `None`: up.
    down: Mutex<Option<(Instant, String)>>,
    /// Woken when it goes down: the probe asks it again at once (a node that missed one
    /// deadline but answers is up again within a probe's round trip).
    wake: Arc<Notify>,
}

impl Health {
    /// Up; `wake` is notified each time it goes down.
    pub fn new(node: &'static str, endpoint: &str, wake: Arc<Notify>) -> Self {
        Self {
            node,
            endpoint: endpoint.to_string(),
            down: Mutex::new(None),
            wake,
        }
    }

    pub fn is_down(&self) -> bool {
        self.down.lock().map(|d| d.is_some()).unwrap_or(false)
    }

    /// Why it is down, for errors and logs (`None`: up).
    pub fn why_down(&self) -> Option<String> {
        let down = self.down.lock().ok()?;
        down.as_ref().map(|(since, why)| {
            format!(
                "{} at {} is down since {:.1} s ago ({why}): retried in the background",
                self.node,
                self.endpoint,
                since.elapsed().as_secs_f64()
            )
        })
    }

    /// A call to it missed its deadline (`what`: which call, and the deadline): marked down,
    /// logged once.
    pub fn missed(&self, what: &str) {
        let Ok(mut down) = self.down.lock() else {
            return;
        };
        if down.is_none() {
            tracing::warn!(node = self.node, replica = %self.endpoint, missed = what,
                "node marked down: generations go on without waiting for it until it answers again");
            *down = Some((Instant::now(), what.to_string()));
            self.wake.notify_one();
        }
    }

    /// It answered a call: up again (logged once).
    pub fn answered(&self) {
        let Ok(mut down) = self.down.lock() else {
            return;
        };
        if let Some((since, _)) = down.take() {
            tracing::info!(node = self.node, replica = %self.endpoint,
                down_for = ?since.elapsed(), "node answers again");
        }
    }
}

/// A replica's channel with its health: where a draft session is opened again after a loss,
/// never while the replica is down.
#[derive(Debug, Clone)]
pub struct Reachable {
    pub channel: Channel,
    pub health: Arc<Health>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_missed_deadline_marks_a_replica_down_until_it_answers() {
        let wake = Arc::new(Notify::new());
        let health = Health::new("draft-node", "http://127.0.0.1:1", Arc::clone(&wake));
        assert!(!health.is_down() && health.why_down().is_none());
        health.missed("a draft step within 10s");
        // The probe is woken (a permit is stored for it) once, at the first miss.
        let woken = tokio::time::timeout(Duration::ZERO, wake.notified()).await;
        assert!(woken.is_ok(), "the probe is woken");
        health.missed("a probe within 2s");
        assert!(health.is_down());
        let why = health.why_down().expect("down");
        assert!(
            why.contains("draft-node at http://127.0.0.1:1 is down")
                && why.contains("a draft step within 10s"),
            "the first miss is the reason: {why}"
        );
        health.answered();
        assert!(!health.is_down() && health.why_down().is_none());
    }
}
