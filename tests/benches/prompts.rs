//! Real prompts (issue 54): first turns of `fixtures/prompts/spec-bench-52.jsonl` (the 13
//! categories of Spec-Bench: chat, writing, QA, summarization, RAG, translation, math, code) and
//! `edits-and-tools-8.jsonl` (code edits, tool calls) in the target's ChatML, through the real
//! Qwen2.5-Coder pair (`scripts/fetch-qwen-pair.sh`), greedy. Each process starts fresh (no
//! generation teaches the policy before the first prompt but a 4-token target-only one that
//! pages the weights in); each prompt's variants run back to back, target-only first, the others
//! in the order given on even prompts and reversed on odd ones, and every greedy output is
//! checked equal to target-only's.
//!
//! Each category, variant and repeat is one tenant (`cache_salt`) sending the category's
//! prompts in order: its first prompt has no earlier output to draft from, the next ones have
//! the category's earlier answers (an agent's or an editor's next request), never those of the
//! same prompt's other variants or repeats (that would be a repeat, not a new request).
//!
//! Setups: `split` (target-node and coordinator pinned to one core, the draft-node to the
//! other: two machines emulated) and `one` (both models in one `coordinator serve` process,
//! its cores shared: the one-machine default). Printed per setup, category and variant: tokens/s
//! (median over the category's prompts), its ratio to target-only (median of the per-prompt
//! ratios), acceptance, mean accepted length (tokens per round), and the rounds drafted by the
//! model / n-gram lookup (of them from earlier outputs) / neither; then the geometric mean of
//! the ratios over the categories.
//!
//! Environment: BENCH_SETUPS (default `split,one`), BENCH_VARIANTS (default
//! `target-only,auto,8`: a number is a fixed K drafted by the model, `model` and `ngram` that
//! drafter alone at K = auto), BENCH_PER_CATEGORY (default 1, at most 4),
//! BENCH_CATEGORIES (default: all 15), BENCH_TOKENS (default 96), BENCH_CPUS (default `0,1`: the
//! target's and the draft's core in `split`), BENCH_REPEATS (default 1: the whole prompt set
//! again, each time in the same order; the medians are over prompts and repeats: one
//! generation's tokens/s on this shared 2-core machine varies by ±10 %),
//! BENCH_VERIFY_STEPS (what the target's verify of 0, 1, … drafts costs in its steps; default
//! [`VERIFY_STEPS`], measured; a round drafts at most as many as the list goes to),
//! BENCH_ANSWERS (a file to which each target-only answer of the first repeat is appended as a
//! JSON line with its category, its prompt's token ids and the category's earlier answers),
//! BENCH_BASELINE (`split` only, with TANDEM_PREBUILT: the name of a coordinator binary beside
//! the others, a build from before a change copied there under another name; started on the
//! same nodes, pinned as the other, its default run as the variant `baseline`, alternated
//! prompt by prompt with the rest).
//!
//! Then, per category, the copy bound of the target-only answers (`tandem_tests::copy_bound`):
//! how much of them follows a recurrence of their last two tokens in the prompt, the answer so
//! far or the category's earlier answers, and the most n-gram lookup could speed them up if it
//! knew which match holds, each round costing the verify of its drafts (BENCH_VERIFY_STEPS).
//! Beside it, n-gram lookup's own proposals (`look_up_in`, 8 tokens, over the answer so far and
//! the category's earlier answers) replayed against each answer (`copy_bound::replay`): the
//! share they carry, and the speedup were each round to verify the whole proposal or only the
//! part that holds. The gap from the bound to the latter is the drafter's choice of match; from
//! the latter to the bench's n-gram row, the policy's choices and the real costs.
//!
//! Last, per category, the drafting bounds (`tandem_tests::drafting_bound`): the draft model
//! (loaded in this process once the setups are done) reads each target-only answer, and an
//! oracle that knew where each chain holds schedules the rounds: the model's chains alone and
//! with copying at BENCH_DRAFT_STEP of a step per model draft (default 0.38), the same with
//! drafting wholly hidden (free), and the draft's top-2 paths (a tree's, its other branches
//! unpaid) with copying. No policy over these drafters passes the last (on this verify cost).
//! Beside them, with no oracle, the model's chains at the best fixed K and confidence stop,
//! serially, drafting ahead (the round the longer of its verify and the step drafting ahead),
//! and the same with the verify slower beside that step by each of BENCH_BESIDE (fractions,
//! default `0.24,0.5`: medians of the target's step beside a draft step against alone over
//! coordinator starts on one machine's two cores at two times of one day, scripts/interference.sh,
//! docs/benchmarks/prompts.md, session 35).

use std::collections::BTreeMap;

use serde_json::json;
use tandem_coordinator::drafting::ngram::look_up_in;
use tandem_coordinator::drafting::policy::ADAPTIVE_MAX_K;
use tandem_coordinator::drafting::suffix::SuffixIndex;
use tandem_coordinator::engine::history::DEFAULT_HISTORY_TOKENS;
use tandem_proto::v1;
use tandem_proto::v1::coordinator_client::CoordinatorClient;
use tandem_runtime::SamplingParams;
use tandem_runtime::{LoadOptions, Model};
use tandem_tests::bench::{env_list, env_parsed, env_usize, geometric_mean, median};
use tandem_tests::copy_bound::{CopyBound, Replay, VerifyCost, copy_bound, copy_runs, replay};
use tandem_tests::drafting_bound::{Drafter, chained, fastest, read, runs_where};
use tandem_tests::processes::Proc;

const PROMPTS: [&str; 2] = [
    include_str!("../../fixtures/prompts/spec-bench-52.jsonl"),
    include_str!("../../fixtures/prompts/edits-and-tools-8.jsonl"),
];
/// The target's verify of 0..=8 drafts in its steps (`BENCH_VERIFY_STEPS`): the Qwen 1.5B
/// Q4_K_M target at 400 positions, one thread on one core of this 2-core EPYC, session 34
/// (`BENCH_ROWS=1,2,3,4,5,6,7,8,9 BENCH_CONTEXT=400 cargo bench -p tandem-runtime --bench
/// verify`): ~0.3 of a step a draft up to 7, then a second tile of rows at 8.
const VERIFY_STEPS: &str = "1,1.20,1.49,1.79,2.08,2.37,2.66,3.05,3.98";
/// The system prompt of a turn that names none.
const SYSTEM: &str = "You are a helpful assistant.";

/// Per category: its prompts' token ids and target-only answers (the first repeat's), in order.
type Answers = BTreeMap<String, Vec<(Vec<u32>, Vec<u32>)>>;

/// One variant's figures in one category, over its prompts.
#[derive(Debug, Default)]
struct Figures {
    tps: Vec<f64>,
    ratio: Vec<f64>,
    alpha: Vec<f64>,
    length: Vec<f64>,
    /// Rounds by the model, n-gram lookup, n-gram lookup from earlier outputs, the target alone.
    rounds: [u32; 4],
}

/// The prompts of the chosen categories, `per` of each, as (category, ChatML prompt).
fn prompts(per: usize, categories: &[String]) -> anyhow::Result<Vec<(String, String)>> {
    let mut taken: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = Vec::new();
    for line in PROMPTS.iter().flat_map(|p| p.lines()) {
        let q: serde_json::Value = serde_json::from_str(line)?;
        let category = q["category"].as_str().unwrap_or_default().to_string();
        let n = taken.entry(category.clone()).or_default();
        let wanted = categories.is_empty() || categories.contains(&category);
        if *n < per && wanted {
            *n += 1;
            let turn = q["turns"][0].as_str().unwrap_or_default();
            let system = q["system"].as_str().unwrap_or(SYSTEM);
            let chat = format!(
                "<|im_start|>system\n{system}<|im_end|>\n\
                 <|im_start|>user\n{turn}<|im_end|>\n<|im_start|>assistant\n"
            );
            out.push((category, chat));
        }
    }
    Ok(out)
}

/// `variant` of `prompt`, sent as `tenant`.
fn request(prompt: &str, variant: &str, tokens: usize, tenant: String) -> v1::GenerateRequest {
    let (draft_tokens, drafter) = match variant {
        "target-only" => (Some(0), ""),
        "auto" => (None, ""),
        "model" | "ngram" => (None, variant),
        k => (
            Some(
                k.parse()
                    .expect("a variant is target-only, auto, model, ngram or K"),
            ),
            "",
        ),
    };
    v1::GenerateRequest {
        prompt: prompt.to_string(),
        max_tokens: tokens as u32,
        sampling: Some((&SamplingParams::greedy()).into()),
        draft_tokens,
        drafter: drafter.into(),
        cache_salt: tenant,
        ..Default::default()
    }
}

/// The setup's coordinator (and the nodes it needs, kept alive beside it); in `split`, last,
/// the `BENCH_BASELINE` coordinator on the same nodes where one is named.
fn start(setup: &str, target: &std::path::Path, draft: &std::path::Path) -> Vec<Proc> {
    let cpus = env_list("BENCH_CPUS", "0,1");
    let (target_cpu, draft_cpu) = (&cpus[0], &cpus[cpus.len() - 1]);
    match setup {
        "one" => vec![Proc::coordinator_serving(target, draft, &[])],
        _ => {
            let t = Proc::node_on("target-node", target, &[], Some(target_cpu));
            let d = Proc::node_on("draft-node", draft, &[], Some(draft_cpu));
            let c = Proc::coordinator(&t.url(), &d.url(), &[], Some(target_cpu));
            let mut procs = vec![c, t, d];
            if let Ok(name) = std::env::var("BENCH_BASELINE") {
                let (t, d) = (procs[1].url(), procs[2].url());
                procs.push(Proc::coordinator_named(&name, &t, &d, target_cpu));
            }
            procs
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() -> anyhow::Result<()> {
    let Some((target, draft)) = tandem_tests::qwen_pair("prompts bench") else {
        return Ok(());
    };
    let variants = env_list("BENCH_VARIANTS", "target-only,auto,8");
    anyhow::ensure!(
        variants[0] == "target-only",
        "the first variant is target-only"
    );
    let tokens = env_usize("BENCH_TOKENS", 96);
    let chosen = env_list("BENCH_CATEGORIES", "");
    let prompts = prompts(env_usize("BENCH_PER_CATEGORY", 1), &chosen)?;
    let repeats = env_usize("BENCH_REPEATS", 1);
    let tokenizer = tandem_runtime::Tokenizer::for_model(&target)?;
    let verify = VerifyCost::measured(env_parsed("BENCH_VERIFY_STEPS", VERIFY_STEPS)?)?;
    let mut answers = Answers::new();
    let dump = std::env::var_os("BENCH_ANSWERS");
    println!(
        "| setup | category | variant | tok/s | × target-only | α | tokens/round | rounds model / n-gram (earlier outputs) / target |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (s, setup) in env_list("BENCH_SETUPS", "split,one")
        .into_iter()
        .enumerate()
    {
        let procs = start(&setup, &target, &draft);
        let mut client = CoordinatorClient::connect(procs[0].url()).await?;
        let mut baseline = match procs.get(3) {
            Some(b) => Some(CoordinatorClient::connect(b.url()).await?),
            None => None,
        };
        for c in std::iter::once(&mut client).chain(baseline.as_mut()) {
            let warm = request(&prompts[0].1, "target-only", 4, "warm-up".into());
            tandem_coordinator::client::run(c, warm, |_| {}).await?;
        }
        let mut figures: BTreeMap<(String, String), Figures> = BTreeMap::new();
        let runs = (0..repeats).flat_map(|r| prompts.iter().map(move |(c, p)| (c, p, r)));
        for (i, (category, prompt, repeat)) in runs.enumerate() {
            let mut base: Option<(f64, Vec<u32>)> = None;
            // After target-only, the others in turn and then in reverse, prompt by prompt, so
            // that none always runs right after target-only (two identical coordinators still
            // differ by their warm-up samples: docs/benchmarks/prompts.md, session 36).
            let mut order = variants.clone();
            if i % 2 == 1 {
                order[1..].reverse();
            }
            for variant in &order {
                let tenant = format!("{category} {variant} #{repeat}");
                let (to, sent) = match (variant.as_str(), baseline.as_mut()) {
                    ("baseline", Some(b)) => (b, "auto"),
                    ("baseline", None) => {
                        anyhow::bail!("{setup}: the baseline runs in split, with BENCH_BASELINE")
                    }
                    _ => (&mut client, variant.as_str()),
                };
                let done = tandem_coordinator::client::run(
                    to,
                    request(prompt, sent, tokens, tenant),
                    |_| {},
                )
                .await?;
                let st = done.stats.unwrap_or_default();
                let f = figures
                    .entry((category.clone(), variant.clone()))
                    .or_default();
                match &base {
                    None => {
                        base = Some((st.tokens_per_second, done.token_ids.clone()));
                        if repeat == 0 && s == 0 {
                            let answered = answers.entry(category.clone()).or_default();
                            let ids = tokenizer.encode(prompt)?;
                            if let Some(path) = &dump {
                                let earlier: Vec<_> = answered.iter().map(|(_, a)| a).collect();
                                let line = json!({"category": category, "prompt": ids,
                                    "answer": done.token_ids, "earlier": earlier});
                                append_line(path, &line)?;
                            }
                            answered.push((ids, done.token_ids.clone()));
                        }
                    }
                    Some((_, ids)) => anyhow::ensure!(
                        &done.token_ids == ids,
                        "{setup} {category} {variant}: greedy output differs from target-only"
                    ),
                }
                f.tps.push(st.tokens_per_second);
                f.ratio
                    .push(st.tokens_per_second / base.as_ref().map_or(1.0, |b| b.0));
                f.alpha.push(st.acceptance_rate);
                f.length.push(st.mean_accepted_length);
                f.rounds[0] += st.model_rounds;
                f.rounds[1] += st.ngram_rounds;
                f.rounds[2] += st.history_rounds;
                f.rounds[3] += st.target_only_rounds;
            }
        }
        let mut ratios: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for ((category, variant), f) in &figures {
            let ratio = median(f.ratio.clone());
            ratios.entry(variant.clone()).or_default().push(ratio);
            let [m, n, h, t] = f.rounds;
            println!(
                "| {setup} | {category} | {variant} | {:.1} | {ratio:.2}× | {:.2} | {:.2} | {m} / {n} ({h}) / {t} |",
                median(f.tps.clone()),
                median(f.alpha.clone()),
                median(f.length.clone()),
            );
            let row = json!({"setup": setup, "category": category, "variant": variant,
                "prompts": f.tps.len(), "tokens": tokens,
                "tokens_per_second": median(f.tps.clone()), "over_target_only": ratio,
                "acceptance_rate": median(f.alpha.clone()),
                "mean_accepted_length": median(f.length.clone()),
                "rounds_model_ngram_history_target": f.rounds});
            println!("{row}");
        }
        for (variant, r) in ratios {
            let geomean = geometric_mean(&r);
            println!("| {setup} | geometric mean | {variant} | | {geomean:.2}× | | | |");
        }
        drop(procs);
    }
    print_bounds(&answers, &verify);
    print_drafting_bounds(&answers, &verify, &draft)
}

/// Appends `line` to the file at `path` (`BENCH_ANSWERS`).
fn append_line(path: &std::ffi::OsStr, line: &serde_json::Value) -> std::io::Result<()> {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    writeln!(file, "{line}")
}

/// n-gram lookup's proposals of [`ADAPTIVE_MAX_K`] tokens, over the text so far and the
/// tenant's `earlier` answers as the coordinator keeps them, replayed against `answer`.
fn replayed(earlier: &[Vec<u32>], prompt: &[u32], answer: &[u32], verify: &VerifyCost) -> Replay {
    let mut index = SuffixIndex::new(DEFAULT_HISTORY_TOKENS);
    for text in earlier {
        index.add(text);
    }
    replay(prompt, answer, verify, |text| {
        look_up_in(Some(&index), text, ADAPTIVE_MAX_K, 0).0.tokens
    })
}

/// The copy bounds per category (median over its prompts), n-gram lookup's proposals replayed
/// beside them, and their geometric means.
fn print_bounds(answers: &Answers, verify: &VerifyCost) {
    println!(
        "\nA verify of 0, 1, … drafts: {verify:?} steps; proposals of {ADAPTIVE_MAX_K} tokens."
    );
    println!(
        "| category | answer tokens copied | copy bound × | n-gram lookup's proposals: copied | verified whole × | verified where they hold × |"
    );
    println!("|---|---|---|---|---|---|");
    let mut all: [Vec<f64>; 3] = Default::default();
    for (category, answered) in answers {
        let results: Vec<(CopyBound, Replay)> = with_earlier(answered)
            .map(|(earlier, prompt, answer)| {
                let b = copy_bound(&earlier, prompt, answer, verify);
                (b, replayed(&earlier, prompt, answer, verify))
            })
            .collect();
        let med = |f: &dyn Fn(&CopyBound, &Replay) -> f64| {
            median(results.iter().map(|(b, r)| f(b, r)).collect())
        };
        let share = |n: usize, of: usize| 100.0 * n as f64 / of.max(1) as f64;
        let bound_copied = med(&|b, _| share(b.copied, b.tokens));
        let replay_copied = med(&|b, r| share(r.copied, b.tokens));
        let speedups = [
            med(&|b, _| b.speedup),
            med(&|_, r| r.whole),
            med(&|_, r| r.knowing),
        ];
        for (all, x) in all.iter_mut().zip(speedups) {
            all.push(x);
        }
        let [b, d, e] = speedups;
        println!(
            "| {category} | {bound_copied:.0} % | {b:.2}× | {replay_copied:.0} % | {d:.2}× | {e:.2}× |"
        );
    }
    let [b, d, e] = all.map(|x| geometric_mean(&x));
    println!("| geometric mean | | {b:.2}× | | {d:.2}× | {e:.2}× |");
}

/// A category's answers in order, each with the answers before it (the tenant's earlier ones)
/// and its prompt.
fn with_earlier(
    answered: &[(Vec<u32>, Vec<u32>)],
) -> impl Iterator<Item = (Vec<Vec<u32>>, &[u32], &[u32])> {
    answered.iter().enumerate().map(|(j, (prompt, answer))| {
        let earlier = answered[..j].iter().map(|(_, a)| a.clone()).collect();
        (earlier, prompt.as_slice(), answer.as_slice())
    })
}

/// The drafting bounds per category (`tandem_tests::drafting_bound`, medians over its prompts):
/// the draft model reads each target-only answer after its prompt, and where its greedy choice
/// (or one of its two likeliest) is the answer's token its chain would hold. A model draft costs
/// BENCH_DRAFT_STEP of a target step (default 0.38: the draft's step against the target's at 64
/// and 700 positions, docs/benchmarks/kernels.md, session 30) serially, nothing where drafting
/// is wholly hidden; the top-2 paths are a tree's that holds, its other branches unpaid. Beside
/// the oracle, no oracle: the model's chains at the K and confidence stop (the policy's two
/// knobs, `drafting_bound::chained`) that give the category's best median, serially, drafting
/// ahead (a chain free after a round whose chain and guess held), and drafting ahead with the
/// verify slower beside the step by each of BENCH_BESIDE (default `0.24,0.5`).
fn print_drafting_bounds(
    answers: &Answers,
    verify: &VerifyCost,
    draft: &std::path::Path,
) -> anyhow::Result<()> {
    let draft_step: f64 = std::env::var("BENCH_DRAFT_STEP").map_or(Ok(0.38), |v| v.parse())?;
    let beside = env_parsed("BENCH_BESIDE", "0.24,0.5")?;
    let tokenizer = tandem_runtime::Tokenizer::for_model(draft)?;
    // The draft-node's vocabulary, as a draft-node of default settings computes it.
    let options = LoadOptions {
        logit_ids: tandem_node::logit_ids(tandem_node::Role::Draft, None, &tokenizer)?,
        ..LoadOptions::default()
    };
    let model = Model::load(draft, &options)?;
    println!(
        "\nA model draft: {draft_step} of a step serially; a verify beside a step drafting ahead slower by {beside:?} on one machine's two cores."
    );
    let slowed: Vec<String> = beside
        .iter()
        .map(|b| {
            format!(
                " drafting ahead, the verify {:.0} % slower beside × (K, stop) |",
                b * 100.0
            )
        })
        .collect();
    println!(
        "| category | draft's greedy choice held | in its top 2 | model chains at the best K and confidence stop, serial × (K, stop) | the same, drafting ahead × (K, stop) |{} oracle: model chains, serial × | model chains and copying, serial × | the same, drafting hidden × | top-2 paths and copying, drafting hidden × |",
        slowed.concat()
    );
    println!(
        "|---|---|---|---|---|{}---|---|---|---|",
        "---|".repeat(beside.len())
    );
    let settings: Vec<(usize, f32)> = (1..=ADAPTIVE_MAX_K)
        .flat_map(|k| [0.0, 0.3, 0.5, 0.7, 0.9].map(|c| (k, c)))
        .collect();
    let costs = (verify, draft_step, beside.as_slice());
    let mut all: Vec<Vec<f64>> = vec![Vec::new(); beside.len() + 6];
    for (category, answered) in answers {
        let mut rows: Vec<Vec<f64>> = Vec::new();
        for (earlier, prompt, answer) in with_earlier(answered) {
            rows.push(drafting_row(
                &model,
                (&earlier, prompt, answer),
                costs,
                &settings,
            )?);
        }
        let m: Vec<f64> = (0..rows[0].len())
            .map(|c| median(rows.iter().map(|r| r[c]).collect()))
            .collect();
        // The setting with the best median: serial, drafting ahead, and slowed beside each.
        let best = |of: &[f64]| {
            of.iter().zip(&settings).fold(
                (1.0, (0, 0.0)),
                |b, (&x, &s)| if x > b.0 { (x, s) } else { b },
            )
        };
        let chained: Vec<(f64, (usize, f32))> = m[6..].chunks(settings.len()).map(best).collect();
        let row = chained.iter().map(|c| c.0).chain(m[2..6].iter().copied());
        for (all, x) in all.iter_mut().zip(row) {
            all.push(x);
        }
        let chains: Vec<String> = chained
            .iter()
            .map(|(x, (k, stop))| format!("{x:.2}× ({k}, {stop})"))
            .collect();
        println!(
            "| {category} | {:.0} % | {:.0} % | {} | {:.2}× | {:.2}× | {:.2}× | {:.2}× |",
            m[0],
            m[1],
            chains.join(" | "),
            m[2],
            m[3],
            m[4],
            m[5]
        );
    }
    let means: Vec<String> = all
        .iter()
        .map(|x| format!("{:.2}×", geometric_mean(x)))
        .collect();
    println!("| geometric mean | | | {} |", means.join(" | "));
    Ok(())
}

/// One answer's drafting figures ([`print_drafting_bounds`]): the shares of its tokens that are
/// the draft's greedy choice and in its top 2; the oracle's four bounds; then the model's chains
/// at each setting serially, drafting ahead, and drafting ahead with the verify slowed beside
/// the step by each of `beside`.
fn drafting_row(
    model: &Model,
    (earlier, prompt, answer): (&[Vec<u32>], &[u32], &[u32]),
    (verify, draft_step, beside): (&VerifyCost, f64, &[f64]),
    settings: &[(usize, f32)],
) -> anyhow::Result<Vec<f64>> {
    let reading = read(model, prompt, answer)?;
    let held = |top: usize| reading.rank.iter().map(|&r| r < top).collect::<Vec<_>>();
    let (greedy, top2) = (runs_where(&held(1)), runs_where(&held(2)));
    let copy = copy_runs(earlier, prompt, answer);
    let drafter = |runs, per_token| Drafter { runs, per_token };
    let copying = drafter(&copy, 0.0);
    let chains = drafter(&greedy, draft_step);
    let share = |top| {
        let n = held(top).iter().filter(|&&h| h).count();
        100.0 * n as f64 / answer.len().max(1) as f64
    };
    let mut row = vec![
        share(1),
        share(2),
        fastest(&[chains], verify).speedup,
        fastest(&[chains, copying], verify).speedup,
        fastest(&[drafter(&greedy, 0.0), copying], verify).speedup,
        fastest(&[drafter(&top2, 0.0), copying], verify).speedup,
    ];
    let aheads = [None, Some(0.0)]
        .into_iter()
        .chain(beside.iter().map(|&b| Some(b)));
    for ahead in aheads {
        row.extend(
            settings
                .iter()
                .map(|&s| chained(chains, &reading.confidence, s, verify, ahead)),
        );
    }
    Ok(row)
}
