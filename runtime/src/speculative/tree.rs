//! A block of drafts as a token tree (issue 31): nodes in order, each with its parent (an
//! earlier node, or none: a child of the last committed token), so that one verify pass can
//! score several continuations where the draft is unsure. A chain is the tree whose every node
//! is its predecessor's child. Parents come before their children, so a tree given this way has
//! no cycle; it is checked once, where it enters (size, depth, sibling tokens), and everything
//! a verifier needs — each node's depth (its position past the committed prefix), its
//! ancestors (what its attention sees of the block), the paths — is read from it.

use super::batch::{BlockVerified, VerifyJob, failed, one};
use crate::sampling::Distribution;
use crate::speculative::Verifier;
use crate::speculative::acceptance::TreeVerdict;
use crate::speculative::draft_check::DraftRefusal;
use crate::{Error, Result};

/// Bounds a tree is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeLimits {
    pub max_nodes: usize,
    pub max_depth: usize,
}

/// A checked token tree: `tokens[i]` is node i's token; `parents[i]` its parent node (always
/// before it), or none for a child of the committed prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftTree {
    tokens: Vec<u32>,
    parents: Vec<Option<usize>>,
    /// 1 for the children of the committed prefix.
    depths: Vec<usize>,
}

impl DraftTree {
    /// The chain of `tokens`, each the child of the one before.
    pub fn chain(tokens: &[u32]) -> Self {
        Self {
            tokens: tokens.to_vec(),
            parents: (0..tokens.len()).map(|i| i.checked_sub(1)).collect(),
            depths: (1..=tokens.len()).collect(),
        }
    }

    /// The tree of `tokens` with `parents` (wire form: 0 for a child of the committed prefix,
    /// j + 1 for a child of node j), refused — naming the node and what is wrong — where the
    /// lengths differ, a parent is not an earlier node, it has more nodes or is deeper than
    /// `limits` allow, or two children of one parent carry the same token (the same
    /// continuation twice).
    pub fn new(tokens: &[u32], parents: &[u32], limits: TreeLimits) -> Result<Self> {
        let bad = |value: String, why: String| Error::invalid("tree", value, why);
        if tokens.len() != parents.len() {
            return Err(bad(
                format!("{} tokens, {} parents", tokens.len(), parents.len()),
                "every node needs one token and one parent".into(),
            ));
        }
        if tokens.len() > limits.max_nodes {
            return Err(bad(
                format!("{} nodes", tokens.len()),
                format!("at most {} (--max-draft-tokens)", limits.max_nodes),
            ));
        }
        let mut tree = Self {
            tokens: tokens.to_vec(),
            parents: Vec::with_capacity(tokens.len()),
            depths: Vec::with_capacity(tokens.len()),
        };
        for (i, &wire) in parents.iter().enumerate() {
            let parent = match wire as usize {
                0 => None,
                j if j <= i => Some(j - 1),
                _ => {
                    return Err(bad(
                        format!("node {i}'s parent {wire}"),
                        "a parent is 0 (the committed prefix) or an earlier node j + 1: parents \
                         come before their children"
                            .into(),
                    ));
                }
            };
            let depth = parent.map_or(1, |p| tree.depths[p] + 1);
            if depth > limits.max_depth {
                return Err(bad(
                    format!("node {i} at depth {depth}"),
                    format!("at most {} deep", limits.max_depth),
                ));
            }
            let twin = (0..i).find(|&s| tree.parents[s] == parent && tokens[s] == tokens[i]);
            if let Some(s) = twin {
                return Err(bad(
                    format!("nodes {s} and {i}"),
                    format!("siblings carry the same token {}", tokens[i]),
                ));
            }
            tree.parents.push(parent);
            tree.depths.push(depth);
        }
        Ok(tree)
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Node `i`'s parent (none: a child of the committed prefix).
    pub fn parent(&self, i: usize) -> Option<usize> {
        self.parents[i]
    }

    /// Node `i`'s depth: 1 for a child of the committed prefix; its position is the committed
    /// length + depth − 1.
    pub fn depth(&self, i: usize) -> usize {
        self.depths[i]
    }

    /// The deepest node's depth (0 for no node).
    pub fn max_depth(&self) -> usize {
        self.depths.iter().copied().max().unwrap_or(0)
    }

    /// Whether each node is the child of the one before (one path).
    pub fn is_chain(&self) -> bool {
        self.parents
            .iter()
            .enumerate()
            .all(|(i, &p)| p == i.checked_sub(1))
    }

    /// The children of `parent` (none: of the committed prefix), in order.
    pub fn children(&self, parent: Option<usize>) -> impl Iterator<Item = usize> + '_ {
        (0..self.len()).filter(move |&i| self.parents[i] == parent)
    }

    /// Node `i`'s path from the committed prefix: its ancestors and itself, shallowest first
    /// (in node order too: parents come first). What its attention sees of the block.
    pub fn path(&self, i: usize) -> Vec<usize> {
        let mut path = Vec::with_capacity(self.depths[i]);
        let mut at = Some(i);
        while let Some(node) = at {
            path.push(node);
            at = self.parents[node];
        }
        path.reverse();
        path
    }

    /// The tokens of node `i`'s path.
    pub fn path_tokens(&self, i: usize) -> Vec<u32> {
        self.path(i).into_iter().map(|n| self.tokens[n]).collect()
    }

    /// The nodes no other node descends from: the ends of the tree's paths.
    pub fn leaves(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.len()).filter(move |&i| !self.parents.contains(&Some(i)))
    }
}

/// A verified token tree: the verdict, the tokens it commits (the accepted path's, then the
/// next token), and why the tree was refused when it was (the verdict is then one plain
/// target step).
#[derive(Debug, Clone, PartialEq)]
pub struct TreeVerified {
    pub verdict: TreeVerdict,
    pub committed: Vec<u32>,
    pub refused: Option<DraftRefusal>,
    /// With [`Verifier::report_logprobs`]: one per committed token, from the target's logits
    /// at its place on the path.
    pub logprobs: Vec<crate::sampling::TokenLogprobs>,
}

/// The deepest tree a verifier scores (its attention reads a path of at most this many nodes).
pub const MAX_TREE_DEPTH: usize = crate::kernels::MAX_TREE_DEPTH;

impl Verifier {
    /// Scores the tree's nodes after `log` in one forward pass, each at the position of its
    /// depth and seeing its own path ([`crate::Model::forward_tree`]), and applies the tree's
    /// acceptance rule ([`verify_tree`]); `q[j]` is the distribution node j was drawn from
    /// given its earlier siblings. A tree whose nodes or q fail the checks a chain's drafts
    /// pass ([`check_block`], at most `max_drafts` nodes) is not scored: the round is one plain
    /// target step and the refusal says why. Afterwards the cache holds the log and the
    /// accepted path, as if they had been fed as a chain.
    pub fn verify_tree(
        &mut self,
        log: &[u32],
        tree: &DraftTree,
        q: &[Distribution],
        max_drafts: usize,
    ) -> Result<TreeVerified> {
        let mut jobs = [VerifyJob {
            verifier: self,
            log,
            drafts: tree.tokens(),
            q,
            max_drafts,
            refused: None,
            tree: Some(tree),
        }];
        match one(Self::verify_batch(&mut jobs))? {
            BlockVerified::Tree(verified) => Ok(verified),
            BlockVerified::Chain(_) => Err(failed("a tree was verified as a chain")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: TreeLimits = TreeLimits {
        max_nodes: 8,
        max_depth: 4,
    };

    #[test]
    fn a_chain_is_the_tree_of_one_path() {
        let chain = DraftTree::chain(&[5, 6, 7]);
        assert!(chain.is_chain());
        let given = DraftTree::new(&[5, 6, 7], &[0, 1, 2], LIMITS).expect("a chain");
        assert_eq!(given, chain);
        assert_eq!((chain.depth(2), chain.max_depth()), (3, 3));
        assert_eq!(chain.path_tokens(2), [5, 6, 7]);
        assert_eq!(chain.leaves().collect::<Vec<_>>(), [2]);
        assert!(DraftTree::chain(&[]).is_empty());
    }

    #[test]
    fn a_tree_gives_each_node_its_depth_path_and_children() {
        //   prefix ─ 10 ─ 11 ─ 13
        //         │     └ 12
        //         └ 20 ─ 21
        let tree =
            DraftTree::new(&[10, 20, 11, 12, 21, 13], &[0, 0, 1, 1, 2, 3], LIMITS).expect("a tree");
        assert!(!tree.is_chain());
        assert_eq!(
            (0..6).map(|i| tree.depth(i)).collect::<Vec<_>>(),
            [1, 1, 2, 2, 2, 3]
        );
        assert_eq!(tree.path(5), [0, 2, 5]);
        assert_eq!(tree.path_tokens(5), [10, 11, 13]);
        assert_eq!(tree.path_tokens(4), [20, 21]);
        assert_eq!(tree.children(None).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(tree.children(Some(0)).collect::<Vec<_>>(), [2, 3]);
        assert_eq!(tree.leaves().collect::<Vec<_>>(), [3, 4, 5]);
        assert_eq!(tree.parent(4), Some(1));
        assert_eq!(tree.max_depth(), 3);
    }

    #[test]
    fn malformed_trees_are_refused_naming_what_is_wrong() {
        let refused = |tokens: &[u32], parents: &[u32]| {
            DraftTree::new(tokens, parents, LIMITS)
                .expect_err("refused")
                .to_string()
        };
        let e = refused(&[1, 2], &[0]);
        assert!(e.contains("2 tokens, 1 parents"), "{e}");
        // A parent after its child, or itself: what a cycle needs.
        let e = refused(&[1, 2], &[2, 0]);
        assert!(
            e.contains("node 0's parent 2") && e.contains("come before"),
            "{e}"
        );
        let e = refused(&[1, 2], &[0, 2]);
        assert!(e.contains("node 1's parent 2"), "{e}");
        let e = refused(&[1; 9], &[0, 1, 2, 3, 4, 5, 6, 7, 8]);
        assert!(e.contains("9 nodes") && e.contains("at most 8"), "{e}");
        let e = refused(&[1, 2, 3, 4, 5], &[0, 1, 2, 3, 4]);
        assert!(
            e.contains("node 4 at depth 5") && e.contains("at most 4 deep"),
            "{e}"
        );
        let e = refused(&[1, 2, 2], &[0, 1, 1]);
        assert!(
            e.contains("nodes 1 and 2") && e.contains("same token 2"),
            "{e}"
        );
        // The same token under different parents is two continuations, not a twin.
        assert!(DraftTree::new(&[1, 2, 1], &[0, 0, 2], LIMITS).is_ok());
    }
}
