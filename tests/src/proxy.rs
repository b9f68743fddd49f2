//! A draft-node stand-in for tests: a gRPC proxy in front of a real draft-node that may rewrite
//! each step on its way in and each reply on its way out (a desynchronised coordinator, a lying
//! or buggy draft), serving the node's info and tokenizer unchanged.

use std::sync::Arc;

use tandem_proto::v1::draft_service_client::DraftServiceClient;
use tandem_proto::v1::draft_service_server::{DraftService, DraftServiceServer};
use tandem_proto::v1::node_service_client::NodeServiceClient;
use tandem_proto::v1::node_service_server::{NodeService, NodeServiceServer};
use tandem_proto::v1::{self, draft_request};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// Rewrites the n-th step (1-based, counted per session) before the draft-node sees it.
pub type StepRewrite = dyn Fn(usize, &mut v1::DraftStep) + Send + Sync;
/// Rewrites the draft-node's reply to the n-th step before the coordinator sees it.
pub type ReplyRewrite = dyn Fn(usize, &mut v1::DraftResponse) + Send + Sync;

/// How long to hold the reply to the n-th step (a stalled draft-node or link).
pub type StepDelay = dyn Fn(usize) -> std::time::Duration + Send + Sync;

/// The proxy: where the real draft-node is, and what to rewrite.
#[derive(Clone)]
pub struct DraftProxy {
    upstream: Upstream,
    on_step: Arc<StepRewrite>,
    on_reply: Arc<ReplyRewrite>,
    delay: Arc<StepDelay>,
}

impl std::fmt::Debug for DraftProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftProxy")
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

impl DraftProxy {
    /// A proxy to the draft-node at `upstream` that changes nothing yet.
    pub fn new(upstream: std::net::SocketAddr) -> Self {
        Self {
            upstream: Upstream::new(upstream),
            on_step: Arc::new(|_, _| {}),
            on_reply: Arc::new(|_, _| {}),
            delay: Arc::new(|_| std::time::Duration::ZERO),
        }
    }

    pub fn delay(self, f: impl Fn(usize) -> std::time::Duration + Send + Sync + 'static) -> Self {
        Self {
            delay: Arc::new(f),
            ..self
        }
    }

    pub fn on_step(self, f: impl Fn(usize, &mut v1::DraftStep) + Send + Sync + 'static) -> Self {
        Self {
            on_step: Arc::new(f),
            ..self
        }
    }

    pub fn on_reply(
        self,
        f: impl Fn(usize, &mut v1::DraftResponse) + Send + Sync + 'static,
    ) -> Self {
        Self {
            on_reply: Arc::new(f),
            ..self
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
                .add_service(DraftServiceServer::new(self))
                .serve_with_incoming(tandem_proto::tls::incoming(listener)),
        );
        url
    }
}

#[tonic::async_trait]
impl DraftService for DraftProxy {
    type SessionStream = ReceiverStream<Result<v1::DraftResponse, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<v1::DraftRequest>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let mut inbound = request.into_inner();
        let (up_tx, up_rx) = mpsc::channel(4);
        let mut upstream = DraftServiceClient::connect(self.upstream.url())
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?
            .session(ReceiverStream::new(up_rx))
            .await?
            .into_inner();
        let (tx, rx) = mpsc::channel(4);
        let proxy = self.clone();
        tokio::spawn(async move {
            let mut steps = 0;
            while let Ok(Some(mut message)) = inbound.message().await {
                let step = match message.kind.as_mut() {
                    Some(draft_request::Kind::Step(step)) => {
                        steps += 1;
                        (proxy.on_step)(steps, step);
                        Some(steps)
                    }
                    _ => None,
                };
                if up_tx.send(message).await.is_err() {
                    break;
                }
                let Ok(Some(mut reply)) = upstream.message().await else {
                    break;
                };
                if let Some(n) = step {
                    (proxy.on_reply)(n, &mut reply);
                    tokio::time::sleep((proxy.delay)(n)).await;
                }
                if tx.send(Ok(reply)).await.is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// The URL of the node behind a proxy; it may be re-pointed (a node restarted on another port,
/// as behind a Kubernetes Service) and every later connection goes there.
#[derive(Debug, Clone)]
pub struct Upstream(Arc<std::sync::Mutex<String>>);

impl Upstream {
    pub fn new(addr: std::net::SocketAddr) -> Self {
        Self(Arc::new(std::sync::Mutex::new(format!("http://{addr}"))))
    }

    pub fn url(&self) -> String {
        self.0.lock().expect("upstream").clone()
    }

    pub fn point_to(&self, addr: std::net::SocketAddr) {
        *self.0.lock().expect("upstream") = format!("http://{addr}");
    }
}

/// NodeService (info, tokenizer) answered by the node at `upstream`, unchanged: what a proxy in
/// front of a node serves beside the role's service.
#[derive(Debug, Clone)]
pub struct NodeForward(pub Upstream);

impl NodeForward {
    async fn node(&self) -> Result<NodeServiceClient<tonic::transport::Channel>, Status> {
        NodeServiceClient::connect(self.0.url())
            .await
            .map_err(|e| Status::unavailable(e.to_string()))
    }

    pub fn into_server(self) -> NodeServiceServer<Self> {
        NodeServiceServer::new(self)
    }
}

#[tonic::async_trait]
impl NodeService for NodeForward {
    async fn info(&self, r: Request<v1::InfoRequest>) -> Result<Response<v1::NodeInfo>, Status> {
        self.node().await?.info(r.into_inner()).await
    }

    async fn tokenizer(
        &self,
        r: Request<v1::TokenizerRequest>,
    ) -> Result<Response<v1::TokenizerReply>, Status> {
        self.node()
            .await?
            .max_decoding_message_size(tandem_proto::MAX_MESSAGE_BYTES)
            .tokenizer(r.into_inner())
            .await
    }
}

/// A proxy that corrupts every third step's committed prefix (its length and its hash in turn):
/// the draft-node answers FAILED_PRECONDITION and the coordinator has to repair.
pub fn corrupting_proxy(upstream: std::net::SocketAddr) -> DraftProxy {
    DraftProxy::new(upstream).on_step(|n, step| {
        if let (0, Some(p)) = (n % 3, step.committed.as_mut()) {
            if n % 2 == 0 { p.len += 1 } else { p.hash ^= 1 }
        }
    })
}
