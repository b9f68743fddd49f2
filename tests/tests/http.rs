//! The OpenAI-compatible HTTP API: the official `openai` Python client against a coordinator
//! started here, and OpenAI-shaped errors for bad input.

use std::net::SocketAddr;
use std::sync::Arc;

use serde_json::{Value, json};
use tandem_coordinator::LocalCluster;
use tandem_node::LimitsArgs;
use tandem_proto::v1;
use tandem_tests::python::openai_script;
use tandem_tests::*;

/// A cluster with both APIs of a coordinator on loopback.
struct Served {
    _cluster: LocalCluster,
    grpc: String,
    http: SocketAddr,
}

async fn serve(target: &std::path::Path) -> Served {
    let cluster = cluster(target, Some(&stories_q8()), &LimitsArgs::default()).await;
    let engine = Arc::new(cluster.engine(4).await.expect("engine"));
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let grpc_url = format!("http://{}", grpc.local_addr().expect("addr"));
    tokio::spawn(tandem_coordinator::serve(
        grpc,
        tandem_coordinator::late_engine::LateEngine::ready(Arc::clone(&engine)),
        Default::default(),
        Default::default(),
        std::future::pending(),
    ));
    Served {
        _cluster: cluster,
        grpc: grpc_url,
        http: serve_http(engine).await,
    }
}

async fn grpc_text(url: &str, request: v1::GenerateRequest) -> v1::GenerateDone {
    let mut client = v1::coordinator_client::CoordinatorClient::connect(url.to_string())
        .await
        .expect("connect");
    tandem_coordinator::client::run(&mut client, request, |_| {})
        .await
        .expect("generate")
}

fn greedy() -> Option<v1::SamplingParams> {
    Some(v1::SamplingParams {
        temperature: 0.0,
        seed: Some(1),
        ..Default::default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_client_gets_the_grpc_text() {
    let model = stories_with_chat_template();
    let served = serve(&model).await;
    let prompt = "Once upon a time";
    let completion = grpc_text(
        &served.grpc,
        v1::GenerateRequest {
            prompt: prompt.into(),
            max_tokens: 40,
            sampling: greedy(),
            ..Default::default()
        },
    )
    .await;
    let chat_prompt = tokenizer(&model)
        .encode_raw(&format!("<s>{prompt}"))
        .expect("encode");
    let chat = grpc_text(
        &served.grpc,
        v1::GenerateRequest {
            prompt_tokens: chat_prompt.clone(),
            max_tokens: 40,
            sampling: greedy(),
            ..Default::default()
        },
    )
    .await;

    let base = format!("http://{}/v1", served.http);
    let args = [&base, "stories260K-chat", prompt, "40"].map(str::to_string);
    let got = openai_script("openai_client.py", args.to_vec()).await;

    assert_eq!(got["completion"], completion.text.as_str());
    assert!(!completion.text.is_empty());
    assert_eq!(got["completion_usage"]["completion_tokens"], 40);
    assert_eq!(got["completion_usage"]["prompt_tokens"], 5);
    let tandem = &got["completion_tandem"];
    assert!(
        tandem["drafted"].as_u64().is_some_and(|d| d > 0),
        "{tandem}"
    );
    assert!(
        tandem["acceptance_rate"].as_f64().is_some_and(|a| a > 0.5),
        "{tandem}"
    );
    assert_eq!(got["chat"], chat.text.as_str());
    assert_eq!(got["chat_stream"], chat.text.as_str());
    assert_eq!(got["chat_finish"], chat.finish_reason.as_str());
    assert_eq!(got["chat_stream_finish"], chat.finish_reason.as_str());
    let usage = &got["chat_stream_usage"];
    assert_eq!(usage["prompt_tokens"], chat_prompt.len());
    assert_eq!(usage["completion_tokens"], chat.token_ids.len());
    assert_eq!(
        got["unknown_model"],
        json!({"type": "NotFoundError", "status": 404})
    );
    // Content parts read as the string; log-probabilities parse in the client's own types.
    assert_eq!(got["chat_parts"], chat.text.as_str());
    let logprobs = got["chat_logprobs"].as_array().expect("chat logprobs");
    assert_eq!(logprobs.len(), chat.token_ids.len(), "{logprobs:?}");
    assert!(
        logprobs
            .iter()
            .all(|l| l["logprob"].as_f64().is_some_and(|p| p <= 0.0) && l["top"] == 2),
        "{logprobs:?}"
    );
    assert_eq!(
        got["token_prompt_logprobs"].as_array().map(Vec::len),
        Some(4)
    );
}

async fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, Value) {
    let (status, body) = http_request(addr, "POST", path, body).await;
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

#[tokio::test]
async fn bad_http_input_gets_openai_shaped_errors() {
    let served = serve(&stories()).await;
    let long_prompt = "Once upon a time ".repeat(200);
    let cases = [
        (
            "/v1/completions",
            r#"{"prompt": "Once", "max_tokens": "#.to_string(),
            400,
            None,
            "invalid JSON",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Once", "model": "gpt-4"}).to_string(),
            404,
            Some("model"),
            "`gpt-4` does not exist",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Once", "max_tokens": "ten"}).to_string(),
            400,
            Some("max_tokens"),
            "invalid `max_tokens`: invalid type: string",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": 7}]}).to_string(),
            400,
            Some("messages[0].content"),
            "invalid `messages[0].content`",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Once", "max_tokens": -5}).to_string(),
            400,
            Some("max_tokens"),
            "at least 1",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Once", "temperature": 3.5}).to_string(),
            400,
            Some("temperature"),
            "[0, 2]",
        ),
        (
            "/v1/completions",
            json!({"prompt": long_prompt, "max_tokens": 16}).to_string(),
            400,
            Some("prompt"),
            "exceeds the context of 512",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Once", "top_p": 0}).to_string(),
            400,
            Some("top_p"),
            "(0, 1]",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}]}).to_string(),
            400,
            Some("messages"),
            "no chat template",
        ),
    ];
    for (path, body, status, param, words) in cases {
        let (got, json) = post(served.http, path, &body).await;
        assert_eq!(got, status, "{body}: {json}");
        let error = &json["error"];
        assert_eq!(error["type"], "invalid_request_error", "{json}");
        assert_eq!(
            error["param"],
            param.map_or(Value::Null, Value::from),
            "{json}"
        );
        let message = error["message"].as_str().expect("message");
        assert!(message.contains(words), "{message:?} lacks {words:?}");
    }
}

#[tokio::test]
async fn the_openai_api_as_clients_use_it() {
    let served = cluster(&stories(), Some(&stories_q8()), &LimitsArgs::default()).await;
    let router = router_over(&served, vec!["tandem-stories".into()]).await;

    // Axum's own refusals in OpenAI's shape.
    let get = |path: &str| {
        axum::http::Request::get(path)
            .body(axum::body::Body::empty())
            .expect("request")
    };
    let (status, _, body) = call(&router, get("/v1/nope")).await;
    assert_eq!(status, 404, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("/v1/completions")),
        "{body}"
    );
    let (status, headers, body) = call(&router, get("/v1/completions")).await;
    assert_eq!(status, 405, "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert!(headers.contains_key("allow"));
    let huge = json!({"prompt": "a".repeat(3 << 20)});
    let (status, _, body) = call(&router, post_json("/v1/completions", &huge)).await;
    assert_eq!(status, 413, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("limit")),
        "{body}"
    );

    // --served-model-name: the names listed and answered; the target's own is not one.
    let (_, _, models) = call(&router, get("/v1/models")).await;
    assert_eq!(models["data"][0]["id"], "tandem-stories", "{models}");
    let ask = |prompt: Value, model: &str| {
        post_json(
            "/v1/completions",
            &json!({"prompt": prompt, "model": model, "max_tokens": 12, "temperature": 0}),
        )
    };
    let (status, _, text) = call(&router, ask(json!("Once upon a time"), "tandem-stories")).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(text["model"], "tandem-stories");
    let (status, _, _) = call(&router, ask(json!("Once upon a time"), "stories260K")).await;
    assert_eq!(status, 404);

    // A prompt as token ids reads as the same text; ids are unique.
    let ids = tokenizer(&stories())
        .encode("Once upon a time")
        .expect("encode");
    let (status, _, tokens) = call(&router, ask(json!(ids), "tandem-stories")).await;
    assert_eq!(status, 200, "{tokens}");
    assert_eq!(tokens["choices"][0]["text"], text["choices"][0]["text"]);
    assert_ne!(tokens["id"], text["id"]);
    assert!(
        text["id"].as_str().is_some_and(|id| id.len() > 20),
        "{text}"
    );

    // Content parts, sampling extensions; what is not supported is refused by name.
    let chat_router = router_over(
        &cluster(&stories_with_chat_template(), None, &LimitsArgs::default()).await,
        Vec::new(),
    )
    .await;
    let parts = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "Once"}]}],
                       "max_tokens": 4, "min_p": 0.05, "top_k": 20, "repetition_penalty": 1.1});
    let (status, _, body) = call(&chat_router, post_json("/v1/chat/completions", &parts)).await;
    assert_eq!(status, 200, "{body}");
    // A stop token id ends the text where that token comes: the third of the greedy text's.
    let greedy = tokenizer(&stories())
        .encode(&format!(
            "Once upon a time{}",
            text["choices"][0]["text"].as_str().expect("text")
        ))
        .expect("encode");
    let third = greedy[ids.len() + 2];
    let stop = json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
                      "stop_token_ids": [third]});
    let (status, _, stopped) = call(&router, post_json("/v1/completions", &stop)).await;
    assert_eq!(status, 200, "{stopped}");
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop", "{stopped}");
    assert!(
        stopped["usage"]["completion_tokens"].as_u64() <= Some(3),
        "{stopped}"
    );
    let penalised = json!({"prompt": "Once", "max_tokens": 4, "presence_penalty": 0.5,
                           "frequency_penalty": -1, "temperature": 0.8, "seed": 1});
    let (status, _, body) = call(&router, post_json("/v1/completions", &penalised)).await;
    assert_eq!(status, 200, "{body}");
    for (field, value) in [
        ("stop_token_ids", json!((0..65).collect::<Vec<u32>>())),
        ("presence_penalty", json!(2.5)),
        ("frequency_penalty", json!(-3)),
        ("logprobs", json!("yes")),
        ("top_logprobs", json!(3)),
    ] {
        let mut req = json!({"prompt": "Once", "max_tokens": 2});
        req[field] = value;
        let (status, _, body) = call(&router, post_json("/v1/completions", &req)).await;
        assert_eq!(status, 400, "{field}: {body}");
        assert_eq!(body["error"]["param"], field, "{body}");
    }
}

#[tokio::test]
async fn a_stream_refused_before_its_first_token_gets_its_status_not_a_200() {
    let full = LimitsArgs {
        kv_cache_bytes: 1,
        ..LimitsArgs::default()
    };
    let cluster = cluster(&stories(), None, &full).await;
    let router = router_over(&cluster, Vec::new()).await;
    let req = json!({"prompt": "Once upon a time", "max_tokens": 8, "stream": true});
    let (status, headers, body) = call(&router, post_json("/v1/completions", &req)).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(headers["retry-after"], "1");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("kv cache budget")),
        "{body}"
    );
}

#[tokio::test]
async fn logprobs_come_from_the_target_whatever_the_draft() {
    let served = cluster(&stories(), Some(&stories_q8()), &LimitsArgs::default()).await;
    let router = router_over(&served, Vec::new()).await;
    let ask = |k: u32, stream: bool| {
        post_json(
            "/v1/completions",
            &json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
                    "logprobs": 3, "draft_tokens": k, "stream": stream}),
        )
    };
    let (status, _, alone) = call(&router, ask(0, false)).await;
    assert_eq!(status, 200, "{alone}");
    let (status, _, drafted) = call(&router, ask(4, false)).await;
    assert_eq!(status, 200, "{drafted}");
    assert!(
        drafted["tandem"]["accepted"].as_u64() > Some(0),
        "{drafted}"
    );
    let (a, d) = (
        &alone["choices"][0]["logprobs"],
        &drafted["choices"][0]["logprobs"],
    );
    let n = alone["usage"]["completion_tokens"]
        .as_u64()
        .expect("tokens") as usize;
    assert_eq!(a["tokens"].as_array().map(Vec::len), Some(n), "{a}");
    assert_eq!(a["tokens"], d["tokens"]);
    for i in 0..n {
        let (la, ld) = (&a["token_logprobs"][i], &d["token_logprobs"][i]);
        let (la, ld) = (la.as_f64().expect("lp"), ld.as_f64().expect("lp"));
        assert!(
            (la - ld).abs() < 1e-4,
            "token {i}: {la} alone, {ld} verified in a block"
        );
        assert!(la <= 0.0);
        // Greedy: the token is the most likely, so its log-probability is the top one's.
        let top = a["top_logprobs"][i].as_object().expect("top");
        assert_eq!(top.len(), 3, "{top:?}");
        let best = top
            .values()
            .filter_map(Value::as_f64)
            .fold(f64::MIN, f64::max);
        assert!(
            (best - la).abs() < 1e-6,
            "token {i}: {la} vs the top {best}"
        );
    }
    // Streamed: every token's log-probability, chunk by chunk.
    let streamed: Vec<f64> = events(&router, ask(4, true))
        .await
        .into_iter()
        .filter_map(|c| {
            c["choices"][0]["logprobs"]["token_logprobs"]
                .as_array()
                .cloned()
        })
        .flatten()
        .filter_map(|v| v.as_f64())
        .collect();
    assert_eq!(streamed.len(), n);
    // Chat: `logprobs: true` with `top_logprobs`, in chat's shape.
    let chat_router = router_over(
        &cluster(&stories_with_chat_template(), None, &LimitsArgs::default()).await,
        Vec::new(),
    )
    .await;
    let chat = json!({"messages": [{"role": "user", "content": "Once"}], "max_tokens": 5,
                      "logprobs": true, "top_logprobs": 2});
    let (status, _, body) = call(&chat_router, post_json("/v1/chat/completions", &chat)).await;
    assert_eq!(status, 200, "{body}");
    let content = body["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("content");
    assert_eq!(content.len(), 5, "{body}");
    for entry in content {
        assert!(
            entry["token"].is_string() && entry["logprob"].is_number(),
            "{entry}"
        );
        assert!(entry["bytes"].is_array(), "{entry}");
        assert_eq!(
            entry["top_logprobs"].as_array().map(Vec::len),
            Some(2),
            "{entry}"
        );
    }
}

/// `--per-request-spec-decode-metrics` (vLLM's shape): `metrics.speculative_decoding` in a
/// whole response and in the streamed usage chunk, consistent with itself and with the `tandem`
/// extension; `null` for two choices; absent where not asked for.
#[tokio::test]
async fn responses_carry_per_request_speculation_metrics_when_asked() {
    use tandem_coordinator::http::spec_metrics::SpecMetrics;
    let served = cluster(&stories(), Some(&stories_q8()), &LimitsArgs::default()).await;
    let engine = Arc::new(patient_engine(&served, 4).await);
    let router = |level| {
        let state = tandem_coordinator::http::HttpState::new(
            tandem_coordinator::late_engine::LateEngine::ready(Arc::clone(&engine)),
            Default::default(),
            Vec::new(),
            level,
        );
        tandem_coordinator::http::router(state, tandem_coordinator::http::MetricsOn::Api)
    };
    let (detailed, none) = (router(SpecMetrics::Detailed), router(SpecMetrics::None));
    let ask = json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
                     "draft_tokens": 4, "drafter": "model"});
    let check = |body: &Value| {
        let s = &body["metrics"]["speculative_decoding"];
        let accepted: Vec<u64> =
            serde_json::from_value(s["per_step_accepted"].clone()).expect("per_step_accepted");
        let drafted: Vec<u64> =
            serde_json::from_value(s["per_step_drafted"].clone()).expect("per_step_drafted");
        let histogram: Vec<u64> = serde_json::from_value(s["acceptance_histogram"].clone())
            .expect("acceptance_histogram");
        let steps = s["num_spec_steps"].as_u64().expect("a count");
        assert!(steps > 0, "the model drafted: {body}");
        assert_eq!(s["num_spec_tokens"], 4, "{body}");
        assert_eq!(histogram.len(), 5, "{body}");
        assert_eq!(histogram.iter().sum::<u64>(), steps, "{body}");
        assert_eq!(accepted.len() as u64, steps, "{body}");
        assert_eq!(drafted.len() as u64, steps, "{body}");
        assert!(
            accepted
                .iter()
                .zip(&drafted)
                .all(|(a, d)| a <= d && *a <= 4)
        );
        for (j, n) in histogram.iter().enumerate() {
            assert_eq!(
                accepted.iter().filter(|&&a| a == j as u64).count() as u64,
                *n
            );
        }
        let (a, d) = (accepted.iter().sum::<u64>(), drafted.iter().sum::<u64>());
        assert_eq!(s["num_accepted_draft_tokens"], a, "{body}");
        assert_eq!(s["num_draft_tokens"], d, "{body}");
        // Every draft this request made was in a step: the extension's counts agree.
        assert_eq!(body["tandem"]["drafted"], d, "{body}");
        assert_eq!(body["tandem"]["accepted"], a, "{body}");
        let mean = s["mean_acceptance_length"].as_f64().expect("a number");
        assert!(
            (mean - (1.0 + a as f64 / steps as f64)).abs() < 1e-9,
            "{body}"
        );
        let rate = s["draft_acceptance_rate"].as_f64().expect("a number");
        assert!((rate - a as f64 / d as f64).abs() < 1e-9, "{body}");
    };
    let (status, _, whole) = call(&detailed, post_json("/v1/completions", &ask)).await;
    assert_eq!(status, 200, "{whole}");
    check(&whole);

    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = events(&detailed, post_json("/v1/completions", &streamed)).await;
    let last = chunks.last().expect("chunks");
    assert!(last["usage"].is_object(), "{last}");
    check(last);
    assert!(
        chunks[..chunks.len() - 1]
            .iter()
            .all(|c| c.get("metrics").is_none()),
        "only the usage chunk carries metrics"
    );

    let mut two = ask.clone();
    two["n"] = json!(2);
    let (status, _, body) = call(&detailed, post_json("/v1/completions", &two)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["metrics"],
        json!({"speculative_decoding": null}),
        "{body}"
    );

    let (status, _, plain) = call(&none, post_json("/v1/completions", &ask)).await;
    assert_eq!(status, 200, "{plain}");
    assert!(plain.get("metrics").is_none(), "{plain}");
}
