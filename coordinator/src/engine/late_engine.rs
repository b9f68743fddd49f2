//! The engine once the coordinator has reached its nodes. The coordinator starts its public
//! APIs before: until a target-node answers they say "not ready" (gRPC health NOT_SERVING,
//! `/ready` 503, requests UNAVAILABLE naming the node and why), while [`connect_until_ready`]
//! keeps trying with backoff. A Kubernetes pod whose nodes start later is then simply not ready
//! for a while, instead of crash-looping.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::{Error, Result};
use tokio::sync::watch;

use crate::engine::Engine;

/// The engine, or why there is none yet.
#[derive(Debug, Clone)]
pub struct LateEngine {
    engine: Arc<watch::Sender<Option<Arc<Engine>>>>,
    waiting: Arc<Mutex<String>>,
}

impl LateEngine {
    /// No engine yet: requests are refused with `why`.
    pub fn waiting(why: impl Into<String>) -> Self {
        Self {
            engine: Arc::new(watch::Sender::new(None)),
            waiting: Arc::new(Mutex::new(why.into())),
        }
    }

    /// An engine already connected.
    pub fn ready(engine: Arc<Engine>) -> Self {
        let late = Self::waiting("");
        late.set(engine);
        late
    }

    pub fn set(&self, engine: Arc<Engine>) {
        self.engine.send_replace(Some(engine));
    }

    /// The engine, or UNAVAILABLE saying what the coordinator is waiting for.
    pub fn get(&self) -> Result<Arc<Engine>> {
        self.engine
            .borrow()
            .clone()
            .ok_or_else(|| Error::NotReady(self.why()))
    }

    /// What the coordinator is waiting for.
    pub fn why(&self) -> String {
        self.waiting
            .lock()
            .map(|w| w.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    /// Resolves once the engine is there.
    pub async fn wait(&self) -> Arc<Engine> {
        let mut rx = self.engine.subscribe();
        let engine = rx
            .wait_for(Option::is_some)
            .await
            .expect("the sender lives in self");
        engine.clone().expect("waited for")
    }

    fn set_waiting(&self, why: String) {
        if let Ok(mut w) = self.waiting.lock() {
            *w = why;
        }
    }
}

/// First wait between two attempts to reach the nodes; it doubles up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(250);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// Connects `connect` until it succeeds, keeping `late`'s reason up to date (each failure is
/// logged with its whole cause), then sets the engine.
pub async fn connect_until_ready<F, Fut>(late: &LateEngine, mut connect: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Engine>>,
{
    let mut wait = RETRY_FIRST;
    loop {
        match connect().await {
            Ok(engine) => {
                late.set(Arc::new(engine));
                return;
            }
            Err(e) => {
                let why = tandem_proto::error_chain(&e);
                tracing::warn!(error = %why, retry_in = ?wait, "the nodes are not reachable yet");
                late.set_waiting(why);
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(RETRY_MAX);
            }
        }
    }
}
