//! Limits against abuse (issue 13): a client with its limit of generations in flight gets 429
//! with `Retry-After` (gRPC: RESOURCE_EXHAUSTED) at once while other clients are served, and
//! `/metrics` can live on a listener of its own; a public request over 4 MiB is refused unread. The three binaries as processes; the target-node
//! is paused (SIGSTOP) to hold generations in flight.

use std::net::SocketAddr;

use tandem_proto::v1;
use tandem_tests::processes::Proc;
use tandem_tests::*;

fn signal(proc: &Proc, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &proc.child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
}

async fn complete(http: SocketAddr, key: &str) -> (u16, String, String) {
    http_exchange_with(
        http,
        "POST",
        "/v1/completions",
        &format!("Authorization: Bearer {key}\r\n"),
        r#"{"prompt": "Once upon a time", "max_tokens": 8}"#,
    )
    .await
}

/// Waits until the coordinator whose metrics are at `metrics` has `n` generations in flight.
async fn in_flight(metrics: SocketAddr, n: usize) {
    let line = format!("tandem_num_requests_running {n}");
    assert!(
        eventually(async || http_request(metrics, "GET", "/metrics", "")
            .await
            .1
            .contains(&line))
        .await,
        "{n} generations in flight"
    );
}

#[tokio::test]
async fn a_client_at_its_limit_gets_429_while_others_are_served() {
    let target = Proc::node("target-node", &stories(), &[]);
    let draft = Proc::node("draft-node", &stories_q8(), &[]);
    let coordinator = Proc::coordinator(
        &target.url(),
        &draft.url(),
        &[
            "--api-key",
            "k1",
            "--api-key",
            "k2",
            "--max-requests-per-client",
            "1",
            "--http-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        None,
    );
    let (http, metrics) = (coordinator.http(), coordinator.listening("metrics"));
    // /metrics is on its own listener, not with the API.
    assert_eq!(http_request(http, "GET", "/metrics", "").await.0, 404);
    let (status, text) = http_request(metrics, "GET", "/metrics", "").await;
    assert_eq!(status, 200);
    assert!(text.contains("tandem_num_requests_running 0"), "{text}");

    // The target paused: k1's generation stays in flight.
    signal(&target, "-STOP");
    let first = tokio::spawn(complete(http, "k1"));
    in_flight(metrics, 1).await;
    let (status, head, body) = complete(http, "k1").await;
    assert_eq!(status, 429, "{body}");
    assert!(
        head.to_ascii_lowercase().contains("retry-after: 1"),
        "{head}"
    );
    let error: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("--max-requests-per-client")),
        "{body}"
    );
    let mut grpc = v1::coordinator_client::CoordinatorClient::connect(coordinator.url())
        .await
        .expect("connect");
    let request = v1::GenerateRequest {
        prompt: "Once upon a time".into(),
        max_tokens: 8,
        ..Default::default()
    };
    let request = with_metadata(request, "authorization", "Bearer k1");
    let status = grpc
        .generate(request)
        .await
        .expect_err("k1 is at its limit");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    // A request over the size cap is refused before it is decoded.
    let mut huge = tonic::Request::new(v1::GenerateRequest {
        prompt: "a".repeat(5 << 20),
        ..Default::default()
    });
    huge.metadata_mut()
        .insert("authorization", "Bearer k2".parse().expect("metadata"));
    let status = grpc.generate(huge).await.expect_err("over the cap");
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
    // Another client is admitted (held too, until the target resumes).
    let other = tokio::spawn(complete(http, "k2"));
    in_flight(metrics, 2).await;
    signal(&target, "-CONT");
    for (who, task) in [("k1", first), ("k2", other)] {
        let (status, _, body) = task.await.expect("request");
        assert_eq!(status, 200, "{who}: {body}");
    }
    // k1's generation ended: it is admitted again.
    assert_eq!(complete(http, "k1").await.0, 200);
}
