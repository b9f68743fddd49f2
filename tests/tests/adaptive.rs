//! Speculation that adapts (issue 10): K chosen each round, K = 0 included; n-gram drafting
//! without a draft model; a stalled draft-node abandoned at its deadline and attached again.
//! Whatever the schedule, greedy output equals target-only decoding and a draft's q keeps the
//! acceptance rule exact (its distribution tests are in runtime/src/acceptance.rs).

use std::path::Path;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tandem_coordinator::{Engine, Outcome};
use tandem_node::LimitsArgs;
use tandem_proto::v1;
use tandem_runtime::SamplingParams;
use tandem_tests::faults::FaultProxy;
use tandem_tests::gate::rounds_until;
use tandem_tests::proxy::DraftProxy;
use tandem_tests::*;

/// A request with K unset (adaptive) unless `k` says, drafted by `drafter`.
fn adaptive(prompt: &[u32], n: u32, k: Option<u32>, drafter: &str) -> v1::GenerateRequest {
    v1::GenerateRequest {
        draft_tokens: k,
        drafter: drafter.into(),
        ..request(prompt, n, 0, &SamplingParams::greedy())
    }
}

fn target_only(target: &Path, prompt: &[u32], n: u32) -> Vec<u32> {
    in_process(
        target,
        None,
        &request(prompt, n, 0, &SamplingParams::greedy()),
    )
    .token_ids
}

fn describe(o: &Outcome) -> String {
    let s = &o.stats;
    format!(
        "model {} / ngram {} ({} from earlier outputs) / target-only {} rounds, α {:.2}, stalls {}, re-attached {}, lost {:?}",
        s.model_rounds,
        s.ngram_rounds,
        s.history_rounds,
        s.target_only_rounds,
        s.base.acceptance_rate(),
        s.draft_stalls,
        s.draft_reattached,
        s.draft_lost_reason
    )
}

#[tokio::test]
async fn every_drafter_and_k_schedule_keeps_greedy_output_equal_to_target_only() {
    for (target, draft) in [
        (stories(), stories_q8()),
        (random_model(21), random_model(22)),
    ] {
        let cluster = cluster(&target, Some(&draft), &LimitsArgs::default()).await;
        let engine = cluster.engine(None).await.expect("engine");
        let prompt = tokenizer(&target)
            .encode("Once upon a time")
            .expect("encode");
        let expected = target_only(&target, &prompt, 120);
        for (k, drafter) in [
            (None, ""),
            (None, "model"),
            (None, "ngram"),
            (Some(4), "ngram"),
            (Some(3), "auto"),
        ] {
            let out = generate(&engine, &adaptive(&prompt, 120, k, drafter)).await;
            let case = format!(
                "{} K {k:?} {drafter:?}: {}",
                target.display(),
                describe(&out)
            );
            assert_eq!(out.token_ids, expected, "{case}");
            let s = &out.stats;
            assert_eq!(
                s.model_rounds + s.ngram_rounds + s.target_only_rounds,
                s.base.rounds as u32,
                "{case}"
            );
            if drafter == "ngram" {
                assert_eq!(s.model_rounds, 0, "{case}");
            }
            if drafter == "model" {
                assert_eq!(s.ngram_rounds, 0, "{case}");
            }
            if k.is_some() && drafter == "auto" {
                // A fixed K drafts with the attached model every round but a last one-token one.
                assert!(s.model_rounds + 1 >= s.base.rounds as u32, "{case}");
            }
        }
    }
}

#[tokio::test]
async fn a_useless_draft_settles_on_target_only_decoding() {
    // Two unrelated random models: nearly nothing is accepted, so K = 0 wins, with rare probes.
    let (target, draft) = (random_model(23), random_model(24));
    let cluster = cluster(&target, Some(&draft), &LimitsArgs::default()).await;
    let engine = cluster.engine(None).await.expect("engine");
    let prompt = tokenizer(&target)
        .encode("Once upon a time")
        .expect("encode");
    let out = generate(&engine, &adaptive(&prompt, 200, None, "model")).await;
    assert_eq!(out.token_ids, target_only(&target, &prompt, 200));
    let s = &out.stats;
    assert!(
        s.target_only_rounds * 10 >= s.base.rounds as u32 * 7,
        "{}",
        describe(&out)
    );
}

#[tokio::test]
async fn ngram_drafting_accepts_what_the_text_repeats() {
    // Target-only decoding of stories260K repeats itself within a few hundred tokens: n-gram
    // lookup proposes the repeats and the target accepts them, with no draft model at all.
    let target = stories();
    let cluster = cluster(&target, None, &LimitsArgs::default()).await;
    let engine = cluster.engine(None).await.expect("engine");
    let prompt = tokenizer(&target)
        .encode("Once upon a time, there was a cat. Once upon a time, there was a")
        .expect("encode");
    let out = generate(&engine, &adaptive(&prompt, 200, Some(4), "ngram")).await;
    assert_eq!(out.token_ids, target_only(&target, &prompt, 200));
    let s = &out.stats;
    assert!(
        s.ngram_rounds > 0 && s.base.accepted > 0,
        "{}",
        describe(&out)
    );
    assert_eq!(s.model_rounds, 0);
}

#[tokio::test]
async fn a_tenant_drafts_from_its_earlier_outputs_and_no_other_tenant_does() {
    // The second run of one tenant's request finds the first's output in the tenant's history
    // (n-gram lookup continues it); another tenant's run of the same request does not, and
    // drafts exactly as the first did. Greedy output equals target-only in each.
    let target = random_model(21);
    let cluster = cluster(&target, None, &LimitsArgs::default()).await;
    let engine = cluster.engine(None).await.expect("engine");
    let prompt = tokenizer(&target)
        .encode("Once upon a time")
        .expect("encode");
    let expected = target_only(&target, &prompt, 120);
    let ask = |salt: &str| v1::GenerateRequest {
        cache_salt: salt.into(),
        ..adaptive(&prompt, 120, Some(4), "ngram")
    };
    let first = generate(&engine, &ask("alpha")).await;
    let again = generate(&engine, &ask("alpha")).await;
    let other = generate(&engine, &ask("beta")).await;
    let case = format!(
        "first: {} / again: {} / other tenant: {}",
        describe(&first),
        describe(&again),
        describe(&other)
    );
    for out in [&first, &again, &other] {
        assert_eq!(out.token_ids, expected, "{case}");
    }
    assert_eq!(first.stats.history_rounds, 0, "{case}");
    assert!(again.stats.history_rounds > 0, "{case}");
    assert!(
        again.stats.base.accepted > first.stats.base.accepted,
        "{case}"
    );
    assert_eq!(other.stats.history_rounds, 0, "{case}");
    assert_eq!(
        (other.stats.base.accepted, other.stats.base.rounds),
        (first.stats.base.accepted, first.stats.base.rounds),
        "{case}"
    );
}

#[tokio::test]
async fn a_policy_file_is_saved_as_generations_end_and_opened_by_the_next_engine() {
    let (target, draft) = (stories(), stories_q8());
    let cluster = cluster(&target, Some(&draft), &LimitsArgs::default()).await;
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("policy.json");
    let mut engine = cluster.engine(None).await.expect("engine");
    assert_eq!(engine.learn_in(&path), None, "no file yet: priors");
    let prompt = tokenizer(&target)
        .encode("Once upon a time")
        .expect("encode");
    let out = generate(&engine, &adaptive(&prompt, 60, None, "")).await;
    assert_eq!(out.token_ids, target_only(&target, &prompt, 60));
    let saved = std::fs::read_to_string(&path).expect("saved when the generation ended");
    let model = &engine.target().info.model_name;
    assert!(saved.contains(model.as_str()), "{saved}");
    // The next engine of this pair opens it; an engine without the draft is another pair.
    let mut next = cluster.engine(None).await.expect("engine");
    assert_eq!(next.learn_in(&path), None);
    let alone = tandem_tests::cluster(&target, None, &LimitsArgs::default()).await;
    let mut other = alone.engine(None).await.expect("engine");
    let why = other.learn_in(&path).expect("another pair");
    assert!(why.contains("draft none"), "{why}");
}

#[tokio::test]
async fn adaptive_k_stops_speculating_past_its_concurrency_limit() {
    // Past `max_speculating` generations (here 0: every one is past it) adaptive K decodes with
    // the target alone, where a batch of plain steps is cheaper than drafts, and leaves the
    // draft-node idle (no background steps either); a request that fixes K still drafts.
    let (target, draft) = (stories(), stories_q8());
    let cluster = cluster(&target, Some(&draft), &LimitsArgs::default()).await;
    let mut engine = cluster.engine(None).await.expect("engine");
    assert_eq!(
        engine.max_speculating,
        Some(1),
        "a CPU target speculates alone"
    );
    engine.max_speculating = Some(0);
    let prompt = tokenizer(&target)
        .encode("Once upon a time")
        .expect("encode");
    let expected = target_only(&target, &prompt, 120);
    let steps = || {
        cluster
            .draft
            .as_ref()
            .expect("draft")
            .metrics
            .requests
            .get()
    };
    let crowded = generate(&engine, &adaptive(&prompt, 120, None, "auto")).await;
    assert_eq!(crowded.token_ids, expected);
    let s = &crowded.stats;
    assert_eq!(
        (s.model_rounds, s.ngram_rounds),
        (0, 0),
        "{}",
        describe(&crowded)
    );
    assert_eq!(steps(), 0, "the draft-node was left alone");
    let fixed = generate(&engine, &adaptive(&prompt, 120, Some(4), "model")).await;
    assert_eq!(fixed.token_ids, expected);
    assert!(fixed.stats.model_rounds > 0, "{}", describe(&fixed));
    // Alone again, adaptive K uses the draft-node (at least to time it in the background). If
    // the fixed-K run timed this draft (as costly as its target, both tiny) too slow to pay on a
    // loaded machine, adaptive generations leave it out but one in 8, which times it again: so
    // up to 8 generations.
    engine.max_speculating = None;
    let before = steps();
    let mut runs = Vec::new();
    for _ in 0..8 {
        let alone = generate(&engine, &adaptive(&prompt, 120, None, "auto")).await;
        assert_eq!(alone.token_ids, expected);
        runs.push(describe(&alone));
        if eventually(async || steps() > before).await {
            return;
        }
    }
    panic!("the draft-node was never used again: {runs:#?}");
}

#[tokio::test]
async fn sampled_ngram_drafting_is_reproducible_from_its_seed() {
    let target = stories();
    let cluster = cluster(&target, None, &LimitsArgs::default()).await;
    let engine = cluster.engine(None).await.expect("engine");
    let prompt = tokenizer(&target)
        .encode("Once upon a time")
        .expect("encode");
    let sampling = SamplingParams {
        temperature: 0.8,
        seed: 7,
        ..SamplingParams::default()
    };
    let req = v1::GenerateRequest {
        drafter: "ngram".into(),
        ..request(&prompt, 100, 4, &sampling)
    };
    let (a, b) = (generate(&engine, &req).await, generate(&engine, &req).await);
    assert_eq!(a.token_ids, b.token_ids);
    assert_eq!(a.token_ids.len(), 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_draft_node_is_abandoned_at_its_deadline_and_attached_again() {
    let (target, draft) = (stories(), stories_q8());
    let cluster = cluster(&target, Some(&draft), &LimitsArgs::default()).await;
    // The target behind a gate that closes when the draft stalls: the generation then goes on
    // a round at a time until the draft-node is attached again, however fast the machine.
    let target_proxy = FaultProxy::passing(cluster.target_addr);
    let gate = target_proxy.gate.clone();
    let target_url = target_proxy.serve().await;
    // The 8th step's reply is held for 20 s, once (re-attached sessions answer at once). Each
    // session's first step is counted: a second one is drafting after a re-attachment.
    let stalled = Arc::new(Mutex::new(None));
    let held = AtomicBool::new(false);
    let first_steps = Arc::new(AtomicUsize::new(0));
    let (on_stall, firsts, closing) =
        (Arc::clone(&stalled), Arc::clone(&first_steps), gate.clone());
    let proxy = DraftProxy::new(cluster.draft_addr.expect("draft"))
        .on_step(move |n, _| {
            if n == 1 {
                firsts.fetch_add(1, Ordering::SeqCst);
            }
            let mut stalled = on_stall.lock().expect("lock");
            if n == 8 && stalled.is_none() {
                *stalled = Some(Instant::now());
                closing.hold_after(0);
            }
        })
        .delay(move |n| {
            if n == 8 && !held.swap(true, Ordering::SeqCst) {
                Duration::from_secs(20)
            } else {
                Duration::ZERO
            }
        })
        .serve()
        .await;
    let engine = Engine::connect(&[target_url], &[proxy], Some(4), &Default::default())
        .await
        .expect("engine");
    let prompt = tokenizer(&target)
        .encode("Once upon a time")
        .expect("encode");
    let request = adaptive(&prompt, 480, Some(4), "model");
    let generation = tokio::spawn(async move { generate(&engine, &request).await });
    // The stalled step abandoned: the generation goes on without the draft, to the gate.
    gate.held().await;
    let abandoned_after = stalled.lock().expect("lock").expect("stalled").elapsed();
    assert!(
        abandoned_after < Duration::from_secs(15),
        "the stalled step was not awaited its 20 s: {abandoned_after:?}"
    );
    rounds_until(&gate, "the draft-node attached again and drafting", || {
        first_steps.load(Ordering::SeqCst) >= 2
    })
    .await;
    gate.open();
    let out = generation.await.expect("the generation's task");
    assert_eq!(out.token_ids, target_only(&target, &prompt, 480));
    let s = &out.stats;
    assert_eq!(s.draft_stalls, 1, "{}", describe(&out));
    assert!(
        !s.draft_lost,
        "a stall is not a loss: {}",
        s.draft_lost_reason
    );
    assert!(s.draft_reattached >= 1, "{}", describe(&out));
    // Drafting resumed after the re-attachment: more model rounds than the 7 before the stall.
    assert!(s.model_rounds > 7, "{}", describe(&out));
}

/// A chain stopped where the draft is unsure (issue 33, `draft_min_confidence`): a bound cuts
/// chains short and the output stays target-only's (so does the stop the policy learns where
/// the request sets none: the tests above); a bound outside [0, 1] is refused.
#[tokio::test]
async fn chains_cut_where_the_draft_is_unsure_keep_greedy_output_equal_to_target_only() {
    let (target, draft) = (stories(), stories_q8());
    let cluster = cluster(&target, Some(&draft), &LimitsArgs::default()).await;
    let engine = cluster.engine(None).await.expect("engine");
    let prompt = tokenizer(&target)
        .encode("Tom and Sue went")
        .expect("encode");
    let expected = target_only(&target, &prompt, 120);
    let cut = |bound: f32| v1::GenerateRequest {
        draft_min_confidence: Some(bound),
        ..adaptive(&prompt, 120, Some(6), "model")
    };
    let mut drafted = Vec::new();
    for bound in [0.0, 0.9] {
        let out = generate(&engine, &cut(bound)).await;
        assert_eq!(out.token_ids, expected, "bound {bound}: {}", describe(&out));
        let s = &out.stats;
        assert!(s.model_rounds > 0, "{}", describe(&out));
        drafted.push(s.base.drafted as f64 / f64::from(s.model_rounds));
    }
    assert!(
        drafted[1] < drafted[0] && drafted[1] >= 1.0,
        "drafts per model round, uncut and cut at 0.9: {drafted:?}"
    );
    let refused = engine.prepare(&cut(1.5));
    let message = format!("{:?}", refused.expect_err("a bound past 1"));
    assert!(message.contains("draft_min_confidence"), "{message}");
}

#[tokio::test]
async fn an_engine_times_its_nodes_before_the_first_request_in_a_prefix_of_its_own() {
    use tandem_coordinator::engine::warm_up::{WARM_UP_TEXT, WarmUp};
    let (target, draft) = (stories(), stories_q8());
    let cluster = cluster(&target, Some(&draft), &LimitsArgs::default()).await;
    let engine = cluster.engine(None).await.expect("engine");
    match engine.warm_up().await.expect("warm-up") {
        WarmUp::Timed {
            target: step,
            beside,
            draft: drafted,
            k,
        } => assert!(
            step > 0.0 && beside > 0.0 && drafted > 0.0 && k > 0,
            "{step} {beside} {drafted} {k}"
        ),
        WarmUp::Skipped => panic!("an adaptive engine with a draft-node warms up"),
    }
    // What it timed is what the next lone session starts from: nothing left to time.
    assert_eq!(engine.warm_up().await.expect("again"), WarmUp::Skipped);
    // Nothing to time where requests' K is fixed or there is no draft-node.
    let fixed = cluster.engine(Some(4)).await.expect("engine");
    assert_eq!(fixed.warm_up().await.expect("fixed K"), WarmUp::Skipped);
    let alone = tandem_tests::cluster(&target, None, &LimitsArgs::default()).await;
    let alone = alone.engine(None).await.expect("engine");
    assert_eq!(alone.warm_up().await.expect("no draft"), WarmUp::Skipped);
    // Its sessions left no prefix a tenant finds: the same text is new to a request, and the
    // request's own entries are found by the next (so this check can fail).
    let prompt = tokenizer(&target).encode(WARM_UP_TEXT).expect("encode");
    let expected = target_only(&target, &prompt, 40);
    let first = generate(&engine, &adaptive(&prompt, 40, None, "")).await;
    assert_eq!(first.token_ids, expected, "{}", describe(&first));
    assert_eq!(
        first.stats.cached_tokens, 0,
        "the warm-up's prefix is its own"
    );
    let second = generate(&engine, &adaptive(&prompt, 40, None, "")).await;
    assert_eq!(second.token_ids, expected, "{}", describe(&second));
    assert!(
        second.stats.cached_tokens > 0,
        "a tenant finds its own prefix"
    );
}
