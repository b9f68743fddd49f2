//! Speculative vs target-only decoding, in process. Variants run alternately, `BENCH_REPS`
//! times each; medians are reported as a table and one JSON object per line.
//!
//! Pairs: stories260K (f32) with its Q8_0 copy as the draft (real text, tiny: shows per-round
//! overhead), and a random-weight model of the stories110M shape (768 × 12 layers × 32k vocab,
//! f32) with its own Q8_0 / Q4_0 copy as the draft (realistic cost).
//!
//! Environment: BENCH_REPS (default 5), BENCH_PAIRS (comma list of `stories260k`, `110m-q8_0`,
//! `110m-q4_0`; default all), BENCH_K (comma list, default `4,8`).

use serde_json::json;
use tandem_runtime::{
    GenerateRequest, Generation, LoadOptions, Model, SamplingParams, SpeculativeGenerator,
    Tokenizer,
};
use tandem_tests::bench::{Pair, env_list, ks, median, pairs, reps};

fn run(
    target: &Model,
    draft: &Model,
    tok: &Tokenizer,
    pair: &Pair,
    k: usize,
) -> anyhow::Result<Generation> {
    let generator = SpeculativeGenerator::new(target, Some(draft), tok)?;
    let request = GenerateRequest {
        prompt: tok.encode(pair.prompt)?,
        max_new_tokens: pair.max_new_tokens,
        sampling: SamplingParams::greedy(),
        draft_tokens: k,
        stop_token_ids: vec![],
        stop_strings: vec![],
    };
    Ok(generator.generate(&request, |_| {})?)
}

fn main() -> anyhow::Result<()> {
    tandem_runtime::init_cpu_threads();
    let (reps, ks) = (reps(), ks()?);
    let wanted = env_list("BENCH_PAIRS", "stories260k,110m-q8_0,110m-q4_0");
    let scratch = tempfile::tempdir()?;
    let pairs = pairs(scratch.path(), &wanted)?;

    println!(
        "{:<24} {:>2} {:>9} {:>9} {:>7} {:>6} {:>6} {:>8} {:>8} {:>8} {:>7} {:>6}",
        "pair",
        "K",
        "base t/s",
        "spec t/s",
        "speedup",
        "α",
        "len",
        "t_d ms",
        "t_v ms",
        "t_tgt ms",
        "bound",
        "eff"
    );
    for pair in &pairs {
        let options = LoadOptions::default();
        let target = Model::load(&pair.target, &options)?;
        let draft = Model::load(&pair.draft, &options)?;
        let tok = Tokenizer::for_model(&pair.target)?;
        // Warm-up: first-touch allocations and page faults of the weights.
        run(&target, &draft, &tok, pair, 0)?;
        run(&target, &draft, &tok, pair, ks[0])?;
        for &k in &ks {
            let (mut base, mut spec) = (Vec::new(), Vec::new());
            let mut reference: Option<Vec<u32>> = None;
            for _ in 0..reps {
                let b = run(&target, &draft, &tok, pair, 0)?;
                let s = run(&target, &draft, &tok, pair, k)?;
                anyhow::ensure!(
                    b.token_ids == s.token_ids,
                    "{}: speculative output differs from target-only",
                    pair.name
                );
                reference.get_or_insert(b.token_ids.clone());
                base.push(b.stats);
                spec.push(s.stats);
            }
            let base_tps = median(base.iter().map(|s| s.tokens_per_second()).collect());
            let spec_tps = median(spec.iter().map(|s| s.tokens_per_second()).collect());
            let speedups: Vec<f64> = base
                .iter()
                .zip(&spec)
                .map(|(b, s)| s.tokens_per_second() / b.tokens_per_second())
                .collect();
            let speedup = median(speedups);
            let s = &spec[0];
            let alpha = s.acceptance_rate();
            let mean_len = s.mean_accepted_length();
            // t_d: draft seconds per drafted token; t_v: target seconds per verify round;
            // t_target: target-only seconds per token.
            let t_d = median(
                spec.iter()
                    .map(|s| s.draft_seconds / s.drafted.max(1) as f64)
                    .collect(),
            );
            let t_v = median(
                spec.iter()
                    .map(|s| s.target_seconds / s.rounds.max(1) as f64)
                    .collect(),
            );
            let t_target = median(
                base.iter()
                    .map(|s| s.decode_seconds / s.generated_tokens.max(1) as f64)
                    .collect(),
            );
            let tokens_per_round = if alpha >= 1.0 {
                (k + 1) as f64
            } else {
                (1.0 - alpha.powi(k as i32 + 1)) / (1.0 - alpha)
            };
            let bound = tokens_per_round * t_target / (k as f64 * t_d + t_v);
            let efficiency = speedup / bound;
            // The same bound with the measured tokens per round instead of the i.i.d. formula:
            // acceptance that depends on the position makes the formula pessimistic (efficiency
            // above 1); this ratio isolates what the loop itself costs.
            let measured_bound = mean_len * t_target / (k as f64 * t_d + t_v);
            let loop_efficiency = speedup / measured_bound;
            // Per-round time not spent in the models: sampling, acceptance, bookkeeping.
            let overhead_us = median(
                spec.iter()
                    .map(|s| {
                        1e6 * (s.decode_seconds - s.draft_seconds - s.target_seconds)
                            / s.rounds.max(1) as f64
                    })
                    .collect(),
            );
            println!(
                "{:<24} {:>2} {:>9.1} {:>9.1} {:>6.2}x {:>6.3} {:>6.2} {:>8.3} {:>8.3} {:>8.3} {:>6.2}x {:>6.2} {:>6.2}",
                pair.name,
                k,
                base_tps,
                spec_tps,
                speedup,
                alpha,
                mean_len,
                1e3 * t_d,
                1e3 * t_v,
                1e3 * t_target,
                bound,
                efficiency,
                loop_efficiency
            );
            let record = json!({
                "pair": pair.name, "k": k, "reps": reps, "tokens": pair.max_new_tokens,
                "target_only_tokens_per_second": base_tps,
                "speculative_tokens_per_second": spec_tps,
                "speedup": speedup, "acceptance_rate": alpha, "mean_accepted_length": mean_len,
                "t_d_ms": 1e3 * t_d, "t_v_ms": 1e3 * t_v, "t_target_ms": 1e3 * t_target,
                "rtt_ms": 0.0, "bound": bound, "efficiency": efficiency,
                "measured_length_efficiency": loop_efficiency,
                "round_overhead_us": overhead_us, "identical_output": true,
            });
            eprintln!("{record}");
        }
    }
    Ok(())
}
