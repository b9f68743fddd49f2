//! A client that hangs up (issue 51, item 3), who a client is behind a proxy, and
//! `coordinator generate --endpoint` against a keyed server (item 5). The three binaries as
//! processes, the target-node behind a gate that holds a verify block of the generation
//! (`tandem_tests::gate`): a client hangs up while its generation is held, so whatever the
//! machine's speed the generation cannot end before the test has looked at what the hang-up
//! left behind (the client's slot still taken, both nodes' sessions open), then the gate opens
//! and the generation must end at that round: no further verify block, no success, both
//! sessions closed, the slot free again.

use std::net::{IpAddr, SocketAddr};

use tandem_proto::v1;
use tandem_tests::faults::FaultProxy;
use tandem_tests::gate::Gate;
use tandem_tests::held::Held;
use tandem_tests::processes::{Proc, binary};
use tandem_tests::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Verify blocks a generation gets through before the gate holds it, mid-way.
const HOLD: usize = 2;

/// A target-node (stories260K with a chat template) behind a gate, a draft-node, and a
/// coordinator drafting K = 4, one generation in flight per client, with `extra` arguments.
struct Served {
    target: Proc,
    draft: Proc,
    coordinator: Proc,
    gate: Gate,
}

impl Served {
    async fn start(extra: &[&str]) -> Self {
        let target = Proc::node("target-node", &stories_with_chat_template(), &[]);
        let draft = Proc::node("draft-node", &stories_q8(), &[]);
        let proxy = FaultProxy::passing(target.addr);
        let gate = proxy.gate.clone();
        let target_url = proxy.serve().await;
        let mut args = vec![
            "--http-listen",
            "127.0.0.1:0",
            "--draft-tokens",
            "4",
            "--max-requests-per-client",
            "1",
        ];
        args.extend_from_slice(extra);
        let coordinator = Proc::coordinator(&target_url, &draft.url(), &args, None);
        Self {
            target,
            draft,
            coordinator,
            gate,
        }
    }

    fn http(&self) -> SocketAddr {
        self.coordinator.http()
    }

    /// The coordinator's counters: the sum of the samples of each metric (or labelled sample)
    /// named.
    async fn counts(&self) -> Counts {
        let text = http_request(self.http(), "GET", "/metrics", "").await.1;
        let sum = |name: &str| -> usize {
            text.lines()
                .filter_map(|l| l.strip_prefix(name))
                // The sample itself, or each of its labelled ones.
                .filter(|rest| rest.starts_with([' ', '{']))
                .filter_map(|rest| rest.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>() as usize
        };
        Counts {
            started: sum("tandem_requests_total"),
            succeeded: sum("tandem_request_success_total"),
            cancelled: sum("tandem_errors_total{kind=\"Cancelled\"}"),
            running: sum("tandem_num_requests_running"),
        }
    }

    /// Waits until `f` holds of the counters; panics naming `what` if it does not.
    async fn until(&self, what: &str, f: impl Fn(&Counts) -> bool) -> Counts {
        until(what, async || self.counts().await, f).await
    }

    /// Sessions open on the target-node and on the draft-node.
    async fn sessions(&self) -> (u32, u32) {
        let target = node_info(self.target.addr).await.active_sessions;
        (target, node_info(self.draft.addr).await.active_sessions)
    }

    /// Waits until `f` holds of the sessions open on the target-node and the draft-node.
    async fn sessions_until(&self, what: &str, f: impl Fn(&(u32, u32)) -> bool) {
        until(what, async || self.sessions().await, f).await;
    }

    /// Waits until neither node holds a session.
    async fn sessions_closed(&self) {
        self.sessions_until("sessions closed", |open| *open == (0, 0))
            .await;
    }

    /// Asserts that a request `send` makes is refused at once for its client's limit (`refused`
    /// reads its answer) rather than admitted: admitted, it would start a generation (held at
    /// the gate like the first), seen in `tandem_requests_total` going past `started`.
    async fn refused<T>(
        &self,
        what: &str,
        started: usize,
        send: impl std::future::Future<Output = T> + Send + 'static,
        refused: impl FnOnce(T) -> bool,
    ) where
        T: Send + 'static,
    {
        let mut answer = tokio::spawn(send);
        let outcome = within(&format!("{what}: an answer"), async {
            loop {
                tokio::select! {
                    done = &mut answer => break Ok(done.expect("the request's task")),
                    () = tokio::time::sleep(std::time::Duration::from_millis(50)) => {
                        let now = self.counts().await;
                        if now.started > started {
                            break Err(now);
                        }
                    }
                }
            }
        })
        .await;
        match outcome {
            Ok(answer) => assert!(refused(answer), "{what}: not refused for its limit"),
            Err(now) => {
                answer.abort();
                panic!("{what}: admitted while its client's first generation runs: {now:?}")
            }
        }
    }
}

/// Polls `probe` until `f` holds of what it says; panics naming `what`, with the last answer,
/// if it does not.
async fn until<T: std::fmt::Debug + Default>(
    what: &str,
    mut probe: impl AsyncFnMut() -> T,
    f: impl Fn(&T) -> bool,
) -> T {
    let mut last = T::default();
    let reached = eventually(async || {
        last = probe().await;
        f(&last)
    })
    .await;
    assert!(reached, "{what}: {last:?}");
    last
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    /// Generations started (each of a request's `n` choices is one).
    started: usize,
    succeeded: usize,
    cancelled: usize,
    running: usize,
}

/// A client on a TCP connection of its own, from `from` (127.0.0.1 unless given): one request,
/// read as far as the test says, then a hang-up.
struct RawClient {
    stream: TcpStream,
    read: Vec<u8>,
}

impl RawClient {
    /// Sends `body` to `path` with `headers` (lines, each ending in `\r\n`).
    async fn send(
        http: SocketAddr,
        from: Option<IpAddr>,
        path: &str,
        headers: &str,
        body: &str,
    ) -> Self {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        if let Some(ip) = from {
            socket.bind(SocketAddr::new(ip, 0)).expect("bind");
        }
        let mut stream = socket.connect(http).await.expect("connect");
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: tandem\r\nContent-Type: application/json\r\n\
             {headers}Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream
            .write_all(request.as_bytes())
            .await
            .expect("write the request");
        Self {
            stream,
            read: Vec::new(),
        }
    }

    /// Reads until the response's head and its first event have come: the stream has begun.
    async fn first_event(&mut self) {
        within("the stream's first event", async {
            while !String::from_utf8_lossy(&self.read)
                .split_once("\r\n\r\n")
                .is_some_and(|(_, events)| events.contains("data: {") && events.contains("\n\n"))
            {
                let mut chunk = [0u8; 4096];
                let n = self.stream.read(&mut chunk).await.expect("read");
                assert!(n > 0, "the stream ended before its first event");
                self.read.extend_from_slice(&chunk[..n]);
            }
        })
        .await;
        let head = String::from_utf8_lossy(&self.read);
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    }

    /// Hangs up: ends its side of the connection (as a client that closes its socket does),
    /// then waits until the server has closed the connection too, which hyper does to a
    /// connection whose client ended it mid-request, dropping the request's handler and body.
    async fn hang_up(mut self) {
        self.stream.shutdown().await.expect("shutdown");
        within("the server closing the connection", async {
            let mut rest = Vec::new();
            // A reset is a close too.
            let _ = self.stream.read_to_end(&mut rest).await;
        })
        .await;
    }
}

/// A completion of 8 tokens by `key` (none: an open server), answered whole.
async fn complete(http: SocketAddr, key: Option<&str>) -> (u16, String, String) {
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    http_exchange_with(
        http,
        "POST",
        "/v1/completions",
        &auth,
        r#"{"prompt": "Once upon a time", "max_tokens": 8}"#,
    )
    .await
}

/// One hang-up: `body` sent to `path` by key `k1` (`n` choices, whole or `streamed`); the
/// gate holds the generation after `hold` verify blocks (a streamed client reads its first
/// event first, where there is one), and the client hangs up; what must follow is asserted.
/// Held at its first block, the first choice has committed nothing: the others never start.
async fn hang_up_mid_generation(
    s: &Served,
    path: &str,
    body: &str,
    n: usize,
    streamed: bool,
    hold: usize,
) {
    let what = format!(
        "{path} n = {n}{}, held after {hold} blocks",
        if streamed { ", streamed" } else { "" }
    );
    let before = s.counts().await;
    let passed = s.gate.passed();
    let choices = if hold == 0 { 1 } else { n };
    s.gate.hold_after(hold);
    let key = "Authorization: Bearer k1\r\n";
    let mut client = RawClient::send(s.http(), None, path, key, body).await;
    if streamed && hold > 0 {
        client.first_event().await;
    }
    // The choices started, and the gate holds the generation.
    s.until(&format!("{what}: {choices} choices started"), |c| {
        c.started == before.started + choices
    })
    .await;
    s.gate.held().await;
    s.sessions_until(&format!("{what}: open on both nodes"), |&(t, d)| {
        t >= 1 && d >= 1
    })
    .await;

    client.hang_up().await;
    // The generation goes on until its next commit, which the gate holds: its client's slot is
    // still taken.
    let http = s.http();
    s.refused(
        &format!("{what}: k1 again"),
        before.started + choices,
        complete(http, Some("k1")),
        |(status, _, body)| status == 429 && body.contains("--max-requests-per-client"),
    )
    .await;

    s.gate.open();
    let after = s
        .until(&format!("{what}: every choice ended"), |c| c.running == 0)
        .await;
    s.sessions_closed().await;
    assert_eq!(after.started, before.started + choices, "{what}: {after:?}");
    assert_eq!(
        after.cancelled,
        before.cancelled + choices,
        "{what}: {after:?}"
    );
    assert_eq!(after.succeeded, before.succeeded, "{what}: {after:?}");
    // Each choice sent at most the block the gate held, and ended at its commit.
    let blocks = s.gate.passed() - passed;
    assert!(blocks <= hold + choices, "{what}: {blocks} verify blocks");
    // The slot is free again.
    let (status, _, body) = complete(http, Some("k1")).await;
    assert_eq!(status, 200, "{what}: {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_ends_its_generation_at_the_next_round_and_holds_its_slot_until_then()
 {
    let s = Served::start(&["--api-key", "k1", "--api-key", "k2"]).await;
    let completion = |n: usize, stream: bool| {
        serde_json::json!({"prompt": "Once upon a time", "max_tokens": 400, "n": n,
                           "stream": stream})
        .to_string()
    };
    let chat = |n: usize, stream: bool| {
        serde_json::json!({"messages": [{"role": "user", "content": "Once upon a time"}],
                           "max_tokens": 400, "n": n, "stream": stream})
        .to_string()
    };
    for streamed in [false, true] {
        let c = completion(1, streamed);
        hang_up_mid_generation(&s, "/v1/completions", &c, 1, streamed, HOLD).await;
        let c = chat(2, streamed);
        hang_up_mid_generation(&s, "/v1/chat/completions", &c, 2, streamed, HOLD).await;
    }
    // Gone before its first event: the second choice is not started for nobody.
    let c = chat(2, true);
    hang_up_mid_generation(&s, "/v1/chat/completions", &c, 2, true, 0).await;
}

/// The gRPC API: a client that drops its stream mid-generation ends it, and its slot (here its
/// address: no keys) is held until then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_client_that_drops_its_stream_ends_its_generation() {
    let s = Served::start(&[]).await;
    let before = s.counts().await;
    s.gate.hold_after(HOLD);
    let request = v1::GenerateRequest {
        prompt: "Once upon a time".into(),
        max_tokens: 400,
        ignore_eos: true,
        ..Default::default()
    };
    // Read to its first delta; the client's stream window (a few deltas) then holds the
    // generation back if the coordinator missed the drop: it could not finish unseen.
    let held = Held::start(s.coordinator.url(), request.clone()).await;
    s.gate.held().await;
    s.sessions_until("open on both nodes", |open| *open == (1, 1))
        .await;
    drop(held);
    let url = s.coordinator.url();
    s.refused(
        "a second call from 127.0.0.1",
        before.started + 1,
        async move {
            let mut client = v1::coordinator_client::CoordinatorClient::connect(url)
                .await
                .expect("connect");
            client.generate(request).await.map(|_| ())
        },
        |answer| answer.is_err_and(|s| s.code() == tonic::Code::ResourceExhausted),
    )
    .await;
    s.gate.open();
    let after = s.until("the generation ended", |c| c.running == 0).await;
    s.sessions_closed().await;
    assert_eq!(after.cancelled, before.cancelled + 1, "{after:?}");
    assert_eq!(after.succeeded, before.succeeded, "{after:?}");
    let (status, _, body) = complete(s.http(), None).await;
    assert_eq!(status, 200, "{body}");
}

/// Without keys, behind a proxy named by `--trusted-proxy` (here 127.0.0.2), each address its
/// `X-Forwarded-For` names is a client of its own; the header from any other peer is ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_behind_a_trusted_proxy_are_told_apart_and_others_cannot_spoof_a_slot() {
    let s = Served::start(&["--trusted-proxy", "127.0.0.2"]).await;
    s.gate.hold_after(0);
    let (proxy, direct) = (Some([127, 0, 0, 2].into()), None);
    let body = r#"{"prompt": "Once upon a time", "max_tokens": 8}"#;
    let http = s.http();
    let send = move |from: Option<IpAddr>, xff: &str| {
        let headers = format!("Connection: close\r\nX-Forwarded-For: {xff}\r\n");
        async move {
            let mut client = RawClient::send(http, from, "/v1/completions", &headers, body).await;
            let mut answer = Vec::new();
            let _ = client.stream.read_to_end(&mut answer).await;
            String::from_utf8_lossy(&answer).into_owned()
        }
    };
    let is_429 = |answer: String| answer.starts_with("HTTP/1.1 429");
    let mut admitted = Vec::new();
    let mut started = 0;
    // One client behind the proxy, held at the gate; the same address again is refused, and
    // another behind the same proxy is let in.
    for (from, xff, let_in) in [
        (proxy, "203.0.113.1", true),
        (proxy, "198.51.100.7, 203.0.113.1", false),
        (proxy, "203.0.113.2", true),
        // A peer that is not a trusted proxy is its own address, whatever it sends.
        (direct, "203.0.113.3", true),
        (direct, "203.0.113.4", false),
    ] {
        if let_in {
            admitted.push(tokio::spawn(send(from, xff)));
            started += 1;
            s.until(&format!("{xff} admitted"), |c| c.started == started)
                .await;
        } else {
            let what = format!("{xff} from {from:?}");
            s.refused(&what, started, send(from, xff), is_429).await;
        }
    }
    // gRPC: the `x-forwarded-for` metadata of a call from the proxy.
    let endpoint = tonic::transport::Endpoint::from_shared(s.coordinator.url())
        .expect("URL")
        .local_address(proxy);
    let channel = endpoint.connect().await.expect("connect from 127.0.0.2");
    let call = |xff: &str| {
        let request = v1::GenerateRequest {
            prompt: "Once upon a time".into(),
            max_tokens: 8,
            ..Default::default()
        };
        let request = with_metadata(request, "x-forwarded-for", xff);
        let mut client = v1::coordinator_client::CoordinatorClient::new(channel.clone());
        async move { client.generate(request).await.map(|_| ()) }
    };
    s.refused(
        "gRPC for 203.0.113.2",
        started,
        call("203.0.113.2"),
        |answer| answer.is_err_and(|s| s.code() == tonic::Code::ResourceExhausted),
    )
    .await;
    call("203.0.113.9")
        .await
        .expect("another client behind the proxy");
    s.gate.open();
    for answer in admitted {
        let answer = answer.await.expect("request");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
}

/// `coordinator generate --endpoint` presents `--api-key` / `TANDEM_API_KEY`, sends one
/// generation (the comparison only on `--compare`), and without a key says how to give one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_against_a_keyed_server_presents_its_key_and_sends_one_generation() {
    const KEY: &str = "hangup-test-s3cr3t";
    let s = Served::start(&["--api-key", KEY]).await;
    let url = s.coordinator.url();
    let generate = |args: &[&str], env: &[(&str, &str)]| {
        let out = std::process::Command::new(binary("coordinator"))
            .args(["generate", "--endpoint", &url, "--max-tokens", "8"])
            .args(args)
            .env_remove("TANDEM_API_KEY")
            .envs(env.iter().copied())
            .output()
            .expect("run coordinator generate");
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!printed.contains(KEY), "the key was printed: {printed}");
        (out.status.success(), printed)
    };
    let (ok, printed) = generate(&["--api-key", KEY], &[]);
    assert!(ok, "{printed}");
    assert_eq!(s.counts().await.started, 1, "one generation, no comparison");
    let (ok, printed) = generate(&["--json"], &[("TANDEM_API_KEY", KEY)]);
    assert!(ok, "{printed}");
    assert_eq!(s.counts().await.started, 2);
    // Without a key, or with a wrong one: refused, saying how to give it.
    let (ok, printed) = generate(&[], &[]);
    assert!(!ok);
    assert!(
        printed.contains("--api-key KEY or TANDEM_API_KEY"),
        "{printed}"
    );
    let (ok, printed) = generate(&["--api-key", "not-the-key"], &[]);
    assert!(!ok);
    assert!(printed.contains("is not one of its keys"), "{printed}");
    assert_eq!(s.counts().await.started, 2);
    // Asked to compare: target-only and speculative runs follow, each with the key.
    let (ok, printed) = generate(
        &["--api-key", KEY, "--compare", "--baseline-runs", "1"],
        &[],
    );
    assert!(ok && printed.contains("speedup"), "{printed}");
    let counts = s.counts().await;
    assert!(counts.started >= 5, "{counts:?}");
    assert_eq!(counts.succeeded, counts.started, "{counts:?}");
}
