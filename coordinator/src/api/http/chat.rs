//! Chat prompts rendered with the model's own chat template (`tokenizer_config.json`, or the
//! GGUF metadata), as Hugging Face's `apply_chat_template` does, with minijinja. Templates may
//! call Python string methods (`.strip()`, `.startswith()`, `.split()` …, as Qwen3's and
//! Llama 3.1's do): minijinja-contrib's Python compatibility layer provides them.

use minijinja::{Environment, context};
use serde::{Deserialize, Serialize};

use super::error::ApiError;

/// One chat message, as OpenAI's clients send it; the template sees what was sent (a field left
/// out is undefined there), as Hugging Face's renderer would, except a null content, which is
/// empty text as vLLM gives it (Qwen3's template reads an assistant's content as text even when
/// the turn only called tools).
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Message {
    pub role: String,
    /// A string, or OpenAI's array of content parts (`[{"type": "text", "text": …}]`), whose
    /// texts are joined; other parts (images, audio) are refused. Null (an assistant's turn that
    /// only called tools) is empty.
    #[serde(default, deserialize_with = "content_text")]
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant's calls: `[{"id", "type": "function", "function": {"name", "arguments"}}]`,
    /// the arguments (a JSON text on the wire) given to the template as the object they encode,
    /// as vLLM does (templates write them with `tojson`).
    #[serde(
        default,
        deserialize_with = "tool_calls",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub tool_calls: Vec<serde_json::Value>,
    /// A tool's answer: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    /// A message of `role` saying `content`.
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: content.to_string(),
            name: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

fn tool_calls<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<serde_json::Value>, D::Error> {
    use serde::de::Error;
    let mut calls = Option::<Vec<serde_json::Value>>::deserialize(d)?.unwrap_or_default();
    for call in &mut calls {
        let function = call
            .get_mut("function")
            .and_then(serde_json::Value::as_object_mut)
            .filter(|f| f.get("name").is_some_and(serde_json::Value::is_string))
            .ok_or_else(|| {
                D::Error::custom("a tool call is `{\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}`")
            })?;
        if let Some(serde_json::Value::String(text)) = function.get("arguments") {
            let arguments = serde_json::from_str(text).map_err(|e| {
                D::Error::custom(format!("a tool call's `arguments` must be JSON text: {e}"))
            })?;
            function.insert("arguments".into(), arguments);
        }
    }
    Ok(calls)
}

fn content_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Content {
        Text(String),
        Parts(Vec<Part>),
    }
    #[derive(Deserialize)]
    struct Part {
        #[serde(rename = "type")]
        kind: String,
        text: Option<String>,
    }
    match Option::<Content>::deserialize(d)? {
        None => Ok(String::new()),
        Some(Content::Text(text)) => Ok(text),
        Some(Content::Parts(parts)) => parts
            .into_iter()
            .map(|p| match (p.kind.as_str(), p.text) {
                ("text", Some(text)) => Ok(text),
                (kind, _) => Err(serde::de::Error::custom(format!(
                    "content parts of type `{kind}` are not supported: only `text` parts \
                     (with a `text` field)"
                ))),
            })
            .collect(),
    }
}

/// Renders `messages` with `template`, ending with the assistant's turn, with `tools` (the
/// request's, as OpenAI shapes them) for templates that describe them. `kwargs` are the
/// request's `chat_template_kwargs` (vLLM's name), more variables for the template, as
/// `apply_chat_template`'s keyword arguments are: Qwen3's `enable_thinking`, say. They cannot
/// replace the messages, the special tokens or the generation prompt.
pub fn render(
    template: Option<&str>,
    messages: &[Message],
    tools: Option<&[serde_json::Value]>,
    bos_token: &str,
    eos_token: &str,
    kwargs: &serde_json::Map<String, serde_json::Value>,
) -> Result<String, ApiError> {
    let template = template.ok_or_else(|| {
        ApiError::invalid(
            Some("messages".to_string()),
            "this model has no chat template (no `chat_template` in its tokenizer_config.json or \
             `tokenizer.chat_template` in its GGUF metadata): \
             use /v1/completions with a prompt, or serve a model that has one",
        )
    })?;
    if messages.is_empty() {
        return Err(ApiError::invalid(
            Some("messages".to_string()),
            "`messages` must hold at least one message",
        ));
    }
    let mut env = Environment::new();
    // As Hugging Face's renderer: a block tag's newline is dropped, and the spaces before it.
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    let bad = |e: minijinja::Error| {
        ApiError::invalid(
            Some("messages".to_string()),
            format!("the model's chat template refused these messages: {e}"),
        )
    };
    env.add_template("chat", template).map_err(bad)?;
    env.get_template("chat")
        .and_then(|t| {
            t.render(context! {
                messages => messages,
                tools => tools,
                documents => (),
                bos_token => bos_token,
                eos_token => eos_token,
                add_generation_prompt => true,
                ..minijinja::Value::from_serialize(kwargs)
            })
        })
        .map_err(bad)
}

/// `tojson` as Hugging Face's renderer has it: Python's `json.dumps` (", " and ": " between
/// items, `indent`, `sort_keys`, `ensure_ascii` off unless asked), not jinja2's HTML-escaping
/// compact one. Templates write tool definitions and call arguments with it, so its spacing is
/// what the model was trained on.
fn tojson(
    value: &minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> Result<String, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value).map_err(|e| {
        minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            format!("tojson: {e}"),
        )
    })?;
    let mut out = String::new();
    let style = PyJson {
        indent,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    style.write(&json, 0, &mut out);
    Ok(out)
}

/// How Python's `json.dumps` lays JSON out.
struct PyJson {
    indent: Option<usize>,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn write(&self, value: &serde_json::Value, depth: usize, out: &mut String) {
        use serde_json::Value;
        let (open, close, items): (char, char, Vec<(Option<&String>, &Value)>) = match value {
            Value::Array(a) => ('[', ']', a.iter().map(|v| (None, v)).collect()),
            Value::Object(o) => {
                let mut items: Vec<_> = o.iter().map(|(k, v)| (Some(k), v)).collect();
                if self.sort_keys {
                    items.sort_by(|a, b| a.0.cmp(&b.0));
                }
                ('{', '}', items)
            }
            Value::String(s) => return self.string(s, out),
            scalar => return out.push_str(&scalar.to_string()),
        };
        out.push(open);
        if items.is_empty() {
            out.push(close);
            return;
        }
        let newline = |out: &mut String, depth: usize| {
            if let Some(n) = self.indent {
                out.push('\n');
                out.extend(std::iter::repeat_n(' ', n * depth));
            }
        };
        for (i, (key, item)) in items.into_iter().enumerate() {
            if i > 0 {
                out.push_str(if self.indent.is_some() { "," } else { ", " });
            }
            newline(out, depth + 1);
            if let Some(key) = key {
                self.string(key, out);
                out.push_str(": ");
            }
            self.write(item, depth + 1, out);
        }
        newline(out, depth);
        out.push(close);
    }

    fn string(&self, s: &str, out: &mut String) {
        let quoted = serde_json::Value::from(s).to_string();
        if !self.ensure_ascii {
            return out.push_str(&quoted);
        }
        for c in quoted.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }
}

/// The local time in a C `strftime` format, as Hugging Face's renderer gives templates (Llama 3's
/// date line); an unknown specifier is an error, not a panic.
fn strftime_now(format: String) -> Result<String, minijinja::Error> {
    use std::fmt::Write;
    let mut text = String::new();
    write!(text, "{}", chrono::Local::now().format(&format)).map_err(|_| {
        minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            format!("strftime_now: cannot format the time as {format:?}"),
        )
    })?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ZEPHYR: &str = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}";

    #[test]
    fn content_is_a_string_or_text_parts() {
        let m: Message = serde_json::from_str(
            r#"{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}"#,
        )
        .expect("parts");
        assert_eq!(m.content, "Hi there");
        let e = serde_json::from_str::<Message>(
            r#"{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}"#,
        )
        .expect_err("an image");
        assert!(
            e.to_string().contains("`image_url` are not supported"),
            "{e}"
        );
        let m: Message =
            serde_json::from_str(r#"{"role": "assistant", "content": null}"#).expect("null");
        assert_eq!(m.content, "");
    }

    #[test]
    fn renders_with_the_generation_prompt_and_refuses_a_missing_template() {
        let none = serde_json::Map::new();
        let msgs = vec![Message::new("user", "Hi")];
        let text = render(Some(ZEPHYR), &msgs, None, "<s>", "</s>", &none).expect("render");
        assert_eq!(text, "<|user|>\nHi</s>\n<|assistant|>\n");
        let err = render(None, &msgs, None, "<s>", "</s>", &none).expect_err("no template");
        assert!(err.message.contains("no chat template"), "{}", err.message);
        let pythonic = "{% for m in messages %}{% if m.content.strip().startswith('H') %}\
                        {{ m.content.split('i')[0] | upper }}{% endif %}{% endfor %}";
        assert_eq!(
            render(Some(pythonic), &msgs, None, "", "", &none).expect("render"),
            "H"
        );
        let strict = "{{ raise_exception('only user turns') }}";
        let err = render(Some(strict), &msgs, None, "<s>", "</s>", &none).expect_err("raised");
        assert!(err.message.contains("only user turns"), "{}", err.message);
    }

    /// Block tags on lines of their own leave nothing behind (trim_blocks and lstrip_blocks, as
    /// Hugging Face's renderer has them: its output for this template is "U: Hi\n").
    #[test]
    fn block_tags_on_their_own_lines_leave_no_whitespace() {
        let template = "{% for m in messages %}\n  {% if m.role == 'user' %}\nU: {{ m.content }}\n  \
                        {% endif %}\n{% endfor %}";
        let msgs: Vec<Message> = serde_json::from_value(serde_json::json!([
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A"}
        ]))
        .expect("messages");
        let none = serde_json::Map::new();
        assert_eq!(
            render(Some(template), &msgs, None, "", "", &none).expect("render"),
            "U: Hi\n"
        );
    }

    /// `strftime_now` gives the local date in C's formats (Llama 3's templates date their system
    /// turn with it); a format it cannot write is the template's error.
    #[test]
    fn strftime_now_gives_the_local_date() {
        let msgs = vec![Message::new("user", "Hi")];
        let none = serde_json::Map::new();
        let date = render(
            Some("{{ strftime_now('%d %b %Y') }}"),
            &msgs,
            None,
            "",
            "",
            &none,
        )
        .expect("render");
        let expected = chrono::Local::now().format("%d %b %Y").to_string();
        let yesterday = (chrono::Local::now() - chrono::Duration::days(1))
            .format("%d %b %Y")
            .to_string();
        // Rendered before `expected`: the day may have turned in between, never twice.
        assert!(date == expected || date == yesterday, "{date} / {expected}");
        assert_eq!(date.len(), "25 Nov 2026".len(), "{date}");
        let err = render(Some("{{ strftime_now('%Q') }}"), &msgs, None, "", "", &none)
            .expect_err("no such specifier");
        assert!(err.message.contains("strftime_now"), "{}", err.message);
    }

    /// Qwen2.5's own template, read from the GGUF metadata of the vocabulary fixture: a plain
    /// chat gets the default system prompt and the assistant's turn.
    #[test]
    fn qwen_template_from_gguf_metadata_renders_a_plain_chat() {
        let none = serde_json::Map::new();
        let gguf = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/qwen2.5-vocab/qwen2.5-vocab.gguf");
        let tok = tandem_runtime::Tokenizer::for_model(&gguf).expect("tokenizer");
        let msgs = vec![Message::new("user", "Write hello world in Rust.")];
        let text =
            render(tok.chat_template(), &msgs, None, "", "<|im_end|>", &none).expect("render");
        assert_eq!(
            text,
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
             assistant.<|im_end|>\n<|im_start|>user\nWrite hello world in Rust.<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        let with_system = vec![Message::new("system", "Be brief."), msgs[0].clone()];
        let text = render(tok.chat_template(), &with_system, None, "", "", &none).expect("render");
        assert!(
            text.starts_with("<|im_start|>system\nBe brief.<|im_end|>\n"),
            "{text}"
        );
    }

    /// `chat_template_kwargs` reach the template, as Qwen3's thinking switch does (its template
    /// closes an empty think block when `enable_thinking` is false), and cannot replace the
    /// variables the server sets.
    #[test]
    fn chat_template_kwargs_are_the_templates_variables() {
        let qwen3_tail = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}\
                          <|im_end|>\n{% endfor %}{% if add_generation_prompt %}\
                          <|im_start|>assistant\n{% if enable_thinking is defined and \
                          enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}";
        let msgs = vec![Message::new("user", "Hi")];
        let kwargs = |v: serde_json::Value| v.as_object().cloned().expect("an object");
        let thinking = render(
            Some(qwen3_tail),
            &msgs,
            None,
            "",
            "",
            &serde_json::Map::new(),
        )
        .expect("render");
        assert_eq!(
            thinking,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let off = kwargs(serde_json::json!({"enable_thinking": false}));
        let quiet = render(Some(qwen3_tail), &msgs, None, "", "", &off).expect("render");
        assert_eq!(quiet, format!("{thinking}<think>\n\n</think>\n\n"));
        let on = kwargs(serde_json::json!({"enable_thinking": true}));
        assert_eq!(
            render(Some(qwen3_tail), &msgs, None, "", "", &on).expect("render"),
            thinking
        );
        let sneaky = kwargs(serde_json::json!({"messages": [], "add_generation_prompt": false}));
        assert_eq!(
            render(Some(qwen3_tail), &msgs, None, "", "", &sneaky).expect("render"),
            thinking
        );
    }
}
