//! The measured costs' estimates: a size's cost between and beyond the sizes seen, a time's
//! spikes.

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
