//! A chain of drafts that stops where the draft is unsure (issue 33,
//! [`ProposeJob::min_confidence`]): it stops before the first draft past its first that the
//! draft's model gives less than the bound, its drafts are those of the uncut chain, the draft's
//! cache stays in step, greedy decoding through cut chains is target-only's, and sampled output
//! still follows the target's distribution (the stop reads the draft's confidence before it
//! draws).

mod common;

use common::*;
use tandem_runtime::quantize::QuantType;
use tandem_runtime::speculative::ProposeJob;
use tandem_runtime::{Drafter, Model, Proposal, SamplingParams, Verifier};

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

/// Sampled speculation (temperature 1) with chains of 3 cut where the draft is unsure: the first
/// two generated tokens follow the target's distribution (chi-square at 0.999). Twice: with a
/// draft that is often unsure and often rejected (5-95 % of its chains cut), and with the target
/// itself as the draft (q = p: every draft accepted, so a stop that favoured some draws over
/// others would show as their excess).
#[test]
fn sampled_chains_cut_by_confidence_follow_the_target_distribution() {
    let target = load(&tiny_random(21));
    let draft = load(&tiny_random(24));
    let prompt = tokenizer().encode("Once upon a time").expect("encode");
    let mut seconds: Vec<f32> = (0..200)
        .map(|seed| {
            let mut d = Drafter::new(&draft, sampling(seed));
            propose(&mut d, &prompt, 3, 0.0).confidence[1]
        })
        .collect();
    seconds.sort_by(f32::total_cmp);
    // Confidences come in lumps (a few contexts): the bound falls between the median's and
    // the next above it, so that the median's chains are cut.
    let median = seconds[seconds.len() / 2];
    let above = seconds.iter().copied().find(|&c| c > median).unwrap_or(1.0);
    let (cut, rounds) = assert_cut_chains_follow(&target, &draft, (median + above) / 2.0, true);
    assert!(
        cut * 20 > rounds && cut * 20 < rounds * 19,
        "{cut} of {rounds} chains cut"
    );
    // The target as its own draft, the bound between the two likeliest tokens after the
    // likeliest first: a stop that looked at the draw would send the likeliest second token
    // alone and let the target redraw the others, the likeliest then in excess.
    let after = [
        &prompt[..],
        &[argmax(&target_distribution(&target, &sampling(0), &prompt))],
    ]
    .concat();
    let mut p = target_distribution(&target, &sampling(0), &after);
    p.sort_by(|a, b| b.total_cmp(a));
    assert_cut_chains_follow(&target, &target, (p[0] + p[1]) / 2.0, false);
}

fn sampling(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        seed,
        ..Default::default()
    }
}

/// The target's sampling distribution after `context`.
fn argmax(p: &[f32]) -> u32 {
    (0..p.len())
        .max_by(|&a, &b| p[a].total_cmp(&p[b]))
        .expect("a token") as u32
}

/// Returns the chains cut, and all.
fn assert_cut_chains_follow(
    target: &Model,
    draft: &Model,
    bound: f32,
    rejects: bool,
) -> (usize, usize) {
    let prompt = tokenizer().encode("Once upon a time").expect("encode");
    let (mut pairs, mut cut, mut rounds, mut rejected) = (Vec::new(), 0, 0, 0);
    for seed in 0..12_000u64 {
        let mut drafter = Drafter::new(draft, sampling(seed));
        let mut verifier = Verifier::new(target, sampling(seed));
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
    let label = format!("chains cut at {bound}, rejecting drafts: {rejects}");
    assert!(
        cut > 0 && cut < rounds,
        "{label}: {cut} of {rounds} chains cut"
    );
    assert_eq!(
        rejected * 10 > rounds,
        rejects,
        "{label}: {rejected} of {rounds} rounds rejected a draft"
    );
    let exact = |context: &[u32]| target_distribution(target, &sampling(0), context);
    assert_first_two_follow(&pairs, &prompt, exact, &label);
    (cut, rounds)
}
