//! The nodes as the coordinator sees them: a [`NodeHandle`] (channel and info, with HTTP/2
//! keepalive), the target's replicas ([`Targets`]), and what a lost node session is: which errors mean the node may serve it again
//! if it is replayed, how long a call may take, how long to wait before asking again.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tandem_proto::tls::ClientTls;
use tandem_proto::v1;
use tandem_proto::{Error, Result};
use tonic::Code;
use tonic::transport::Channel;

/// A node the coordinator talks to.
#[derive(Debug, Clone)]
pub struct NodeHandle {
    pub endpoint: String,
    pub channel: Channel,
    pub info: v1::NodeInfo,
}

impl NodeHandle {
    /// Connects (with TLS for an `https://` URL) and reads the node's info.
    pub async fn connect(node: &'static str, endpoint: &str, tls: &ClientTls) -> Result<Self> {
        let unavailable = |reason: String| Error::Unavailable {
            node,
            endpoint: endpoint.to_string(),
            reason,
        };
        let channel = tls
            .endpoint(endpoint, Duration::from_secs(10))
            .map_err(unavailable)?
            .connect()
            .await
            .map_err(|e| unavailable(connect_error(&e, endpoint)))?;
        let info = v1::node_service_client::NodeServiceClient::new(channel.clone())
            .info(v1::InfoRequest {})
            .await
            .map_err(|status| {
                match tandem_proto::tls::mismatch_hint(endpoint, &crate::error_chain(&status)) {
                    "" => Error::Remote { node, status },
                    _ => unavailable(connect_error(&status, endpoint)),
                }
            })?
            .into_inner();
        Ok(Self {
            endpoint: endpoint.to_string(),
            channel,
            info,
        })
    }

    pub fn limits(&self) -> v1::NodeLimits {
        self.info.limits.unwrap_or_default()
    }

    /// After the node was lost: reads its info again and refuses a node that now serves
    /// another model or vocabulary (a replay into it would not continue this generation).
    pub async fn check_same(&self, node: &'static str) -> Result<()> {
        let info = v1::node_service_client::NodeServiceClient::new(self.channel.clone())
            .info(v1::InfoRequest {})
            .await
            .map_err(|status| Error::Remote { node, status })?
            .into_inner();
        let (was, now) = (&self.info, &info);
        if was.model_name != now.model_name || was.vocab_hash != now.vocab_hash {
            return Err(Error::Protocol {
                node,
                what: format!(
                    "came back serving `{}` (vocabulary hash {:016x}) instead of `{}` ({:016x}): \
                     its sessions cannot be rebuilt there",
                    now.model_name, now.vocab_hash, was.model_name, was.vocab_hash
                ),
            });
        }
        Ok(())
    }
}

/// The target-node's replicas (`--target` given several times): the same model on each. A
/// generation opens its session on the least loaded (ties: the first listed) and stays there
/// for its life; a session lost with its replica is rebuilt on the next one. The first replica
/// that answers at start gives the model's info; the others are reached lazily, and their info
/// is checked against it before their first session.
#[derive(Debug)]
pub struct Targets {
    replicas: Vec<Replica>,
}

#[derive(Debug)]
struct Replica {
    handle: NodeHandle,
    /// Generations whose session opened here.
    load: AtomicUsize,
    /// Whether its info was read and matches the first replica's.
    checked: AtomicBool,
}

/// A generation's count on its replica, given back on drop.
#[derive(Debug)]
pub struct Lease<'a>(&'a AtomicUsize);

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Targets {
    /// Connects to the first of `urls` that answers (its info is the model's) and reaches the
    /// others lazily.
    pub async fn connect(urls: &[String], tls: &ClientTls) -> Result<Self> {
        let mut first_error = None;
        let mut primary = None;
        for (i, url) in urls.iter().enumerate() {
            match NodeHandle::connect("target-node", url, tls).await {
                Ok(handle) => {
                    primary = Some((i, handle));
                    break;
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        let Some((at, primary)) = primary else {
            return Err(first_error.unwrap_or_else(|| Error::Unavailable {
                node: "target-node",
                endpoint: String::new(),
                reason: "no --target was given".into(),
            }));
        };
        let mut replicas = Vec::with_capacity(urls.len());
        for (i, url) in urls.iter().enumerate() {
            let handle = if i == at {
                primary.clone()
            } else {
                let channel = tls
                    .endpoint(url, Duration::from_secs(10))
                    .map_err(|reason| Error::Unavailable {
                        node: "target-node",
                        endpoint: url.clone(),
                        reason,
                    })?
                    .connect_lazy();
                NodeHandle {
                    endpoint: url.clone(),
                    channel,
                    info: primary.info.clone(),
                }
            };
            replicas.push(Replica {
                handle,
                load: AtomicUsize::new(0),
                checked: AtomicBool::new(i == at),
            });
        }
        Ok(Self { replicas })
    }

    /// The replica whose info is the model's.
    pub fn primary(&self) -> &NodeHandle {
        self.replicas
            .iter()
            .find(|r| r.checked.load(Ordering::Relaxed))
            .map_or(&self.replicas[0].handle, |r| &r.handle)
    }

    pub fn len(&self) -> usize {
        self.replicas.len()
    }

    pub fn is_empty(&self) -> bool {
        self.replicas.is_empty()
    }

    /// The least loaded replica (ties: the first), counted until the lease drops.
    pub fn pick(&self) -> (usize, Lease<'_>) {
        let i = (0..self.replicas.len())
            .min_by_key(|&i| self.replicas[i].load.load(Ordering::Relaxed))
            .unwrap_or(0);
        let load = &self.replicas[i].load;
        load.fetch_add(1, Ordering::Relaxed);
        (i, Lease(load))
    }

    /// Every replica's URL, for errors.
    pub fn endpoints(&self) -> String {
        let urls: Vec<&str> = self
            .replicas
            .iter()
            .map(|r| r.handle.endpoint.as_str())
            .collect();
        urls.join(", ")
    }

    /// Replica `i` (modulo their number), its info checked against the model's the first time.
    pub async fn get(&self, i: usize) -> Result<&NodeHandle> {
        let replica = &self.replicas[i % self.replicas.len()];
        if !replica.checked.load(Ordering::Relaxed) {
            self.recheck(i).await?;
        }
        Ok(&replica.handle)
    }

    /// Replica `i`, its info read again (after a lost session: the node may have come back
    /// serving another model, which is refused).
    pub async fn recheck(&self, i: usize) -> Result<&NodeHandle> {
        let replica = &self.replicas[i % self.replicas.len()];
        replica.handle.check_same("target-node").await?;
        replica.checked.store(true, Ordering::Relaxed);
        Ok(&replica.handle)
    }
}

/// The draft-node. Reached at start, it must share the target's vocabulary (else the
/// coordinator refuses to start, naming both). Unreachable then, the coordinator serves with the
/// target alone and attaches it in the background once it answers (backoff 250 ms to 10 s,
/// vocabulary checked; a mismatch then is logged and the draft left out).
#[derive(Debug, Clone, Default)]
pub struct LateDraft(Arc<OnceLock<NodeHandle>>);

impl LateDraft {
    pub async fn connect(url: &str, target: &NodeHandle, tls: &ClientTls) -> Result<Self> {
        let late = Self::default();
        match NodeHandle::connect("draft-node", url, tls).await {
            Ok(draft) => {
                same_vocabulary(target, &draft)?;
                let _ = late.0.set(draft);
            }
            Err(e) => {
                tracing::warn!(error = %crate::error_chain(&e),
                    "draft-node not reachable: serving with the target alone until it answers");
                let (cell, url, target, tls) = (
                    Arc::clone(&late.0),
                    url.to_string(),
                    target.clone(),
                    tls.clone(),
                );
                tokio::spawn(async move {
                    let mut wait = Duration::from_millis(250);
                    loop {
                        tokio::time::sleep(wait).await;
                        let Ok(draft) = NodeHandle::connect("draft-node", &url, &tls).await else {
                            wait = (wait * 2).min(Duration::from_secs(10));
                            continue;
                        };
                        match same_vocabulary(&target, &draft) {
                            Ok(()) => {
                                tracing::info!(draft_node = %url, model = %draft.info.model_name,
                                    "draft-node attached");
                                let _ = cell.set(draft);
                            }
                            Err(e) => tracing::error!(error = %e, "draft-node left out"),
                        }
                        return;
                    }
                });
            }
        }
        Ok(late)
    }

    /// The draft-node, if it has answered.
    pub fn get(&self) -> Option<&NodeHandle> {
        self.0.get()
    }
}

/// Refuses a draft whose vocabulary differs from the target's, naming both.
fn same_vocabulary(target: &NodeHandle, draft: &NodeHandle) -> Result<()> {
    let (t, d) = (&target.info, &draft.info);
    if t.vocab_size == d.vocab_size && t.vocab_hash == d.vocab_hash {
        return Ok(());
    }
    Err(tandem_runtime::Error::VocabularyMismatch(format!(
        "draft-node {} serves {} ({} tokens, vocabulary hash {:016x}), target-node {} serves {} \
         ({} tokens, vocabulary hash {:016x})",
        draft.endpoint,
        d.model_name,
        d.vocab_size,
        d.vocab_hash,
        target.endpoint,
        t.model_name,
        t.vocab_size,
        t.vocab_hash
    ))
    .into())
}

/// Why a connection to `endpoint` failed, or its first call: the error chain, and a word on
/// TLS where it reads like a mismatch ([`tandem_proto::tls::mismatch_hint`]).
pub fn connect_error(e: &(dyn std::error::Error + 'static), endpoint: &str) -> String {
    let text = crate::error_chain(e);
    let hint = tandem_proto::tls::mismatch_hint(endpoint, &text);
    text + hint
}

/// The first wait before asking a lost target again; it doubles up to [`TARGET_BACKOFF_MAX`].
pub const TARGET_BACKOFF: Duration = Duration::from_millis(50);
pub const TARGET_BACKOFF_MAX: Duration = Duration::from_secs(2);
/// A node call's deadline: this floor, plus [`DEADLINE_FACTOR`] times the call's expected time.
pub const CALL_FLOOR: Duration = Duration::from_secs(10);
const DEADLINE_FACTOR: f64 = 8.0;

/// How long a call expected to take `expected` seconds (`None`: not yet measured) may take
/// before its node is treated as lost.
pub fn call_deadline(expected: Option<f64>) -> Duration {
    CALL_FLOOR + Duration::from_secs_f64(DEADLINE_FACTOR * expected.unwrap_or(0.0).max(0.0))
}

/// `backoff` scaled into [0.5, 1.5) by a hash of the session and the attempt: sessions that lost
/// the same node do not all come back at the same instant.
pub fn jittered(backoff: Duration, session: &str, attempt: u32) -> Duration {
    use std::hash::BuildHasher;
    let h = std::collections::hash_map::RandomState::new().hash_one((session, attempt));
    backoff.mul_f64(0.5 + (h % 1000) as f64 / 1000.0)
}

/// Errors after which a node may serve the session again if it is replayed: the node stopped,
/// restarted, was unreachable, did not answer in time, or no longer knows the session.
pub fn session_lost(e: &Error) -> bool {
    matches!(
        e.code(),
        Code::Unavailable
            | Code::NotFound
            | Code::DeadlineExceeded
            | Code::Aborted
            | Code::Unknown
            | Code::Cancelled
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replicas(n: usize) -> Targets {
        let replica = |i: usize| Replica {
            handle: NodeHandle {
                endpoint: format!("http://127.0.0.1:{}", 1 + i),
                channel: tonic::transport::Endpoint::from_static("http://127.0.0.1:1")
                    .connect_lazy(),
                info: v1::NodeInfo::default(),
            },
            load: AtomicUsize::new(0),
            checked: AtomicBool::new(i == 0),
        };
        Targets {
            replicas: (0..n).map(replica).collect(),
        }
    }

    #[tokio::test]
    async fn generations_go_to_the_least_loaded_replica_and_leave_it_when_they_end() {
        let targets = replicas(3);
        let (a, lease_a) = targets.pick();
        let (b, _lease_b) = targets.pick();
        let (c, _lease_c) = targets.pick();
        assert_eq!((a, b, c), (0, 1, 2), "one each, ties to the first listed");
        let (d, _lease_d) = targets.pick();
        assert_eq!(d, 0);
        drop(lease_a);
        let (e, _lease_e) = targets.pick();
        assert_eq!(e, 0, "replica 0 holds one again, as few as any");
        assert_eq!(
            targets.endpoints(),
            "http://127.0.0.1:1, http://127.0.0.1:2, http://127.0.0.1:3"
        );
        assert_eq!(targets.primary().endpoint, "http://127.0.0.1:1");
    }
}
