//! A chain of drafts that stops where the draft is unsure (issue 33,
//! [`ProposeJob::min_confidence`]): it stops before the first draft past its first that the
//! draft's model gives less than the bound, its drafts are those of the uncut chain, the draft's
//! cache stays in step, greedy decoding through cut chains is target-only's, and sampled output
//! still follows the target's distribution.

mod common;

use common::*;
use tandem_runtime::quantize::QuantType;
use tandem_runtime::sampling::distribution;
use tandem_runtime::speculative::ProposeJob;
use tandem_runtime::{Distribution, Drafter, Logits, Proposal, SamplingParams, Verifier};

fn propose(drafter: &mut Drafter, log: &[u32], k: usize, min_confidence: f32) -> Proposal {
    let mut jobs = [ProposeJob {
        drafter,
        log,
        k,
        branches: 0,
        min_confidence,
    }];
    Drafter::propose_batch(&mut jobs)
        .remove(0)
        .expect("proposal")
}

#[test]
fn a_chain_stops_before_the_first_unsure_draft_and_decodes_as_target_only() {
    let target = load(&stories_dir());
    let draft = load(&stories_gguf(QuantType::Q4_0));
    let prompt = &story_tokens()[..8];
    let (k, bound) = (6, 0.6);
    let mut drafter = Drafter::new(&draft, SamplingParams::greedy());
    let mut verifier = Verifier::new(&target, SamplingParams::greedy());
    verifier.prefill(prompt).expect("prefill");
    let mut plain = Verifier::new(&target, SamplingParams::greedy());
    plain.prefill(prompt).expect("prefill");
    let (mut log, mut cut, mut rounds) = (prompt.to_vec(), 0, 0);
    while log.len() < prompt.len() + 80 {
        let proposal = propose(&mut drafter, &log, k, bound);
        // The uncut chain, from a fresh draft: the cut chain is its drafts up to the first past
        // the first below the bound, with the same confidences.
        let mut fresh = Drafter::new(&draft, SamplingParams::greedy());
        fresh.prefill(&log).expect("prefill");
        let whole = propose(&mut fresh, &log, k, 0.0);
        assert_eq!(whole.tokens.len(), k);
        assert_eq!(whole.confidence.len(), k);
        assert!(whole.confidence.iter().all(|&c| c > 0.0 && c <= 1.0));
        let stop = (1..k).find(|&i| whole.confidence[i] < bound).unwrap_or(k);
        assert_eq!(proposal.tokens, whole.tokens[..stop]);
        assert_eq!(proposal.confidence, whole.confidence[..stop]);
        cut += usize::from(stop < k);
        rounds += 1;
        let v = verifier
            .verify(&log, &proposal.tokens, &proposal.q, k)
            .expect("verify");
        log.extend(&proposal.tokens[..v.verdict.accepted]);
        log.push(v.verdict.next);
    }
    assert!(cut > 0 && cut < rounds, "{cut} of {rounds} chains cut");
    // Greedy through cut chains: target-only's text.
    let mut want = prompt.to_vec();
    while want.len() < log.len() {
        let v = plain.verify(&want, &[], &[], 0).expect("step");
        want.push(v.verdict.next);
    }
    assert_eq!(log, want);
}

/// Sampled speculation (temperature 1, a pair whose draft is often unsure and often rejected) with chains of 3 cut at the
/// median confidence of a chain's second draft: the first two generated tokens follow the
/// target's distribution (chi-square at 0.999), about half of the chains cut.
#[test]
fn sampled_chains_cut_by_confidence_follow_the_target_distribution() {
    let (target, draft) = (load(&tiny_random(21)), load(&tiny_random(24)));
    let prompt = tokenizer().encode("Once upon a time").expect("encode");
    let sampling = |seed| SamplingParams {
        temperature: 1.0,
        seed,
        ..Default::default()
    };
    let mut seconds: Vec<f32> = (0..200)
        .map(|seed| {
            let mut d = Drafter::new(&draft, sampling(seed));
            propose(&mut d, &prompt, 3, 0.0).confidence[1]
        })
        .collect();
    seconds.sort_by(f32::total_cmp);
    let bound = seconds[seconds.len() / 2];
    let (mut pairs, mut cut, mut rounds, mut rejected) = (Vec::new(), 0, 0, 0);
    for seed in 0..12_000u64 {
        let mut drafter = Drafter::new(&draft, sampling(seed));
        let mut verifier = Verifier::new(&target, sampling(seed));
        verifier.prefill(&prompt).expect("prefill");
        let mut log = prompt.clone();
        while log.len() < prompt.len() + 2 {
            let proposal = propose(&mut drafter, &log, 3, bound);
            cut += usize::from(proposal.tokens.len() < 3);
            rounds += 1;
            let v = verifier
                .verify(&log, &proposal.tokens, &proposal.q, 3)
                .expect("verify");
            rejected += usize::from(v.verdict.accepted < proposal.tokens.len());
            log.extend(&proposal.tokens[..v.verdict.accepted]);
            log.push(v.verdict.next);
        }
        pairs.push((log[prompt.len()], log[prompt.len() + 1]));
    }
    assert!(
        cut * 5 > rounds && cut * 5 < rounds * 4,
        "{cut} of {rounds} chains cut"
    );
    assert!(
        rejected * 10 > rounds,
        "{rejected} of {rounds} rounds rejected a draft"
    );
    let exact = |context: &[u32]| -> Vec<f32> {
        let rows = target
            .forward(context, &mut target.new_cache(), Logits::Last)
            .expect("forward");
        match distribution(&rows[0], &sampling(0), context).expect("finite logits") {
            Distribution::Dense(p) => p,
            other => panic!("expected dense, got {other:?}"),
        }
    };
    assert_first_two_follow(&pairs, &prompt, exact, "chains cut by confidence");
}
