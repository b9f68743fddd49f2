//! The speculative acceptance rule (docs/architecture.md invariant 1): accept draft token x only when
//! q(x) > 0 and p(x) > 0, with probability min(1, p(x)/q(x)); on the first rejection sample from
//! norm(max(0, p − q)), or from p itself when that residual is empty (possible only through
//! rounding or a lying q); if every draft is accepted, sample a bonus token from p. With a
//! one-hot p (greedy target) this is exact matching against the target's argmax.
//!
//! Every uniform comes from [`Draws`] keyed by the position it decides ([`ACCEPT_DRAW`] for the
//! test, [`SAMPLE_DRAW`] for the token sampled there), so verifying the same block at the same
//! position again gives the same verdict.

use crate::sampling::rng::{ACCEPT_DRAW, Draws, SAMPLE_DRAW};
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
/// (one per draft plus one for the bonus position). `start` is the position of the first draft
/// (the committed length), which keys the draws.
///
/// # Panics
/// If `q.len() != drafts.len()` or `p.len() != drafts.len() + 1`: callers build these from the
/// same block.
pub fn verify(
    drafts: &[u32],
    q: &[Distribution],
    p: &[Distribution],
    draws: &Draws,
    start: usize,
) -> Verdict {
    assert_eq!(q.len(), drafts.len(), "one draft distribution per draft");
    assert_eq!(
        p.len(),
        drafts.len() + 1,
        "one target distribution per draft plus the bonus"
    );
    for (i, &x) in drafts.iter().enumerate() {
        let (px, qx) = (p[i].prob(x), q[i].prob(x));
        let position = start + i;
        // Ratios of ≥ 1 decide without looking at the draw (always so for a greedy target).
        let accept = qx > 0.0
            && px > 0.0
            && (px >= qx || draws.uniform(position, ACCEPT_DRAW) < f64::from(px) / f64::from(qx));
        if !accept {
            return Verdict {
                accepted: i,
                next: residual(&p[i], &q[i], draws.uniform(position, SAMPLE_DRAW)),
            };
        }
    }
    let bonus = start + drafts.len();
    Verdict {
        accepted: drafts.len(),
        next: p[drafts.len()].sample(draws.uniform(bonus, SAMPLE_DRAW)),
    }
}

/// Samples from norm(max(0, p − q)) with the uniform `u`; from p when that is empty.
fn residual(p: &Distribution, q: &Distribution, u: f64) -> u32 {
    match p {
        // One-hot p at t: max(0, p − q) is zero everywhere but at t, or everywhere; either way t.
        Distribution::OneHot(t) => *t,
        Distribution::Dense(p) => {
            let weights: Vec<f32> = p
                .iter()
                .enumerate()
                .map(|(i, &pi)| (pi - q.prob(i as u32)).max(0.0))
                .collect();
            if weights.iter().all(|&w| w == 0.0) {
                sample_weights(p, u)
            } else {
                sample_weights(&weights, u)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::rng::Rng;
    use Distribution::{Dense, OneHot};

    fn draws() -> Draws {
        Draws::new(0, 0)
    }

    #[test]
    fn greedy_target_is_exact_match() {
        let p = [OneHot(5), OneHot(6), OneHot(7)];
        let q = [OneHot(5), OneHot(9)];
        assert_eq!(
            verify(&[5, 9], &q, &p, &draws(), 0),
            Verdict {
                accepted: 1,
                next: 6
            }
        );
        let q = [OneHot(5), OneHot(6)];
        assert_eq!(
            verify(&[5, 6], &q, &p, &draws(), 0),
            Verdict {
                accepted: 2,
                next: 7
            }
        );
        assert_eq!(
            verify(&[], &[], &p[..1], &draws(), 0),
            Verdict {
                accepted: 0,
                next: 5
            }
        );
    }

    /// The bug this rule once had: `p(x) >= q(x)` held when both were 0, so a q without mass on
    /// the draft made a token the target gives no probability the output.
    #[test]
    fn no_mass_on_either_side_is_never_accepted() {
        let p_zero_at_3 = Dense(vec![0.5, 0.5, 0.0, 0.0]);
        for seed in 0..200 {
            let d = Draws::new(seed, 0);
            // p(x) = 0 and q(x) = 0: a lying q.
            let v = verify(&[3], &[OneHot(1)], &[p_zero_at_3.clone(), OneHot(0)], &d, 9);
            assert_eq!(v.accepted, 0);
            assert!(v.next < 2, "the correction comes from p's support: {v:?}");
            // p(x) = 0, q(x) > 0: an honest draft the target disagrees with.
            let q = Dense(vec![0.0, 0.0, 0.0, 1.0]);
            let v = verify(&[3], &[q], &[p_zero_at_3.clone(), OneHot(0)], &d, 9);
            assert_eq!(v.accepted, 0);
            assert!(v.next < 2, "{v:?}");
            // q(x) = 0, p(x) > 0: still refused, however likely the target finds x.
            let p = Dense(vec![0.1, 0.1, 0.1, 0.7]);
            let v = verify(
                &[3],
                &[Dense(vec![0.5, 0.5, 0.0, 0.0])],
                &[p, OneHot(0)],
                &d,
                9,
            );
            assert_eq!(v.accepted, 0, "{v:?}");
            // A greedy target with a one-hot q elsewhere.
            let v = verify(&[3], &[OneHot(2)], &[OneHot(3), OneHot(0)], &d, 9);
            assert_eq!(
                v,
                Verdict {
                    accepted: 0,
                    next: 3
                }
            );
        }
    }

    /// When p ≤ q everywhere (q over-states mass, only possible through rounding or a lie) the
    /// residual is empty: the correction is drawn from p, never token 0 by default.
    #[test]
    fn an_empty_residual_samples_from_p() {
        let p = Dense(vec![0.0, 0.5, 0.5]);
        let q = Dense(vec![0.0, 0.6, 0.6]);
        let mut seen = [0u32; 3];
        for seed in 0..2_000 {
            let v = verify(
                &[1],
                std::slice::from_ref(&q),
                &[p.clone(), p.clone()],
                &Draws::new(seed, 0),
                0,
            );
            if v.accepted == 0 {
                seen[v.next as usize] += 1;
            }
        }
        assert_eq!(seen[0], 0, "token 0 has no mass in p");
        assert!(seen[1] > 50 && seen[2] > 50, "both of p's tokens: {seen:?}");
    }

    #[test]
    fn the_same_block_at_the_same_position_gets_the_same_verdict() {
        let p = Dense(vec![0.2, 0.3, 0.5]);
        let q = Dense(vec![0.6, 0.3, 0.1]);
        let ps = [p.clone(), p.clone(), p];
        let qs = [q.clone(), q];
        let verdicts: Vec<Verdict> = (0..50)
            .map(|n| verify(&[0, 0], &qs, &ps, &Draws::new(4, 1), n))
            .collect();
        for (n, v) in verdicts.iter().enumerate() {
            assert_eq!(*v, verify(&[0, 0], &qs, &ps, &Draws::new(4, 1), n));
        }
        assert!(
            verdicts.iter().any(|v| *v != verdicts[0]),
            "other positions draw other numbers"
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

    /// The first token of a speculative step must be distributed as p, for any q: a spread
    /// one, a truncated one (the draft's compact support), and a one-hot one (a deterministic
    /// drafter such as n-gram lookup), on a token p favours, disfavours or excludes.
    #[test]
    fn first_token_is_distributed_as_target() {
        let p = vec![0.5f32, 0.3, 0.15, 0.05, 0.0];
        let pd = Dense(p.clone());
        for qd in [
            Dense(vec![0.1, 0.1, 0.2, 0.3, 0.3]),
            Dense(vec![0.0, 0.6, 0.4, 0.0, 0.0]),
            OneHot(0),
            OneHot(3),
            OneHot(4),
        ] {
            let mut counts = [0u64; 5];
            for position in 0..100_000 {
                let d = Draws::new(42, 7);
                let x = qd.sample(Draws::new(42, 8).uniform(position, SAMPLE_DRAW));
                let v = verify(
                    &[x],
                    std::slice::from_ref(&qd),
                    &[pd.clone(), pd.clone()],
                    &d,
                    position,
                );
                let first = if v.accepted == 1 { x } else { v.next };
                counts[first as usize] += 1;
            }
            let expected: Vec<f64> = p.iter().map(|&x| f64::from(x)).collect();
            let stat = chi_square(&counts, &expected);
            // 3 degrees of freedom (token 4 has p = 0 and must never appear): the 0.999
            // quantile is 16.27.
            assert_eq!(counts[4], 0, "q {qd:?}");
            assert!(
                stat < 16.27,
                "q {qd:?}: chi-square {stat} counts {counts:?}"
            );
        }
    }

    /// A wrong residual (sampling the correction from p instead of norm(max(0, p − q))) is caught
    /// by the same test: the statistic explodes.
    #[test]
    fn a_wrong_residual_rule_fails_the_test() {
        let p = vec![0.5f32, 0.3, 0.15, 0.05];
        let q = vec![0.1f32, 0.1, 0.2, 0.6];
        let (pd, qd) = (Dense(p.clone()), Dense(q.clone()));
        let mut rng = Rng::new(1);
        let mut counts = [0u64; 4];
        for _ in 0..50_000 {
            let x = qd.sample(rng.uniform());
            let accept =
                rng.uniform() < (f64::from(p[x as usize]) / f64::from(q[x as usize])).min(1.0);
            let first = if accept { x } else { pd.sample(rng.uniform()) };
            counts[first as usize] += 1;
        }
        let expected: Vec<f64> = p.iter().map(|&x| f64::from(x)).collect();
        assert!(chi_square(&counts, &expected) > 100.0);
    }
}
