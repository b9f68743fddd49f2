//! Token trees across the services (issue 31): the draft-node adds sibling leaves where the
//! coordinator asks (a fixed number, or as many as the policy expects to pay), the target-node
//! verifies the tree in one pass, and the generation is exactly target-only's.

use tandem_coordinator::engine::Outcome;
use tandem_node::LimitsArgs;
use tandem_runtime::SamplingParams;
use tandem_runtime::quantize::{QuantType, quantize_to_gguf};
use tandem_tests::*;

#[tokio::test(flavor = "multi_thread")]
async fn trees_of_drafts_generate_target_only_text() {
    // A Q4_0 copy of the story model: a draft often right, sometimes second-best.
    let dir = tempfile::tempdir().expect("temp dir");
    let draft = dir.path().join("stories260K-q4_0.gguf");
    quantize_to_gguf(&stories(), &draft, QuantType::Q4_0).expect("quantize");
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
