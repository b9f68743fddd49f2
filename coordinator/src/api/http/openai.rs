//! OpenAI's request and response shapes for completions and chat completions, checked against
//! OpenAI's ranges and turned into the coordinator's requests.

use serde::Deserialize;
use serde_json::{Value, json};
use tandem_proto::v1;

use super::chat::Message;
use super::error::ApiError;
use super::spec_metrics::SpecMetrics;
use super::tools::{Delta, Reply};
use crate::engine::{Job, Outcome};
use tandem_runtime::Tokenizer;
use tandem_runtime::sampling::TokenLogprobs;

/// A string or a list of strings (`prompt`, `stop`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling and streaming fields both endpoints share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<OneOrMany>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u32>,
    /// Extension (vLLM's): keep the k most likely tokens.
    pub top_k: Option<u32>,
    /// Extension (vLLM's): token ids that end the generation, besides the model's EOS.
    #[serde(default)]
    pub stop_token_ids: Vec<u32>,
    /// Extension (vLLM's): drop tokens below this fraction of the most likely one's probability.
    pub min_p: Option<f32>,
    /// Extension (vLLM's): divide the logits of tokens already seen by this (1: off).
    pub repetition_penalty: Option<f32>,
    /// Subtracted from the logit of each of the last 64 tokens, prompt included.
    pub presence_penalty: Option<f32>,
    /// Subtracted once per occurrence among the last 64 tokens.
    pub frequency_penalty: Option<f32>,
    /// Accepted when false only: log-probabilities are not returned.
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<u32>,
    /// Extension: K, tokens drafted per round (0: target-only; unset: chosen each round).
    pub draft_tokens: Option<u32>,
    /// Extension: who drafts, `auto`, `model` or `ngram`.
    #[serde(default)]
    pub drafter: String,
    /// Extension: `false` drafts, then verifies, every round (no drafting during the verify).
    pub pipeline: Option<bool>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema",
    /// "strict"}}`: the output is constrained to it (any JSON object, or JSON valid against the
    /// schema).
    pub response_format: Option<Value>,
    /// Extension (vLLM's): `{"json": schema}`, `{"regex": "…"}` or `{"grammar": "…"}` (Lark,
    /// llguidance's dialect), one of them.
    pub structured_outputs: Option<Value>,
    /// Extension (vLLM's): requests that give the same salt share cached prompts, whatever their
    /// API key; unset: the key's own (docs/security.md).
    #[serde(default)]
    pub cache_salt: String,
}

/// A 400 naming `param`.
fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(Some(param.to_string()), message.into())
}

impl Common {
    /// The grammar the request's output follows: `response_format` or `structured_outputs`
    /// (not both); checked here for shape, compiled by the engine before anything runs.
    fn constraint(&self) -> Result<Option<v1::Constraint>, ApiError> {
        use v1::constraint::Kind;
        let kind = match (&self.response_format, &self.structured_outputs) {
            (Some(_), Some(_)) => {
                return Err(bad(
                    "response_format",
                    "give `response_format` or `structured_outputs`, not both",
                ));
            }
            (Some(format), None) => match format["type"].as_str() {
                Some("text") => None,
                Some("json_object") => Some(Kind::JsonObject(true)),
                Some("json_schema") => {
                    let schema = &format["json_schema"]["schema"];
                    if !schema.is_object() && !schema.is_boolean() {
                        return Err(bad(
                            "response_format",
                            "`response_format.json_schema.schema` must be a JSON schema (an \
                             object)",
                        ));
                    }
                    Some(Kind::JsonSchema(schema.to_string()))
                }
                other => {
                    return Err(bad(
                        "response_format",
                        format!(
                            "`response_format.type` = {other:?}: must be `text`, `json_object` \
                             or `json_schema`"
                        ),
                    ));
                }
            },
            (None, Some(outputs)) => {
                let given: Vec<&str> = ["json", "regex", "grammar"]
                    .into_iter()
                    .filter(|k| !outputs[*k].is_null())
                    .collect();
                let text = |k: &str| {
                    outputs[k].as_str().map(str::to_string).ok_or_else(|| {
                        bad(
                            "structured_outputs",
                            format!("`structured_outputs.{k}` must be a string"),
                        )
                    })
                };
                match given[..] {
                    ["json"] => Some(Kind::JsonSchema(match &outputs["json"] {
                        Value::String(s) => s.clone(),
                        schema => schema.to_string(),
                    })),
                    ["regex"] => Some(Kind::Regex(text("regex")?)),
                    ["grammar"] => Some(Kind::Lark(text("grammar")?)),
                    _ => {
                        return Err(bad(
                            "structured_outputs",
                            "`structured_outputs` takes exactly one of `json`, `regex`, `grammar`",
                        ));
                    }
                }
            }
            (None, None) => None,
        };
        Ok(kind.map(|kind| v1::Constraint {
            kind: Some(kind),
            start: 0,
        }))
    }
}

/// A completion's prompt: text, or token ids; a list of one of either.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

impl Prompt {
    /// The coordinator's request for this prompt; a batch of several is refused.
    pub fn into_request(self) -> Result<v1::GenerateRequest, ApiError> {
        let batch = || {
            ApiError::invalid(
                Some("prompt".to_string()),
                "`prompt` must be one text or one list of token ids (batches are not supported)",
            )
        };
        let (prompt, prompt_tokens) = match self {
            Self::Text(text) => (text, Vec::new()),
            Self::Tokens(ids) => (String::new(), ids),
            Self::Texts(mut v) if v.len() == 1 => (v.remove(0), Vec::new()),
            Self::TokenLists(mut v) if v.len() == 1 => (String::new(), v.remove(0)),
            Self::Texts(_) | Self::TokenLists(_) => return Err(batch()),
        };
        Ok(v1::GenerateRequest {
            prompt,
            prompt_tokens,
            ..Default::default()
        })
    }
}

/// A completion request's own fields; its [`Common`] ones are read from the same body.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
}

/// A chat request's own fields; its [`Common`] ones are read from the same body.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    /// More variables for the model's chat template (vLLM's `chat_template_kwargs`).
    #[serde(default)]
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Functions the model may call ([`super::tools`]), and whether and which it must.
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
}

/// Most choices one request may ask for (`n`): each is a session on each node.
pub const MAX_CHOICES: u32 = 16;

/// OpenAI's default length of a completion; chat completions default to [`CHAT_MAX_TOKENS`].
pub const COMPLETION_MAX_TOKENS: i64 = 16;
pub const CHAT_MAX_TOKENS: i64 = 256;

impl Common {
    /// The coordinator's request for `prompt`, with every field checked against OpenAI's ranges.
    pub fn to_request(
        &self,
        prompt: v1::GenerateRequest,
        default_max_tokens: i64,
    ) -> Result<v1::GenerateRequest, ApiError> {
        let max_tokens = self
            .max_completion_tokens
            .or(self.max_tokens)
            .unwrap_or(default_max_tokens);
        if max_tokens < 1 {
            return Err(ApiError::invalid(
                Some("max_tokens".to_string()),
                format!("`max_tokens` = {max_tokens}: must be at least 1"),
            ));
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                Some("temperature".to_string()),
                format!("`temperature` = {temperature}: must be in [0, 2]"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                Some("top_p".to_string()),
                format!("`top_p` = {top_p}: must be in (0, 1]"),
            ));
        }
        self.choices()?;
        let stop = self
            .stop
            .clone()
            .map(OneOrMany::into_vec)
            .unwrap_or_default();
        if stop.len() > 4 || stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid(
                Some("stop".to_string()),
                "`stop` takes up to 4 non-empty strings",
            ));
        }
        let top_logprobs = self.top_logprobs()?;
        let constraint = match (self.constraint()?, prompt.constraint.clone()) {
            (Some(_), Some(_)) => {
                return Err(bad(
                    "tool_choice",
                    "a required or named `tool_choice` constrains the answer to tool calls: it \
                     cannot also follow `response_format` or `structured_outputs`",
                ));
            }
            (own, forced) => own.or(forced),
        };
        Ok(v1::GenerateRequest {
            max_tokens: u32::try_from(max_tokens).unwrap_or(u32::MAX),
            sampling: Some(v1::SamplingParams {
                temperature,
                top_p,
                top_k: self.top_k.unwrap_or(0),
                min_p: self.min_p.unwrap_or(0.0),
                repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
                presence_penalty: self.presence_penalty.unwrap_or(0.0),
                frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
                seed: self.seed,
                ..Default::default()
            }),
            draft_tokens: self.draft_tokens,
            drafter: self.drafter.clone(),
            pipeline: self.pipeline,
            stop,
            stop_token_ids: self.stop_token_ids.clone(),
            top_logprobs,
            constraint,
            cache_salt: self.cache_salt.clone(),
            ..prompt
        })
    }

    /// How many alternatives to report with each token's log-probability, if any: chat asks
    /// with `logprobs: true` and `top_logprobs: N`, completions with `logprobs: N`.
    fn top_logprobs(&self) -> Result<Option<u32>, ApiError> {
        let invalid = |field: &str, why: &str| {
            Err(ApiError::invalid(
                Some(field.to_string()),
                format!("`{field}` {why}"),
            ))
        };
        let top = match &self.logprobs {
            None | Some(Value::Null | Value::Bool(false)) => {
                if self.top_logprobs.is_some() {
                    return invalid("top_logprobs", "needs `logprobs: true`");
                }
                return Ok(None);
            }
            Some(Value::Bool(true)) => self.top_logprobs.unwrap_or(0),
            Some(Value::Number(n)) => match n.as_u64().and_then(|n| u32::try_from(n).ok()) {
                Some(n) => n,
                None => return invalid("logprobs", "must be true, or a number of alternatives"),
            },
            Some(_) => return invalid("logprobs", "must be true, or a number of alternatives"),
        };
        if top as usize > tandem_runtime::sampling::MAX_TOP_LOGPROBS {
            return invalid("top_logprobs", "is at most 20");
        }
        Ok(Some(top))
    }

    /// How many choices the request asks for (`n`, 1 by default, at most [`MAX_CHOICES`]).
    pub fn choices(&self) -> Result<usize, ApiError> {
        match self.n.unwrap_or(1) {
            n @ 1..=MAX_CHOICES => Ok(n as usize),
            n => Err(ApiError::invalid(
                Some("n".to_string()),
                format!("`n` = {n}: must be in [1, {MAX_CHOICES}]"),
            )),
        }
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

/// Which endpoint a response is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

/// Identity of one response, repeated in every chunk.
#[derive(Debug, Clone)]
pub struct Head {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub kind: Kind,
    /// What the response says of its speculation, in `metrics` ([`SpecMetrics`]).
    pub spec_metrics: SpecMetrics,
}

impl Head {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    /// Choice `index` carrying `text`, whole (`chunk` false) or as a streamed delta, with its
    /// tokens' `logprobs` ([`logprobs_json`]).
    fn choice(
        &self,
        index: usize,
        text: &str,
        finish: Option<&str>,
        chunk: bool,
        first: bool,
        logprobs: Value,
    ) -> Value {
        match (self.kind, chunk) {
            (Kind::Completion, _) => json!({"index": index, "text": text, "logprobs": logprobs,
                                            "finish_reason": finish}),
            (Kind::Chat, false) => json!({
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
            (Kind::Chat, true) => {
                let mut delta = if finish.is_some() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                if first {
                    delta["role"] = json!("assistant");
                }
                json!({"index": index, "delta": delta, "logprobs": logprobs,
                       "finish_reason": finish})
            }
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// A streamed chunk of choice `index`'s text, with its tokens' `logprobs` (or null).
    pub fn chunk(&self, index: usize, text: &str, first: bool, logprobs: Value) -> Value {
        let choice = self.choice(index, text, None, true, first, logprobs);
        self.envelope(true, json!([choice]))
    }

    /// A streamed chunk of a chat's tool calls ([`delta_json`]) in choice `index`, with its
    /// tokens' `logprobs`.
    pub fn delta_chunk(
        &self,
        index: usize,
        mut delta: Value,
        first: bool,
        logprobs: Value,
    ) -> Value {
        if first {
            delta["role"] = json!("assistant");
        }
        self.envelope(
            true,
            json!([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": null}]),
        )
    }

    /// The chunk that ends choice `index`, for `reason` ([`finish_reason`]).
    pub fn finish_chunk(&self, index: usize, reason: &str) -> Value {
        let choice = self.choice(index, "", Some(reason), true, false, Value::Null);
        self.envelope(true, json!([choice]))
    }

    /// The chunk with usage only (`stream_options.include_usage`), of every choice.
    pub fn usage_chunk(&self, job: &Job, outcomes: &[&Outcome]) -> Value {
        let mut v = self.envelope(true, json!([]));
        v["usage"] = usage(job, outcomes);
        self.add_speculation(&mut v, job, outcomes);
        v
    }

    /// The `tandem` extension (of the first choice) and, where asked for, vLLM's `metrics`.
    fn add_speculation(&self, v: &mut Value, job: &Job, outcomes: &[&Outcome]) {
        if let Some(first) = outcomes.first() {
            v["tandem"] = speculation(first);
        }
        if let Some(metrics) = self.spec_metrics.metrics(job.draft_tokens, outcomes) {
            v["metrics"] = metrics;
        }
    }

    /// The whole response of a request without streaming: one choice per outcome, each with
    /// its tokens' `logprobs` and, for a chat with tools, the `reply` read from its text.
    pub fn response(&self, job: &Job, answers: &[(Outcome, Value, Option<Reply>)]) -> Value {
        let choices: Vec<Value> = answers
            .iter()
            .enumerate()
            .map(|(index, (outcome, logprobs, reply))| {
                let called = reply.as_ref().is_some_and(|r| !r.calls.is_empty());
                let reason = finish_reason(outcome, called);
                let text = &outcome.text;
                let mut choice =
                    self.choice(index, text, Some(reason), false, false, logprobs.clone());
                if let Some(reply) = reply {
                    choice["message"] = reply.message();
                }
                choice
            })
            .collect();
        let mut v = self.envelope(false, Value::Array(choices));
        let outcomes: Vec<&Outcome> = answers.iter().map(|(o, _, _)| o).collect();
        v["usage"] = usage(job, &outcomes);
        self.add_speculation(&mut v, job, &outcomes);
        v
    }
}

/// Why a choice ended: the generation's reason, `tool_calls` where it stopped after calling.
pub fn finish_reason(outcome: &Outcome, called: bool) -> &str {
    match outcome.finish_reason.as_str() {
        "stop" if called => "tool_calls",
        reason => reason,
    }
}

/// A chat chunk's `delta` for a piece of a reply read for tool calls.
pub fn delta_json(delta: Delta) -> Value {
    match delta {
        Delta::Content(text) => json!({"content": text}),
        Delta::Call { index, id, name } => json!({"tool_calls": [{
            "index": index, "id": id, "type": "function",
            "function": {"name": name, "arguments": ""}}]}),
        Delta::Arguments { index, text } => {
            json!({"tool_calls": [{"index": index, "function": {"arguments": text}}]})
        }
    }
}

/// Tokens' log-probabilities in the shape of `kind`'s responses (null when there are none):
/// completions `{tokens, token_logprobs, top_logprobs, text_offset}`, chat
/// `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
///
/// `offset` is where the first token's text starts in the whole completion (completions'
/// `text_offset`); advanced past these tokens' text.
pub fn logprobs_json(
    kind: Kind,
    tok: &Tokenizer,
    logprobs: &[TokenLogprobs],
    offset: &mut usize,
) -> Value {
    if logprobs.is_empty() {
        return Value::Null;
    }
    let text = |id: u32| tok.decode(&[id]).unwrap_or_default();
    match kind {
        Kind::Completion => {
            let tokens: Vec<String> = logprobs.iter().map(|l| text(l.token)).collect();
            let offsets: Vec<usize> = tokens
                .iter()
                .map(|t| {
                    let here = *offset;
                    *offset += t.len();
                    here
                })
                .collect();
            json!({
                "tokens": tokens,
                "token_logprobs": logprobs.iter().map(|l| l.logprob).collect::<Vec<_>>(),
                "top_logprobs": logprobs.iter().map(|l| {
                    top(l).map(|(id, lp)| (text(id), json!(lp))).collect::<serde_json::Map<_, _>>()
                }).collect::<Vec<_>>(),
                "text_offset": offsets,
            })
        }
        Kind::Chat => {
            let entry = |id: u32, lp: f32| {
                let t = text(id);
                json!({"token": t, "logprob": lp, "bytes": t.as_bytes()})
            };
            let content: Vec<Value> = logprobs
                .iter()
                .map(|l| {
                    let mut e = entry(l.token, l.logprob);
                    e["top_logprobs"] = top(l).map(|(id, lp)| entry(id, lp)).collect();
                    e
                })
                .collect();
            json!({ "content": content })
        }
    }
}

/// A token's alternatives: (id, log-probability), most likely first.
fn top(l: &TokenLogprobs) -> impl Iterator<Item = (u32, f32)> + '_ {
    l.top.iter().copied()
}

/// Usage as OpenAI counts it: the prompt once, the completion tokens of every choice; the
/// prompt tokens the first choice found cached (the others found it too: it shares its prompt).
fn usage(job: &Job, outcomes: &[&Outcome]) -> Value {
    let p = job.prompt.len();
    let c: usize = outcomes.iter().map(|o| o.token_ids.len()).sum();
    let cached = outcomes.first().map_or(0, |o| o.stats.cached_tokens);
    json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
           "prompt_tokens_details": {"cached_tokens": cached}})
}

/// The extension field with the speculation statistics (of the first choice, when there are
/// several).
fn speculation(outcome: &Outcome) -> Value {
    let s = &outcome.stats.base;
    json!({
        "acceptance_rate": s.acceptance_rate(),
        "mean_accepted_length": s.mean_accepted_length(),
        "drafted": s.drafted,
        "accepted": s.accepted,
        "rounds": s.rounds,
        "tokens_per_second": s.tokens_per_second(),
        "draft_lost": outcome.stats.draft_lost,
        "draft_lost_reason": outcome.stats.draft_lost_reason,
        "draft_blocks_refused": outcome.stats.draft_blocks_refused,
        "seed": outcome.stats.seed,
        "model_rounds": outcome.stats.model_rounds,
        "ngram_rounds": outcome.stats.ngram_rounds,
        "history_rounds": outcome.stats.history_rounds,
        "target_only_rounds": outcome.stats.target_only_rounds,
        "draft_reattached": outcome.stats.draft_reattached,
        "draft_stalls": outcome.stats.draft_stalls,
        "pipeline_rounds": outcome.stats.pipeline_rounds,
        "pipeline_hits": outcome.stats.pipeline_hits,
    })
}
