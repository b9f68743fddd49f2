//! The node's model thread: every forward pass of every session runs on this one OS thread, in
//! arrival order, never on the async workers. One thread keeps the model's working memory
//! (thread-local matmul buffers, caches) warm where a pool would hop between threads (measured:
//! a pool cost up to 9 % of decode speed on a 110M model); the matmuls inside a forward still
//! use every core through the compute pools.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc;

use tandem_proto::{Error, Result};

type Job = Box<dyn FnOnce() + Send>;

/// A handle to the model thread; the thread ends when the last handle is dropped.
#[derive(Debug)]
pub struct ModelThread {
    jobs: mpsc::Sender<Job>,
}

impl ModelThread {
    pub fn spawn(name: &str) -> Self {
        let (jobs, queue) = mpsc::channel::<Job>();
        let spawned = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                for job in queue {
                    job();
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
        let (done, result) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = done.send(catch_unwind(AssertUnwindSafe(f)));
        });
        let failed = |what: &str| Error::Protocol {
            node: "node",
            what: what.to_string(),
        };
        self.jobs
            .send(job)
            .map_err(|_| failed("the model thread is gone"))?;
        match result.await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(_)) => Err(failed("a model task panicked")),
            Err(_) => Err(failed("the model thread dropped a task")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn runs_tasks_in_order_on_one_thread_and_survives_a_panic() {
        let worker = ModelThread::spawn("test-model");
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
}
