use super::*;
use tandem_runtime::{GrammarCompiler, Tokenizer};

const HERMES: &str = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>";
const LLAMA3: &str = "Respond in the format {\"name\": function name, \"parameters\": dictionary \
                      of argument name and its value}.";

fn weather() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12},
                       "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": false}}},
     {"type": "function", "function": {"name": "now"}}])
}

fn tools(choice: Value, template: &str) -> Tools {
    Tools::from_request(Some(&weather()), Some(&choice), None, Some(template))
        .expect("valid")
        .expect("tools")
}

/// Reads `text` in pieces of `size` bytes (on character boundaries).
fn read(tools: &Tools, text: &str, size: usize) -> Reply {
    let mut reader = tools.reader();
    let mut reply = Reply::default();
    let mut rest = text;
    while !rest.is_empty() {
        let mut n = size.min(rest.len());
        while !rest.is_char_boundary(n) {
            n += 1;
        }
        reader
            .push(&rest[..n])
            .into_iter()
            .for_each(|d| reply.add(d));
        rest = &rest[n..];
    }
    reader.finish().into_iter().for_each(|d| reply.add(d));
    reply
}

/// Every way of cutting `text` into pieces reads as the whole does; the ids differ, not the rest.
fn read_all_ways(tools: &Tools, text: &str) -> Reply {
    let whole = tools.read(text);
    let strip = |r: &Reply| {
        let mut r = r.clone();
        r.calls.iter_mut().for_each(|c| c.id.clear());
        r
    };
    for size in 1..text.len().min(40) {
        let pieces = read(tools, text, size);
        assert_eq!(strip(&pieces), strip(&whole), "pieces of {size}: {text:?}");
    }
    whole
}

fn calls(reply: &Reply) -> Vec<(String, Value)> {
    reply
        .calls
        .iter()
        .map(|c| {
            let args = serde_json::from_str(&c.arguments)
                .unwrap_or_else(|e| panic!("{:?}: {e}", c.arguments));
            (c.name.clone(), args)
        })
        .collect()
}

#[test]
fn hermes_calls_are_read_whole_and_in_pieces() {
    let t = tools(json!("auto"), HERMES);
    let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                {\"city\": \"Tōkyō\", \"unit\": \"c\"}}\n</tool_call>\n<tool_call>\n\
                {\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
    let reply = read_all_ways(&t, text);
    assert_eq!(reply.content.as_deref(), Some("Let me check."));
    assert_eq!(
        calls(&reply),
        vec![
            ("get_weather".into(), json!({"city": "Tōkyō", "unit": "c"})),
            ("now".into(), json!({})),
        ]
    );
    // The arguments are the model's own text.
    assert_eq!(
        reply.calls[0].arguments,
        "{\"city\": \"Tōkyō\", \"unit\": \"c\"}"
    );
    assert!(reply.calls[0].id.starts_with("call_") && reply.calls[0].id.len() == 29);
    assert_ne!(reply.calls[0].id, reply.calls[1].id);
    let message = reply.message();
    assert_eq!(message["tool_calls"][1]["function"]["name"], "now");
    assert_eq!(message["tool_calls"][0]["type"], "function");
}

#[test]
fn text_without_calls_is_content_and_lookalikes_stay_text() {
    let t = tools(json!("auto"), HERMES);
    for text in ["Paris.", "a <tool b", "x < y and <tool_cal", "  spaced  "] {
        let reply = read_all_ways(&t, text);
        assert_eq!(reply.content.as_deref(), Some(text.trim()), "{text:?}");
        assert!(reply.calls.is_empty());
    }
    assert_eq!(read_all_ways(&t, "").content, None);
}

#[test]
fn unusual_calls_an_unclosed_one_a_late_name_and_nonsense() {
    let t = tools(json!("auto"), HERMES);
    // The model stopped before its closing tag.
    let reply = read_all_ways(
        &t,
        "<tool_call>\n{\"name\": \"now\", \"arguments\": {\"x\": [1, {\"y\": 2}]}}\n</tool_",
    );
    assert_eq!(
        calls(&reply),
        vec![("now".into(), json!({"x": [1, {"y": 2}]}))]
    );
    assert_eq!(reply.content, None);
    // Spaces inside and around the arguments: they are the text between the braces' ends.
    let reply = read_all_ways(
        &t,
        "<tool_call>{ \"name\" : \"now\" , \"arguments\" : { \"x\" : { } } }\n</tool_call>",
    );
    assert_eq!(reply.calls[0].arguments, "{ \"x\" : { } }");
    // Arguments before the name: read when the call is whole.
    let reply = read_all_ways(
        &t,
        "<tool_call>{\"arguments\": {\"city\": \"Oslo\"}, \"name\": \"get_weather\"}</tool_call>",
    );
    assert_eq!(
        calls(&reply),
        vec![("get_weather".into(), json!({"city": "Oslo"}))]
    );
    // Not a call: it stays text.
    let reply = read_all_ways(&t, "<tool_call>not json</tool_call>");
    assert_eq!(
        reply.content.as_deref(),
        Some("<tool_call>not json</tool_call>")
    );
    assert!(reply.calls.is_empty());
    // Text after a call is dropped, as the call ends the turn.
    let reply = read_all_ways(
        &t,
        "<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>\nDone.",
    );
    assert_eq!(reply.content, None);
    assert_eq!(reply.calls.len(), 1);
}

/// Qwen2.5-Coder writes its calls in fenced JSON blocks: read as llama.cpp's parser reads them;
/// fenced code that is not a call stays text.
#[test]
fn calls_in_fenced_json_blocks_are_read_and_other_code_is_text() {
    let t = tools(json!("auto"), HERMES);
    let text = "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\n    \"city\": \
                \"Paris\",\n    \"unit\": \"c\"\n  }\n}\n```";
    let reply = read_all_ways(&t, text);
    assert_eq!(
        calls(&reply),
        vec![("get_weather".into(), json!({"city": "Paris", "unit": "c"}))]
    );
    assert_eq!(reply.content, None);
    let bare = read_all_ways(&t, "Here:\n```\n{\"name\": \"now\", \"arguments\": {}}```");
    assert_eq!(bare.content.as_deref(), Some("Here:"));
    assert_eq!(calls(&bare), vec![("now".into(), json!({}))]);
    for text in [
        "```python\nprint(1)\n```",
        "```json\n{\"city\": \"Paris\"}\n```",
        "Use ``` fences, or `code`.",
        "```js",
    ] {
        let reply = read_all_ways(&t, text);
        assert_eq!(reply.content.as_deref(), Some(text), "{text:?}");
        assert!(reply.calls.is_empty(), "{text:?}");
    }
}

#[test]
fn llama3_calls_are_the_whole_answer() {
    let t = tools(json!("auto"), LLAMA3);
    let reply = read_all_ways(
        &t,
        " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\", \"unit\": \"f\"}}",
    );
    assert_eq!(
        calls(&reply),
        vec![("get_weather".into(), json!({"city": "Rome", "unit": "f"}))]
    );
    let reply = read_all_ways(&t, "It is {warm} today.");
    assert_eq!(reply.content.as_deref(), Some("It is {warm} today."));
    assert!(!t.parallel, "Llama 3's syntax has one call per answer");
}

#[test]
fn requests_are_checked_and_say_what_is_wrong() {
    let err = |tools: Value, choice: Value, template: &str| {
        Tools::from_request(Some(&tools), Some(&choice), None, Some(template)).expect_err("refused")
    };
    let e = err(json!([{"type": "retrieval"}]), json!("auto"), HERMES);
    assert_eq!(e.param.as_deref(), Some("tools[0]"));
    let e = err(
        json!([{"type": "function", "function": {"name": "bad name!"}}]),
        json!("auto"),
        HERMES,
    );
    assert!(e.message.contains("bad name!"), "{}", e.message);
    let twice = json!([{"type": "function", "function": {"name": "f"}},
                       {"type": "function", "function": {"name": "f"}}]);
    assert!(err(twice, json!("auto"), HERMES).message.contains("`f`"));
    let e = err(
        weather(),
        json!({"type": "function", "function": {"name": "nope"}}),
        HERMES,
    );
    assert_eq!(e.param.as_deref(), Some("tool_choice"));
    assert!(e.message.contains("`nope`"), "{}", e.message);
    let e = err(weather(), json!("always"), HERMES);
    assert!(e.message.contains("always"), "{}", e.message);
    let e = err(json!([]), json!("required"), HERMES);
    assert!(e.message.contains("no `tools`"), "{}", e.message);
    let e = err(weather(), json!("auto"), "{{ messages }}");
    assert!(
        e.message.contains("does not describe tool calls"),
        "{}",
        e.message
    );
    // `none` needs no syntax; no tools and no choice is no tools.
    let none = tools(json!("none"), "{{ messages }}");
    assert_eq!(none.rendered(), None);
    assert!(!none.parsed() && none.grammar().is_none());
    assert!(
        Tools::from_request(None, None, None, Some(HERMES))
            .expect("fine")
            .is_none()
    );
}

/// Qwen2.5's vocabulary (the fixture's GGUF metadata) and a compiler over it.
fn qwen() -> (Tokenizer, GrammarCompiler) {
    let gguf = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/qwen2.5-vocab/qwen2.5-vocab.gguf");
    let tok = Tokenizer::for_model(&gguf).expect("tokenizer");
    let eos = tok.eos_id().expect("eos");
    let compiler = GrammarCompiler::new(&tok, tok.vocab_size(), &[eos]).expect("compiler");
    (tok, compiler)
}

/// Whether the grammar takes `text` (as Qwen's tokenizer encodes it) and then may end.
fn takes(tools: &Tools, (tok, compiler): &(Tokenizer, GrammarCompiler), text: &str) -> bool {
    let lark = tools.grammar().expect("a grammar");
    let mut state = compiler.compile(&Grammar::Lark(lark), 0).expect("compiles");
    let ids = tok.encode_raw(text).expect("encode");
    for id in ids {
        if !state.push(id).expect("push") {
            return false;
        }
    }
    state.push(tok.eos_id().expect("eos")).expect("push")
}

#[test]
fn forced_calls_follow_the_models_syntax_and_the_schemas() {
    let qwen = qwen();
    let (tok, _) = &qwen;
    // `<tool_call>` is one of Qwen's tokens, and the grammar takes it as the model writes it.
    assert_eq!(tok.encode_raw("<tool_call>").expect("encode").len(), 1);
    let required = tools(json!("required"), HERMES);
    let call = |name: &str, args: &str| {
        format!("<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {args}}}\n</tool_call>")
    };
    let paris = call("get_weather", "{\"city\": \"Paris\", \"unit\": \"c\"}");
    assert!(takes(&required, &qwen, &paris));
    assert!(takes(
        &required,
        &qwen,
        &format!("{paris}\n{}", call("now", "{}"))
    ));
    assert!(
        !takes(&required, &qwen, "Paris is sunny."),
        "text is not a call"
    );
    assert!(!takes(
        &required,
        &qwen,
        &call("get_weather", "{\"city\": \"Paris\"}")
    ));
    assert!(!takes(
        &required,
        &qwen,
        &call(
            "get_weather",
            "{\"city\": \"Llanfairpwllgwyngyll\", \"unit\": \"c\"}"
        )
    ));
    assert!(!takes(&required, &qwen, &call("now", "{\"x\": 1}")));
    assert!(!takes(&required, &qwen, &call("sudo", "{}")));
    let named = tools(
        json!({"type": "function", "function": {"name": "now"}}),
        HERMES,
    );
    assert!(takes(&named, &qwen, &call("now", "{}")));
    assert!(!takes(&named, &qwen, &paris));
    let single = Tools::from_request(
        Some(&weather()),
        Some(&json!("required")),
        Some(false),
        Some(HERMES),
    )
    .expect("valid")
    .expect("tools");
    assert!(takes(&single, &qwen, &paris));
    assert!(!takes(&single, &qwen, &format!("{paris}\n{paris}")));
    let llama = tools(json!("required"), LLAMA3);
    assert!(takes(
        &llama,
        &qwen,
        "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\", \"unit\": \"f\"}}"
    ));
    assert!(!takes(&llama, &qwen, &paris));
    // What the grammar makes, the reader reads.
    let reply = read_all_ways(&required, &paris);
    assert_eq!(
        calls(&reply),
        vec![("get_weather".into(), json!({"city": "Paris", "unit": "c"}))]
    );
}
