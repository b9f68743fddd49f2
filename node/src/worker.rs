//! The node's model thread: every forward pass of every session runs on this one OS thread, never
//! on the async workers. One thread keeps the model's working memory (thread-local matmul
//! buffers, caches) warm where a pool would hop between threads (measured: a pool cost up to 9 %
//! of decode speed on a 110M model); the matmuls inside a forward still use every core through
//! the compute pools.
//!
//! It is also the node's scheduler (continuous batching, docs/architecture.md "Batching"): work of a kind
//! that runs many at a time ([`Batch`]: verify blocks, draft steps, prefill chunks) is not run as
//! it arrives but gathered, with whatever else is queued when the thread comes free, into one
//! call over up to `max_batch` items (waiting up to `max_wait` while fewer are ready than the
//! last batch held); a session joins the next batch as soon as its request arrives and has its
//! answer when its batch ends. Other jobs run one at a time, in arrival order, between batches.
//! A model on the CPU gathers once it holds the process's cores ([`ModelThread::spawn`]).

use std::any::{Any, TypeId};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use tandem_runtime::kernels::Cores;
use tokio::sync::oneshot;

/// Work the model thread runs many items of at once.
pub trait Batch: 'static {
    type Item: Send + 'static;
    type Output: Send + 'static;
    /// Runs every item (blocking), returning one output per item, in order.
    fn run(items: Vec<Self::Item>) -> Vec<Self::Output>;
}

type Erased = Box<dyn Any + Send>;

enum Job {
    Once(Box<dyn FnOnce() + Send>),
    Batched {
        kind: TypeId,
        /// `(B::Item, oneshot::Sender<B::Output>)`.
        item: Erased,
        run: fn(Vec<Erased>),
    },
}

/// A handle to the model thread; the thread ends when the last handle is dropped.
#[derive(Debug)]
pub struct ModelThread {
    jobs: mpsc::Sender<Job>,
}

impl ModelThread {
    /// Starts the thread; a batch holds at most `max_batch` items (at least 1). While fewer
    /// items are ready than the last batch held, it waits up to `max_wait` for the rest: the
    /// sessions that batch answered come back within a round trip through the coordinator, and
    /// run now with the first of them rather than a whole forward pass later.
    ///
    /// With `holds_cores` (a model on the CPU) each turn's work runs holding the process's CPU
    /// cores ([`Cores`]); the wait runs on while another model holds them, to `max_wait` after
    /// that model's turn (the rest of the batch may be its sessions, back a round trip after its
    /// pass; one turn at most), and what came while another model in the process held them
    /// joins the batch: two models that take turns on the same cores then run each session's
    /// step in one batch, not the sessions split into groups that alternate, each pass serving
    /// a few of them (8 sessions at K = 4 in one process: target passes of 2.3 sessions on
    /// average, 1-5).
    pub fn spawn(name: &str, max_batch: usize, max_wait: Duration, holds_cores: bool) -> Self {
        let (jobs, queue) = mpsc::channel::<Job>();
        let max_batch = max_batch.max(1);
        let spawned = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let (mut ready, mut last) = (Vec::new(), 0);
                loop {
                    if ready.is_empty() {
                        match queue.recv() {
                            Ok(job) => ready.push(job),
                            Err(_) => break,
                        }
                    }
                    ready.extend(queue.try_iter());
                    let mut wait = Wait::new(max_wait, holds_cores);
                    while (1..last).contains(&batched(&ready)) {
                        let left = wait.ends().checked_duration_since(Instant::now());
                        let Some(left) = left.filter(|left| !left.is_zero()) else {
                            break;
                        };
                        match queue.recv_timeout(left) {
                            Ok(job) => ready.push(job),
                            Err(mpsc::RecvTimeoutError::Timeout) => {}
                            Err(mpsc::RecvTimeoutError::Disconnected) => break,
                        }
                    }
                    // A turn of one-off jobs alone (a cache published) does not take the
                    // cores: such a job may wait on something else, and a forward inside one
                    // takes them itself, pass by pass.
                    let _cores = (holds_cores && batched(&ready) > 0).then(Cores::hold);
                    ready.extend(queue.try_iter());
                    (ready, last) = run_ready(ready, max_batch);
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the model thread");
        }
        Self { jobs }
    }

    /// Runs `f` on the model thread and waits for its result without blocking the caller's
    /// async worker. A panic in `f` becomes an error; the thread lives on.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T> {
        let (done, result) = oneshot::channel();
        let job = Job::Once(Box::new(move || {
            let _ = done.send(catch_unwind(AssertUnwindSafe(f)));
        }));
        self.send(job)?;
        match result.await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(_)) => Err(failed("a model task panicked")),
            Err(_) => Err(failed("the model thread dropped a task")),
        }
    }

    /// Runs `item` on the model thread in the next batch of `B`, and waits for its output. A
    /// panic in the batch fails every item in it; the thread lives on.
    pub async fn batch<B: Batch>(&self, item: B::Item) -> Result<B::Output> {
        let (done, result) = oneshot::channel::<B::Output>();
        self.send(Job::Batched {
            kind: TypeId::of::<B>(),
            item: Box::new((item, done)),
            run: run_erased::<B>,
        })?;
        result
            .await
            .map_err(|_| failed("a batch of model work failed"))
    }

    fn send(&self, job: Job) -> Result<()> {
        self.jobs
            .send(job)
            .map_err(|_| failed("the model thread is gone"))
    }
}

fn failed(what: &str) -> Error {
    Error::Internal(what.to_string())
}

/// A wait for the rest of a batch: it ends `max_wait` after it began, and for a model on the
/// CPU, while another model in the process holds the cores, not before `max_wait` after that
/// turn ended. Waiting costs nothing while the other holds them (the batch could not run
/// before), and the rest may be the other model's sessions, back a round trip after its pass: a
/// wait cut short there split 8 sessions in one process into groups that alternated again, each
/// model's passes serving a few. One turn at most: a wait that outlasted turns back to back (a
/// long prompt's prefill chunks) would hold the sessions waiting here back for all of them.
struct Wait {
    started: Instant,
    max_wait: Duration,
    /// For a model on the CPU (with a wait): the holds of the cores that had ended when the wait
    /// began, and when the first one after did.
    turns: Option<(u64, Option<Instant>)>,
}

impl Wait {
    fn new(max_wait: Duration, holds_cores: bool) -> Self {
        let turns = (holds_cores && !max_wait.is_zero()).then(|| (Cores::state().1, None));
        Self {
            started: Instant::now(),
            max_wait,
            turns,
        }
    }

    /// When the wait ends, as far as is known now.
    fn ends(&mut self) -> Instant {
        let Some((before, first_end)) = self.turns.as_mut() else {
            return self.started + self.max_wait;
        };
        let (busy, ended, last_end) = Cores::state();
        match (ended - *before, *first_end) {
            (_, Some(end)) => end + self.max_wait,
            (1, None) => *first_end.insert(last_end.unwrap_or(self.started)) + self.max_wait,
            // Several short turns ended between two looks: past one turn already.
            (2.., None) => self.started,
            // The cores held since the wait began (or before): looked at again after `max_wait`.
            (0, None) if busy => Instant::now() + self.max_wait,
            (0, None) => self.started + self.max_wait,
        }
    }
}

/// Items of batches among `jobs`.
fn batched(jobs: &[Job]) -> usize {
    jobs.iter()
        .filter(|job| matches!(job, Job::Batched { .. }))
        .count()
}

/// Runs the jobs that were ready together: each one-off job in its turn, and at the turn of the
/// first item of a kind of batch, every ready item of that kind (up to `max_batch`) in one call.
/// Returns the items left over past a full batch, in order, for the next turn, and the size of
/// the largest batch run (0: none).
fn run_ready(ready: Vec<Job>, max_batch: usize) -> (Vec<Job>, usize) {
    let mut pending: Vec<Option<Job>> = ready.into_iter().map(Some).collect();
    let (mut left, mut largest) = (Vec::new(), 0);
    for i in 0..pending.len() {
        match pending[i].take() {
            None => {}
            Some(Job::Once(f)) => f(),
            Some(Job::Batched { kind, item, run }) => {
                let mut items = vec![item];
                for slot in &mut pending[i + 1..] {
                    if matches!(slot, Some(Job::Batched { kind: k, .. }) if *k == kind) {
                        if items.len() == max_batch {
                            left.extend(slot.take());
                        } else if let Some(Job::Batched { item, .. }) = slot.take() {
                            items.push(item);
                        }
                    }
                }
                largest = largest.max(items.len());
                run(items);
            }
        }
    }
    (left, largest)
}

/// [`Batch::run`] over type-erased items; a panic drops the senders, failing every item.
fn run_erased<B: Batch>(items: Vec<Erased>) {
    let (items, senders): (Vec<_>, Vec<_>) = items
        .into_iter()
        .filter_map(|item| {
            item.downcast::<(B::Item, oneshot::Sender<B::Output>)>()
                .ok()
        })
        .map(|item| *item)
        .unzip();
    if let Ok(outputs) = catch_unwind(AssertUnwindSafe(|| B::run(items))) {
        for (output, done) in outputs.into_iter().zip(senders) {
            let _ = done.send(output);
        }
    }
}
