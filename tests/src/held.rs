//! A generation its client holds back: it reads the first delta, then nothing until the test has
//! done what it must do mid-generation (cut a link, kill a node, cancel). The client's HTTP/2
//! stream window is a few deltas, and the coordinator buffers a few more before its round loop
//! waits for the client ([`tandem_coordinator`]'s stream buffer): while held, a generation
//! commits at most a few dozen tokens past the first delta, however fast the machine, so a
//! fault made then lands mid-generation by construction (a callback after the first delta
//! raced the 400 tokens a tiny model decodes in 60 ms).

use tandem_proto::v1;
use tandem_proto::v1::coordinator_client::CoordinatorClient;
use tandem_proto::v1::generate_response::Kind;
use tonic::transport::Endpoint;

/// Bytes the coordinator may send past what the client read (its HTTP/2 stream window).
const WINDOW: u32 = 128;

/// A generation started and held after its first delta.
#[derive(Debug)]
pub struct Held {
    stream: tonic::Streaming<v1::GenerateResponse>,
    /// The ids streamed so far.
    pub ids: Vec<u32>,
}

impl Held {
    /// Starts `req` on the coordinator at `url` and reads up to its first delta.
    pub async fn start(url: String, req: v1::GenerateRequest) -> Self {
        let channel = Endpoint::from_shared(url)
            .expect("coordinator URL")
            .initial_stream_window_size(WINDOW)
            .connect()
            .await
            .expect("connect to the coordinator");
        let mut stream = CoordinatorClient::new(channel)
            .generate(req)
            .await
            .expect("generate")
            .into_inner();
        let first = crate::within("the held generation's first delta", stream.message())
            .await
            .expect("the generation starts")
            .expect("a first message");
        let ids = match first.kind {
            Some(Kind::Delta(d)) => d.token_ids,
            other => panic!("the first message is a delta, not {other:?}"),
        };
        Self { stream, ids }
    }

    /// Reads the rest: every id streamed and how the stream ended.
    pub async fn finish(mut self) -> (Vec<u32>, Result<v1::GenerateDone, tonic::Status>) {
        let rest = async {
            loop {
                match self.stream.message().await {
                    Ok(Some(message)) => match message.kind {
                        Some(Kind::Delta(d)) => self.ids.extend(d.token_ids),
                        Some(Kind::Done(done)) => return Ok(done),
                        None => {}
                    },
                    Ok(None) => panic!("the stream ended without its last message"),
                    Err(status) => return Err(status),
                }
            }
        };
        let end = crate::within("the end of the held generation after its release", rest).await;
        (self.ids, end)
    }

    /// Cancels the generation as a client that goes away does.
    pub fn cancel(self) {
        drop(self.stream);
    }
}

/// Holds a generation on an engine at its first commit (its sessions open on the nodes, its
/// replica's count with it) until released; tells when that commit came.
struct Holding {
    start: std::time::Instant,
    started: Option<tokio::sync::oneshot::Sender<std::time::Duration>>,
    release: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl tandem_coordinator::CommitSink for Holding {
    async fn send(
        &mut self,
        _: &tandem_runtime::Commit,
        _: &[tandem_runtime::sampling::TokenLogprobs],
    ) -> bool {
        if let Some(started) = self.started.take() {
            let _ = started.send(self.start.elapsed());
        }
        if let Some(release) = self.release.take() {
            let _ = release.await;
        }
        true
    }
}

/// A generation on an engine (in this process) held at its first commit.
#[derive(Debug)]
pub struct HeldAtFirstCommit {
    release: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<tandem_coordinator::Outcome>,
    /// From the start to the first commit.
    pub first_commit: std::time::Duration,
}

impl HeldAtFirstCommit {
    /// Starts `req` on `engine`; returns once its first commit is held.
    pub async fn start(
        engine: &std::sync::Arc<tandem_coordinator::Engine>,
        req: &v1::GenerateRequest,
    ) -> Self {
        let (started, on) = tokio::sync::oneshot::channel();
        let (release, released) = tokio::sync::oneshot::channel();
        let job = engine.prepare(req).expect("job");
        let e = std::sync::Arc::clone(engine);
        let task = tokio::spawn(async move {
            let mut sink = Holding {
                start: std::time::Instant::now(),
                started: Some(started),
                release: Some(released),
            };
            e.generate(&job, &mut sink).await.expect("generated")
        });
        let first_commit = crate::within("the first commit", on)
            .await
            .expect("the generation started");
        Self {
            release,
            task,
            first_commit,
        }
    }

    /// Starts all of `requests`, each held at its first commit: the first alone (its prompt then
    /// prefilled on the nodes), then the others at once.
    pub async fn start_all(
        engine: &std::sync::Arc<tandem_coordinator::Engine>,
        requests: &[v1::GenerateRequest],
    ) -> Vec<Self> {
        let Some((first, rest)) = requests.split_first() else {
            return Vec::new();
        };
        let mut held = vec![Self::start(engine, first).await];
        let rest: Vec<_> = rest
            .iter()
            .map(|req| {
                let (e, req) = (std::sync::Arc::clone(engine), req.clone());
                tokio::spawn(async move { Self::start(&e, &req).await })
            })
            .collect();
        for h in rest {
            held.push(h.await.expect("task"));
        }
        held
    }

    /// Lets it go on; its outcome.
    pub async fn finish(self) -> tandem_coordinator::Outcome {
        let _ = self.release.send(());
        crate::within("the held generation", self.task)
            .await
            .expect("task")
    }
}
