//! The nodes as the coordinator sees them: a [`NodeHandle`] (channel and info, with HTTP/2
//! keepalive), a draft-node that may come late ([`LateDraft`]), and what a lost node session is: which errors mean the node may serve it again
//! if it is replayed, how long a call may take, how long to wait before asking again.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tandem_proto::tls::ClientTls;

use crate::replicas::Replicas;
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
        Self::connect_named(node, endpoint, None, tls).await
    }

    /// [`Self::connect`] to one address of the name `domain` (TLS checks that name).
    pub async fn connect_named(
        node: &'static str,
        endpoint: &str,
        domain: Option<&str>,
        tls: &ClientTls,
    ) -> Result<Self> {
        let unavailable = |reason: String| Error::Unavailable {
            node,
            endpoint: endpoint.to_string(),
            reason,
        };
        let channel = tls
            .endpoint_named(endpoint, domain, Duration::from_secs(10))
            .map_err(unavailable)?
            .connect()
            .await
            .map_err(|e| unavailable(connect_error(&e, endpoint)))?;
        let info = v1::node_service_client::NodeServiceClient::new(channel.clone())
            .info(v1::InfoRequest {})
            .await
            .map_err(|status| {
                let chain = crate::error_chain(&status);
                match tandem_proto::tls::mismatch_hint(endpoint, &chain) {
                    "" => Error::Remote { node, status },
                    hint => unavailable(chain + hint),
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

/// The draft-node's replicas. Reached at start, they must share the target's vocabulary (else
/// the coordinator refuses to start, naming both). Unreachable then, the coordinator serves with
/// the target alone and attaches them in the background once one answers (backoff 250 ms to
/// 10 s, vocabulary checked; a mismatch then is logged and the draft left out).
#[derive(Debug, Clone, Default)]
pub struct LateDraft(Arc<OnceLock<Replicas>>);

impl LateDraft {
    pub async fn connect(urls: &[String], target: &NodeHandle, tls: &ClientTls) -> Result<Self> {
        let late = Self::default();
        match Replicas::connect("draft-node", urls, tls).await {
            Ok(drafts) => {
                same_vocabulary(target, drafts.primary())?;
                let _ = late.0.set(drafts);
            }
            Err(e) => {
                tracing::warn!(error = %crate::error_chain(&e),
                    "draft-node not reachable: serving with the target alone until it answers");
                let (cell, urls, target, tls) = (
                    Arc::clone(&late.0),
                    urls.to_vec(),
                    target.clone(),
                    tls.clone(),
                );
                tokio::spawn(async move {
                    let mut wait = Duration::from_millis(250);
                    loop {
                        tokio::time::sleep(wait).await;
                        let Ok(drafts) = Replicas::connect("draft-node", &urls, &tls).await else {
                            wait = (wait * 2).min(Duration::from_secs(10));
                            continue;
                        };
                        match same_vocabulary(&target, drafts.primary()) {
                            Ok(()) => {
                                tracing::info!(model = %drafts.primary().info.model_name,
                                    replicas = %drafts.endpoints(), "draft-node attached");
                                let _ = cell.set(drafts);
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

    /// The draft-node's replicas, once one has answered.
    pub fn get(&self) -> Option<&Replicas> {
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
