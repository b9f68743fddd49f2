//! Where a chain of drafts stops (issue 33). The draft-node reports its confidence at each draft
//! (its model's largest probability there); the policy learns how often a draft made at each
//! confidence is accepted where a round reaches it, and asks the node to stop before the first
//! draft (but the chain's first) whose confidence says it will be accepted too seldom to pay for
//! its place in the block: its draft step and its verified position. (That a draft may not be
//! reached is left out: counting unreached drafts as failures would blame a sure draft for the
//! unsure one before it and push the stop up to the first draft.)
//! llama.cpp stops at a fixed `--draft-p-min`; this stop is learned, per session, from the
//! pair's measured acceptance and costs.
//!
//! Exact whatever the stop: the confidence at a position is known before the draft there is
//! drawn, so where a chain ends depends only on the drafts before it, never on the draw it
//! skips nor on the target; each draft sent is drawn from the q it states.

use super::{DrafterKind, KPolicy};

/// Confidence buckets, of equal width.
const BUCKETS: usize = 20;
/// Weight an observation of a bucket keeps at each later observation of the same bucket.
const DECAY: f64 = 0.98;
/// Every this many rounds observed, a round drafts its whole chain, so that what a confidence
/// the stop cuts off is worth stays measured.
const EXPLORE_EVERY: u32 = 16;

/// Drafts reached that a session carries to the next, at most, per bucket.
const CARRIED: f64 = 16.0;

/// How often drafts made at each confidence are accepted, as decaying counts.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Confidence {
    reached: [f64; BUCKETS],
    accepted: [f64; BUCKETS],
    rounds: u32,
}

fn bucket(confidence: f32) -> usize {
    ((confidence.clamp(0.0, 1.0) * BUCKETS as f32) as usize).min(BUCKETS - 1)
}

impl Confidence {
    /// A round's chain: the confidence at each draft and how many drafts were accepted (those
    /// past the first rejected were not reached).
    pub fn observe(&mut self, confidence: &[f32], accepted: usize) {
        self.rounds = self.rounds.wrapping_add(1);
        for (i, &c) in confidence.iter().enumerate().take(accepted + 1) {
            let b = bucket(c);
            self.reached[b] = self.reached[b] * DECAY + 1.0;
            self.accepted[b] = self.accepted[b] * DECAY + f64::from(u8::from(i < accepted));
        }
    }

    /// What the next session starts from: the same acceptance by confidence, worth at most
    /// [`CARRIED`] drafts per bucket (it depends on the text).
    pub fn carried(&self) -> Self {
        let mut next = Self::default();
        for b in 0..BUCKETS {
            let scale = (CARRIED / self.reached[b].max(CARRIED)).min(1.0);
            next.reached[b] = self.reached[b] * scale;
            next.accepted[b] = self.accepted[b] * scale;
        }
        next
    }

    /// The least confidence to draft at, where a draft is worth its place when it is accepted
    /// at least `break_even` of the times it is reached: the bucket edge below which drafting
    /// lost the most, as measured (drafts below it accepted `break_even` of the time or less,
    /// taken together). 0 where no bucket lost, and on an exploring round.
    pub fn stop(&self, break_even: f64) -> f32 {
        if self.rounds % EXPLORE_EVERY == EXPLORE_EVERY - 1 {
            return 0.0;
        }
        let mut lost = 0.0;
        let mut best = (0.0, 0);
        for b in 0..BUCKETS {
            lost += break_even * self.reached[b] - self.accepted[b];
            if lost > best.0 {
                best = (lost, b + 1);
            }
        }
        best.1 as f32 / BUCKETS as f32
    }
}

impl KPolicy {
    /// Where a chain of `k` model drafts stops ([`Confidence::stop`]): a draft pays where its
    /// chance of acceptance, times the tokens per second the round is expected to give, exceeds
    /// what it adds to the round (one more draft step and one more verified position). 0 before
    /// the draft has been timed.
    pub fn min_confidence(&self, k: usize) -> f32 {
        if k < 2 || !self.model.timed() {
            return 0.0;
        }
        let verify = self.verify_seconds(k + 1);
        let rate = self.rate_with(DrafterKind::Model, k, verify);
        let draft = self.model.draft_seconds(k) - self.model.draft_seconds(k - 1);
        let position = verify - self.verify_seconds(k);
        let added = (draft.max(0.0) + position.max(0.0)) * self.model.calibration;
        self.confidence.stop((rate * added).clamp(0.0, 1.0))
    }

    /// A round of model drafts sent as a chain: each one's confidence, and how many were
    /// accepted.
    pub fn observe_confidence(&mut self, confidence: &[f32], accepted: usize) {
        self.confidence.observe(confidence, accepted);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stop_falls_where_drafts_stop_paying() {
        let mut c = Confidence::default();
        // Unsure drafts (0.1-0.3) accepted one time in five, sure ones (0.9) nine in ten.
        for round in 0..200 {
            c.observe(&[0.9, 0.9, 0.2], 2 + usize::from(round % 5 == 0));
            c.observe(&[0.25], usize::from(round % 5 == 0));
        }
        c.rounds = 0;
        assert_eq!(c.stop(0.5), 0.3);
        c.rounds = EXPLORE_EVERY - 1;
        assert_eq!(
            c.stop(0.5),
            0.0,
            "an exploring round drafts its whole chain"
        );
        c.rounds = 0;
        // Where a draft pays at one acceptance in ten, the unsure ones pay too: no stop.
        assert_eq!(c.stop(0.1), 0.0);
        // Where every draft must be accepted nine times in ten to pay, the sure ones barely
        // do and the stop stays below them.
        assert!(c.stop(0.85) <= 0.9);
        // The next session starts from the same stop, worth at most CARRIED drafts a bucket.
        let next = c.carried();
        assert_eq!(next.stop(0.5), 0.3);
        assert!(next.reached.iter().all(|&r| r <= CARRIED + 1e-9));
        // Nothing seen: no stop.
        assert_eq!(Confidence::default().stop(0.5), 0.0);
    }

    /// The policy's stop: none before the draft is timed; with drafts that cost as much as the
    /// target's step, below the confidences that are seldom accepted; with drafts that cost
    /// next to nothing, none (every draft pays).
    #[test]
    fn the_policy_stops_where_a_draft_costs_more_than_it_commits() {
        let policy = |draft_step: f64| {
            let mut p = KPolicy::new(8);
            for round in 0..64 {
                let k = 4 + round % 4;
                // The 0.2 draft is accepted one time in five, the 0.15 ones after it one in two.
                let accepted = 2 + usize::from(round % 5 == 0) + usize::from(round % 10 == 0);
                let costs = super::super::RoundCosts {
                    drafted: k,
                    accepted,
                    draft_wall: draft_step * k as f64,
                    draft_compute: draft_step * k as f64,
                    verify_wall: 0.010 + 0.0002 * k as f64,
                    round_wall: draft_step * k as f64 + 0.010 + 0.0002 * k as f64,
                    ..Default::default()
                };
                p.observe(
                    super::super::RoundPlan {
                        drafter: Some(DrafterKind::Model),
                        k,
                    },
                    &costs,
                );
                let confidence = [&[0.9, 0.9, 0.2][..], &vec![0.15; k - 3]].concat();
                p.observe_confidence(&confidence, accepted);
            }
            p.confidence.rounds = 0;
            p
        };
        assert_eq!(KPolicy::new(8).min_confidence(8), 0.0, "not yet timed");
        assert_eq!(policy(0.010).min_confidence(8), 0.25);
        assert_eq!(policy(0.0001).min_confidence(8), 0.0);
    }
}
