//! Each family's own chat template (issue 28) rendered by the coordinator's chat endpoint
//! renderer (minijinja) exactly as Hugging Face's `apply_chat_template` renders it (transformers'
//! own renderer, `tests/references/chat_template.py`): the templates of Qwen3 (with its thinking
//! switch), Qwen2.5, Llama 3.2, Mistral Nemo and Phi-3.5 from llama.cpp's collection (as vendored
//! by llama-cpp-python on PyPI), Gemma 3's and Phi-4-mini's from `tests/references/templates/`.

use std::path::{Path, PathBuf};

use serde_json::json;
use tandem_coordinator::api::http::chat::{Message, render};
use tandem_tests::python::{LLAMA_CPP_PYTHON, chat_template_answer, source_files};

const LLAMA_CPP_TEMPLATES: &str = "vendor/llama.cpp/models/templates";

/// The template files: llama.cpp's (fetched once from the sdist) and the repository's.
fn templates() -> Vec<PathBuf> {
    let names = [
        "Qwen-Qwen3-0.6B.jinja",
        "Qwen-Qwen2.5-7B-Instruct.jinja",
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        "microsoft-Phi-3.5-mini-instruct.jinja",
    ];
    let members: Vec<String> = names
        .iter()
        .map(|n| format!("{LLAMA_CPP_TEMPLATES}/{n}"))
        .collect();
    let members: Vec<&str> = members.iter().map(String::as_str).collect();
    let (project, version) = LLAMA_CPP_PYTHON;
    let dir = source_files(project, version, &members);
    let ours = Path::new(env!("CARGO_MANIFEST_DIR")).join("references/templates");
    members
        .iter()
        .map(|m| dir.join(m))
        .chain(
            [
                "google-gemma-3-it.jinja",
                "microsoft-Phi-4-mini-instruct.jinja",
            ]
            .map(|n| ours.join(n)),
        )
        .collect()
}

/// Conversations every template renders, with the tools they are given: one turn; a system
/// prompt and a finished exchange, with whitespace a template may trim, non-ASCII text and
/// markup-like characters; a first turn with tools; an assistant's two tool calls and the tools'
/// answers, and one call and its answer (the arguments as OpenAI sends them, JSON text).
fn conversations() -> Vec<(serde_json::Value, serde_json::Value)> {
    let tools = json!([{"type": "function", "function": {
        "name": "get_weather",
        "description": "The weather <now> in a city, \"quoted\"",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "Name, e.g. Tōkyō"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1}},
            "required": ["city"]}}}]);
    let call = |id: &str, city: &str| {
        json!({"id": id, "type": "function", "function": {"name": "get_weather",
            "arguments": json!({"city": city, "unit": "celsius", "days": [1, 2]}).to_string()}})
    };
    vec![
        (
            json!([{"role": "user", "content": "Hi there"}]),
            json!(null),
        ),
        (
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "  What is 2+2? <b>\"quoted\"</b>\n"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "Und 3+3? 日本語 🙂"},
            ]),
            json!(null),
        ),
        (
            json!([{"role": "user", "content": "Weather in Paris?"}]),
            tools.clone(),
        ),
        (
            json!([
                {"role": "system", "content": "You answer with tools."},
                {"role": "user", "content": "Weather in Paris and Tōkyō?"},
                {"role": "assistant", "content": null,
                 "tool_calls": [call("call12345", "Paris"), call("call67890", "Tōkyō")]},
                {"role": "tool", "tool_call_id": "call12345", "content": "{\"temp\": 18}"},
                {"role": "tool", "tool_call_id": "call67890", "content": "{\"temp\": 22}"},
            ]),
            tools.clone(),
        ),
        (
            json!([
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": null, "tool_calls": [call("call24680", "Oslo")]},
                {"role": "tool", "tool_call_id": "call24680", "content": "sunny"},
            ]),
            tools,
        ),
    ]
}

/// `messages` as vLLM hands them to Hugging Face's renderer: a call's arguments an object, a
/// null content empty.
fn for_transformers(messages: &serde_json::Value) -> serde_json::Value {
    let mut messages = messages.clone();
    for m in messages.as_array_mut().expect("messages") {
        if m["content"].is_null() {
            m["content"] = json!("");
        }
        let calls = m.get_mut("tool_calls").and_then(|c| c.as_array_mut());
        for call in calls.into_iter().flatten() {
            let text = call["function"]["arguments"].as_str().expect("text");
            call["function"]["arguments"] = serde_json::from_str(text).expect("json");
        }
    }
    messages
}

fn ours(template: &str, request: &serde_json::Value) -> Result<String, String> {
    let messages: Vec<Message> =
        serde_json::from_value(request["messages"].clone()).expect("messages");
    let variables = request["variables"].as_object().expect("variables");
    let text = |key: &str| variables[key].as_str().expect("token").to_string();
    let mut kwargs = variables.clone();
    kwargs.remove("bos_token");
    kwargs.remove("eos_token");
    let tools = kwargs.remove("tools").filter(|t| !t.is_null());
    let tools = tools
        .as_ref()
        .map(|t| t.as_array().expect("a list").as_slice());
    render(
        Some(template),
        &messages,
        tools,
        &text("bos_token"),
        &text("eos_token"),
        &kwargs,
    )
    .map_err(|e| e.message)
}

#[test]
fn every_familys_template_renders_as_hugging_face_renders_it() {
    let (mut checked, mut refused) = (0, 0);
    for path in templates() {
        let template = std::fs::read_to_string(&path).expect("template");
        let name = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        let mut variable_sets = vec![json!({})];
        if template.contains("enable_thinking") {
            variable_sets.push(json!({"enable_thinking": false}));
            variable_sets.push(json!({"enable_thinking": true}));
        }
        if template.contains("date_string") {
            // strftime_now gives today's date on both sides; a fixed one keeps the test exact.
            variable_sets = vec![json!({"date_string": "25 Nov 2026"})];
        }
        let mut requests = Vec::new();
        for (messages, tools) in conversations() {
            for extra in &variable_sets {
                let mut variables =
                    json!({"bos_token": "<s>", "eos_token": "</s>", "tools": tools});
                variables
                    .as_object_mut()
                    .expect("object")
                    .extend(extra.as_object().expect("object").clone());
                requests.push(json!({"messages": messages, "variables": variables}));
            }
        }
        let theirs: Vec<_> = requests
            .iter()
            .map(|r| json!({"messages": for_transformers(&r["messages"]), "variables": r["variables"]}))
            .collect();
        let answer = chat_template_answer(&path, &json!(theirs));
        let renderings = answer["renderings"].as_array().expect("renderings");
        assert_eq!(renderings.len(), requests.len());
        for (request, theirs) in requests.iter().zip(renderings) {
            let variables = &request["variables"];
            match (theirs["text"].as_str(), ours(&template, request)) {
                (Some(theirs), Ok(ours)) => assert_eq!(
                    ours, theirs,
                    "{name} with {variables}: rendered otherwise than by transformers {}",
                    answer["transformers"]
                ),
                // Both refuse (a template that knows no tool turns).
                (None, Err(_)) => refused += 1,
                (_, ours) => {
                    panic!("{name} with {variables}: transformers {theirs}, Tandem {ours:?}")
                }
            }
            checked += 1;
        }
    }
    assert!(checked >= 35, "{checked} renderings compared");
    // Phi-3.5, Gemma 3 and Phi-4-mini know no tool turns; Llama 3.2 takes one call at a time.
    assert!(refused <= 4, "{refused} of {checked} refused on both sides");
}
