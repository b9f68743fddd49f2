//! The draft's token tree (issue 31): its chain of K drafts, each drawn from the q it states as
//! a chain's are, and B more nodes grown best-first off it, as EAGLE-2 grows its trees. Every
//! node the draft feeds offers children (a chain node its next draft, then the likeliest other
//! tokens; any other node its likeliest tokens), each scored by the draft's own chance that the
//! path to it is right (the product of its probabilities along it); each forward pass feeds the
//! chain's next draft and the best-scored other nodes not yet fed, together as tree rows over
//! the rows earlier passes fed ([`crate::model::Model::forward_tree`]), and the block is the
//! chain and the B best-scored others. A node's score is at most its parent's, so those are a
//! tree. Where the draft model takes no trees (sliding-window layers) or follows a grammar, only
//! the chain is fed: the others are its nodes' other candidates, as sibling leaves.
//!
//! Exact whatever the target's sampling: the chain is drawn as a chain is and always sent whole
//! (what is sent besides never depends on which draft was drawn in a way the verifier must
//! know), and every other node is a chosen child (one-hot q), which the target's multi-draft
//! rule accepts exactly whatever chose it; a chain's draft comes first among its siblings.
//! Where the sampling is greedy every node is a chosen child (the chain's too: the draft's
//! argmax), so the chain need not be whole: the K + B best-scored nodes of all are sent, no
//! deeper than K + B, and a pass feeds only nodes whose children could still be among them — a
//! sure draft grows one long path, an unsure one a bushy tree in fewer passes (EAGLE-2's
//! dynamic trees).

use super::Proposal;
use crate::sampling::Distribution;

/// Candidates a fed node offers.
const CHILDREN: usize = 3;

/// The least chance of being right a node off the chain must have to be fed: its children
/// could add no more than that many tokens a round, less than a row of a pass costs.
const WORTH_FEEDING: f32 = 1.0 / 64.0;

/// One node of a growing tree.
#[derive(Debug)]
struct Node {
    token: u32,
    parent: Option<usize>,
    /// The draft's own chance that the path to this node is right.
    score: f32,
    q: Distribution,
    depth: usize,
    /// Its tree row, once fed.
    row: Option<usize>,
    /// Whether it is one of the chain's drafts.
    chain: bool,
}

/// A token tree the draft grows over several forward passes.
#[derive(Debug)]
pub(super) struct Growth {
    nodes: Vec<Node>,
    /// The parents (as tree rows) of the tree rows fed so far, in row order.
    fed_parents: Vec<Option<usize>>,
    /// The nodes the latest pass fed, in row order.
    feeding: Vec<usize>,
    /// The chain's drafts (and the deepest any node goes), and the other nodes sent.
    k: usize,
    others: usize,
    /// Other nodes fed per pass.
    width: usize,
    /// Whether other nodes are fed (the model takes trees), not only the chain's.
    deep: bool,
    /// Whether the chain competes with the others (greedy sampling: every node a chosen child).
    free: bool,
}

impl Growth {
    /// A chain of `k` drafts and `others` more nodes, no deeper than `k`, grown in `k` forward
    /// passes (as the chain alone), the first the log's own (its candidates the root's
    /// children); where `free`, the `k + others` best nodes, no deeper than that.
    pub(super) fn new(k: usize, others: usize, deep: bool, free: bool) -> Self {
        let passes = k.saturating_sub(1).max(1);
        let width = match (deep, free) {
            (false, _) => 0,
            (true, false) => others.div_ceil(passes).min(3),
            (true, true) => (k + others).div_ceil(k).clamp(2, 3),
        };
        Self {
            nodes: Vec::with_capacity((k + others) * CHILDREN),
            fed_parents: Vec::new(),
            feeding: Vec::new(),
            k,
            others,
            width,
            deep,
            free,
        }
    }

    /// Offers the children of `at` (none: the root), from the draft's `row` of logits there:
    /// the chain's next draft `drawn` from its q where `at` is the chain's (or the root), then
    /// the likeliest other tokens.
    pub(super) fn offer(
        &mut self,
        at: Option<usize>,
        row: &[f32],
        drawn: Option<(u32, Distribution)>,
    ) {
        let (score, depth) = at.map_or((1.0, 0), |n| (self.nodes[n].score, self.nodes[n].depth));
        let probs = Softmax::of(row);
        let except = drawn.as_ref().map(|(t, _)| *t);
        let others = CHILDREN - usize::from(drawn.is_some());
        if let Some((token, q)) = drawn {
            self.nodes.push(Node {
                token,
                parent: at,
                score: score * probs.prob(row, token),
                q,
                depth: depth + 1,
                row: None,
                chain: true,
            });
        }
        for (token, logit) in top(row, except, others) {
            self.nodes.push(Node {
                token,
                parent: at,
                score: score * probs.of_logit(logit),
                q: Distribution::OneHot(token),
                depth: depth + 1,
                row: None,
                chain: false,
            });
        }
    }

    /// Whether node `n` is on the chain (its next draft is drawn when it is fed).
    pub(super) fn on_chain(&self, n: usize) -> bool {
        self.nodes[n].chain
    }

    /// The tokens the next pass feeds (none: the tree is grown): the chain's last draft while
    /// the chain is short, and where the tree is deep, the best-scored others not yet fed whose
    /// children could still be sent (shallower than `k`, among the best `others`). Where the
    /// chain is free, the best-scored nodes not yet fed whose children could still be sent
    /// (among the best `k + others`, shallower than that), only the chain's where the tree is
    /// not deep. A node off the chain is fed only if it is likely enough ([`WORTH_FEEDING`]).
    pub(super) fn next_pass(&mut self) -> Option<Vec<u32>> {
        self.feeding.clear();
        let chain = self.chain();
        let tip = chain.last().copied();
        if self.free {
            let deepest = self.k + self.others;
            let grows: Vec<usize> = (self.best().into_iter())
                .filter(|&n| self.nodes[n].row.is_none() && self.nodes[n].depth < deepest)
                .filter(|&n| Some(n) == tip || self.deep && self.worth_feeding(n))
                .take(self.width.max(1))
                .collect();
            self.feeding = grows;
        } else {
            if chain.len() < self.k {
                self.feeding
                    .extend(tip.filter(|&n| self.nodes[n].row.is_none()));
            }
            if self.deep && !self.feeding.is_empty() {
                let grows: Vec<usize> = (self.best().into_iter())
                    .filter(|&n| self.nodes[n].row.is_none() && self.nodes[n].depth < self.k)
                    .filter(|&n| self.worth_feeding(n))
                    .take(self.width)
                    .collect();
                self.feeding.extend(grows);
            }
        }
        if self.feeding.is_empty() {
            return None;
        }
        self.feeding.sort_unstable();
        let tokens = self.feeding.iter().map(|&n| self.nodes[n].token).collect();
        for &n in &self.feeding {
            let parent = self.nodes[n].parent.and_then(|p| self.nodes[p].row);
            self.nodes[n].row = Some(self.fed_parents.len());
            self.fed_parents.push(parent);
        }
        Some(tokens)
    }

    /// The parents of the tree rows fed so far, the latest pass's last, where the tree is deep
    /// (where it is not, the chain's next row follows the cache as a plain block's).
    pub(super) fn row_parents(&self) -> Option<&[Option<usize>]> {
        self.deep.then_some(&self.fed_parents[..])
    }

    /// The nodes the latest pass fed, in row order, and each one's context past the log (the
    /// tokens of its path).
    pub(super) fn fed_paths(&self) -> Vec<(usize, Vec<u32>)> {
        self.feeding
            .iter()
            .map(|&n| {
                (
                    n,
                    self.path(n).iter().map(|&m| self.nodes[m].token).collect(),
                )
            })
            .collect()
    }

    /// The tree rows of the chain's drafts that were fed, in order, and their tokens: what the
    /// draft's cache keeps of the tree.
    pub(super) fn fed_chain(&self) -> Vec<(usize, u32)> {
        self.chain()
            .into_iter()
            .map_while(|n| self.nodes[n].row.map(|r| (r, self.nodes[n].token)))
            .collect()
    }

    /// The block sent: the chain (wire form: each draft the child of the one before), then the
    /// best-scored others as they were offered (a parent before its children); where the chain
    /// is free, as much of it as is among the best. A block that is one path (a sure draft's
    /// free tree) is sent as a chain: the coordinator drafts ahead past a chain.
    pub(super) fn proposal(self) -> Proposal {
        let mut best = self.best();
        let mut order = self.chain();
        order.retain(|n| !self.free || best.contains(n));
        let mut chain = order.len();
        best.retain(|n| !order.contains(n));
        best.sort_unstable();
        order.extend(best);
        let path = order
            .iter()
            .enumerate()
            .all(|(i, &n)| self.nodes[n].parent == i.checked_sub(1).map(|before| order[before]));
        if path {
            chain = order.len();
        }
        let mut wire = vec![0u32; self.nodes.len()];
        for (i, &n) in order.iter().enumerate() {
            wire[n] = i as u32 + 1;
        }
        let mut proposal = Proposal::default();
        let mut nodes: Vec<Option<Node>> = self.nodes.into_iter().map(Some).collect();
        for &n in &order {
            let node = nodes[n].take().expect("each node once");
            if order.len() > chain {
                proposal.parents.push(node.parent.map_or(0, |p| wire[p]));
            }
            proposal.tokens.push(node.token);
            proposal.q.push(node.q);
        }
        proposal
    }

    /// The best-scored nodes off the chain, at most `others` of them, or where the chain is
    /// free of all, at most `k + others`; best first, each one's parent on the chain (not free)
    /// or among them (ties: the earlier offered, so a parent before its children).
    fn best(&self) -> Vec<usize> {
        let count = if self.free {
            self.k + self.others
        } else {
            self.others
        };
        let mut ranked: Vec<usize> = (0..self.nodes.len())
            .filter(|&n| self.free || !self.nodes[n].chain)
            .collect();
        ranked.sort_by(|&a, &b| self.nodes[b].score.total_cmp(&self.nodes[a].score));
        let mut taken = vec![false; self.nodes.len()];
        let mut best = Vec::with_capacity(count);
        for n in ranked {
            if best.len() == count {
                break;
            }
            let parent = self.nodes[n].parent;
            if parent.is_none_or(|p| taken[p] || !self.free && self.nodes[p].chain) {
                taken[n] = true;
                best.push(n);
            }
        }
        best
    }

    fn worth_feeding(&self, n: usize) -> bool {
        self.nodes[n].score >= WORTH_FEEDING
    }

    /// The chain's drafts so far, in order.
    fn chain(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&n| self.nodes[n].chain)
            .collect()
    }

    /// Node `n`'s path from the root, `n` last.
    fn path(&self, n: usize) -> Vec<usize> {
        let mut path = vec![n];
        while let Some(p) = self.nodes[*path.last().expect("not empty")].parent {
            path.push(p);
        }
        path.reverse();
        path
    }
}

/// A row's softmax, by its largest logit and the sum of the exponentials past it.
pub(super) struct Softmax {
    max: f32,
    total: f32,
}

impl Softmax {
    pub(super) fn of(row: &[f32]) -> Self {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let total = crate::kernels::exp_sum(row, max);
        Self { max, total }
    }

    fn of_logit(&self, logit: f32) -> f32 {
        (logit - self.max).exp() / self.total
    }

    /// The largest probability: the draft's confidence at this row, whatever it draws.
    pub(super) fn top(&self) -> f32 {
        1.0 / self.total
    }

    pub(super) fn prob(&self, row: &[f32], token: u32) -> f32 {
        row.get(token as usize).map_or(0.0, |&l| self.of_logit(l))
    }
}

/// The `count` tokens of `row` with the largest logits (but `except`), best first.
fn top(row: &[f32], except: Option<u32>, count: usize) -> Vec<(u32, f32)> {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(count + 1);
    for (i, &l) in row.iter().enumerate() {
        if Some(i as u32) == except
            || top.len() == count && top.last().is_some_and(|&(_, w)| l <= w)
        {
            continue;
        }
        let at = top.partition_point(|&(_, w)| w >= l);
        top.insert(at, (i as u32, l));
        top.truncate(count);
    }
    top
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Logits over a vocabulary of 8 giving `probs` to tokens 0.. (the rest nearly nothing).
    fn row(probs: &[f32]) -> Vec<f32> {
        let mut row = vec![-30.0; 8];
        for (i, &p) in probs.iter().enumerate() {
            row[i] = p.ln();
        }
        row
    }

    fn drawn(token: u32) -> Option<(u32, Distribution)> {
        Some((token, Distribution::OneHot(token)))
    }

    #[test]
    fn the_best_tokens_are_found_in_order() {
        let r = [0.1, 0.5, -2.0, 0.4, 0.5, 3.0];
        let best: Vec<u32> = top(&r, Some(5), 3).into_iter().map(|(t, _)| t).collect();
        assert_eq!(best, vec![1, 4, 3]);
        let best: Vec<u32> = top(&r, None, 2).into_iter().map(|(t, _)| t).collect();
        assert_eq!(best, vec![5, 1]);
    }

    #[test]
    fn a_chain_grows_whole_and_its_nodes_other_candidates_are_siblings() {
        // Not deep: only the chain is fed; its drafts are sent whole, then the best others.
        let mut g = Growth::new(3, 2, false, false);
        g.offer(None, &row(&[0.9, 0.1]), drawn(0));
        let tokens = g.next_pass().expect("the chain's first draft is fed");
        assert_eq!((tokens, g.row_parents()), (vec![0], None));
        assert_eq!(g.fed_paths(), vec![(0, vec![0])]);
        g.offer(Some(0), &row(&[0.0, 0.2, 0.7, 0.1]), drawn(1));
        let tokens = g.next_pass().expect("the chain's second draft is fed");
        assert_eq!(tokens, vec![1]);
        g.offer(Some(3), &row(&[0.0, 0.0, 0.0, 0.99, 0.01]), drawn(3));
        assert!(g.next_pass().is_none(), "the chain is whole");
        assert_eq!(g.fed_chain(), vec![(0, 0), (1, 1)]);
        let p = g.proposal();
        // The chain 0, 1 (drawn though unlikely), 3; then token 2 beside 1 (0.63) and the
        // root's 1 (0.1).
        assert_eq!(p.tokens, vec![0, 1, 3, 1, 2]);
        assert_eq!(p.parents, vec![0, 1, 2, 0, 1]);
    }

    #[test]
    fn a_deep_tree_feeds_its_best_others_beside_the_chain() {
        let mut g = Growth::new(2, 2, true, false);
        assert_eq!(g.width, 2);
        g.offer(None, &row(&[0.6, 0.3, 0.1]), drawn(0));
        let tokens = g.next_pass().expect("the chain and the best others");
        assert_eq!(tokens, vec![0, 1, 2]);
        assert_eq!(g.row_parents(), Some(&[None, None, None][..]));
        g.offer(Some(0), &row(&[0.0, 0.0, 0.5, 0.5]), drawn(2));
        g.offer(Some(1), &row(&[0.0, 0.0, 0.0, 0.0, 0.9, 0.1]), None);
        g.offer(Some(2), &row(&[0.5, 0.5]), None);
        assert!(g.next_pass().is_none(), "the chain is whole");
        let p = g.proposal();
        // The chain 0, 2; the others: the root's 1 (0.3) and 3 beside the chain's 2 (0.3);
        // 4 under 1 (0.27) misses.
        assert_eq!(p.tokens, vec![0, 2, 1, 3]);
        assert_eq!(p.parents, vec![0, 1, 0, 1]);
    }

    #[test]
    fn a_sure_drafts_free_tree_is_one_path_sent_as_a_chain() {
        // Greedy, 2 + 2 nodes: the draft gives each next token 0.97, so its best four nodes
        // are one path of four, sent without parents (a chain, which the coordinator drafts
        // ahead past).
        let mut g = Growth::new(2, 2, true, true);
        let sure = |token: usize| {
            let mut probs = [0.005; 8];
            probs[token] = 0.97;
            row(&probs)
        };
        g.offer(None, &sure(1), drawn(1));
        let mut depth = 1;
        while g.next_pass().is_some() {
            depth += 1;
            for (n, _) in g.fed_paths() {
                let d = g.on_chain(n).then(|| drawn(depth as u32)).flatten();
                g.offer(Some(n), &sure(depth), d);
            }
        }
        let p = g.proposal();
        assert_eq!(p.tokens, vec![1, 2, 3, 4]);
        assert!(p.parents.is_empty(), "a path: {:?}", p.parents);
    }

    #[test]
    fn a_free_tree_sends_its_best_nodes_and_grows_only_where_they_can_be_beaten() {
        // Greedy: 2 + 2 nodes of all, the chain among them only as far as it is likely.
        let mut g = Growth::new(2, 2, true, true);
        assert_eq!(g.width, 2);
        g.offer(None, &row(&[0.5, 0.45, 0.05]), drawn(0));
        // All three root children are among the best four: the two likeliest grow.
        assert_eq!(g.next_pass().expect("a pass"), vec![0, 1]);
        g.offer(Some(0), &row(&[0.0, 0.0, 0.1, 0.1, 0.8]), drawn(4));
        g.offer(Some(1), &row(&[0.0, 0.0, 0.0, 0.0, 0.0, 0.9, 0.1]), None);
        // Best four: 0 (.5), 1 (.45), 5 under 1 (.405), 4 under 0 (.4): 4 and 5 grow.
        assert_eq!(g.next_pass().expect("a pass"), vec![4, 5]);
        // Where the draft knows nothing (all alike), no child beats the best four.
        g.offer(Some(3), &row(&[]), drawn(7));
        g.offer(Some(6), &row(&[]), None);
        assert!(g.next_pass().is_none(), "nothing left that could be sent");
        let p = g.proposal();
        // The chain 0, 4 first (its third draft is not among the best), then 1 and 5 under it.
        assert_eq!(p.tokens, vec![0, 4, 1, 5]);
        assert_eq!(p.parents, vec![0, 1, 0, 3]);
    }
}
