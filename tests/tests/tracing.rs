//! One request produces spans from the coordinator, the draft-node and the target-node in one
//! trace, exported over OTLP/gRPC to a collector this test runs.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use tandem_proto::v1;
use tandem_runtime::SamplingParams;
use tandem_tests::processes::Proc;
use tandem_tests::*;
use tonic::{Request, Response, Status};

/// (service.name, trace id, span name) of every span received.
type Spans = Arc<Mutex<Vec<(String, Vec<u8>, String)>>>;

#[derive(Debug, Clone, Default)]
struct Collector(Spans);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut spans = self.0.lock().expect("lock");
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                    Value::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for span in rs.scope_spans.iter().flat_map(|s| &s.spans) {
                spans.push((service.clone(), span.trace_id.clone(), span.name.clone()));
            }
        }
        Ok(Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_across_the_three_services() {
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let endpoint = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(collector.clone()))
            .serve_with_incoming(tandem_proto::tls::incoming(listener)),
    );
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let node = |name: &str, model: std::path::PathBuf| {
        let model = model.display().to_string();
        Proc::start_with_env(name, &["--model", &model, "--listen", "127.0.0.1:0"], &env)
    };
    let target = node("target-node", stories());
    let draft = node("draft-node", stories_q8());
    let (t, d) = (target.url(), draft.url());
    let args = [
        "serve",
        "--target",
        &t,
        "--draft",
        &d,
        "--listen",
        "127.0.0.1:0",
    ];
    let coordinator = Proc::start_with_env("coordinator", &args, &env);
    coordinator.wait_ready();

    let mut client = v1::coordinator_client::CoordinatorClient::connect(coordinator.url())
        .await
        .expect("connect");
    let prompt = tokenizer(&stories())
        .encode("Once upon a time")
        .expect("encode");
    let req = request(&prompt, 20, 4, &SamplingParams::greedy());
    tandem_coordinator::client::run(&mut client, req, |_| {})
        .await
        .expect("generate");

    let services = [
        "tandem-coordinator",
        "tandem-draft-node",
        "tandem-target-node",
    ];
    let complete = || {
        let spans = collector.0.lock().expect("lock");
        let mut by_trace: HashMap<&[u8], BTreeSet<(&str, &str)>> = HashMap::new();
        for (service, trace, name) in spans.iter() {
            by_trace.entry(trace).or_default().insert((service, name));
        }
        by_trace
            .into_values()
            .find(|names| {
                services
                    .iter()
                    .all(|s| names.iter().any(|(svc, _)| svc == s))
            })
            .map(|names| {
                names
                    .into_iter()
                    .map(|(s, n)| format!("{s}/{n}"))
                    .collect::<BTreeSet<_>>()
            })
    };
    let expected = [
        "tandem-coordinator/generate",
        "tandem-coordinator/round",
        "tandem-coordinator/draft",
        "tandem-coordinator/verify",
        "tandem-draft-node/session",
        "tandem-draft-node/draft_step",
        "tandem-target-node/session",
        "tandem-target-node/verify",
    ];
    // Batches arrive every 100 ms from each process: wait for the whole trace.
    let mut names = BTreeSet::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while std::time::Instant::now() < deadline {
        names = complete().unwrap_or_default();
        if expected.iter().all(|e| names.contains(*e)) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    for e in expected {
        assert!(
            names.contains(e),
            "{e} missing from the trace with all three services: {names:?}"
        );
    }
    drop((target, draft, coordinator));
}
