//! The idle draft-node's background work, as the policy decides it: when it is kept caught up
//! with the log ([`KPolicy::catch_up_soon`], [`KPolicy::set_model_behind`]), and how far apart
//! its timing steps come, by what they slowed the target's steps beside them
//! ([`KPolicy::background_affordable`]; docs/adaptive-k.md, "Probing, and never being slower").

use super::{KPolicy, RECENT_ROUNDS};

/// Share of the target's time that the idle draft's background work may cost it by slowing the
/// target's steps beside it ([`KPolicy::background_affordable`]).
const BACKGROUND_BUDGET: f64 = 0.02;
/// The most background budget a session holds, in target steps' budget.
const BACKGROUND_CAP_ROUNDS: f64 = 100.0;
/// The target's slowdown beside a background step assumed until both have been timed.
const PRIOR_SLOWDOWN: f64 = 0.1;
/// A slowdown of the target beside the draft's background work small enough to ignore.
const FREE_SLOWDOWN: f64 = 0.03;

impl KPolicy {
    /// Whether the idle draft-node should be fed what was committed since it last drafted, in
    /// the background, where it has cores of its own: a probe is near, or the model drafted one
    /// of the last [`RECENT_ROUNDS`] rounds and may well draft the next. Alternating with n-gram
    /// lookup, a draft left behind first prefilled what the lookup's rounds had committed, a
    /// cost its estimates did not show (on the real pair's code edit, the default with both
    /// drafters read 1.35× target-only where n-gram lookup alone read 1.68×). Never on the
    /// target's cores: there the feed slows the target's rounds as much as it would the model's
    /// next round, where it is measured (and a probe's charged to the exploration credit).
    /// Nor where a catch-up slows the target's step beside it (by more than
    /// [`FREE_SLOWDOWN`]): there the model is caught up only once it would draft
    /// ([`Self::set_model_behind`]); kept caught up for 8 rounds after each model round, the
    /// real pair's humanities prompts (split on one machine's two cores) ran their target steps
    /// at 46-48 ms against 39-41 and read 0.93x target-only.
    pub fn catch_up_soon(&self, own_cores: bool) -> bool {
        own_cores
            && self.interference.slowdown(PRIOR_SLOWDOWN) <= FREE_SLOWDOWN
            && (self.probe_soon() || (self.idle_rounds < RECENT_ROUNDS && self.model_could_pay()))
    }

    /// Whether a probe of the idle draft is near (its budget mostly earned).
    fn probe_soon(&self) -> bool {
        // Not where no probe will come: a draft-node kept caught up round after round costs the
        // coordinator's core a step per round trip.
        // Nor once background steps have measured the draft's acceptance: no probe comes then
        // ([`Self::choose`]), and a catch-up after every round of a text the model could not
        // pay on slowed the target's steps beside it by a sixth on one machine's two cores
        // (the real pair's writing prompts, split: 0.89-0.96x target-only, no model round).
        self.shadow[1] == 0
            && self.explore_credit >= 0.7 * self.probe_cost(1)
            && self.model_could_pay()
    }

    /// Whether the idle draft-node is behind the log as this round is chosen: a model round (or
    /// a probe) would feed the gap first, a cost its estimates do not show (on the real pair's
    /// writing prompts, split, one such round took 238 ms against 75 expected). The model then
    /// does not draft this round; where it would have, it is caught up in the background
    /// ([`Self::catch_up_wanted`]) and drafts the next.
    pub fn set_model_behind(&mut self, behind: bool) {
        self.behind = behind;
    }

    /// Whether the last choice left the model out only because it was behind.
    pub fn catch_up_wanted(&self) -> bool {
        self.catch_up_wanted
    }

    /// Learns a target-only round's verify, `beside` a background step of the draft-node or
    /// alone.
    pub fn observe_target_step(&mut self, beside: bool, seconds: f64) {
        self.interference.observe(beside, seconds);
    }

    /// Whether a background timing step that keeps the draft-node busy `task` seconds (the gap
    /// it feeds first included, [`Self::background_task_seconds`]) fits the budget: what the
    /// target's steps beside background work have measured slower than alone stays within
    /// [`BACKGROUND_BUDGET`] of the session's time so far, this step's expected loss (its time at
    /// the learnt slowdown) included. Always where the draft-node has a machine of its own (no
    /// slowdown). Priced by the step's drafts alone, on one machine's two cores a step came
    /// every ~30 rounds, but each first fed the ~30 tokens committed since the last, at 2-3×
    /// the step's time: the real pair's writing prompts lost 5-6 % of their target steps' time
    /// beside them (docs/benchmarks/prompts.md, session 31). Where feeding the gap alone costs
    /// the target more than the budget earns in the rounds that made it, no step comes again.
    pub fn background_affordable(&self, task: f64) -> bool {
        let slowdown = self.interference.slowdown(PRIOR_SLOWDOWN);
        slowdown <= FREE_SLOWDOWN || self.interference.credit() >= task * slowdown
    }

    /// Earns the background budget of a round of `wall` seconds, up to that of
    /// [`BACKGROUND_CAP_ROUNDS`] target steps: a long stretch of model rounds does not buy a
    /// burst of steps every 4 rounds once the model stops drafting.
    pub(super) fn earn_background(&mut self, wall: f64) {
        let cap = BACKGROUND_CAP_ROUNDS * BACKGROUND_BUDGET * self.verify_seconds(1);
        self.interference.earn(wall * BACKGROUND_BUDGET, cap);
    }

    /// Expected seconds of a background timing step of `k` drafts that first feeds `fed`
    /// tokens (as the last steps fed them; nothing before one has), once the draft is timed.
    pub fn background_task_seconds(&self, k: usize, fed: usize) -> Option<f64> {
        let feed = self.model.feed.0.unwrap_or(0.0);
        Some(self.expected_draft_seconds(k)? + fed as f64 * feed)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{on_a_machine_of_its_own, pair, simulate_on};
    use super::super::{ADAPTIVE_MAX_K, RoundCosts, RoundPlan};
    use super::*;
    use crate::drafting::DrafterKind;
    use crate::drafting::ngram::NgramOffer;

    #[test]
    fn an_idle_draft_is_kept_caught_up_only_after_the_model_drafted() {
        // A fresh session: the model has drafted no round, and no probe is near; catching the
        // draft-node up each round only slows the target beside it.
        let mut policy = KPolicy::new(8);
        policy.set_first_probe_cost(0.05);
        on_a_machine_of_its_own(&mut policy, 0.040);
        assert!(!policy.catch_up_soon(true));
        let model = RoundPlan {
            drafter: Some(DrafterKind::Model),
            k: 1,
        };
        let round = RoundCosts {
            drafted: 1,
            verify_wall: 0.040,
            ..RoundCosts::default()
        };
        policy.observe(model, &round);
        assert!(policy.catch_up_soon(true));
        assert!(!policy.catch_up_soon(false), "never on the target's cores");
        // Where the target is a sixth slower beside a catch-up (one machine's two cores), the
        // model is caught up only once it would draft.
        for _ in 0..10 {
            policy.observe_target_step(true, 0.047);
        }
        assert!(!policy.catch_up_soon(true));
    }

    #[test]
    fn no_catch_up_waits_for_a_probe_once_background_steps_measured_the_draft() {
        // Credit enough for a probe, and none drafted by the model: a probe may come, and the
        // draft-node is kept caught up for it.
        let mut policy = KPolicy::new(8);
        policy.set_first_probe_cost(0.0);
        on_a_machine_of_its_own(&mut policy, 0.040);
        assert!(policy.catch_up_soon(true));
        // A background step measured the draft's acceptance: no probe comes, so no catch-up
        // (each would slow the target beside it for nothing).
        policy.observe_shadow(4, 1);
        assert!(!policy.catch_up_soon(true));
    }

    #[test]
    fn a_draft_behind_the_log_is_caught_up_before_it_drafts() {
        let mut policy = KPolicy::new(ADAPTIVE_MAX_K);
        simulate_on(&mut policy, pair(0.9, 0.001, 0.0, 0.02, 0.02), 100);
        // Behind the log, the model sits the round out (where it would have drafted, a catch-up
        // is asked for) ...
        policy.set_model_behind(true);
        let plan = policy.choose(true, 0, NgramOffer::default(), 100);
        assert_ne!(plan.drafter, Some(DrafterKind::Model));
        assert!(policy.catch_up_wanted());
        // ... and drafts once caught up.
        policy.set_model_behind(false);
        let plan = policy.choose(true, 0, NgramOffer::default(), 100);
        assert_eq!(plan.drafter, Some(DrafterKind::Model));
        assert!(!policy.catch_up_wanted());
    }

    #[test]
    fn a_background_step_is_priced_with_the_gap_it_feeds_first() {
        // A step of 4 drafts timed at 68 ms after feeding 20 tokens in 100 ms more: 5 ms a
        // token, so a step that would first feed 30 tokens is expected to take 68 + 150 ms.
        let mut policy = KPolicy::new(8);
        assert_eq!(policy.background_task_seconds(4, 30), None, "not timed");
        policy.observe_timing(&super::super::Timing {
            k: 4,
            wall_secs: 0.068,
            compute_secs: 0.068,
            task_secs: 0.168,
            fed: 20,
            from: 100,
            tokens: vec![1, 2, 3, 4],
        });
        let task = policy.background_task_seconds(4, 30).expect("timed");
        let drafts = policy.expected_draft_seconds(4).expect("timed");
        assert!((drafts - 0.068).abs() < 1e-9, "{drafts}");
        assert!((task - (0.068 + 30.0 * 0.005)).abs() < 1e-9, "{task}");
    }

    #[test]
    fn a_verify_beside_a_step_drafting_ahead_is_learnt_as_it_costs_alone() {
        // A target step of 40 ms, 48 beside the draft's (one machine's two cores), or 40 (a
        // machine of its own); a verify of 2 positions timed at 56.4 ms beside a step drafting
        // ahead: 47 alone where a step beside slows it by a fifth, as timed where none does.
        for (beside, alone) in [(0.048, 0.047), (0.040, 0.0564)] {
            let mut policy = KPolicy::new(ADAPTIVE_MAX_K);
            policy.observe_target_step(false, 0.040);
            policy.observe_target_step(true, beside);
            let model = RoundPlan {
                drafter: Some(DrafterKind::Model),
                k: 1,
            };
            let ahead = RoundCosts {
                drafted: 1,
                accepted: 1,
                drafted_ahead: true,
                drafted_next: 2,
                verify_wall: 0.0564,
                round_wall: 0.0564,
                ..RoundCosts::default()
            };
            for _ in 0..20 {
                let step = RoundCosts {
                    verify_wall: 0.040,
                    round_wall: 0.040,
                    ..RoundCosts::default()
                };
                policy.observe(RoundPlan::TARGET_ONLY, &step);
                policy.observe(model, &ahead);
            }
            let learnt = policy.expected_verify_seconds(2).expect("timed");
            assert!((learnt - alone).abs() < 0.0005, "{learnt} against {alone}");
        }
    }
}
