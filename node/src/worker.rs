//! The node's model thread: every forward pass of every session runs on this one OS thread, never
//! on the async workers. One thread keeps the model's working memory (thread-local matmul
//! buffers, caches) warm where a pool would hop between threads (measured: a pool cost up to 9 %
//! of decode speed on a 110M model); the matmuls inside a forward still use every core through
//! the compute pools.
//!
//! It is also the node's scheduler (continuous batching, docs/architecture.md "Batching"): work of a kind
//! that runs many at a time ([`Batch`]: verify blocks, draft steps) is not run as it arrives but
//! gathered, with whatever else is queued when the thread comes free, into one call over up to
//! `max_batch` items (waiting up to `max_wait` while fewer are ready than the last batch held);
//! a session joins the next batch as soon as its request arrives and has its answer when its
//! batch ends. Other jobs (opening a session, a prefill chunk) run one at a time,
//! in arrival order, between batches.

use std::any::{Any, TypeId};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tandem_proto::{Error, Result};
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
    pub fn spawn(name: &str, max_batch: usize, max_wait: Duration) -> Self {
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
                    let deadline = Instant::now() + max_wait;
                    while (1..last).contains(&batched(&ready)) {
                        let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                            break;
                        };
                        match queue.recv_timeout(left) {
                            Ok(job) => ready.push(job),
                            Err(_) => break,
                        }
                    }
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
    Error::Protocol {
        node: "node",
        what: what.to_string(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn runs_tasks_in_order_on_one_thread_and_survives_a_panic() {
        let worker = ModelThread::spawn("test-model", 8, Duration::ZERO);
        let a = worker
            .run(|| std::thread::current().id())
            .await
            .expect("run");
        let err: Result<()> = worker.run(|| panic!("boom")).await;
        assert!(err.is_err(), "a panic is an error");
        let b = worker
            .run(|| std::thread::current().id())
            .await
            .expect("run");
        assert_eq!(a, b, "one thread");
        assert_ne!(a, std::thread::current().id());
    }

    /// Answers each item with the size of the batch it ran in.
    struct Sizes;

    impl Batch for Sizes {
        type Item = u32;
        type Output = (u32, usize);
        fn run(items: Vec<u32>) -> Vec<(u32, usize)> {
            let n = items.len();
            items.into_iter().map(|i| (i, n)).collect()
        }
    }

    /// Items sent while the thread is busy run together when it comes free, at most
    /// `max_batch` at a time, each answered with its own output.
    async fn batch_sizes(max_batch: usize, items: u32) -> Vec<(u32, usize)> {
        let worker =
            std::sync::Arc::new(ModelThread::spawn("test-batch", max_batch, Duration::ZERO));
        queued_batch(&worker, 0..items).await
    }

    type Call = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(u32, usize)>>>>;

    /// Polls `call` once, without a waker.
    fn poll_once(call: &mut Call) -> std::task::Poll<Result<(u32, usize)>> {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        call.as_mut().poll(&mut cx)
    }

    /// Sends `item` to the model thread now (an unpolled [`ModelThread::batch`] sends nothing):
    /// polls the call once and returns it, to be awaited for its answer.
    fn sent(worker: &std::sync::Arc<ModelThread>, item: u32) -> Call {
        let worker = std::sync::Arc::clone(worker);
        let mut call: Call = Box::pin(async move { worker.batch::<Sizes>(item).await });
        match poll_once(&mut call) {
            std::task::Poll::Ready(answer) => Box::pin(std::future::ready(answer)),
            std::task::Poll::Pending => call,
        }
    }

    /// Items `items` sent while the thread is busy (a job it has started, which ends once they
    /// are all queued), answered.
    async fn queued_batch(
        worker: &std::sync::Arc<ModelThread>,
        items: std::ops::Range<u32>,
    ) -> Vec<(u32, usize)> {
        let (started, running) = std::sync::mpsc::channel::<()>();
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let busy = {
            let worker = std::sync::Arc::clone(worker);
            tokio::spawn(async move {
                worker
                    .run(move || {
                        started.send(()).expect("started");
                        wait.recv()
                    })
                    .await
            })
        };
        tokio::task::spawn_blocking(move || running.recv())
            .await
            .expect("join")
            .expect("the busy job started");
        let calls: Vec<_> = items.map(|i| sent(worker, i)).collect();
        release.send(()).expect("release");
        busy.await
            .expect("join")
            .expect("busy job")
            .expect("released");
        let mut out = Vec::new();
        for call in calls {
            out.push(call.await.expect("batched"));
        }
        out.sort_unstable();
        out
    }

    #[tokio::test]
    async fn work_queued_while_busy_runs_as_one_batch_up_to_the_cap() {
        assert_eq!(batch_sizes(8, 3).await, vec![(0, 3), (1, 3), (2, 3)]);
        let capped = batch_sizes(2, 5).await;
        assert_eq!(
            capped.iter().map(|&(i, _)| i).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4]
        );
        let mut sizes: Vec<usize> = capped.iter().map(|&(_, n)| n).collect();
        sizes.sort_unstable();
        assert_eq!(sizes, [1, 2, 2, 2, 2], "two batches of two, then one");
    }

    #[tokio::test]
    async fn a_batch_waits_briefly_for_the_sessions_the_last_one_held() {
        // After a batch of 3, an item that arrives alone waits (up to a minute here: it ends
        // when the others come) for two more sent after it, and the three run together.
        let worker =
            std::sync::Arc::new(ModelThread::spawn("test-wait", 8, Duration::from_secs(60)));
        assert_eq!(queued_batch(&worker, 0..3).await, [(0, 3), (1, 3), (2, 3)]);
        let mut first = sent(&worker, 10);
        // Given time to run alone (as it would without the wait), it has not: still waiting.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(poll_once(&mut first).is_pending(), "ran without waiting");
        let later: Vec<_> = (11..13).map(|i| sent(&worker, i)).collect();
        assert_eq!(
            first.await.expect("batched"),
            (10, 3),
            "waited for the others"
        );
        for call in later {
            assert_eq!(call.await.expect("batched").1, 3);
        }
        // With no wait, the item that arrives alone runs alone: it is answered before the
        // others are sent.
        let worker = std::sync::Arc::new(ModelThread::spawn("test-wait", 8, Duration::ZERO));
        assert_eq!(queued_batch(&worker, 0..3).await, [(0, 3), (1, 3), (2, 3)]);
        assert_eq!(sent(&worker, 10).await.expect("batched"), (10, 1));
    }
}
