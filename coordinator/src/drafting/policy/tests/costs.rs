//! The measured costs' estimates: a size's cost between and beyond the sizes seen, a time's
//! spikes, a stale size after the step's cost rose.

use super::super::costs::Ewma;
use super::*;

#[test]
fn verify_cost_interpolates_between_the_sizes_seen() {
    let mut policy = KPolicy::new(8);
    policy.verify.observe(1, 0.010);
    // One size seen: the prior slope scales it.
    assert!((policy.verify_seconds(5) - 0.010 * 2.0).abs() < 1e-12);
    policy.verify.observe(5, 0.030);
    assert!((policy.verify_seconds(3) - 0.020).abs() < 1e-12);
    assert!((policy.verify_seconds(9) - 0.050).abs() < 1e-12);
    assert!((policy.verify_seconds(5) - 0.030).abs() < 1e-12);
    // A draft whose compute has a fixed part (feeding the last round's tokens): the line
    // through two sizes carries it, where a per-token rate would overcharge long blocks.
    policy.model.compute.observe(2, 0.018);
    assert!((policy.model.draft_seconds(8) - 0.072).abs() < 1e-12);
    policy.model.compute.observe(4, 0.026);
    assert!((policy.model.draft_seconds(8) - 0.042).abs() < 1e-12);
}

#[test]
fn a_time_far_above_the_average_counts_as_twice_the_average() {
    let mut cost = Ewma::default();
    cost.add(1e-4);
    // A 4 ms hiccup on a 0.1 ms step moves the average as a 0.2 ms step would.
    cost.add(4e-3);
    assert!((cost.0.expect("seen") - (1e-4 + LEARN * 1e-4)).abs() < 1e-15);
    // A lasting slowdown is still followed, by at most LEARN · (SPIKE − 1) a sample.
    for _ in 0..60 {
        cost.add(4e-3);
    }
    assert!(cost.0.expect("seen") > 3.9e-3, "{:?}", cost.0);
    // Faster samples enter as they are.
    cost.add(1e-4);
    assert!(cost.0.expect("seen") < 3.5e-3);
}

#[test]
fn a_block_timed_before_a_slow_stretch_keeps_its_margin_over_the_step() {
    // The real pair on one machine: steps at 38 ms, blocks of 2, 4 and 9 positions timed at
    // 44, 50 and 58 ms, then five steps at 70–95 ms (the machine, nothing of the draft beside
    // them). The step's average passes every block's; floored to it, every block up to 9
    // positions looked as cheap as one step.
    let mut policy = KPolicy::new(ADAPTIVE_MAX_K);
    for _ in 0..20 {
        policy.verify.observe(1, 0.038);
    }
    for (n, seconds) in [(2, 0.044), (4, 0.050), (9, 0.058)] {
        policy.verify.observe(n, seconds);
    }
    // A draft of 17 ms a token accepted at 0.36: not worth a round at these costs.
    policy.model.overhead.add(0.0);
    policy.model.compute.observe(1, 0.017);
    policy.model.compute.observe(2, 0.034);
    policy.model.accept = [0.36; ADAPTIVE_MAX_K];
    policy.model.tried = [100; ADAPTIVE_MAX_K];
    assert_eq!(
        policy.choose(true, 0, NgramOffer::default(), 1000),
        RoundPlan::TARGET_ONLY
    );
    for seconds in [0.070, 0.095, 0.080, 0.090, 0.075] {
        policy.verify.observe(1, seconds);
    }
    let step = policy.verify_seconds(1);
    assert!(step > 0.058, "the step's average {step} passes the blocks'");
    for (n, margin) in [(2, 0.006), (4, 0.012), (9, 0.020)] {
        let block = policy.verify_seconds(n);
        assert!(
            block - step >= margin - 1e-12,
            "{n} positions: {block} against a step of {step}"
        );
    }
    assert_eq!(
        policy.choose(true, 0, NgramOffer::default(), 1000),
        RoundPlan::TARGET_ONLY
    );
    // The stretch over, the step falls back: stale blocks fall back with it, never below their
    // own times.
    for _ in 0..40 {
        policy.verify.observe(1, 0.038);
    }
    let nine = policy.verify_seconds(9);
    assert!((nine - 0.058).abs() < 1e-4, "{nine}");
}
