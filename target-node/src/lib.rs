//! target-node: serves `tandem.v1.TargetService`. Each session holds a [`Verifier`] and the
//! committed log; a verify block rolls back to the named committed prefix, appends the newly
//! committed tokens, scores [last committed token, d1..dK] in one forward pass and applies the
//! lossless acceptance rule. The verdict's accepted drafts and next token join the log.

use std::sync::Arc;

use tandem_node::{Incoming, NodeState, Session};
use tandem_proto::v1::target_response::Kind as Reply;
use tandem_proto::v1::target_service_server::{TargetService, TargetServiceServer};
use tandem_proto::v1::{self, target_request::Kind};
use tandem_proto::{Error, Result, distribution_from_wire, prefix_from_wire, prefix_to_wire};
use tandem_runtime::{Prefix, TokenLog, Verifier};
use tokio::net::TcpListener;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// One target session.
#[derive(Debug)]
pub struct TargetSession {
    verifier: Verifier,
    log: TokenLog,
}

impl Session for TargetSession {
    type Request = v1::TargetRequest;
    type Response = v1::TargetResponse;
    type Work = v1::VerifyBlock;

    fn classify(request: v1::TargetRequest) -> Result<Incoming<v1::VerifyBlock>> {
        match request.kind.ok_or(Error::MissingField("kind"))? {
            Kind::Open(open) => Ok(Incoming::Open(open)),
            Kind::Verify(block) => Ok(Incoming::Work(block)),
            Kind::Close(_) => Ok(Incoming::Close),
        }
    }

    fn opened(opened: v1::Opened) -> v1::TargetResponse {
        reply(Reply::Opened(opened))
    }

    fn closed() -> v1::TargetResponse {
        reply(Reply::Closed(v1::Closed {}))
    }

    fn rejected(rejection: v1::Rejection) -> v1::TargetResponse {
        reply(Reply::Rejected(rejection))
    }

    fn open(state: &NodeState, open: v1::OpenSession) -> Result<Self> {
        let sampling = state.check_open(&open)?;
        let mut verifier = Verifier::new(&state.model, sampling);
        verifier.prefill(&open.prompt)?;
        Ok(Self {
            verifier,
            log: TokenLog::new(&open.prompt),
        })
    }

    fn handle(&mut self, state: &NodeState, block: v1::VerifyBlock) -> Result<v1::TargetResponse> {
        let committed = prefix_from_wire(block.committed)?;
        // The block commits up to K + 1 tokens.
        state.check_step(committed.len, &block.new_tokens, block.drafts.len(), 1)?;
        state.check_tokens("drafts", &block.drafts)?;
        if block.q.len() != block.drafts.len() {
            return Err(tandem_runtime::Error::invalid(
                "q",
                format!("{} distributions", block.q.len()),
                format!("must hold one per draft token ({})", block.drafts.len()),
            )
            .into());
        }
        let q = block
            .q
            .iter()
            .map(|d| distribution_from_wire(d, state.vocab_size()))
            .collect::<Result<Vec<_>>>()?;
        self.log.rollback_to(committed)?;
        self.log.extend(&block.new_tokens);
        let start = std::time::Instant::now();
        let verdict = match self.verifier.verify(self.log.tokens(), &block.drafts, &q) {
            Ok(v) => v,
            Err(e) => {
                self.log.rollback_to(committed)?;
                return Err(e.into());
            }
        };
        self.log.extend(&verdict.committed(&block.drafts));
        Ok(reply(Reply::Verdict(v1::VerdictReply {
            accepted: verdict.accepted as u32,
            next_token: verdict.next,
            committed: Some(prefix_to_wire(self.log.prefix())),
            compute_micros: start.elapsed().as_micros() as u64,
        })))
    }

    fn tokens(reply: &v1::TargetResponse) -> usize {
        match &reply.kind {
            Some(Reply::Verdict(v)) => v.accepted as usize + 1,
            _ => 0,
        }
    }

    fn held(&self) -> Prefix {
        self.log.prefix()
    }

    fn kv_bytes(&self) -> usize {
        self.verifier.cache_bytes()
    }
}

fn reply(kind: Reply) -> v1::TargetResponse {
    v1::TargetResponse { kind: Some(kind) }
}

/// The gRPC service.
#[derive(Debug, Clone)]
pub struct TargetServer(pub Arc<NodeState>);

#[tonic::async_trait]
impl TargetService for TargetServer {
    type SessionStream = ReceiverStream<Result<v1::TargetResponse, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<v1::TargetRequest>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        Ok(Response::new(tandem_node::drive_session::<TargetSession>(
            Arc::clone(&self.0),
            request,
        )))
    }
}

/// Serves a loaded target node on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    state: Arc<NodeState>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> std::result::Result<(), tonic::transport::Error> {
    let service = TargetServiceServer::new(TargetServer(Arc::clone(&state)))
        .max_decoding_message_size(tandem_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(tandem_proto::MAX_MESSAGE_BYTES);
    tandem_node::serve(
        listener,
        state,
        "tandem.v1.TargetService",
        |router| router.add_service(service),
        shutdown,
    )
    .await
}
