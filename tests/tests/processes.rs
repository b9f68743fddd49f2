//! The three real binaries as processes on loopback: the output of `coordinator generate`
//! (local all-in-one and against a running `coordinator serve`) equals target-only greedy, and a
//! generation survives the draft-node being killed.

use std::path::Path;
use std::process::Command;

use tandem_proto::v1;
use tandem_runtime::SamplingParams;
use tandem_tests::processes::{Proc, binary, free_addr};
use tandem_tests::*;

struct Nodes {
    target: Proc,
    draft: Proc,
    coordinator: Proc,
}

fn start_nodes(target: &Path, draft: &Path) -> Nodes {
    let node = |name: &str, model: &Path| {
        let addr = free_addr();
        let (model, listen) = (model.display().to_string(), addr.to_string());
        Proc::start(name, &["--model", &model, "--listen", &listen], addr)
    };
    let target = node("target-node", target);
    let draft = node("draft-node", draft);
    let addr = free_addr();
    let listen = addr.to_string();
    let coordinator = Proc::start(
        "coordinator",
        &[
            "serve",
            "--target",
            &target.url(),
            "--draft",
            &draft.url(),
            "--listen",
            &listen,
        ],
        addr,
    );
    Nodes {
        target,
        draft,
        coordinator,
    }
}

/// Runs `coordinator generate --json` with `args` and returns its token ids.
fn generate_cli(args: &[&str]) -> Vec<u32> {
    let out = Command::new(binary("coordinator"))
        .args(["generate", "--json", "--no-baseline", "--ignore-eos"])
        .args(args)
        .current_dir(fixtures().join(".."))
        .output()
        .expect("run coordinator generate");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    for key in [
        "generated_tokens",
        "rounds",
        "drafted",
        "accepted",
        "acceptance_rate",
        "mean_accepted_length",
        "tokens_per_second",
    ] {
        assert!(json["stats"][key].is_number(), "stats.{key} in {json}");
    }
    assert!(json["text"].is_string());
    json["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect()
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
            let ids = generate_cli(&[
                "--endpoint",
                &nodes.coordinator.url(),
                "--prompt",
                "Once upon a time",
                "--max-tokens",
                "40",
                "--draft-tokens",
                k,
            ]);
            assert_eq!(ids, expected, "K = {k}, target {}", target.display());
        }
        drop(nodes);
    }
}

#[test]
fn local_all_in_one_generate_equals_target_only() {
    let expected = target_only(&stories(), "Once upon a time", 60);
    for k in ["0", "4"] {
        let ids = generate_cli(&["--max-tokens", "60", "--draft-tokens", k]);
        assert_eq!(ids, expected, "K = {k}");
    }
}

#[tokio::test]
async fn killing_the_draft_node_mid_generation_costs_speed_not_output() {
    let mut nodes = start_nodes(&stories(), &stories_q8());
    let mut client = v1::coordinator_client::CoordinatorClient::connect(nodes.coordinator.url())
        .await
        .expect("connect");
    let prompt = tokenizer(&stories())
        .encode("Once upon a time")
        .expect("encode");
    let req = request(&prompt, 400, 4, &SamplingParams::greedy());
    let mut stream = client.generate(req).await.expect("generate").into_inner();
    let mut ids = Vec::new();
    let mut killed = false;
    let done = loop {
        match stream
            .message()
            .await
            .expect("stream")
            .expect("message")
            .kind
        {
            Some(v1::generate_response::Kind::Delta(d)) => {
                ids.extend(d.token_ids);
                if !killed {
                    nodes.draft.kill();
                    killed = true;
                }
            }
            Some(v1::generate_response::Kind::Done(done)) => break done,
            None => {}
        }
    };
    let stats = done.stats.expect("stats");
    assert!(
        stats.draft_lost,
        "the coordinator noticed the draft-node's loss"
    );
    assert_eq!(ids, target_only(&stories(), "Once upon a time", 400));
    assert_eq!(done.token_ids, ids);
    drop(nodes.target);
}

#[tokio::test]
async fn sigterm_lets_the_generation_in_flight_finish() {
    let nodes = start_nodes(&stories(), &stories_q8());
    let mut client = v1::coordinator_client::CoordinatorClient::connect(nodes.coordinator.url())
        .await
        .expect("connect");
    let prompt = tokenizer(&stories())
        .encode("Once upon a time")
        .expect("encode");
    let req = request(&prompt, 300, 4, &SamplingParams::greedy());
    let mut stream = client.generate(req).await.expect("generate").into_inner();
    let first = stream.message().await.expect("stream").expect("a delta");
    let mut ids = match first.kind {
        Some(v1::generate_response::Kind::Delta(d)) => d.token_ids,
        other => panic!("expected a delta, got {other:?}"),
    };
    let pid = nodes.coordinator.child.id().to_string();
    let sent = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(sent.success());
    let done = loop {
        match stream
            .message()
            .await
            .expect("the stream survives SIGTERM")
            .expect("message")
            .kind
        {
            Some(v1::generate_response::Kind::Delta(d)) => ids.extend(d.token_ids),
            Some(v1::generate_response::Kind::Done(done)) => break done,
            None => {}
        }
    };
    assert_eq!(ids.len(), 300);
    assert_eq!(done.token_ids, ids);
    assert_eq!(ids, target_only(&stories(), "Once upon a time", 300));
    let mut coordinator = nodes.coordinator;
    let status = tokio::task::spawn_blocking(move || coordinator.child.wait())
        .await
        .expect("join")
        .expect("wait");
    assert!(
        status.success(),
        "the coordinator exits cleanly after draining: {status}"
    );
}
