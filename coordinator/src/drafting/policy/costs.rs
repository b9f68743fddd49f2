//! The policy's measured costs: a time's moving average ([`Ewma`]), a cost by size
//! ([`SizeCost`]: the verify's by positions, a drafter's compute by K), and what is known of one
//! drafter ([`DrafterCosts`]: its acceptance by position, its costs, its calibration).

use serde::{Deserialize, Serialize};

use super::{ADAPTIVE_MAX_K, CALIBRATION_SAMPLE, LEARN, LEARN_ACCEPT, PRIOR_ACCEPT, PRIOR_WEIGHT};

/// How far above its moving average one time sample counts ([`Ewma`]).
const SPIKE: f64 = 2.0;

/// A moving average of a time that starts at its first sample. A sample above [`SPIKE`] times
/// the average enters as that bound: a time's noise is one-sided (a preemption, a page fault, a
/// packet queued adds, nothing subtracts), and on a 0.2 ms step one 4 ms hiccup unbounded moved
/// the average 3×, enough for a draft that cannot pay to look as if it did for a whole session.
/// A lasting slowdown still shows: each round raises the average by up to `LEARN · (SPIKE − 1)`.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub(super) struct Ewma(pub(super) Option<f64>);

impl Ewma {
    pub(super) fn add(&mut self, x: f64) {
        self.0 = Some(match self.0 {
            Some(v) if v > 0.0 => v + LEARN * (x.min(SPIKE * v) - v),
            _ => x,
        });
    }
}

/// How much slower the target's step runs while the draft-node computes beside it in the
/// background (a timing step of the idle draft, a catch-up): nothing where the draft-node has a
/// machine of its own; on one machine's two cores, where both models' decode steps are
/// memory-bound and share its bandwidth, a sixth (the real pair, split: 47 ms against 40).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub(super) struct Interference {
    /// A target-only round's verify, alone and beside a background step.
    alone: Ewma,
    beside: Ewma,
    /// Seconds the target's steps may still lose beside this session's background work: its
    /// budget earned so far ([`Self::earn`]), less what each step beside it measured slower than
    /// the target's step alone. A session starts with none.
    #[serde(skip)]
    credit: f64,
}

impl Interference {
    pub(super) fn observe(&mut self, beside: bool, seconds: f64) {
        if beside {
            if let Some(alone) = self.alone.0 {
                self.credit -= (seconds - alone).max(0.0);
            }
            self.beside.add(seconds);
        } else {
            self.alone.add(seconds);
        }
    }

    /// Adds `seconds` to what the target's steps may lose beside background work, up to `cap`.
    pub(super) fn earn(&mut self, seconds: f64, cap: f64) {
        self.credit = (self.credit + seconds).min(cap.max(self.credit));
    }

    /// What the target's steps may still lose beside background work, in seconds.
    pub(super) fn credit(&self) -> f64 {
        self.credit
    }

    /// The slowdown learnt, for a new session: without the last session's credit.
    pub(super) fn carried(&self) -> Self {
        Self {
            credit: 0.0,
            ..*self
        }
    }

    /// The target's slowdown beside a background step, as a fraction of its step alone;
    /// `prior` until both have been timed.
    pub(super) fn slowdown(&self, prior: f64) -> f64 {
        match (self.alone.0, self.beside.0) {
            (Some(alone), Some(beside)) if alone > 0.0 => (beside / alone - 1.0).max(0.0),
            _ => prior,
        }
    }
}

/// A cost that grows with a size (positions verified, tokens drafted): a moving average per size
/// seen, a least-squares line between and beyond them, and never less for a larger size than for
/// a smaller one seen (measured noise would otherwise make a longer block look cheaper). With
/// one size seen, other sizes scale by `1 + prior_slope · (size − 1)`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct SizeCost {
    by_size: Vec<Ewma>,
    pub(super) seen: Vec<u32>,
    prior_slope: f64,
    /// What the estimates follow from, refitted by each observation: the policy asks for some
    /// hundred estimates a round, which on a 0.2 ms target cost a few per cent of its speed
    /// when each was fitted afresh.
    fit: Option<Fit>,
    /// For each size, the largest cost seen at that size or below (the floor of an estimate).
    floor: Vec<f64>,
}

/// The sizes seen: one (scaled by the prior slope), or a least-squares line.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
enum Fit {
    One { size: f64, seconds: f64 },
    Line { mx: f64, my: f64, slope: f64 },
}

impl SizeCost {
    pub(super) fn new(max_size: usize, prior_slope: f64) -> Self {
        Self {
            by_size: vec![Ewma::default(); max_size],
            seen: vec![0; max_size],
            prior_slope,
            fit: None,
            floor: vec![0.0; max_size],
        }
    }

    pub(super) fn observe(&mut self, size: usize, seconds: f64) {
        let Some(i) = size.checked_sub(1).filter(|&i| i < self.by_size.len()) else {
            return;
        };
        self.by_size[i].add(seconds);
        self.seen[i] += 1;
        let seen = || {
            self.by_size
                .iter()
                .enumerate()
                .filter_map(|(i, e)| e.0.map(|v| ((i + 1) as f64, v)))
        };
        let count = seen().count() as f64;
        self.fit = if count == 1.0 {
            seen()
                .next()
                .map(|(size, seconds)| Fit::One { size, seconds })
        } else {
            let mx = seen().map(|p| p.0).sum::<f64>() / count;
            let my = seen().map(|p| p.1).sum::<f64>() / count;
            let sxx: f64 = seen().map(|p| (p.0 - mx).powi(2)).sum();
            let sxy: f64 = seen().map(|p| (p.0 - mx) * (p.1 - my)).sum();
            let slope = (sxy / sxx).max(0.0);
            Some(Fit::Line { mx, my, slope })
        };
        let mut floor = 0.0;
        for (f, e) in self.floor.iter_mut().zip(&self.by_size) {
            floor = e.0.map_or(floor, |v| f64::max(floor, v));
            *f = floor;
        }
    }

    /// The estimate for `size`: the moving average where it was seen, else from the fit; never
    /// less than a smaller size seen. `None` before any size was seen.
    pub(super) fn seconds(&self, size: usize) -> Option<f64> {
        let n = size as f64;
        let raw = match self.fit? {
            Fit::One { size, seconds } => {
                let scale = |x: f64| 1.0 + self.prior_slope * (x - 1.0);
                seconds * scale(n) / scale(size)
            }
            Fit::Line { mx, my, slope } => match size.checked_sub(1).map(|i| self.by_size.get(i)) {
                Some(Some(Ewma(Some(v)))) => *v,
                _ => (my + slope * (n - mx)).max(1e-6),
            },
        };
        let floor = size
            .checked_sub(1)
            .and_then(|i| self.floor.get(i.min(self.floor.len() - 1)))
            .copied()
            .unwrap_or(0.0);
        Some(raw.max(floor))
    }
}

/// What is known of one drafter.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct DrafterCosts {
    pub(super) accept: [f64; ADAPTIVE_MAX_K],
    /// Rounds that reached each position.
    pub(super) tried: [u32; ADAPTIVE_MAX_K],
    /// The link's round trip and the node's fixed cost: wall time beyond the compute.
    pub(super) overhead: Ewma,
    /// Compute by K (it includes feeding the previous round's tokens, a cost that does not grow
    /// with K: hence a line, not a per-token rate).
    pub(super) compute: SizeCost,
    /// Measured round time over the time the model predicted for it, as a moving average: what
    /// the parts do not show (a link that queues, contention for the cores, a block drafted
    /// ahead that ran late). Rates are divided by it, so a model that is wrong about a drafter
    /// stops choosing it after a few rounds.
    pub(super) calibration: f64,
    pub(super) calibrated: u32,
    /// Acceptance assumed where no round has reached a position.
    pub(super) prior: f64,
    /// Seconds a token of the gap a background step feeds before its drafts.
    #[serde(default)]
    pub(super) feed: Ewma,
}

impl Default for DrafterCosts {
    fn default() -> Self {
        Self::with_prior(PRIOR_ACCEPT)
    }
}

impl DrafterCosts {
    pub(super) fn with_prior(prior: f64) -> Self {
        Self {
            accept: [prior; ADAPTIVE_MAX_K],
            tried: [0; ADAPTIVE_MAX_K],
            overhead: Ewma::default(),
            compute: SizeCost::new(ADAPTIVE_MAX_K, 1.0),
            calibration: 1.0,
            calibrated: 0,
            prior,
            feed: Ewma::default(),
        }
    }

    /// For i = 1..=k, the probability that drafts 1..=i are all accepted. A position never
    /// reached is assumed to fare as the last one reached (acceptance by position is flat or
    /// falls slowly), so a draft that does well is tried on longer blocks.
    pub(super) fn reach(&self, k: usize) -> impl Iterator<Item = f64> + '_ {
        let (mut last, mut reach) = (self.prior, 1.0);
        (0..k.min(ADAPTIVE_MAX_K)).map(move |i| {
            if self.tried[i] > 0 {
                last = self.accept[i];
            }
            reach *= last;
            reach
        })
    }

    /// Probability that all of `k` drafts are accepted.
    pub(super) fn all_accepted(&self, k: usize) -> f64 {
        self.reach(k).last().unwrap_or(1.0)
    }

    /// Expected committed tokens of a round drafting `k` (accepted drafts plus one).
    pub(super) fn expected_tokens(&self, k: usize) -> f64 {
        1.0 + self.reach(k).sum::<f64>()
    }

    pub(super) fn draft_seconds(&self, k: usize) -> f64 {
        self.overhead.0.unwrap_or(0.0) + self.compute.seconds(k).unwrap_or(0.0)
    }

    pub(super) fn observe_acceptance(&mut self, k: usize, accepted: usize) {
        for i in 0..k.min(accepted + 1) {
            self.observe_position(i, i < accepted);
        }
    }

    /// Learns whether draft position `i` (from 0) was accepted, its earlier ones having been.
    pub(super) fn observe_position(&mut self, i: usize, hit: bool) {
        if i >= ADAPTIVE_MAX_K {
            return;
        }
        // A position reached for the first time starts from the one before it, as `reach`
        // assumed while it was untried (not from the fixed prior: one success on an
        // exploration round must not make a longer block look worse than before it).
        if self.tried[i] == 0 && i > 0 {
            self.accept[i] = self.accept[i - 1];
        }
        // The first trials weigh more, so a few rounds replace the prior.
        self.tried[i] = self.tried[i].saturating_add(1);
        let weight = LEARN_ACCEPT.max(1.0 / f64::from(self.tried[i] + PRIOR_WEIGHT));
        self.accept[i] += weight * (f64::from(u8::from(hit)) - self.accept[i]);
    }

    pub(super) fn timed(&self) -> bool {
        self.compute.seen.iter().any(|&n| n > 0)
    }

    pub(super) fn calibrate(&mut self, measured_over_predicted: f64) {
        let (low, high) = CALIBRATION_SAMPLE;
        self.calibrated = self.calibrated.saturating_add(1);
        let weight = LEARN.max(1.0 / f64::from(self.calibrated + PRIOR_WEIGHT));
        self.calibration += weight * (measured_over_predicted.clamp(low, high) - self.calibration);
    }

    pub(super) fn observe_costs(&mut self, k: usize, wall: f64, compute: f64) {
        if k > 0 {
            self.compute.observe(k, compute);
            self.overhead.add((wall - compute).max(0.0));
        }
    }
}
