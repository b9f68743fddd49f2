//! Structured outputs across the nodes (issue 29): a request's grammar (OpenAI's
//! `response_format`, vLLM's `structured_outputs`, or the gRPC `constraint`) compiled by the
//! coordinator before anything runs, the target-node masking every verified position and the
//! draft-node its drafts; greedy output the same for every K; a grammar that does not compile a
//! 400 naming `response_format`.

use serde_json::{Value, json};
use tandem_node::LimitsArgs;
use tandem_proto::v1;
use tandem_runtime::SamplingParams;
use tandem_tests::*;

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 1, "maximum": 99}
        },
        "required": ["name", "age"],
        "additionalProperties": false
    })
}

/// Asserts that `text` is a document of [`schema`].
fn assert_valid(text: &str) {
    let doc: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(
        doc["name"]
            .as_str()
            .is_some_and(|n| n.chars().count() <= 10),
        "{text}"
    );
    assert!(
        doc["age"].as_i64().is_some_and(|a| (1..=99).contains(&a)),
        "{text}"
    );
    assert_eq!(doc.as_object().map(serde_json::Map::len), Some(2), "{text}");
}

#[tokio::test]
async fn greedy_constrained_output_is_the_same_for_every_k_and_keeps_to_the_schema() {
    let served = cluster(&stories(), Some(&stories_q8()), &LimitsArgs::default()).await;
    let engine = patient_engine(&served, 4).await;
    let prompt = tokenizer(&stories())
        .encode("Once upon a time")
        .expect("encode");
    let constraint = v1::Constraint {
        kind: Some(v1::constraint::Kind::JsonSchema(schema().to_string())),
        start: 0,
    };
    let texts = {
        let mut texts = Vec::new();
        // The draft-node at K = 1, 4, 8; n-gram lookup (cut at the grammar) at K = 4.
        for (k, drafter) in [
            (0, ""),
            (1, "model"),
            (4, "model"),
            (8, "model"),
            (4, "ngram"),
        ] {
            let mut req = request(&prompt, 200, k, &SamplingParams::greedy());
            req.ignore_eos = false;
            req.drafter = drafter.into();
            req.constraint = Some(constraint.clone());
            let out = generate(&engine, &req).await;
            assert_eq!(
                out.finish_reason,
                tandem_runtime::FinishReason::Stop,
                "K = {k}"
            );
            texts.push((k, drafter, out.text, out.stats.base.drafted));
        }
        texts
    };
    let (_, _, alone, _) = &texts[0];
    assert_valid(alone);
    for (k, drafter, text, drafted) in &texts[1..] {
        assert_eq!(text, alone, "K = {k}, {drafter}");
        if *drafter == "model" {
            assert!(*drafted > 0, "K = {k}: the draft drafted");
        }
    }
}

/// `body` posted to `path`: the status and the JSON answer.
async fn post(router: &axum::Router, path: &str, body: &Value) -> (u16, Value) {
    let (status, _, json) = call(router, post_json(path, body)).await;
    (status, json)
}

#[tokio::test]
async fn the_openai_api_constrains_completions_and_refuses_bad_grammars() {
    let served = cluster(&stories(), Some(&stories_q8()), &LimitsArgs::default()).await;
    let router = router_over(&served, vec!["tandem-stories".into()]).await;
    let ask = |extra: Value| {
        let mut body = json!({"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0});
        body.as_object_mut()
            .expect("object")
            .extend(extra.as_object().expect("object").clone());
        body
    };
    let format = json!({"response_format": {"type": "json_schema",
        "json_schema": {"name": "person", "schema": schema(), "strict": true}}});
    let (status, body) = post(&router, "/v1/completions", &ask(format)).await;
    assert_eq!(status, 200, "{body}");
    assert_valid(body["choices"][0]["text"].as_str().expect("text"));
    assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");

    let (status, body) = post(
        &router,
        "/v1/completions",
        &ask(json!({"response_format": {"type": "json_object"}})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    // Any object: the story model writes its story into a key until the tokens run out, or
    // closes the object.
    let text = body["choices"][0]["text"].as_str().expect("text");
    assert!(text.starts_with('{'), "{text:?}");
    if body["choices"][0]["finish_reason"] == "stop" {
        let doc: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(doc.is_object(), "{text}");
    }

    let regex = json!({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,3}"}});
    let (status, body) = post(&router, "/v1/completions", &ask(regex)).await;
    assert_eq!(status, 200, "{body}");
    let text = body["choices"][0]["text"].as_str().expect("text");
    let (digits, letters) = text.split_once('-').unwrap_or_else(|| panic!("{text:?}"));
    assert!(
        digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()),
        "{text:?}"
    );
    assert!((2..=3).contains(&letters.len()), "{text:?}");
    assert!(letters.bytes().all(|b| b.is_ascii_lowercase()), "{text:?}");

    let lark = json!({"structured_outputs": {"grammar": r#"start: "yes" | "no""#}});
    let (status, body) = post(&router, "/v1/completions", &ask(lark)).await;
    assert_eq!(status, 200, "{body}");
    let text = body["choices"][0]["text"].as_str().expect("text");
    assert!(text == "yes" || text == "no", "{text:?}");

    // Refused before any token, naming the problem.
    let refusals = [
        (
            json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}),
            "nonsense",
        ),
        (
            json!({"response_format": {"type": "xml"}}),
            "response_format.type",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            "schema",
        ),
        (
            json!({"structured_outputs": {"grammar": "start: ("}}),
            "constraint",
        ),
        (
            json!({"structured_outputs": {"regex": "a", "grammar": "start: \"a\""}}),
            "exactly one",
        ),
        // A keyword llguidance does not implement is refused, not ignored.
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                "schema": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}}}),
            "Unimplemented keys",
        ),
        // A huge schema (an enum of 30,000 names, ~400 KB: under the body limit).
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                "schema": {"enum": (0..30_000).map(|i| format!("name number {i}")).collect::<Vec<_>>()}}}}),
            "at most 262144",
        ),
    ];
    for (extra, words) in refusals {
        let (status, body) = post(&router, "/v1/completions", &ask(extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {body}");
        let error = &body["error"];
        assert_eq!(error["type"], "invalid_request_error", "{body}");
        assert!(
            error["param"] == "response_format" || error["param"] == "structured_outputs",
            "{body}"
        );
        let message = error["message"].as_str().expect("message");
        assert!(
            message.contains(words),
            "{extra}: {message:?} lacks {words:?}"
        );
    }
    // And the server is unharmed: the first request again, the same answer.
    let format = json!({"response_format": {"type": "json_schema",
        "json_schema": {"name": "person", "schema": schema()}}});
    let (status, body) = post(&router, "/v1/completions", &ask(format)).await;
    assert_eq!(status, 200, "{body}");
    assert_valid(body["choices"][0]["text"].as_str().expect("text"));
}
