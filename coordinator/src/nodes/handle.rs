//! A node as the coordinator sees it: a [`NodeHandle`] (channel and info, with HTTP/2
//! keepalive), and what a lost node session is: which errors mean the node may serve it again
//! if it is replayed, how long a call may take, how long to wait before asking again.

use std::time::Duration;

use crate::error::{Error, Result};
use tandem_proto::tls::ClientTls;
use tandem_proto::v1;
use tandem_runtime::Tokenizer;
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
            .info(v1::InfoRequest::default())
            .await
            .map_err(|status| {
                let chain = tandem_proto::error_chain(&status);
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

    /// Whether the node's model runs on the CPU.
    pub fn on_cpu(&self) -> bool {
        self.info.device.starts_with("cpu")
    }

    /// The tokenizer of the node's model (the coordinator needs no copy of its own).
    pub async fn tokenizer(&self, node: &'static str) -> Result<Tokenizer> {
        let reply = v1::node_service_client::NodeServiceClient::new(self.channel.clone())
            .max_decoding_message_size(tandem_proto::MAX_MESSAGE_BYTES)
            .tokenizer(v1::TokenizerRequest {})
            .await
            .map_err(|status| Error::Remote { node, status })?
            .into_inner();
        Ok(Tokenizer::from_json(
            &reply.tokenizer_json,
            reply.bos_id,
            reply.eos_id,
            reply.chat_template,
            &self.endpoint,
        )?)
    }

    /// After the node was lost: reads its info again and refuses a node that now serves
    /// another model or vocabulary (a replay into it would not continue this generation).
    pub async fn check_same(&self, node: &'static str) -> Result<()> {
        let info = v1::node_service_client::NodeServiceClient::new(self.channel.clone())
            .info(v1::InfoRequest::default())
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

/// Why a connection to `endpoint` failed, or its first call: the error chain, and a word on
/// TLS where it reads like a mismatch ([`tandem_proto::tls::mismatch_hint`]).
pub fn connect_error(e: &(dyn std::error::Error + 'static), endpoint: &str) -> String {
    let text = tandem_proto::error_chain(e);
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
pub fn call_deadline(floor: Duration, expected: Option<f64>) -> Duration {
    floor + Duration::from_secs_f64(DEADLINE_FACTOR * expected.unwrap_or(0.0).max(0.0))
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
