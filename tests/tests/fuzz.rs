//! Property tests over untrusted input (issue 13), 10,000 cases each: every node request a
//! stream may carry (open, verify, draft step, close, in any order, with any values; and
//! messages decoded from arbitrary bytes) driven through the node's own session code, and every
//! OpenAI request body through the HTTP API's router. No panic; every refusal is a client error
//! (INVALID_ARGUMENT and kin / HTTP 4xx) whose message names what was wrong.

use std::sync::{Arc, LazyLock};

use proptest::prelude::*;
use prost::Message;
use tandem_draft_node::DraftSession;
use tandem_node::{Incoming, LimitsArgs, NodeState, Role, Session};
use tandem_proto::v1;
use tandem_target_node::TargetSession;
use tandem_tests::*;
use tonic::Code;

const CASES: u32 = 10_000;
/// The cases' seed (change it to explore others).
const SEED: u64 = 0x7a4d_e301;

static TARGET: LazyLock<NodeState> =
    LazyLock::new(|| node(Role::Target, &stories(), &LimitsArgs::default()));
static DRAFT: LazyLock<NodeState> =
    LazyLock::new(|| node(Role::Draft, &stories_q8(), &LimitsArgs::default()));

/// A client error that says what was wrong; anything else fails the case.
fn check_refusal(e: &tandem_node::Error) -> Result<(), TestCaseError> {
    let text = e.to_string();
    let client = matches!(
        e.code(),
        Code::InvalidArgument
            | Code::OutOfRange
            | Code::FailedPrecondition
            | Code::NotFound
            | Code::ResourceExhausted
    );
    prop_assert!(client, "not a client error: {:?}: {text}", e.code());
    if e.code() == Code::InvalidArgument {
        prop_assert!(
            text.contains('`') || text.contains("prompt"),
            "names no field: {text}"
        );
    }
    Ok(())
}

fn floats() -> impl Strategy<Value = f32> {
    prop_oneof![
        40 => 0.0f32..1.0,
        1 => Just(0.0f32),
        1 => Just(1.0),
        1 => Just(-1.0),
        1 => Just(f32::NAN),
        1 => Just(f32::INFINITY),
        1 => Just(1e30),
        1 => -2.0f32..3.0,
    ]
}

fn tokens(max_len: usize) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(
        prop_oneof![200 => 0u32..512, 1 => 512u32..600, 1 => Just(u32::MAX), 1 => any::<u32>()],
        0..max_len,
    )
}

/// Stands for the prefix the session holds (filled in by [`drive`]): most blocks and steps
/// continue the session, so the cases reach the model, not only the prefix check.
const HELD: v1::Prefix = v1::Prefix {
    len: u32::MAX - 1,
    hash: 0,
};

fn prefix() -> impl Strategy<Value = Option<v1::Prefix>> {
    let random = (prop_oneof![0u32..40, any::<u32>()], any::<u64>())
        .prop_map(|(len, hash)| Some(v1::Prefix { len, hash }));
    prop_oneof![8 => Just(Some(HELD)), 1 => random, 1 => Just(None)]
}

fn open() -> impl Strategy<Value = v1::OpenSession> {
    let sampling = (
        floats(),
        prop_oneof![0u32..600, any::<u32>()],
        floats(),
        floats(),
        floats(),
        prop_oneof![0u32..128, any::<u32>()],
        any::<Option<u64>>(),
        floats(),
        floats(),
    )
        .prop_map(
            |(temperature, top_k, top_p, min_p, rp, last_n, seed, presence, frequency)| {
                v1::SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    repetition_penalty: rp,
                    repeat_last_n: last_n,
                    seed,
                    presence_penalty: presence,
                    frequency_penalty: frequency,
                }
            },
        );
    let session_id = prop_oneof![
        8 => Just("gen-1".to_string()),
        1 => ".{0,40}",
        1 => Just("x".repeat(300)),
    ];
    (
        session_id,
        tokens(12),
        prop::option::weighted(0.9, sampling),
        prop_oneof![8 => 1u32..64, 1 => any::<u32>()],
        prop::option::weighted(0.3, prop_oneof![0u32..24, any::<u32>()]),
        prop::option::weighted(0.2, constraint()),
        prop_oneof![8 => Just(Vec::new()), 2 => prop::collection::vec(any::<u8>(), 0..80)],
    )
        .prop_map(
            |(session_id, prompt, sampling, max_new_tokens, top_logprobs, constraint, salt)| {
                v1::OpenSession {
                    session_id,
                    prompt,
                    sampling,
                    max_new_tokens,
                    top_logprobs,
                    constraint,
                    cache_salt: salt,
                }
            },
        )
}

/// A grammar of any kind, valid or not (schemas that are not JSON, regexes and Lark that do not
/// parse), starting anywhere.
fn constraint() -> impl Strategy<Value = v1::Constraint> {
    use v1::constraint::Kind;
    let kind = prop_oneof![
        any::<bool>().prop_map(Kind::JsonObject),
        prop_oneof![
            Just(r#"{"type": "object", "properties": {"a": {"type": "integer"}}}"#.to_string()),
            ".{0,60}",
        ]
        .prop_map(Kind::JsonSchema),
        prop_oneof![Just("[0-9]{1,3}".to_string()), ".{0,30}"].prop_map(Kind::Regex),
        prop_oneof![Just(r#"start: "a" | "b""#.to_string()), ".{0,40}"].prop_map(Kind::Lark),
    ];
    (
        prop::option::weighted(0.95, kind),
        prop_oneof![8 => 0u32..64, 1 => any::<u32>()],
    )
        .prop_map(|(kind, start)| v1::Constraint { kind, start })
}

fn distribution() -> impl Strategy<Value = v1::Distribution> {
    use v1::distribution::Kind;
    let kind = prop_oneof![
        4 => prop_oneof![0u32..600, any::<u32>()].prop_map(Kind::OneHot),
        1 => (
            prop_oneof![Just(512u32), any::<u32>()],
            tokens(6),
            prop::collection::vec(floats(), 0..6),
        )
            .prop_map(|(vocab_size, ids, probs)| Kind::Sparse(v1::SparseProbs {
                vocab_size,
                ids,
                probs,
            })),
        1 => prop::collection::vec(any::<u8>(), 0..64).prop_map(Kind::DenseF32),
        1 => Just(Kind::DenseF32(
            (0..512)
                .flat_map(|_| (1.0f32 / 512.0).to_le_bytes())
                .collect()
        )),
    ];
    prop::option::of(kind).prop_map(|kind| v1::Distribution { kind })
}

fn verify() -> impl Strategy<Value = v1::VerifyBlock> {
    (
        prefix(),
        tokens(6),
        tokens(6),
        prop::collection::vec(distribution(), 0..6),
        // A chain, or a tree's parents: well formed or not (after their child, too many).
        prop_oneof![
            2 => Just(Vec::new()),
            1 => prop::collection::vec(0u32..4, 0..7),
            1 => prop::collection::vec(any::<u32>(), 0..7),
        ],
    )
        .prop_map(
            |(committed, new_tokens, drafts, q, parents)| v1::VerifyBlock {
                committed,
                new_tokens,
                drafts,
                q,
                parents,
            },
        )
}

fn step() -> impl Strategy<Value = v1::DraftStep> {
    let k = prop_oneof![0u32..12, any::<u32>()];
    // Mostly chains (a tree's siblings past K or the limit are refused before any drafting).
    let branches = prop_oneof![3 => Just(0u32), 1 => 0u32..6, 1 => any::<u32>()];
    // Any float: NaN, negative and past 1 included (a bound nothing meets cuts after one draft).
    let min_confidence = prop_oneof![3 => Just(0.0f32), 1 => any::<f32>()];
    (prefix(), tokens(6), k, branches, min_confidence).prop_map(
        |(committed, new_tokens, k, branches, min_confidence)| v1::DraftStep {
            committed,
            new_tokens,
            k,
            branches,
            min_confidence,
        },
    )
}

/// What the cases reached: sessions opened, work answered (a verdict, a proposal, or an
/// in-band rejection), refusals.
#[derive(Debug, Default)]
struct Reached {
    opened: usize,
    answered: usize,
    refused: usize,
}

/// Drives `requests` through one session of role `S` as the stream driver would (the model
/// work inline), checking every refusal.
fn drive<S: Session>(
    state: &NodeState,
    requests: Vec<S::Request>,
    aim: fn(&mut S::Work, v1::Prefix),
    reached: &mut Reached,
) -> Result<(), TestCaseError> {
    let mut session: Option<S> = None;
    for request in requests {
        let incoming = match S::classify(request) {
            Ok(i) => i,
            Err(e) => {
                reached.refused += 1;
                check_refusal(&e)?;
                continue;
            }
        };
        match incoming {
            Incoming::Open(open) => {
                let opened = tandem_proto::check_session_id(&open.session_id)
                    .map_err(tandem_node::Error::from)
                    .and_then(|()| S::open(state, open, None));
                match opened {
                    Ok(mut s) => {
                        while !s.prefill_chunk(512).map_err(|e| {
                            TestCaseError::fail(format!("prefill of an accepted open: {e}"))
                        })? {}
                        reached.opened += 1;
                        session = Some(s);
                    }
                    Err(e) => {
                        reached.refused += 1;
                        check_refusal(&e)?;
                    }
                }
            }
            Incoming::Work(mut work) => {
                let Some(s) = session.as_mut() else { continue };
                aim(&mut work, tandem_proto::prefix_to_wire(s.held()));
                let span = tracing::Span::none();
                for result in S::handle_batch(state, vec![(s, work, &span)]) {
                    match result {
                        Ok(_) => reached.answered += 1,
                        Err(e) => {
                            reached.refused += 1;
                            check_refusal(&e)?;
                        }
                    }
                }
            }
            Incoming::Close => session = None,
        }
    }
    Ok(())
}

/// Runs [`CASES`] cases of `requests` (plus one message decoded from arbitrary bytes, where
/// they decode) through role `S`, and checks that the cases reached the model, not only the
/// first checks.
fn fuzz<S: Session>(
    state: &NodeState,
    requests: impl Strategy<Value = Vec<S::Request>>,
    decode: fn(&[u8]) -> Option<S::Request>,
    aim: fn(&mut S::Work, v1::Prefix),
) where
    S::Request: std::fmt::Debug,
{
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: CASES,
        failure_persistence: None,
        // The same cases in every run: a failure in CI is one to reproduce here.
        rng_seed: proptest::test_runner::RngSeed::Fixed(SEED),
        ..ProptestConfig::default()
    });
    let reached = std::cell::RefCell::new(Reached::default());
    let cases = (requests, prop::collection::vec(any::<u8>(), 0..48));
    runner
        .run(&cases, |(mut requests, raw)| {
            requests.extend(decode(&raw));
            drive::<S>(state, requests, aim, &mut reached.borrow_mut())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let reached = reached.into_inner();
    eprintln!("{reached:?}");
    let n = CASES as usize;
    assert!(
        reached.opened > n / 5 && reached.answered > n / 20 && reached.refused > n / 2,
        "the cases reached the model and its checks: {reached:?}"
    );
}

#[test]
fn target_node_requests_are_served_or_refused_by_name() {
    use v1::target_request::Kind;
    let request = prop_oneof![
        3 => open().prop_map(Kind::Open),
        6 => verify().prop_map(Kind::Verify),
        1 => Just(Kind::Close(v1::CloseSession {})),
    ]
    .prop_map(|k| v1::TargetRequest { kind: Some(k) });
    // Most streams start with an open, as a client's do; the others test work before one.
    let first = prop_oneof![
        4 => open().prop_map(|o| v1::TargetRequest { kind: Some(Kind::Open(o)) }),
        1 => request.clone(),
    ];
    let requests = (first, prop::collection::vec(request, 0..4)).prop_map(|(first, mut rest)| {
        rest.insert(0, first);
        rest
    });
    fuzz::<TargetSession>(
        &TARGET,
        requests,
        |raw| v1::TargetRequest::decode(raw).ok(),
        |block, held| {
            if block.committed == Some(HELD) {
                block.committed = Some(held);
            }
        },
    );
}

#[test]
fn draft_node_requests_are_served_or_refused_by_name() {
    use v1::draft_request::Kind;
    let request = prop_oneof![
        3 => open().prop_map(Kind::Open),
        6 => step().prop_map(Kind::Step),
        1 => Just(Kind::Close(v1::CloseSession {})),
    ]
    .prop_map(|k| v1::DraftRequest { kind: Some(k) });
    // Most streams start with an open, as a client's do; the others test work before one.
    let first = prop_oneof![
        4 => open().prop_map(|o| v1::DraftRequest { kind: Some(Kind::Open(o)) }),
        1 => request.clone(),
    ];
    let requests = (first, prop::collection::vec(request, 0..4)).prop_map(|(first, mut rest)| {
        rest.insert(0, first);
        rest
    });
    fuzz::<DraftSession>(
        &DRAFT,
        requests,
        |raw| v1::DraftRequest::decode(raw).ok(),
        |step, held| {
            if step.committed == Some(HELD) {
                step.committed = Some(held);
            }
        },
    );
}

/// A JSON value of any shape, biased to what the OpenAI fields take.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::{Value, json};
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        (0i64..20).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-3.0f64..3.0).prop_map(Value::from),
        Just(json!(1e300)),
        "[a-z ]{0,12}".prop_map(Value::from),
        ".{0,8}".prop_map(Value::from),
    ];
    leaf.prop_recursive(2, 8, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            (
                prop_oneof![Just("user"), Just("system"), Just("assistant"), Just("x")],
                inner
            )
                .prop_map(|(role, content)| json!({"role": role, "content": content})),
        ]
    })
}

/// A request body: an object with OpenAI's fields (and others), each of any shape; or bytes
/// that are not JSON at all.
fn openai_body() -> impl Strategy<Value = Vec<u8>> {
    use serde_json::{Value, json};
    const FIELDS: [&str; 20] = [
        "model",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "n",
        "top_k",
        "draft_tokens",
        "drafter",
        "pipeline",
        "logprobs",
        "user",
        "presence_penalty",
        "echo",
        "suffix",
        "unknown_field",
    ];
    let base = prop_oneof![
        3 => "[a-z ]{1,20}".prop_map(|p| json!({"prompt": p, "max_tokens": 2})),
        3 => "[a-z ]{1,20}".prop_map(|c| json!({
            "messages": [{"role": "user", "content": c}], "max_tokens": 2
        })),
        1 => json_value().prop_map(|p| json!({"prompt": p, "max_tokens": 2})),
        1 => json_value().prop_map(|m| json!({"messages": m, "max_tokens": 2})),
        1 => json_value(),
    ];
    let body = (
        base,
        prop::collection::vec((prop::sample::select(&FIELDS[..]), json_value()), 0..3),
    )
        .prop_map(|(mut body, extra)| {
            if let Value::Object(map) = &mut body {
                for (field, value) in extra {
                    map.insert(field.to_string(), value);
                }
            }
            body.to_string().into_bytes()
        });
    prop_oneof![9 => body, 1 => prop::collection::vec(any::<u8>(), 0..32)]
}

#[test]
fn openai_requests_are_served_or_refused_with_a_4xx_naming_the_field() {
    use tower::ServiceExt;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (_cluster, router) = runtime.block_on(async {
        let cluster = cluster(&stories(), Some(&stories_q8()), &LimitsArgs::default()).await;
        let engine = Arc::new(cluster.engine(4).await.expect("engine"));
        let state = tandem_coordinator::http::HttpState::new(
            tandem_coordinator::late_engine::LateEngine::ready(engine),
            Default::default(),
            Vec::new(),
            // Every response through the per-request speculation metrics too.
            tandem_coordinator::http::spec_metrics::SpecMetrics::Detailed,
        );
        let router =
            tandem_coordinator::http::router(state, tandem_coordinator::http::MetricsOn::Api);
        (cluster, router)
    });
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: CASES,
        failure_persistence: None,
        // The same cases in every run: a failure in CI is one to reproduce here.
        rng_seed: proptest::test_runner::RngSeed::Fixed(SEED),
        ..ProptestConfig::default()
    });
    let (served, refused) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    let path = prop_oneof![Just("/v1/completions"), Just("/v1/chat/completions")];
    runner
        .run(&(path, openai_body()), |(path, body)| {
            let request = axum::http::Request::post(path)
                .header("content-type", "application/json")
                .body(axum::body::Body::from(body.clone()))
                .expect("request");
            let (status, text) = runtime.block_on(async {
                let response = router.clone().oneshot(request).await.expect("infallible");
                let status = response.status();
                let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
                    .await
                    .expect("body");
                (status, String::from_utf8_lossy(&bytes).into_owned())
            });
            let input = String::from_utf8_lossy(&body);
            prop_assert!(status.as_u16() < 500, "{status} for {input}: {text}");
            if status.is_success() {
                served.set(served.get() + 1);
                return Ok(());
            }
            refused.set(refused.get() + 1);
            let error: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| TestCaseError::fail(format!("{status} body not JSON: {e}: {text}")))?;
            let message = error["error"]["message"].as_str().unwrap_or_default();
            // Bytes that are not JSON are refused as such; JSON is refused naming a field.
            let json = serde_json::from_slice::<serde_json::Value>(&body).is_ok();
            let named = error["error"]["param"].is_string()
                || message.contains('`')
                || (!json && message.contains("JSON"))
                || message.contains("must be a JSON object")
                || message.contains("missing field `");
            prop_assert!(named, "{status} names no field for {input}: {text}");
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let (n, served, refused) = (CASES as usize, served.get(), refused.get());
    assert!(
        served > n / 20 && refused > n / 4,
        "served {served}, refused {refused}"
    );
}
