//! Tool calls through the OpenAI API (issue 29), across the nodes: `tool_choice` `required` and
//! a named function force calls in the template's syntax (Hermes' `<tool_call>` tags here) whose
//! arguments keep to the function's schema, whole and streamed as OpenAI streams them, the same
//! for every K; `auto` leaves the model free (the story model writes a story); `none` hides the
//! definitions; malformed tools and conflicting requests are 400s naming the field.

use serde_json::{Value, json};
use tandem_node::LimitsArgs;
use tandem_tests::*;

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "now"}},
    ])
}

fn ask(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "Once upon a time"}],
        "tools": tools(),
        "max_tokens": 300,
        "temperature": 0,
    });
    body.as_object_mut()
        .expect("object")
        .extend(extra.as_object().expect("object").clone());
    body
}

async fn post(router: &axum::Router, body: &Value) -> (u16, Value) {
    let (status, _, json) = call(router, post_json("/v1/chat/completions", body)).await;
    (status, json)
}

/// Asserts that `call` is a call of `get_weather` with valid arguments.
fn assert_weather(call: &Value) {
    assert_eq!(call["type"], "function", "{call}");
    assert_eq!(call["function"]["name"], "get_weather", "{call}");
    let text = call["function"]["arguments"].as_str().expect("JSON text");
    let args: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    let city = args["city"].as_str().expect("city");
    assert!(city.chars().count() <= 12, "{args}");
    assert!(
        args["unit"] == "celsius" || args["unit"] == "fahrenheit",
        "{args}"
    );
    assert_eq!(
        args.as_object().map(serde_json::Map::len),
        Some(2),
        "{args}"
    );
    assert!(
        call["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("call_"))
    );
}

#[tokio::test]
async fn a_required_call_is_forced_whole_and_streamed_the_same_for_every_k() {
    let served = cluster(
        &stories_with_chat_template(),
        Some(&stories_q8()),
        &LimitsArgs::default(),
    )
    .await;
    let router = router_over(&served, Vec::new()).await;
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    let mut first: Option<Value> = None;
    for k in [0, 1, 4, 8] {
        let (status, body) = post(
            &router,
            &ask(json!({"tool_choice": named, "parallel_tool_calls": false, "draft_tokens": k})),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let choice = &body["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "K = {k}: {body}");
        let message = &choice["message"];
        assert_eq!(message["role"], "assistant");
        assert_eq!(message["content"], Value::Null, "{body}");
        let calls = message["tool_calls"].as_array().expect("tool_calls");
        assert_eq!(calls.len(), 1, "{body}");
        assert_weather(&calls[0]);
        let call = calls[0]["function"].clone();
        match &first {
            None => first = Some(call),
            Some(alone) => assert_eq!(&call, alone, "K = {k}"),
        }
        if k > 0 {
            assert!(body["tandem"]["drafted"].as_u64() > Some(0), "{body}");
        }
    }
    let whole = first.expect("a call");

    // Streamed: a chunk with the call's index, id, type and name (arguments ""), then its
    // arguments in pieces; the role first; `tool_calls` as the finish reason.
    let chunks = events(
        &router,
        post_json(
            "/v1/chat/completions",
            &ask(json!({"tool_choice": named, "parallel_tool_calls": false, "stream": true})),
        ),
    )
    .await;
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    assert_eq!(deltas[0]["role"], "assistant", "{chunks:?}");
    let parts: Vec<&Value> = deltas
        .iter()
        .filter_map(|d| d["tool_calls"].as_array())
        .flatten()
        .collect();
    assert!(parts.len() >= 2, "the name, then the arguments: {parts:?}");
    assert_eq!(parts[0]["index"], 0);
    assert_eq!(parts[0]["function"]["name"], "get_weather");
    assert_eq!(parts[0]["function"]["arguments"], "");
    assert!(
        parts[0]["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("call_"))
    );
    assert!(
        parts[1..]
            .iter()
            .all(|p| p["index"] == 0 && p.get("id").is_none())
    );
    let arguments: String = parts
        .iter()
        .filter_map(|p| p["function"]["arguments"].as_str())
        .collect();
    assert_eq!(arguments, whole["arguments"].as_str().expect("text"));
    assert!(
        deltas
            .iter()
            .all(|d| d.get("content").is_none_or(|c| c == "")),
        "{chunks:?}"
    );
    let finish = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["finish_reason"].as_str());
    assert_eq!(finish.collect::<Vec<_>>(), ["tool_calls"]);

    // `required` with parallel calls: every call whole and valid, each with its own id.
    let (status, body) = post(&router, &ask(json!({"tool_choice": "required"}))).await;
    assert_eq!(status, 200, "{body}");
    let calls = body["choices"][0]["message"]["tool_calls"]
        .as_array()
        .expect("tool_calls");
    assert!(!calls.is_empty(), "{body}");
    for call in calls {
        match call["function"]["name"].as_str() {
            Some("now") => {
                let text = call["function"]["arguments"].as_str().expect("text");
                assert_eq!(serde_json::from_str::<Value>(text).ok(), Some(json!({})));
            }
            _ => assert_weather(call),
        }
    }
    let mut ids: Vec<&str> = calls.iter().filter_map(|c| c["id"].as_str()).collect();
    ids.dedup();
    assert_eq!(ids.len(), calls.len(), "{body}");
}

#[tokio::test]
async fn auto_and_none_leave_the_model_free_and_bad_tools_are_refused() {
    let served = cluster(&stories_with_chat_template(), None, &LimitsArgs::default()).await;
    let router = router_over(&served, Vec::new()).await;
    let prompt_tokens = |body: &Value| body["usage"]["prompt_tokens"].as_u64().expect("usage");

    // `auto`: the story model writes its story, which holds no call.
    let (status, auto) = post(&router, &ask(json!({"max_tokens": 16}))).await;
    assert_eq!(status, 200, "{auto}");
    let message = &auto["choices"][0]["message"];
    assert!(
        message["content"].as_str().is_some_and(|c| !c.is_empty()),
        "{auto}"
    );
    assert!(message.get("tool_calls").is_none(), "{auto}");
    assert_eq!(auto["choices"][0]["finish_reason"], "length");

    // `none`: the definitions are not shown (the prompt is the one without tools).
    let (_, none) = post(
        &router,
        &ask(json!({"max_tokens": 16, "tool_choice": "none"})),
    )
    .await;
    let mut plain = ask(json!({"max_tokens": 16}));
    plain.as_object_mut().expect("object").remove("tools");
    let (_, plain) = post(&router, &plain).await;
    assert_eq!(prompt_tokens(&none), prompt_tokens(&plain));
    assert!(
        prompt_tokens(&auto) > prompt_tokens(&plain),
        "the names are shown"
    );
    assert_eq!(
        none["choices"][0]["message"],
        plain["choices"][0]["message"]
    );

    let refusals = [
        (json!({"tools": [{"type": "function"}]}), "tools[0]", "name"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "rm -rf"}}]}),
            "tools[0]",
            "rm -rf",
        ),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "launch"}}}),
            "tool_choice",
            "launch",
        ),
        (
            json!({"tool_choice": "sometimes"}),
            "tool_choice",
            "sometimes",
        ),
        (
            json!({"tool_choice": "required", "response_format": {"type": "json_object"}}),
            "tool_choice",
            "response_format",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f",
                "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}}],
                "tool_choice": "required"}),
            "tools",
            "nonsense",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                "function": {"name": "now", "arguments": "{not json"}}]}]}),
            "messages[0].tool_calls",
            "JSON",
        ),
    ];
    for (extra, param, words) in refusals {
        let (status, body) = post(&router, &ask(extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {body}");
        let error = &body["error"];
        assert_eq!(error["param"], param, "{extra}: {body}");
        let message = error["message"].as_str().expect("message");
        assert!(
            message.contains(words),
            "{extra}: {message:?} lacks {words:?}"
        );
    }
}
