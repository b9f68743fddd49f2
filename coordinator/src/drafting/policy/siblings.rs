//! Token trees' share of the policy (issue 31): how many nodes a round adds beside the model's
//! chain of drafts. A node off the chain (a sibling of a chain draft, or deeper under one: the
//! draft-node grows its trees best-first) commits tokens where the round reaches its depth, the
//! chain's draft there is rejected and the branch is right: one token for a sibling leaf, more
//! where the branch goes deeper; it costs one more verified position, and where the sampling is
//! greedy one more draft pass too: there the draft-node grows the K + B best nodes up to K + B
//! deep (`runtime/src/speculative/growth.rs`), a pass more per node (K = 1 with one sibling took
//! two passes, 66 ms on the real 0.5B draft, against 33 for the chain); sampled, it feeds the
//! others in the passes its chain takes.

use super::{DrafterKind, KPolicy};

/// Weight kept by the old evidence at each new observation.
const DECAY: f64 = 0.98;
/// Prior: a branch right one time in four (a leaf: one token), worth four observations.
const PRIOR_TESTED: f64 = 4.0;
const PRIOR_TOKENS: f64 = 1.0;

/// What the branches beside the chain commit where they are tested (the depth of the chain's
/// first rejected draft reached, a node beside it sent): the tokens past the chain's accepted
/// drafts (none where wrong, one for a right leaf, more down a deeper branch).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Siblings {
    tested: f64,
    tokens: f64,
}

impl Default for Siblings {
    fn default() -> Self {
        Self {
            tested: PRIOR_TESTED,
            tokens: PRIOR_TOKENS,
        }
    }
}

impl Siblings {
    /// A tested branch: `committed` tokens past the chain's accepted drafts (0: it was wrong).
    pub fn observe(&mut self, committed: usize) {
        self.tested = self.tested * DECAY + 1.0;
        self.tokens = self.tokens * DECAY + committed as f64;
    }

    /// The tokens a tested branch commits, on average.
    pub fn tokens(&self) -> f64 {
        self.tokens / self.tested
    }
}

/// The number of nodes beside the chain, at most `max`, that makes a round's expected tokens
/// per second largest: `reach[i]` the chance that drafts 0..=i are all accepted, `gain` the
/// tokens a tested branch commits, `tokens` and `seconds` the chain's expected tokens and round
/// time, `extra_verify(b)` what b more positions add to the verify. Nodes are counted as a
/// branch at each of the shallowest depths (the draft places them where it is least sure,
/// weighted by its chance of getting there, which favours shallow ones).
pub fn best_branches(
    reach: &[f64],
    gain: f64,
    (tokens, seconds): (f64, f64),
    extra_verify: impl Fn(usize) -> f64,
    max: usize,
) -> usize {
    let mut best = (tokens / seconds, 0);
    let mut extra = 0.0;
    for b in 1..=max.min(reach.len()) {
        let before = if b == 1 { 1.0 } else { reach[b - 2] };
        extra += (before - reach[b - 1]) * gain;
        let per_second = (tokens + extra) / (seconds + extra_verify(b));
        if per_second > best.0 {
            best = (per_second, b);
        }
    }
    best.1
}

impl KPolicy {
    /// Nodes to add beside `k` model drafts, at most `max`: as many as raise the round's
    /// expected tokens per second, from the measured acceptance by depth, what tested branches
    /// committed, the round's expected time and what more verified positions cost, and where
    /// `greedy`, what more draft passes cost (a greedy tree of K + B nodes may take K + B).
    pub fn branches(&self, k: usize, max: usize, greedy: bool) -> usize {
        if k == 0 || max == 0 {
            return 0;
        }
        let reach: Vec<f64> = self.model.reach(k).collect();
        let verify = self.verify_seconds(k + 1);
        let chain = (
            self.model.expected_tokens(k),
            self.calibrated_round(DrafterKind::Model, k, verify),
        );
        let passes = |b: usize| {
            let draft = |n| self.model.draft_seconds(n);
            if greedy {
                (draft(k + b) - draft(k)).max(0.0)
            } else {
                0.0
            }
        };
        let extra = |b: usize| (self.verify_seconds(k + 1 + b) - verify).max(0.0) + passes(b);
        best_branches(&reach, self.siblings.tokens(), chain, extra, max.min(k))
    }

    /// A round whose branch beside the first rejected draft was verified: the tokens it
    /// committed past the chain's accepted drafts (0: wrong).
    pub fn observe_sibling(&mut self, committed: usize) {
        self.siblings.observe(committed);
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
    fn a_greedy_trees_draft_passes_are_priced() {
        // Verify 10 ms flat (positions free), a draft of 8 ms a pass, α = 0.6, a branch right
        // half the times it is tested.
        let mut policy = crate::drafting::policy::tests::measured(0.010, 0.008, 0.6);
        for i in 0..100 {
            policy.observe_sibling(i % 2);
        }
        // Sampled, a sibling costs only its verified position (free here): it pays.
        assert_eq!(policy.branches(1, 1, false), 1);
        // Greedy, it costs a draft pass of 8 ms for 0.2 tokens on a 1.6-token, 18 ms round.
        assert_eq!(policy.branches(1, 1, true), 0);
    }

    #[test]
    fn a_trees_verify_is_learnt_at_its_positions() {
        use crate::drafting::policy::{RoundCosts, RoundPlan};
        // Rounds of a chain of 2 and 6 siblings: 9 positions verified in 40 ms each; chains of
        // 2 (3 positions) in 10 ms.
        let mut policy = KPolicy::new(8);
        for siblings in [6, 0].repeat(20) {
            let plan = RoundPlan {
                drafter: Some(DrafterKind::Model),
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
    fn the_tokens_a_branch_commits_follow_what_was_seen() {
        let mut s = Siblings::default();
        assert!((s.tokens() - 0.25).abs() < 1e-9);
        // Right branches, each committing 3 tokens (a deep branch).
        for _ in 0..200 {
            s.observe(3);
        }
        assert!(s.tokens() > 2.9, "{}", s.tokens());
        // Half of them right, one token each (leaves).
        for i in 0..400 {
            s.observe(i % 2);
        }
        assert!((s.tokens() - 0.5).abs() < 0.05, "{}", s.tokens());
        for _ in 0..200 {
            s.observe(0);
        }
        assert!(s.tokens() < 0.1, "{}", s.tokens());
    }
}
