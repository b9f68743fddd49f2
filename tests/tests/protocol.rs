//! The node protocol under misuse: prefix mismatches answered FAILED_PRECONDITION and repaired
//! by the coordinator, unknown sessions, values over the limits, cancellation freeing both
//! nodes' sessions.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tandem_coordinator::Engine;
use tandem_node::LimitsArgs;
use tandem_proto::v1::draft_service_client::DraftServiceClient;
use tandem_proto::v1::draft_service_server::{DraftService, DraftServiceServer};
use tandem_proto::v1::node_service_client::NodeServiceClient;
use tandem_proto::v1::node_service_server::{NodeService, NodeServiceServer};
use tandem_proto::v1::target_service_client::TargetServiceClient;
use tandem_proto::v1::{self, draft_request, draft_response, target_request, target_response};
use tandem_runtime::{SamplingParams, TokenLog};
use tandem_tests::*;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status, Streaming};

fn open(prompt: &[u32], max_new_tokens: u32) -> v1::OpenSession {
    v1::OpenSession {
        session_id: "test".into(),
        prompt: prompt.to_vec(),
        sampling: Some((&SamplingParams::greedy()).into()),
        max_new_tokens,
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
    let cases: [(v1::OpenSession, Code, &[&str]); 4] = [
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

    // In an open session, a block over K or with unknown tokens is rejected in-band.
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
        Ok(target_response::Kind::Rejected(r)) => {
            assert_eq!(r.code, Code::InvalidArgument as i32);
            assert!(
                r.message.contains("`k`") && r.message.contains("at most 8"),
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
    ];
    for (req, words) in cases {
        let err = engine.prepare(&req).expect_err("refused");
        assert_eq!(err.code(), Code::InvalidArgument, "{err}");
        for w in words {
            assert!(err.to_string().contains(w), "{err} lacks {w:?}");
        }
    }
}

/// Corrupts every third draft step's committed prefix (length and hash in turn) on its way to
/// the real draft-node, and counts the FAILED_PRECONDITION answers.
#[derive(Debug, Clone)]
struct CorruptingProxy {
    upstream: String,
    rejections: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl DraftService for CorruptingProxy {
    type SessionStream = ReceiverStream<Result<v1::DraftResponse, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<v1::DraftRequest>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let mut inbound = request.into_inner();
        let (up_tx, up_rx) = mpsc::channel(4);
        let mut upstream = DraftServiceClient::connect(self.upstream.clone())
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?
            .session(ReceiverStream::new(up_rx))
            .await?
            .into_inner();
        let (tx, rx) = mpsc::channel(4);
        let rejections = Arc::clone(&self.rejections);
        tokio::spawn(async move {
            let mut steps = 0;
            while let Ok(Some(mut message)) = inbound.message().await {
                if let Some(draft_request::Kind::Step(step)) = message.kind.as_mut() {
                    steps += 1;
                    if let (0, Some(p)) = (steps % 3, step.committed.as_mut()) {
                        if steps % 2 == 0 {
                            p.len += 1
                        } else {
                            p.hash ^= 1
                        }
                    }
                }
                if up_tx.send(message).await.is_err() {
                    break;
                }
                let Ok(Some(reply)) = upstream.message().await else {
                    break;
                };
                if let Some(draft_response::Kind::Rejected(r)) = &reply.kind {
                    assert_eq!(r.code, Code::FailedPrecondition as i32, "{}", r.message);
                    rejections.fetch_add(1, Ordering::Relaxed);
                }
                if tx.send(Ok(reply)).await.is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

#[tonic::async_trait]
impl NodeService for CorruptingProxy {
    async fn info(&self, r: Request<v1::InfoRequest>) -> Result<Response<v1::NodeInfo>, Status> {
        NodeServiceClient::connect(self.upstream.clone())
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?
            .info(r.into_inner())
            .await
    }

    async fn tokenizer(
        &self,
        r: Request<v1::TokenizerRequest>,
    ) -> Result<Response<v1::TokenizerReply>, Status> {
        NodeServiceClient::connect(self.upstream.clone())
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?
            .tokenizer(r.into_inner())
            .await
    }
}

#[tokio::test]
async fn desynchronised_steps_are_repaired_and_the_generation_finishes_correctly() {
    let cluster = cluster(&stories(), Some(&stories_q8()), &LimitsArgs::default()).await;
    let proxy = CorruptingProxy {
        upstream: format!("http://{}", cluster.draft_addr.expect("draft")),
        rejections: Arc::default(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let proxy_url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DraftServiceServer::new(proxy.clone()))
            .add_service(NodeServiceServer::new(proxy.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let target_url = format!("http://{}", cluster.target_addr);
    let engine = Engine::connect(&target_url, Some(&proxy_url), 4)
        .await
        .expect("engine");
    let req = request(&[1, 403, 407], 80, 4, &SamplingParams::greedy());
    let outcome = generate(&engine, &req).await;
    let baseline = in_process(
        &stories(),
        None,
        &request(&[1, 403, 407], 80, 0, &SamplingParams::greedy()),
    );
    assert_eq!(outcome.token_ids, baseline.token_ids);
    let rejected = proxy.rejections.load(Ordering::Relaxed);
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
        Arc::clone(&engine),
        std::future::pending(),
    ));
    let mut client = v1::coordinator_client::CoordinatorClient::connect(url)
        .await
        .expect("connect");
    let req = request(&[1, 403], 400, 4, &SamplingParams::greedy());
    let mut stream = client.generate(req).await.expect("generate").into_inner();
    let first = stream.message().await.expect("stream").expect("a delta");
    assert!(matches!(
        first.kind,
        Some(v1::generate_response::Kind::Delta(_))
    ));
    // The client reads no further: the generation waits for it with both sessions open.
    let (t, d) = (cluster.target_addr, cluster.draft_addr.expect("draft"));
    for addr in [t, d] {
        let info = node_info(addr).await;
        assert_eq!(info.active_sessions, 1, "{} holds the session", info.role);
        assert!(info.kv_cache_bytes > 0);
    }
    assert_eq!(engine.active(), 1);
    drop(stream);
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
