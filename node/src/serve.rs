//! Serving a node: NodeService (info, tokenizer), standard gRPC health, the role's own service,
//! logging, and shutdown on SIGINT/SIGTERM.

use std::sync::Arc;

use tandem_proto::tls::{DefaultClients, ServerLayers, ServerTlsSetup};
use tandem_proto::v1;
use tandem_proto::v1::node_service_server::{NodeService, NodeServiceServer};
use tokio::net::TcpListener;
use tonic::transport::server::Router;
use tonic::{Request, Response, Status};

use std::net::SocketAddr;

use crate::config::NodeArgs;
use crate::state::{NodeState, Role};

#[derive(Debug)]
struct NodeInfoService(Arc<NodeState>);

#[tonic::async_trait]
impl NodeService for NodeInfoService {
    async fn info(&self, r: Request<v1::InfoRequest>) -> Result<Response<v1::NodeInfo>, Status> {
        Ok(Response::new(self.0.info(&r.into_inner().session_id)))
    }

    async fn tokenizer(
        &self,
        _: Request<v1::TokenizerRequest>,
    ) -> Result<Response<v1::TokenizerReply>, Status> {
        let t = &self.0.tokenizer;
        Ok(Response::new(v1::TokenizerReply {
            tokenizer_json: t.to_json().map_err(crate::error::Error::from)?,
            bos_id: t.bos_id(),
            eos_id: t.eos_id(),
            chat_template: t.chat_template().map(str::to_string),
        }))
    }
}

/// Serves `role_service` (already added to a router by the caller's `add`) with NodeService
/// and health on `listener`, with `tls` (and the clients it admits), until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    state: Arc<NodeState>,
    service_name: &'static str,
    add: impl FnOnce(Router<ServerLayers>) -> Router<ServerLayers>,
    tls: &ServerTlsSetup,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status(service_name, tonic_health::ServingStatus::Serving)
        .await;
    let node = NodeServiceServer::new(NodeInfoService(state))
        .max_decoding_message_size(tandem_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(tandem_proto::MAX_MESSAGE_BYTES);
    let router = tls.server()?.add_service(health).add_service(node);
    // Draining: health says NOT_SERVING (for the overall server and the role's service) while
    // in-flight sessions finish.
    let draining = async move {
        shutdown.await;
        for name in ["", service_name] {
            reporter
                .set_service_status(name, tonic_health::ServingStatus::NotServing)
                .await;
        }
    };
    add(router)
        .serve_with_incoming_shutdown(tandem_proto::tls::incoming(listener), draining)
        .await
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// Runs a node: loads the model (on a blocking thread), binds its listeners, logs what was
/// loaded, on which device and where it listens, then serves the role's gRPC service (through
/// `serve_role`) and the HTTP side until SIGINT/SIGTERM, letting in-flight requests finish.
pub async fn run<F, Fut>(role: Role, args: NodeArgs, serve_role: F) -> anyhow::Result<()>
where
    F: FnOnce(TcpListener, Arc<NodeState>, ServerTlsSetup, Shutdown) -> Fut,
    Fut: std::future::Future<Output = Result<(), tonic::transport::Error>>,
{
    use anyhow::Context;
    let source = &args.source;
    // Certificates are checked before the model loads: a bad path fails in a second, not after.
    // Under mutual TLS a node admits the coordinator's role unless told otherwise.
    let tls = args.tls.load(DefaultClients::Coordinators)?;
    tracing::info!(role = role.as_str(), model = %source.model, device = %source.device, "loading model");
    let (listen, http_listen) = (args.listen, args.http_listen);
    let state =
        tokio::task::spawn_blocking(move || NodeState::load(role, &args.source, &args.limits))
            .await?
            .with_context(|| format!("loading the {} model", role.as_str()))?;
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let http = bind_http(http_listen).await?;
    let config = state.model.config();
    tracing::info!(
        role = role.as_str(),
        model = %state.model.name(),
        layers = config.num_layers,
        vocab = config.vocab_size,
        context = config.max_context,
        device = %state.device,
        cpu_kernels = tandem_runtime::kernels::cpu_path(),
        listen = %listener.local_addr()?,
        grpc = tls.mode(),
        grpc_clients = %tls.admits(),
        http_listen = ?http.as_ref().and_then(|l| l.local_addr().ok()),
        max_sessions = state.limits.max_sessions,
        max_session_tokens = state.limits.max_session_tokens,
        max_draft_tokens = state.limits.max_draft_tokens,
        "node ready"
    );
    announce_listening(&listener, &[("http", http.as_ref())])?;
    let state = Arc::new(state);
    serve_until_signal(
        || {
            tracing::info!("shutting down: letting in-flight requests finish");
            state
                .draining
                .store(true, std::sync::atomic::Ordering::Relaxed);
        },
        |stop| serve_role(listener, Arc::clone(&state), tls, stop),
        |stop| async {
            match http {
                Some(l) => crate::http::serve_http(l, Arc::clone(&state), stop).await,
                None => Ok(()),
            }
        },
    )
    .await?;
    tracing::info!(role = role.as_str(), "node stopped");
    Ok(())
}

/// Prints where this process listens as one line on stdout, `listening grpc=ADDR` followed by
/// ` NAME=ADDR` for each other listener that is bound: with port 0 (`--listen 127.0.0.1:0`) the
/// system picks a free port, and whoever started the process (a supervisor, a test) reads here
/// which one, with no window in which another process could take it.
pub fn announce_listening(
    grpc: &TcpListener,
    others: &[(&str, Option<&TcpListener>)],
) -> std::io::Result<()> {
    use std::io::Write;
    let mut line = format!("listening grpc={}", grpc.local_addr()?);
    for (name, listener) in others {
        if let Some(l) = listener {
            line.push_str(&format!(" {name}={}", l.local_addr()?));
        }
    }
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}")?;
    stdout.flush()
}

/// Binds the optional HTTP listener (`--http-listen`).
pub async fn bind_http(addr: Option<SocketAddr>) -> anyhow::Result<Option<TcpListener>> {
    use anyhow::Context;
    match addr {
        Some(addr) => {
            Ok(Some(TcpListener::bind(addr).await.with_context(|| {
                format!("cannot listen on {addr} (--http-listen)")
            })?))
        }
        None => Ok(None),
    }
}

/// Serves a gRPC and an HTTP server until SIGINT/SIGTERM: `on_signal` runs first (readiness
/// off), then both stop accepting and let their in-flight requests finish.
pub async fn serve_until_signal<G, H>(
    on_signal: impl FnOnce(),
    grpc: impl FnOnce(Shutdown) -> G,
    http: impl FnOnce(Shutdown) -> H,
) -> anyhow::Result<()>
where
    G: std::future::Future<Output = Result<(), tonic::transport::Error>>,
    H: std::future::Future<Output = std::io::Result<()>>,
{
    let (stop, _) = tokio::sync::watch::channel(false);
    let (grpc_stop, http_stop) = (stopped(&stop), stopped(&stop));
    let signal = async move {
        shutdown_signal().await;
        on_signal();
        let _ = stop.send(true);
    };
    let ((), grpc, http) =
        tokio::join!(signal, grpc(Box::pin(grpc_stop)), http(Box::pin(http_stop)));
    grpc?;
    http?;
    Ok(())
}

/// Resolves when a shutdown was asked for.
pub type Shutdown = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// A future that resolves once `stop` says true.
pub fn stopped(
    stop: &tokio::sync::watch::Sender<bool>,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let mut rx = stop.subscribe();
    async move {
        let _ = rx.wait_for(|s| *s).await;
    }
}
