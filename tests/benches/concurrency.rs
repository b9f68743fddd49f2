//! Many sessions on one target: the three binaries as processes on loopback, N generations at
//! once through one coordinator, with the target-node batching the verify blocks of the
//! sessions ready together (continuous batching, the default) and, in the same run, alternating,
//! a second target-node that runs them one at a time (`--max-batch 1`, the behaviour before).
//!
//! Reported per N and variant: aggregate tokens/s (all sessions' tokens over the wall time from
//! the first request to the last answer), its ratio to one session alone, and p50/p99 of the time
//! between two streamed commits of a session (a round as its client sees it), and the draft steps
//! abandoned at their deadline (a loaded draft-node answers late). Every greedy
//! output is checked equal to the same request alone.
//!
//! Environment: BENCH_REPS (default 1), BENCH_PAIRS (default `110m-q8_0`), BENCH_SESSIONS
//! (default `1,4,8,16,64`), BENCH_VARIANTS (default `target-only,auto,4`: K = 0, K chosen
//! each round, or a fixed K; a `-serial` suffix: no drafting ahead during the verify),
//! BENCH_BATCH (default `64,1`: the target-nodes' --max-batch; `N:W` adds --batch-wait-us W),
//! BENCH_TOKENS (default 64),
//! BENCH_ONE_PROCESS (default none: `N[:W]` values as BENCH_BATCH's, each a setup with both
//! models in one `coordinator serve --target-model --draft-model` process, its cores shared
//! through the process's one CPU pool; BENCH_BATCH may then be empty: no three-process setup),
//! BENCH_CPUS (unset: every process on every core; `T,D`: the target-nodes pinned to CPUs `T`,
//! the draft-node and the coordinator to `D`, two machines emulated on one),
//! BENCH_TARGET_ARGS (more arguments of the target-nodes, e.g. `--device cuda`).

use std::time::{Duration, Instant};

use serde_json::json;
use tandem_proto::v1;
use tandem_proto::v1::coordinator_client::CoordinatorClient;
use tandem_runtime::SamplingParams;
use tandem_tests::bench::{env_list, env_parsed, median, pairs, target_args};
use tandem_tests::processes::Proc;
use tandem_tests::tokenizer;

const PROMPTS: [&str; 4] = [
    "Once upon a time",
    "The little dog ran to the park",
    "Tom and Sue went",
    "One day, a girl named Lily",
];

/// The `q`-quantile of `xs` (nearest rank).
fn quantile(mut xs: Vec<f64>, q: f64) -> f64 {
    xs.sort_by(f64::total_cmp);
    let i = ((xs.len() as f64 * q).ceil() as usize).clamp(1, xs.len().max(1)) - 1;
    xs.get(i).copied().unwrap_or(f64::NAN)
}

/// One wave of `n` concurrent generations.
struct Wave {
    tokens_per_second: f64,
    /// The gaps between two commits of a session, in seconds.
    gaps: Vec<f64>,
    outputs: Vec<Vec<u32>>,
    /// Draft steps abandoned at their deadline, over all sessions.
    stalls: u32,
}

async fn wave(
    client: &CoordinatorClient<tonic::transport::Channel>,
    requests: Vec<v1::GenerateRequest>,
) -> anyhow::Result<Wave> {
    let start = Instant::now();
    let tasks: Vec<_> = requests
        .into_iter()
        .map(|request| {
            let mut client = client.clone();
            tokio::spawn(async move {
                let mut gaps = Vec::new();
                let mut last = Instant::now();
                let done = tandem_coordinator::client::run(&mut client, request, |_| {
                    gaps.push(last.elapsed().as_secs_f64());
                    last = Instant::now();
                })
                .await;
                // The first gap holds the prefill: not a round.
                gaps.remove(0);
                done.map(|d| (gaps, d.token_ids, d.stats.unwrap_or_default().draft_stalls))
            })
        })
        .collect();
    let mut w = Wave {
        tokens_per_second: 0.0,
        gaps: Vec::new(),
        outputs: Vec::new(),
        stalls: 0,
    };
    for task in tasks {
        let (gaps, ids, stalls) = task.await??;
        w.gaps.extend(gaps);
        w.outputs.push(ids);
        w.stalls += stalls;
    }
    let tokens: usize = w.outputs.iter().map(Vec::len).sum();
    w.tokens_per_second = tokens as f64 / start.elapsed().as_secs_f64();
    Ok(w)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let reps: usize = env_parsed("BENCH_REPS", "1")?[0];
    let sessions = env_parsed::<usize>("BENCH_SESSIONS", "1,4,8,16,64")?;
    let batches = env_list("BENCH_BATCH", "64,1");
    let one_process = env_list("BENCH_ONE_PROCESS", "");
    let tokens: usize = env_parsed("BENCH_TOKENS", "64")?[0];
    let variants = env_list("BENCH_VARIANTS", "target-only,auto,4");
    let target_args = target_args();
    let cpus: Vec<String> = std::env::var("BENCH_CPUS")
        .map(|v| v.split(',').map(str::to_string).collect())
        .unwrap_or_default();
    anyhow::ensure!(
        cpus.is_empty() || cpus.len() == 2,
        "BENCH_CPUS: `T,D` (the target's CPUs, the draft's)"
    );
    let scratch = tempfile::tempdir()?;
    let pairs = pairs(scratch.path(), &env_list("BENCH_PAIRS", "110m-q8_0"))?;
    println!(
        "| pair | sessions | variant | max batch | aggregate tok/s | × one session | round p50 ms | round p99 ms | draft stalls |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for pair in &pairs {
        let tok = tokenizer(&pair.target);
        let prompts: Vec<Vec<u32>> = PROMPTS
            .iter()
            .map(|p| tok.encode(p))
            .collect::<Result<_, _>>()?;
        let (target_cpus, draft_cpus) = match cpus.as_slice() {
            [t, d] => (Some(t.as_str()), Some(d.as_str())),
            _ => (None, None),
        };
        let draft = (!batches.is_empty())
            .then(|| Proc::node_on("draft-node", &pair.draft, &[], draft_cpus));
        // `N[:W]`: --max-batch N [--batch-wait-us W], after `args`.
        let batching = |mut args: Vec<String>, max_batch: &str| {
            args.push("--max-batch".into());
            match max_batch.split_once(':') {
                Some((batch, wait)) => {
                    args.extend([batch, "--batch-wait-us", wait].map(String::from))
                }
                None => args.push(max_batch.into()),
            }
            args
        };
        // (label, processes kept running, the coordinator's client)
        let mut setups = Vec::new();
        for max_batch in &batches {
            let args = batching(target_args.clone(), max_batch);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let target = Proc::node_on("target-node", &pair.target, &args, target_cpus);
            let draft = draft.as_ref().expect("started with the first setup");
            let coordinator =
                Proc::coordinator(&target.url(), &draft.url(), &Proc::NO_HISTORY, draft_cpus);
            let client = CoordinatorClient::connect(coordinator.url()).await?;
            setups.push((max_batch.clone(), vec![target, coordinator], client));
        }
        for max_batch in &one_process {
            let args = batching(target_args.clone(), max_batch);
            let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
            args.extend(Proc::NO_HISTORY);
            let coordinator = Proc::coordinator_serving(&pair.target, &pair.draft, &args);
            let client = CoordinatorClient::connect(coordinator.url()).await?;
            setups.push((
                format!("{max_batch} one process"),
                vec![coordinator],
                client,
            ));
        }
        anyhow::ensure!(
            !setups.is_empty(),
            "BENCH_BATCH and BENCH_ONE_PROCESS both empty"
        );
        let request = |i: usize, variant: &str| v1::GenerateRequest {
            prompt_tokens: prompts[i % prompts.len()].clone(),
            max_tokens: tokens as u32,
            sampling: Some((&SamplingParams::greedy()).into()),
            draft_tokens: match variant.trim_end_matches("-serial") {
                "target-only" => Some(0),
                "auto" => None,
                k => Some(
                    k.parse()
                        .expect("a variant is target-only, auto or K[-serial]"),
                ),
            },
            // `-serial`: no drafting ahead during the verify.
            pipeline: variant.ends_with("-serial").then_some(false),
            ignore_eos: true,
            ..Default::default()
        };
        // Each prompt alone, target-only: what every session must reproduce; and a warm-up.
        let solo = wave(
            &setups[0].2,
            (0..prompts.len())
                .map(|i| request(i, "target-only"))
                .collect(),
        )
        .await?
        .outputs;
        let mut alone: Vec<Vec<f64>> = vec![Vec::new(); variants.len() * setups.len()];
        for &n in &sessions {
            let mut samples: Vec<(Vec<f64>, Vec<f64>, u32)> =
                vec![(Vec::new(), Vec::new(), 0); variants.len() * setups.len()];
            for _ in 0..reps {
                for (v, variant) in variants.iter().enumerate() {
                    for (b, (_, _, client)) in setups.iter().enumerate() {
                        let requests = (0..n).map(|i| request(i, variant)).collect();
                        let w = wave(client, requests).await?;
                        for (i, out) in w.outputs.iter().enumerate() {
                            anyhow::ensure!(
                                *out == solo[i % prompts.len()],
                                "{n} sessions, {variant}: session {i}'s output differs from alone"
                            );
                        }
                        let s = &mut samples[v * setups.len() + b];
                        s.0.push(w.tokens_per_second);
                        s.1.extend(w.gaps);
                        s.2 += w.stalls;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            for (v, variant) in variants.iter().enumerate() {
                for (b, (max_batch, ..)) in setups.iter().enumerate() {
                    let (tps, gaps, stalls) = &samples[v * setups.len() + b];
                    let tps = median(tps.clone());
                    if n == 1 {
                        alone[v * setups.len() + b].push(tps);
                    }
                    let one = alone[v * setups.len() + b]
                        .first()
                        .copied()
                        .unwrap_or(f64::NAN);
                    let (p50, p99) = (quantile(gaps.clone(), 0.5), quantile(gaps.clone(), 0.99));
                    println!(
                        "| {} | {n} | {variant} | {max_batch} | {tps:.1} | {:.2} | {:.1} | {:.1} | {stalls} |",
                        pair.name,
                        tps / one,
                        1e3 * p50,
                        1e3 * p99
                    );
                    eprintln!(
                        "{}",
                        json!({
                            "pair": pair.name, "sessions": n, "variant": variant,
                            "max_batch": max_batch, "reps": reps, "tokens": tokens,
                            "aggregate_tokens_per_second": tps, "over_one_session": tps / one,
                            "round_p50_ms": 1e3 * p50, "round_p99_ms": 1e3 * p99, "draft_stalls": stalls,
                        })
                    );
                }
            }
        }
    }
    Ok(())
}
