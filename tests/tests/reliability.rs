//! Hard to break (issue 13): the three binaries as processes on loopback, the target-node lost
//! in the middle of a generation. Killed and restarted, it costs time, not tokens: the
//! coordinator rebuilds the session from its log and the streamed output is target-only's. Gone
//! for good, the client gets a clear UNAVAILABLE once `--target-retry-secs` has passed; with
//! replicas, the generation moves to another at once.
//!
//! Every fault lands mid-generation by construction, not by the machine's speed: the target
//! sits behind a gate that holds a verify block of the generation while the test injects the
//! fault, and lets it through after.

use std::path::Path;
use std::time::{Duration, Instant};

use tandem_proto::v1;
use tandem_runtime::SamplingParams;
use tandem_tests::faults::FaultProxy;
use tandem_tests::gate::{Gate, rounds_until, with_fault};
use tandem_tests::link::{Link, LinkSpec};
use tandem_tests::processes::Proc;
use tandem_tests::*;

fn start_target(model: &Path) -> Proc {
    Proc::node("target-node", model, &[])
}

fn start_draft() -> Proc {
    Proc::node("draft-node", &stories_q8(), &[])
}

fn story(n: u32, k: u32) -> v1::GenerateRequest {
    let prompt = tokenizer(&stories())
        .encode("Once upon a time")
        .expect("encode");
    request(&prompt, n, k, &SamplingParams::greedy())
}

/// [`story`] kept to a grammar (400 characters of lowercase words and punctuation, then the
/// end): the nodes mask with it, and a session rebuilt or attached anew must bring its state to
/// the log.
fn constrained(k: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        ignore_eos: false,
        constraint: Some(v1::Constraint {
            kind: Some(v1::constraint::Kind::Regex("[a-z ,.]{400}".into())),
            start: 0,
        }),
        ..story(400, k)
    }
}

/// What the coordinator at `url` streams for `req` with nothing going wrong.
async fn uninterrupted(url: &str, req: v1::GenerateRequest) -> Vec<u32> {
    let (ids, done) = stream(url.to_string(), req).await;
    assert_eq!(done.expect("generated").token_ids, ids);
    ids
}

/// A target-node behind a gate (a proxy whose upstream follows the node when it is restarted
/// elsewhere), a draft-node and a coordinator (with `extra` arguments) in front of them.
struct Three {
    target: Option<Proc>,
    gate: FaultProxy,
    _draft: Proc,
    coordinator: Proc,
}

async fn start_three(extra: &[&str]) -> Three {
    let target = start_target(&stories());
    let gate = FaultProxy::passing(target.addr);
    let gate_url = gate.clone().serve().await;
    let draft = start_draft();
    let coordinator = Proc::coordinator(&gate_url, &draft.url(), extra, None);
    Three {
        target: Some(target),
        gate,
        _draft: draft,
        coordinator,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_node_killed_and_restarted_mid_generation_loses_no_token() {
    let mut three = start_three(&[]).await;
    let plain = in_process(&stories(), None, &story(400, 0)).token_ids;
    let kept = uninterrupted(&three.coordinator.url(), constrained(0)).await;
    assert!(
        kept.len() > 2 * tandem_tests::gate::HOLD_AT,
        "{} tokens",
        kept.len()
    );
    for (k, req, want) in [
        (4, story(400, 4), &plain),
        (0, story(400, 0), &plain),
        (4, constrained(4), &kept),
    ] {
        let grammar = req.constraint.is_some();
        let (url, gate) = (three.coordinator.url(), three.gate.gate.clone());
        let (ids, done) = with_fault(&url, req, &gate, async || {
            // SIGKILL: no goodbye on the stream; back (on another port) before the block goes on.
            drop(three.target.take());
            let restarted = start_target(&stories());
            three.gate.upstream.point_to(restarted.addr);
            three.target = Some(restarted);
        })
        .await;
        let done = done.unwrap_or_else(|s| panic!("K = {k}: the generation failed: {s:?}"));
        let stats = done.stats.expect("stats");
        assert!(
            stats.repairs >= 1,
            "K = {k}: the target's session was rebuilt"
        );
        assert_eq!(done.token_ids, ids, "K = {k}: none repeated");
        assert_eq!(
            &ids, want,
            "K = {k}, grammar {grammar}: the output of an uninterrupted run"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_node_that_does_not_come_back_fails_the_generation_with_unavailable() {
    let mut three = start_three(&["--target-retry-secs", "2"]).await;
    let (url, gate) = (three.coordinator.url(), three.gate.gate.clone());
    // The retry time runs from the verify the target was lost under, sent before the kill.
    let start = Instant::now();
    let (_, done) = with_fault(&url, story(400, 4), &gate, async || {
        drop(three.target.take());
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_started_before_its_nodes_is_not_ready_until_they_answer() {
    // The nodes' stable addresses (as a Service's), with nobody behind them yet.
    let target_link = Link::unbound(LinkSpec::DIRECT).expect("link");
    let draft_link = Link::unbound(LinkSpec::DIRECT).expect("link");
    let coordinator = Proc::coordinator_starting(
        &target_link.url(),
        &draft_link.url(),
        &["--http-listen", "127.0.0.1:0"],
        None,
    );
    let http = coordinator.http();
    // Up, not ready: /health answers, /ready and requests say what is awaited, and why.
    assert_eq!(http_request(http, "GET", "/health", "").await.0, 200);
    let (status, body) = http_request(http, "GET", "/ready", "").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains(&target_link.addr.to_string()), "{body}");
    let (status, body) = http_request(
        http,
        "POST",
        "/v1/completions",
        r#"{"prompt": "Once upon a time", "max_tokens": 4}"#,
    )
    .await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("not ready"), "{body}");
    let (_, done) = stream(coordinator.url(), story(8, 4)).await;
    let status = done.expect_err("not ready");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    // `generate --endpoint` waits for readiness up to --wait-ready, then says what it waited for.
    let url = coordinator.url().to_string();
    let out = std::process::Command::new(processes::binary("coordinator"))
        .args(["generate", "--endpoint", &url, "--wait-ready", "1"])
        .args(["--max-tokens", "4", "--no-baseline"])
        .output()
        .expect("run coordinator generate");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("waited 1 s") && stderr.contains("not ready"),
        "{stderr}"
    );
    assert!(stderr.contains(&target_link.addr.to_string()), "{stderr}");
    // Sent before the nodes are up: it is answered once they are. (The nodes' binaries are
    // built first: the wait bounds a failure, not a build.)
    processes::binary("target-node");
    processes::binary("draft-node");
    let waiting = std::thread::spawn(move || {
        let wait = [
            "--wait-ready",
            "600",
            "--max-tokens",
            "8",
            "--draft-tokens",
            "4",
        ];
        processes::generate_cli(&[&["--endpoint", url.as_str()][..], &wait].concat(), &[])
    });
    // The nodes come up: the coordinator finds them and serves.
    let target = start_target(&stories());
    let draft = start_draft();
    target_link.point_to(target.addr);
    draft_link.point_to(draft.addr);
    let ids = waiting.join().expect("generate --endpoint waited");
    assert_eq!(ids, in_process(&stories(), None, &story(8, 0)).token_ids);
    let deadline = Instant::now() + Duration::from_secs(60);
    while http_request(http, "GET", "/ready", "").await.0 != 200 {
        assert!(
            Instant::now() < deadline,
            "ready once the nodes answer{}",
            coordinator.stderr_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (ids, done) = stream(coordinator.url(), story(40, 4)).await;
    done.expect("generated");
    assert_eq!(ids, in_process(&stories(), None, &story(40, 0)).token_ids);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_api_keys_only_a_request_presenting_one_gets_in() {
    let three = start_three(&[
        "--api-key",
        "s3cr3t-one",
        "--api-key",
        "s3cr3t-two",
        "--http-listen",
        "127.0.0.1:0",
    ])
    .await;
    let http = three.coordinator.http();
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
    let (_, done) = stream(three.coordinator.url(), story(8, 4)).await;
    let status = done.expect_err("no key");
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    assert!(!status.message().contains("s3cr3t"));
    let request = with_metadata(story(8, 4), "authorization", "Bearer s3cr3t-two");
    let replies = generate_over_grpc(three.coordinator.url(), request).await;
    let done = replies.into_iter().find_map(|reply| match reply.kind {
        Some(v1::generate_response::Kind::Done(done)) => Some(done),
        _ => None,
    });
    assert_eq!(done.expect("done").token_ids.len(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_node_back_with_another_model_is_refused_not_used() {
    let mut three = start_three(&[]).await;
    let (url, gate) = (three.coordinator.url(), three.gate.gate.clone());
    let (_, done) = with_fault(&url, story(400, 4), &gate, async || {
        drop(three.target.take());
        // Another model where the target was: the log cannot be continued there.
        let replaced = start_target(&stories_q8());
        three.gate.upstream.point_to(replaced.addr);
        three.target = Some(replaced);
    })
    .await;
    let status = done.expect_err("refused");
    assert!(
        status.message().contains("came back serving"),
        "the error names both models: {status:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_whose_replica_is_lost_continues_on_another() {
    let mut a = Some(start_target(&stories()));
    let a_gate = FaultProxy::passing(a.as_ref().expect("a").addr);
    let a_url = a_gate.clone().serve().await;
    let b = start_target(&stories());
    let draft = start_draft();
    // Replicas, the first listed (the least loaded's tie-break) to be lost; a retry time of an
    // hour: a move that waited for it would run into `with_fault`'s deadline.
    let coordinator = Proc::coordinator(
        &a_url,
        &draft.url(),
        &[
            "--target",
            &b.url(),
            "--target-retry-secs",
            "3600",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        None,
    );
    let (ids, done) = with_fault(
        &coordinator.url(),
        story(400, 4),
        &a_gate.gate,
        async || {
            drop(a.take());
        },
    )
    .await;
    let done = done.expect("the generation moved to the other replica");
    assert!(done.stats.expect("stats").repairs >= 1, "rebuilt once");
    assert_eq!(ids.len(), 400, "no token lost");
    assert_eq!(done.token_ids, ids, "none repeated");
    assert_eq!(ids, in_process(&stories(), None, &story(400, 0)).token_ids);
    // Counted as a failover: replayed on the other replica, after the lost one refused.
    let (_, page) = http_request(coordinator.listening("metrics"), "GET", "/metrics", "").await;
    for line in [
        "tandem_target_replays_total{replica=\"other\"} 1\n",
        "tandem_target_replays_total{replica=\"same\"} 0\n",
    ] {
        assert!(page.contains(line), "{line:?} in {page}");
    }
    // With the first replica gone, new generations open on the other at once.
    for k in [4, 0] {
        let (ids, done) = stream(coordinator.url(), story(40, k)).await;
        done.expect("served by the replica that is left");
        assert_eq!(ids, in_process(&stories(), None, &story(40, 0)).token_ids);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draft_node_that_comes_late_is_attached_once_it_answers() {
    let target = start_target(&stories());
    // The draft-node's stable address, with nobody behind it yet.
    let draft_link = Link::unbound(LinkSpec::DIRECT).expect("link");
    // Ready with the target alone: the draft-node is not up yet.
    let coordinator = Proc::coordinator(&target.url(), &draft_link.url(), &[], None);
    let (ids, done) = stream(coordinator.url(), story(40, 4)).await;
    let stats = done
        .expect("served by the target alone")
        .stats
        .expect("stats");
    assert_eq!(stats.drafted, 0);
    let want = in_process(&stories(), None, &story(40, 0)).token_ids;
    assert_eq!(ids, want);
    let draft = start_draft();
    draft_link.point_to(draft.addr);
    let mut client = v1::coordinator_client::CoordinatorClient::connect(coordinator.url())
        .await
        .expect("connect");
    // Asked again with backoff (250 ms doubling to 10 s).
    let deadline = Instant::now() + Duration::from_secs(60);
    while !client
        .info(v1::InfoRequest::default())
        .await
        .is_ok_and(|i| i.into_inner().draft.is_some())
    {
        assert!(
            Instant::now() < deadline,
            "the draft-node is attached once it answers{}",
            coordinator.stderr_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (ids, done) = stream(coordinator.url(), story(40, 4)).await;
    let stats = done.expect("generated").stats.expect("stats");
    assert!(stats.drafted > 0, "the draft is used: {stats:?}");
    assert_eq!(ids, want);
}

/// A target-node behind a gate, two draft-node replicas (A, which a test may kill, and B,
/// behind a proxy that counts its steps) and a coordinator given both, A first.
struct TwoDrafts {
    _target: Proc,
    gate: Gate,
    draft_a: Option<Proc>,
    _draft_b: Proc,
    b_proxy: FaultProxy,
    coordinator: Proc,
}

async fn two_drafts() -> TwoDrafts {
    let target = start_target(&stories());
    let gate = FaultProxy::passing(target.addr);
    let target_url = gate.clone().serve().await;
    let draft_a = start_draft();
    let draft_b = start_draft();
    let b_proxy = FaultProxy::passing(draft_b.addr);
    let b_url = b_proxy.clone().serve().await;
    let coordinator = Proc::coordinator(&target_url, &draft_a.url(), &["--draft", &b_url], None);
    TwoDrafts {
        _target: target,
        gate: gate.gate,
        draft_a: Some(draft_a),
        _draft_b: draft_b,
        b_proxy,
        coordinator,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_draft_replica_is_skipped_for_another() {
    let mut two = two_drafts().await;
    let want = in_process(&stories(), None, &story(40, 0)).token_ids;
    // The first draft replica gone: generations open their draft session on the other.
    drop(two.draft_a.take());
    for _ in 0..3 {
        let (ids, done) = stream(two.coordinator.url(), story(40, 4)).await;
        let stats = done.expect("generated").stats.expect("stats");
        assert!(stats.drafted > 0, "drafted on the replica left: {stats:?}");
        assert!(!stats.draft_lost, "{stats:?}");
        assert_eq!(ids, want);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draft_replica_lost_mid_generation_is_replaced_by_another() {
    let want = in_process(&stories(), None, &story(400, 0)).token_ids;
    draft_replaced_mid_generation(story(400, 4), None, want).await;
}

/// The same with a grammar: B's session is opened with it, its state brought to the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_constrained_generation_keeps_its_grammar_on_the_draft_that_replaces_another() {
    draft_replaced_mid_generation(constrained(4), Some(constrained(0)), Vec::new()).await;
}

/// A (the draft a generation of `req` opens on) dies mid-generation; B is attached in its
/// place and drafts; the output is `want`, or what `reference` streams before the fault.
async fn draft_replaced_mid_generation(
    req: v1::GenerateRequest,
    reference: Option<v1::GenerateRequest>,
    mut want: Vec<u32>,
) {
    let mut two = two_drafts().await;
    if let Some(reference) = reference {
        want = uninterrupted(&two.coordinator.url(), reference).await;
    }
    let b_steps = two.b_proxy.gate.clone();
    // The generation opens its draft on A (the first, as least loaded); A dies mid-generation,
    // and the generation goes on (a round at a time) until B, attached in its place, drafts.
    let url = two.coordinator.url();
    let gate = two.gate.clone();
    let (ids, done) = with_fault(&url, req, &gate, async || {
        drop(two.draft_a.take());
        rounds_until(&gate, "B attached and drafting", || b_steps.passed() > 0).await;
    })
    .await;
    let stats = done.expect("generated").stats.expect("stats");
    assert!(stats.draft_lost, "A was lost: {stats:?}");
    assert!(stats.draft_reattached >= 1, "attached to B: {stats:?}");
    assert!(b_steps.passed() > 0, "B drafted");
    assert_eq!(ids, want);
}
