//! Streamed answers: server-sent events, a chunk per commit of each choice (its `index` in
//! every chunk), each choice's end as it ends, then the usage (when asked) and `[DONE]`.

use std::convert::Infallible;
use std::sync::Arc;

use crate::error::Result;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tandem_runtime::Commit;
use tandem_runtime::sampling::TokenLogprobs;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument;

use super::choices::{self, ChoiceSink};
use super::error::ApiError;
use super::openai::{self, Head};
use super::tools::{Reader, Tools};
use crate::api::limits::ClientPermit;
use crate::engine::{CommitSink, Engine, Job, Outcome};

/// Streams `jobs`' choices. The response's status waits for the first choice's first text or
/// its failure before it: a refusal (a full node, a lost target) gets its HTTP status, not a
/// 200 with an error event. The events' receiver is held by this future, then by the
/// response's body: once the client has gone (hyper drops them), each choice ends at its next
/// commit, and `slot` is given back when the last has ended.
pub async fn answer(
    engine: Arc<Engine>,
    head: Head,
    include_usage: bool,
    jobs: Vec<Job>,
    tools: Option<Tools>,
    slot: ClientPermit,
) -> Result<Response, ApiError> {
    let (tx, rx) = mpsc::channel(4);
    let (started, first) = oneshot::channel();
    let job = jobs[0].clone();
    let mut sinks: Vec<SseSink> = (0..jobs.len())
        .map(|index| SseSink {
            engine: Arc::clone(&engine),
            head: head.clone(),
            tx: tx.clone(),
            index,
            first: true,
            offset: 0,
            started: None,
            reader: tools.as_ref().map(Tools::reader),
        })
        .collect();
    sinks[0].started = Some(started);
    tokio::spawn(
        async move {
            let mut outcomes = Vec::new();
            for (mut sink, outcome) in choices::run(&engine, jobs, sinks, slot).await {
                match (sink.started.take(), outcome) {
                    (Some(started), Err(e)) => {
                        let _ = started.send(Err(ApiError::from(e)));
                        return;
                    }
                    (_, Ok(outcome)) => outcomes.push(outcome),
                    // Sent as an error event when it ended.
                    (_, Err(_)) => {}
                }
            }
            if include_usage {
                let usage = head.usage_chunk(&job, &outcomes.iter().collect::<Vec<_>>());
                let _ = tx.send(Ok(Event::default().data(usage.to_string()))).await;
            }
            let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
        }
        .in_current_span(),
    );
    match first.await {
        Ok(Ok(())) => Ok(Sse::new(ReceiverStream::new(rx)).into_response()),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: "the generation ended before its first event".into(),
            param: None,
            code: None,
        }),
    }
}

/// Sends each commit of choice `index` as an SSE chunk.
struct SseSink {
    engine: Arc<Engine>,
    head: Head,
    tx: mpsc::Sender<Result<Event, Infallible>>,
    index: usize,
    first: bool,
    /// Where the next token's text starts in the completion (logprobs' `text_offset`).
    offset: usize,
    /// Told once the stream has its first event (the response then starts, status 200).
    started: Option<oneshot::Sender<Result<(), ApiError>>>,
    /// Reads a chat's text for tool calls, when it has tools.
    reader: Option<Reader>,
}

impl SseSink {
    fn start(&mut self) {
        if let Some(started) = self.started.take() {
            let _ = started.send(Ok(()));
        }
    }

    async fn send_all(&self, events: Vec<Value>) -> bool {
        for v in events {
            let event = Event::default().data(v.to_string());
            if self.tx.send(Ok(event)).await.is_err() {
                return false;
            }
        }
        !self.tx.is_closed()
    }
}

impl CommitSink for SseSink {
    async fn send(&mut self, commit: &Commit, logprobs: &[TokenLogprobs]) -> bool {
        self.start();
        // Text held back (half a character, a possible stop string) sends nothing, unless its
        // tokens' log-probabilities were asked for.
        if commit.text.is_empty() && logprobs.is_empty() && !self.first {
            return !self.tx.is_closed();
        }
        let (kind, tok, index) = (self.head.kind, &self.engine.tokenizer, self.index);
        let logprobs = openai::logprobs_json(kind, tok, logprobs, &mut self.offset);
        let chunks = match &mut self.reader {
            None => vec![self.head.chunk(index, &commit.text, self.first, logprobs)],
            Some(reader) => {
                let mut deltas: Vec<Value> = reader
                    .push(&commit.text)
                    .into_iter()
                    .map(openai::delta_json)
                    .collect();
                if deltas.is_empty() && (self.first || !logprobs.is_null()) {
                    deltas.push(json!({"content": ""}));
                }
                let mut logprobs = Some(logprobs);
                deltas
                    .into_iter()
                    .map(|d| {
                        let lp = logprobs.take().unwrap_or(Value::Null);
                        let chunk = self.head.delta_chunk(index, d, self.first, lp);
                        self.first = false;
                        chunk
                    })
                    .collect()
            }
        };
        self.first = false;
        self.send_all(chunks).await
    }
}

impl ChoiceSink for SseSink {
    /// The choice's last tool-call pieces and its finish chunk; or an error event. A first
    /// choice that failed before its first event is left to answer with its status.
    async fn ended(&mut self, outcome: &Result<Outcome>) {
        if self.started.is_some() && outcome.is_err() {
            return;
        }
        self.start();
        let (head, index) = (&self.head, self.index);
        let events = match outcome {
            Ok(outcome) => {
                let mut events = Vec::new();
                let mut called = false;
                if let Some(reader) = &mut self.reader {
                    events.extend(reader.finish().into_iter().map(|d| {
                        head.delta_chunk(index, openai::delta_json(d), false, Value::Null)
                    }));
                    called = reader.called();
                }
                events.push(head.finish_chunk(index, openai::finish_reason(outcome, called)));
                events
            }
            Err(e) => {
                let e = ApiError::from(e);
                vec![
                    json!({"error": {"message": e.message, "type": "server_error",
                                      "param": e.param, "code": null}}),
                ]
            }
        };
        self.send_all(events).await;
    }
}
