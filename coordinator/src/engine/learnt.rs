//! What sessions learnt of the nodes' costs and the draft's acceptance, for the next session to
//! start from ([`KPolicy::continued`]), kept per load: a round's costs depend on how many
//! generations share the nodes' batches. After waves of 8 sessions in one process (the draft's
//! and the target's passes taking turns on 2 cores), a lone session that started from the last
//! crowded session's costs found the draft unable to pay and decoded at 35-55 tokens/s, under
//! the target alone; it starts from the last lone session's instead.

use std::sync::Mutex;

use crate::drafting::policy::KPolicy;

/// Load classes: 1, 2, 3-4, 5-8, 9-16, 17-32 and more generations at once.
const CLASSES: usize = 7;

/// The class of a load of `generations` at once.
fn class(generations: usize) -> usize {
    let above = generations.saturating_sub(1);
    ((usize::BITS - above.leading_zeros()) as usize).min(CLASSES - 1)
}

/// The last session's policy at each load class.
#[derive(Debug, Default)]
pub(crate) struct Learnt(Mutex<[Option<KPolicy>; CLASSES]>);

impl Learnt {
    /// The policy of a session that starts while `generations` run (itself included): what the
    /// last session at that load learnt, or priors where none has run at it.
    pub(crate) fn start(&self, generations: usize, max_k: usize) -> KPolicy {
        let class = class(generations);
        self.0
            .lock()
            .ok()
            .and_then(|learnt| learnt[class].as_ref().map(|p| p.continued(max_k)))
            .unwrap_or_else(|| KPolicy::new(max_k))
    }

    /// Keeps what a session learnt while `generations` ran on average.
    pub(crate) fn keep(&self, generations: f64, policy: KPolicy) {
        if let Ok(mut learnt) = self.0.lock() {
            learnt[class(generations.round() as usize)] = Some(policy);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drafting::policy::{RoundCosts, RoundPlan};

    /// A policy that has seen target-only steps of `seconds`.
    fn stepped(seconds: f64) -> KPolicy {
        let mut policy = KPolicy::new(8);
        policy.observe(
            RoundPlan::TARGET_ONLY,
            &RoundCosts {
                verify_wall: seconds,
                ..RoundCosts::default()
            },
        );
        policy
    }

    #[test]
    fn loads_fall_in_classes_by_powers_of_two() {
        let classes: Vec<usize> = [0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 500]
            .into_iter()
            .map(class)
            .collect();
        assert_eq!(classes, [0, 0, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]);
    }

    #[test]
    fn a_session_starts_from_what_the_last_one_at_its_load_learnt() {
        let learnt = Learnt::default();
        assert_eq!(
            learnt.start(1, 8).verify_seconds(1),
            KPolicy::new(8).verify_seconds(1),
            "priors before any session"
        );
        learnt.keep(1.0, stepped(0.015));
        learnt.keep(7.6, stepped(0.024));
        assert_eq!(learnt.start(1, 8).verify_seconds(1), 0.015);
        assert_eq!(learnt.start(8, 8).verify_seconds(1), 0.024);
        assert_eq!(learnt.start(5, 8).verify_seconds(1), 0.024);
        // A load none has run at starts from priors, not from another load's costs.
        assert_eq!(
            learnt.start(2, 8).verify_seconds(1),
            KPolicy::new(8).verify_seconds(1)
        );
        // The next session at a load replaces the last.
        learnt.keep(1.4, stepped(0.016));
        assert_eq!(learnt.start(1, 8).verify_seconds(1), 0.016);
    }
}
