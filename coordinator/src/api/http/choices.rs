//! A request's `n` choices (OpenAI's `n`): a job each, seeded `seed + i` where the request
//! names a seed (each unseeded one draws its own). The first runs alone until its first commit
//! (its prompt then prefilled on the nodes, and shared there through their prefix caches); the
//! others start then and begin with the prompt's keys and values instead of computing them
//! again (issue 30).
//!
//! Each choice runs in a task of its own, which holds the client's place under
//! `--max-requests-per-client` until it ends, and ends at its next commit once its sink says
//! the client has gone (hyper drops the handler's future, and a streamed response's body, when
//! the client closes its connection).

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;

use crate::error::Result;
use tandem_proto::v1;
use tandem_runtime::Commit;
use tandem_runtime::sampling::TokenLogprobs;
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use crate::api::limits::ClientPermit;
use crate::engine::{CommitSink, Engine, Job, Outcome};

/// Where one choice's commits go, told when it ends.
pub trait ChoiceSink: CommitSink + 'static {
    /// The choice has ended with `outcome` (each choice's end is sent as it happens).
    fn ended(&mut self, outcome: &Result<Outcome>) -> impl Future<Output = ()> + Send;
}

/// The sink of a whole (not streamed) answer's choice: keeps nothing (the outcome has it all),
/// and says the client has gone once the client's end of its channel was dropped.
#[derive(Debug, Clone)]
pub struct Whole(mpsc::Sender<Infallible>);

/// The sinks of a whole answer's `n` choices, and the client's end they watch: the handler's
/// future holds it, and hyper drops that future when the client closes its connection.
pub fn whole(n: usize) -> (mpsc::Receiver<Infallible>, Vec<Whole>) {
    let (tx, rx) = mpsc::channel(1);
    (rx, vec![Whole(tx); n])
}

impl CommitSink for Whole {
    async fn send(&mut self, _: &Commit, _: &[TokenLogprobs]) -> bool {
        !self.0.is_closed()
    }
}

impl ChoiceSink for Whole {
    async fn ended(&mut self, _: &Result<Outcome>) {}
}

/// `request`'s `n` jobs, checked by `engine`, of the tenant `tenant`
/// ([`Engine::prepare_for`]).
pub fn jobs(
    engine: &Engine,
    request: &v1::GenerateRequest,
    n: usize,
    tenant: &[u8],
) -> Result<Vec<Job>> {
    (0..n)
        .map(|i| {
            let mut choice = request.clone();
            if let Some(s) = choice.sampling.as_mut() {
                s.seed = s.seed.map(|seed| seed.wrapping_add(i as u64));
            }
            engine.prepare_for(&choice, tenant)
        })
        .collect()
}

/// Tells the first choice's first commit (or its end, whichever comes first).
struct First<S> {
    sink: S,
    started: Option<oneshot::Sender<()>>,
}

impl<S: CommitSink> CommitSink for First<S> {
    async fn send(&mut self, commit: &Commit, logprobs: &[TokenLogprobs]) -> bool {
        let open = self.sink.send(commit, logprobs).await;
        // Where the client has gone, the others are not started (dropped, it is told nothing).
        let started = self.started.take();
        if let Some(started) = started.filter(|_| open) {
            let _ = started.send(());
        }
        open
    }
}

/// Runs `jobs` on `engine`, each choice's commits to its sink: the first alone until its first
/// commit, then the others together. Each sink comes back with its choice's outcome; a first
/// choice that fails (or whose client has gone) before it commits anything is the only one run.
/// `slot` is held by the choices' tasks: given back when the last ends, even where this future
/// was dropped before (the client hung up).
pub async fn run<S: ChoiceSink>(
    engine: &Arc<Engine>,
    jobs: Vec<Job>,
    sinks: Vec<S>,
    slot: ClientPermit,
) -> Vec<(S, Result<Outcome>)> {
    let slot = Arc::new(slot);
    let mut pairs = jobs.into_iter().zip(sinks);
    let Some((job, sink)) = pairs.next() else {
        return Vec::new();
    };
    let (started, on) = oneshot::channel();
    let first = spawn(
        engine,
        job,
        First {
            sink,
            started: Some(started),
        },
        Arc::clone(&slot),
    );
    let mut out = Vec::with_capacity(pairs.len() + 1);
    let first = if on.await.is_ok() {
        Some(first)
    } else {
        // It ended before its first commit: the others run only if it succeeded.
        let done = join(first).await;
        let failed = done.1.is_err();
        out.push(done);
        if failed {
            return out;
        }
        None
    };
    let others = pairs.map(|(job, sink)| {
        spawn(
            engine,
            job,
            First {
                sink,
                started: None,
            },
            Arc::clone(&slot),
        )
    });
    let tasks: Vec<_> = first.into_iter().chain(others).collect();
    for task in tasks {
        out.push(join(task).await);
    }
    out
}

async fn join<T>(task: tokio::task::JoinHandle<T>) -> T {
    match task.await {
        Ok(done) => done,
        // A task that panicked: the panic goes on here.
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

fn spawn<S: ChoiceSink>(
    engine: &Arc<Engine>,
    job: Job,
    mut sink: First<S>,
    slot: Arc<ClientPermit>,
) -> tokio::task::JoinHandle<(S, Result<Outcome>)> {
    let engine = Arc::clone(engine);
    tokio::spawn(
        async move {
            let outcome = engine.generate(&job, &mut sink).await;
            drop(slot);
            let mut sink = sink.sink;
            sink.ended(&outcome).await;
            (sink, outcome)
        }
        .in_current_span(),
    )
}
