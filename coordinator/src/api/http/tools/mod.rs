//! Tool calling, as OpenAI's chat completions have it: a request's `tools` (function
//! definitions) and `tool_choice` (`none`, `auto`, `required`, or one named function), the
//! definitions rendered by the model's own chat template, and the calls the model writes, in its
//! own syntax, parsed back into OpenAI's `tool_calls` (whole, or streamed as OpenAI streams them:
//! a call's id and name, then its arguments in pieces).
//!
//! The syntax is the one the model's template teaches it: Hermes' (`<tool_call>\n{"name": …,
//! "arguments": {…}}\n</tool_call>`, Qwen2.5, Qwen3 and Hermes models; several calls in a row;
//! like llama.cpp's parser, a call in a fenced JSON block is read too, as Qwen2.5-Coder writes
//! them) or Llama 3.1+'s (the whole answer one JSON object `{"name": …, "parameters": {…}}`). With
//! `required` or a named function the output is constrained (a Lark grammar embedding each
//! function's parameter schema) to calls in that syntax, so it always parses and its arguments
//! validate; with `auto` the model chooses, and what it wrote is parsed.

use serde_json::{Value, json};

use super::error::ApiError;
use tandem_runtime::Grammar;

/// The longest function name OpenAI accepts.
const MAX_NAME: usize = 64;

/// How a model writes its calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Syntax {
    /// Each call `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`.
    Hermes,
    /// The whole answer `{"name": …, "parameters": …}`.
    Llama3,
}

impl Syntax {
    /// The syntax `template` teaches, if it knows one.
    fn of(template: &str) -> Option<Self> {
        if template.contains("<tool_call>") {
            Some(Self::Hermes)
        } else if template.contains("\"parameters\": dictionary of argument name") {
            Some(Self::Llama3)
        } else {
            None
        }
    }

    /// Where a call starts (None: the answer is one) and ends (None: with the answer).
    fn tags(self) -> (Option<&'static str>, Option<&'static str>) {
        match self {
            Self::Hermes => (Some("<tool_call>"), Some("</tool_call>")),
            Self::Llama3 => (None, None),
        }
    }

    /// The key a call's arguments are under.
    fn arguments(self) -> &'static str {
        match self {
            Self::Hermes => "arguments",
            Self::Llama3 => "parameters",
        }
    }
}

/// What the model may do with the tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// Answer in text (the definitions are not shown to it).
    None,
    /// Call tools or answer, as it likes.
    Auto,
    /// Call at least one tool.
    Required,
    /// Call this function.
    Named(String),
}

/// A request's tools.
#[derive(Debug, Clone)]
pub struct Tools {
    /// The definitions as the request gave them, for the template.
    definitions: Vec<Value>,
    /// Each function's name and parameter schema.
    functions: Vec<(String, Value)>,
    pub choice: Choice,
    /// `parallel_tool_calls`: more than one call in an answer.
    parallel: bool,
    syntax: Syntax,
}

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(Some(param.to_string()), message.into())
}

impl Tools {
    /// The request's `tools`, `tool_choice` and `parallel_tool_calls`, for a model with chat
    /// `template`; None when it has no tools and chooses none.
    pub fn from_request(
        tools: Option<&Value>,
        tool_choice: Option<&Value>,
        parallel_tool_calls: Option<bool>,
        template: Option<&str>,
    ) -> Result<Option<Self>, ApiError> {
        let definitions = match tools {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(list)) => list.clone(),
            Some(_) => return Err(bad("tools", "`tools` must be a list of functions")),
        };
        let mut functions = Vec::new();
        for (i, tool) in definitions.iter().enumerate() {
            functions.push(function(tool).map_err(|why| bad(&format!("tools[{i}]"), why))?);
        }
        if let Some(name) = duplicate(&functions) {
            return Err(bad("tools", format!("two functions are named `{name}`")));
        }
        let choice = match tool_choice {
            None | Some(Value::Null) if functions.is_empty() => return Ok(None),
            None | Some(Value::Null) => Choice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => Choice::None,
                "auto" => Choice::Auto,
                "required" => Choice::Required,
                other => {
                    return Err(bad(
                        "tool_choice",
                        format!(
                            "`tool_choice` = {other:?}: must be `none`, `auto`, `required` or \
                             {{\"type\": \"function\", \"function\": {{\"name\": …}}}}"
                        ),
                    ));
                }
            },
            Some(named) => match named["function"]["name"].as_str() {
                Some(name) if named["type"] == "function" => Choice::Named(name.to_string()),
                _ => {
                    return Err(bad(
                        "tool_choice",
                        "a named `tool_choice` is {\"type\": \"function\", \"function\": \
                         {\"name\": …}}",
                    ));
                }
            },
        };
        match &choice {
            Choice::None => {}
            Choice::Named(name) if !functions.iter().any(|(n, _)| n == name) => {
                return Err(bad(
                    "tool_choice",
                    format!("`tool_choice` names `{name}`, which is not one of `tools`"),
                ));
            }
            _ if functions.is_empty() => {
                return Err(bad(
                    "tool_choice",
                    "`tool_choice` asks for tool calls but the request has no `tools`",
                ));
            }
            _ => {}
        }
        let syntax = template.and_then(Syntax::of);
        let syntax = match (syntax, &choice) {
            (Some(syntax), _) => syntax,
            // Not shown, never called: any syntax does.
            (None, Choice::None) => Syntax::Hermes,
            (None, _) => {
                return Err(bad(
                    "tools",
                    "this model's chat template does not describe tool calls in a syntax \
                     Tandem parses (Hermes' <tool_call> tags, as Qwen2.5, Qwen3 and Hermes \
                     models write them, or Llama 3.1's JSON): serve it with such a template, \
                     or leave `tools` out",
                ));
            }
        };
        Ok(Some(Self {
            definitions,
            functions,
            choice,
            parallel: parallel_tool_calls.unwrap_or(true) && syntax == Syntax::Hermes,
            syntax,
        }))
    }

    /// The definitions the template shows the model: none when it may not call them.
    pub fn rendered(&self) -> Option<&[Value]> {
        (self.choice != Choice::None).then_some(self.definitions.as_slice())
    }

    /// Whether the answer is read for calls.
    pub fn parsed(&self) -> bool {
        self.choice != Choice::None
    }

    /// The grammar that makes the answer calls (one or more: `parallel_tool_calls`) in the
    /// model's syntax, each call's arguments valid against its function's schema: for
    /// `required` and a named function; None otherwise.
    pub fn grammar(&self) -> Option<String> {
        let allowed: Vec<&(String, Value)> = match &self.choice {
            Choice::None | Choice::Auto => return None,
            Choice::Required => self.functions.iter().collect(),
            Choice::Named(name) => self.functions.iter().filter(|(n, _)| n == name).collect(),
        };
        let key = self.syntax.arguments();
        let bodies: Vec<Value> = allowed
            .iter()
            .map(|(name, parameters)| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": name}, key: parameters},
                    "required": ["name", key],
                    "additionalProperties": false,
                })
            })
            .collect();
        let body = Grammar::lark_json(&json!({"anyOf": bodies}));
        let call = match self.syntax.tags() {
            (Some(open), Some(close)) => format!("{open:?} \"\\n\" body \"\\n\" {close:?}"),
            _ => "body".to_string(),
        };
        let start = if self.parallel {
            "call (\"\\n\" call)*"
        } else {
            "call"
        };
        Some(format!("start: {start}\ncall: {call}\nbody: {body}\n"))
    }

    /// A reader of the answer's text for calls.
    pub fn reader(&self) -> Reader {
        Reader::new(self.syntax)
    }

    /// A whole answer's text read for calls.
    pub fn read(&self, text: &str) -> Reply {
        let mut reader = self.reader();
        let mut reply = Reply::default();
        let deltas = reader.push(text);
        deltas
            .into_iter()
            .chain(reader.finish())
            .for_each(|d| reply.add(d));
        reply
    }
}

/// A tool definition's function name and parameter schema.
fn function(tool: &Value) -> Result<(String, Value), String> {
    if tool["type"] != "function" {
        return Err(
            "a tool is {\"type\": \"function\", \"function\": {\"name\", \"description\", \
                    \"parameters\"}}"
                .into(),
        );
    }
    let f = &tool["function"];
    let name = f["name"]
        .as_str()
        .ok_or("a tool's `function.name` must be a string")?;
    let well_formed = !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !well_formed {
        return Err(format!(
            "function name {name:?}: 1 to {MAX_NAME} letters, digits, `_` or `-`"
        ));
    }
    let parameters = match &f["parameters"] {
        // OpenAI: no `parameters`, no arguments.
        Value::Null => json!({"type": "object", "properties": {}, "additionalProperties": false}),
        p @ Value::Object(_) => p.clone(),
        _ => {
            return Err(format!(
                "`{name}`'s `parameters` must be a JSON schema object"
            ));
        }
    };
    Ok((name.to_string(), parameters))
}

fn duplicate(functions: &[(String, Value)]) -> Option<&str> {
    let mut names: Vec<&str> = functions.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    names.windows(2).find(|w| w[0] == w[1]).map(|w| w[0])
}

/// What a piece of the answer adds to a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    /// Text for `content`.
    Content(String),
    /// Call `index` begins: its id and function name.
    Call {
        index: usize,
        id: String,
        name: String,
    },
    /// More of call `index`'s arguments (JSON text).
    Arguments { index: usize, text: String },
}

/// One call, whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// A reply's text and calls, from its deltas.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reply {
    pub content: Option<String>,
    pub calls: Vec<Call>,
}

impl Reply {
    pub fn add(&mut self, delta: Delta) {
        match delta {
            Delta::Content(text) => self.content.get_or_insert_default().push_str(&text),
            Delta::Call { id, name, .. } => self.calls.push(Call {
                id,
                name,
                arguments: String::new(),
            }),
            Delta::Arguments { index, text } => self.calls[index].arguments.push_str(&text),
        }
    }

    /// The assistant's message in OpenAI's shape.
    pub fn message(&self) -> Value {
        let mut m = json!({"role": "assistant", "content": self.content});
        if !self.calls.is_empty() {
            m["tool_calls"] = self
                .calls
                .iter()
                .map(|c| {
                    json!({"id": c.id, "type": "function",
                           "function": {"name": c.name, "arguments": c.arguments}})
                })
                .collect();
        }
        m
    }
}

/// A call being read: its text so far, and what of it was told.
#[derive(Debug)]
struct Open {
    /// The text that opened it (a tag, a fence), and what closes it (None: the answer's end).
    opener: String,
    close: Option<&'static str>,
    text: String,
    /// Where its arguments start in `text`, once its name was told.
    arguments: Option<usize>,
    /// How much of the arguments was told.
    told: usize,
}

/// Reads an answer's text as it comes, in pieces of any size: text outside calls is `content`
/// (before the first call; what follows a call is dropped), each call its id and name as soon as
/// they are written, then its arguments as they come. Calls that do not parse stay text.
#[derive(Debug)]
pub struct Reader {
    syntax: Syntax,
    /// Text not yet told (a possible start of a call, whitespace that may precede one).
    held: String,
    call: Option<Open>,
    calls: usize,
    /// Nothing but whitespace read so far.
    at_start: bool,
}

impl Reader {
    fn new(syntax: Syntax) -> Self {
        Self {
            syntax,
            held: String::new(),
            call: None,
            calls: 0,
            at_start: true,
        }
    }

    /// Whether a call was read.
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    /// The deltas `text`, the answer's next piece, makes.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        let mut out = Vec::new();
        self.held.push_str(text);
        loop {
            if self.call.is_some() {
                self.read_call(&mut out, false);
                if self.call.is_some() {
                    return out;
                }
                continue;
            }
            match self.syntax {
                Syntax::Hermes => match opening(&self.held) {
                    Some(Opening::At { at, len, close }) => {
                        let before = self.held[..at].trim_end().to_string();
                        self.content(&before, &mut out);
                        let opener: String = self.held.drain(..at + len).skip(at).collect();
                        self.open_call(opener, Some(close));
                    }
                    found => {
                        // Hold what may start a call, and trailing whitespace.
                        let keep = match found {
                            Some(Opening::Undecided(at)) => at,
                            _ => self.held.len(),
                        };
                        let cut = self.held[..keep].trim_end().len();
                        let told = self.held[..cut].to_string();
                        self.content(&told, &mut out);
                        self.held.drain(..cut);
                        return out;
                    }
                },
                Syntax::Llama3 => {
                    let trimmed = self.held.trim_start();
                    if self.at_start && trimmed.starts_with('{') {
                        self.held = trimmed.to_string();
                        self.open_call(String::new(), None);
                    } else if self.at_start && trimmed.is_empty() {
                        return out;
                    } else {
                        let told = std::mem::take(&mut self.held);
                        self.content(&told, &mut out);
                        return out;
                    }
                }
            }
        }
    }

    /// The deltas the answer's end makes: a call still open is closed (a model may stop before
    /// its closing tag), held text told.
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        if self.call.is_some() {
            self.read_call(&mut out, true);
        }
        let held = std::mem::take(&mut self.held);
        self.content(held.trim_end(), &mut out);
        out
    }

    fn open_call(&mut self, opener: String, close: Option<&'static str>) {
        self.call = Some(Open {
            opener,
            close,
            text: std::mem::take(&mut self.held),
            arguments: None,
            told: 0,
        });
    }

    /// Content, unless it is empty or follows a call.
    fn content(&mut self, text: &str, out: &mut Vec<Delta>) {
        if text.is_empty() || self.calls > 0 {
            return;
        }
        let text = if self.at_start {
            text.trim_start()
        } else {
            text
        };
        if !text.is_empty() {
            self.at_start = false;
            out.push(Delta::Content(text.to_string()));
        }
    }

    /// Reads the open call: tells its name once written, its arguments up to its last `}`
    /// (which may be the call's own), and closes it at its closing tag (or `end`).
    fn read_call(&mut self, out: &mut Vec<Delta>, end: bool) {
        let Some(mut call) = self.call.take() else {
            return;
        };
        call.text.push_str(&std::mem::take(&mut self.held));
        let close = call.close;
        let closed = match close.and_then(|c| call.text.find(c).map(|at| (at, c.len()))) {
            Some((at, len)) => {
                self.held = call.text[at + len..].to_string();
                call.text.truncate(at);
                true
            }
            None if end => {
                if let Some(c) = close {
                    let partial = partial_suffix(&call.text, c);
                    call.text.truncate(call.text.len() - partial);
                }
                true
            }
            None => false,
        };
        let index = self.calls;
        if call.arguments.is_none()
            && let Some((name, at)) = head(&call.text, self.syntax.arguments())
        {
            out.push(Delta::Call {
                index,
                id: call_id(),
                name,
            });
            call.arguments = Some(at);
        }
        if let Some(start) = call.arguments {
            let body = call.text[start..].trim_end();
            // The call's own `}` is the last one once it is whole: hold it back till then.
            let upto = match body.rfind('}') {
                Some(at) if closed && at + 1 == body.len() => body[..at].trim_end().len(),
                Some(at) => body[..at].trim_end().len(),
                None => body.len(),
            };
            if upto > call.told {
                out.push(Delta::Arguments {
                    index,
                    text: body[call.told..upto].to_string(),
                });
                call.told = upto;
            }
            if closed {
                self.calls += 1;
            } else {
                self.call = Some(call);
            }
            return;
        }
        if !closed {
            self.call = Some(call);
            return;
        }
        // Its name was not written first: read it whole, or keep it as text.
        match whole(&call.text, self.syntax.arguments()) {
            Some((name, arguments)) => {
                out.push(Delta::Call {
                    index,
                    id: call_id(),
                    name,
                });
                out.push(Delta::Arguments {
                    index,
                    text: arguments,
                });
                self.calls += 1;
            }
            None => {
                let close = if end { "" } else { close.unwrap_or("") };
                let raw = format!("{}{}{close}", call.opener, call.text);
                self.content(&raw, out);
            }
        }
    }
}

/// Where a call starts in Hermes' syntax.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Opening {
    /// At byte `at`, its opener `len` bytes long, closed by `close`.
    At {
        at: usize,
        len: usize,
        close: &'static str,
    },
    /// Perhaps at byte `at`: what follows is not there yet.
    Undecided(usize),
}

/// The first place in `text` a call starts or may start: `<tool_call>`, or a fenced block
/// (```` ``` ```` or ```` ```json ````) holding an object whose first key is `"name"` (as
/// llama.cpp's Hermes parser reads them); None if none can.
fn opening(text: &str) -> Option<Opening> {
    const TAG: &str = "<tool_call>";
    for (at, _) in text.match_indices(['<', '`']) {
        let rest = &text[at..];
        if rest.starts_with(TAG) {
            return Some(Opening::At {
                at,
                len: TAG.len(),
                close: "</tool_call>",
            });
        }
        if TAG.starts_with(rest) || "```".starts_with(rest) {
            return Some(Opening::Undecided(at));
        }
        let Some(after) = rest.strip_prefix("```") else {
            continue;
        };
        if after.len() < 4 && "json".starts_with(after) {
            return Some(Opening::Undecided(at));
        }
        let body = after.strip_prefix("json").unwrap_or(after).trim_start();
        let named = body.strip_prefix('{').map(str::trim_start);
        match named {
            Some(key) if key.starts_with("\"name\"") => {
                return Some(Opening::At {
                    at,
                    len: rest.len() - body.len(),
                    close: "```",
                });
            }
            _ if body.is_empty() => return Some(Opening::Undecided(at)),
            Some(key) if "\"name\"".starts_with(key) => return Some(Opening::Undecided(at)),
            _ => {}
        }
    }
    None
}

/// The length of the longest end of `text` that starts `tag` (a tag perhaps cut by a piece).
fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// `{"name": "…", "<key>": ` at the start of `text`: the name, and where the arguments start.
fn head(text: &str, key: &str) -> Option<(String, usize)> {
    let mut rest = text.trim_start().strip_prefix('{')?.trim_start();
    rest = rest
        .strip_prefix("\"name\"")?
        .trim_start()
        .strip_prefix(':')?
        .trim_start();
    let mut strings = serde_json::Deserializer::from_str(rest).into_iter::<String>();
    let name = strings.next()?.ok()?;
    rest = rest[strings.byte_offset()..]
        .trim_start()
        .strip_prefix(',')?
        .trim_start();
    for k in [key, "arguments", "parameters"] {
        if let Some(after) = rest.strip_prefix(&format!("\"{k}\"")) {
            let after = after.trim_start().strip_prefix(':')?.trim_start();
            // The arguments have begun once their first character is there.
            return (!after.is_empty()).then(|| (name, text.len() - after.len()));
        }
    }
    None
}

/// A whole call `{"name": …, "<key>": …}` in any order: its name and arguments (JSON text).
fn whole(text: &str, key: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(text.trim()).ok()?;
    let name = v["name"].as_str()?.to_string();
    let arguments = [key, "arguments", "parameters"]
        .iter()
        .map(|k| &v[*k])
        .find(|a| !a.is_null())?;
    let arguments = match arguments {
        Value::String(s) => s.clone(),
        a => a.to_string(),
    };
    Some((name, arguments))
}

/// A call's id: `call_` and 24 random hex digits, as OpenAI's look.
fn call_id() -> String {
    let (a, b) = (tandem_proto::random_seed(), tandem_proto::random_seed());
    format!("call_{:016x}{:08x}", a, b as u32)
}

#[cfg(test)]
mod tests;
