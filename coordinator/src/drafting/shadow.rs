//! Acceptance measured without a round paying for it. While the target decodes alone (the policy
//! found drafting not worth it, or has not yet learnt that it is), the idle draft-node drafts a
//! few tokens in the background from where the log stands, a step no round waits for (which
//! times it too); once the target has produced those positions, the drafts it would have
//! accepted are counted. Greedy only: a greedy draft is accepted exactly when it is the target's
//! greedy token, while a sampled one is accepted with a probability no single match measures.
//!
//! Without it the policy learns acceptance only from probes, which its 2 % budget spaces out: a
//! good draft behind a 20 ms link stayed unused for whole requests, its acceptance at the prior.

use tandem_runtime::TokenLog;

use crate::drafting::policy::{KPolicy, Timing};

/// Drafts per background step.
pub const SHADOW_K: usize = 4;
/// Rounds without the draft model between two background steps where the draft-node has cores
/// of its own (a step holds the session for about a round trip and 4 draft tokens, rounds in
/// which the policy could not switch to drafting).
const EVERY: usize = 4;
/// How much further apart the steps are where the draft could not pay even if every draft were
/// accepted ([`KPolicy::model_could_pay`]): acceptance cannot change the choice, and the steps
/// only re-time the node (a link that got faster), while their gRPC work shares the
/// coordinator's core (on a 0.2 ms target, every 4th round's step cost a few per cent).
const SPREAD_WHEN_HOPELESS: usize = 16;

/// Drafts of a background step: no more than the draft-node accepts per step (`cap`: it refuses
/// a longer step, which drops its session and replays the log) nor past the session's room.
pub fn shadow_len(cap: usize, remaining: usize) -> usize {
    SHADOW_K.min(cap).min(remaining.saturating_sub(1))
}

/// The background steps of one generation.
#[derive(Debug)]
pub struct Shadow {
    /// Drafts past the first `.0` tokens of the log, to compare once the target has produced
    /// their positions.
    pending: Option<(usize, Vec<u32>)>,
    pacing: Pacing,
    on: bool,
}

/// When the next background step comes.
#[derive(Debug)]
enum Pacing {
    /// After [`EVERY`] rounds without the model (the draft-node's own cores), once what the
    /// steps slow the target beside them fits the policy's budget; the count so far.
    Rounds(usize),
    /// Where the draft shares the target's cores (the all-in-one mode), a step slows the target
    /// down by what it takes: it comes once the policy's exploration credit pays for what it is
    /// expected to take (the gap it feeds first included), and is charged what it took
    /// ([`KPolicy::spend`]). Every 16 rounds instead, the real pair's roleplay prompt ran
    /// the draft model alone at 0.84× target-only while the model drafted 9 rounds of 153.
    Budget,
}

impl Shadow {
    /// `greedy`: the generation's sampling (anything else is not measured); `sharing_cores`:
    /// whether the draft-node runs on the target's cores.
    pub fn new(greedy: bool, sharing_cores: bool) -> Self {
        Self {
            pending: None,
            pacing: if sharing_cores {
                Pacing::Budget
            } else {
                Pacing::Rounds(0)
            },
            on: greedy,
        }
    }

    /// Keeps what a background step drafted, to compare.
    /// Where the draft shares the target's cores, what it took is charged to the policy's
    /// exploration credit.
    pub fn drafted(&mut self, t: &Timing, policy: &mut KPolicy) {
        if let Pacing::Budget = self.pacing {
            policy.spend(t.task_secs);
        }
        if self.on && !t.tokens.is_empty() {
            self.pending = Some((t.from, t.tokens.clone()));
        }
    }

    /// After a commit: once the target has produced every position a background step drafted,
    /// the policy learns how many of its drafts it would have accepted.
    pub fn compare(&mut self, log: &TokenLog, policy: &mut KPolicy) {
        let Some((from, drafts)) = &self.pending else {
            return;
        };
        let Some(target) = log.tokens().get(*from..from + drafts.len()) else {
            return;
        };
        let accepted = drafts
            .iter()
            .zip(target)
            .take_while(|(d, t)| d == t)
            .count();
        policy.observe_shadow(drafts.len(), accepted);
        self.pending = None;
    }

    /// Counts a round without the draft model; true when a background step is due: none is
    /// waiting to be compared, and (own cores) [`EVERY`] such rounds have passed and the step
    /// is `affordable` ([`KPolicy::background_affordable`]), or (shared cores) the policy's
    /// exploration `credit` pays for the `task` seconds it is expected to take;
    /// [`SPREAD_WHEN_HOPELESS`] times more where the draft `could_pay` no matter its acceptance.
    pub fn due(&mut self, could_pay: bool, credit: f64, task: f64, affordable: bool) -> bool {
        if !self.on || self.pending.is_some() {
            return false;
        }
        let spread = if could_pay { 1 } else { SPREAD_WHEN_HOPELESS };
        match &mut self.pacing {
            Pacing::Rounds(rounds) => {
                *rounds += 1;
                if *rounds >= EVERY * spread && affordable {
                    *rounds = 0;
                    return true;
                }
            }
            Pacing::Budget => return credit >= task * spread as f64,
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(from: usize, tokens: &[u32]) -> Timing {
        Timing {
            k: tokens.len(),
            wall_secs: 0.01,
            compute_secs: 0.005,
            task_secs: 0.02,
            fed: 0,
            from,
            tokens: tokens.to_vec(),
        }
    }

    #[test]
    fn drafts_are_scored_against_the_targets_tokens_once_it_has_produced_them() {
        let mut policy = KPolicy::new(8);
        let mut shadow = Shadow::new(true, false);
        let mut log = TokenLog::new(&[1, 2, 3]);
        shadow.drafted(&timing(3, &[10, 11, 12, 13]), &mut policy);
        log.extend(&[10, 11]);
        shadow.compare(&log, &mut policy);
        assert!(
            !shadow.due(true, 0.0, 0.0, true),
            "still waiting for two positions"
        );
        log.extend(&[12, 99, 5]);
        let before = policy.summary();
        shadow.compare(&log, &mut policy);
        // Three accepted, the fourth refused: position 1 up from the prior, position 4 down.
        let after = policy.summary();
        assert_ne!(before, after);
        assert_eq!(policy.shadow_acceptance(), [3, 4]);
        // Compared: the next step is due after `EVERY` rounds.
        assert_eq!(
            (0..EVERY)
                .filter(|_| shadow.due(true, 0.0, 0.0, true))
                .count(),
            1
        );
        assert!(!shadow.due(true, 0.0, 0.0, true));
        // A draft that could not pay even if always right: steps much further apart.
        let spread = EVERY * SPREAD_WHEN_HOPELESS;
        // (one round counted already, by the call above)
        assert_eq!(
            (2..spread)
                .filter(|_| shadow.due(false, 0.0, 0.0, true))
                .count(),
            0
        );
        assert!(shadow.due(false, 0.0, 0.0, true));
    }

    #[test]
    fn a_step_fits_the_draft_nodes_limit_and_the_sessions_room() {
        assert_eq!(shadow_len(8, 100), SHADOW_K);
        assert_eq!(shadow_len(3, 100), 3);
        assert_eq!(shadow_len(8, 3), 2);
        assert_eq!(shadow_len(0, 100), 0);
        assert_eq!(shadow_len(8, 1), 0);
    }

    #[test]
    fn sampled_generations_are_not_measured() {
        let mut policy = KPolicy::new(8);
        let mut shadow = Shadow::new(false, false);
        shadow.drafted(&timing(0, &[1, 2]), &mut policy);
        shadow.compare(&TokenLog::new(&[1, 2, 3]), &mut policy);
        assert_eq!(policy.shadow_acceptance(), [0, 0]);
        assert!(!(0..10).any(|_| shadow.due(true, 0.0, 0.0, true)));
    }

    #[test]
    fn on_shared_cores_steps_come_when_the_exploration_credit_pays_and_are_charged_to_it() {
        let mut policy = KPolicy::new(8);
        let mut shadow = Shadow::new(true, true);
        // A step comes once the credit (however many rounds earned it) pays for the seconds it
        // is expected to take, the gap it feeds first included.
        assert!(!shadow.due(true, 0.09, 0.1, true));
        assert!(shadow.due(true, 0.1, 0.1, true));
        // A step that took 0.2 s in all (the gap it fed and its drafts) is charged to the
        // policy's credit.
        let mut step = timing(3, &[10, 11]);
        step.task_secs = 0.2;
        let credit = policy.explore_credit();
        shadow.drafted(&step, &mut policy);
        assert!((credit - 0.2 - policy.explore_credit()).abs() < 1e-12);
        assert!(!shadow.due(true, 1.0, 0.1, true), "waiting to be compared");
        shadow.compare(&TokenLog::new(&[1, 2, 3, 10, 11]), &mut policy);
        assert!(!shadow.due(true, 0.15, 0.2, true));
        assert!(shadow.due(true, 0.2, 0.2, true));
        // A draft that could not pay: the step costs as much as many.
        let hopeless = 0.2 * SPREAD_WHEN_HOPELESS as f64;
        assert!(!shadow.due(false, hopeless * 0.99, 0.2, true));
        assert!(shadow.due(false, hopeless, 0.2, true));
        // On its own cores a step is not charged.
        let mut own = Shadow::new(true, false);
        let credit = policy.explore_credit();
        own.drafted(&step, &mut policy);
        assert_eq!(policy.explore_credit(), credit);
    }

    #[test]
    fn own_cores_steps_come_once_what_they_slowed_the_target_fits_its_budget() {
        use crate::drafting::policy::{RoundCosts, RoundPlan};
        let step = RoundCosts {
            verify_wall: 0.040,
            ..RoundCosts::default()
        };
        // One machine's two cores: the target's step 40 ms alone, 52 beside a background step
        // (three tenths slower), learnt by an earlier session; this one starts with no credit.
        let mut learnt = KPolicy::new(8);
        learnt.observe_target_step(false, 0.040);
        learnt.observe_target_step(true, 0.052);
        let mut policy = learnt.continued(8);
        // A step that keeps the draft-node busy 0.1 s is expected to cost the target 30 ms: 2 %
        // of 40 ms a round pays for it after 38 rounds.
        let rounds_until_affordable = |policy: &mut KPolicy| {
            (1..1000)
                .find(|_| {
                    policy.observe(RoundPlan::TARGET_ONLY, &step);
                    policy.background_affordable(0.1)
                })
                .expect("affordable")
        };
        assert_eq!(rounds_until_affordable(&mut policy), 38);
        // The step ran: the target's steps beside it took 70 and 55 ms (its gap's feed, then its
        // drafts), 45 ms lost, 14.6 more than the credit held; the slowdown learnt from them is
        // 0.37. The next waits until the credit is back up to 0.1 · 0.37: 64.4 rounds of 0.8 ms.
        policy.observe_target_step(true, 0.070);
        policy.observe_target_step(true, 0.055);
        assert!(!policy.background_affordable(0.1));
        assert_eq!(rounds_until_affordable(&mut policy), 65);
        let mut shadow = Shadow::new(true, false);
        assert!(!(0..4 * EVERY).any(|_| shadow.due(true, 0.0, 0.0, false)));
        assert!(shadow.due(true, 0.0, 0.0, true), "past EVERY rounds");
        // Where the draft-node has a machine of its own the target is as fast beside a step:
        // every EVERY rounds, from the first.
        let mut own = KPolicy::new(8);
        own.observe_target_step(false, 0.040);
        own.observe_target_step(true, 0.040);
        assert!(own.continued(8).background_affordable(0.1));
        // Nor where it is slower by less than FREE_SLOWDOWN (here 2 %), with no credit yet.
        let mut near = KPolicy::new(8);
        near.observe_target_step(false, 0.040);
        near.observe_target_step(true, 0.0408);
        assert!(near.continued(8).background_affordable(0.1));
        let mut shadow = Shadow::new(true, false);
        let steps = (0..4 * EVERY)
            .filter(|_| shadow.due(true, 0.0, 0.0, true))
            .count();
        assert_eq!(steps, 4);
    }
}
