//! Token trees across the services (issue 31): the draft-node grows trees where the
//! coordinator asks (a fixed number, or as many as the policy expects to pay), the target-node
//! verifies the tree in one pass, and the generation is exactly target-only's; concurrent
//! sessions' trees and chains are verified together in one forward pass.

use std::sync::Arc;

use tandem_coordinator::engine::Outcome;
use tandem_node::LimitsArgs;
use tandem_runtime::SamplingParams;
use tandem_runtime::quantize::{QuantType, quantize_to_gguf};
use tandem_tests::*;

/// A Q4_0 copy of the story model in `dir`: a draft often right, sometimes second-best.
fn q4_draft(dir: &std::path::Path) -> std::path::PathBuf {
    let draft = dir.join("stories260K-q4_0.gguf");
    quantize_to_gguf(&stories(), &draft, QuantType::Q4_0).expect("quantize");
    draft
}

#[tokio::test(flavor = "multi_thread")]
async fn trees_of_drafts_generate_target_only_text() {
    let dir = tempfile::tempdir().expect("temp dir");
    let draft = q4_draft(dir.path());
    let cluster = cluster(&stories(), Some(&draft), &LimitsArgs::default()).await;
    let engine = patient_engine(&cluster, 4).await;
    let prompt = tokenizer(&stories())
        .encode("Once upon a time")
        .expect("encode");
    let greedy = SamplingParams::greedy();
    let alone = generate(&engine, &request(&prompt, 96, 0, &greedy)).await;
    let run = async |k: u32, branches: Option<u32>| -> Outcome {
        let mut req = request(&prompt, 96, k, &greedy);
        req.draft_branches = branches;
        req.drafter = "model".into();
        generate(&engine, &req).await
    };
    let (mut trees, mut hits) = (0, 0);
    for (k, branches) in [(4, Some(3)), (8, Some(8)), (3, Some(1))] {
        let out = run(k, branches).await;
        assert_eq!(
            out.token_ids, alone.token_ids,
            "K = {k}, {branches:?} siblings"
        );
        assert!(out.stats.tree_rounds > 0, "K = {k}: no round was a tree");
        trees += out.stats.tree_rounds;
        hits += out.stats.sibling_hits;
    }
    assert!(hits > 0, "no sibling committed in {trees} tree rounds");
    // The n-gram drafter's trees: the other earlier continuations of the text's last tokens.
    let repeats = tokenizer(&stories())
        .encode("Tom had a cat. Tom had a dog. Tom had a hat. Tom had a")
        .expect("encode");
    let mut req = request(&repeats, 48, 4, &greedy);
    let reference = generate(&engine, &request(&repeats, 48, 0, &greedy)).await;
    (req.drafter, req.draft_branches) = ("ngram".into(), Some(4));
    let out = generate(&engine, &req).await;
    assert_eq!(out.token_ids, reference.token_ids, "n-gram trees");
    assert!(out.stats.tree_rounds > 0, "no n-gram round was a tree");
    // Fixed K without siblings stays a chain.
    let chain = run(4, None).await;
    assert_eq!(chain.token_ids, alone.token_ids);
    assert_eq!(chain.stats.tree_rounds, 0);
    // More siblings than drafts, or past the nodes' limit together: refused, naming the field.
    for (k, branches) in [(2, 3), (8, 20)] {
        let mut req = request(&prompt, 8, k, &greedy);
        req.draft_branches = Some(branches);
        let err = engine.prepare(&req).expect_err("too many siblings");
        assert!(err.to_string().contains("draft_branches"), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_trees_and_chains_equal_the_same_requests_alone() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cluster = cluster(
        &stories(),
        Some(&q4_draft(dir.path())),
        &LimitsArgs::default(),
    )
    .await;
    let engine = Arc::new(patient_engine(&cluster, 4).await);
    let tok = tokenizer(&stories());
    let texts = [
        "Once upon a time",
        "Tom and Sue went",
        "The cat",
        "Lily saw a",
    ];
    // Trees of several shapes and chains, greedy and sampled, side by side.
    let requests: Vec<_> = (0..8u32)
        .map(|i| {
            let prompt = tok.encode(texts[i as usize % texts.len()]).expect("encode");
            let sampling = match i % 3 {
                2 => sampled(u64::from(i)),
                _ => SamplingParams::greedy(),
            };
            let mut req = request(&prompt, 48, 2 + i % 5, &sampling);
            req.draft_branches = (i % 2 == 0).then_some(1 + i % 3);
            req.drafter = "model".into();
            req
        })
        .collect();
    let together = generate_concurrently(&engine, &requests).await;
    let mut trees = 0;
    for (req, concurrent) in requests.iter().zip(&together) {
        let alone = generate(&engine, req).await;
        assert_eq!(
            concurrent.token_ids, alone.token_ids,
            "{:?}",
            req.draft_branches
        );
        trees += concurrent.stats.tree_rounds;
    }
    assert!(trees > 0, "no round was a tree");
    assert_target_batched(&cluster);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trees_chain_is_drafted_past_during_the_verify() {
    // A draft often right, sometimes second-best: most rounds are trees (some are one path,
    // sent as a chain); while the target verifies one, the draft-node drafts past its chain,
    // used by the next round where the chain was accepted whole and the guess was right.
    // The target 50 ms away ([`engine_far_target`]), so that the draft drafts ahead.
    let dir = tempfile::tempdir().expect("temp dir");
    let draft = q4_draft(dir.path());
    let cluster = cluster(&stories(), Some(&draft), &LimitsArgs::default()).await;
    let (_link, engine) = engine_far_target(&cluster, 4).await;
    let prompt = tokenizer(&stories())
        .encode("Once upon a time")
        .expect("encode");
    let greedy = SamplingParams::greedy();
    let alone = in_process(&stories(), None, &request(&prompt, 96, 0, &greedy));
    let mut req = request(&prompt, 96, 4, &greedy);
    (req.drafter, req.draft_branches) = ("model".into(), Some(2));
    let out = generate(&engine, &req).await;
    assert_eq!(out.token_ids, alone.token_ids);
    let st = out.stats;
    let chains = st.base.rounds as u32 - st.tree_rounds;
    assert!(
        st.pipeline_rounds > chains && st.pipeline_hits > 0,
        "{} rounds, {} trees: {} blocks drafted during a verify, {} used",
        st.base.rounds,
        st.tree_rounds,
        st.pipeline_rounds,
        st.pipeline_hits
    );
    // Sampled, a seeded generation is the same whether blocks were drafted ahead or not: a
    // sampled tree is not drafted past (the tree drafted ahead would not be the one the next
    // step grows); a sampled chain is (it is the chain the step draws).
    for branches in [Some(2), None] {
        let mut req = request(&prompt, 96, 4, &sampled(3));
        (req.drafter, req.draft_branches) = ("model".into(), branches);
        let out = generate(&engine, &req).await;
        req.pipeline = Some(false);
        let serial = generate(&engine, &req).await;
        assert_eq!(out.token_ids, serial.token_ids, "{branches:?} branches");
        if branches.is_some() {
            assert_eq!(out.stats.pipeline_rounds, 0, "a sampled tree drafted past");
        }
    }
}
