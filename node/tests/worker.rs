//! The node's model thread (`tandem_node::ModelThread`): one-off jobs in order on one thread,
//! batches of work that came while it was busy, the wait for the sessions the last batch held,
//! and, for a model on the CPU, batches gathered once it holds the process's cores.

use std::time::Duration;

use tandem_node::Result;
use tandem_node::{Batch, ModelThread};
use tandem_runtime::kernels::Cores;

#[tokio::test]
async fn runs_tasks_in_order_on_one_thread_and_survives_a_panic() {
    let worker = ModelThread::spawn("test-model", 8, Duration::ZERO, false);
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
    let worker = std::sync::Arc::new(ModelThread::spawn(
        "test-batch",
        max_batch,
        Duration::ZERO,
        false,
    ));
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
    let worker = std::sync::Arc::new(ModelThread::spawn(
        "test-wait",
        8,
        Duration::from_secs(60),
        false,
    ));
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
    let worker = std::sync::Arc::new(ModelThread::spawn("test-wait", 8, Duration::ZERO, false));
    assert_eq!(queued_batch(&worker, 0..3).await, [(0, 3), (1, 3), (2, 3)]);
    assert_eq!(sent(&worker, 10).await.expect("batched"), (10, 1));
}

/// Taken by the tests that hold the process's cores, one at a time (no other test of this
/// binary holds or waits for them).
static CORES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Another model's pass in this process: a thread that holds the cores until [`Pass::end`].
struct Pass {
    thread: std::thread::JoinHandle<()>,
    release: std::sync::mpsc::Sender<()>,
}

impl Pass {
    /// Starts once the thread holds the cores.
    fn start() -> Self {
        let (held, holding) = std::sync::mpsc::channel();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let _cores = Cores::hold();
            held.send(()).expect("the test waits");
            released.recv().expect("the test releases");
        });
        holding.recv().expect("the other model holds the cores");
        Self { thread, release }
    }

    fn end(self) {
        self.release.send(()).expect("release");
        self.thread.join().expect("the other model's pass");
    }
}

/// A model thread on the CPU whose last batch held 4 items.
async fn after_a_batch_of_four(name: &str, wait: Duration) -> std::sync::Arc<ModelThread> {
    let worker = std::sync::Arc::new(ModelThread::spawn(name, 8, wait, true));
    let sizes: Vec<usize> = queued_batch(&worker, 0..4)
        .await
        .iter()
        .map(|a| a.1)
        .collect();
    assert_eq!(sizes, [4; 4]);
    worker
}

/// `first` and `later` answered in one batch of them all.
async fn in_one_batch(first: Call, later: Vec<Call>) {
    let n = 1 + later.len();
    assert_eq!(
        first.await.expect("batched").1,
        n,
        "ran with the later items"
    );
    for call in later {
        assert_eq!(call.await.expect("batched").1, n);
    }
}

#[tokio::test]
async fn work_that_came_while_another_model_held_the_cores_joins_the_batch() {
    let _alone = CORES.lock().await;
    let pass = Pass::start();
    assert_eq!(Cores::queued(), 1);
    let worker = std::sync::Arc::new(ModelThread::spawn("test-cores", 8, Duration::ZERO, true));
    let first = sent(&worker, 0);
    // The model thread takes item 0, alone, and waits for the cores.
    tokio::task::spawn_blocking(|| {
        while Cores::queued() < 2 {
            std::thread::yield_now();
        }
    })
    .await
    .expect("join");
    let later: Vec<_> = (1..4).map(|i| sent(&worker, i)).collect();
    pass.end();
    in_one_batch(first, later).await;
}

#[tokio::test]
async fn the_wait_for_a_batch_lasts_while_another_model_holds_the_cores() {
    // After a batch of 4, an item comes while another model's pass holds the cores for longer
    // than the wait; the other three come before that pass ends: all four run together.
    let _alone = CORES.lock().await;
    let wait = Duration::from_secs(1);
    let worker = after_a_batch_of_four("test-cores-wait", wait).await;
    let pass = Pass::start();
    let first = sent(&worker, 10);
    // Past its wait, the model thread has not asked for the cores (it would have run item 10
    // alone as they came free): it still gathers.
    tokio::time::sleep(wait + wait / 2).await;
    assert_eq!(
        Cores::queued(),
        1,
        "asked for the cores with a partial batch"
    );
    let later: Vec<_> = (11..14).map(|i| sent(&worker, i)).collect();
    pass.end();
    in_one_batch(first, later).await;
}

#[tokio::test]
async fn the_wait_for_a_batch_outlasts_one_turn_of_another_model_at_most() {
    let _alone = CORES.lock().await;
    // Another model whose passes follow each other (a long prompt prefilled in chunks): after a
    // batch of 4, an item that comes alone runs between two of them, not after the last.
    let worker = after_a_batch_of_four("test-cores-turns", Duration::from_millis(500)).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let passes = {
        let stop = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _pass = Cores::hold();
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let answer = tokio::time::timeout(Duration::from_secs(60), sent(&worker, 10)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    passes.join().expect("the other model's passes");
    let answer = answer.expect("ran between the other model's passes");
    assert_eq!(answer.expect("batched"), (10, 1));
}
