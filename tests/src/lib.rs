//! Fixtures of the cross-node tests: model pairs, nodes and clusters in this process, the real
//! binaries as processes, and the in-process generator the distributed output is compared to.

pub mod bench;
pub mod copy_bound;
pub mod drafting_bound;
pub mod faults;
pub mod gate;
pub mod held;
pub mod hub;
pub mod link;
pub mod netns;
pub mod pki;
pub mod processes;
pub mod proxy;
pub mod python;
pub mod recorded;
pub mod reference;

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use tandem_coordinator::http::spec_metrics::SpecMetrics;
use tandem_coordinator::{Discard, Engine, LocalCluster, Outcome};
use tandem_node::{LimitsArgs, NodeState, Role};
use tandem_proto::v1;
use tandem_runtime::synthetic::{SyntheticSpec, write_random_llama};
use tandem_runtime::{
    GenerateRequest, Generation, LoadOptions, Model, SamplingParams, SpeculativeGenerator,
    Tokenizer,
};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

/// stories260K (f32 safetensors): the high-acceptance target.
pub fn stories() -> PathBuf {
    fixtures().join("stories260K")
}

/// Its Q8_0 copy: the high-acceptance draft.
pub fn stories_q8() -> PathBuf {
    fixtures().join("stories260K-q8_0.gguf")
}

fn scratch() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"))
        .path()
}

/// A tiny random-weight model with the stories260K tokenizer (two seeds make a low-acceptance
/// pair), written once per test binary.
pub fn random_model(seed: u64) -> PathBuf {
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().expect("fixture lock");
    let dir = scratch().join(format!("tiny-{seed}"));
    if !dir.exists() {
        write_random_llama(&dir, &SyntheticSpec::tiny(seed), &stories()).expect("random model");
    }
    dir
}

/// A random model whose vocabulary differs from stories260K's: two token ids swapped.
pub fn foreign_vocab_model() -> PathBuf {
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().expect("fixture lock");
    let dir = scratch().join("foreign-vocab");
    if !dir.exists() {
        write_random_llama(&dir, &SyntheticSpec::tiny(99), &stories()).expect("random model");
        let path = dir.join("tokenizer.json");
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        let vocab = json["model"]["vocab"].as_object_mut().expect("vocab");
        let (a, b) = (vocab["▁the"].clone(), vocab["▁a"].clone());
        vocab.insert("▁the".into(), b);
        vocab.insert("▁a".into(), a);
        std::fs::write(&path, json.to_string()).expect("write tokenizer.json");
    }
    dir
}

/// The chat template the HTTP tests give stories260K (which has none of its own): the messages'
/// texts, then the names of the tools it is given, and Hermes' syntax for calls.
pub const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}\
                                 {% for t in tools or [] %} {{ t.function.name }}{% endfor %}\
                                 {# calls: <tool_call>{\"name\": …, \"arguments\": …}</tool_call> #}";

/// A copy of stories260K whose tokenizer_config.json carries [`CHAT_TEMPLATE`].
pub fn stories_with_chat_template() -> PathBuf {
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().expect("fixture lock");
    let dir = scratch().join("stories260K-chat");
    if !dir.exists() {
        std::fs::create_dir_all(&dir).expect("mkdir");
        for entry in std::fs::read_dir(stories()).expect("read stories260K") {
            let path = entry.expect("entry").path();
            std::fs::copy(&path, dir.join(path.file_name().expect("name"))).expect("copy");
        }
    }
    // Written whenever it differs: a copy made with an older template is brought up to date.
    let path = dir.join("tokenizer_config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    if config["chat_template"] != CHAT_TEMPLATE {
        config["chat_template"] = CHAT_TEMPLATE.into();
        let partial = dir.join("tokenizer_config.json.partial");
        std::fs::write(&partial, config.to_string()).expect("write");
        std::fs::rename(&partial, &path).expect("rename");
    }
    dir
}

pub fn load(path: &Path) -> Model {
    Model::load(path, &LoadOptions::default()).expect("load model")
}

pub fn tokenizer(path: &Path) -> Tokenizer {
    Tokenizer::for_model(path).expect("tokenizer")
}

/// A node of `role` serving the model at `path`.
pub fn node(role: Role, path: &Path, limits: &LimitsArgs) -> NodeState {
    NodeState::new(role, load(path), tokenizer(path), "cpu", limits)
}

/// Target and (optional) draft nodes on 127.0.0.1:0 in this process.
pub async fn cluster(target: &Path, draft: Option<&Path>, limits: &LimitsArgs) -> LocalCluster {
    let t = node(Role::Target, target, limits);
    let d = draft.map(|p| node(Role::Draft, p, limits));
    LocalCluster::start(t, d).await.expect("start cluster")
}

/// A draft step's slack ([`Engine::draft_step_slack`]) and a draft session's grace beside the
/// target's open ([`Engine::draft_open_grace`]) where a test compares a distributed generation
/// with the in-process generator round for round or draw for draw: that generator never abandons
/// a step, and a loaded machine may delay one past the product's 0.5 s or an open past its 0.25 s
/// (rounds then decoded by the target alone: the same greedy text in more rounds, another
/// sample).
pub const PATIENT: std::time::Duration = std::time::Duration::from_secs(60);

/// `cluster`'s engine, K fixed at `k` for requests that name none, patient with draft steps and
/// opens ([`PATIENT`]).
pub async fn patient_engine(cluster: &LocalCluster, k: usize) -> Engine {
    let mut engine = cluster.engine(k).await.expect("engine");
    engine.draft_step_slack = PATIENT;
    engine.draft_open_grace = PATIENT;
    engine
}

/// An engine on `cluster`'s target with the draft-node at `draft_url` (a proxy in front of the
/// cluster's own, say), K fixed at `k` for requests that name none, patient with draft steps and
/// opens ([`PATIENT`]).
pub async fn engine_through(cluster: &LocalCluster, draft_url: &str, k: usize) -> Engine {
    engine_to(&format!("http://{}", cluster.target_addr), draft_url, k).await
}

/// [`engine_through`] on `cluster`'s own draft-node, with its target-node 50 ms away behind a
/// [`link::Link`] (returned, to keep it up): its verify gives the draft's steps (a few
/// milliseconds on the tests' models) the time to draft ahead, however loaded the machine.
pub async fn engine_far_target(cluster: &LocalCluster, k: usize) -> (link::Link, Engine) {
    let link = target_behind(cluster, std::time::Duration::from_millis(50)).await;
    let draft_url = format!("http://{}", cluster.draft_addr.expect("a draft"));
    let engine = engine_to(&link.url(), &draft_url, k).await;
    (link, engine)
}

/// A [`link::Link`] of round trip `rtt` (no bandwidth cap) in front of `cluster`'s target-node.
pub async fn target_behind(cluster: &LocalCluster, rtt: std::time::Duration) -> link::Link {
    let far = link::LinkSpec {
        rtt,
        bits_per_second: None,
    };
    link::Link::start(cluster.target_addr, far)
        .await
        .expect("link")
}

/// An engine with its target-node at `target_url` ([`engine_through`]).
async fn engine_to(target_url: &str, draft_url: &str, k: usize) -> Engine {
    let mut engine = Engine::connect(
        &[target_url.to_string()],
        &[draft_url.to_string()],
        Some(k),
        &Default::default(),
    )
    .await
    .expect("engine");
    engine.draft_step_slack = PATIENT;
    engine.draft_open_grace = PATIENT;
    engine
}

/// A request by token ids, greedy unless `sampling` says otherwise, with no stop tokens so
/// that every token is compared.
pub fn request(
    prompt: &[u32],
    max_tokens: u32,
    k: u32,
    sampling: &SamplingParams,
) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt_tokens: prompt.to_vec(),
        max_tokens,
        sampling: Some(sampling.into()),
        draft_tokens: Some(k),
        ignore_eos: true,
        ..Default::default()
    }
}

/// The same request run by the in-process generator (no gRPC).
pub fn in_process(target: &Path, draft: Option<&Path>, req: &v1::GenerateRequest) -> Generation {
    let (target_model, draft_model) = (load(target), draft.map(load));
    in_process_with(&target_model, draft_model.as_ref(), &tokenizer(target), req)
}

/// [`in_process`] with models already loaded.
pub fn in_process_with(
    target: &Model,
    draft: Option<&Model>,
    tok: &Tokenizer,
    req: &v1::GenerateRequest,
) -> Generation {
    let request = GenerateRequest {
        prompt: req.prompt_tokens.clone(),
        max_new_tokens: req.max_tokens as usize,
        sampling: req
            .sampling
            .as_ref()
            .map(|s| s.to_runtime().expect("sampling"))
            .unwrap_or_default(),
        draft_tokens: req.draft_tokens.unwrap_or(0) as usize,
        stop_token_ids: Vec::new(),
        stop_strings: req.stop.clone(),
    };
    SpeculativeGenerator::new(target, draft, tok)
        .expect("generator")
        .generate(&request, |_| {})
        .expect("in-process generation")
}

/// Runs a request on `engine` to the end (no streaming).
pub async fn generate(engine: &Engine, req: &v1::GenerateRequest) -> Outcome {
    let job = engine.prepare(req).expect("valid request");
    within(
        "a generation on the engine",
        engine.generate(&job, &mut Discard),
    )
    .await
    .expect("generation")
}

/// Runs all `requests` at once on `engine`; their outcomes in order.
pub async fn generate_concurrently(
    engine: &std::sync::Arc<Engine>,
    requests: &[v1::GenerateRequest],
) -> Vec<Outcome> {
    let tasks: Vec<_> = requests
        .iter()
        .cloned()
        .map(|req| {
            let engine = std::sync::Arc::clone(engine);
            tokio::spawn(async move { generate(&engine, &req).await })
        })
        .collect();
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.expect("task"));
    }
    outcomes
}

/// Serves the OpenAI-compatible HTTP API of `engine` on 127.0.0.1:0.
pub async fn serve_http(engine: std::sync::Arc<Engine>) -> std::net::SocketAddr {
    serve_http_with(engine, SpecMetrics::None).await
}

/// [`serve_http`], its responses saying `spec_metrics` of their speculation.
pub async fn serve_http_with(
    engine: std::sync::Arc<Engine>,
    spec_metrics: SpecMetrics,
) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(tandem_coordinator::http::serve(
        listener,
        tandem_coordinator::http::HttpState::new(
            tandem_coordinator::late_engine::LateEngine::ready(engine),
            Default::default(),
            Vec::new(),
            spec_metrics,
        ),
        tandem_coordinator::http::MetricsOn::Api,
        std::future::pending(),
    ));
    addr
}

/// Node info over gRPC.
pub async fn node_info(addr: std::net::SocketAddr) -> v1::NodeInfo {
    within(&format!("the node info of {addr}"), async {
        v1::node_service_client::NodeServiceClient::connect(format!("http://{addr}"))
            .await
            .expect("connect")
            .info(v1::InfoRequest::default())
            .await
            .expect("info")
            .into_inner()
    })
    .await
}

/// Streams `req` from the coordinator at `url`. Returns the streamed ids and how the stream
/// ended.
pub async fn stream(
    url: String,
    req: v1::GenerateRequest,
) -> (Vec<u32>, Result<v1::GenerateDone, tonic::Status>) {
    let what = format!("a generation streamed from {url}");
    within(&what, async {
        let mut client = v1::coordinator_client::CoordinatorClient::connect(url)
            .await
            .expect("connect");
        let mut stream = match client.generate(req).await {
            Ok(response) => response.into_inner(),
            Err(status) => return (Vec::new(), Err(status)),
        };
        let mut ids = Vec::new();
        loop {
            match stream.message().await {
                Ok(Some(message)) => match message.kind {
                    Some(v1::generate_response::Kind::Delta(d)) => ids.extend(d.token_ids),
                    Some(v1::generate_response::Kind::Done(done)) => return (ids, Ok(done)),
                    None => {}
                },
                Ok(None) => panic!("the stream ended without its last message"),
                Err(status) => return (ids, Err(status)),
            }
        }
    })
    .await
}

/// How long a test waits for anything (a generation, a reply, a process) before it calls it a
/// hang: minutes, for a loaded 2-core machine is slow, not wrong.
pub const HANG: std::time::Duration = std::time::Duration::from_secs(300);

/// Awaits `fut`, or panics naming `what` it was waiting for once [`HANG`] has passed.
pub async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(HANG, fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {} s", HANG.as_secs()))
}

/// The cluster's target-node verified blocks of several sessions in one forward pass.
pub fn assert_target_batched(cluster: &LocalCluster) {
    let m = &cluster.target.metrics;
    assert!(
        m.batched_requests.get() > m.batches.get(),
        "no batch held more than one session: {} requests in {} batches",
        m.batched_requests.get(),
        m.batches.get()
    );
}

/// Polls until `f` holds, for up to a minute (a loaded machine is slow, not wrong).
pub async fn eventually(mut f: impl AsyncFnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::time::Instant::now() < deadline {
        if f().await {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    false
}

/// Sampling parameters for seeded sampling tests.
pub fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        seed,
        ..SamplingParams::default()
    }
}

/// One HTTP/1.1 request (`Connection: close`); returns the status and the body.
pub async fn http_request(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, String) {
    let (status, _, body) = http_exchange(addr, method, path, body).await;
    (status, body)
}

/// [`http_request`], with the response's head (status line and headers) as well.
pub async fn http_exchange(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, String, String) {
    http_exchange_with(addr, method, path, "", body).await
}

/// [`http_exchange`] with extra header lines (each ending in `\r\n`).
pub async fn http_exchange_with(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: tandem\r\nContent-Type: application/json\r\n\
         {headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let response = within(&format!("{method} {path} on {addr}"), async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut response = String::new();
        stream.read_to_string(&mut response).await.expect("read");
        response
    })
    .await;
    let status = response
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    (status, head.to_string(), body.to_string())
}

/// Where `.ci/run` fetches the real Qwen2.5-Coder pair (`TANDEM_QWEN_DIR`, default
/// `~/.cache/tandem/models`).
pub fn qwen_dir() -> PathBuf {
    std::env::var_os("TANDEM_QWEN_DIR").map_or_else(
        || Path::new(&std::env::var_os("HOME").unwrap_or_default()).join(".cache/tandem/models"),
        PathBuf::from,
    )
}

/// The real pair (target, draft) when it has been fetched. In CI (`CI` set) its absence fails
/// the test; elsewhere the test says loudly that it did not run and how to make it run.
pub fn qwen_pair(test: &str) -> Option<(PathBuf, PathBuf)> {
    let dir = qwen_dir();
    let target = dir.join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    let draft = dir.join("qwen2.5-coder-0.5b-instruct.gguf");
    if target.exists() && draft.exists() {
        return Some((target, draft));
    }
    let how = format!(
        "the Qwen2.5-Coder pair is not in {}: fetch it with \
         `scripts/fetch-qwen-pair.sh {}` (.ci/run does)",
        dir.display(),
        dir.display()
    );
    not_run(test, &how);
    None
}

/// Says that `test` could not run here and why: in CI (`CI` set) a failure; elsewhere a line
/// written to the process's standard error itself, past the test harness's capture (which kept
/// `eprintln!`'s "NOT RUN" out of sight), so that a test that passed without running is never
/// taken for one that ran, and a line in [`not_run_list`], which the suite's last test binary
/// counts (`tests/tests/zz_not_run.rs`). `scripts/prerequisites.sh` names these tests before the
/// suite starts.
pub fn not_run(test: &str, why: &str) {
    use std::io::Write;
    assert!(std::env::var_os("CI").is_none(), "{test}: {why}");
    let _ = std::io::stderr().write_all(format!("NOT RUN {test}: {why}\n").as_bytes());
    let list = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(not_run_list());
    if let Ok(mut list) = list {
        let _ = list.write_all(format!("{test}: {why}\n").as_bytes());
    }
}

/// Where the tests of this `cargo test` that could not run are listed: a file named by cargo's
/// process id (every test binary it runs is its child).
pub fn not_run_list() -> PathBuf {
    let cargo = std::os::unix::process::parent_id();
    processes::profile_dir().join(format!("tandem-not-run-{cargo}.txt"))
}

/// `request` as a gRPC call carrying the metadata `key: value` (an API key's
/// `authorization: Bearer KEY`, a proxy's `x-forwarded-for`).
pub fn with_metadata<T>(request: T, key: &'static str, value: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(request);
    let value = value.parse().expect("ASCII metadata");
    request.metadata_mut().insert(key, value);
    request
}

/// The replies of the coordinator at `url` to the gRPC generation `request`, admitted and
/// streamed to its end.
pub async fn generate_over_grpc(
    url: String,
    request: tonic::Request<v1::GenerateRequest>,
) -> Vec<v1::GenerateResponse> {
    let mut client = v1::coordinator_client::CoordinatorClient::connect(url)
        .await
        .expect("connect");
    let mut replies = client
        .generate(request)
        .await
        .expect("admitted")
        .into_inner();
    let mut all = Vec::new();
    while let Some(reply) = replies.message().await.expect("streamed") {
        all.push(reply);
    }
    all
}

/// `router` answers for `request`: its status, headers and body as JSON (Null if not JSON).
pub async fn call(
    router: &axum::Router,
    request: axum::http::Request<axum::body::Body>,
) -> (u16, axum::http::HeaderMap, serde_json::Value) {
    use tower::ServiceExt;
    let response = router.clone().oneshot(request).await.expect("infallible");
    let (status, headers) = (response.status().as_u16(), response.headers().clone());
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .expect("body");
    (
        status,
        headers,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    )
}

/// The JSON events of `router`'s streamed answer to `request` (not `[DONE]`).
pub async fn events(
    router: &axum::Router,
    request: axum::http::Request<axum::body::Body>,
) -> Vec<serde_json::Value> {
    use tower::ServiceExt;
    let response = router.clone().oneshot(request).await.expect("infallible");
    let body = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .expect("body");
    String::from_utf8_lossy(&body)
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// A POST of `body` as JSON to `path`.
pub fn post_json(path: &str, body: &serde_json::Value) -> axum::http::Request<axum::body::Body> {
    axum::http::Request::post(path)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body.to_string()))
        .expect("request")
}

/// The coordinator's HTTP API over `cluster` (K = 4 unless a request names one, patient with
/// draft steps: [`PATIENT`]), serving the model under `served_names`.
pub async fn router_over(cluster: &LocalCluster, served_names: Vec<String>) -> axum::Router {
    let engine = std::sync::Arc::new(patient_engine(cluster, 4).await);
    let state = tandem_coordinator::http::HttpState::new(
        tandem_coordinator::late_engine::LateEngine::ready(engine),
        Default::default(),
        served_names,
        SpecMetrics::None,
    );
    tandem_coordinator::http::router(state, tandem_coordinator::http::MetricsOn::Api)
}
