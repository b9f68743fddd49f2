//! Distributed over loopback gRPC against in-process speculative decoding, same pair and K,
//! and target-only for the speedup. The variants run alternately, `BENCH_REPS` times each;
//! medians are reported as a table and one JSON object per line.
//!
//! Pairs: stories260K (f32) / its Q8_0 copy (tiny: shows the per-round overhead), and a
//! random-weight model of the stories110M shape (768 × 12 layers × 32k vocab, f32) / its own
//! Q8_0 copy (realistic cost).
//!
//! Environment: BENCH_REPS (default 5), BENCH_PAIRS (`stories260k`, `110m-q8_0`; default both),
//! BENCH_K (default `4,8`).

use serde_json::json;
use tandem_node::LimitsArgs;
use tandem_runtime::SamplingParams;
use tandem_tests::bench::{env_list, ks, median, pairs, reps};
use tandem_tests::{cluster, generate, in_process_with, load, request, tokenizer};

#[derive(Default)]
struct Samples {
    base_tps: Vec<f64>,
    local_tps: Vec<f64>,
    dist_tps: Vec<f64>,
    dist_over_local: Vec<f64>,
    speedup: Vec<f64>,
    extra_us: Vec<f64>,
    outside_us: Vec<f64>,
    bytes: Vec<f64>,
    alpha: f64,
    len: f64,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    tandem_runtime::init_cpu_threads();
    let (reps, ks) = (reps(), ks()?);
    let scratch = tempfile::tempdir()?;
    let pairs = pairs(
        scratch.path(),
        &env_list("BENCH_PAIRS", "stories260k,110m-q8_0"),
    )?;
    println!(
        "| pair | K | target-only t/s | in-process t/s | distributed t/s | dist / in-process | speedup (dist) | α | len | extra µs/round | outside nodes µs/round | bytes/round |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for pair in &pairs {
        let (target, draft) = (load(&pair.target), load(&pair.draft));
        let tok = tokenizer(&pair.target);
        let cluster = cluster(&pair.target, Some(&pair.draft), &LimitsArgs::default()).await;
        let engine = cluster.engine(4).await?;
        let prompt = tok.encode(pair.prompt)?;
        let greedy = SamplingParams::greedy();
        for &k in &ks {
            let spec = request(&prompt, pair.max_new_tokens as u32, k as u32, &greedy);
            let base = request(&prompt, pair.max_new_tokens as u32, 0, &greedy);
            // Warm-up: thread pools, page faults, connections.
            generate(&engine, &spec).await;
            in_process_with(&target, Some(&draft), &tok, &spec);
            let mut s = Samples::default();
            for _ in 0..reps {
                let b = in_process_with(&target, None, &tok, &base);
                let l = in_process_with(&target, Some(&draft), &tok, &spec);
                let d = generate(&engine, &spec).await;
                assert_eq!(
                    d.token_ids, b.token_ids,
                    "distributed output must equal target-only"
                );
                assert_eq!(
                    l.token_ids, b.token_ids,
                    "in-process output must equal target-only"
                );
                let st = &d.stats.base;
                let rounds = st.rounds as f64;
                s.base_tps.push(b.stats.tokens_per_second());
                s.local_tps.push(l.stats.tokens_per_second());
                s.dist_tps.push(st.tokens_per_second());
                s.dist_over_local
                    .push(st.tokens_per_second() / l.stats.tokens_per_second());
                s.speedup
                    .push(st.tokens_per_second() / b.stats.tokens_per_second());
                s.extra_us
                    .push(1e6 * (st.decode_seconds - l.stats.decode_seconds) / rounds);
                s.outside_us.push(
                    1e6 * tandem_coordinator::service::stats_to_wire(&d).overhead_seconds()
                        / rounds,
                );
                s.bytes
                    .push((d.stats.traffic.sent + d.stats.traffic.received) as f64 / rounds);
                s.alpha = st.acceptance_rate();
                s.len = st.mean_accepted_length();
            }
            let row = json!({
                "pair": pair.name, "k": k, "reps": reps,
                "target_only_tps": median(s.base_tps.clone()),
                "in_process_tps": median(s.local_tps.clone()),
                "distributed_tps": median(s.dist_tps.clone()),
                "distributed_over_in_process": median(s.dist_over_local.clone()),
                "speedup_distributed": median(s.speedup.clone()),
                "acceptance_rate": s.alpha,
                "mean_accepted_length": s.len,
                "extra_us_per_round": median(s.extra_us.clone()),
                "outside_nodes_us_per_round": median(s.outside_us.clone()),
                "bytes_per_round": median(s.bytes.clone()),
            });
            println!(
                "| {} | {k} | {:.1} | {:.1} | {:.1} | {:.3} | {:.2}× | {:.3} | {:.2} | {:.0} | {:.0} | {:.0} |",
                pair.name,
                row["target_only_tps"].as_f64().unwrap_or_default(),
                row["in_process_tps"].as_f64().unwrap_or_default(),
                row["distributed_tps"].as_f64().unwrap_or_default(),
                row["distributed_over_in_process"]
                    .as_f64()
                    .unwrap_or_default(),
                row["speedup_distributed"].as_f64().unwrap_or_default(),
                s.alpha,
                s.len,
                row["extra_us_per_round"].as_f64().unwrap_or_default(),
                row["outside_nodes_us_per_round"]
                    .as_f64()
                    .unwrap_or_default(),
                row["bytes_per_round"].as_f64().unwrap_or_default(),
            );
            eprintln!("{row}");
        }
    }
    Ok(())
}
