//! The coordinator's side of the node session streams. A [`SessionLink`] is one long-lived
//! bidirectional stream (a round costs no set-up); a [`NodeSession`] (of the [`Draft`] or the
//! [`Target`] wire) tracks the committed prefix the node holds, names it in every step, and
//! repairs a mismatch: by rolling the node back when it holds a prefix of the log, else by
//! replaying the log into a new session.

use crate::error::{Error, Result};
use prost::Message;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tandem_proto::v1::draft_service_client::DraftServiceClient;
use tandem_proto::v1::target_service_client::TargetServiceClient;
use tandem_proto::v1::{self, draft_request, draft_response, target_request, target_response};
use tandem_proto::{prefix_from_wire, prefix_to_wire};
use tandem_runtime::{Prefix, SamplingParams, TokenLog};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Status, Streaming};

/// gRPC adds a 5-byte frame header to every message.
const FRAME_HEADER: u64 = 5;

/// Bytes a session moved, counted as gRPC messages (protobuf plus frame header).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Traffic {
    pub sent: u64,
    pub received: u64,
}

impl std::ops::AddAssign for Traffic {
    fn add_assign(&mut self, other: Self) {
        self.sent += other.sent;
        self.received += other.received;
    }
}

/// One bidirectional session stream.
#[derive(Debug)]
struct SessionLink<Req, Resp> {
    node: &'static str,
    tx: mpsc::Sender<Req>,
    rx: Streaming<Resp>,
    traffic: Traffic,
    /// Replies received on the stream (its open's included): what the node's
    /// `session_answered` is compared with.
    received: Arc<AtomicU32>,
}

impl<Req: Message, Resp: Message + Default> SessionLink<Req, Resp> {
    async fn call(&mut self, request: Req) -> Result<Resp> {
        self.traffic.sent += request.encoded_len() as u64 + FRAME_HEADER;
        let closed = |node| Error::StreamClosed { node };
        self.tx.send(request).await.map_err(|_| closed(self.node))?;
        match self.rx.message().await {
            Ok(Some(reply)) => {
                self.traffic.received += reply.encoded_len() as u64 + FRAME_HEADER;
                self.received.fetch_add(1, Ordering::Relaxed);
                Ok(reply)
            }
            Ok(None) => Err(closed(self.node)),
            Err(status) => Err(Error::Remote {
                node: self.node,
                status,
            }),
        }
    }

    /// Tells the node the session is over, without waiting for the answer.
    fn close(&self, request: Req) {
        let _ = self.tx.try_send(request);
    }
}

/// What a session is opened with, kept to replay it into a new session.
#[derive(Debug, Clone)]
pub struct SessionSpec {
    pub session_id: String,
    pub sampling: SamplingParams,
    /// Largest committed length the session will reach.
    pub max_len: usize,
    /// Target sessions: log-probabilities reported with this many alternatives.
    pub top_logprobs: Option<u32>,
    /// The grammar the output follows, with where generation began (so that a replayed
    /// session, whose prompt holds generated tokens, resumes its grammar state).
    pub constraint: Option<v1::Constraint>,
    /// The salt of the generation's tenant (`OpenSession.cache_salt`): every session of it,
    /// replays and re-attachments included, finds and leaves prefix-cache entries of that
    /// tenant only.
    pub cache_salt: Vec<u8>,
}

impl SessionSpec {
    fn open(&self, log: &TokenLog) -> v1::OpenSession {
        v1::OpenSession {
            session_id: self.session_id.clone(),
            prompt: log.tokens().to_vec(),
            sampling: Some((&self.sampling).into()),
            max_new_tokens: (self.max_len.saturating_sub(log.len())) as u32,
            top_logprobs: self.top_logprobs,
            constraint: self.constraint.clone(),
            cache_salt: self.cache_salt.clone(),
        }
    }
}

fn rejected(node: &'static str, r: v1::Rejection) -> Error {
    Error::Remote {
        node,
        status: Status::new(Code::from_i32(r.code), r.message),
    }
}

fn unexpected(node: &'static str, what: &str) -> Error {
    Error::Protocol {
        node,
        what: format!("expected {what}"),
    }
}

/// Where the next message should say the node stands: its held prefix when the log contains
/// it, else the longest prefix of the log it could hold (the node checks and may refuse).
fn resume_point(log: &TokenLog, held: Prefix) -> Prefix {
    log.prefix_at(held.len.min(log.len()))
        .unwrap_or_else(|| log.prefix())
}

/// How a node's refusal is repaired: the prefix to resume from, or a replay.
fn repair(log: &TokenLog, rejection: &v1::Rejection) -> Option<Prefix> {
    let held = prefix_from_wire(rejection.held).ok()?;
    (log.prefix_at(held.len) == Some(held)).then_some(held)
}

/// What a reply on a session stream is.
#[derive(Debug)]
pub enum Reply<A> {
    Opened(v1::Opened),
    Answer(A),
    Rejected(v1::Rejection),
    Closed,
}

/// One role's wire messages, as the coordinator uses them.
pub trait Wire: Send + 'static {
    type Req: Message + Send + 'static;
    type Resp: Message + Default + Send + 'static;
    /// What a step or verify answers.
    type Answer: Send;
    const NODE: &'static str;

    fn open(open: v1::OpenSession) -> Self::Req;
    fn close() -> Self::Req;
    fn classify(resp: Self::Resp) -> Option<Reply<Self::Answer>>;
    /// The committed prefix the node holds after answering.
    fn committed(answer: &Self::Answer) -> Option<v1::Prefix>;
    fn connect(
        channel: Channel,
        requests: ReceiverStream<Self::Req>,
    ) -> impl Future<Output = Result<Streaming<Self::Resp>, Status>> + Send;
}

/// Declares `$wire`, one node's side of a session stream ([`Wire`]): its request and response
/// messages (`$req`, `$resp`, whose `kind`s live in the modules `$req_kind` and `$resp_kind`),
/// the reply its steps answer (`$resp_kind::Kind::$answer`, a `v1::$answer_type`), and its
/// client. A macro: each service's messages are prost types of their own, alike in shape.
macro_rules! wire {
    ($(#[$doc:meta])* $wire:ident, $node:literal, $client:ident,
     $req:ident($req_kind:ident), $resp:ident($resp_kind:ident), $answer:ident($answer_type:ident)) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $wire;

        impl Wire for $wire {
            type Req = v1::$req;
            type Resp = v1::$resp;
            type Answer = v1::$answer_type;
            const NODE: &'static str = $node;

            fn open(open: v1::OpenSession) -> v1::$req {
                v1::$req {
                    kind: Some($req_kind::Kind::Open(open)),
                }
            }

            fn close() -> v1::$req {
                v1::$req {
                    kind: Some($req_kind::Kind::Close(v1::CloseSession {})),
                }
            }

            fn classify(resp: v1::$resp) -> Option<Reply<v1::$answer_type>> {
                use $resp_kind::Kind;
                Some(match resp.kind? {
                    Kind::Opened(o) => Reply::Opened(o),
                    Kind::$answer(a) => Reply::Answer(a),
                    Kind::Rejected(r) => Reply::Rejected(r),
                    Kind::Closed(_) => Reply::Closed,
                })
            }

            fn committed(answer: &v1::$answer_type) -> Option<v1::Prefix> {
                answer.committed
            }

            async fn connect(
                channel: Channel,
                requests: ReceiverStream<v1::$req>,
            ) -> Result<Streaming<v1::$resp>, Status> {
                let mut client = $client::new(channel)
                    .max_decoding_message_size(tandem_proto::MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(tandem_proto::MAX_MESSAGE_BYTES);
                Ok(client.session(traced(requests)).await?.into_inner())
            }
        }
    };
}

wire!(
    /// The draft side.
    Draft,
    "draft-node",
    DraftServiceClient,
    DraftRequest(draft_request),
    DraftResponse(draft_response),
    Proposal(Proposal)
);

wire!(
    /// The target side.
    Target,
    "target-node",
    TargetServiceClient,
    TargetRequest(target_request),
    TargetResponse(target_response),
    Verdict(VerdictReply)
);

/// A streaming request carrying the current trace context, so the node's session span joins
/// the generation's trace.
fn traced<T>(stream: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(stream);
    tandem_proto::trace::inject_current(request.metadata_mut());
    request
}

/// Attempts of one request before a persisting mismatch is an error.
const MAX_ATTEMPTS: usize = 3;

/// A session on one node with the committed prefix it holds.
#[derive(Debug)]
pub struct NodeSession<W: Wire> {
    channel: Channel,
    spec: SessionSpec,
    link: SessionLink<W::Req, W::Resp>,
    held: Prefix,
    /// Traffic of sessions replaced by replays.
    past: Traffic,
    /// Mismatches repaired by rollback or replay.
    pub repairs: u32,
    /// Which of its node's replicas holds it ([`crate::nodes::Replicas`]; 0 for a draft).
    pub replica: usize,
    /// How long its last open waited for the node's model thread (the node's queue).
    pub queued: Duration,
    /// Prompt tokens its last open took from the node's prefix cache.
    pub cached_tokens: u32,
    /// Replies received on its current stream ([`Self::replies_received`]).
    received: Arc<AtomicU32>,
}

impl<W: Wire> NodeSession<W> {
    /// Opens a session holding `log` (the prompt, or everything committed on a replay).
    pub async fn open(channel: Channel, spec: SessionSpec, log: &TokenLog) -> Result<Self> {
        let received = Arc::default();
        let (link, opened) = Self::start(&channel, &spec, log, &received).await?;
        Ok(Self {
            channel,
            spec,
            link,
            held: prefix_from_wire(opened.committed)?,
            past: Traffic::default(),
            repairs: 0,
            replica: 0,
            queued: Duration::from_micros(opened.queued_micros),
            cached_tokens: opened.cached_tokens,
            received,
        })
    }

    /// Moves the session to `replica` over `channel`: the next [`Self::replay`] opens it there.
    pub fn rebind(&mut self, replica: usize, channel: Channel) {
        self.replica = replica;
        self.channel = channel;
    }

    /// Opens a stream, its replies counted in `received` (from 0).
    async fn start(
        channel: &Channel,
        spec: &SessionSpec,
        log: &TokenLog,
        received: &Arc<AtomicU32>,
    ) -> Result<(SessionLink<W::Req, W::Resp>, v1::Opened)> {
        received.store(0, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(2);
        let rx = W::connect(channel.clone(), ReceiverStream::new(rx))
            .await
            .map_err(|status| Error::Remote {
                node: W::NODE,
                status,
            })?;
        let mut link = SessionLink {
            node: W::NODE,
            tx,
            rx,
            traffic: Traffic::default(),
            received: Arc::clone(received),
        };
        let reply = link.call(W::open(spec.open(log))).await?;
        match W::classify(reply) {
            Some(Reply::Opened(opened)) => Ok((link, opened)),
            Some(Reply::Rejected(r)) => Err(rejected(W::NODE, r)),
            _ => Err(unexpected(W::NODE, "opened")),
        }
    }

    /// Replays `log` into a new session, replacing this one.
    #[tracing::instrument(skip_all, fields(node = W::NODE, len = log.len()))]
    pub async fn replay(&mut self, log: &TokenLog) -> Result<()> {
        let (link, opened) = Self::start(&self.channel, &self.spec, log, &self.received).await?;
        let old = std::mem::replace(&mut self.link, link);
        old.close(W::close());
        self.past += old.traffic;
        self.held = prefix_from_wire(opened.committed)?;
        self.queued = Duration::from_micros(opened.queued_micros);
        self.cached_tokens = opened.cached_tokens;
        Ok(())
    }

    /// Sends the request `make(committed prefix, new tokens)` builds for `log`, repairing a
    /// prefix mismatch by rollback (the node holds a prefix of the log) or replay.
    pub async fn call(
        &mut self,
        log: &TokenLog,
        make: impl Fn(v1::Prefix, Vec<u32>) -> W::Req,
    ) -> Result<W::Answer> {
        for _ in 0..MAX_ATTEMPTS {
            let from = resume_point(log, self.held);
            let request = make(prefix_to_wire(from), log.tokens()[from.len..].to_vec());
            match W::classify(self.link.call(request).await?) {
                Some(Reply::Answer(answer)) => {
                    self.held = prefix_from_wire(W::committed(&answer))?;
                    return Ok(answer);
                }
                Some(Reply::Rejected(r)) if r.code == Code::FailedPrecondition as i32 => {
                    tracing::info!(node = W::NODE, message = %r.message, "repairing a prefix mismatch");
                    self.repairs += 1;
                    match repair(log, &r) {
                        Some(held) => {
                            tracing::info_span!("rollback", node = W::NODE, to = held.len)
                                .in_scope(|| self.held = held);
                        }
                        None => self.replay(log).await?,
                    }
                }
                Some(Reply::Rejected(r)) => return Err(rejected(W::NODE, r)),
                _ => return Err(unexpected(W::NODE, "an answer")),
            }
        }
        Err(Error::Desynchronised {
            node: W::NODE,
            attempts: MAX_ATTEMPTS,
        })
    }

    /// The count of replies received on the session's current stream (its open's included; a
    /// replay's stream counts from 0), readable while a call is under way.
    pub fn replies_received(&self) -> Arc<AtomicU32> {
        Arc::clone(&self.received)
    }

    /// The session's id (as the nodes log it).
    pub fn session_id(&self) -> &str {
        &self.spec.session_id
    }

    /// Length of the committed prefix the node holds.
    pub fn held_len(&self) -> usize {
        self.held.len
    }

    /// After a step on tokens not yet committed: the node is known to hold no more of the log
    /// than `prefix`, from which the next step resumes (rolling the node back without a
    /// refusal, its cache kept where the tokens match).
    pub fn hold_at_most(&mut self, prefix: Prefix) {
        if self.held.len > prefix.len {
            self.held = prefix;
        }
    }

    pub fn traffic(&self) -> Traffic {
        let mut total = self.past;
        total += self.link.traffic;
        total
    }

    /// Closes the session (the node frees it).
    pub fn close(self) {
        self.link.close(W::close());
    }
}
