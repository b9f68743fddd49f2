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
use crate::speculative::tree::DraftTree;

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
        if !accepts(px, qx, || draws.uniform(position, ACCEPT_DRAW)) {
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

/// Whether a draft the target gives `px` and the draft `qx` is accepted: never without mass on
/// both sides, with probability min(1, px/qx) from the uniform `draw` (ratios of ≥ 1 decide
/// without looking at it: always so for a greedy target).
fn accepts(px: f32, qx: f32, draw: impl FnOnce() -> f64) -> bool {
    qx > 0.0 && px > 0.0 && (px >= qx || draw() < f64::from(px) / f64::from(qx))
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

/// Outcome of verifying a token tree of drafts ([`DraftTree`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeVerdict {
    /// The accepted nodes, from a child of the committed prefix down one path.
    pub path: Vec<usize>,
    /// The token after them: the correction where every child of the path's last node was
    /// rejected, else the bonus token.
    pub next: u32,
}

/// The draws of sibling `k`'s acceptance test (sibling 0's is a chain's, [`ACCEPT_DRAW`]).
fn sibling_draw(k: usize) -> u64 {
    if k == 0 { ACCEPT_DRAW } else { 2 * k as u64 }
}

/// What is left of the target's distribution at a node after its rejected children: p itself,
/// or weights (not normalized) once a child was rejected.
enum Residual<'a> {
    Target(&'a Distribution),
    Weights(Vec<f32>, f64),
}

impl Residual<'_> {
    fn prob(&self, x: u32) -> f32 {
        match self {
            Self::Target(p) => p.prob(x),
            Self::Weights(w, total) => {
                (f64::from(w.get(x as usize).copied().unwrap_or(0.0)) / total) as f32
            }
        }
    }

    fn sample(&self, u: f64) -> u32 {
        match self {
            Self::Target(p) => p.sample(u),
            Self::Weights(w, _) => sample_weights(w, u),
        }
    }

    /// After a rejected child drawn from `q`: norm(max(0, r − q)), or r unchanged where that
    /// is empty.
    fn reject(self, q: &Distribution) -> Self {
        let weights: Vec<f32> = match &self {
            Self::Target(Distribution::OneHot(t)) => {
                let mut w = vec![0.0; *t as usize + 1];
                w[*t as usize] = (1.0 - q.prob(*t)).max(0.0);
                w
            }
            Self::Target(Distribution::Dense(p)) => p
                .iter()
                .enumerate()
                .map(|(i, &pi)| (pi - q.prob(i as u32)).max(0.0))
                .collect(),
            Self::Weights(w, total) => w
                .iter()
                .enumerate()
                .map(|(i, &wi)| ((f64::from(wi) / total) as f32 - q.prob(i as u32)).max(0.0))
                .collect(),
        };
        let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
        if total > 0.0 {
            Self::Weights(weights, total)
        } else {
            self
        }
    }
}

/// Verifies a token tree of drafts against the target, exactly (SpecInfer's multi-draft
/// rejection sampling): from the committed prefix down, a node's children are tried in order,
/// each against what is left of the target's distribution there after the ones before were
/// rejected, accepted with probability min(1, r(x)/q(x)) where `q[c]` is the distribution child
/// c was drawn from given its earlier siblings (one-hot for a child chosen, not sampled); a
/// rejection leaves norm(max(0, r − q)). The first accepted child is followed; where all are
/// rejected, or a node has none, the next token is drawn from what is left. `p[0]` is the
/// target's distribution after the committed prefix, `p[j + 1]` after node j; `start` is the
/// committed length. A chain verifies exactly as [`verify`] verifies it.
///
/// # Panics
/// If `q.len() != tree.len()` or `p.len() != tree.len() + 1`.
pub fn verify_tree(
    tree: &DraftTree,
    q: &[Distribution],
    p: &[Distribution],
    draws: &Draws,
    start: usize,
) -> TreeVerdict {
    assert_eq!(q.len(), tree.len(), "one draft distribution per node");
    assert_eq!(
        p.len(),
        tree.len() + 1,
        "one target distribution per node and the root"
    );
    let (mut path, mut at) = (Vec::new(), None);
    loop {
        let position = start + path.len();
        let mut r = Residual::Target(&p[at.map_or(0, |n: usize| n + 1)]);
        let mut accepted = None;
        for (k, c) in tree.children(at).enumerate() {
            let x = tree.tokens()[c];
            let (rx, qx) = (r.prob(x), q[c].prob(x));
            if accepts(rx, qx, || draws.uniform(position, sibling_draw(k))) {
                accepted = Some(c);
                break;
            }
            r = r.reject(&q[c]);
        }
        match accepted {
            Some(c) => {
                path.push(c);
                at = Some(c);
            }
            None => {
                let next = r.sample(draws.uniform(position, SAMPLE_DRAW));
                return TreeVerdict { path, next };
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

    fn dense(rng: &mut Rng, n: usize) -> Distribution {
        let w: Vec<f32> = (0..n).map(|_| rng.uniform() as f32).collect();
        let total: f32 = w.iter().sum();
        Dense(w.iter().map(|x| x / total).collect())
    }

    /// A chain as a tree gets the chain's verdict, draw for draw.
    #[test]
    fn a_chain_verified_as_a_tree_gets_the_chains_verdict() {
        let mut rng = Rng::new(3);
        for case in 0..2_000 {
            let k = case % 5;
            let q: Vec<Distribution> = (0..k).map(|_| dense(&mut rng, 6)).collect();
            let p: Vec<Distribution> = (0..=k)
                .map(|i| {
                    if case % 3 == 0 {
                        OneHot(((case + i) % 6) as u32)
                    } else {
                        dense(&mut rng, 6)
                    }
                })
                .collect();
            let drafts: Vec<u32> = q.iter().map(|d| d.sample(rng.uniform())).collect();
            let d = Draws::new(case as u64, 1);
            let chain = verify(&drafts, &q, &p, &d, case);
            let tree = verify_tree(&DraftTree::chain(&drafts), &q, &p, &d, case);
            assert_eq!(
                tree.path,
                (0..chain.accepted).collect::<Vec<_>>(),
                "case {case}"
            );
            assert_eq!(tree.next, chain.next, "case {case}");
        }
    }

    #[test]
    fn a_greedy_target_follows_the_branch_that_matches_its_argmax() {
        let limits = crate::speculative::tree::TreeLimits {
            max_nodes: 8,
            max_depth: 4,
        };
        // prefix ─ 4 ─ 9
        //        └ 5 ─ 6 ─ 8
        //              └ 7
        let tree = DraftTree::new(&[4, 5, 9, 6, 7, 8], &[0, 0, 1, 2, 2, 4], limits).expect("tree");
        let q: Vec<Distribution> = tree.tokens().iter().map(|&t| OneHot(t)).collect();
        let mut p = vec![OneHot(0); 7];
        p[0] = OneHot(5); // after the prefix: 5, the second child
        p[2] = OneHot(7); // after node 1 (5): 7, its second child
        p[5] = OneHot(3); // after node 4 (7): 3, not drafted
        let v = verify_tree(&tree, &q, &p, &draws(), 0);
        assert_eq!(
            v,
            TreeVerdict {
                path: vec![1, 4],
                next: 3
            }
        );
        p[0] = OneHot(2);
        let v = verify_tree(&tree, &q, &p, &draws(), 0);
        assert_eq!(
            v,
            TreeVerdict {
                path: vec![],
                next: 2
            }
        );
    }

    /// The tokens a tree commits follow the target's distribution whatever the draft proposes:
    /// the first token where the tree branches at the first depth (a child sampled from q and
    /// one chosen, q's likeliest other token), and the second where it branches at the second
    /// (after a first token the target is sure of). Skipping the residual after a rejected
    /// sibling fails it (chi-square above 10,000).
    #[test]
    fn a_trees_tokens_are_distributed_as_target_where_it_branches() {
        let limits = crate::speculative::tree::TreeLimits {
            max_nodes: 8,
            max_depth: 4,
        };
        let p = vec![0.45f32, 0.3, 0.15, 0.1, 0.0];
        let qd = Dense(vec![0.05, 0.15, 0.2, 0.3, 0.3]);
        for depth in [1, 2] {
            let mut counts = [0u64; 5];
            for position in 0..100_000 {
                let sampled = qd.sample(Draws::new(42, 8).uniform(position, SAMPLE_DRAW));
                // q's likeliest token other than the sampled one: 3, or 4 when 3 was sampled.
                let chosen = if sampled == 3 { 4 } else { 3 };
                let (tree, q, ps) = if depth == 1 {
                    let tree = DraftTree::new(&[sampled, chosen], &[0, 0], limits).expect("tree");
                    let ps = vec![Dense(p.clone()), OneHot(0), OneHot(0)];
                    (tree, vec![qd.clone(), OneHot(chosen)], ps)
                } else {
                    let tree =
                        DraftTree::new(&[1, sampled, chosen], &[0, 1, 1], limits).expect("tree");
                    let ps = vec![OneHot(1), Dense(p.clone()), OneHot(0), OneHot(0)];
                    (tree, vec![OneHot(1), qd.clone(), OneHot(chosen)], ps)
                };
                let v = verify_tree(&tree, &q, &ps, &Draws::new(42, 7), position);
                let committed: Vec<u32> = v
                    .path
                    .iter()
                    .map(|&n| tree.tokens()[n])
                    .chain([v.next])
                    .collect();
                counts[committed[depth - 1] as usize] += 1;
            }
            let expected: Vec<f64> = p.iter().map(|&x| f64::from(x)).collect();
            assert_eq!(counts[4], 0, "depth {depth}: p excludes token 4");
            let stat = chi_square(&counts, &expected);
            assert!(
                stat < 16.27,
                "depth {depth}: chi-square {stat}, counts {counts:?}"
            );
        }
    }
}
