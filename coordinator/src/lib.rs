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
pub mod stats;

pub use cluster::LocalCluster;
pub use engine::{CommitSink, Discard, Engine, Job, MAX_REFUSED_BLOCKS, Outcome, Stats};

use std::sync::Arc;

/// An error and its causes, joined by ": " (a tonic transport error alone says only "transport
/// error"; its source says "Connection refused").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let next = c.to_string();
        if !text.ends_with(&next) {
            text = format!("{text}: {next}");
        }
        cause = c.source();
    }
    text
}

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

#[cfg(test)]
mod tests {
    #[test]
    fn an_error_chain_names_every_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
        #[derive(Debug)]
        struct Transport(std::io::Error);
        impl std::fmt::Display for Transport {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("transport error")
            }
        }
        impl std::error::Error for Transport {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        assert_eq!(
            super::error_chain(&Transport(io)),
            "transport error: Connection refused"
        );
    }
}
