//! The choice of K each round (docs/architecture.md "Adaptive K"; the cost model is in
//! docs/adaptive-k.md). Per session the policy estimates, from what each round measured:
//!
//! - a_i, the chance that draft position i is accepted when positions 1..i-1 were, per drafter
//!   (the draft-node's model, the n-gram lookup), as moving averages;
//! - the drafter's wall time per round, `overhead + K · per_token` (the link's round trip and the
//!   node's fixed cost, and its compute per drafted token);
//! - the target's wall time to verify a block of n positions, V(n), per n, interpolated linearly
//!   between the sizes seen.
//!
//! A round that drafts K tokens commits E(K) = 1 + Σ_{i≤K} Π_{j≤i} a_j tokens on average and takes
//! T(K) = draft(K) + V(K + 1); K = 0 (target only) commits 1 in V(1). The policy picks the drafter
//! and K with the highest E/T. When target-only wins it still probes the draft now and then, so
//! that a draft that starts paying is noticed, but only as often as keeps the probes' expected
//! loss under [`PROBE_BUDGET`] of the time spent without the draft; a draft never timed is tried
//! the same way, its first probe's cost taken from how long its session took to open.

use serde::{Deserialize, Serialize};

use crate::drafting::DrafterKind;
use crate::drafting::ngram::{self, NgramOffer};
use costs::{DrafterCosts, Interference, SizeCost};

/// Largest K the adaptive policy tries.
pub const ADAPTIVE_MAX_K: usize = 8;
/// Weight of a new observation in the moving averages of times, and of acceptance (which a
/// session changes slowly, and which one round measures noisily).
const LEARN: f64 = 0.15;
const LEARN_ACCEPT: f64 = 0.04;
/// Acceptance assumed for a position never tried.
const PRIOR_ACCEPT: f64 = 0.6;
/// Acceptance assumed for an n-gram match never tried, by class of its length
/// ([`ngram::class`]): a match of 2 or 3–4 tokens in chat text is mostly a common phrase that
/// goes elsewhere (Spec-Bench's extraction and RAG prompts accepted none of 5 such rounds, a
/// short answer's whole length), while 5 or more is copied text. Each failed round costs a
/// longer verify, which a short answer never earns back.
const PRIOR_NGRAM_ACCEPT: [f64; ngram::CLASSES] = [0.3, 0.45, PRIOR_ACCEPT];
/// How much longer than the verify a block drafted ahead may take.
const AHEAD_WINDOW: f64 = 2.0;
/// Rounds of acceptance evidence per position a new session keeps from an earlier one.
const CARRIED_TRIALS: u32 = 4;
/// Target-only rounds a session starts with.
const TARGET_ONLY_FIRST: u32 = 2;
/// Times the verify of two positions is timed before n-gram lookup is no longer probed to time
/// it ([`KPolicy::choose`]).
const TWO_POSITIONS_TIMED: u32 = 2;
/// How much faster (as a fraction) drafting must look than target-only to be chosen: the
/// estimates are noisy (acceptance from a few rounds, times on a shared machine), a near tie is
/// as likely a loss as a gain, and K = 0 is safe.
const MARGIN: f64 = 0.05;
/// Rounds after which a session's verify costs are kept for the next session to start from.
const EARLY_ROUNDS: u32 = 8;
/// The prior counts as this many trials.
const PRIOR_WEIGHT: u32 = 2;
/// Every this many drafted rounds, one position past the best K is tried, so that the estimate
/// of a position that once failed can recover.
const EXPLORE_EVERY: u32 = 16;
/// Verify cost per extra position, relative to one position, assumed until two sizes are seen.
const PRIOR_VERIFY_SLOPE: f64 = 0.25;
/// Rounds after the model's last that it is kept caught up with the log.
const RECENT_ROUNDS: u32 = 8;
/// Share of the time spent without the draft that its probes may lose.
const PROBE_BUDGET: f64 = 0.02;
/// The most exploration credit a session holds, in target-only tokens' time: a long stretch
/// where the draft could not pay does not buy a burst of probes once it could.
const CREDIT_CAP_TOKENS: f64 = 10.0;
/// Bounds on one round's measured-over-predicted time, as it enters the calibration (one round
/// may be an outlier: a page fault, a scheduler hiccup).
const CALIBRATION_SAMPLE: (f64, f64) = (0.25, 4.0);

/// What a round does: `k == 0` is a plain target step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundPlan {
    pub drafter: Option<DrafterKind>,
    pub k: usize,
}

impl RoundPlan {
    pub const TARGET_ONLY: Self = Self {
        drafter: None,
        k: 0,
    };
}

/// The per-session K controller (saved whole by `--policy-file`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KPolicy {
    max_k: usize,
    model: DrafterCosts,
    /// N-gram lookup, per class of match length ([`crate::drafting::ngram::class`]): a long match is
    /// copied text, accepted far more often than a match of two tokens.
    ngram: [DrafterCosts; ngram::CLASSES],
    /// The class of this round's n-gram match.
    ngram_class: usize,
    /// Verify wall time by block size.
    verify: SizeCost,
    /// `verify` as it stood after the session's first [`EARLY_ROUNDS`] rounds: what the next
    /// session starts from ([`Self::continued`]).
    early_verify: Option<SizeCost>,
    /// Rounds observed in this session.
    rounds: u32,
    /// How often the draft's guess of the bonus token is the target's, when every draft was
    /// accepted (what makes a block drafted ahead usable), and how often it was seen.
    guess: f64,
    guesses: u32,
    /// Seconds since the draft-node's model last drafted a round, and rounds.
    idle_seconds: f64,
    idle_rounds: u32,
    /// What a first probe is expected to cost, before the draft has been timed.
    first_probe_cost: f64,
    probes: u32,
    /// Seconds exploring may still lose: [`PROBE_BUDGET`] of each round without the model, less
    /// what each probe measurably lost against target-only decoding and what each background
    /// step on the target's cores took ([`Self::spend`]). Probes priced by the cost model alone
    /// lost about 5× their price on one machine (the gap fed first, the steps around them).
    explore_credit: f64,
    /// The model's round now running is a probe, priced at this many seconds.
    probing: Option<f64>,
    drafted_rounds: u32,
    /// Whether the engine drafts ahead during the verify.
    pipelining: bool,
    /// The model's drafts ready for the round being chosen (drafted during the last verify): a
    /// model round of at most as many costs no drafting ([`Self::choose`]).
    held: usize,
    /// The model's K at its long-run rate, its held drafts aside (as of the last choice): the
    /// length a block drafted ahead grows to, so that the pipeline follows the K the policy
    /// would choose, not the K of the block it holds ([`Self::ahead_plan`]).
    #[serde(default)]
    steady: usize,
    /// Drafts of background steps the target would have accepted, and those compared.
    shadow: [u32; 2],
    /// How much a background step of the draft-node slows the target's steps beside it.
    #[serde(default)]
    interference: Interference,
    /// The idle draft-node is behind the log (as of this round's choice), and the model would
    /// have won the round or been probed: it is caught up first ([`Self::set_model_behind`]).
    #[serde(skip)]
    behind: bool,
    #[serde(skip)]
    catch_up_wanted: bool,
    /// How often a token tree's sibling leaves are right ([`siblings`]).
    siblings: siblings::Siblings,
    /// How often drafts of each confidence are accepted: where a chain stops ([`confidence`]).
    confidence: confidence::Confidence,
}

impl KPolicy {
    pub fn new(max_k: usize) -> Self {
        let max_k = max_k.clamp(1, ADAPTIVE_MAX_K);
        Self {
            max_k,
            model: DrafterCosts::default(),
            ngram: PRIOR_NGRAM_ACCEPT.map(DrafterCosts::with_prior),
            ngram_class: 0,
            // Sized for every K, so that sessions with other bounds share what they learn.
            verify: SizeCost::new(ADAPTIVE_MAX_K + 1, PRIOR_VERIFY_SLOPE),
            early_verify: None,
            rounds: 0,
            guess: PRIOR_ACCEPT,
            guesses: 0,
            idle_seconds: 0.0,
            // No model round yet: not kept caught up until one ([`Self::catch_up_soon`]).
            idle_rounds: RECENT_ROUNDS,
            first_probe_cost: 0.0,
            probes: 0,
            explore_credit: 0.0,
            probing: None,
            drafted_rounds: 0,
            pipelining: true,
            held: 0,
            steady: 0,
            shadow: [0, 0],
            interference: Interference::default(),
            behind: false,
            catch_up_wanted: false,
            siblings: siblings::Siblings::default(),
            confidence: confidence::Confidence::default(),
        }
    }

    /// Whether blocks are drafted ahead during the verify (the request's `pipeline`).
    pub fn set_pipelining(&mut self, on: bool) {
        self.pipelining = on;
    }

    /// A policy for a new session that starts from what an earlier one at its load learnt: its
    /// costs as they were (the hardware's, the link's, the batches'), its acceptance
    /// as a prior worth at most [`CARRIED_TRIALS`] rounds per position (it depends on the text).
    /// The verify's costs are those of the earlier session's first rounds, where this one
    /// starts: a step's attention grows with the context, and on stories260K a step at position
    /// 250 took 2.5× one at position 5, so costs from the end of a generation made target-only
    /// look 2.5× slower than it was at the start of the next (whose model rounds then lost).
    pub fn continued(&self, max_k: usize) -> Self {
        let mut next = Self::new(max_k);
        next.verify = self.early_verify.as_ref().unwrap_or(&self.verify).clone();
        next.guess = self.guess;
        next.interference = self.interference.carried();
        next.guesses = self.guesses.min(CARRIED_TRIALS);
        next.siblings = self.siblings.clone();
        next.confidence = self.confidence.carried();
        for (to, from) in std::iter::once((&mut next.model, &self.model))
            .chain(next.ngram.iter_mut().zip(&self.ngram))
        {
            *to = from.clone();
            for tried in &mut to.tried {
                *tried = (*tried).min(CARRIED_TRIALS);
            }
            // A calibration raised by one session's stalls weighs no more than its acceptance.
            to.calibrated = to.calibrated.min(CARRIED_TRIALS);
        }
        // A calibration is learnt only from the drafter's own rounds: a drafter it prices out is
        // never chosen to bring it back, and one session's bad luck would price it out of every
        // later session. The model carries half its excess; n-gram rounds cost the target's
        // verify alone, learnt by size, so what their calibration saw was one session's.
        next.model.calibration = 1.0 + (self.model.calibration - 1.0) / 2.0;
        for ngram in &mut next.ngram {
            (ngram.calibration, ngram.calibrated) = (1.0, 0);
        }
        next
    }

    fn costs(&self, drafter: DrafterKind) -> &DrafterCosts {
        match drafter {
            DrafterKind::Model => &self.model,
            DrafterKind::Ngram => &self.ngram[self.ngram_class],
        }
    }

    /// Estimated wall time to verify a block of `n` positions (before any verify: in units of
    /// one position's time, which is all the comparisons need).
    pub fn verify_seconds(&self, n: usize) -> f64 {
        self.verify
            .seconds(n)
            .unwrap_or(1.0 + PRIOR_VERIFY_SLOPE * (n as f64 - 1.0))
    }

    /// Expected tokens per second of drafting `k` with `drafter`.
    pub fn rate(&self, drafter: DrafterKind, k: usize) -> f64 {
        self.rate_with(drafter, k, self.verify_seconds(k + 1))
    }

    /// [`Self::rate`] given the verify's cost. A draft-node that can draft the next block while
    /// the target verifies this one ([`Self::ahead_k`]) costs no drafting time in the rounds
    /// where that block is used: all `k` drafts accepted and its guess of the bonus right. The
    /// calibration corrects the parts' sum for what they do not show, but a round never takes
    /// less than its own verify: on a loaded machine, drafted rounds that ran in a lull can
    /// calibrate a draft never accepted down to a quarter of its cost, cheaper than the target
    /// alone (a loaded soak saw one used for 81 rounds of 200 with nothing accepted).
    fn rate_with(&self, drafter: DrafterKind, k: usize, verify: f64) -> f64 {
        self.costs(drafter).expected_tokens(k) / self.calibrated_round(drafter, k, verify)
    }

    /// [`Self::round_seconds`] calibrated, and no less than the verify.
    fn calibrated_round(&self, drafter: DrafterKind, k: usize, verify: f64) -> f64 {
        let calibration = self.costs(drafter).calibration;
        (self.round_seconds(drafter, k, verify) * calibration).max(verify)
    }

    /// The expected wall time of a round drafting `k` with `drafter`, as the parts add up
    /// (before calibration); a model round of at most the drafts held ready drafts nothing
    /// before its verify.
    fn round_seconds(&self, drafter: DrafterKind, k: usize, verify: f64) -> f64 {
        let draft = if drafter == DrafterKind::Model && k <= self.held {
            0.0
        } else {
            self.costs(drafter).draft_seconds(k)
        };
        match drafter {
            DrafterKind::Model => draft + self.ahead_plan(k, verify).map_or(verify, |(_, t)| t),
            DrafterKind::Ngram => draft + verify,
        }
    }

    /// Drafting ahead during the verify of a block of `k` drafts, where it pays: the block's
    /// length past the guess of the bonus token (`k`, or one more where that fits in the verify
    /// as well: [`Self::ahead_k`]), and the round's expected time past its drafting: the longer
    /// of the verify and the step drafting ahead, less the next round's draft saved on a hit
    /// (every draft accepted, the guess right: the next round's drafts are then held ready).
    /// `None` where verifying alone is expected to be as fast: a step ahead that outlasts the
    /// verify delays the round, and saves a draft only on a hit, so a poor draft is not drafted
    /// ahead of (a miss must cost no more than a round without the pipeline).
    fn ahead_plan(&self, k: usize, verify: f64) -> Option<(usize, f64)> {
        let fits = self.ahead_k(k);
        if k == 0 || fits < k {
            return None;
        }
        let costs = &self.model;
        let beside = self.beside(verify);
        let step = |len: usize| beside.max(costs.draft_seconds(len + 1));
        let hit = costs.all_accepted(k) * self.guess;
        // One more than K only where it costs the round nothing more: a block of K + 1 held
        // lets the policy grow K without drafting, but a step past the verify delays the round.
        let len = if fits > k && step(k + 1) <= step(k) {
            k + 1
        } else {
            k
        };
        let mut plan = (len, step(len) - hit * costs.draft_seconds(k));
        // Up to the long-run K where that is longer and saves the next round more than it
        // delays this one: held drafts are priced free, so a block as long as this round's K
        // kept K where it was (a tool call after summaries ran K = 1 where K = 2 paid).
        let steady = self.steady;
        if steady > len && steady <= fits {
            let longer = step(steady) - hit * costs.draft_seconds(steady);
            if longer < plan.1 {
                plan = (steady, longer);
            }
        }
        (plan.1 < verify).then_some(plan)
    }

    /// What the model predicts for a round that went as `round` did.
    fn seconds_of(&self, drafter: DrafterKind, round: &RoundCosts) -> f64 {
        let (costs, k) = (self.costs(drafter), round.drafted);
        let draft = if round.drafted_ahead {
            0.0
        } else {
            costs.draft_seconds(k)
        };
        let verify = self.verify_seconds(k + round.siblings + 1);
        if round.drafted_next > 0 {
            draft
                + self
                    .beside(verify)
                    .max(costs.draft_seconds(round.drafted_next))
        } else {
            draft + verify
        }
    }

    /// A verify of `verify` seconds alone, beside the draft-node's step drafting ahead: slowed
    /// as a target step beside a background step is ([`Self::observe_target_step`]), not at
    /// all until that has been timed. Nothing where the draft-node has a machine of its own; on
    /// one machine's two cores the real pair's verify of 2 positions took 57 ms beside a step
    /// against 47 alone.
    fn beside(&self, verify: f64) -> f64 {
        verify * (1.0 + self.interference.slowdown(0.0))
    }

    /// How many tokens the draft-node can draft past a block of `k` while the target verifies
    /// it (its guess of the bonus token not counted): the most whose expected time is within
    /// [`AHEAD_WINDOW`] times the verify's (the round waits for the longer of the two, which
    /// the rate accounts for). 0 before the draft has been timed, or when not even two fit.
    pub fn ahead_k(&self, k: usize) -> usize {
        if !self.pipelining || !self.model.timed() {
            return 0;
        }
        let window = AHEAD_WINDOW * self.verify_seconds(k + 1);
        (1..=self.max_k.max(k))
            .take_while(|&j| self.model.draft_seconds(j + 1) <= window)
            .last()
            .unwrap_or(0)
    }

    /// How many tokens an adaptive session drafts past a block of `k` during its verify (the
    /// guess of the bonus token not counted): one more than `k` where it fits, so that a policy
    /// that grows K (or explores a longer block) is not held to this K by its own pipeline; 0
    /// where drafting ahead is not expected to pay ([`Self::ahead_plan`]).
    pub fn ahead_len(&self, k: usize) -> usize {
        self.ahead_plan(k, self.verify_seconds(k + 1))
            .map_or(0, |(len, _)| len)
    }

    /// Whether the draft-node's cost has been measured.
    pub fn draft_timed(&self) -> bool {
        self.model.timed()
    }

    /// Learns the draft-node's cost from a step timed in the background, and what feeding the
    /// gap before it cost a token.
    pub fn observe_timing(&mut self, t: &Timing) {
        self.model.observe_costs(t.k, t.wall_secs, t.compute_secs);
        if t.fed > 0 {
            let feed = (t.task_secs - t.wall_secs).max(0.0) / t.fed as f64;
            self.model.feed.add(feed);
        }
    }

    /// Learns the draft's acceptance (and its guesses) from `k` drafts of a greedy background
    /// step that no round used, `accepted` of which were the target's tokens
    /// ([`crate::drafting::shadow`]).
    pub fn observe_shadow(&mut self, k: usize, accepted: usize) {
        self.model.observe_acceptance(k, accepted);
        // Greedy, each compared draft is also a guess of the target's next token after a
        // right prefix: the event that makes a block drafted ahead usable.
        for i in 0..k.min(accepted + 1) {
            self.observe_guess(i < accepted);
        }
        self.shadow[0] += accepted as u32;
        self.shadow[1] += k.min(accepted + 1) as u32;
    }

    /// Drafts of background steps the target would have accepted, and those compared.
    pub fn shadow_acceptance(&self) -> [u32; 2] {
        self.shadow
    }

    /// Learns from a draft step of `k` abandoned at its deadline: it cost at least that much.
    /// Entered as a round slower than predicted (the calibration, which rounds that go as
    /// predicted bring back), not as the cost of `k` tokens: a cost by size would stand until
    /// that size is drafted again, which its own price prevents.
    pub fn observe_stall(&mut self, k: usize, deadline: f64) {
        let expected = self.model.draft_seconds(k);
        self.model
            .calibrate(deadline / expected.max(f64::MIN_POSITIVE));
    }

    /// Learns whether the draft's guess of the bonus token was the target's, in a round whose
    /// `chain` model drafts were all accepted. Where it was the one guess of a greedy chain
    /// drafted ahead (`sole_greedy`), it is what draft `chain + 1` would have been, and right
    /// exactly where the target would have accepted it: the acceptance of a position no round
    /// drafts, learnt for free, which lets K grow where the text's drafts are better than the
    /// last text's.
    pub fn observe_guess_after(&mut self, chain: usize, right: bool, sole_greedy: bool) {
        self.observe_guess(right);
        if sole_greedy && chain > 0 {
            self.model.observe_position(chain, right);
        }
    }

    /// Learns whether the draft's guess of the bonus token was the target's, in a round whose
    /// drafts were all accepted.
    pub fn observe_guess(&mut self, right: bool) {
        self.guesses = self.guesses.saturating_add(1);
        let weight = LEARN_ACCEPT.max(1.0 / f64::from(self.guesses + PRIOR_WEIGHT));
        self.guess += weight * (f64::from(u8::from(right)) - self.guess);
    }

    /// Expected wall seconds of a verify of `n` positions, once a verify has been timed.
    pub fn expected_verify_seconds(&self, n: usize) -> Option<f64> {
        self.verify.seconds(n)
    }

    /// Expected wall seconds of a draft-node step of `k` tokens, once one has been timed.
    pub fn expected_draft_seconds(&self, k: usize) -> Option<f64> {
        self.model
            .compute
            .seconds(k)
            .map(|_| self.model.draft_seconds(k))
    }

    /// The best plan: `model` says whether the draft-node is attached, `ngram` what the n-gram
    /// lookup can propose, `remaining` how many tokens the generation may still take.
    /// `held`: the model's drafts ready for this round (drafted during the last verify).
    pub fn choose(
        &mut self,
        model: bool,
        held: usize,
        ngram: NgramOffer,
        remaining: usize,
    ) -> RoundPlan {
        self.held = held;
        self.catch_up_wanted = false;
        self.ngram_class = ngram::class(ngram.matched);
        self.seed_ngram_class();
        let ngram = ngram.len;
        // The first rounds measure target-only decoding, the cost every choice is weighed
        // against (extrapolating it from larger blocks overstates it where a forward's fixed
        // cost dominates).
        if self.verify.seen[0] < TARGET_ONLY_FIRST {
            return RoundPlan::TARGET_ONLY;
        }
        let cap = self.max_k.min(remaining.saturating_sub(1));
        // The model competes once it has been timed; before, only a probe tries it.
        let timed = self.model.timed();
        // Drafting must beat target-only by a margin: a near tie is noise, and K = 0 is safe.
        let verify: Vec<f64> = (1..=cap + 1).map(|n| self.verify_seconds(n)).collect();
        self.steady = if model && timed {
            self.steady_k(&verify)
        } else {
            0
        };
        let mut best = ((1.0 + MARGIN) / verify[0], RoundPlan::TARGET_ONLY);
        let mut best_model = None;
        for (drafter, limit) in [
            (DrafterKind::Model, if model && timed { cap } else { 0 }),
            (DrafterKind::Ngram, ngram.min(cap)),
        ] {
            // verify[k] is the block of k drafts plus one.
            for (k, verify) in verify.iter().enumerate().take(limit + 1).skip(1) {
                let rate = self.rate_with(drafter, k, *verify);
                if drafter == DrafterKind::Model && best_model.is_none_or(|(r, _)| rate > r) {
                    best_model = Some((rate, k));
                }
                let caught_up = drafter != DrafterKind::Model || !self.behind || self.held >= k;
                if rate > best.0 && caught_up {
                    best = (
                        rate,
                        RoundPlan {
                            drafter: Some(drafter),
                            k,
                        },
                    );
                }
            }
        }
        let mut plan = best.1;
        self.catch_up_wanted = self.behind && best_model.is_some_and(|(r, _)| r > best.0);
        if plan.drafter.is_some() {
            self.drafted_rounds += 1;
            let limit = if plan.drafter == Some(DrafterKind::Ngram) {
                ngram.min(cap)
            } else {
                cap
            };
            if self.drafted_rounds.is_multiple_of(EXPLORE_EVERY) && plan.k < limit {
                plan.k += 1;
            }
        }
        if plan.drafter.is_none()
            && ngram > 0
            && cap > 0
            && self.verify.seen[1] < TWO_POSITIONS_TIMED
        {
            // A block's verify is timed only where a round drafts: at the prior slope (a
            // quarter of a step per position) short matches never pay, so the target's real
            // slope (nearly flat on a CPU's first positions) was never learnt and nothing was
            // drafted in whole runs. One n-gram draft times it, charged as a probe, until the
            // verify of two positions has been timed twice (probed only before any block was
            // timed, one slow first block — a page fault, a step beside it — priced every
            // block out for good).
            let price = self.verify_seconds(2)
                - (1.0 + self.ngram[self.ngram_class].accept[0]) * self.verify_seconds(1);
            if self.explore_credit >= price {
                self.probing = Some(price.max(0.0));
                return RoundPlan {
                    drafter: Some(DrafterKind::Ngram),
                    k: 1,
                };
            }
        }
        if plan.drafter == Some(DrafterKind::Model) || !model || cap == 0 {
            return plan;
        }
        // A probe: the model's best K (every other probe one longer, so that the draft's cost is
        // seen at two sizes), once the time without it pays for the probe's expected loss. Not
        // where background steps measure the draft ([`crate::drafting::shadow`]): they learn its
        // acceptance and its cost for free, and a probe's real cost (the round trip, the gap it
        // feeds, the steps around it) was found well above its price (the real pair's code edit
        // at 20 ms: 1.17× with probes, n-gram lookup alone 1.69×).
        let k = best_model.map_or(1, |(_, k)| k);
        let k = (k + (self.probes % 2) as usize).min(cap);
        let price = self.probe_cost(k);
        if self.idle_seconds > 0.0
            && self.shadow[1] == 0
            && self.explore_credit >= price
            && self.model_could_pay()
        {
            if self.behind {
                self.catch_up_wanted = true;
                return plan;
            }
            self.probes += 1;
            self.probing = Some(price);
            return RoundPlan {
                drafter: Some(DrafterKind::Model),
                k,
            };
        }
        plan
    }

    /// The model's K with the best long-run rate (its held drafts and the long-run K aside),
    /// `verify[n - 1]` the verify of n positions.
    fn steady_k(&mut self, verify: &[f64]) -> usize {
        let held = std::mem::take(&mut self.held);
        self.steady = 0;
        let rate = |k: usize| self.rate_with(DrafterKind::Model, k, verify[k]);
        let best = (1..verify.len()).max_by(|&a, &b| rate(a).total_cmp(&rate(b)));
        self.held = held;
        best.unwrap_or(0)
    }

    /// Whether the draft-node's model could pay at all: at its measured costs (calibrated), its
    /// best K beats target-only by the margin were every draft accepted and every guess of the
    /// bonus token right. Where it could not, what it would accept cannot change the choice: it
    /// is not probed, and its background steps are spaced out ([`crate::drafting::shadow`]). True before
    /// it has been timed.
    pub fn model_could_pay(&self) -> bool {
        if !self.model.timed() {
            return true;
        }
        let target_only = (1.0 + MARGIN) / self.verify_seconds(1);
        (1..=self.max_k).any(|k| {
            let verify = self.verify_seconds(k + 1);
            let round = if self.ahead_k(k) >= k {
                verify.max(self.model.draft_seconds(k + 1))
            } else {
                verify + self.model.draft_seconds(k)
            };
            (k + 1) as f64 / (round * self.model.calibration) > target_only
        })
    }

    /// A class of n-gram match never tried starts from the nearest class tried (its acceptance
    /// as a prior worth [`PRIOR_WEIGHT`] rounds) where that is above its own prior: on a text
    /// that loops, every class is accepted, and a class first met at the prior lost its rounds
    /// to the draft model.
    fn seed_ngram_class(&mut self) {
        let c = self.ngram_class;
        if self.ngram[c].tried[0] > 0 {
            return;
        }
        let donor = (1..ngram::CLASSES)
            .flat_map(|d| [c.checked_add(d), c.checked_sub(d)])
            .flatten()
            .find(|&i| i < ngram::CLASSES && self.ngram[i].tried[0] > 0);
        if let Some(d) = donor {
            let (accept, tried) = (self.ngram[d].accept, self.ngram[d].tried);
            let seeded = &mut self.ngram[c];
            // Seeding only raises a class's prior: seeded down from two-token matches refused
            // in prose, five-token matches (copied text) were never drafted again, and summaries
            // lost n-gram lookup for the rest of the process.
            for i in 0..ADAPTIVE_MAX_K {
                if accept[i] > seeded.accept[i] {
                    seeded.accept[i] = accept[i];
                    seeded.tried[i] = tried[i].min(PRIOR_WEIGHT);
                }
            }
        }
    }

    /// The time a probe drafting `k` is expected to lose against target-only decoding of the
    /// tokens it commits.
    fn probe_cost(&self, k: usize) -> f64 {
        if !self.model.timed() {
            return self.first_probe_cost;
        }
        // Priced as the round is planned (drafted ahead of where that pays), calibrated.
        let round = self.calibrated_round(DrafterKind::Model, k, self.verify_seconds(k + 1));
        (round - self.model.expected_tokens(k) * self.verify_seconds(1)).max(0.0)
    }

    /// A one-line account of the estimates (for debug logs).
    pub fn summary(&self) -> String {
        let model: Vec<String> = (1..=self.max_k)
            .map(|k| format!("{:.0}", self.rate(DrafterKind::Model, k)))
            .collect();
        format!(
            "target-only {:.0} tok/s, model by K {:?} (timed {}, calibration {:.2}, acceptance {:?}, draft s by K {:?}, ahead {}, shadow {:?}), verify s by n {:?}, guess {:.2}, idle {:.2} s, background slowdown {:.2}",
            1.0 / self.verify_seconds(1),
            model,
            self.model.timed(),
            self.model.calibration,
            self.model.accept.map(|a| (a * 100.0).round() / 100.0),
            (1..=self.max_k)
                .map(|k| (self.model.draft_seconds(k) * 1e3).round() / 1e3)
                .collect::<Vec<_>>(),
            self.ahead_k(self.max_k),
            self.shadow,
            (1..=self.max_k + 1)
                .map(|n| (self.verify_seconds(n) * 1e3).round() / 1e3)
                .collect::<Vec<_>>(),
            self.guess,
            self.idle_seconds,
            self.interference.slowdown(f64::NAN),
        )
    }

    /// What a first probe is expected to cost: how long the draft's session took to open.
    pub fn set_first_probe_cost(&mut self, seconds: f64) {
        self.first_probe_cost = seconds;
    }

    /// The exploration credit left, in seconds ([`Self::spend`]).
    pub fn explore_credit(&self) -> f64 {
        self.explore_credit
    }

    /// Charges `seconds` of exploration to the credit: a background step that ran on the
    /// target's cores.
    pub fn spend(&mut self, seconds: f64) {
        self.explore_credit -= seconds;
    }

    /// Learns from a finished round: `drafted` tokens by `plan.drafter` (fewer than `plan.k` when
    /// the drafter had no more), `accepted` of them, the drafter's wall and compute seconds and
    /// the verify's wall seconds.
    pub fn observe(&mut self, plan: RoundPlan, round: &RoundCosts) {
        let wall = if round.round_wall > 0.0 {
            round.round_wall
        } else {
            round.draft_wall + round.verify_wall
        };
        if let Some(price) = self.probing.take() {
            // What the probe lost against decoding its tokens without the draft, and at least
            // its price (a round measured faster than its parts is a lull's luck).
            let committed = (round.accepted + 1) as f64;
            self.spend((wall - committed * self.verify_seconds(1)).max(price));
        }
        if plan.drafter == Some(DrafterKind::Model) {
            (self.idle_seconds, self.idle_rounds) = (0.0, 0);
        } else {
            self.idle_seconds += round.draft_wall + round.verify_wall;
            self.idle_rounds = self.idle_rounds.saturating_add(1);
            let cap = (CREDIT_CAP_TOKENS * self.verify_seconds(1)).max(self.probe_cost(self.max_k));
            self.explore_credit = (self.explore_credit + wall * PROBE_BUDGET).min(cap);
        }
        self.earn_background(wall);
        if let Some(drafter) = plan.drafter {
            // How long the round took against what the model, as it stood, predicts for a round
            // that went as this one did (whether its drafts were ready, whether the next block
            // was drafted during its verify): acceptance's luck is not a cost.
            let predicted = self.seconds_of(drafter, round);
            let costs = match drafter {
                DrafterKind::Model => &mut self.model,
                DrafterKind::Ngram => &mut self.ngram[self.ngram_class],
            };
            if costs.timed() && round.round_wall > 0.0 && predicted > 0.0 {
                costs.calibrate(round.round_wall / predicted);
            }
            costs.observe_acceptance(round.drafted, round.accepted);
            // Drafts made ahead, during the last verify, cost this round nothing to learn from.
            if !round.drafted_ahead {
                costs.observe_costs(round.drafted, round.draft_wall, round.draft_compute);
            }
        }
        // A verify of n positions does what n decode steps do, at once: a block timed slower
        // than that was slowed by something else (a page fault, a step beside it), and at a
        // size timed once it would price longer blocks out for good.
        let n = round.drafted + round.siblings + 1;
        let bound = if self.verify.seen[0] > 0 && n > 1 {
            n as f64 * self.verify_seconds(1)
        } else {
            f64::INFINITY
        };
        // What the verify cost alone: one beside a step drafting ahead, timed as it was, made
        // every block look 10 ms a position dearer than it is alone, and priced n-gram lookup's
        // blocks (never beside a step) out where they paid.
        let alone = if round.drafted_next > 0 {
            round.verify_wall / self.beside(1.0)
        } else {
            round.verify_wall
        };
        self.verify.observe(n, alone.min(bound));
        self.rounds = self.rounds.saturating_add(1);
        if self.rounds == EARLY_ROUNDS {
            self.early_verify = Some(self.verify.clone());
        }
    }
}

/// A draft step timed in the background: K, what it cost, and what it drafted past the first
/// `from` tokens of the log.
#[derive(Debug)]
pub struct Timing {
    pub k: usize,
    pub wall_secs: f64,
    pub compute_secs: f64,
    /// The whole background task's wall seconds: the step and the gap it fed first.
    pub task_secs: f64,
    /// Tokens of that gap.
    pub fed: usize,
    pub from: usize,
    pub tokens: Vec<u32>,
}

/// What one round cost.
#[derive(Debug, Clone, Copy, Default)]
pub struct RoundCosts {
    pub drafted: usize,
    /// A token tree's sibling leaves besides the `drafted` chain (verified positions too).
    pub siblings: usize,
    /// The drafts were drafted ahead, during the previous round's verify.
    pub drafted_ahead: bool,
    /// Tokens the draft-node drafted during this round's verify, its guess of the bonus token
    /// included (0: none, or the step failed).
    pub drafted_next: usize,
    pub accepted: usize,
    pub draft_wall: f64,
    pub draft_compute: f64,
    pub verify_wall: f64,
    /// The whole round, from the plan to the verdict (0: not measured).
    pub round_wall: f64,
}

mod background;
mod confidence;
mod costs;
mod siblings;
#[cfg(test)]
mod tests;
