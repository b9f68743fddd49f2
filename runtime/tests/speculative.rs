//! Losslessness: greedy speculative output equals target-only greedy output, and sampled
//! speculative output is distributed as target sampling.

mod common;

use common::*;
use tandem_runtime::quantize::QuantType;
use tandem_runtime::{GenerateRequest, Generation, Model, SamplingParams, SpeculativeGenerator};

fn request(
    prompt: &str,
    max_new_tokens: usize,
    k: usize,
    sampling: SamplingParams,
) -> GenerateRequest {
    GenerateRequest {
        prompt: tokenizer().encode(prompt).expect("encode"),
        max_new_tokens,
        sampling,
        draft_tokens: k,
        // No stop tokens: random models may emit BOS/EOS early, and every token is compared.
        stop_token_ids: vec![],
        stop_strings: vec![],
    }
}

fn run(target: &Model, draft: Option<&Model>, req: &GenerateRequest) -> Generation {
    let tok = tokenizer();
    SpeculativeGenerator::new(target, draft, &tok)
        .expect("generator")
        .generate(req, |_| {})
        .expect("generate")
}

/// Greedy speculative output must equal target-only greedy output token for token, whatever
/// the draft proposes. Returns the acceptance rate at K = 4.
fn assert_greedy_lossless(target: &Model, draft: &Model, prompts: &[&str]) -> f64 {
    let mut alpha = 0.0;
    for prompt in prompts {
        let baseline = run(
            target,
            None,
            &request(prompt, 60, 0, SamplingParams::greedy()),
        );
        assert_eq!(baseline.token_ids.len(), 60);
        assert_eq!(baseline.stats.drafted, 0);
        for k in [1, 2, 4, 8] {
            let spec = run(
                target,
                Some(draft),
                &request(prompt, 60, k, SamplingParams::greedy()),
            );
            assert_eq!(
                spec.token_ids, baseline.token_ids,
                "K = {k}, prompt {prompt:?}"
            );
            assert_eq!(spec.text, baseline.text);
            // Every round commits its accepted drafts plus one token.
            assert_eq!(spec.stats.accepted + spec.stats.rounds, 60, "K = {k}");
            if k == 4 {
                alpha = spec.stats.acceptance_rate();
            }
        }
    }
    alpha
}

#[test]
fn greedy_speculative_equals_target_only_low_acceptance_pair() {
    let (target, draft) = (load(&tiny_random(11)), load(&tiny_random(12)));
    let alpha = assert_greedy_lossless(&target, &draft, &["Once upon a time", "The cat"]);
    assert!(
        alpha < 0.5,
        "two unrelated random models should rarely agree: α = {alpha}"
    );
}

#[test]
fn greedy_speculative_equals_target_only_high_acceptance_pair() {
    let (target, draft) = (load(&stories_dir()), load(&stories_gguf(QuantType::Q8_0)));
    let alpha = assert_greedy_lossless(&target, &draft, &["Once upon a time", "Tom and Sue went"]);
    assert!(alpha > 0.8, "a Q8_0 copy should mostly agree: α = {alpha}");
}

#[test]
fn stop_tokens_stop_strings_and_max_tokens() {
    let target = load(&stories_dir());
    let draft = load(&stories_gguf(QuantType::Q8_0));
    let tok = tokenizer();
    let mut req = request("Once upon a time", 200, 4, SamplingParams::greedy());
    req.stop_token_ids = tandem_runtime::default_stop_tokens(&target, &tok);
    assert!(req.stop_token_ids.contains(&1) && req.stop_token_ids.contains(&2));
    let full = run(&target, Some(&draft), &req);
    assert!(
        full.text
            .starts_with(&REFERENCE_STORY["Once upon a time".len()..])
    );
    assert!(
        !full
            .token_ids
            .iter()
            .any(|t| req.stop_token_ids.contains(t))
    );

    let mut streamed = Vec::new();
    req.stop_strings = vec!["Lily".into()];
    let cut = SpeculativeGenerator::new(&target, Some(&draft), &tok)
        .expect("generator")
        .generate(&req, |t| streamed.extend_from_slice(t))
        .expect("generate");
    assert_eq!(cut.text, ", there was a little girl named ");
    assert_eq!(cut.finish_reason, tandem_runtime::FinishReason::Stop);
    assert_eq!(
        streamed, cut.token_ids,
        "the callback sees exactly the committed tokens"
    );

    req.stop_strings.clear();
    req.max_new_tokens = 7;
    let short = run(&target, Some(&draft), &req);
    assert_eq!(short.token_ids.len(), 7);
    assert_eq!(short.finish_reason, tandem_runtime::FinishReason::Length);
    assert_eq!(short.token_ids, full.token_ids[..7]);
}

/// Speculative sampling at temperature 1 on a low-acceptance pair (many rejections, so the
/// residual rule is exercised): the first generated token must follow the target's p exactly,
/// and the second, given the most frequent first, the target's conditional p.
#[test]
fn sampled_speculative_tokens_follow_target_distribution() {
    let (target, draft) = (load(&tiny_random(21)), load(&tiny_random(22)));
    let sampling = SamplingParams {
        temperature: 1.0,
        ..Default::default()
    };
    let prompt = tokenizer().encode("Once upon a time").expect("encode");
    let n = 12_000u64;
    let mut pairs: Vec<(u32, u32)> = Vec::new();
    let mut drafted = 0;
    let mut accepted = 0;
    for seed in 0..n {
        let mut req = request(
            "Once upon a time",
            3,
            2,
            SamplingParams {
                seed,
                ..sampling.clone()
            },
        );
        req.prompt = prompt.clone();
        let out = run(&target, Some(&draft), &req);
        pairs.push((out.token_ids[0], out.token_ids[1]));
        drafted += out.stats.drafted;
        accepted += out.stats.accepted;
    }
    let alpha = accepted as f64 / drafted as f64;
    assert!(
        alpha > 0.02 && alpha < 0.9,
        "both accept and reject paths must occur: α = {alpha}"
    );

    let exact = |context: &[u32]| target_distribution(&target, &sampling, context);
    assert_first_two_follow(&pairs, &prompt, exact, "speculative sampling");
}

#[test]
fn same_seed_same_sampled_output() {
    let (target, draft) = (load(&stories_dir()), load(&stories_gguf(QuantType::Q4_0)));
    let sampling = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        seed: 7,
        ..Default::default()
    };
    let a = run(
        &target,
        Some(&draft),
        &request("Once upon a time", 40, 4, sampling.clone()),
    );
    let b = run(
        &target,
        Some(&draft),
        &request("Once upon a time", 40, 4, sampling.clone()),
    );
    assert_eq!(a.token_ids, b.token_ids);
    let c = run(
        &target,
        Some(&draft),
        &request(
            "Once upon a time",
            40,
            4,
            SamplingParams {
                seed: 8,
                ..sampling
            },
        ),
    );
    assert_ne!(
        a.token_ids, c.token_ids,
        "another seed should give another story"
    );
}

/// A draft asked for no tokens catches its cache up with the log; its next proposal is the one
/// a draft that never paused would make, whatever the gap was.
#[test]
fn a_catch_up_step_leaves_the_next_proposal_unchanged() {
    use tandem_runtime::speculative::Drafter;
    let model = load(&stories_dir());
    let log = tokenizer()
        .encode("Once upon a time, there was a little girl who loved to play outside")
        .expect("encode");
    let params = SamplingParams {
        temperature: 0.9,
        seed: 3,
        ..SamplingParams::default()
    };
    let (prompt, rest) = log.split_at(3);
    let mut steady = Drafter::new(&model, params.clone());
    steady.prefill(prompt).expect("prefill");
    let mut paused = Drafter::new(&model, params);
    paused.prefill(prompt).expect("prefill");
    // A sequence's cache holds all but its last token, which the next proposal feeds.
    assert_eq!(paused.cached_tokens(), prompt.len() - 1);
    let caught_up = paused.propose(&log, 0).expect("catch up");
    assert!(caught_up.tokens.is_empty() && caught_up.q.is_empty());
    assert_eq!(paused.cached_tokens(), prompt.len() + rest.len() - 1);
    assert_eq!(
        paused.propose(&log, 4).expect("propose"),
        steady.propose(&log, 4).expect("propose")
    );
}
