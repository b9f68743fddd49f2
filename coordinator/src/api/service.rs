//! The public gRPC API (`tandem.v1.Coordinator`, with health): the service, its server
//! ([`serve`]), and the conversions of the engine's results to wire messages.

use tandem_proto::v1;
use tandem_proto::v1::coordinator_server::{Coordinator, CoordinatorServer};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use tandem_runtime::Commit;
use tandem_runtime::sampling::TokenLogprobs;

use crate::api::auth::Access;
use crate::engine::late_engine::LateEngine;
use crate::engine::{CommitSink, Outcome};

/// Largest public request: a prompt of a million tokens' text fits.
pub const MAX_REQUEST_BYTES: usize = 4 << 20;

/// Deltas buffered for a slow client before the generation waits for it.
const STREAM_BUFFER: usize = 4;

/// The statistics of an outcome on the wire.
pub fn stats_to_wire(o: &Outcome) -> v1::GenerationStats {
    let (s, b) = (&o.stats, &o.stats.base);
    v1::GenerationStats {
        generated_tokens: b.generated_tokens as u32,
        rounds: b.rounds as u32,
        drafted: b.drafted as u32,
        accepted: b.accepted as u32,
        acceptance_rate: b.acceptance_rate(),
        mean_accepted_length: b.mean_accepted_length(),
        tokens_per_second: b.tokens_per_second(),
        prefill_seconds: b.prefill_seconds,
        decode_seconds: b.decode_seconds,
        draft_seconds: b.draft_seconds,
        target_seconds: b.target_seconds,
        repairs: s.repairs,
        draft_lost: s.draft_lost,
        bytes_sent: s.traffic.sent,
        bytes_received: s.traffic.received,
        draft_lost_reason: s.draft_lost_reason.clone(),
        draft_blocks_refused: s.draft_blocks_refused,
        seed: s.seed,
        model_rounds: s.model_rounds,
        ngram_rounds: s.ngram_rounds,
        history_rounds: s.history_rounds,
        target_only_rounds: s.target_only_rounds,
        draft_reattached: s.draft_reattached,
        draft_stalls: s.draft_stalls,
        pipeline_rounds: s.pipeline_rounds,
        pipeline_hits: s.pipeline_hits,
        draft_waited_seconds: s.draft_waited_seconds,
        draft_node_tokens: s.draft_node_tokens,
    }
}

/// The final message of a generation.
pub fn done_to_wire(o: &Outcome) -> v1::GenerateDone {
    v1::GenerateDone {
        finish_reason: o.finish_reason.as_str().into(),
        stats: Some(stats_to_wire(o)),
        text: o.text.clone(),
        token_ids: o.token_ids.clone(),
    }
}

fn message(kind: v1::generate_response::Kind) -> Result<v1::GenerateResponse, Status> {
    Ok(v1::GenerateResponse { kind: Some(kind) })
}

/// Streams each commit to the client as a delta.
struct DeltaSink(mpsc::Sender<Result<v1::GenerateResponse, Status>>);

impl CommitSink for DeltaSink {
    async fn send(&mut self, commit: &Commit, logprobs: &[TokenLogprobs]) -> bool {
        let delta = v1::TokenDelta {
            text: commit.text.clone(),
            token_ids: commit.tokens.clone(),
            logprobs: logprobs
                .iter()
                .map(tandem_proto::logprobs_to_wire)
                .collect(),
        };
        self.0
            .send(message(v1::generate_response::Kind::Delta(delta)))
            .await
            .is_ok()
    }
}

/// `tandem.v1.Coordinator` over an engine.
#[derive(Debug, Clone)]
pub struct CoordinatorService {
    pub engine: LateEngine,
    pub access: Access,
}

impl CoordinatorService {
    /// The server, refusing requests over [`MAX_REQUEST_BYTES`] (RESOURCE_EXHAUSTED, before
    /// they are decoded).
    pub fn into_server(self) -> CoordinatorServer<Self> {
        CoordinatorServer::new(self).max_decoding_message_size(MAX_REQUEST_BYTES)
    }
}

#[tonic::async_trait]
impl Coordinator for CoordinatorService {
    type GenerateStream = ReceiverStream<Result<v1::GenerateResponse, Status>>;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let span = tracing::info_span!("grpc_generate");
        tandem_proto::trace::continue_trace(request.metadata(), &span);
        let engine = self.engine.get()?;
        let peer = request.remote_addr().map(|a| a.ip());
        let forwarded_for = request.metadata().get_all("x-forwarded-for");
        let authorization = crate::api::auth::grpc_authorization(&request);
        let permit = self.access.admit(
            authorization,
            peer,
            forwarded_for.iter().filter_map(|v| v.to_str().ok()),
        )?;
        let tenant = self.access.tenant(authorization);
        let job = engine.prepare_for(request.get_ref(), &tenant)?;
        // The client's stream ends where it cancels the call or its connection closes: the
        // sink then fails at the next commit, the generation ends, and the permit, held by
        // the task, is given back.
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        tokio::spawn(tracing::Instrument::instrument(
            async move {
                let outcome = engine.generate(&job, &mut DeltaSink(tx.clone())).await;
                let last = match outcome {
                    Ok(o) => message(v1::generate_response::Kind::Done(done_to_wire(&o))),
                    Err(e) => {
                        tracing::info!(error = %e, "generation failed");
                        Err(e.into())
                    }
                };
                let _ = tx.send(last).await;
                drop(permit);
            },
            span,
        ));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn info(
        &self,
        _: Request<v1::InfoRequest>,
    ) -> Result<Response<v1::CoordinatorInfo>, Status> {
        let e = self.engine.get()?;
        Ok(Response::new(v1::CoordinatorInfo {
            target: Some(e.target().info.clone()),
            draft: e.draft.get().map(|d| d.primary().info.clone()),
            default_draft_tokens: e.default_draft_tokens.map(|k| k as u32),
            active_generations: e.active() as u32,
        }))
    }
}

/// Serves the public gRPC API (and health) on `listener` until `shutdown` resolves. Health
/// says NOT_SERVING, and requests are refused UNAVAILABLE, until `engine` has reached its nodes.
/// With keys in `access`, a call must present one ([`super::auth`]), and a client has at most its
/// limit of generations in flight; health stays open. `tls` secures the
/// connections (mutual TLS where it names a client CA).
pub async fn serve(
    listener: tokio::net::TcpListener,
    engine: LateEngine,
    access: Access,
    tls: tandem_proto::tls::ServerTlsSetup,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    let service = "tandem.v1.Coordinator";
    for name in ["", service] {
        reporter
            .set_service_status(name, tonic_health::ServingStatus::NotServing)
            .await;
    }
    let (ready, keys) = (engine.clone(), access.keys.clone());
    tokio::spawn(async move {
        ready.wait().await;
        for name in ["", service] {
            reporter
                .set_service_status(name, tonic_health::ServingStatus::Serving)
                .await;
        }
    });
    tls.server()?
        .add_service(health)
        .add_service(tonic::service::interceptor::InterceptedService::new(
            CoordinatorService { engine, access }.into_server(),
            move |request| keys.check(request),
        ))
        .serve_with_incoming_shutdown(tandem_proto::tls::incoming(listener), shutdown)
        .await
}
