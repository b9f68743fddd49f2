//! Speculation across an emulated link: the three binaries as processes, the target-node pinned
//! to one core and the draft-node to the other (two machines on one; target-only runs pinned the
//! same way), the draft-node behind a link emulator (`tandem_tests::link`: one-way delay and a
//! bandwidth cap) as an edge box would be, the coordinator beside the target.
//!
//! Variants, alternated within each repetition: target-only (K = 0), the default (K chosen each
//! round), and fixed K; a `-serial` suffix (`4-serial`, `auto-serial`) turns off drafting during the
//! verify. Reported per pair and link: tokens/s, speedup over target-only (median of
//! the per-repetition ratios), acceptance, the rounds' split between the draft model, n-gram
//! lookup and the target alone, blocks drafted ahead during a verify and used (the pipeline's
//! hits), the mean K of drafted rounds, and bytes per round. Greedy outputs
//! are checked equal to target-only's.
//!
//! Environment: BENCH_REPS (default 3), BENCH_PAIRS (default `110m-q8_0`; also `stories260k`,
//! `qwen-prose`, `qwen-code`), BENCH_TOKENS (default: the pair's), BENCH_RTT_MS (default `0,5,20,50`), BENCH_MBIT (default `0,100,10`;
//! 0 is unlimited), BENCH_VARIANTS (default `target-only,auto,4,8`; a number is a fixed K,
//! `K+B` a token tree of K + B positions no deeper than K, `@C` after either the draft's chain
//! stopping below confidence C (`@0`: never early; without it the policy learns where),
//! `-serial` after any no drafting during the verify),
//! BENCH_DRAFTER (default `auto`), BENCH_TEMPERATURE (default 0, greedy), BENCH_CPUS (default
//! `0,1`: the target's and the draft's core), BENCH_TARGET_ARGS (more arguments of the
//! target-node, e.g. `--device cuda`).

use std::time::Duration;

use serde_json::json;
use tandem_proto::v1;
use tandem_proto::v1::coordinator_client::CoordinatorClient;
use tandem_runtime::SamplingParams;
use tandem_tests::bench::{env_list, env_parsed, env_usize, median, pairs, target_args};
use tandem_tests::link::{Link, LinkSpec};
use tandem_tests::processes::Proc;
use tandem_tests::tokenizer;

/// One variant's numbers over the repetitions.
#[derive(Default)]
struct Samples {
    tps: Vec<f64>,
    speedup: Vec<f64>,
    alpha: Vec<f64>,
    bytes_per_round: Vec<f64>,
    /// Committed tokens per round.
    tokens_per_round: Vec<f64>,
    rounds: [u32; 3],
    /// Blocks drafted ahead during a verify, and those used.
    pipeline: [u32; 2],
    /// Draft steps abandoned at their deadline, and draft-node sessions attached again.
    stalls: [u32; 2],
    drafted_k: Vec<f64>,
    /// Decode time outside the nodes' compute, per round (links, gRPC, the coordinator).
    outside_ms: Vec<f64>,
}

// The link's tasks run on a worker thread: the main one blocks while a process starts.
#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() -> anyhow::Result<()> {
    let reps = env_usize("BENCH_REPS", 3);
    let rtts: Vec<u64> = env_parsed("BENCH_RTT_MS", "0,5,20,50")?;
    let mbits: Vec<f64> = env_parsed("BENCH_MBIT", "0,100,10")?;
    let variants = env_list("BENCH_VARIANTS", "target-only,auto,4,8");
    let drafter = std::env::var("BENCH_DRAFTER").unwrap_or_else(|_| "auto".into());
    let temperature: f32 = std::env::var("BENCH_TEMPERATURE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.0);
    let cpus = env_list("BENCH_CPUS", "0,1");
    let (target_cpu, draft_cpu) = (cpus[0].clone(), cpus[cpus.len() - 1].clone());
    let scratch = tempfile::tempdir()?;
    let pairs = pairs(scratch.path(), &env_list("BENCH_PAIRS", "110m-q8_0"))?;
    let sampling = if temperature > 0.0 {
        SamplingParams {
            temperature,
            seed: 1,
            ..SamplingParams::default()
        }
    } else {
        SamplingParams::greedy()
    };
    println!(
        "| pair | link | variant | tok/s | speedup | tokens/round | α | rounds model / n-gram / target | drafted ahead / used | mean K drafted | bytes/round | outside nodes ms/round |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for pair in &pairs {
        let prompt = tokenizer(&pair.target).encode(pair.prompt)?;
        let extra = target_args();
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let target = Proc::node_on("target-node", &pair.target, &extra, Some(&target_cpu));
        let draft = Proc::node_on("draft-node", &pair.draft, &[], Some(&draft_cpu));
        for &rtt in &rtts {
            for &mbit in &mbits {
                let spec = LinkSpec {
                    rtt: Duration::from_millis(rtt),
                    bits_per_second: (mbit > 0.0).then_some(mbit * 1e6),
                };
                let link = Link::start(draft.addr, spec).await?;
                let draft_url = format!("http://{}", link.addr);
                // The coordinator sits beside the target, on its core.
                let coordinator = Proc::coordinator(
                    &target.url(),
                    &draft_url,
                    &Proc::NO_HISTORY,
                    Some(&target_cpu),
                );
                let mut client = CoordinatorClient::connect(coordinator.url()).await?;
                let request = |variant: &str| {
                    let (k, serial) = variant
                        .strip_suffix("-serial")
                        .map_or((variant, false), |k| (k, true));
                    // `K@C`: the chain stops below confidence C.
                    let (k, min_confidence) = k
                        .split_once('@')
                        .map_or((k, None), |(k, c)| (k, c.parse().ok()));
                    // `K+B`: a token tree of K + B nodes, no deeper than K.
                    let (k, branches) = k
                        .split_once('+')
                        .map_or((k, None), |(k, b)| (k, b.parse().ok()));
                    v1::GenerateRequest {
                        prompt_tokens: prompt.clone(),
                        max_tokens: pair.max_new_tokens as u32,
                        sampling: Some((&sampling).into()),
                        draft_tokens: match k {
                            "target-only" => Some(0),
                            "auto" => None,
                            k => Some(k.parse().expect("a variant is target-only, auto or K")),
                        },
                        draft_branches: branches,
                        draft_min_confidence: min_confidence,
                        drafter: drafter.clone(),
                        pipeline: serial.then_some(false),
                        ignore_eos: true,
                        ..Default::default()
                    }
                };
                // Warm-up: connections, page faults, the nodes' thread pools.
                tandem_coordinator::client::run(&mut client, request("auto"), |_| {}).await?;
                let mut samples: Vec<Samples> =
                    variants.iter().map(|_| Samples::default()).collect();
                for _ in 0..reps {
                    let mut baseline = None;
                    for (variant, s) in variants.iter().zip(samples.iter_mut()) {
                        let done =
                            tandem_coordinator::client::run(&mut client, request(variant), |_| {})
                                .await?;
                        let st = done.stats.unwrap_or_default();
                        if variant == "target-only" {
                            baseline = Some((st.tokens_per_second, done.token_ids.clone()));
                        } else if let Some((_, ids)) = &baseline
                            && temperature == 0.0
                        {
                            anyhow::ensure!(
                                &done.token_ids == ids,
                                "{variant}: greedy output differs from target-only"
                            );
                        }
                        let rounds = f64::from(st.rounds.max(1));
                        s.tps.push(st.tokens_per_second);
                        if let Some((base, _)) = &baseline {
                            s.speedup.push(st.tokens_per_second / base);
                        }
                        s.alpha.push(st.acceptance_rate);
                        s.outside_ms.push(1e3 * st.overhead_seconds() / rounds);
                        s.bytes_per_round
                            .push((st.bytes_sent + st.bytes_received) as f64 / rounds);
                        s.tokens_per_round
                            .push(done.token_ids.len() as f64 / rounds);
                        s.rounds[0] += st.model_rounds;
                        s.rounds[1] += st.ngram_rounds;
                        s.rounds[2] += st.target_only_rounds;
                        s.pipeline[0] += st.pipeline_rounds;
                        s.pipeline[1] += st.pipeline_hits;
                        s.stalls[0] += st.draft_stalls;
                        s.stalls[1] += st.draft_reattached;
                        let drafted_rounds = st.model_rounds + st.ngram_rounds;
                        if drafted_rounds > 0 {
                            s.drafted_k
                                .push(f64::from(st.drafted) / f64::from(drafted_rounds));
                        }
                    }
                }
                for (variant, s) in variants.iter().zip(samples) {
                    let row = json!({
                        "pair": pair.name, "link": spec.label(), "variant": variant,
                        "reps": reps, "drafter": drafter, "temperature": temperature,
                        "tokens_per_second": median(s.tps.clone()),
                        "speedup": median(s.speedup.clone()),
                        "acceptance_rate": median(s.alpha.clone()),
                        "rounds_model_ngram_target": s.rounds,
                        "drafted_ahead_used": s.pipeline,
                        "stalls_reattached": s.stalls,
                        "mean_k_drafted": median(s.drafted_k.clone()),
                        "bytes_per_round": median(s.bytes_per_round.clone()),
                        "tokens_per_round": median(s.tokens_per_round.clone()),
                        "outside_nodes_ms_per_round": median(s.outside_ms.clone()),
                    });
                    println!(
                        "| {} | {} | {variant} | {:.1} | {:.2}× | {:.2} | {:.2} | {} / {} / {} | {} / {} | {:.1} | {:.0} | {:.1} |",
                        pair.name,
                        spec.label(),
                        median(s.tps),
                        median(s.speedup),
                        median(s.tokens_per_round),
                        median(s.alpha),
                        s.rounds[0],
                        s.rounds[1],
                        s.rounds[2],
                        s.pipeline[0],
                        s.pipeline[1],
                        median(s.drafted_k),
                        median(s.bytes_per_round),
                        median(s.outside_ms),
                    );
                    eprintln!("{row}");
                }
                drop(coordinator);
            }
        }
    }
    Ok(())
}
