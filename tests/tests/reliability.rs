//! Hard to break (issue 13): the three binaries as processes on loopback, the target-node lost
//! in the middle of a generation. Killed and restarted, it costs time, not tokens: the
//! coordinator rebuilds the session from its log and the streamed output is target-only's. Gone
//! for good, the client gets a clear UNAVAILABLE once `--target-retry-secs` has passed; with
//! replicas, the generation moves to another at once.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use tandem_proto::v1;
use tandem_runtime::SamplingParams;
use tandem_tests::processes::{Proc, free_addr};
use tandem_tests::*;

/// Node `name` serving `model` on `addr`.
fn start_node(name: &str, model: &Path, addr: SocketAddr) -> Proc {
    let (model, listen) = (model.display().to_string(), addr.to_string());
    Proc::start(name, &["--model", &model, "--listen", &listen], addr)
}

fn start_target(model: &Path, addr: SocketAddr) -> Proc {
    start_node("target-node", model, addr)
}

/// Streams `req` from the coordinator at `url`, calling `after_first` once the first delta has
/// arrived. Returns the streamed ids and how the stream ended.
async fn stream(
    url: String,
    req: v1::GenerateRequest,
    after_first: impl FnOnce(),
) -> (Vec<u32>, Result<v1::GenerateDone, tonic::Status>) {
    let mut client = v1::coordinator_client::CoordinatorClient::connect(url)
        .await
        .expect("connect");
    let mut stream = match client.generate(req).await {
        Ok(response) => response.into_inner(),
        Err(status) => return (Vec::new(), Err(status)),
    };
    let mut ids = Vec::new();
    let mut after_first = Some(after_first);
    loop {
        match stream.message().await {
            Ok(Some(message)) => match message.kind {
                Some(v1::generate_response::Kind::Delta(d)) => {
                    ids.extend(d.token_ids);
                    if let Some(f) = after_first.take() {
                        f();
                    }
                }
                Some(v1::generate_response::Kind::Done(done)) => return (ids, Ok(done)),
                None => {}
            },
            Ok(None) => panic!("the stream ended without its last message"),
            Err(status) => return (ids, Err(status)),
        }
    }
}

fn story(n: u32, k: u32) -> v1::GenerateRequest {
    let prompt = tokenizer(&stories())
        .encode("Once upon a time")
        .expect("encode");
    request(&prompt, n, k, &SamplingParams::greedy())
}

/// A target-node (which a test may kill: taken out of the mutex, it is killed on drop), a
/// draft-node and a coordinator (with `extra` arguments) in front of them.
struct Three {
    target_addr: SocketAddr,
    target: std::sync::Mutex<Option<Proc>>,
    _draft: Proc,
    coordinator: Proc,
}

fn start_three(extra: &[&str]) -> Three {
    let target_addr = free_addr();
    let target = std::sync::Mutex::new(Some(start_target(&stories(), target_addr)));
    let draft = start_node("draft-node", &stories_q8(), free_addr());
    let coordinator = Proc::coordinator(
        &format!("http://{target_addr}"),
        &draft.url(),
        free_addr(),
        extra,
        None,
    );
    Three {
        target_addr,
        target,
        _draft: draft,
        coordinator,
    }
}

#[tokio::test]
async fn a_target_node_killed_and_restarted_mid_generation_loses_no_token() {
    let Three {
        target_addr,
        target,
        coordinator,
        ..
    } = start_three(&[]);
    let restarted = std::sync::Mutex::new(None);
    for k in [4, 0] {
        let (ids, done) = stream(coordinator.url(), story(400, k), || {
            // SIGKILL: no goodbye on the stream; back on the same port half a second later.
            drop(target.lock().expect("lock").take());
            *restarted.lock().expect("lock") = Some(std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(500));
                start_target(&stories(), target_addr)
            }));
        })
        .await;
        let done = done.unwrap_or_else(|s| panic!("K = {k}: the generation failed: {s:?}"));
        let stats = done.stats.expect("stats");
        assert!(
            stats.repairs >= 1,
            "K = {k}: the target's session was rebuilt"
        );
        assert_eq!(ids.len(), 400, "K = {k}: no token lost");
        assert_eq!(done.token_ids, ids, "K = {k}: none repeated");
        assert_eq!(
            ids,
            in_process(&stories(), None, &story(400, 0)).token_ids,
            "K = {k}: the output of an uninterrupted run"
        );
        let handle = restarted.lock().expect("lock").take().expect("restarted");
        *target.lock().expect("lock") = Some(handle.join().expect("restart"));
    }
}

#[tokio::test]
async fn a_target_node_that_does_not_come_back_fails_the_generation_with_unavailable() {
    let Three {
        target,
        coordinator,
        ..
    } = start_three(&["--target-retry-secs", "2"]);
    let start = Instant::now();
    let (_, done) = stream(coordinator.url(), story(400, 4), || {
        drop(target.lock().expect("lock").take());
    })
    .await;
    let status = done.expect_err("no target: the generation fails");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("target-node") && status.message().contains("2 s"),
        "the error says which node and how long it was waited for: {}",
        status.message()
    );
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(20),
        "the retry deadline bounds the wait: {waited:?}"
    );
}

#[tokio::test]
async fn a_coordinator_started_before_its_nodes_is_not_ready_until_they_answer() {
    let (target_addr, draft_addr, http) = (free_addr(), free_addr(), free_addr());
    let http_listen = http.to_string();
    let coordinator = Proc::coordinator_starting(
        &format!("http://{target_addr}"),
        &format!("http://{draft_addr}"),
        free_addr(),
        &["--http-listen", &http_listen],
        None,
    );
    // Up, not ready: /health answers, /ready and requests say what is awaited, and why.
    while std::net::TcpStream::connect(http).is_err() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(http_request(http, "GET", "/health", "").await.0, 200);
    let (status, body) = http_request(http, "GET", "/ready", "").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains(&target_addr.to_string()), "{body}");
    let (status, body) = http_request(
        http,
        "POST",
        "/v1/completions",
        r#"{"prompt": "Once upon a time", "max_tokens": 4}"#,
    )
    .await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("not ready"), "{body}");
    let (_, done) = stream(coordinator.url(), story(8, 4), || {}).await;
    let status = done.expect_err("not ready");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    // The nodes come up: the coordinator finds them and serves.
    let _target = start_target(&stories(), target_addr);
    let draft = start_node("draft-node", &stories_q8(), draft_addr);
    let deadline = Instant::now() + Duration::from_secs(30);
    while http_request(http, "GET", "/ready", "").await.0 != 200 {
        assert!(Instant::now() < deadline, "ready once the nodes answer");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (ids, done) = stream(coordinator.url(), story(40, 4), || {}).await;
    done.expect("generated");
    assert_eq!(ids, in_process(&stories(), None, &story(40, 0)).token_ids);
    drop(draft);
}

#[tokio::test]
async fn with_api_keys_only_a_request_presenting_one_gets_in() {
    let http = free_addr();
    let http_listen = http.to_string();
    let three = start_three(&[
        "--api-key",
        "s3cr3t-one",
        "--api-key",
        "s3cr3t-two",
        "--http-listen",
        &http_listen,
    ]);
    let body = r#"{"prompt": "Once upon a time", "max_tokens": 4}"#;
    let post = async |authorization: &str| {
        let header = if authorization.is_empty() {
            String::new()
        } else {
            format!("Authorization: {authorization}\r\n")
        };
        http_exchange_with(http, "POST", "/v1/completions", &header, body).await
    };
    // HTTP: no key, a wrong key, a key without `Bearer`: 401 in OpenAI's shape, no key echoed.
    for authorization in ["", "Bearer s3cr3t-three", "s3cr3t-one"] {
        let (status, _, body) = post(authorization).await;
        assert_eq!(status, 401, "{authorization:?}: {body}");
        let error: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!(error["error"]["code"], "invalid_api_key", "{body}");
        assert!(!body.contains("s3cr3t"), "{body}");
    }
    for key in ["s3cr3t-one", "s3cr3t-two"] {
        let (status, _, body) = post(&format!("Bearer {key}")).await;
        assert_eq!(status, 200, "{body}");
    }
    // Probes stay open.
    assert_eq!(http_request(http, "GET", "/health", "").await.0, 200);
    assert_eq!(http_request(http, "GET", "/ready", "").await.0, 200);
    // gRPC: UNAUTHENTICATED without the key, served with it.
    let (_, done) = stream(three.coordinator.url(), story(8, 4), || {}).await;
    let status = done.expect_err("no key");
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    assert!(!status.message().contains("s3cr3t"));
    let mut request = tonic::Request::new(story(8, 4));
    request
        .metadata_mut()
        .insert("authorization", "Bearer s3cr3t-two".parse().expect("ascii"));
    let mut client = v1::coordinator_client::CoordinatorClient::connect(three.coordinator.url())
        .await
        .expect("connect");
    let mut replies = client
        .generate(request)
        .await
        .expect("admitted")
        .into_inner();
    while let Some(reply) = replies.message().await.expect("streamed") {
        if let Some(v1::generate_response::Kind::Done(done)) = reply.kind {
            assert_eq!(done.token_ids.len(), 8);
        }
    }
}

#[tokio::test]
async fn a_target_node_back_with_another_model_is_refused_not_used() {
    let Three {
        target_addr,
        target,
        coordinator,
        ..
    } = start_three(&[]);
    let replaced = std::sync::Mutex::new(None);
    let (_, done) = stream(coordinator.url(), story(400, 4), || {
        drop(target.lock().expect("lock").take());
        // Another model on the same port: the log cannot be continued there.
        *replaced.lock().expect("lock") = Some(start_target(&stories_q8(), target_addr));
    })
    .await;
    let status = done.expect_err("refused");
    assert!(
        status.message().contains("came back serving"),
        "the error names both models: {status:?}"
    );
}

#[tokio::test]
async fn a_generation_whose_replica_is_lost_continues_on_another() {
    let (a_addr, b_addr) = (free_addr(), free_addr());
    let a = std::sync::Mutex::new(Some(start_target(&stories(), a_addr)));
    let _b = start_target(&stories(), b_addr);
    let draft = start_node("draft-node", &stories_q8(), free_addr());
    let (a_url, b_url) = (format!("http://{a_addr}"), format!("http://{b_addr}"));
    // Replicas, the first listed (the least loaded's tie-break) to be lost; a long retry time:
    // the move must not wait for it.
    let coordinator = Proc::coordinator(
        &a_url,
        &draft.url(),
        free_addr(),
        &["--target", &b_url, "--target-retry-secs", "60"],
        None,
    );
    let start = Instant::now();
    let (ids, done) = stream(coordinator.url(), story(400, 4), || {
        drop(a.lock().expect("lock").take());
    })
    .await;
    let done = done.expect("the generation moved to the other replica");
    assert!(done.stats.expect("stats").repairs >= 1, "rebuilt once");
    assert_eq!(ids.len(), 400, "no token lost");
    assert_eq!(done.token_ids, ids, "none repeated");
    assert_eq!(ids, in_process(&stories(), None, &story(400, 0)).token_ids);
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
    // With the first replica gone, new generations open on the other at once.
    for k in [4, 0] {
        let (ids, done) = stream(coordinator.url(), story(40, k), || {}).await;
        done.expect("served by the replica that is left");
        assert_eq!(ids, in_process(&stories(), None, &story(40, 0)).token_ids);
    }
}

#[tokio::test]
async fn a_draft_node_that_comes_late_is_attached_once_it_answers() {
    let target = start_target(&stories(), free_addr());
    let draft_addr = free_addr();
    // Ready with the target alone: the draft-node is not up yet.
    let coordinator = Proc::coordinator(
        &target.url(),
        &format!("http://{draft_addr}"),
        free_addr(),
        &[],
        None,
    );
    let (ids, done) = stream(coordinator.url(), story(40, 4), || {}).await;
    let stats = done
        .expect("served by the target alone")
        .stats
        .expect("stats");
    assert_eq!(stats.drafted, 0);
    let want = in_process(&stories(), None, &story(40, 0)).token_ids;
    assert_eq!(ids, want);
    let _draft = start_node("draft-node", &stories_q8(), draft_addr);
    let mut client = v1::coordinator_client::CoordinatorClient::connect(coordinator.url())
        .await
        .expect("connect");
    // Asked again with backoff (250 ms doubling to 10 s).
    let deadline = Instant::now() + Duration::from_secs(20);
    while !client
        .info(v1::InfoRequest {})
        .await
        .is_ok_and(|i| i.into_inner().draft.is_some())
    {
        assert!(
            Instant::now() < deadline,
            "the draft-node is attached once it answers"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (ids, done) = stream(coordinator.url(), story(40, 4), || {}).await;
    let stats = done.expect("generated").stats.expect("stats");
    assert!(stats.drafted > 0, "the draft is used: {stats:?}");
    assert_eq!(ids, want);
}

/// A target-node, two draft-node replicas (A, which a test may kill by taking it out of the
/// mutex, and B) and a coordinator given both, A first.
struct TwoDrafts {
    _target: Proc,
    draft_a: std::sync::Mutex<Option<Proc>>,
    _draft_b: Proc,
    coordinator: Proc,
}

fn two_drafts() -> TwoDrafts {
    let target = start_target(&stories(), free_addr());
    let draft_a = start_node("draft-node", &stories_q8(), free_addr());
    let draft_b = start_node("draft-node", &stories_q8(), free_addr());
    let coordinator = Proc::coordinator(
        &target.url(),
        &draft_a.url(),
        free_addr(),
        &["--draft", &draft_b.url()],
        None,
    );
    TwoDrafts {
        _target: target,
        draft_a: std::sync::Mutex::new(Some(draft_a)),
        _draft_b: draft_b,
        coordinator,
    }
}

#[tokio::test]
async fn a_lost_draft_replica_is_skipped_for_another() {
    // Bound whole: every process lives to the end of the test.
    let two = two_drafts();
    let (draft_a, coordinator) = (&two.draft_a, &two.coordinator);
    let want = in_process(&stories(), None, &story(40, 0)).token_ids;
    // The first draft replica gone: generations open their draft session on the other.
    drop(draft_a.lock().expect("lock").take());
    for _ in 0..3 {
        let (ids, done) = stream(coordinator.url(), story(40, 4), || {}).await;
        let stats = done.expect("generated").stats.expect("stats");
        assert!(stats.drafted > 0, "drafted on the replica left: {stats:?}");
        assert!(!stats.draft_lost, "{stats:?}");
        assert_eq!(ids, want);
    }
}

#[tokio::test]
async fn a_draft_replica_lost_mid_generation_is_replaced_by_another() {
    // Bound whole: every process lives to the end of the test.
    let two = two_drafts();
    let (draft_a, coordinator) = (&two.draft_a, &two.coordinator);
    // The generation opens its draft on A (the first, as least loaded); A dies mid-generation.
    let (ids, done) = stream(coordinator.url(), story(400, 4), || {
        drop(draft_a.lock().expect("lock").take());
    })
    .await;
    let stats = done.expect("generated").stats.expect("stats");
    assert!(stats.draft_lost, "A was lost: {stats:?}");
    assert!(stats.draft_reattached >= 1, "attached to B: {stats:?}");
    assert_eq!(ids, in_process(&stories(), None, &story(400, 0)).token_ids);
}
