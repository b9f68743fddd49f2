//! A seeded fault layer between the coordinator and a node: a gRPC proxy in front of a real
//! target-node or draft-node that, for each message of a session by a draw keyed by the seed,
//! the session and the message's index, passes it on, holds it (delay), sends it twice (the
//! node's second answer swallowed: a retransmitted request), corrupts the committed prefix it
//! carries, resets the stream (UNAVAILABLE to the coordinator; the node sees its stream end), or
//! drops it (neither forwarded nor answered: on a reliable stream a lost message is a stall, which
//! the coordinator's call deadline ends). Messages of one stream cannot be reordered (each waits
//! for its reply); the draft's and the target's streams are, by their independent delays. Its
//! gate holds work messages while a test injects a fault of its own (a node killed, restarted
//! elsewhere: the upstream re-pointed).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tandem_proto::v1::draft_service_client::DraftServiceClient;
use tandem_proto::v1::draft_service_server::{DraftService, DraftServiceServer};
use tandem_proto::v1::target_service_client::TargetServiceClient;
use tandem_proto::v1::target_service_server::{TargetService, TargetServiceServer};
use tandem_proto::v1::{self, draft_request, target_request};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::gate::Gate;
use crate::proxy::{NodeForward, Upstream};

/// What happens to one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Pass,
    Delay(Duration),
    Duplicate,
    CorruptPrefix,
    Reset,
    Drop,
}

/// Faults injected so far, by kind.
#[derive(Debug, Default)]
pub struct Injected {
    pub messages: AtomicUsize,
    pub delayed: AtomicUsize,
    pub duplicated: AtomicUsize,
    pub corrupted: AtomicUsize,
    pub reset: AtomicUsize,
    pub dropped: AtomicUsize,
}

/// The proxy: the node behind it, the seed, and each fault's chance per message (per mille);
/// a gate on its work messages (open unless a test closes it).
#[derive(Debug, Clone)]
pub struct FaultProxy {
    pub upstream: Upstream,
    pub gate: Gate,
    seed: u64,
    /// Delay, duplicate, corrupt, reset, drop.
    per_mille: [u64; 5],
    sessions: Arc<AtomicU64>,
    pub injected: Arc<Injected>,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl FaultProxy {
    /// A proxy to the node at `upstream`: per message, a delay, a duplicate, a corrupted
    /// prefix, a reset or a drop with these chances per mille.
    pub fn new(upstream: std::net::SocketAddr, seed: u64, per_mille: [u64; 5]) -> Self {
        Self {
            upstream: Upstream::new(upstream),
            gate: Gate::default(),
            seed,
            per_mille,
            sessions: Arc::default(),
            injected: Arc::default(),
        }
    }

    /// A proxy to the node at `upstream` that injects no fault: its gate alone holds messages.
    pub fn passing(upstream: std::net::SocketAddr) -> Self {
        Self::new(upstream, 0, [0; 5])
    }

    /// The fault for message `n` of session `session` (work messages only may be duplicated
    /// or corrupted: an open sent twice is a protocol error, not a retransmission).
    pub fn draw(&self, session: u64, n: u64, work: bool) -> Fault {
        let r = splitmix(self.seed ^ splitmix(session ^ splitmix(n))) % 1000;
        let [delay, dup, corrupt, reset, drop] = self.per_mille;
        if r < drop && work {
            Fault::Drop
        } else if r < drop + reset {
            Fault::Reset
        } else if r < drop + reset + corrupt && work {
            Fault::CorruptPrefix
        } else if r < drop + reset + corrupt + dup && work {
            Fault::Duplicate
        } else if r < drop + reset + corrupt + dup + delay {
            Fault::Delay(Duration::from_millis(1 + r % 20))
        } else {
            Fault::Pass
        }
    }

    /// Serves the proxy on 127.0.0.1:0; returns its URL.
    pub async fn serve(self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(NodeForward(self.upstream.clone()).into_server())
                .add_service(TargetServiceServer::new(self.clone()))
                .add_service(DraftServiceServer::new(self))
                .serve_with_incoming(tandem_proto::tls::incoming(listener)),
        );
        url
    }

    /// Relays one session between `inbound` and the node, injecting faults.
    async fn relay<Req, Resp>(
        &self,
        mut inbound: Streaming<Req>,
        up_tx: mpsc::Sender<Req>,
        mut upstream: Streaming<Resp>,
        tx: mpsc::Sender<Result<Resp, Status>>,
        prefix: fn(&mut Req) -> Option<&mut v1::Prefix>,
    ) where
        Req: Clone,
    {
        let session = self.sessions.fetch_add(1, Ordering::Relaxed);
        let counts = &self.injected;
        for n in 0u64.. {
            let Ok(Some(mut message)) = inbound.message().await else {
                return;
            };
            counts.messages.fetch_add(1, Ordering::Relaxed);
            let work = prefix(&mut message).is_some();
            if work {
                self.gate.pass().await;
            }
            let fault = self.draw(session, n, work);
            match fault {
                Fault::Reset => {
                    counts.reset.fetch_add(1, Ordering::Relaxed);
                    let _ = tx
                        .send(Err(Status::unavailable("fault: stream reset")))
                        .await;
                    return;
                }
                Fault::CorruptPrefix => {
                    counts.corrupted.fetch_add(1, Ordering::Relaxed);
                    if let Some(p) = prefix(&mut message) {
                        p.hash ^= 1;
                    }
                }
                Fault::Duplicate => {
                    counts.duplicated.fetch_add(1, Ordering::Relaxed);
                    if up_tx.send(message.clone()).await.is_err()
                        || !matches!(upstream.message().await, Ok(Some(_)))
                    {
                        return;
                    }
                }
                Fault::Delay(d) => {
                    counts.delayed.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(d).await;
                }
                Fault::Drop => {
                    // Lost: the coordinator gives up on the stream at its deadline.
                    counts.dropped.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Fault::Pass => {}
            }
            if up_tx.send(message).await.is_err() {
                return;
            }
            let reply = match upstream.message().await {
                Ok(Some(reply)) => Ok(reply),
                Ok(None) => return,
                Err(status) => Err(status),
            };
            let ended = reply.is_err();
            if tx.send(reply).await.is_err() || ended {
                return;
            }
        }
    }

    /// Relays a session on its own task; the stream the coordinator reads.
    fn spawn_relay<Req, Resp>(
        &self,
        inbound: Streaming<Req>,
        up_tx: mpsc::Sender<Req>,
        upstream: Streaming<Resp>,
        prefix: fn(&mut Req) -> Option<&mut v1::Prefix>,
    ) -> ReceiverStream<Result<Resp, Status>>
    where
        Req: Clone + Send + 'static,
        Resp: Send + 'static,
    {
        let (tx, rx) = mpsc::channel(4);
        let proxy = self.clone();
        tokio::spawn(async move { proxy.relay(inbound, up_tx, upstream, tx, prefix).await });
        ReceiverStream::new(rx)
    }
}

/// The committed prefix a verify carries (the other target requests carry none).
fn verify_prefix(m: &mut v1::TargetRequest) -> Option<&mut v1::Prefix> {
    match m.kind.as_mut() {
        Some(target_request::Kind::Verify(b)) => b.committed.as_mut(),
        _ => None,
    }
}

/// The committed prefix a draft step carries.
fn step_prefix(m: &mut v1::DraftRequest) -> Option<&mut v1::Prefix> {
    match m.kind.as_mut() {
        Some(draft_request::Kind::Step(s)) => s.committed.as_mut(),
        _ => None,
    }
}

fn unavailable(e: impl std::fmt::Display) -> Status {
    Status::unavailable(e.to_string())
}

#[tonic::async_trait]
impl TargetService for FaultProxy {
    type SessionStream = ReceiverStream<Result<v1::TargetResponse, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<v1::TargetRequest>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let (up_tx, up_rx) = mpsc::channel(4);
        let mut client = TargetServiceClient::connect(self.upstream.url())
            .await
            .map_err(unavailable)?;
        let upstream = client.session(ReceiverStream::new(up_rx)).await?;
        let inbound = request.into_inner();
        let relayed = self.spawn_relay(inbound, up_tx, upstream.into_inner(), verify_prefix);
        Ok(Response::new(relayed))
    }
}

#[tonic::async_trait]
impl DraftService for FaultProxy {
    type SessionStream = ReceiverStream<Result<v1::DraftResponse, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<v1::DraftRequest>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let (up_tx, up_rx) = mpsc::channel(4);
        let mut client = DraftServiceClient::connect(self.upstream.url())
            .await
            .map_err(unavailable)?;
        let upstream = client.session(ReceiverStream::new(up_rx)).await?;
        let inbound = request.into_inner();
        let relayed = self.spawn_relay(inbound, up_tx, upstream.into_inner(), step_prefix);
        Ok(Response::new(relayed))
    }
}
