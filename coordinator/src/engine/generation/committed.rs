//! A token tree's round (issue 31): which drafts the target's verdict committed, and what the
//! policy learns from it. A chain is the tree of one path; the draft-node's trees are its
//! chain of drafts (its own choices), then the branches off it.

use crate::error::{Error, Result};

use crate::drafting::block::chain_len;
use crate::nodes::steps::TargetVerdict;

/// What a verified block committed.
#[derive(Debug, PartialEq)]
pub struct Committed {
    /// The accepted drafts, then the target's next token.
    pub tokens: Vec<u32>,
    /// The chain's length (the drafts before any sibling) and how many of them were accepted.
    pub chain: (usize, usize),
    /// Whether the sibling beside the chain's first rejected draft, where the block had one,
    /// was right.
    pub sibling: Option<bool>,
}

/// The tokens a verdict commits from `drafts` (a chain, or a tree with `parents` in wire form),
/// its path checked to be one: from a child of the committed tokens, each node a child of the
/// one before.
pub fn committed(drafts: &[u32], parents: &[u32], verdict: &TargetVerdict) -> Result<Committed> {
    let accepted = verdict.accepted;
    let bad = |what: String| Error::Protocol {
        node: "target-node",
        what,
    };
    if accepted > drafts.len() || (verdict.refused.is_some() && accepted > 0) {
        return Err(bad(format!(
            "accepted {accepted} of {} drafts",
            drafts.len()
        )));
    }
    if parents.is_empty() {
        let mut tokens = drafts[..accepted].to_vec();
        tokens.push(verdict.next_token);
        return Ok(Committed {
            tokens,
            chain: (drafts.len(), accepted),
            sibling: None,
        });
    }
    let path = &verdict.path;
    let mut parent = 0;
    for &node in path {
        if parents.get(node) != Some(&parent) {
            return Err(bad(format!(
                "a path {path:?} not down the tree {parents:?}"
            )));
        }
        parent = node as u32 + 1;
    }
    if path.len() != accepted {
        return Err(bad(format!(
            "{accepted} accepted, a path of {}",
            path.len()
        )));
    }
    let chain = chain_len(parents, drafts.len());
    let on_chain = path
        .iter()
        .enumerate()
        .take_while(|&(depth, &node)| node == depth && node < chain)
        .count();
    // The sibling beside the first rejected chain draft, where the round reached it.
    let sibling = (on_chain < chain && verdict.refused.is_none())
        .then(|| {
            (chain..drafts.len())
                .find(|&j| parents[j] as usize == on_chain)
                .map(|j| path.get(on_chain) == Some(&j))
        })
        .flatten();
    let mut tokens: Vec<u32> = path.iter().map(|&i| drafts[i]).collect();
    tokens.push(verdict.next_token);
    Ok(Committed {
        tokens,
        chain: (chain, on_chain),
        sibling,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(accepted: usize, path: &[usize], next: u32) -> TargetVerdict {
        TargetVerdict {
            accepted,
            next_token: next,
            path: path.to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn a_verdict_commits_its_path_and_says_whether_the_sibling_was_right() {
        // A chain of three, siblings beside its first and third drafts.
        let drafts = [10, 11, 12, 20, 22];
        let parents = [0, 1, 2, 0, 2];
        let c = committed(&drafts, &parents, &verdict(2, &[0, 1], 7)).expect("chain path");
        assert_eq!(
            (c.tokens, c.chain, c.sibling),
            (vec![10, 11, 7], (3, 2), Some(false))
        );
        let c = committed(&drafts, &parents, &verdict(3, &[0, 1, 4], 7)).expect("sibling path");
        assert_eq!(
            (c.tokens, c.chain, c.sibling),
            (vec![10, 11, 22, 7], (3, 2), Some(true))
        );
        let c = committed(&drafts, &parents, &verdict(1, &[3], 7)).expect("root sibling");
        assert_eq!(
            (c.tokens, c.chain, c.sibling),
            (vec![20, 7], (3, 0), Some(true))
        );
        let c = committed(&drafts, &parents, &verdict(1, &[0], 7)).expect("no sibling there");
        assert_eq!((c.chain, c.sibling), ((3, 1), None));
        let c = committed(&drafts, &parents, &verdict(3, &[0, 1, 2], 7)).expect("all");
        assert_eq!((c.chain, c.sibling), ((3, 3), None));
        // A chain block (no parents): its leading drafts.
        let c = committed(&drafts[..3], &[], &verdict(1, &[], 9)).expect("chain");
        assert_eq!((c.tokens, c.chain), (vec![10, 9], (3, 1)));
        // Paths that are not down the tree, or not as long as the count, are the node's fault.
        for (accepted, path) in [(2, &[0, 2][..]), (1, &[4][..]), (2, &[0][..]), (6, &[][..])] {
            assert!(committed(&drafts, &parents, &verdict(accepted, path, 7)).is_err());
        }
    }
}
