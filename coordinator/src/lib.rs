//! tandem-coordinator: the public API, the round loop over gRPC with the canonical logs
//! ([`engine`]), the node session streams ([`links`]), and the in-process cluster of the local
//! all-in-one mode ([`cluster`]).

pub mod cli;
pub mod client;
pub mod cluster;
pub mod drafters;
pub mod engine;
pub mod http;
pub mod links;
pub mod local;
pub mod metrics;
pub mod ngram;
pub mod policy;
pub mod service;
pub mod shadow;

pub use cluster::LocalCluster;
pub use engine::{CommitSink, Discard, Engine, Job, MAX_REFUSED_BLOCKS, Outcome, Stats};

use std::sync::Arc;

/// Serves the public gRPC API (and health) on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    engine: Arc<Engine>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status(
            "tandem.v1.Coordinator",
            tonic_health::ServingStatus::Serving,
        )
        .await;
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(health)
        .add_service(service::CoordinatorService(engine).into_server())
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await
}
