//! Token trees' share of the policy (issue 31): how many sibling leaves a round adds beside the
//! model's drafts. A sibling (the draft's runner-up at a depth) commits one more token where the
//! round reaches its depth, the draft beside it is rejected and it is right; it costs one more
//! verified position and no draft step.

use super::{Drafter, KPolicy};

/// Weight kept by the old evidence at each new observation.
const DECAY: f64 = 0.98;
/// Prior: a sibling right one time in four, worth four observations.
const PRIOR_TESTED: f64 = 4.0;
const PRIOR_RIGHT: f64 = 1.0;

/// How often a sibling leaf is right where it is tested: its depth reached and the draft beside
/// it rejected.
#[derive(Debug, Clone)]
pub struct Siblings {
    tested: f64,
    right: f64,
}

impl Default for Siblings {
    fn default() -> Self {
        Self {
            tested: PRIOR_TESTED,
            right: PRIOR_RIGHT,
        }
    }
}

impl Siblings {
    pub fn observe(&mut self, right: bool) {
        self.tested = self.tested * DECAY + 1.0;
        self.right = self.right * DECAY + f64::from(u8::from(right));
    }

    pub fn rate(&self) -> f64 {
        self.right / self.tested
    }
}

/// The number of siblings, at most `max`, that makes a round's expected tokens per second
/// largest: `reach[i]` the chance that drafts 0..=i are all accepted, `tokens` and `seconds`
/// the chain's expected tokens and round time, `extra_verify(b)` what b more positions add to
/// the verify. Siblings are counted at the shallowest depths (the draft places them where it is
/// least sure, weighted by its chance of getting there, which favours shallow ones).
pub fn best_branches(
    reach: &[f64],
    rate: f64,
    (tokens, seconds): (f64, f64),
    extra_verify: impl Fn(usize) -> f64,
    max: usize,
) -> usize {
    let mut best = (tokens / seconds, 0);
    let mut extra = 0.0;
    for b in 1..=max.min(reach.len()) {
        let before = if b == 1 { 1.0 } else { reach[b - 2] };
        extra += (before - reach[b - 1]) * rate;
        let per_second = (tokens + extra) / (seconds + extra_verify(b));
        if per_second > best.0 {
            best = (per_second, b);
        }
    }
    best.1
}

impl KPolicy {
    /// Sibling leaves to add beside `k` model drafts, at most `max`: as many as raise the
    /// round's expected tokens per second, from the measured acceptance by depth, how often
    /// siblings were right, the round's expected time and what more verified positions cost.
    pub fn branches(&self, k: usize, max: usize) -> usize {
        if k == 0 || max == 0 {
            return 0;
        }
        let reach: Vec<f64> = self.model.reach(k).collect();
        let verify = self.verify_seconds(k + 1);
        let chain = (
            self.model.expected_tokens(k),
            self.calibrated_round(Drafter::Model, k, verify),
        );
        let extra = |b: usize| (self.verify_seconds(k + 1 + b) - verify).max(0.0);
        best_branches(&reach, self.siblings.rate(), chain, extra, max.min(k))
    }

    /// A round whose sibling beside the first rejected draft was verified: right or not.
    pub fn observe_sibling(&mut self, right: bool) {
        self.siblings.observe(right);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn siblings_pay_where_positions_are_cheap_against_the_round() {
        // α = 0.6 at every depth, K = 4.
        let reach: Vec<f64> = (1..=4).map(|i| 0.6f64.powi(i)).collect();
        let tokens = 1.0 + reach.iter().sum::<f64>();
        // A 50 ms round trip dominates the round; a position costs 0.5 ms: every sibling pays.
        let b = best_branches(&reach, 0.3, (tokens, 0.06), |b| 0.0005 * b as f64, 4);
        assert_eq!(b, 4);
        // A position costs as much as a whole round's share of a token: none pays.
        let b = best_branches(&reach, 0.3, (tokens, 0.01), |b| 0.005 * b as f64, 4);
        assert_eq!(b, 0);
        // Never more than asked or than there are depths.
        assert_eq!(best_branches(&reach, 0.9, (tokens, 1.0), |_| 0.0, 2), 2);
        assert_eq!(
            best_branches(&reach[..1], 0.9, (tokens, 1.0), |_| 0.0, 3),
            1
        );
    }

    #[test]
    fn a_trees_verify_is_learnt_at_its_positions() {
        use crate::drafting::policy::{Plan, RoundCosts};
        // Rounds of a chain of 2 and 6 siblings: 9 positions verified in 40 ms each; chains of
        // 2 (3 positions) in 10 ms.
        let mut policy = KPolicy::new(8);
        for siblings in [6, 0].repeat(20) {
            let plan = Plan {
                drafter: Some(Drafter::Model),
                k: 2,
            };
            let round = RoundCosts {
                drafted: 2,
                siblings,
                accepted: 1,
                verify_wall: if siblings > 0 { 0.040 } else { 0.010 },
                ..RoundCosts::default()
            };
            policy.observe(plan, &round);
        }
        let (three, nine) = (policy.verify_seconds(3), policy.verify_seconds(9));
        assert!((three - 0.010).abs() < 0.002, "3 positions: {three}");
        assert!((nine - 0.040).abs() < 0.008, "9 positions: {nine}");
    }

    #[test]
    fn the_rate_follows_what_was_seen() {
        let mut s = Siblings::default();
        assert!((s.rate() - 0.25).abs() < 1e-9);
        for _ in 0..200 {
            s.observe(true);
        }
        assert!(s.rate() > 0.95, "{}", s.rate());
        for _ in 0..200 {
            s.observe(false);
        }
        assert!(s.rate() < 0.05, "{}", s.rate());
    }
}
