//! What every drafter gives and is asked for: a round's [`DraftBlock`] (a chain, or a token
//! tree), the [`Ask`] that shapes it, and why a step gave none ([`StepFailure`]).

use std::time::Duration;

use crate::error::Error;

pub use crate::nodes::steps::Ask;
use crate::nodes::steps::{DraftQ, Drafted};

/// Why a draft-node step gave no drafts.
#[derive(Debug)]
pub enum StepFailure {
    /// It failed (the node or the link).
    Failed(Error),
    /// It did not answer within its deadline.
    Stalled(Duration),
}

impl std::fmt::Display for StepFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Failed(e) => write!(f, "{e}"),
            Self::Stalled(d) => write!(f, "no drafts within the deadline of {d:?}"),
        }
    }
}

/// A round's drafts.
#[derive(Debug, Default)]
pub struct DraftBlock {
    pub tokens: Vec<u32>,
    pub q: Vec<DraftQ>,
    /// A token tree's parents (0: a child of the committed tokens, j + 1: of draft j); empty
    /// for a chain.
    pub parents: Vec<u32>,
    /// A chain's: the draft model's confidence at each draft; empty for a tree and for n-gram
    /// lookup.
    pub confidence: Vec<f32>,
    /// The drafter's compute (the node's report; the lookup's own time).
    pub compute_secs: f64,
    /// From asking to having the drafts.
    pub wall_secs: f64,
    /// Whether it was drafted during the last round's verify (the model's block ahead).
    pub drafted_ahead: bool,
}

impl DraftBlock {
    /// Drafts with one-hot q (a deterministic drafter's: exact under the acceptance rule,
    /// whatever the sampling), made in `secs`.
    pub fn one_hot(tokens: Vec<u32>, parents: Vec<u32>, secs: f64) -> Self {
        let q = tokens.iter().map(|&t| DraftQ::one_hot(t)).collect();
        Self {
            tokens,
            q,
            parents,
            compute_secs: secs,
            wall_secs: secs,
            ..Self::default()
        }
    }

    /// The first `k` drafts (and their q; a tree stays one, its parents before its children).
    pub fn truncated(mut self, k: usize) -> Self {
        self.tokens.truncate(k);
        self.q.truncate(k);
        self.parents.truncate(k);
        self.confidence.truncate(k);
        self
    }

    /// A draft step's answer, `wall_secs` after asking.
    pub fn drafted(d: Drafted, wall_secs: f64) -> Self {
        Self {
            tokens: d.tokens,
            q: d.q,
            parents: d.parents,
            confidence: d.confidence,
            compute_secs: d.compute_secs,
            wall_secs,
            drafted_ahead: false,
        }
    }

    /// A chain cut where the draft was unsure, as the draft-node cuts the chains it drafts
    /// (its `min_confidence`): before its first draft past the first whose
    /// confidence is below `bound`. A tree, or a block without confidences, stays whole.
    pub fn cut(self, bound: f32) -> Self {
        if !self.parents.is_empty() || self.confidence.len() != self.tokens.len() {
            return self;
        }
        let n = self.tokens.len();
        let keep = (1..n).find(|&i| self.confidence[i] < bound).unwrap_or(n);
        self.truncated(keep)
    }

    /// Where a first draft (a chain's, or any of a tree's at its first depth) is `token`: the
    /// drafts under it, as a block of their own (its children first-depth drafts; a block that
    /// is one path a chain). `None` where no first draft is `token` or the block is malformed.
    pub fn under(&self, token: u32) -> Option<Self> {
        let n = self.tokens.len();
        let tree = !self.parents.is_empty();
        if self.q.len() != n || (tree && self.parents.len() != n) {
            return None;
        }
        // A node's parent in wire form: 0 the block's root, i + 1 the node i.
        let parent = |i: usize| if tree { self.parents[i] as usize } else { i };
        let at = (0..n).find(|&i| parent(i) == 0 && self.tokens[i] == token)?;
        let mut below = Self::default();
        // Each node's index in the new block, where it is under `at`.
        let mut index: Vec<Option<u32>> = vec![None; n];
        for i in at + 1..n {
            let p = parent(i);
            let new_parent = if p == at + 1 {
                Some(0)
            } else {
                p.checked_sub(1)
                    .filter(|&p| p < i)
                    .and_then(|p| index[p])
                    .map(|j| j + 1)
            };
            if let Some(new_parent) = new_parent {
                index[i] = Some(below.tokens.len() as u32);
                below.tokens.push(self.tokens[i]);
                below.q.push(self.q[i].clone());
                below.parents.push(new_parent);
                below.confidence.extend(self.confidence.get(i));
            }
        }
        if chain_len(&below.parents, below.tokens.len()) == below.tokens.len() {
            below.parents.clear();
        }
        Some(below)
    }
}

/// How many of a block's `drafts` (`parents` in wire form, empty for a chain) are its chain:
/// the drafts before the first that is not the child of the one before it.
pub fn chain_len(parents: &[u32], drafts: usize) -> usize {
    if parents.is_empty() {
        return drafts;
    }
    parents
        .iter()
        .enumerate()
        .take_while(|&(i, &p)| p as usize == i)
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(tokens: &[u32], parents: &[u32]) -> DraftBlock {
        DraftBlock::one_hot(tokens.to_vec(), parents.to_vec(), 0.0)
    }

    #[test]
    fn the_drafts_under_the_right_guess_are_a_block_of_their_own() {
        // A chain: what follows its first draft, when that was the guess.
        let chain = block(&[5, 6, 7], &[]);
        let under = chain.under(5).expect("the guess");
        assert_eq!((under.tokens, under.parents), (vec![6, 7], vec![]));
        assert_eq!(under.q.len(), 2);
        assert!(chain.under(6).is_none(), "6 is not a first draft");
        assert_eq!(block(&[5], &[]).under(5).map(|p| p.tokens), Some(vec![]));
        // Under the guess, a chain drafted whole is cut as the draft-node would have cut it.
        let mut sure = block(&[5, 6, 7, 8], &[]);
        sure.confidence = vec![0.1, 0.9, 0.3, 0.9];
        let under = |bound| sure.under(5).expect("the guess").cut(bound);
        assert_eq!(under(0.0).confidence, [0.9, 0.3, 0.9]);
        assert_eq!(under(0.5).tokens, [6]);
        assert_eq!(under(0.2).tokens, [6, 7, 8]);
        assert_eq!(under(0.95).tokens, [6], "the first draft is always kept");
        // A tree: guesses 5 and 9 at the first depth; under 5 a chain 6, 7 and 8 beside 6;
        // under 9 the path 10, 11.
        let tree = block(&[5, 6, 7, 9, 8, 10, 11], &[0, 1, 2, 0, 1, 4, 6]);
        let under = tree.under(5).expect("the first guess");
        assert_eq!(
            (under.tokens, under.parents),
            (vec![6, 7, 8], vec![0, 1, 0])
        );
        let under = tree.under(9).expect("the second guess");
        assert_eq!((under.tokens, under.parents), (vec![10, 11], vec![]));
        assert!(tree.under(6).is_none(), "6 is under 5, not a guess");
        // Malformed: parents that do not fit, a node's parent after it.
        assert!(block(&[5, 6], &[0]).under(5).is_none());
        let forward = block(&[5, 6, 7], &[0, 3, 1]);
        assert_eq!(forward.under(5).map(|p| p.tokens), Some(vec![7]));
    }
}
