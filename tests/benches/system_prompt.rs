//! Many sessions sharing one system prompt (issue 30, item 5): the target-node, the draft-node
//! and the coordinator in this process (gRPC over loopback), N chat requests in ChatML whose
//! prompts are one system prompt of S tokens and a short question of their own. The first opens
//! alone (an agent's first call), the other N - 1 together once it has committed its first
//! token; all N are held open at their first commit while the nodes' KV memory is read: what
//! their sessions hold (`tandem_node_kv_cache_bytes`), what the prefix cache holds beyond that
//! (`tandem_node_prefix_cache_bytes`), and the process's resident memory grown since the models
//! were loaded. Then they finish; the answers are checked equal to target-only's.
//!
//! One case per run, so that resident memory is not what an earlier case left to the
//! allocator: BENCH_CACHE (`on` (default) or `off`), BENCH_SESSIONS (64), BENCH_SYSTEM_TOKENS
//! (1000), BENCH_PAIRS (`qwen` (default) or `stories260k`).

use std::sync::Arc;
use std::time::Instant;

use tandem_node::{LimitsArgs, NodeState};
use tandem_proto::v1;
use tandem_runtime::{SamplingParams, Tokenizer};
use tandem_tests::bench::{env_list, env_usize, median};
use tandem_tests::held::HeldAtFirstCommit;

/// Resident memory of this process, bytes.
fn rss() -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmRSS"))?;
    Ok(kib * 1024)
}

/// A system prompt of exactly `tokens` tokens: an agent's instructions, numbered.
fn system(tok: &Tokenizer, tokens: usize) -> anyhow::Result<Vec<u32>> {
    let mut text = String::from("<|im_start|>system\nYou are the billing team's assistant.\n");
    let mut i = 0;
    while tok.encode_raw(&text)?.len() < tokens {
        i += 1;
        text.push_str(&format!(
            "Rule {i}: when a customer asks about invoice line {i}, check the tax rate, the \
             discount and the currency before you answer, and cite the line number.\n"
        ));
    }
    let mut ids = tok.encode_raw(&text)?;
    ids.truncate(tokens);
    Ok(ids)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    tandem_runtime::init_cpu_threads();
    let cache = std::env::var("BENCH_CACHE").unwrap_or_else(|_| "on".into());
    let sessions = env_usize("BENCH_SESSIONS", 64).max(1);
    let system_tokens = env_usize("BENCH_SYSTEM_TOKENS", 1000);
    let pair = env_list("BENCH_PAIRS", "qwen").remove(0);
    let (target, draft) = match pair.as_str() {
        "stories260k" => (tandem_tests::stories(), tandem_tests::stories_q8()),
        _ => tandem_tests::qwen_pair("system prompt bench")
            .ok_or_else(|| anyhow::anyhow!("the Qwen pair is not fetched"))?,
    };
    let tok = Tokenizer::for_model(&target)?;
    let limits = LimitsArgs {
        prefix_cache_bytes: (cache == "off").then_some(0),
        max_sessions: 2 * sessions.max(64),
        ..LimitsArgs::default()
    };
    let cluster = tandem_tests::cluster(&target, Some(&draft), &limits).await;
    let engine = Arc::new(tandem_tests::patient_engine(&cluster, 4).await);
    let system = system(&tok, system_tokens)?;
    let requests: Vec<v1::GenerateRequest> = (0..sessions)
        .map(|i| {
            let question = format!(
                "<|im_end|>\n<|im_start|>user\nCustomer {i} asks: is line {i} taxed?<|im_end|>\n\
                 <|im_start|>assistant\n"
            );
            let mut prompt = system.clone();
            prompt.extend(tok.encode_raw(&question)?);
            Ok(v1::GenerateRequest {
                prompt_tokens: prompt,
                max_tokens: 16,
                sampling: Some((&SamplingParams::greedy()).into()),
                // Every token compared with target-only's (which does not stop at EOS).
                ignore_eos: true,
                ..Default::default()
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let before = rss()?;
    let start = Instant::now();
    let held = HeldAtFirstCommit::start_all(&engine, &requests).await;
    let all_open = start.elapsed();
    let draft_node = cluster
        .draft
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("a draft-node"))?;
    // The draft sessions open beside the target's; a draft open that took too long on a loaded
    // node was given up (the generation went on without it): counted, not waited for.
    let draft_sessions = draft_node.sessions.active();
    let grown = rss()?.saturating_sub(before);
    let memory = |n: &NodeState| {
        let (sessions, cached) = (n.sessions.kv_bytes() as u64, n.prefixes.bytes() as u64);
        (sessions, cached, n.metrics.prefix_cache_hits.get())
    };
    let (t, d) = (memory(&cluster.target), memory(draft_node));
    let per_position = [&cluster.target, draft_node].map(|n| {
        let probe = n.model.new_cache();
        probe.bytes_per_position() as u64
    });
    let first_commits: Vec<f64> = held
        .iter()
        .map(|h| h.first_commit.as_secs_f64() * 1e3)
        .collect();
    let mut answers = Vec::new();
    for h in held {
        answers.push(h.finish().await.token_ids);
    }
    let total = start.elapsed();
    let opened = cluster.target.metrics.sessions_opened.get();
    // Target-only, alone, for a few of them (the first, a middle one and the last).
    for i in [0, sessions / 2, sessions - 1] {
        let alone = tandem_tests::in_process(&target, None, &{
            let mut req = requests[i].clone();
            req.draft_tokens = Some(0);
            req
        });
        anyhow::ensure!(
            alone.token_ids == answers[i],
            "session {i}: the answer differs from target-only's"
        );
    }
    let copies = sessions as u64 * system.len() as u64;
    println!(
        "{pair}, cache {cache}: {sessions} sessions, a system prompt of {} tokens, prompts of {}–{} tokens",
        system.len(),
        requests
            .iter()
            .map(|r| r.prompt_tokens.len())
            .min()
            .unwrap_or(0),
        requests
            .iter()
            .map(|r| r.prompt_tokens.len())
            .max()
            .unwrap_or(0),
    );
    println!(
        "| node | sessions hold | prefix cache beyond | together | {sessions} copies of the system prompt would be | cache hits (tokens) |"
    );
    println!("|---|---|---|---|---|---|");
    for (name, (s, c, hits), per) in [
        ("target", t, per_position[0]),
        ("draft", d, per_position[1]),
    ] {
        println!(
            "| {name} | {} | {} | {} | {} | {hits} |",
            mib(s),
            mib(c),
            mib(s + c),
            mib(copies * per)
        );
    }
    println!("resident memory grown while all were open: {}", mib(grown));
    println!(
        "target sessions opened: {opened}; draft sessions open while measured: {draft_sessions}"
    );
    println!(
        "first commit: first session {:.0} ms, median of all {:.0} ms; all {sessions} open after {:.1} s, all done after {:.1} s",
        first_commits[0],
        median(first_commits.clone()),
        all_open.as_secs_f64(),
        total.as_secs_f64()
    );
    Ok(())
}
