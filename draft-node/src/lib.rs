//! draft-node: serves `tandem.v1.DraftService`. Each session holds a [`Drafter`] and the
//! committed log it was told; a step rolls back to the named committed prefix, appends the
//! newly committed tokens and proposes K tokens with the distributions they were sampled from.

use std::sync::Arc;

use tandem_node::{Incoming, NodeState, Session};
use tandem_proto::v1::draft_response::Kind as Reply;
use tandem_proto::v1::draft_service_server::{DraftService, DraftServiceServer};
use tandem_proto::v1::{self, draft_request::Kind};
use tandem_proto::{Error, Result, distribution_to_wire, prefix_from_wire, prefix_to_wire};
use tandem_runtime::{Drafter, Prefix, TokenLog};
use tokio::net::TcpListener;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// One draft session.
#[derive(Debug)]
pub struct DraftSession {
    drafter: Drafter,
    log: TokenLog,
}

impl Session for DraftSession {
    type Request = v1::DraftRequest;
    type Response = v1::DraftResponse;
    type Work = v1::DraftStep;

    fn classify(request: v1::DraftRequest) -> Result<Incoming<v1::DraftStep>> {
        match request.kind.ok_or(Error::MissingField("kind"))? {
            Kind::Open(open) => Ok(Incoming::Open(open)),
            Kind::Step(step) => Ok(Incoming::Work(step)),
            Kind::Close(_) => Ok(Incoming::Close),
        }
    }

    fn opened(opened: v1::Opened) -> v1::DraftResponse {
        reply(Reply::Opened(opened))
    }

    fn closed() -> v1::DraftResponse {
        reply(Reply::Closed(v1::Closed {}))
    }

    fn rejected(rejection: v1::Rejection) -> v1::DraftResponse {
        reply(Reply::Rejected(rejection))
    }

    fn open(state: &NodeState, open: v1::OpenSession) -> Result<Self> {
        let sampling = state.check_open(&open)?;
        let mut drafter = Drafter::new(&state.model, sampling);
        drafter.prefill(&open.prompt)?;
        Ok(Self {
            drafter,
            log: TokenLog::new(&open.prompt),
        })
    }

    fn handle(&mut self, state: &NodeState, step: v1::DraftStep) -> Result<v1::DraftResponse> {
        let committed = prefix_from_wire(step.committed)?;
        let k = step.k as usize;
        state.check_step(committed.len, &step.new_tokens, k, 0)?;
        self.log.rollback_to(committed)?;
        self.log.extend(&step.new_tokens);
        let start = std::time::Instant::now();
        let proposal = self.drafter.propose(self.log.tokens(), k);
        let proposal = match proposal {
            Ok(p) => p,
            Err(e) => {
                // Keep the session as it was: the log goes back to the step's prefix.
                self.log.rollback_to(committed)?;
                return Err(e.into());
            }
        };
        Ok(reply(Reply::Proposal(v1::Proposal {
            committed: Some(prefix_to_wire(self.log.prefix())),
            tokens: proposal.tokens,
            q: proposal.q.iter().map(distribution_to_wire).collect(),
            compute_micros: start.elapsed().as_micros() as u64,
        })))
    }

    fn tokens(reply: &v1::DraftResponse) -> usize {
        match &reply.kind {
            Some(Reply::Proposal(p)) => p.tokens.len(),
            _ => 0,
        }
    }

    fn held(&self) -> Prefix {
        self.log.prefix()
    }

    fn kv_bytes(&self) -> usize {
        self.drafter.cache_bytes()
    }
}

fn reply(kind: Reply) -> v1::DraftResponse {
    v1::DraftResponse { kind: Some(kind) }
}

/// The gRPC service.
#[derive(Debug, Clone)]
pub struct DraftServer(pub Arc<NodeState>);

#[tonic::async_trait]
impl DraftService for DraftServer {
    type SessionStream = ReceiverStream<Result<v1::DraftResponse, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<v1::DraftRequest>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        Ok(Response::new(tandem_node::drive_session::<DraftSession>(
            Arc::clone(&self.0),
            request,
        )))
    }
}

/// Serves a loaded draft node on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    state: Arc<NodeState>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> std::result::Result<(), tonic::transport::Error> {
    let service = DraftServiceServer::new(DraftServer(Arc::clone(&state)))
        .max_decoding_message_size(tandem_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(tandem_proto::MAX_MESSAGE_BYTES);
    tandem_node::serve(
        listener,
        state,
        "tandem.v1.DraftService",
        |router| router.add_service(service),
        shutdown,
    )
    .await
}
