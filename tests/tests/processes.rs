//! The three real binaries as processes on loopback: the output of `coordinator generate`
//! (local all-in-one and against a running `coordinator serve`) and of `coordinator serve` with
//! both models in its process equals target-only greedy, and a generation survives the
//! draft-node being killed.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use tandem_proto::v1;
use tandem_runtime::SamplingParams;
use tandem_tests::faults::FaultProxy;
use tandem_tests::gate::{Gate, with_fault};
use tandem_tests::link::{Link, LinkSpec};
use tandem_tests::processes::{Proc, generate_cli};
use tandem_tests::*;

struct Nodes {
    /// Kept to keep the process alive (killed on drop).
    _target: Proc,
    draft: Proc,
    coordinator: Proc,
    /// The HTTP ports (metrics, health) of target, draft and coordinator.
    http: [SocketAddr; 3],
}

/// Node `name` serving `model`, with its HTTP side.
fn start_node(name: &str, model: &Path) -> Proc {
    Proc::node(name, model, &["--http-listen", "127.0.0.1:0"])
}

/// A target-node and a draft-node, and a coordinator talking to them at these URLs.
fn nodes_at(target: Proc, target_url: &str, draft: Proc, draft_url: &str) -> Nodes {
    let coordinator = Proc::coordinator(
        target_url,
        draft_url,
        &["--http-listen", "127.0.0.1:0"],
        None,
    );
    Nodes {
        http: [target.http(), draft.http(), coordinator.http()],
        _target: target,
        draft,
        coordinator,
    }
}

fn start_nodes(target: &Path, draft: &Path) -> Nodes {
    let target = start_node("target-node", target);
    let draft = start_node("draft-node", draft);
    let (target_url, draft_url) = (target.url(), draft.url());
    nodes_at(target, &target_url, draft, &draft_url)
}

/// Nodes for a fault mid-generation: the stories pair, the target-node behind a gate that holds
/// a verify block of the generation while the fault is injected, the draft-node behind a link
/// that follows it when it is restarted elsewhere.
struct Gated {
    nodes: Nodes,
    gate: Gate,
    draft_link: Link,
}

async fn start_gated() -> Gated {
    let target = start_node("target-node", &stories());
    let proxy = FaultProxy::passing(target.addr);
    let target_url = proxy.clone().serve().await;
    let draft = start_node("draft-node", &stories_q8());
    let draft_link = Link::start(draft.addr, LinkSpec::DIRECT)
        .await
        .expect("link");
    Gated {
        nodes: nodes_at(target, &target_url, draft, &draft_link.url()),
        gate: proxy.gate,
        draft_link,
    }
}

fn target_only(target: &Path, prompt: &str, n: u32) -> Vec<u32> {
    let ids = tokenizer(target).encode(prompt).expect("encode");
    in_process(
        target,
        None,
        &request(&ids, n, 0, &SamplingParams::greedy()),
    )
    .token_ids
}

#[test]
fn three_processes_generate_target_only_greedy_output() {
    for (target, draft) in [
        (stories(), stories_q8()),
        (random_model(11), random_model(12)),
    ] {
        let nodes = start_nodes(&target, &draft);
        let expected = target_only(&target, "Once upon a time", 40);
        for k in ["1", "4", "8"] {
            let ids = generate_cli(
                &[
                    "--endpoint",
                    &nodes.coordinator.url(),
                    "--prompt",
                    "Once upon a time",
                    "--max-tokens",
                    "40",
                    "--draft-tokens",
                    k,
                ],
                &[],
            );
            assert_eq!(ids, expected, "K = {k}, target {}", target.display());
        }
        drop(nodes);
    }
}

#[test]
fn local_all_in_one_generate_equals_target_only() {
    let expected = target_only(&stories(), "Once upon a time", 60);
    for k in ["0", "4"] {
        let ids = generate_cli(&["--max-tokens", "60", "--draft-tokens", k], &[]);
        assert_eq!(ids, expected, "K = {k}");
    }
}

/// `coordinator serve --target-model --draft-model`: one machine serving both models from one
/// process; sessions at once, drafted by the model (K = 4) or adaptive, each get their prompt's
/// target-only output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process_serving_both_models_gives_each_session_target_only_output() {
    let (target, draft) = (stories(), stories_q8());
    let coordinator = Proc::coordinator_serving(&target, &draft, &[]);
    let prompts = ["Once upon a time", "The little dog ran", "Tom and Sue went"];
    let expected = prompts.map(|p| target_only(&target, p, 48));
    let client = v1::coordinator_client::CoordinatorClient::connect(coordinator.url())
        .await
        .expect("connect");
    let sessions: Vec<_> = (0..8)
        .map(|i| {
            let mut client = client.clone();
            let prompt = tokenizer(&target).encode(prompts[i % 3]).expect("encode");
            let mut req = request(&prompt, 48, 4, &SamplingParams::greedy());
            // Half adaptive, half drafting 4 a round.
            req.draft_tokens = (i % 2 == 0).then_some(4);
            tokio::spawn(
                async move { tandem_coordinator::client::run(&mut client, req, |_| {}).await },
            )
        })
        .collect();
    for (i, session) in sessions.into_iter().enumerate() {
        let done = session.await.expect("join").expect("generated");
        assert_eq!(done.token_ids, expected[i % 3], "session {i}");
        if i % 2 == 0 {
            let stats = done.stats.expect("stats");
            assert!(stats.drafted > 0, "session {i} drafted nothing: {stats:?}");
        }
    }
}

/// The models served in-process and node URLs are one or the other, and a draft model needs
/// its target: refused before anything loads, naming the option.
#[test]
fn serving_models_in_process_refuses_a_half_or_mixed_setup() {
    let draft = stories_q8().display().to_string();
    let target = stories().display().to_string();
    for (args, names) in [
        (vec!["--draft-model", draft.as_str()], "--target-model"),
        (
            vec![
                "--target-model",
                target.as_str(),
                "--target",
                "http://127.0.0.1:1",
            ],
            "--target",
        ),
    ] {
        let out = Command::new(tandem_tests::processes::binary("coordinator"))
            .arg("serve")
            .args(&args)
            .output()
            .expect("run the coordinator");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(names), "{args:?}: {stderr}");
    }
}

#[test]
fn local_generate_follows_a_json_schema_for_every_k() {
    let schema = r#"{"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["name", "age"], "additionalProperties": false}"#;
    let run = |k: &str| {
        generate_cli(
            &[
                "--max-tokens",
                "60",
                "--draft-tokens",
                k,
                "--json-schema",
                schema,
            ],
            &[],
        )
    };
    let alone = run("0");
    assert_eq!(run("4"), alone, "K = 4");
    // With --ignore-eos the grammar, once complete, allows only the end of sequence, which
    // decoding skips.
    let text = tokenizer(&stories()).decode(&alone).expect("decode");
    let doc: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(
        doc["age"].as_i64().is_some_and(|a| (1..=99).contains(&a)),
        "{text}"
    );
    assert!(
        doc["name"]
            .as_str()
            .is_some_and(|n| n.chars().count() <= 10),
        "{text}"
    );
}

/// A greedy story of `n` tokens, drafted 4 at a time.
fn story(n: u32) -> v1::GenerateRequest {
    let prompt = tokenizer(&stories())
        .encode("Once upon a time")
        .expect("encode");
    request(&prompt, n, 4, &SamplingParams::greedy())
}

/// Streams [`story`]`(n)` from `g`'s coordinator with `fault` injected mid-generation.
async fn generate_with(
    g: &mut Gated,
    n: u32,
    fault: impl AsyncFnOnce(&mut Nodes),
) -> (Vec<u32>, v1::GenerateDone) {
    let url = g.nodes.coordinator.url();
    let nodes = &mut g.nodes;
    let (ids, done) = with_fault(&url, story(n), &g.gate, async || fault(nodes).await).await;
    (ids, done.expect("the stream goes on"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_draft_node_mid_generation_costs_speed_not_output() {
    let mut g = start_gated().await;
    let (ids, done) = generate_with(&mut g, 400, async |n| n.draft.kill()).await;
    let stats = done.stats.expect("stats");
    assert!(
        stats.draft_lost,
        "the coordinator noticed the draft-node's loss"
    );
    assert_eq!(ids, target_only(&stories(), "Once upon a time", 400));
    assert_eq!(done.token_ids, ids);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_the_generation_in_flight_finish() {
    let mut g = start_gated().await;
    let (ids, done) = generate_with(&mut g, 300, async |n| {
        let pid = n.coordinator.child.id().to_string();
        let sent = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill");
        assert!(sent.success());
        // Draining: it has stopped taking connections, the generation still held in flight.
        let http = n.http[2];
        assert!(
            eventually(async || tokio::net::TcpStream::connect(http).await.is_err()).await,
            "the coordinator stops listening on SIGTERM{}",
            n.coordinator.stderr_tail()
        );
    })
    .await;
    assert_eq!(ids.len(), 300);
    assert_eq!(done.token_ids, ids);
    assert_eq!(ids, target_only(&stories(), "Once upon a time", 300));
    let mut coordinator = g.nodes.coordinator;
    let status = tokio::task::spawn_blocking(move || coordinator.child.wait())
        .await
        .expect("join")
        .expect("wait");
    assert!(
        status.success(),
        "the coordinator exits cleanly after draining: {status}"
    );
}

/// Every sample of a Prometheus text page, parsed by the reference parser (prometheus_client):
/// `name{label="v",...}` → value.
fn parse_metrics(text: &str) -> std::collections::HashMap<String, f64> {
    let samples = reference_parser(
        text,
        "print(json.dumps({s.name + json.dumps(s.labels, sort_keys=True): s.value \
                  for f in p(sys.stdin.read()) for s in f.samples}))",
    );
    let samples = samples.as_object().expect("samples by name");
    samples
        .iter()
        .map(|(k, v)| (k.clone(), v.as_f64().expect("a sample's value")))
        .collect()
}

/// The metric families of a Prometheus text page, parsed by the reference parser, named as
/// docs/metrics.md names them (a counter with its `_total`).
fn families(text: &str) -> std::collections::HashSet<String> {
    let names = reference_parser(
        text,
        "print(json.dumps([f.name + ('_total' if f.type == 'counter' else '') \
                  for f in p(sys.stdin.read())]))",
    );
    let names = names.as_array().expect("family names");
    names
        .iter()
        .map(|n| n.as_str().expect("a name").to_string())
        .collect()
}

/// `text` parsed by Prometheus' reference parser (prometheus_client's, as `p`), what `print`
/// writes as JSON.
fn reference_parser(text: &str, print: &str) -> serde_json::Value {
    let python = tandem_tests::python::python_with(&[("prometheus_client", "prometheus-client")]);
    let script = format!(
        "import sys, json\nfrom prometheus_client.parser import text_string_to_metric_families as p\n{print}"
    );
    let mut child = Command::new(python)
        .args(["-c", &script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python");
    use std::io::Write;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("parse");
    assert!(out.status.success(), "not Prometheus text:\n{text}");
    serde_json::from_slice(&out.stdout).expect("json")
}

/// The metric names docs/metrics.md documents: the coordinator's, then the nodes'.
fn documented() -> (Vec<String>, Vec<String>) {
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/metrics.md"),
    )
    .expect("docs/metrics.md");
    let (coordinator, nodes) = doc
        .split_once("## Target-node and draft-node")
        .expect("a section for the nodes");
    let names = |section: &str| -> Vec<String> {
        section
            .lines()
            .filter_map(|l| l.strip_prefix("| `tandem_"))
            .filter_map(|rest| rest.split_once('`'))
            .map(|(name, _)| format!("tandem_{name}"))
            .collect()
    };
    (names(coordinator), names(nodes))
}

async fn page(addr: SocketAddr) -> String {
    let (status, body) = http_request(addr, "GET", "/metrics", "").await;
    assert_eq!(status, 200);
    body
}

async fn scrape(addr: SocketAddr) -> std::collections::HashMap<String, f64> {
    let (status, body) = http_request(addr, "GET", "/metrics", "").await;
    assert_eq!(status, 200);
    tokio::task::spawn_blocking(move || parse_metrics(&body))
        .await
        .expect("join")
}

fn get(m: &std::collections::HashMap<String, f64>, key: &str) -> f64 {
    *m.get(key).unwrap_or_else(|| panic!("no sample {key}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_on_every_node_move_by_what_a_request_did() {
    let nodes = start_nodes(&stories(), &stories_q8());
    let before: Vec<_> = futures_scrape(&nodes).await;
    let mut client = v1::coordinator_client::CoordinatorClient::connect(nodes.coordinator.url())
        .await
        .expect("connect");
    let prompt = tokenizer(&stories())
        .encode("Once upon a time")
        .expect("encode");
    let req = request(&prompt, 50, 4, &SamplingParams::greedy());
    let done = tandem_coordinator::client::run(&mut client, req, |_| {})
        .await
        .expect("generate");
    let st = done.stats.expect("stats");
    let after: Vec<_> = futures_scrape(&nodes).await;
    let delta =
        |i: usize, key: &str| get(&after[i], key) - before[i].get(key).copied().unwrap_or(0.0);
    let (t, d, c) = (0, 1, 2);
    assert_eq!(delta(c, "tandem_requests_total{}"), 1.0);
    assert_eq!(
        delta(c, "tandem_prompt_tokens_total{}"),
        prompt.len() as f64
    );
    assert_eq!(delta(c, "tandem_generation_tokens_total{}"), 50.0);
    assert_eq!(
        delta(
            c,
            "tandem_request_success_total{\"finished_reason\": \"length\"}"
        ),
        1.0
    );
    assert_eq!(
        delta(c, "tandem_spec_decode_num_draft_tokens_total{}"),
        f64::from(st.drafted)
    );
    assert_eq!(
        delta(c, "tandem_spec_decode_num_accepted_tokens_total{}"),
        f64::from(st.accepted)
    );
    let drafted_rounds = st.model_rounds + st.ngram_rounds;
    assert_eq!(
        delta(c, "tandem_spec_decode_num_drafts_total{}"),
        f64::from(drafted_rounds)
    );
    // Rounds by who drafted them (a drafter with no round has no sample).
    let by = |drafter: &str| {
        let key = format!("tandem_rounds_total{{\"drafter\": \"{drafter}\"}}");
        after[c].get(&key).copied().unwrap_or(0.0) - before[c].get(&key).copied().unwrap_or(0.0)
    };
    assert_eq!(by("model"), f64::from(st.model_rounds));
    assert_eq!(by("ngram"), f64::from(st.ngram_rounds));
    assert_eq!(by("none"), f64::from(st.target_only_rounds));
    assert_eq!(
        delta(c, "tandem_round_seconds_count{}"),
        f64::from(st.rounds)
    );
    assert_eq!(
        delta(c, "tandem_round_part_seconds_count{\"part\": \"verify\"}"),
        f64::from(st.rounds)
    );
    assert_eq!(
        delta(
            c,
            "tandem_spec_decode_num_draft_tokens_per_pos_total{\"position\": \"1\"}"
        ),
        f64::from(drafted_rounds)
    );
    assert!(
        get(
            &after[c],
            "tandem_spec_decode_num_accepted_tokens_per_pos_total{\"position\": \"1\"}"
        ) > 0.0
    );
    // One first token, and one latency for each token after the first commit (which holds at
    // most K + 1 = 5 of the 50).
    assert_eq!(delta(c, "tandem_time_to_first_token_seconds_count{}"), 1.0);
    let later = delta(c, "tandem_inter_token_latency_seconds_count{}");
    assert!((45.0..=49.0).contains(&later), "{later}");
    assert_eq!(delta(c, "tandem_e2e_request_latency_seconds_count{}"), 1.0);
    assert_eq!(delta(c, "tandem_request_prefill_time_seconds_count{}"), 1.0);
    assert_eq!(delta(c, "tandem_request_queue_time_seconds_count{}"), 1.0);
    assert_eq!(
        delta(c, "tandem_wire_bytes_total{\"direction\": \"sent\"}"),
        st.bytes_sent as f64
    );
    assert_eq!(get(&after[c], "tandem_num_requests_running{}"), 0.0);
    assert_eq!(get(&after[c], "tandem_num_requests_waiting{}"), 0.0);
    assert_eq!(
        delta(d, "tandem_node_tokens_total{}"),
        f64::from(st.draft_node_tokens)
    );
    assert_eq!(delta(d, "tandem_node_sessions_opened_total{}"), 1.0);
    assert_eq!(
        delta(t, "tandem_node_tokens_total{}"),
        f64::from(st.accepted + st.rounds)
    );
    assert_eq!(
        delta(t, "tandem_node_requests_total{}"),
        f64::from(st.rounds)
    );
    assert_eq!(
        delta(t, "tandem_node_compute_seconds_count{}"),
        f64::from(st.rounds)
    );
    for i in [t, d] {
        assert!(
            eventually(
                async || scrape(nodes.http[i]).await["tandem_node_sessions_active{}"] == 0.0
            )
            .await
        );
        let page = scrape(nodes.http[i]).await;
        assert!(page["tandem_node_kv_cache_budget_bytes{}"] > 0.0);
        assert_eq!(page["tandem_node_kv_cache_usage_perc{}"], 0.0);
    }
    // A refused request is counted by its code.
    let bad = request(&[], 5, 4, &SamplingParams::greedy());
    assert!(
        tandem_coordinator::client::run(&mut client, bad, |_| {})
            .await
            .is_err()
    );
    assert_eq!(
        get(
            &scrape(nodes.http[c]).await,
            "tandem_errors_total{\"kind\": \"InvalidArgument\"}"
        ),
        1.0
    );
    // The round trip to each node, measured in the background (an Info call every 5 s).
    for node in ["target-node", "draft-node"] {
        let label = format!("\"node\": \"{node}\"");
        let measured = async || {
            scrape(nodes.http[c]).await.iter().any(|(k, &s)| {
                k.starts_with("tandem_link_rtt_seconds{")
                    && k.contains(&label)
                    && s > 0.0
                    && s < 10.0
            })
        };
        assert!(eventually(measured).await, "a round trip to the {node}");
    }
    // Every name docs/metrics.md documents is on the page it says (a labelled counter once it
    // has a series: the error above gave the coordinator's errors one).
    let (coordinator_names, node_names) = documented();
    assert!(coordinator_names.len() > 20 && node_names.len() > 10);
    for (i, names) in [(c, &coordinator_names), (t, &node_names), (d, &node_names)] {
        let body = page(nodes.http[i]).await;
        let found = tokio::task::spawn_blocking(move || families(&body))
            .await
            .expect("join");
        for name in names {
            assert!(
                found.contains(name),
                "{name} is documented but not served: {found:?}"
            );
        }
    }
}

async fn futures_scrape(nodes: &Nodes) -> Vec<std::collections::HashMap<String, f64>> {
    let mut out = Vec::new();
    for addr in nodes.http {
        out.push(scrape(addr).await);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draft_node_restarted_after_a_crash_drafts_again() {
    let mut g = start_gated().await;
    let (_, done) = generate_with(&mut g, 200, async |n| n.draft.kill()).await;
    assert!(done.stats.expect("stats").draft_lost);
    // The same machine back (at the address its clients know): the next sessions use it.
    g.nodes.draft = start_node("draft-node", &stories_q8());
    g.draft_link.point_to(g.nodes.draft.addr);
    let (ids, done) = stream(g.nodes.coordinator.url(), story(100)).await;
    let stats = done.expect("generated").stats.expect("stats");
    assert!(!stats.draft_lost, "{}", stats.draft_lost_reason);
    assert!(stats.model_rounds > 0, "drafting resumed: {stats:?}");
    assert_eq!(ids, target_only(&stories(), "Once upon a time", 100));
}
