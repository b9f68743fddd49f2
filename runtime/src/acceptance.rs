//! The speculative acceptance rule (DESIGN.md invariant 1): accept draft token x with
//! probability min(1, p(x)/q(x)); on the first rejection sample from norm(max(0, p − q)); if every
//! draft is accepted, sample a bonus token from p. With a one-hot p (greedy target) this is exact
//! matching against the target's argmax.

use crate::rng::Rng;
use crate::sampling::{Distribution, sample_weights};

/// Outcome of verifying one drafted block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// How many leading drafts were accepted.
    pub accepted: usize,
    /// The token after them: the correction on a rejection, else the bonus token.
    pub next: u32,
}

impl Verdict {
    /// The tokens this verdict commits: the accepted drafts, then the next token.
    pub fn committed(&self, drafts: &[u32]) -> Vec<u32> {
        let mut tokens = drafts[..self.accepted].to_vec();
        tokens.push(self.next);
        tokens
    }
}

/// Verifies `drafts` (sampled from `q`, one distribution per draft) against the target's `p`
/// (one per draft plus one for the bonus position).
///
/// # Panics
/// If `q.len() != drafts.len()` or `p.len() != drafts.len() + 1`: callers build these from the
/// same block.
pub fn verify(drafts: &[u32], q: &[Distribution], p: &[Distribution], rng: &mut Rng) -> Verdict {
    assert_eq!(q.len(), drafts.len(), "one draft distribution per draft");
    assert_eq!(
        p.len(),
        drafts.len() + 1,
        "one target distribution per draft plus the bonus"
    );
    for (i, &x) in drafts.iter().enumerate() {
        let (px, qx) = (p[i].prob(x), q[i].prob(x));
        // Ratios of 0 and ≥ 1 decide without a draw (always so for a greedy target).
        let accept = if px >= qx {
            true
        } else if px == 0.0 {
            false
        } else {
            rng.uniform() < f64::from(px) / f64::from(qx)
        };
        if !accept {
            return Verdict {
                accepted: i,
                next: residual(&p[i], &q[i], rng),
            };
        }
    }
    Verdict {
        accepted: drafts.len(),
        next: p[drafts.len()].sample(rng),
    }
}

/// Samples from norm(max(0, p − q)).
fn residual(p: &Distribution, q: &Distribution, rng: &mut Rng) -> u32 {
    match (p, q) {
        // One-hot p at t, rejected x ≠ t: the residual is all at t.
        (Distribution::OneHot(t), _) => *t,
        (Distribution::Dense(p), q) => {
            let weights: Vec<f32> = p
                .iter()
                .enumerate()
                .map(|(i, &pi)| (pi - q.prob(i as u32)).max(0.0))
                .collect();
            if weights.iter().all(|&w| w == 0.0) {
                // p == q up to rounding: a rejection is then vanishingly rare; p is the answer.
                sample_weights(p, rng)
            } else {
                sample_weights(&weights, rng)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_target_is_exact_match() {
        let mut rng = Rng::new(0);
        let p = [
            Distribution::OneHot(5),
            Distribution::OneHot(6),
            Distribution::OneHot(7),
        ];
        let q = [Distribution::OneHot(5), Distribution::OneHot(9)];
        assert_eq!(
            verify(&[5, 9], &q, &p, &mut rng),
            Verdict {
                accepted: 1,
                next: 6
            }
        );
        let q = [Distribution::OneHot(5), Distribution::OneHot(6)];
        assert_eq!(
            verify(&[5, 6], &q, &p, &mut rng),
            Verdict {
                accepted: 2,
                next: 7
            }
        );
        assert_eq!(
            verify(&[], &[], &p[..1], &mut rng),
            Verdict {
                accepted: 0,
                next: 5
            }
        );
    }

    /// Pearson chi-square statistic of observed counts against expected probabilities.
    fn chi_square(counts: &[u64], expected: &[f64]) -> f64 {
        let n: u64 = counts.iter().sum();
        counts
            .iter()
            .zip(expected)
            .filter(|(_, e)| **e > 0.0)
            .map(|(&c, &e)| {
                let e = e * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    /// The first token of a speculative step must be distributed as p, for any q.
    #[test]
    fn first_token_is_distributed_as_target() {
        let p = vec![0.5f32, 0.3, 0.15, 0.05, 0.0];
        let q = vec![0.1f32, 0.1, 0.2, 0.3, 0.3];
        let (pd, qd) = (Distribution::Dense(p.clone()), Distribution::Dense(q));
        let mut rng = Rng::new(42);
        let mut counts = [0u64; 5];
        let n = 200_000;
        for _ in 0..n {
            let x = qd.sample(&mut rng);
            let v = verify(
                &[x],
                std::slice::from_ref(&qd),
                &[pd.clone(), pd.clone()],
                &mut rng,
            );
            let first = if v.accepted == 1 { x } else { v.next };
            counts[first as usize] += 1;
        }
        let expected: Vec<f64> = p.iter().map(|&x| f64::from(x)).collect();
        let stat = chi_square(&counts, &expected);
        // 3 degrees of freedom (token 4 has p = 0 and must never appear): the 0.999 quantile
        // is 16.27.
        assert_eq!(counts[4], 0);
        assert!(stat < 16.27, "chi-square {stat} counts {counts:?}");
    }

    /// A wrong residual (sampling the correction from p instead of norm(max(0, p − q))) is caught
    /// by the same test: the statistic explodes.
    #[test]
    fn a_wrong_residual_rule_fails_the_test() {
        let p = vec![0.5f32, 0.3, 0.15, 0.05];
        let q = vec![0.1f32, 0.1, 0.2, 0.6];
        let (pd, qd) = (
            Distribution::Dense(p.clone()),
            Distribution::Dense(q.clone()),
        );
        let mut rng = Rng::new(1);
        let mut counts = [0u64; 4];
        for _ in 0..50_000 {
            let x = qd.sample(&mut rng);
            let accept =
                rng.uniform() < (f64::from(p[x as usize]) / f64::from(q[x as usize])).min(1.0);
            let first = if accept { x } else { pd.sample(&mut rng) };
            counts[first as usize] += 1;
        }
        let expected: Vec<f64> = p.iter().map(|&x| f64::from(x)).collect();
        assert!(chi_square(&counts, &expected) > 100.0);
    }
}
