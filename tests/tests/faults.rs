//! Fault injection (issue 13): a seeded fault layer ([`FaultProxy`]) between the coordinator and
//! each node delays, duplicates, corrupts the prefix of, drops, and resets the streams of a share
//! of the messages, over more than 1,000 rounds. Every generation ends with target-only's output
//! or with a clean error, and no session is left open on either node.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tandem_coordinator::{Discard, Engine};
use tandem_node::LimitsArgs;
use tandem_runtime::SamplingParams;
use tandem_tests::faults::{FaultProxy, Injected};
use tandem_tests::*;
use tonic::Code;

/// Per mille of messages delayed, duplicated, corrupted, reset, dropped (a dropped verify costs
/// the target call's deadline, 10 s).
const FAULTS: [u64; 5] = [50, 30, 30, 10, 1];

fn report(who: &str, i: &Injected) -> String {
    format!(
        "{who}: {} messages, {} delayed, {} duplicated, {} corrupted, {} reset, {} dropped",
        i.messages.load(Ordering::Relaxed),
        i.delayed.load(Ordering::Relaxed),
        i.duplicated.load(Ordering::Relaxed),
        i.corrupted.load(Ordering::Relaxed),
        i.reset.load(Ordering::Relaxed),
        i.dropped.load(Ordering::Relaxed)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_rounds_of_faults_end_exact_or_cleanly_and_leak_no_session() {
    let cluster = cluster(&stories(), Some(&stories_q8()), &LimitsArgs::default()).await;
    let target = FaultProxy::new(cluster.target_addr, 7, FAULTS);
    let draft = FaultProxy::new(cluster.draft_addr.expect("draft"), 11, FAULTS);
    let (target_faults, draft_faults) = (target.injected.clone(), draft.injected.clone());
    let (target_url, draft_url) = (target.serve().await, draft.serve().await);
    let mut engine = Engine::connect(&[target_url], &[draft_url], None, &Default::default())
        .await
        .expect("engine");
    engine.target_retry = Duration::from_secs(20);

    let tok = tokenizer(&stories());
    let prompts = [
        "Once upon a time",
        "The little dog",
        "Lily and Ben",
        "One day",
    ];
    let want: Vec<_> = prompts
        .iter()
        .map(|p| {
            let prompt = tok.encode(p).expect("encode");
            in_process(
                &stories(),
                None,
                &request(&prompt, 200, 0, &SamplingParams::greedy()),
            )
            .token_ids
        })
        .collect();
    let (mut rounds, mut exact, mut failed) = (0, 0, Vec::new());
    for i in 0..24 {
        let prompt = tok.encode(prompts[i % 4]).expect("encode");
        let k = [2, 4, 8, 0][(i / 4) % 4];
        let req = request(&prompt, 200, k, &SamplingParams::greedy());
        let job = engine.prepare(&req).expect("valid request");
        match engine.generate(&job, &mut Discard).await {
            Ok(outcome) => {
                rounds += outcome.stats.base.rounds;
                assert_eq!(
                    outcome.token_ids,
                    want[i % 4],
                    "generation {i} (K = {k}) ended with other text"
                );
                exact += 1;
            }
            Err(e) => {
                // A clean error: a status a client can act on, saying what happened.
                let code = e.code();
                assert!(
                    matches!(code, Code::Unavailable | Code::DeadlineExceeded),
                    "generation {i}: {code:?}: {e}"
                );
                assert!(!e.to_string().is_empty());
                failed.push(e.to_string());
            }
        }
    }
    let summary = format!(
        "{rounds} rounds, {exact} exact, {} clean errors {failed:?}; {}; {}",
        failed.len(),
        report("target", &target_faults),
        report("draft", &draft_faults)
    );
    eprintln!("{summary}");
    assert!(rounds >= 1000, "{summary}");
    for i in [&target_faults, &draft_faults] {
        for n in [&i.delayed, &i.duplicated, &i.corrupted, &i.reset] {
            assert!(
                n.load(Ordering::Relaxed) > 0,
                "every fault injected: {summary}"
            );
        }
    }
    // Every session closed on both nodes, the reset ones included.
    let idle = eventually(async || {
        cluster.target.sessions.active() == 0
            && cluster
                .draft
                .as_ref()
                .is_some_and(|d| d.sessions.active() == 0)
    })
    .await;
    assert!(
        idle,
        "sessions left: target {}, draft {}",
        cluster.target.sessions.active(),
        cluster.draft.as_ref().map_or(0, |d| d.sessions.active())
    );
}
