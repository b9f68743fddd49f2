//! The n-gram drafter (prompt lookup): the continuation of the latest earlier occurrence of the
//! session's last tokens, in the prompt and the text generated so far. It needs no model and
//! runs in the coordinator in microseconds; code editing, quoting and repetitive text accept
//! most of it. Its q is one-hot on each proposed token (the proposal is deterministic), which the
//! acceptance rule handles exactly. Asked for branches, it makes a token tree of the other
//! earlier occurrences' continuations where they part from the chosen one. Where the tenant's
//! earlier outputs ([`super::suffix`]) hold a longer match than the session's own text, it
//! proposes what followed there instead.

use std::time::Instant;

use tandem_runtime::{Constraint, TokenLog};

use super::block::{Ask, DraftBlock};
use super::suffix::{SuffixIndex, TenantHistory};
use super::{Propose, Proposing};
use crate::constraints::cut;

/// Longest and shortest suffix looked up; a longer match is tried first.
const MAX_MATCH: usize = 8;
const MIN_MATCH: usize = 2;
/// The log's last tokens looked up in the tenant's earlier outputs, and the shortest match
/// there that is continued (shorter ones, in another text, are mostly common words).
const HISTORY_WINDOW: usize = 64;
const MIN_HISTORY_MATCH: usize = 3;

/// A proposal, and the length of the match it continues: the longer the match, the likelier the
/// text is being copied (the policy keeps acceptance per class of length, [`class`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Lookup {
    pub tokens: Vec<u32>,
    pub matched: usize,
    /// A token tree's parents in wire form (0: a child of the log, j + 1: of node j): the
    /// chain of `k` tokens, then the branches; empty for a chain.
    pub parents: Vec<u32>,
}

/// Classes of match length, each with its own acceptance in the policy.
pub const CLASSES: usize = 3;

/// A match's class: 2 tokens (often a common pair of words), 3–4, 5 or more (copied text).
pub fn class(matched: usize) -> usize {
    match matched {
        0..=2 => 0,
        3..=4 => 1,
        _ => 2,
    }
}

/// Up to `k` tokens continuing the latest earlier occurrence of the longest suffix of `tokens`
/// (between [`MIN_MATCH`] and [`MAX_MATCH`] tokens long); empty when none recurs. A match `d`
/// tokens back says the text repeats with period `d`: the proposal follows that period past
/// the end of the log, so a loop of any length is proposed `k` tokens at a time.
pub fn propose(tokens: &[u32], k: usize) -> Lookup {
    propose_tree(tokens, k, 0)
}

/// [`propose`], and up to `branches` more tokens from the other earlier occurrences of a suffix
/// (the longest matches first, the latest among equals): each continuation follows the tree
/// while it agrees with a path and branches off where it parts from it, as deep as `k`.
pub fn propose_tree(tokens: &[u32], k: usize, branches: usize) -> Lookup {
    let len = tokens.len();
    // The length of the match ending at each earlier position (most fail at the first token),
    // the latest first; then the longest first, the latest among equals (a stable sort). A
    // chain alone needs no other occurrence: the latest match of the longest length wins at once.
    let mut found: Vec<(usize, usize)> = Vec::new();
    for e in (0..len.saturating_sub(1)).rev() {
        let n = (0..MAX_MATCH.min(e + 1))
            .take_while(|&m| tokens[e - m] == tokens[len - 1 - m])
            .count();
        if n >= MIN_MATCH {
            found.push((n, e));
            if branches == 0 && n == MAX_MATCH {
                break;
            }
        }
    }
    found.sort_by_key(|&(n, _)| std::cmp::Reverse(n));
    let Some(&(matched, end)) = found.first() else {
        return Lookup::default();
    };
    // The occurrence ends `period` tokens before the log does.
    let period = len - 1 - end;
    let mut proposal: Vec<u32> = Vec::with_capacity(k + branches);
    for i in 0..k {
        let next = if i < period {
            tokens[len - period + i]
        } else {
            proposal[i - period]
        };
        proposal.push(next);
    }
    let mut parents = Vec::new();
    if branches > 0 && k > 0 {
        parents.extend(0..k as u32);
        let mut left = branches;
        for &(_, e) in &found[1..] {
            let mut at = 0; // wire form: the node the continuation has reached
            for &t in &tokens[e + 1..len.min(e + 1 + k)] {
                let child = (0..proposal.len()).find(|&j| parents[j] == at && proposal[j] == t);
                match child {
                    Some(j) => at = j as u32 + 1,
                    None if left > 0 => {
                        proposal.push(t);
                        parents.push(at);
                        at = proposal.len() as u32;
                        left -= 1;
                    }
                    None => break,
                }
            }
            if left == 0 {
                break;
            }
        }
        if parents.len() == k {
            parents.clear();
        }
    }
    Lookup {
        tokens: proposal,
        matched,
        parents,
    }
}

/// [`propose_tree`] over `tokens`, or a chain continuing the longest match in `history` where it
/// is longer (and at least [`MIN_HISTORY_MATCH`]): whether it came from there too.
pub fn look_up_in(
    history: Option<&SuffixIndex>,
    tokens: &[u32],
    k: usize,
    branches: usize,
) -> (Lookup, bool) {
    let own = propose_tree(tokens, k, branches);
    let Some(index) = history.filter(|_| k > 0) else {
        return (own, false);
    };
    let found = index.longest_match(tokens, HISTORY_WINDOW);
    if found.len < MIN_HISTORY_MATCH || found.len <= own.matched {
        return (own, false);
    }
    let tokens = index.continuation(found, k);
    if tokens.is_empty() {
        return (own, false);
    }
    let lookup = Lookup {
        tokens,
        matched: found.len,
        parents: Vec::new(),
    };
    (lookup, true)
}

/// What n-gram lookup can propose this round: how many tokens, continuing a match of how many.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NgramOffer {
    pub len: usize,
    pub matched: usize,
}

/// The n-gram drafter of one generation: each round's lookup, made where the plan weighs it
/// ([`Self::look_up`]), and proposed where the plan chose it.
#[derive(Debug, Default)]
pub struct NgramDrafter {
    /// The last lookup, the length of the log it continues, and whether it continued an
    /// earlier output.
    looked_up: Option<(usize, DraftBlock, bool)>,
    /// Whether the block proposed last continued an earlier output.
    from_history: bool,
    /// The tenant's earlier outputs, where they are kept.
    history: Option<TenantHistory>,
}

impl NgramDrafter {
    /// A drafter that also continues the tenant's earlier outputs in `history`.
    pub fn with_history(history: Option<TenantHistory>) -> Self {
        Self {
            looked_up: None,
            from_history: false,
            history,
        }
    }

    /// Whether the block proposed last continued an earlier output (not the session's text).
    pub fn proposed_from_history(&self) -> bool {
        self.from_history
    }

    /// Keeps a finished generation's `output` for the tenant's next generations.
    pub fn remember(&self, output: &[u32]) {
        if let Some(index) = &self.history
            && let Ok(mut index) = index.lock()
        {
            index.add(output);
        }
    }

    /// Looks up `k` drafts past `log` (and, with `branches`, a token tree of other earlier
    /// continuations; none under a grammar: it checks the chain), cut before the first one the
    /// generation's grammar forbids, and keeps them for this round's [`Propose::propose`].
    /// Their q is one-hot: exact under the acceptance rule, whatever the sampling. Returns
    /// what the lookup offers the policy.
    pub fn look_up(
        &mut self,
        log: &TokenLog,
        (k, branches): (usize, usize),
        grammar: Option<&mut Constraint>,
    ) -> NgramOffer {
        let start = Instant::now();
        let branches = if grammar.is_some() { 0 } else { branches };
        let history = self.history.as_ref().and_then(|h| h.lock().ok());
        let (lookup, from_history) = look_up_in(history.as_deref(), log.tokens(), k, branches);
        drop(history);
        let Lookup {
            mut tokens,
            matched,
            parents,
        } = lookup;
        // A grammar state that cannot follow the log proposes nothing (the target decides).
        let valid = cut(grammar, log.tokens(), &tokens).unwrap_or(0);
        tokens.truncate(valid);
        let secs = start.elapsed().as_secs_f64();
        let block = DraftBlock::one_hot(tokens, parents, secs);
        let offer = NgramOffer {
            len: block.tokens.len(),
            matched,
        };
        self.looked_up = Some((log.len(), block, from_history));
        offer
    }
}

impl Propose for NgramDrafter {
    /// The round's lookup, cut to `ask.k` (a tree, looked up at the round's shape already,
    /// whole); nothing where none was looked up past this `log`.
    fn propose<'a>(&'a mut self, log: &'a TokenLog, ask: Ask, _: Option<f64>) -> Proposing<'a> {
        let (block, from_history) = match self.looked_up.take() {
            Some((at, block, h)) if at == log.len() && block.parents.is_empty() => {
                (block.truncated(ask.k), h)
            }
            Some((at, block, h)) if at == log.len() => (block, h),
            _ => (DraftBlock::default(), false),
        };
        self.from_history = from_history;
        Box::pin(std::future::ready(Ok(block)))
    }
}

#[cfg(test)]
mod tests {
    use super::{SuffixIndex, class, look_up_in, propose, propose_tree};

    fn propose_tokens(tokens: &[u32], k: usize) -> Vec<u32> {
        propose(tokens, k).tokens
    }

    #[test]
    fn the_longest_latest_match_is_continued() {
        // "a b c d" then later "x b c" : the suffix "b c" matched at its latest occurrence.
        let tokens = [1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3];
        assert_eq!(propose_tokens(&tokens, 2), vec![5, 7]);
        // A longer suffix wins over a later shorter one: "1 2 3" occurs once, earlier.
        let tokens = [1, 2, 3, 4, 5, 8, 2, 3, 6, 1, 2, 3];
        assert_eq!(propose_tokens(&tokens, 3), vec![4, 5, 8]);
    }

    #[test]
    fn a_loop_is_continued_past_the_end_of_the_log_for_k_tokens() {
        let tokens = [7, 8, 9, 7, 8];
        assert_eq!(propose_tokens(&tokens, 8), vec![9, 7, 8, 9, 7, 8, 9, 7]);
        assert_eq!(propose_tokens(&tokens, 1), vec![9]);
        // A token repeated: period 1.
        assert_eq!(propose_tokens(&[4, 5, 5, 5], 3), vec![5, 5, 5]);
        // A match far back continues what followed it, then repeats with its period.
        let tokens = [1, 2, 3, 4, 1, 2];
        assert_eq!(propose_tokens(&tokens, 4), vec![3, 4, 1, 2]);
    }

    #[test]
    fn no_recurrence_no_proposal() {
        assert!(propose_tokens(&[1, 2, 3, 4, 5], 4).is_empty());
        assert!(propose_tokens(&[1], 4).is_empty());
        assert!(propose_tokens(&[], 4).is_empty());
        // A single recurring token is below the shortest match.
        assert!(propose_tokens(&[5, 6, 5], 4).is_empty());
    }

    #[test]
    fn the_match_length_is_reported_and_classed() {
        // "def f ( x )" quoted, then "def f (" generated: a 3-token match continued.
        let tokens = [10, 11, 12, 13, 14, 99, 10, 11, 12];
        let lookup = propose(&tokens, 2);
        assert_eq!((lookup.tokens, lookup.matched), (vec![13, 14], 3));
        assert_eq!(class(lookup.matched), 1);
        // Copied text: the longest suffix looked up wins.
        let quoted: Vec<u32> = (1..=12).collect();
        let mut tokens = quoted.clone();
        tokens.push(50);
        tokens.extend(1..=9);
        let lookup = propose(&tokens, 3);
        assert_eq!((lookup.tokens, lookup.matched), (vec![10, 11, 12], 8));
        assert_eq!(class(lookup.matched), 2);
        assert_eq!(class(2), 0);
        assert_eq!(propose(&[1, 2, 3], 2).matched, 0);
    }

    #[test]
    fn other_continuations_branch_off_where_they_part() {
        // "2 3" was followed by 4 5 6, later by 4 7 8, last by 9 9 9; the log ends in "2 3".
        let tokens = [2, 3, 4, 5, 6, 1, 2, 3, 4, 7, 8, 1, 2, 3, 9, 9, 9, 1, 2, 3];
        // The chain is the latest continuation (after "1 2 3", the longest match, latest).
        assert_eq!(propose(&tokens, 3).tokens, [9, 9, 9]);
        let tree = propose_tree(&tokens, 3, 8);
        // Then 4 7 8 branches off at the root, and 4 5 6 follows it to 4 and parts there.
        assert_eq!(tree.tokens, [9, 9, 9, 4, 7, 8, 5, 6]);
        assert_eq!(tree.parents, [0, 1, 2, 0, 4, 5, 4, 7]);
        // Budgeted: two more tokens at most.
        let tree = propose_tree(&tokens, 3, 2);
        assert_eq!((tree.tokens.len(), tree.parents), (5, vec![0, 1, 2, 0, 4]));
        // No other continuation, or one that agrees with the chain: a chain (no parents).
        let tree = propose_tree(&[5, 6, 7, 8, 5, 6], 2, 4);
        assert_eq!((tree.tokens, tree.parents), (vec![7, 8], vec![]));
        let tree = propose_tree(&[5, 6, 7, 5, 6, 7, 5, 6], 2, 4);
        assert_eq!((tree.tokens, tree.parents), (vec![7, 5], vec![]));
    }

    #[test]
    fn an_earlier_output_is_continued_where_it_matches_longer() {
        let mut earlier = SuffixIndex::new(100);
        earlier.add(&[1, 2, 3, 4, 5, 6]);
        // The session's own text has "2 3" (then 9); the earlier output has "1 2 3".
        let (lookup, from_history) = look_up_in(Some(&earlier), &[2, 3, 9, 1, 2, 3], 3, 0);
        assert!(from_history);
        assert_eq!((lookup.tokens, lookup.matched), (vec![4, 5, 6], 3));
        // The session's own "7 1 2 3" is the longer match: its continuation is proposed.
        let (lookup, from_history) = look_up_in(Some(&earlier), &[7, 1, 2, 3, 8, 7, 1, 2, 3], 2, 0);
        assert!(!from_history);
        assert_eq!(lookup.tokens, vec![8, 7]);
        // Two tokens of another text are not enough.
        let (lookup, from_history) = look_up_in(Some(&earlier), &[9, 5, 6], 2, 0);
        assert!(!from_history && lookup.tokens.is_empty());
        let (lookup, _) = look_up_in(None, &[2, 3, 9, 1, 2, 3], 3, 0);
        assert_eq!(lookup.tokens, vec![9, 1, 2]);
    }
}
