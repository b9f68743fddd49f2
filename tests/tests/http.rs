//! The OpenAI-compatible HTTP API: the official `openai` Python client against a coordinator
//! started here, and OpenAI-shaped errors for bad input.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;

use serde_json::{Value, json};
use tandem_coordinator::LocalCluster;
use tandem_node::LimitsArgs;
use tandem_proto::v1;
use tandem_tests::python::python_with;
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
        tandem_coordinator::late::LateEngine::ready(Arc::clone(&engine)),
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
    let python = python_with(&[("openai", "openai>=1.40")]);
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

    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let base = format!("http://{}/v1", served.http);
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(script)
            .args([&base, "stories260K-chat", prompt, "40"])
            .output()
    })
    .await
    .expect("join")
    .expect("run the openai client");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Value = serde_json::from_slice(&out.stdout).expect("json");

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
