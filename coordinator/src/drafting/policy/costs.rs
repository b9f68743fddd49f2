//! The policy's measured costs: a time's moving average ([`Ewma`]) and a cost by size
//! ([`SizeCost`]: the verify's by positions, a drafter's compute by K).

use serde::{Deserialize, Serialize};

use super::LEARN;

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
