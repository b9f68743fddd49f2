//! A chat's turns with the prefix cache on and off (issue 30, item 5): the target-node, the
//! draft-node and the coordinator in this process (gRPC over loopback), a ten-turn chat in
//! ChatML whose history grows by a user message and an answer of at most 48 tokens each turn
//! (to ~2,000 tokens on the Qwen pair); the history is sent as text, as a chat client sends it. Each repetition runs the chat on a cluster with the cache and on
//! one without, alternating which goes first, with a user text of its own (so no repetition
//! finds another's turns). Reported per turn (1, 5, 10 and all): time to the first token and
//! end to end, medians, and the ratio off / on; the answers are checked equal.
//!
//! Environment: BENCH_REPS (default 5), BENCH_PAIRS (`qwen` (default) or `stories260k`),
//! BENCH_TURNS (default 10).

use std::time::{Duration, Instant};

use tandem_coordinator::{CommitSink, Engine, LocalCluster};
use tandem_node::LimitsArgs;
use tandem_proto::v1;
use tandem_runtime::{Commit, SamplingParams, Tokenizer};
use tandem_tests::bench::{env_list, env_usize, median, reps};

/// Times the first commit of a generation.
struct FirstToken {
    start: Instant,
    first: Option<Duration>,
}

impl CommitSink for FirstToken {
    async fn send(
        &mut self,
        commit: &Commit,
        _: &[tandem_runtime::sampling::TokenLogprobs],
    ) -> bool {
        if !commit.tokens.is_empty() {
            self.first.get_or_insert(self.start.elapsed());
        }
        true
    }
}

/// A user message of about 150 tokens, different for each turn and repetition.
fn user(turn: usize, rep: usize) -> String {
    format!(
        "Request {rep}.{turn}: here is a function from our billing service, version {turn}. \
         Review it and tell me in one sentence what it does.\n```python\n\
         def invoice_total_{rep}_{turn}(lines, tax_rate={turn}.5, discount=None):\n    \
         subtotal = 0\n    for line in lines:\n        price = line[\"price\"] * line[\"qty\"]\n        \
         if line.get(\"taxable\", True):\n            price *= 1 + tax_rate / 100\n        \
         subtotal += price\n    if discount is not None:\n        \
         subtotal -= min(discount, subtotal * 0.{turn})\n    return round(subtotal, 2)\n```"
    )
}

/// One chat of `turns` on `cluster`: per turn (time to first token, end to end), and answers.
async fn chat(
    engine: &Engine,
    tok: &Tokenizer,
    turns: usize,
    rep: usize,
) -> anyhow::Result<(Vec<(Duration, Duration)>, Vec<Vec<u32>>, usize)> {
    let mut history =
        String::from("<|im_start|>system\nYou are a concise code reviewer.<|im_end|>\n");
    let (mut times, mut answers, mut prompt_len) = (Vec::new(), Vec::new(), 0);
    for turn in 1..=turns {
        history.push_str(&format!(
            "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
            user(turn, rep)
        ));
        let prompt = tok.encode_raw(&history)?;
        prompt_len = prompt.len();
        let req = v1::GenerateRequest {
            prompt_tokens: prompt,
            max_tokens: 48,
            sampling: Some((&SamplingParams::greedy()).into()),
            ..Default::default()
        };
        let job = engine.prepare(&req)?;
        let mut sink = FirstToken {
            start: Instant::now(),
            first: None,
        };
        let out = engine.generate(&job, &mut sink).await?;
        let whole = sink.start.elapsed();
        times.push((sink.first.unwrap_or(whole), whole));
        history.push_str(&out.text);
        history.push_str("<|im_end|>\n");
        answers.push(out.token_ids);
    }
    Ok((times, answers, prompt_len))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    tandem_runtime::init_cpu_threads();
    let reps = reps();
    let turns = env_usize("BENCH_TURNS", 10);
    let pair = env_list("BENCH_PAIRS", "qwen").remove(0);
    let (target, draft) = match pair.as_str() {
        "stories260k" => (tandem_tests::stories(), tandem_tests::stories_q8()),
        _ => tandem_tests::qwen_pair("prefix bench")
            .ok_or_else(|| anyhow::anyhow!("the Qwen pair is not fetched"))?,
    };
    let tok = Tokenizer::for_model(&target)?;
    let off = LimitsArgs {
        prefix_cache_bytes: Some(0),
        ..LimitsArgs::default()
    };
    let mut by_mode: [Vec<Vec<(Duration, Duration)>>; 2] = [Vec::new(), Vec::new()];
    let mut history_tokens = 0;
    for rep in 0..reps {
        // The cache on, then off; the next repetition the other way round.
        let order = if rep % 2 == 0 { [0, 1] } else { [1, 0] };
        let mut answers: [Vec<Vec<u32>>; 2] = Default::default();
        for mode in order {
            let limits = if mode == 0 {
                LimitsArgs::default()
            } else {
                off.clone()
            };
            let cluster: LocalCluster = tandem_tests::cluster(&target, Some(&draft), &limits).await;
            let engine = tandem_tests::patient_engine(&cluster, 4).await;
            let (times, out, len) = chat(&engine, &tok, turns, rep).await?;
            history_tokens = len;
            by_mode[mode].push(times);
            answers[mode] = out;
            let hits = cluster.target.metrics.prefix_cache_hits.get();
            eprintln!(
                "rep {rep} cache {}: target hits {hits} tokens",
                ["on", "off"][mode]
            );
        }
        anyhow::ensure!(
            answers[0] == answers[1],
            "rep {rep}: answers differ with the cache"
        );
    }
    println!("{pair}: {turns} turns, the last prompt {history_tokens} tokens, {reps} repetitions");
    println!("| turn | TTFT on ms | TTFT off ms | off/on | end-to-end on ms | off ms | off/on |");
    println!("|---|---|---|---|---|---|---|");
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for turn in 0..turns {
        let col = |mode: usize, e2e: bool| -> Vec<f64> {
            by_mode[mode]
                .iter()
                .map(|t| ms(if e2e { t[turn].1 } else { t[turn].0 }))
                .collect()
        };
        let ratio = |e2e: bool| -> f64 {
            median(
                col(1, e2e)
                    .iter()
                    .zip(col(0, e2e))
                    .map(|(off, on)| off / on)
                    .collect(),
            )
        };
        println!(
            "| {} | {:.0} | {:.0} | {:.2}× | {:.0} | {:.0} | {:.2}× |",
            turn + 1,
            median(col(0, false)),
            median(col(1, false)),
            ratio(false),
            median(col(0, true)),
            median(col(1, true)),
            ratio(true),
        );
    }
    Ok(())
}
