//! Constrained generation under speculation (issue 29, item 5), in process: for each pair and K,
//! alternating, `BENCH_REPS` times each, greedy:
//!
//! - free: target-only, and speculative (the draft model proposing K);
//! - a JSON schema: target-only masked, speculative with the draft masked by the same grammar
//!   (what Tandem's draft-node does), and speculative with the draft free (its drafts the
//!   grammar forbids are rejected at the verify).
//!
//! Speculative output is checked equal to target-only under the same grammar. Reported: decode
//! tokens/s (prefill excluded), speedup over target-only of the same mode, acceptance α (accepted
//! / drafted), tokens committed per round, and ms per token. One JSON object per line follows.
//!
//! Environment: BENCH_REPS (default 5), BENCH_PAIRS (`110m-q8_0`, `qwen`; default both;
//! `qwen` needs the pair .ci/run fetches), BENCH_K (default `4,8`).

use std::time::Instant;

use serde_json::json;
use tandem_runtime::{
    Drafter, Grammar, GrammarCompiler, LoadOptions, Model, SamplingParams, Tokenizer, Verifier,
    default_stop_tokens,
};
use tandem_tests::bench::{env_list, ks, median, pairs, reps};

/// The schema every constrained run keeps to (bounded, so a random-weight model ends too).
fn schema() -> serde_json::Value {
    json!({
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 24},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "genre": {"enum": ["fairy tale", "fable", "myth", "novel"]},
            "characters": {"type": "array", "items": {"type": "string", "maxLength": 12},
                           "minItems": 1, "maxItems": 3}
        },
        "required": ["title", "year", "genre", "characters"],
        "additionalProperties": false
    })
}

const QWEN_PROMPT: &str = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
    <|im_start|>user\nDescribe a children's book as JSON with its title, year, genre and up to \
    three characters.<|im_end|>\n<|im_start|>assistant\n";

/// One generation's figures.
#[derive(Debug, Clone)]
struct Run {
    ids: Vec<u32>,
    seconds: f64,
    drafted: usize,
    accepted: usize,
    rounds: usize,
    /// Tokens committed, the stop token that ended the output included.
    committed: usize,
}

struct Setup<'a> {
    target: &'a Model,
    draft: &'a Model,
    compiler: &'a GrammarCompiler,
    stops: &'a [u32],
    prompt: &'a [u32],
    max_new: usize,
}

/// How the draft drafts under a grammar.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Draft {
    Masked,
    Free,
}

fn run(s: &Setup, k: usize, grammar: Option<&Grammar>, how: Draft) -> anyhow::Result<Run> {
    let params = SamplingParams::greedy();
    let mut verifier = Verifier::new(s.target, params.clone());
    let mut drafter = Drafter::new(s.draft, params);
    if let Some(g) = grammar {
        verifier.constrain(s.compiler.compile(g, s.prompt.len())?);
        if how == Draft::Masked {
            drafter.constrain(s.compiler.compile(g, s.prompt.len())?);
        }
    }
    verifier.prefill(s.prompt)?;
    if k > 0 {
        drafter.prefill(s.prompt)?;
    }
    let start = Instant::now();
    let mut log = s.prompt.to_vec();
    let (mut drafted, mut accepted, mut rounds, mut committed) = (0, 0, 0, 0);
    'rounds: while log.len() - s.prompt.len() < s.max_new {
        let proposal = if k > 0 {
            drafter.propose(&log, k)?
        } else {
            Default::default()
        };
        let v = verifier.verify(&log, &proposal.tokens, &proposal.q, k)?;
        anyhow::ensure!(v.refused.is_none(), "{:?}", v.refused);
        rounds += 1;
        drafted += proposal.tokens.len();
        accepted += v.verdict.accepted;
        let round = proposal.tokens[..v.verdict.accepted]
            .iter()
            .copied()
            .chain([v.verdict.next]);
        for t in round {
            committed += 1;
            if s.stops.contains(&t) {
                break 'rounds;
            }
            log.push(t);
        }
    }
    log.truncate(s.prompt.len() + s.max_new);
    Ok(Run {
        ids: log[s.prompt.len()..].to_vec(),
        seconds: start.elapsed().as_secs_f64(),
        drafted,
        accepted,
        rounds,
        committed,
    })
}

fn main() -> anyhow::Result<()> {
    tandem_runtime::init_cpu_threads();
    let (reps, ks) = (reps(), ks()?);
    let wanted = env_list("BENCH_PAIRS", "110m-q8_0,qwen");
    let scratch = tempfile::tempdir()?;
    let mut sets = Vec::new();
    if wanted.iter().any(|w| w == "110m-q8_0") {
        for p in pairs(scratch.path(), &["110m-q8_0".to_string()])? {
            sets.push((
                p.name.to_string(),
                p.target,
                p.draft,
                p.prompt.to_string(),
                160,
            ));
        }
    }
    if wanted.iter().any(|w| w == "qwen") {
        let (target, draft) = tandem_tests::qwen_pair("structured bench")
            .ok_or_else(|| anyhow::anyhow!("the Qwen pair is not fetched"))?;
        let name = "Qwen2.5-Coder 1.5B Q4_K_M / 0.5B".to_string();
        sets.push((name, target, draft, QWEN_PROMPT.to_string(), 160));
    }
    let grammar = Grammar::JsonSchema(schema());
    println!(
        "{:<34} {:>2} {:<22} {:>8} {:>8} {:>6} {:>6} {:>7} {:>7}",
        "pair", "K", "variant", "tok/s", "speedup", "α", "len", "ms/tok", "tokens"
    );
    for (name, target_path, draft_path, prompt, max_new) in &sets {
        let options = LoadOptions::default();
        let target = Model::load(target_path, &options)?;
        let draft = Model::load(draft_path, &options)?;
        let tok = Tokenizer::for_model(target_path)?;
        let stops = default_stop_tokens(&target, &tok);
        let compiler = GrammarCompiler::new(&tok, target.config().vocab_size, &stops)?;
        let prompt = tok.encode(prompt)?;
        let setup = Setup {
            target: &target,
            draft: &draft,
            compiler: &compiler,
            stops: &stops,
            prompt: &prompt,
            max_new: *max_new,
        };
        for &k in &ks {
            let variants: [(&str, usize, Option<&Grammar>, Draft); 5] = [
                ("free target-only", 0, None, Draft::Free),
                ("free speculative", k, None, Draft::Free),
                ("schema target-only", 0, Some(&grammar), Draft::Masked),
                ("schema draft masked", k, Some(&grammar), Draft::Masked),
                ("schema draft free", k, Some(&grammar), Draft::Free),
            ];
            // Warm-up: first-touch allocations and page faults of the weights.
            for (_, k, g, how) in &variants {
                run(&setup, *k, *g, *how)?;
            }
            let mut runs: Vec<Vec<Run>> = vec![Vec::new(); variants.len()];
            for _ in 0..reps {
                for (i, (_, k, g, how)) in variants.iter().enumerate() {
                    runs[i].push(run(&setup, *k, *g, *how)?);
                }
            }
            for (i, (variant, _, g, _)) in variants.iter().enumerate() {
                // The target-only run of the same mode is the reference and the baseline.
                let base = if g.is_some() { 2 } else { 0 };
                for (a, b) in runs[i].iter().zip(&runs[base]) {
                    anyhow::ensure!(a.ids == b.ids, "{name} K = {k} {variant}: output differs");
                }
                let speedups: Vec<f64> = runs[i]
                    .iter()
                    .zip(&runs[base])
                    .map(|(a, b)| b.seconds / a.seconds)
                    .collect();
                let r = &runs[i];
                let tokens = r[0].ids.len();
                let tps = median(r.iter().map(|x| x.ids.len() as f64 / x.seconds).collect());
                let alpha = median(
                    r.iter()
                        .map(|x| x.accepted as f64 / x.drafted.max(1) as f64)
                        .collect(),
                );
                let len = median(
                    r.iter()
                        .map(|x| x.committed as f64 / x.rounds as f64)
                        .collect(),
                );
                let speedup = median(speedups);
                println!(
                    "{name:<34} {k:>2} {variant:<22} {tps:>8.1} {speedup:>7.2}× {alpha:>6.2} \
                     {len:>6.2} {:>7.1} {tokens:>7}",
                    1e3 / tps
                );
                eprintln!(
                    "{}",
                    json!({"pair": name, "k": k, "variant": variant, "tokens_per_s": tps,
                           "speedup": speedup, "acceptance": alpha,
                           "tokens_per_round": len, "tokens": tokens, "reps": reps})
                );
            }
        }
    }
    Ok(())
}
