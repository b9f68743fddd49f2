//! tandem-coordinator: the public API, the round loop over gRPC with the canonical logs
//! ([`engine`]), the node session streams ([`links`]), and the in-process cluster of the local
//! all-in-one mode ([`cluster`]).

pub mod auth;
pub mod cli;
pub mod client;
pub mod cluster;
pub mod drafters;
pub mod engine;
pub mod http;
pub mod job;
pub mod late;
pub mod limits;
pub mod links;
pub mod local;
pub mod metrics;
pub mod ngram;
pub mod nodes;
pub mod policy;
pub mod replicas;
pub mod service;
pub mod shadow;
pub mod stats;

pub use cluster::LocalCluster;
pub use engine::{CommitSink, Discard, Engine, Job, MAX_REFUSED_BLOCKS, Outcome, Stats};

use late::LateEngine;

pub use tandem_proto::error_chain;

/// Whether a draft-node runs on the target-node's cores, from what they say of themselves: the
/// same machine (boot id) and CPU sets that overlap (an empty set: every CPU). `None` where
/// either does not say (an older node, not Linux): then [`same_machine`] guesses from the URLs.
pub fn shares_cores(
    target: &tandem_proto::v1::NodeInfo,
    draft: &tandem_proto::v1::NodeInfo,
) -> Option<bool> {
    if target.host_id.is_empty() || draft.host_id.is_empty() {
        return None;
    }
    let overlap = target.cpus.is_empty()
        || draft.cpus.is_empty()
        || target.cpus.iter().any(|c| draft.cpus.contains(c));
    Some(target.host_id == draft.host_id && overlap)
}

/// Whether two node URLs name the same machine: the same host, or loopback both (a draft-node
/// there runs on the target-node's cores). URLs that do not parse name no machine.
pub fn same_machine(a: &str, b: &str) -> bool {
    fn host(url: &str) -> Option<String> {
        let uri: tonic::codegen::http::Uri = url.parse().ok()?;
        Some(uri.host()?.trim_matches(['[', ']']).to_ascii_lowercase())
    }
    fn loopback(host: &str) -> bool {
        host == "localhost"
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    }
    match (host(a), host(b)) {
        (Some(a), Some(b)) => a == b || (loopback(&a) && loopback(&b)),
        _ => false,
    }
}

/// Serves the public gRPC API (and health) on `listener` until `shutdown` resolves. Health
/// says NOT_SERVING, and requests are refused UNAVAILABLE, until `engine` has reached its nodes.
/// With keys in `access`, a call must present one ([`auth`]), and a client has at most its
/// limit of generations in flight; health stays open. `tls` secures the
/// connections (mutual TLS where it names a client CA).
pub async fn serve(
    listener: tokio::net::TcpListener,
    engine: LateEngine,
    access: auth::Access,
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
            service::CoordinatorService { engine, access }.into_server(),
            move |request| keys.check(request),
        ))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await
}

#[cfg(test)]
mod tests {
    #[test]
    fn node_urls_on_one_machine_are_told_from_urls_on_two() {
        use super::same_machine;
        assert!(same_machine(
            "http://127.0.0.1:50051",
            "http://localhost:50052"
        ));
        assert!(same_machine("http://[::1]:1", "http://127.0.0.2:2"));
        assert!(same_machine(
            "http://Target.local:1",
            "https://target.local:2"
        ));
        assert!(!same_machine("http://10.0.0.1:1", "http://10.0.0.2:1"));
        assert!(!same_machine(
            "http://target-node:50051",
            "http://draft-node:50052"
        ));
        assert!(!same_machine("http://127.0.0.1:1", "http://edge.example:1"));
        assert!(!same_machine("not a url", "not a url"));
    }

    #[test]
    fn nodes_share_cores_on_one_machine_only_where_their_cpus_overlap() {
        use super::shares_cores;
        use tandem_proto::v1::NodeInfo;
        let node = |host: &str, cpus: &[u32]| NodeInfo {
            host_id: host.into(),
            cpus: cpus.to_vec(),
            ..NodeInfo::default()
        };
        let target = node("boot-a", &[0]);
        assert_eq!(shares_cores(&target, &node("boot-a", &[1])), Some(false));
        assert_eq!(shares_cores(&target, &node("boot-a", &[0, 1])), Some(true));
        assert_eq!(shares_cores(&target, &node("boot-a", &[])), Some(true));
        assert_eq!(shares_cores(&target, &node("boot-b", &[0])), Some(false));
        assert_eq!(shares_cores(&target, &node("", &[0])), None);
    }

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
