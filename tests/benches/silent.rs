//! What a silent draft link costs (issue 51 item 4): the three binaries as processes, the
//! target-node (and the coordinator beside it) pinned to one core and the draft-node to the other,
//! the draft-node behind a link (`tandem_tests::link`) that a run silences: every byte held, no
//! reset, no FIN, as behind a router that stopped forwarding.
//!
//! Measured, each a generation's wall time at the client, alternated with target-only (K = 0)
//! runs in every repetition:
//! - `healthy`: the link up, the variant's own speed;
//! - `first silent`: the first generation after the link went silent (it finds the link itself);
//! - `silent`: generations that start while the link stays silent (the node is down by then);
//! - `silent mid-way`: a generation whose link goes silent after its first token (healed before
//!   the next, and drafting seen to resume first).
//!
//! Requests draft with the draft model only (`drafter: model`): without it a round is the
//! target's alone, as a K = 0 run's. Reported: medians, and each against target-only's median.
//! Greedy outputs are checked equal to target-only's.
//!
//! Environment: BENCH_REPS (default 5), BENCH_PAIRS (default `110m-q8_0`), BENCH_TOKENS
//! (default 100), BENCH_VARIANTS (default `auto,4`: K chosen each round, or a fixed K),
//! BENCH_CPUS (default `0,1`: the target's and the draft's core).

use std::time::Instant;

use tandem_proto::v1;
use tandem_proto::v1::coordinator_client::CoordinatorClient;
use tandem_tests::bench::{env_list, env_usize, median, pairs};
use tandem_tests::link::{Link, LinkSpec};
use tandem_tests::processes::Proc;
use tandem_tests::tokenizer;
use tonic::transport::Channel;

type Client = CoordinatorClient<Channel>;

/// One generation: its wall time in seconds, its tokens, and the rounds its draft model drafted.
async fn run(
    client: &mut Client,
    request: v1::GenerateRequest,
    on_first: impl FnOnce(),
) -> anyhow::Result<(f64, Vec<u32>, u32)> {
    let start = Instant::now();
    let mut first = Some(on_first);
    let done = tandem_coordinator::client::run(client, request, |_| {
        if let Some(f) = first.take() {
            f();
        }
    })
    .await?;
    let model_rounds = done.stats.as_ref().map_or(0, |s| s.model_rounds);
    Ok((start.elapsed().as_secs_f64(), done.token_ids, model_rounds))
}

// The link's tasks run on a worker thread: the main one blocks while a process starts.
#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() -> anyhow::Result<()> {
    let reps = env_usize("BENCH_REPS", 5);
    let tokens = env_usize("BENCH_TOKENS", 100) as u32;
    let variants = env_list("BENCH_VARIANTS", "auto,4");
    let cpus = env_list("BENCH_CPUS", "0,1");
    let (target_cpu, draft_cpu) = (cpus[0].clone(), cpus[cpus.len() - 1].clone());
    let scratch = tempfile::tempdir()?;
    println!("| pair | variant | case | median s | target-only median s | ratio |");
    println!("|---|---|---|---|---|---|");
    for pair in pairs(scratch.path(), &env_list("BENCH_PAIRS", "110m-q8_0"))? {
        let prompt = tokenizer(&pair.target).encode(pair.prompt)?;
        let target = Proc::node_on("target-node", &pair.target, &[], Some(&target_cpu));
        let draft = Proc::node_on("draft-node", &pair.draft, &[], Some(&draft_cpu));
        // The draft model only (no n-gram lookup, which drafts well on a random model's
        // repetitive text): without the draft-node a round is the target's alone, as K = 0's.
        let request = |k: Option<u32>| v1::GenerateRequest {
            prompt_tokens: prompt.clone(),
            max_tokens: tokens,
            draft_tokens: k,
            drafter: "model".into(),
            ignore_eos: true,
            ..Default::default()
        };
        for variant in &variants {
            let k = variant.parse::<u32>().ok();
            let link = Link::start(draft.addr, LinkSpec::DIRECT).await?;
            let coordinator = Proc::coordinator(
                &target.url(),
                &link.url(),
                &Proc::NO_HISTORY,
                Some(&target_cpu),
            );
            let mut client = Client::connect(coordinator.url()).await?;
            let (_, alone, _) = run(&mut client, request(Some(0)), || {}).await?;
            let mut cases: [(&str, Vec<f64>); 4] = [
                ("healthy", vec![]),
                ("first silent", vec![]),
                ("silent", vec![]),
                ("silent mid-way", vec![]),
            ];
            let mut baseline = Vec::new();
            for _ in 0..reps {
                // Healed, and drafting again (a generation that drafts) before each repetition.
                link.silence(false);
                loop {
                    let (secs, out, drafted) = run(&mut client, request(k), || {}).await?;
                    anyhow::ensure!(out == alone, "{variant}: output differs from target-only");
                    if drafted > 0 {
                        cases[0].1.push(secs);
                        break;
                    }
                }
                let (secs, out, _) = run(&mut client, request(Some(0)), || {}).await?;
                anyhow::ensure!(out == alone);
                baseline.push(secs);
                link.silence(true);
                let (secs, out, _) = run(&mut client, request(k), || {}).await?;
                anyhow::ensure!(out == alone, "{variant}: output differs when silent");
                cases[1].1.push(secs);
                for _ in 0..2 {
                    let (secs, out, _) = run(&mut client, request(k), || {}).await?;
                    anyhow::ensure!(out == alone, "{variant}: output differs when silent");
                    cases[2].1.push(secs);
                    let (secs, _, _) = run(&mut client, request(Some(0)), || {}).await?;
                    baseline.push(secs);
                }
                link.silence(false);
                loop {
                    let (_, _, drafted) = run(&mut client, request(k), || {}).await?;
                    if drafted > 0 {
                        break;
                    }
                }
                let (secs, out, _) = run(&mut client, request(k), || link.silence(true)).await?;
                anyhow::ensure!(out == alone, "{variant}: output differs, silenced mid-way");
                cases[3].1.push(secs);
            }
            let base = median(baseline);
            for (case, secs) in cases {
                let m = median(secs);
                println!(
                    "| {} | {variant} | {case} | {m:.3} | {base:.3} | {:.2}× |",
                    pair.name,
                    m / base
                );
            }
            link.silence(false);
            drop(coordinator);
        }
    }
    Ok(())
}
