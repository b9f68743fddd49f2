//! The node protocol under misuse: prefix mismatches answered FAILED_PRECONDITION and repaired
//! by the coordinator, unknown sessions, values over the limits, cancellation freeing both
//! nodes' sessions.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tandem_node::LimitsArgs;
use tandem_proto::v1::target_service_client::TargetServiceClient;
use tandem_proto::v1::{self, draft_response, target_request, target_response};
use tandem_runtime::{SamplingParams, TokenLog};
use tandem_tests::held::Held;
use tandem_tests::proxy::corrupting_proxy;
use tandem_tests::*;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status, Streaming};

fn open(prompt: &[u32], max_new_tokens: u32) -> v1::OpenSession {
    v1::OpenSession {
        session_id: "test".into(),
        prompt: prompt.to_vec(),
        sampling: Some((&SamplingParams::greedy()).into()),
        max_new_tokens,
        top_logprobs: None,
        constraint: None,
        cache_salt: Vec::new(),
    }
}

fn wire_prefix(log: &TokenLog) -> Option<v1::Prefix> {
    let p = log.prefix();
    Some(v1::Prefix {
        len: p.len as u32,
        hash: p.hash,
    })
}

/// A raw target session stream.
async fn target_stream(
    addr: std::net::SocketAddr,
) -> (
    mpsc::Sender<v1::TargetRequest>,
    Streaming<v1::TargetResponse>,
) {
    let (tx, rx) = mpsc::channel(4);
    let responses = TargetServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("connect")
        .session(ReceiverStream::new(rx))
        .await
        .expect("session")
        .into_inner();
    (tx, responses)
}

async fn target_call(
    tx: &mpsc::Sender<v1::TargetRequest>,
    rx: &mut Streaming<v1::TargetResponse>,
    kind: target_request::Kind,
) -> Result<target_response::Kind, Status> {
    tx.send(v1::TargetRequest { kind: Some(kind) })
        .await
        .expect("send");
    Ok(rx.message().await?.expect("a reply").kind.expect("kind"))
}

fn verify(
    committed: Option<v1::Prefix>,
    new_tokens: Vec<u32>,
    drafts: Vec<u32>,
) -> target_request::Kind {
    let q = drafts
        .iter()
        .map(|&t| tandem_proto::distribution_to_wire(&tandem_runtime::Distribution::OneHot(t)))
        .collect();
    target_request::Kind::Verify(v1::VerifyBlock {
        committed,
        new_tokens,
        drafts,
        q,
        parents: Vec::new(),
    })
}

#[tokio::test]
async fn a_wrong_prefix_gets_failed_precondition_and_the_session_survives() {
    let cluster = cluster(&stories(), None, &LimitsArgs::default()).await;
    let (tx, mut rx) = target_stream(cluster.target_addr).await;
    let mut log = TokenLog::new(&[1, 403, 407]);
    let opened = target_call(
        &tx,
        &mut rx,
        target_request::Kind::Open(open(log.tokens(), 20)),
    )
    .await
    .expect("open");
    assert!(matches!(opened, target_response::Kind::Opened(o) if o.committed == wire_prefix(&log)));

    let held = wire_prefix(&log).expect("prefix");
    let wrong_len = v1::Prefix {
        len: held.len + 1,
        ..held
    };
    let wrong_hash = v1::Prefix {
        hash: held.hash ^ 1,
        ..held
    };
    for wrong in [wrong_len, wrong_hash] {
        match target_call(&tx, &mut rx, verify(Some(wrong), vec![], vec![5, 6])).await {
            Ok(target_response::Kind::Rejected(r)) => {
                assert_eq!(r.code, Code::FailedPrecondition as i32, "{}", r.message);
                assert_eq!(r.held, Some(held), "the rejection says what the node holds");
                assert!(r.message.contains("prefix mismatch"), "{}", r.message);
            }
            other => panic!("expected a rejection, got {other:?}"),
        }
    }
    // The same stream goes on from the prefix the node named.
    match target_call(&tx, &mut rx, verify(Some(held), vec![], vec![])).await {
        Ok(target_response::Kind::Verdict(v)) => {
            log.extend(&[v.next_token]);
            assert_eq!(v.committed, wire_prefix(&log));
        }
        other => panic!("expected a verdict, got {other:?}"),
    }
    // A duplicated (stale) block names a prefix the node has moved past: refused, not applied.
    let stale = target_call(&tx, &mut rx, verify(Some(held), vec![], vec![])).await;
    assert!(
        matches!(stale, Ok(target_response::Kind::Verdict(_))),
        "rolling back to a held prefix is allowed"
    );
}

#[tokio::test]
async fn unknown_session_and_values_over_the_limits_are_named() {
    let limits = LimitsArgs {
        max_sessions: 1,
        max_session_tokens: 64,
        max_draft_tokens: 8,
        ..LimitsArgs::default()
    };
    let cluster = cluster(&stories(), None, &limits).await;

    // A verify before any open.
    let (tx, mut rx) = target_stream(cluster.target_addr).await;
    let err = target_call(&tx, &mut rx, verify(None, vec![], vec![]))
        .await
        .expect_err("no session");
    assert_eq!(err.code(), Code::NotFound);
    assert!(
        err.message().contains("send `open` first"),
        "{}",
        err.message()
    );

    // Open refusals end the stream with a status naming the field and the limit.
    let cases: [(v1::OpenSession, Code, &[&str]); 6] = [
        (
            v1::OpenSession {
                session_id: "x\n2026-01-01 INFO forged".into(),
                ..open(&[1], 8)
            },
            Code::InvalidArgument,
            &["`session_id`", "ASCII letters"],
        ),
        (
            v1::OpenSession {
                cache_salt: vec![7; 65],
                ..open(&[1], 8)
            },
            Code::InvalidArgument,
            &["`cache_salt`", "65 bytes", "at most 64"],
        ),
        (open(&[], 8), Code::InvalidArgument, &["empty prompt"]),
        (
            open(&[1, 2], 100),
            Code::InvalidArgument,
            &["100 new tokens", "context of 64"],
        ),
        (
            open(&[1, 9999], 8),
            Code::InvalidArgument,
            &["`prompt`", "token 9999", "512"],
        ),
        (
            v1::OpenSession {
                sampling: Some(v1::SamplingParams {
                    temperature: -1.0,
                    ..Default::default()
                }),
                ..open(&[1], 8)
            },
            Code::InvalidArgument,
            &["`temperature`", "[0, 100]"],
        ),
    ];
    for (request, code, words) in cases {
        let (tx, mut rx) = target_stream(cluster.target_addr).await;
        let err = target_call(&tx, &mut rx, target_request::Kind::Open(request))
            .await
            .expect_err("refused");
        assert_eq!(err.code(), code, "{}", err.message());
        for w in words {
            assert!(err.message().contains(w), "{:?} lacks {w:?}", err.message());
        }
    }

    // In an open session, a block over K is a draft's fault: refused in the verdict, which is
    // a plain target step. New tokens out of the vocabulary are the coordinator's: rejected
    // in-band, the session kept.
    let (tx, mut rx) = target_stream(cluster.target_addr).await;
    let log = TokenLog::new(&[1, 403]);
    target_call(
        &tx,
        &mut rx,
        target_request::Kind::Open(open(log.tokens(), 8)),
    )
    .await
    .expect("open");
    let too_many = verify(wire_prefix(&log), vec![], vec![5; 9]);
    match target_call(&tx, &mut rx, too_many).await {
        Ok(target_response::Kind::Verdict(v)) => {
            let r = v.draft_refused.expect("refused");
            assert_eq!(r.reason, "too_many_drafts");
            assert!(r.message.contains("at most 8"), "{}", r.message);
            assert_eq!(v.accepted, 0);
        }
        other => panic!("expected a verdict, got {other:?}"),
    }
    let unknown = verify(wire_prefix(&log), vec![9999], vec![]);
    match target_call(&tx, &mut rx, unknown).await {
        Ok(target_response::Kind::Rejected(r)) => {
            assert_eq!(r.code, Code::InvalidArgument as i32);
            assert!(
                r.message.contains("`new_tokens`") && r.message.contains("token 9999"),
                "{}",
                r.message
            );
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
    // A second session is over --max-sessions.
    let (tx2, mut rx2) = target_stream(cluster.target_addr).await;
    let err = target_call(&tx2, &mut rx2, target_request::Kind::Open(open(&[1], 4)))
        .await
        .expect_err("over the limit");
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert!(
        err.message().contains("--max-sessions"),
        "{}",
        err.message()
    );
}

#[tokio::test]
async fn the_kv_budget_admits_what_fits_and_refuses_the_rest_at_once() {
    // stories260K: 5 layers × 4 kv heads × 8 dims, keys and values, f32 = 1280 bytes a position.
    let per_position = 1280;
    let limits = LimitsArgs {
        max_draft_tokens: 8,
        kv_cache_bytes: 100 * per_position,
        ..LimitsArgs::default()
    };
    let cluster = cluster(&stories(), None, &limits).await;
    // 2 prompt tokens + 40 new + one block of 8 drafts and its bonus: 51 positions.
    let (tx, mut rx) = target_stream(cluster.target_addr).await;
    let log = TokenLog::new(&[1, 403]);
    target_call(
        &tx,
        &mut rx,
        target_request::Kind::Open(open(log.tokens(), 40)),
    )
    .await
    .expect("fits");
    let step = target_call(&tx, &mut rx, verify(wire_prefix(&log), vec![], vec![5; 8])).await;
    assert!(
        matches!(step, Ok(target_response::Kind::Verdict(_))),
        "{step:?}"
    );
    let info = node_info(cluster.target_addr).await;
    assert!(
        info.kv_cache_bytes <= 51 * per_position,
        "the cache stays within its reservation: {} bytes",
        info.kv_cache_bytes
    );
    // 70 positions do not fit in the 49 left: refused at once, naming need, free and budget.
    let (tx2, mut rx2) = target_stream(cluster.target_addr).await;
    let err = target_call(&tx2, &mut rx2, target_request::Kind::Open(open(&[1], 60)))
        .await
        .expect_err("over the budget");
    assert_eq!(err.code(), Code::ResourceExhausted);
    for w in ["89600", "62720", "128000", "--kv-cache-bytes"] {
        assert!(err.message().contains(w), "{:?} lacks {w:?}", err.message());
    }
    // Through the coordinator's HTTP API: 429 with Retry-After.
    let engine = Arc::new(cluster.engine(0).await.expect("engine"));
    let http = serve_http(engine).await;
    let body = r#"{"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 60}"#;
    let (status, head, body) = http_exchange(http, "POST", "/v1/completions", body).await;
    assert_eq!(status, 429, "{body}");
    assert!(
        head.to_ascii_lowercase().contains("retry-after: 1"),
        "{head}"
    );
    assert!(body.contains("--kv-cache-bytes"), "{body}");
    // The first session ends: its reservation is free again and the second fits.
    drop((tx, rx));
    assert!(
        eventually(async || node_info(cluster.target_addr).await.active_sessions == 0).await,
        "the session is freed"
    );
    let (tx3, mut rx3) = target_stream(cluster.target_addr).await;
    target_call(&tx3, &mut rx3, target_request::Kind::Open(open(&[1], 60)))
        .await
        .expect("fits once the first session ended");
}

#[tokio::test]
async fn the_coordinator_names_bad_requests() {
    let cluster = cluster(&stories(), Some(&stories_q8()), &LimitsArgs::default()).await;
    let engine = cluster.engine(4).await.expect("engine");
    let base = request(&[1, 403], 16, 4, &SamplingParams::greedy());
    let cases: Vec<(v1::GenerateRequest, &[&str])> = vec![
        (
            v1::GenerateRequest {
                prompt_tokens: vec![],
                ..base.clone()
            },
            &["empty prompt"],
        ),
        (
            v1::GenerateRequest {
                draft_tokens: Some(33),
                ..base.clone()
            },
            &["`draft_tokens`", "at most 32"],
        ),
        (
            v1::GenerateRequest {
                max_tokens: 600,
                ..base.clone()
            },
            &["600 new tokens", "context of 512"],
        ),
        (
            v1::GenerateRequest {
                sampling: Some(v1::SamplingParams {
                    top_p: 1.5,
                    ..Default::default()
                }),
                ..base.clone()
            },
            &["`top_p`", "(0, 1]"],
        ),
        (
            v1::GenerateRequest {
                prompt_tokens: vec![1, 512],
                ..base.clone()
            },
            &["token id 512", "512 tokens"],
        ),
        (
            v1::GenerateRequest {
                cache_salt: "s".repeat(1025),
                ..base.clone()
            },
            &["`cache_salt`", "1025 bytes", "at most 1024"],
        ),
    ];
    for (req, words) in cases {
        let err = engine.prepare(&req).expect_err("refused");
        assert_eq!(err.code(), Code::InvalidArgument, "{err}");
        for w in words {
            assert!(err.to_string().contains(w), "{err} lacks {w:?}");
        }
    }
}

#[tokio::test]
async fn desynchronised_steps_are_repaired_and_the_generation_finishes_correctly() {
    let cluster = cluster(&stories(), Some(&stories_q8()), &LimitsArgs::default()).await;
    let rejections = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&rejections);
    let proxy_url = corrupting_proxy(cluster.draft_addr.expect("draft"))
        .on_reply(move |_, reply| {
            if let Some(draft_response::Kind::Rejected(r)) = &reply.kind {
                assert_eq!(r.code, Code::FailedPrecondition as i32, "{}", r.message);
                counted.fetch_add(1, Ordering::Relaxed);
            }
        })
        .serve()
        .await;
    let engine = engine_through(&cluster, &proxy_url, 4).await;
    let req = request(&[1, 403, 407], 80, 4, &SamplingParams::greedy());
    let outcome = generate(&engine, &req).await;
    let baseline = in_process(
        &stories(),
        None,
        &request(&[1, 403, 407], 80, 0, &SamplingParams::greedy()),
    );
    assert_eq!(outcome.token_ids, baseline.token_ids);
    let rejected = rejections.load(Ordering::Relaxed);
    assert!(
        rejected >= 3,
        "the proxy corrupted several steps: {rejected} rejections"
    );
    assert_eq!(
        outcome.stats.repairs as usize, rejected,
        "each mismatch was repaired once"
    );
    assert!(!outcome.stats.draft_lost);
    assert!(outcome.stats.base.accepted > 0);
}

#[tokio::test]
async fn cancelling_a_generation_frees_the_sessions_on_both_nodes() {
    let cluster = cluster(&stories(), Some(&stories_q8()), &LimitsArgs::default()).await;
    let engine = Arc::new(cluster.engine(4).await.expect("engine"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(tandem_coordinator::serve(
        listener,
        tandem_coordinator::late_engine::LateEngine::ready(Arc::clone(&engine)),
        Default::default(),
        Default::default(),
        std::future::pending(),
    ));
    // The client reads its first delta and no further: the generation waits for it with both
    // sessions open.
    let held = Held::start(url, request(&[1, 403], 400, 4, &SamplingParams::greedy())).await;
    let (t, d) = (cluster.target_addr, cluster.draft_addr.expect("draft"));
    for addr in [t, d] {
        let info = node_info(addr).await;
        assert_eq!(info.active_sessions, 1, "{} holds the session", info.role);
        assert!(info.kv_cache_bytes > 0);
    }
    assert_eq!(engine.active(), 1);
    held.cancel();
    for addr in [t, d] {
        assert!(
            eventually(async || node_info(addr).await.active_sessions == 0).await,
            "the session on {addr} is freed after the client cancels"
        );
        assert_eq!(node_info(addr).await.kv_cache_bytes, 0);
    }
    assert!(eventually(async || engine.active() == 0).await);
}

#[tokio::test]
async fn an_idle_session_is_closed_and_freed() {
    let limits = LimitsArgs {
        idle_timeout_secs: 1,
        ..LimitsArgs::default()
    };
    let cluster = cluster(&stories(), None, &limits).await;
    let (tx, mut rx) = target_stream(cluster.target_addr).await;
    target_call(&tx, &mut rx, target_request::Kind::Open(open(&[1, 403], 8)))
        .await
        .expect("open");
    assert_eq!(node_info(cluster.target_addr).await.active_sessions, 1);
    let err = rx
        .message()
        .await
        .expect_err("the node ends an idle session");
    assert_eq!(err.code(), Code::DeadlineExceeded);
    assert!(
        err.message().contains("--idle-timeout-secs"),
        "{}",
        err.message()
    );
    assert_eq!(node_info(cluster.target_addr).await.active_sessions, 0);
}

#[tokio::test]
async fn every_node_reports_health_and_info() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let cluster = cluster(&stories(), Some(&stories_q8()), &LimitsArgs::default()).await;
    let (t, d) = (cluster.target_addr, cluster.draft_addr.expect("draft"));
    for (addr, service, role) in [
        (t, "tandem.v1.TargetService", "target"),
        (d, "tandem.v1.DraftService", "draft"),
    ] {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("url")
            .connect()
            .await
            .expect("connect");
        let mut health = HealthClient::new(channel);
        for name in ["", service] {
            let status = health
                .check(HealthCheckRequest {
                    service: name.into(),
                })
                .await
                .expect("health")
                .into_inner()
                .status;
            assert_eq!(status, ServingStatus::Serving as i32, "{role} {name:?}");
        }
        let info = node_info(addr).await;
        assert_eq!(info.role, role);
        assert_eq!(info.vocab_size, 512);
        assert_eq!(info.max_context, 512);
        assert_eq!(info.stop_token_ids, vec![1, 2]);
        assert_eq!(info.limits.expect("limits").max_draft_tokens, 32);
    }
    assert_eq!(node_info(t).await.vocab_hash, node_info(d).await.vocab_hash);
    assert_eq!(node_info(t).await.model_name, "stories260K");
}

/// A duplicated VerifyBlock gets the identical verdict without a second forward pass, and the
/// same block in a new session (a reconnect, a replay) gets the same verdict too: draws are
/// keyed by position. Sampled, with a dense q, so that the acceptance test and the residual
/// both draw.
#[tokio::test]
async fn a_repeated_verify_block_gets_the_same_verdict() {
    let cluster = cluster(&stories(), None, &LimitsArgs::default()).await;
    let log = TokenLog::new(&[1, 403, 407]);
    let sampling = sampled(11);
    let flat = tandem_runtime::Distribution::Dense(vec![1.0 / 512.0; 512]);
    let block = target_request::Kind::Verify(v1::VerifyBlock {
        committed: wire_prefix(&log),
        new_tokens: vec![],
        drafts: vec![300, 301, 302],
        q: vec![tandem_proto::distribution_to_wire(&flat); 3],
        parents: Vec::new(),
    });
    let mut verdicts = Vec::new();
    for _session in 0..2 {
        let (tx, mut rx) = target_stream(cluster.target_addr).await;
        let open = v1::OpenSession {
            sampling: Some((&sampling).into()),
            ..open(log.tokens(), 20)
        };
        target_call(&tx, &mut rx, target_request::Kind::Open(open))
            .await
            .expect("open");
        let repeated = cluster.target.metrics.repeated_blocks.get();
        let first = target_call(&tx, &mut rx, block.clone())
            .await
            .expect("verify");
        let again = target_call(&tx, &mut rx, block.clone())
            .await
            .expect("verify");
        assert!(matches!(&first, target_response::Kind::Verdict(v) if v.draft_refused.is_none()));
        assert_eq!(first, again, "a duplicate gets the identical reply");
        assert_eq!(
            cluster.target.metrics.repeated_blocks.get(),
            repeated + 1,
            "without a second forward pass"
        );
        verdicts.push(first);
    }
    let strip = |k: &target_response::Kind| match k {
        target_response::Kind::Verdict(v) => (v.accepted, v.next_token, v.committed),
        other => panic!("expected a verdict, got {other:?}"),
    };
    assert_eq!(
        strip(&verdicts[0]),
        strip(&verdicts[1]),
        "a new session verifying the same block reaches the same verdict"
    );
}

/// A block the target refuses is answered with a plain target step naming the position and the
/// reason, never with an error: the session goes on.
#[tokio::test]
async fn a_bad_block_is_refused_in_the_verdict_and_the_session_goes_on() {
    let cluster = cluster(&stories(), None, &LimitsArgs::default()).await;
    let (tx, mut rx) = target_stream(cluster.target_addr).await;
    let mut log = TokenLog::new(&[1, 403, 407]);
    target_call(
        &tx,
        &mut rx,
        target_request::Kind::Open(open(log.tokens(), 40)),
    )
    .await
    .expect("open");
    let plain = match target_call(&tx, &mut rx, verify(wire_prefix(&log), vec![], vec![]))
        .await
        .expect("verify")
    {
        target_response::Kind::Verdict(v) => v.next_token,
        other => panic!("expected a verdict, got {other:?}"),
    };
    // Two good drafts, then one whose one-hot q names another token; then 40 drafts, over
    // --max-draft-tokens (32) and the session's room.
    let mut lying = verify(wire_prefix(&log), vec![], vec![plain, 7, 9]);
    if let target_request::Kind::Verify(b) = &mut lying {
        b.q[2] = tandem_proto::distribution_to_wire(&tandem_runtime::Distribution::OneHot(10));
    }
    let too_long = verify(wire_prefix(&log), vec![], vec![5; 40]);
    // A million empty sparse q for one draft: refused by count before anything is decoded.
    let mut flood = verify(wire_prefix(&log), vec![], vec![plain]);
    if let target_request::Kind::Verify(b) = &mut flood {
        let empty = v1::Distribution {
            kind: Some(v1::distribution::Kind::Sparse(v1::SparseProbs {
                vocab_size: 512,
                ..Default::default()
            })),
        };
        b.q = vec![empty; 1_000_000];
    }
    for (block, position, reason) in [
        (lying, 2, "no_mass_on_draft"),
        (too_long, 32, "too_many_drafts"),
        (flood, 1, "q_count"),
    ] {
        match target_call(&tx, &mut rx, block)
            .await
            .expect("a verdict, not an error")
        {
            target_response::Kind::Verdict(v) => {
                let r = v.draft_refused.expect("refused");
                assert_eq!(
                    (r.position, r.reason.as_str()),
                    (position, reason),
                    "{}",
                    r.message
                );
                assert!(
                    r.message.contains(&format!("draft {}", position + 1)),
                    "{}",
                    r.message
                );
                assert_eq!(
                    (v.accepted, v.next_token),
                    (0, plain),
                    "a plain target step"
                );
                let mut after = log.clone();
                after.extend(&[plain]);
                assert_eq!(v.committed, wire_prefix(&after));
            }
            other => panic!("expected a verdict, got {other:?}"),
        }
    }
    log.extend(&[plain]);
    assert!(matches!(
        target_call(&tx, &mut rx, verify(wire_prefix(&log), vec![], vec![])).await,
        Ok(target_response::Kind::Verdict(_))
    ));
}

/// A tree of drafts on the wire (issue 31): the target-node verifies every node in one pass and
/// answers the accepted path; a malformed or oversized tree is refused in the verdict (one
/// plain target step), and the session goes on.
#[tokio::test]
async fn a_tree_of_drafts_is_verified_and_a_malformed_one_refused() {
    let cluster = cluster(&stories(), None, &LimitsArgs::default()).await;
    let prompt = [1, 403, 407];
    let want = in_process(
        &stories(),
        None,
        &request(&prompt, 12, 0, &SamplingParams::greedy()),
    )
    .token_ids;
    let (tx, mut rx) = target_stream(cluster.target_addr).await;
    let mut log = TokenLog::new(&prompt);
    target_call(
        &tx,
        &mut rx,
        target_request::Kind::Open(open(log.tokens(), 20)),
    )
    .await
    .expect("open");
    let one_hot =
        |t: u32| tandem_proto::distribution_to_wire(&tandem_runtime::Distribution::OneHot(t));
    let wrong = |t: u32| (t + 1) % 512;
    let tree = |log: &TokenLog, drafts: Vec<u32>, parents: Vec<u32>| {
        target_request::Kind::Verify(v1::VerifyBlock {
            committed: wire_prefix(log),
            new_tokens: vec![],
            q: drafts.iter().map(|&t| one_hot(t)).collect(),
            drafts,
            parents,
        })
    };
    let verdict = |reply: target_response::Kind| match reply {
        target_response::Kind::Verdict(v) => v,
        other => panic!("expected a verdict: {other:?}"),
    };
    // prefix ─ wrong
    //        └ right ─ next
    //                └ wrong(next)
    let (right, next) = (want[0], want[1]);
    let block = tree(
        &log,
        vec![wrong(right), right, next, wrong(next)],
        vec![0, 0, 2, 2],
    );
    let v = verdict(target_call(&tx, &mut rx, block).await.expect("verify"));
    assert_eq!(
        (v.path.clone(), v.accepted, v.next_token),
        (vec![1, 2], 2, want[2])
    );
    assert!(v.draft_refused.is_none());
    log.extend(&want[..3]);
    assert_eq!(v.committed, wire_prefix(&log));
    // A parent after its child: refused, one plain step.
    let block = tree(&log, vec![want[3], want[4]], vec![2, 0]);
    let v = verdict(target_call(&tx, &mut rx, block).await.expect("verify"));
    let refusal = v.draft_refused.expect("refused");
    assert_eq!(refusal.reason, "malformed_tree", "{}", refusal.message);
    assert!(refusal.message.contains("parent"), "{}", refusal.message);
    assert_eq!((v.accepted, v.next_token), (0, want[3]));
    log.extend(&want[3..4]);
    // More nodes than the node's --max-draft-tokens (32): refused by count.
    let many: Vec<u32> = (0..33).map(|i| 10 + i).collect();
    let block = tree(&log, many, vec![0; 33]);
    let v = verdict(target_call(&tx, &mut rx, block).await.expect("verify"));
    assert_eq!(v.draft_refused.expect("refused").reason, "too_many_drafts");
    assert_eq!(v.next_token, want[4]);
    log.extend(&want[4..5]);
    // And the session goes on: a chain given as a tree.
    let block = tree(&log, want[5..8].to_vec(), vec![0, 1, 2]);
    let v = verdict(target_call(&tx, &mut rx, block).await.expect("verify"));
    assert_eq!((v.path, v.next_token), (vec![0, 1, 2], want[8]));
}
