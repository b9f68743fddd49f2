//! The real Qwen2.5-Coder pair end to end, as a user has it: two .gguf files and nothing else
//! (tokenizer and chat template from the metadata, mixed Q5_0/Q8_0/Q4_K/Q6_K tensors). Greedy
//! speculative output equals target-only for several K, and a chat completion through the
//! OpenAI API renders Qwen's template and answers; the official `openai` client gets structured
//! outputs and tool calls from it. `.ci/run` fetches the pair; without it these
//! tests fail in CI and say so elsewhere (`tandem_tests::qwen_pair`).

use std::sync::Arc;

use serde_json::Value;
use tandem_node::LimitsArgs;
use tandem_runtime::SamplingParams;
use tandem_tests::*;

#[tokio::test]
async fn qwen_pair_greedy_speculative_equals_target_only() {
    let Some((target, draft)) = qwen_pair("qwen_pair_greedy_speculative_equals_target_only") else {
        return;
    };
    let cluster = cluster(&target, Some(&draft), &LimitsArgs::default()).await;
    let engine = cluster.engine(4).await.expect("engine");
    let tok = tokenizer(&target);
    for text in [
        "The capital of France is",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    ] {
        let prompt = tok.encode(text).expect("encode");
        let greedy = SamplingParams::greedy();
        let baseline = generate(&engine, &request(&prompt, 24, 0, &greedy)).await;
        assert_eq!(baseline.token_ids.len(), 24);
        for k in [1, 4, 8] {
            let spec = generate(&engine, &request(&prompt, 24, k, &greedy)).await;
            assert_eq!(spec.token_ids, baseline.token_ids, "K = {k}, {text:?}");
            assert!(!spec.stats.draft_lost, "{}", spec.stats.draft_lost_reason);
            assert!(
                spec.stats.base.accepted > 0,
                "the 0.5B draft agrees with the 1.5B target sometimes"
            );
        }
        if text.starts_with("The capital") {
            assert!(baseline.text.starts_with(" Paris."), "{:?}", baseline.text);
        }
    }
}

#[tokio::test]
async fn qwen_chat_completion_renders_the_template_and_answers() {
    let Some((target, draft)) = qwen_pair("qwen_chat_completion_renders_the_template_and_answers")
    else {
        return;
    };
    let cluster = cluster(&target, Some(&draft), &LimitsArgs::default()).await;
    let engine = Arc::new(cluster.engine(4).await.expect("engine"));
    let addr = serve_http(engine).await;
    let body = serde_json::json!({
        "model": cluster.target.model.name(),
        "messages": [{"role": "user", "content": "What is the capital of France? One word."}],
        "max_tokens": 8,
        "temperature": 0,
    });
    let (status, reply) =
        http_request(addr, "POST", "/v1/chat/completions", &body.to_string()).await;
    assert_eq!(status, 200, "{reply}");
    let reply: Value = serde_json::from_str(&reply).expect("json");
    let answer = reply["choices"][0]["message"]["content"]
        .as_str()
        .expect("content");
    assert!(answer.contains("Paris"), "{answer:?}");
    assert_eq!(reply["choices"][0]["finish_reason"], "stop", "{reply}");
    // The prompt was Qwen's template: system prompt, user turn, assistant turn.
    let prompt_tokens = reply["usage"]["prompt_tokens"].as_u64().expect("usage");
    assert!(
        prompt_tokens > 25,
        "the default system prompt is in: {prompt_tokens}"
    );
}

/// The official `openai` client's structured-output and tool-calling calls, unmodified
/// (`tests/openai_tools.py`), on the real pair: a pydantic response format parsed by the client,
/// JSON mode, a call the model chooses (auto) and one it must make (required, streamed), parsed
/// into the client's pydantic model, and the conversation going on after the tool's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_client_gets_structured_outputs_and_tool_calls_from_qwen() {
    let Some((target, draft)) =
        qwen_pair("the_openai_client_gets_structured_outputs_and_tool_calls_from_qwen")
    else {
        return;
    };
    let cluster = cluster(&target, Some(&draft), &LimitsArgs::default()).await;
    let engine = Arc::new(cluster.engine(4).await.expect("engine"));
    let addr = serve_http(engine).await;
    let args = vec![format!("http://{addr}/v1"), cluster.target.model.name()];
    let got = tandem_tests::python::openai_script("openai_tools.py", args).await;
    assert_eq!(got["parsed"]["capital"], "Paris", "{got}");
    assert!(got["parsed"]["population_millions"].is_i64(), "{got}");
    assert!(got["json_object"].is_object(), "{got}");
    for (mode, finish) in [("auto", "auto_finish"), ("stream", "stream_finish")] {
        assert_eq!(got[finish], "tool_calls", "{mode}: {got}");
        let calls = got[format!("{mode}_calls")].as_array().expect("calls");
        assert!(!calls.is_empty(), "{mode}: {got}");
        assert!(
            calls.iter().all(|c| c["name"] == "get_weather"
                && (c["parsed"]["unit"] == "celsius" || c["parsed"]["unit"] == "fahrenheit")),
            "{mode}: {got}"
        );
    }
    assert_eq!(got["auto_calls"][0]["parsed"]["city"], "Paris", "{got}");
    assert_eq!(got["stream_calls"][0]["parsed"]["city"], "Oslo", "{got}");
    assert_eq!(got["follow_up_calls"], 0, "{got}");
    let answer = got["follow_up"].as_str().expect("an answer in text");
    assert!(
        answer.contains("18"),
        "the tool's answer is used: {answer:?}"
    );
}
