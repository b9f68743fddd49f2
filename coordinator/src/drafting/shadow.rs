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
/// Rounds without the draft model between two background steps, where the draft-node has cores
/// of its own (a step holds the session for about a round trip and 4 draft tokens, rounds in
/// which the policy could not switch to drafting), and where it shares the target's (the
/// all-in-one mode: there a step slows the target down, 1 draft token per 4 target tokens at
/// most).
const EVERY: usize = 4;
const EVERY_SHARING_CORES: usize = 4 * SHADOW_K;
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
    every: usize,
    rounds: usize,
    on: bool,
}

impl Shadow {
    /// `greedy`: the generation's sampling (anything else is not measured); `sharing_cores`:
    /// whether the draft-node runs on the target's cores.
    pub fn new(greedy: bool, sharing_cores: bool) -> Self {
        Self {
            pending: None,
            every: if sharing_cores {
                EVERY_SHARING_CORES
            } else {
                EVERY
            },
            rounds: 0,
            on: greedy,
        }
    }

    /// Keeps what a background step drafted, to compare.
    pub fn drafted(&mut self, t: &Timing) {
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

    /// Counts a round without the draft model; true when a background step is due (none is
    /// waiting to be compared, and enough such rounds have passed: [`SPREAD_WHEN_HOPELESS`]
    /// times more where the draft `could_pay` no matter its acceptance).
    pub fn due(&mut self, could_pay: bool) -> bool {
        if !self.on || self.pending.is_some() {
            return false;
        }
        self.rounds += 1;
        let every = if could_pay {
            self.every
        } else {
            self.every * SPREAD_WHEN_HOPELESS
        };
        if self.rounds >= every {
            self.rounds = 0;
            return true;
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
            from,
            tokens: tokens.to_vec(),
        }
    }

    #[test]
    fn drafts_are_scored_against_the_targets_tokens_once_it_has_produced_them() {
        let mut policy = KPolicy::new(8);
        let mut shadow = Shadow::new(true, false);
        let mut log = TokenLog::new(&[1, 2, 3]);
        shadow.drafted(&timing(3, &[10, 11, 12, 13]));
        log.extend(&[10, 11]);
        shadow.compare(&log, &mut policy);
        assert!(!shadow.due(true), "still waiting for two positions");
        log.extend(&[12, 99, 5]);
        let before = policy.summary();
        shadow.compare(&log, &mut policy);
        // Three accepted, the fourth refused: position 1 up from the prior, position 4 down.
        let after = policy.summary();
        assert_ne!(before, after);
        assert_eq!(policy.shadow_acceptance(), [3, 4]);
        // Compared: the next step is due after `EVERY` rounds.
        assert_eq!((0..EVERY).filter(|_| shadow.due(true)).count(), 1);
        assert!(!shadow.due(true));
        // A draft that could not pay even if always right: steps much further apart.
        let spread = EVERY * SPREAD_WHEN_HOPELESS;
        // (one round counted already, by the call above)
        assert_eq!((2..spread).filter(|_| shadow.due(false)).count(), 0);
        assert!(shadow.due(false));
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
        shadow.drafted(&timing(0, &[1, 2]));
        shadow.compare(&TokenLog::new(&[1, 2, 3]), &mut policy);
        assert_eq!(policy.shadow_acceptance(), [0, 0]);
        assert!(!(0..10).any(|_| shadow.due(true)));
    }
}
