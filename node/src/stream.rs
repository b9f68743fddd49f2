//! The driver of one session's bidirectional stream, the same for both roles: the first message
//! opens the session, later ones work on it, `close` or the end of the stream frees it, and so
//! does an idle timeout. Model work runs on the node's model thread, never on the async workers.
//! A refused request that left the session intact (a prefix mismatch, a value out of range) is
//! answered in-band with a `Rejection` naming what the node holds; anything else ends the stream
//! with a status.

use std::sync::Arc;

use crate::error::{Error, Result};
use tandem_proto::prefix_to_wire;
use tandem_proto::v1;
use tandem_runtime::{KvPrefix, Prefix};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status, Streaming};
use tracing::Instrument;

use crate::state::NodeState;
use crate::worker::Batch;

/// What a request on a session stream asks for.
#[derive(Debug)]
pub enum Incoming<W> {
    Open(v1::OpenSession),
    Work(W),
    Close,
}

/// One role's session: its wire messages and what it does with them.
pub trait Session: Sized + Send + 'static {
    type Request: Send + 'static;
    type Response: Send + 'static;
    /// The role's own request (a draft step, a verify block).
    type Work: Send + 'static;

    fn classify(request: Self::Request) -> Result<Incoming<Self::Work>>;
    fn opened(opened: v1::Opened) -> Self::Response;
    fn closed() -> Self::Response;
    fn rejected(rejection: v1::Rejection) -> Self::Response;

    /// Checks the request and sets the session up, its prompt not yet fed; it starts with
    /// `prefix` (found in the prefix cache), if there is one.
    fn open(state: &NodeState, open: v1::OpenSession, prefix: Option<KvPrefix>) -> Result<Self>;
    /// Its sequence and the prompt the sequence is prefilled with.
    fn prefilling(&mut self) -> (&mut tandem_runtime::SequenceState, &[u32]);
    /// Feeds the next at most `max_tokens` of the prompt (blocking); true once all is fed. (A
    /// node feeds the sessions that open together in one pass, `Prefill` below.)
    fn prefill_chunk(&mut self, max_tokens: usize) -> Result<bool> {
        let (sequence, prompt) = self.prefilling();
        Ok(sequence.prefill_chunk(prompt, max_tokens)?)
    }
    /// Does the work of several sessions at once (blocking; a batch of the pieces that were
    /// ready together, docs/architecture.md "Batching"): one result per item, in order, each what the
    /// session would get alone. `span` is each item's own span (the whole batch runs inside all
    /// of them). On error a session must be as it was.
    fn handle_batch(
        state: &NodeState,
        items: Vec<(&mut Self, Self::Work, &tracing::Span)>,
    ) -> Vec<Result<Self::Response>>;
    /// Tokens a reply proposes (draft) or commits (target), for the metrics.
    fn tokens(reply: &Self::Response) -> usize;
    /// The committed prefix the session holds.
    fn held(&self) -> Prefix;
    /// Its sequence: its cache, and the prefix it shares.
    fn sequence(&self) -> &tandem_runtime::SequenceState;
    fn sequence_mut(&mut self) -> &mut tandem_runtime::SequenceState;
    /// What it computed, as it ends, for the prefix cache.
    fn into_prefix(self) -> Option<KvPrefix>;
}

type Outbound<S> = mpsc::Sender<Result<<S as Session>::Response, Status>>;

/// An open session, its place in the session table, and its tenant's salt
/// (`OpenSession.cache_salt`: whose prefix-cache entries it starts from and leaves).
type Open<S> = (S, crate::SessionSlot, Vec<u8>);

/// Serves one session stream; the returned stream is the gRPC response.
pub fn drive_session<S: Session>(
    state: Arc<NodeState>,
    request: tonic::Request<Streaming<S::Request>>,
) -> ReceiverStream<Result<S::Response, Status>> {
    let (tx, rx) = mpsc::channel(2);
    let span = tracing::info_span!(
        "session",
        role = state.role.as_str(),
        session_id = tracing::field::Empty
    );
    tandem_proto::trace::continue_trace(request.metadata(), &span);
    let inbound = request.into_inner();
    tokio::spawn(
        async move {
            if let Err(e) = run::<S>(&state, inbound, &tx).await {
                tracing::info!(error = %e, "session ended with an error");
                state.metrics.errors.add(&format!("{:?}", e.code()), 1);
                let _ = tx.send(Err(e.into())).await;
            }
        }
        .instrument(span),
    );
    ReceiverStream::new(rx)
}

/// Serves the session's stream until it ends, however it ends; then what the session computed
/// goes to the prefix cache, its tenant's, once its reservation is freed.
async fn run<S: Session>(
    state: &Arc<NodeState>,
    inbound: Streaming<S::Request>,
    tx: &Outbound<S>,
) -> Result<()> {
    let mut session: Option<Open<S>> = None;
    let ended = serve::<S>(state, inbound, tx, &mut session).await;
    if let Some((s, slot, salt)) = session.take() {
        drop(slot);
        if let Some(prefix) = s.into_prefix() {
            state.keep(&salt, prefix);
        }
    }
    ended
}

async fn serve<S: Session>(
    state: &Arc<NodeState>,
    mut inbound: Streaming<S::Request>,
    tx: &Outbound<S>,
    session: &mut Option<Open<S>>,
) -> Result<()> {
    let idle = state.limits.idle_timeout;
    loop {
        let request = match tokio::time::timeout(idle, inbound.message()).await {
            Err(_) => {
                return Err(Error::IdleTimeout {
                    secs: idle.as_secs(),
                });
            }
            // The client closed or reset the stream: the session goes with it.
            Ok(Ok(None) | Err(_)) => return Ok(()),
            Ok(Ok(Some(request))) => request,
        };
        let reply = match S::classify(request)? {
            Incoming::Open(open) => {
                if session.is_some() {
                    return Err(Error::SessionAlreadyOpen);
                }
                // The client gone mid-prefill: nothing more to do.
                let Some((opened, reply)) = open_session::<S>(state, tx, open).await? else {
                    return Ok(());
                };
                *session = Some(opened);
                reply
            }
            Incoming::Work(work) => {
                let open = session.take().ok_or(Error::NoSession)?;
                let (open, reply) = run_work::<S>(state, open, work).await?;
                *session = Some(open);
                reply
            }
            Incoming::Close => {
                let _ = tx.send(Ok(S::closed())).await;
                return Ok(());
            }
        };
        if tx.send(Ok(reply)).await.is_err() {
            return Ok(()); // nobody listens any more
        }
        if let Some((_, slot, _)) = session.as_ref() {
            slot.answered();
        }
    }
}

/// Opens a session (admitted, its prompt prefilled in chunks, published to the prefix cache
/// where worth keeping) and its `Opened` reply; `None` where the client left mid-prefill.
async fn open_session<S: Session>(
    state: &Arc<NodeState>,
    tx: &Outbound<S>,
    mut open: v1::OpenSession,
) -> Result<Option<(Open<S>, S::Response)>> {
    tandem_proto::check_session_id(&open.session_id)?;
    tracing::Span::current().record("session_id", open.session_id.as_str());
    let (slot, prefix) = state.admit(&open)?;
    let salt = std::mem::take(&mut open.cache_salt);
    let span = tracing::info_span!("prefill", prompt_tokens = open.prompt.len());
    let arrived = std::time::Instant::now();
    let positions = state.session_room(&open);
    let mut s = S::open(state, open, prefix)?;
    // Chunked prefill: each chunk is its own job on the model thread, so the
    // batches of other sessions run between two chunks of a long prompt; the
    // chunks of sessions that open together run in one pass ([`Prefill`]). The
    // wait for the first is the open's queue time.
    let mut queued = None;
    loop {
        // A client gone mid-prefill (it gave up waiting): the rest is not computed
        // for nobody, ahead of the sessions still waiting for the model.
        if tx.is_closed() {
            return Ok(None);
        }
        let item = (s, Arc::clone(state), arrived, span.clone());
        let (back, done, began) = state.worker.batch::<Prefill<S>>(item).await?;
        queued.get_or_insert(began);
        s = back;
        if done? {
            break;
        }
    }
    let cached = s.sequence().shared_tokens();
    // Its prompt shared at once with the sessions that start the same way (`n`
    // completions of one prompt, an agent's calls with one system prompt).
    if state.prefixes.worth_keeping(s.sequence()) {
        let (back, published) = (state.worker)
            .run(move || {
                let published = s.sequence_mut().publish();
                (s, published)
            })
            .await?;
        s = back;
        state.publish(&slot, &salt, published?, positions);
    }
    state.metrics.sessions_opened.inc_by(1);
    slot.set_kv_bytes(s.sequence().cache_bytes());
    let reply = S::opened(v1::Opened {
        committed: Some(prefix_to_wire(s.held())),
        queued_micros: queued.map_or(0, |q| u64::try_from(q.as_micros()).unwrap_or(u64::MAX)),
        cached_tokens: u32::try_from(cached).unwrap_or(u32::MAX),
    });
    tracing::debug!("opened");
    Ok(Some(((s, slot, salt), reply)))
}

/// Runs one step or verify of an open session on the model thread (batched with other
/// sessions'); an error the client can act on is answered in band, as a rejection.
async fn run_work<S: Session>(
    state: &Arc<NodeState>,
    open: Open<S>,
    work: S::Work,
) -> Result<(Open<S>, S::Response)> {
    let (s, slot, salt) = open;
    slot.take();
    let st = Arc::clone(state);
    let start = std::time::Instant::now();
    let held = s.held().len;
    let span = match state.role {
        crate::Role::Draft => tracing::info_span!("draft_step", held),
        crate::Role::Target => tracing::info_span!("verify", held),
    };
    let (s, result) = (state.worker)
        .batch::<Handle<S>>((s, work, st, span))
        .await?;
    slot.set_kv_bytes(s.sequence().cache_bytes());
    let m = &state.metrics;
    let reply = match result {
        Ok(reply) => {
            m.requests.inc_by(1);
            m.tokens.inc_by(S::tokens(&reply) as u64);
            m.compute.observe(start.elapsed().as_secs_f64());
            reply
        }
        Err(e) if in_band(&e) => {
            tracing::info!(error = %e, "rejected");
            m.errors.add(&format!("{:?}", e.code()), 1);
            S::rejected(v1::Rejection {
                code: e.code() as i32,
                message: e.to_string(),
                held: Some(prefix_to_wire(s.held())),
            })
        }
        Err(e) => return Err(e),
    };
    Ok(((s, slot, salt), reply))
}

/// The work of sessions of role `S`, run in batches on the model thread.
struct Handle<S>(std::marker::PhantomData<S>);

impl<S: Session> Batch for Handle<S> {
    type Item = (S, S::Work, Arc<NodeState>, tracing::Span);
    type Output = (S, Result<S::Response>);

    fn run(items: Vec<Self::Item>) -> Vec<Self::Output> {
        let Some(state) = items.first().map(|(_, _, st, _)| Arc::clone(st)) else {
            return Vec::new();
        };
        let (mut sessions, rest): (Vec<S>, Vec<_>) = items
            .into_iter()
            .map(|(s, work, _, span)| (s, (work, span)))
            .unzip();
        let (works, spans): (Vec<_>, Vec<_>) = rest.into_iter().unzip();
        state.metrics.batches.inc_by(1);
        state.metrics.batched_requests.inc_by(sessions.len() as u64);
        let results = in_spans(&spans, || {
            let _batch = tracing::debug_span!("batch", size = sessions.len()).entered();
            let items = sessions.iter_mut().zip(works).zip(&spans);
            S::handle_batch(&state, items.map(|((s, w), sp)| (s, w, sp)).collect())
        });
        sessions.into_iter().zip(results).collect()
    }
}

/// `f` run inside every span of `spans` (each session's span covers the whole batch it waited
/// for), left in the reverse order.
fn in_spans<T>(spans: &[tracing::Span], f: impl FnOnce() -> T) -> T {
    let mut entered: Vec<_> = spans.iter().map(tracing::Span::enter).collect();
    let result = f();
    while entered.pop().is_some() {}
    result
}

/// Chunks of the prompts of sessions that open together, fed in one forward pass: at most the
/// node's `--prefill-chunk` tokens in all ([`tandem_runtime::SequenceState::prefill_batch`]),
/// the sessions past it in the next. Eight sessions opened at once on one process's cores were
/// eight passes of each model, one per prompt.
struct Prefill<S>(std::marker::PhantomData<S>);

impl<S: Session> Batch for Prefill<S> {
    /// The session, the node, when its open arrived, its prefill's span.
    type Item = (S, Arc<NodeState>, std::time::Instant, tracing::Span);
    /// The session, whether its prompt is all fed, and how long after its open this ran.
    type Output = (S, Result<bool>, std::time::Duration);

    fn run(items: Vec<Self::Item>) -> Vec<Self::Output> {
        let Some(state) = items.first().map(|(_, st, _, _)| Arc::clone(st)) else {
            return Vec::new();
        };
        let began: Vec<_> = items
            .iter()
            .map(|(_, _, arrived, _)| arrived.elapsed())
            .collect();
        let (mut sessions, spans): (Vec<S>, Vec<_>) =
            items.into_iter().map(|(s, _, _, span)| (s, span)).unzip();
        let results = in_spans(&spans, || {
            let mut parts: Vec<_> = sessions.iter_mut().map(S::prefilling).collect();
            let before: Vec<_> = parts.iter().map(|(seq, _)| seq.cached_tokens()).collect();
            let results = tandem_runtime::SequenceState::prefill_batch(
                &mut parts,
                state.limits.prefill_chunk,
            );
            let fed = parts
                .iter()
                .zip(before)
                .filter(|((seq, _), before)| seq.cached_tokens() > *before)
                .count();
            state.metrics.prefill_chunks.inc_by(fed as u64);
            results
        });
        sessions
            .into_iter()
            .zip(results)
            .zip(began)
            .map(|((s, done), began)| (s, done.map_err(Error::from), began))
            .collect()
    }
}

/// Errors a session survives, answered with a `Rejection`.
fn in_band(e: &Error) -> bool {
    matches!(
        e.code(),
        Code::FailedPrecondition | Code::InvalidArgument | Code::OutOfRange
    )
}
