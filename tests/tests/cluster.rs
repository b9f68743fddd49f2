//! The in-process cluster: target-node and draft-node on 127.0.0.1:0, the coordinator's engine
//! in the test. Distributed output must equal target-only and the in-process generator.

use std::path::Path;
use std::sync::Arc;

use tandem_node::LimitsArgs;
use tandem_proto::v1;
use tandem_runtime::SamplingParams;
use tandem_tests::*;

fn prompt(text: &str) -> Vec<u32> {
    tokenizer(&stories()).encode(text).expect("encode")
}

/// Greedy distributed output equals target-only greedy and the in-process generator for
/// K ∈ {1, 2, 4, 8}. Returns α at K = 4.
async fn assert_greedy_lossless(target: &Path, draft: &Path) -> f64 {
    let cluster = cluster(target, Some(draft), &LimitsArgs::default()).await;
    let engine = patient_engine(&cluster, 4).await;
    let greedy = SamplingParams::greedy();
    let mut alpha = 0.0;
    for text in ["Once upon a time", "Tom and Sue went"] {
        let p = prompt(text);
        let baseline = in_process(target, None, &request(&p, 48, 0, &greedy));
        assert_eq!(baseline.token_ids.len(), 48);
        let target_only = generate(&engine, &request(&p, 48, 0, &greedy)).await;
        assert_eq!(
            target_only.token_ids, baseline.token_ids,
            "target-only over gRPC"
        );
        assert_eq!(target_only.stats.base.drafted, 0);
        for k in [1, 2, 4, 8] {
            // Whole chains, as the in-process generator drafts (the engine's learned stop would
            // end some early: same text, other rounds).
            let req = v1::GenerateRequest {
                draft_min_confidence: Some(0.0),
                ..request(&p, 48, k, &greedy)
            };
            let distributed = generate(&engine, &req).await;
            let local = in_process(target, Some(draft), &req);
            assert_eq!(
                distributed.token_ids, baseline.token_ids,
                "K = {k}, {text:?}"
            );
            assert_eq!(distributed.text, baseline.text);
            assert_eq!(distributed.stats.base.rounds, local.stats.rounds, "K = {k}");
            assert_eq!(
                distributed.stats.base.accepted, local.stats.accepted,
                "K = {k}"
            );
            assert_eq!(distributed.stats.repairs, 0);
            assert!(!distributed.stats.draft_lost);
            if k == 4 {
                alpha = distributed.stats.base.acceptance_rate();
            }
        }
    }
    alpha
}

#[tokio::test]
async fn greedy_distributed_equals_target_only_high_acceptance_pair() {
    let alpha = assert_greedy_lossless(&stories(), &stories_q8()).await;
    assert!(alpha > 0.8, "a Q8_0 copy should mostly agree: α = {alpha}");
}

#[tokio::test]
async fn greedy_distributed_equals_target_only_low_acceptance_pair() {
    let alpha = assert_greedy_lossless(&random_model(11), &random_model(12)).await;
    assert!(
        alpha < 0.5,
        "unrelated random models should rarely agree: α = {alpha}"
    );
}

#[tokio::test]
async fn seeded_sampling_equals_the_in_process_generator() {
    let (target, draft) = (stories(), stories_q8());
    let cluster = cluster(&target, Some(&draft), &LimitsArgs::default()).await;
    let engine = patient_engine(&cluster, 4).await;
    let p = prompt("Once upon a time");
    let mut distinct = std::collections::HashSet::new();
    for seed in [1, 2, 3] {
        for k in [0, 3, 6] {
            let req = request(&p, 40, k, &sampled(seed));
            let distributed = generate(&engine, &req).await;
            let local = in_process(&target, Some(&draft), &req);
            assert_eq!(
                distributed.token_ids, local.token_ids,
                "seed {seed}, K = {k}"
            );
            assert_eq!(distributed.stats.base.accepted, local.stats.accepted);
            distinct.insert(distributed.token_ids);
        }
    }
    assert!(
        distinct.len() > 1,
        "different seeds should sample different stories"
    );
    // Presence and frequency penalties shape p and q alike, distributed as in process.
    let penalised = SamplingParams {
        presence_penalty: 0.8,
        frequency_penalty: 0.4,
        ..sampled(5)
    };
    let req = request(&p, 60, 4, &penalised);
    let distributed = generate(&engine, &req).await;
    assert_eq!(
        distributed.token_ids,
        in_process(&target, Some(&draft), &req).token_ids
    );
    let plain = generate(&engine, &request(&p, 60, 4, &sampled(5))).await;
    assert_ne!(distributed.token_ids, plain.token_ids, "the penalties act");
}

#[tokio::test]
async fn eight_concurrent_sessions_equal_the_same_requests_alone() {
    let (target, draft) = (stories(), stories_q8());
    let cluster = cluster(&target, Some(&draft), &LimitsArgs::default()).await;
    let engine = Arc::new(patient_engine(&cluster, 4).await);
    let texts = [
        "Once upon a time",
        "Tom and Sue went",
        "The cat",
        "Lily saw a",
    ];
    let requests: Vec<v1::GenerateRequest> = (0..8u32)
        .map(|i| {
            let p = prompt(texts[i as usize % texts.len()]);
            let sampling = if i % 2 == 0 {
                SamplingParams::greedy()
            } else {
                sampled(u64::from(i))
            };
            request(&p, 40 + 4 * i, 1 + i % 5, &sampling)
        })
        .collect();
    let together = generate_concurrently(&engine, &requests).await;
    for (req, concurrent) in requests.iter().zip(&together) {
        let alone = generate(&engine, req).await;
        assert_eq!(concurrent.token_ids.len(), req.max_tokens as usize);
        // A sampled token depends on the draft it was verified against (the acceptance rule
        // is exact in distribution, not draw for draw): the engine is patient with draft steps,
        // so that none is abandoned on a loaded machine and both runs draft alike.
        assert_eq!(concurrent.token_ids, alone.token_ids);
    }
    // The target verified blocks of several sessions in one forward pass.
    assert_target_batched(&cluster);
    for addr in [cluster.target_addr, cluster.draft_addr.expect("draft")] {
        assert!(
            eventually(async || node_info(addr).await.active_sessions == 0).await,
            "sessions are freed after the generations end"
        );
    }
}

#[tokio::test]
async fn a_prompt_near_the_context_is_prefilled_in_chunks_beside_another_session() {
    // stories260K's context is 512: a 480-token prompt, fed 16 tokens per forward pass, while a
    // short generation runs on the same nodes; both equal the in-process generator.
    let (target, draft) = (stories(), stories_q8());
    let limits = LimitsArgs {
        prefill_chunk: 16,
        ..LimitsArgs::default()
    };
    let cluster = cluster(&target, Some(&draft), &limits).await;
    let engine = Arc::new(patient_engine(&cluster, 4).await);
    let story = prompt("Once upon a time, there was a little girl named Lily. She loved to play.");
    let long: Vec<u32> = story.iter().copied().cycle().take(480).collect();
    let requests = [
        request(&long, 24, 4, &SamplingParams::greedy()),
        request(&prompt("The cat"), 60, 2, &SamplingParams::greedy()),
    ];
    let together = generate_concurrently(&engine, &requests).await;
    for (req, out) in requests.iter().zip(together) {
        assert_eq!(
            out.token_ids,
            in_process(&target, Some(&draft), req).token_ids
        );
    }
    // 479 prompt tokens before the last, 16 at a time: at least 30 chunks on each node.
    for node in [&cluster.target, cluster.draft.as_ref().expect("draft")] {
        let chunks = node.metrics.prefill_chunks.get();
        assert!(chunks >= 30, "{chunks} prefill chunks");
    }
}

#[tokio::test]
async fn a_draft_with_a_different_vocabulary_is_refused_at_connect_time() {
    let limits = LimitsArgs::default();
    let cluster = cluster(&stories(), Some(&foreign_vocab_model()), &limits).await;
    let err = cluster
        .engine(4)
        .await
        .expect_err("a foreign vocabulary is refused");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    let msg = err.to_string();
    assert!(
        msg.contains("vocabularies differ") && msg.contains("vocabulary hash"),
        "{msg}"
    );
}

/// Blocks the target-node's model thread at the generation's first commit (as other sessions'
/// work holds it), until the test releases it.
struct BlockAtFirstCommit {
    node: Arc<tandem_node::NodeState>,
    release: Option<std::sync::mpsc::Receiver<()>>,
}

impl tandem_coordinator::CommitSink for BlockAtFirstCommit {
    async fn send(
        &mut self,
        _: &tandem_runtime::Commit,
        _: &[tandem_runtime::sampling::TokenLogprobs],
    ) -> bool {
        if let Some(release) = self.release.take() {
            let node = Arc::clone(&self.node);
            tokio::spawn(async move { node.worker.run(move || release.recv()).await });
        }
        true
    }
}

/// A target call later than its deadline on a node that works on it (its verify queued behind
/// the model's other work) is waited for, not taken for lost: the generation goes on once the
/// model is free, exact, its session never replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_call_the_node_works_on_is_waited_for_not_replayed() {
    let cluster = cluster(&stories(), None, &LimitsArgs::default()).await;
    let mut engine = cluster.engine(0).await.expect("engine");
    engine.call_floor = std::time::Duration::from_millis(200);
    let engine = Arc::new(engine);
    let greedy = SamplingParams::greedy();
    let req = request(&prompt("Once upon a time"), 64, 0, &greedy);
    let (release, released) = std::sync::mpsc::channel();
    let job = engine.prepare(&req).expect("job");
    let e = Arc::clone(&engine);
    let mut sink = BlockAtFirstCommit {
        node: Arc::clone(&cluster.target),
        release: Some(released),
    };
    let task = tokio::spawn(async move { e.generate(&job, &mut sink).await });
    let late = &engine.metrics.target_late_calls;
    assert!(
        eventually(async || late.get() >= 2).await,
        "the late verify waited for (twice past its deadline)"
    );
    release.send(()).expect("the model held");
    let out = within("the generation", task)
        .await
        .expect("task")
        .expect("generated");
    assert_eq!(out.stats.repairs, 0, "no session replayed");
    let alone = in_process(&stories(), None, &req);
    assert_eq!(out.token_ids, alone.token_ids);
}

#[tokio::test]
async fn the_reported_times_add_up_and_drafting_ahead_is_counted_once() {
    let (target, draft) = (stories(), stories_q8());
    let cluster = cluster(&target, Some(&draft), &LimitsArgs::default()).await;
    // The nodes as other processes (an engine connected to them, not the in-process cluster's
    // own, whose passes take turns on the same cores and draft nothing ahead: below), the
    // target 50 ms away ([`engine_far_target`]): beside the target's own verify, a draft step
    // slowed by a loaded machine to 9 ms against a 1 ms verify was, rightly, not drafted ahead,
    // and no block was.
    let (_link, engine) = engine_far_target(&cluster, 4).await;
    // A draft that agrees with the target: every draft accepted, blocks drafted during the
    // verify are used.
    let req = request(
        &prompt("Once upon a time"),
        96,
        4,
        &SamplingParams::greedy(),
    );
    let out = generate(&engine, &req).await;
    // Where the passes take turns on this process's cores, a fixed K drafts nothing ahead (it
    // would run after the verify, one pass longer than the next block): the same text.
    let local = generate(&patient_engine(&cluster, 4).await, &req).await;
    assert_eq!(
        local.stats.pipeline_rounds, 0,
        "drafted ahead on shared cores"
    );
    assert!(local.stats.model_rounds > 0, "{:?}", local.stats);
    assert_eq!(local.token_ids, out.token_ids);
    let st = tandem_coordinator::service::stats_to_wire(&out);
    assert!(
        st.pipeline_rounds > 0,
        "no block was drafted during a verify: {st:?}"
    );
    let during_verify = st.draft_seconds - st.draft_waited_seconds;
    assert!(
        during_verify > 0.0,
        "drafting during the verify was not counted apart: {st:?}"
    );
    assert!(
        st.draft_waited_seconds > 0.0 && st.target_seconds > 0.0,
        "{st:?}"
    );
    assert!(st.overhead_seconds() >= 0.0, "a negative overhead: {st:?}");
    assert!(
        st.draft_waited_seconds + st.target_seconds <= st.decode_seconds,
        "the nodes' waited-for compute exceeds the decode time: {st:?}"
    );
}

/// A target reply still on its way when its call's deadline passes is waited for, not taken
/// for lost: the target-node sits farther than the deadline (a 400 ms round trip against a
/// 100 ms floor), so the first verify's reply arrives after it, when the node, asked, has
/// answered the verify and works on nothing. The node says so; the generation goes on exact,
/// its session never replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_on_its_way_at_the_deadline_is_waited_for_not_replayed() {
    let cluster = cluster(&stories(), None, &LimitsArgs::default()).await;
    let link = target_behind(&cluster, std::time::Duration::from_millis(400)).await;
    let mut engine = tandem_coordinator::engine::Engine::connect(
        &[link.url()],
        &[],
        Some(0),
        &Default::default(),
    )
    .await
    .expect("engine");
    engine.call_floor = std::time::Duration::from_millis(100);
    let req = request(&prompt("Once upon a time"), 4, 0, &SamplingParams::greedy());
    let out = generate(&engine, &req).await;
    assert!(
        engine.metrics.target_late_calls.get() >= 1,
        "the first verify's reply came after its deadline"
    );
    assert_eq!(out.stats.repairs, 0, "no session replayed");
    let alone = in_process(&stories(), None, &req);
    assert_eq!(out.token_ids, alone.token_ids);
}
