//! A suffix automaton over a tenant's earlier outputs ([`SuffixIndex`]): the longest suffix of a
//! session's log that any of them contains, and what followed it there, in time linear in the
//! suffix looked at. The n-gram drafter proposes that continuation where it matches longer than
//! the session's own text does ([`super::ngram`]): agents repeat their tool calls, edits repeat
//! the code they were shown last time, and a chat repeats its earlier answers (SuffixDecoding,
//! arXiv 2411.04975, drafts from such a structure). Written here rather than taken from a crate:
//! the suffix-array crates index bytes or `char`s rebuilt whole, where this one indexes token ids
//! and grows by one text at a time.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// One tenant's index, shared by its generations (kept per tenant by the engine).
pub type TenantHistory = Arc<Mutex<SuffixIndex>>;

/// Separators between texts: token ids no vocabulary reaches, one per text (a match never spans
/// two texts, and a continuation stops at the end of its text).
const SEPARATORS: u32 = 0xF000_0000;
/// No state (the root's suffix link).
const NONE: u32 = u32::MAX;

/// One state of the automaton: the strings that end at the same set of positions.
#[derive(Debug, Clone)]
struct State {
    /// The longest string of the state.
    len: u32,
    link: u32,
    /// Where the first occurrence of the state's strings ends in the corpus.
    end: u32,
    /// Transitions, sorted by token.
    next: Vec<(u32, u32)>,
}

impl State {
    fn get(&self, token: u32) -> Option<u32> {
        self.next
            .binary_search_by_key(&token, |&(t, _)| t)
            .ok()
            .map(|i| self.next[i].1)
    }

    fn set(&mut self, token: u32, to: u32) {
        match self.next.binary_search_by_key(&token, |&(t, _)| t) {
            Ok(i) => self.next[i].1 = to,
            Err(i) => self.next.insert(i, (token, to)),
        }
    }
}

/// The longest match of a log's suffix in the index: how many tokens, and the state it ends in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Match {
    pub len: usize,
    state: u32,
}

/// Earlier texts, at most `budget` tokens of them (the oldest dropped first), indexed by a
/// suffix automaton.
#[derive(Debug, Clone)]
pub struct SuffixIndex {
    states: Vec<State>,
    last: u32,
    /// The texts in order, each followed by its separator.
    corpus: Vec<u32>,
    /// The length of each text kept (its separator not counted), oldest first.
    texts: VecDeque<usize>,
    budget: usize,
    separators: u32,
}

impl SuffixIndex {
    /// An empty index that keeps at most `budget` tokens of texts.
    pub fn new(budget: usize) -> Self {
        Self {
            states: vec![State {
                len: 0,
                link: NONE,
                end: 0,
                next: Vec::new(),
            }],
            last: 0,
            corpus: Vec::new(),
            texts: VecDeque::new(),
            budget,
            separators: 0,
        }
    }

    /// Tokens of text kept (separators not counted).
    pub fn tokens(&self) -> usize {
        self.texts.iter().sum()
    }

    /// Adds `text` (its last `budget` tokens where it is longer). Where the texts kept would
    /// then pass the budget, the oldest are dropped until half of it is left, and the rest
    /// indexed again: the cost of a rebuild is spread over half a budget of texts added.
    pub fn add(&mut self, text: &[u32]) {
        let text = &text[text.len().saturating_sub(self.budget)..];
        if text.is_empty() {
            return;
        }
        if self.tokens() + text.len() > self.budget {
            let mut kept = self.tokens();
            let mut dropped = 0;
            while kept + text.len() > self.budget.div_ceil(2).max(text.len()) {
                let Some(n) = self.texts.pop_front() else {
                    break;
                };
                kept -= n;
                dropped += n + 1;
            }
            let rest: Vec<usize> = self.texts.drain(..).collect();
            let corpus = self.corpus.split_off(dropped);
            *self = Self::new(self.budget);
            let mut at = 0;
            for n in rest {
                self.append(&corpus[at..at + n]);
                at += n + 1;
            }
        }
        self.append(text);
    }

    fn append(&mut self, text: &[u32]) {
        for &t in text {
            self.extend(t);
        }
        // The separator is a token of its own: a match never crosses it.
        self.extend(SEPARATORS + self.separators);
        self.separators = (self.separators + 1) % (u32::MAX - SEPARATORS);
        self.texts.push_back(text.len());
    }

    /// The automaton's online construction, one token at a time.
    fn extend(&mut self, token: u32) {
        let end = self.corpus.len() as u32;
        self.corpus.push(token);
        let cur = self.states.len() as u32;
        self.states.push(State {
            len: self.states[self.last as usize].len + 1,
            link: 0,
            end,
            next: Vec::new(),
        });
        let mut p = self.last;
        while p != NONE && self.states[p as usize].get(token).is_none() {
            self.states[p as usize].set(token, cur);
            p = self.states[p as usize].link;
        }
        if p != NONE {
            let q = self.states[p as usize].get(token).expect("a transition");
            if self.states[p as usize].len + 1 == self.states[q as usize].len {
                self.states[cur as usize].link = q;
            } else {
                let clone = self.states.len() as u32;
                let mut state = self.states[q as usize].clone();
                state.len = self.states[p as usize].len + 1;
                self.states.push(state);
                while p != NONE && self.states[p as usize].get(token) == Some(q) {
                    self.states[p as usize].set(token, clone);
                    p = self.states[p as usize].link;
                }
                self.states[q as usize].link = clone;
                self.states[cur as usize].link = clone;
            }
        }
        self.last = cur;
    }

    /// The longest suffix of `log` that some text kept contains (looked for within its last
    /// `window` tokens).
    pub fn longest_match(&self, log: &[u32], window: usize) -> Match {
        let (mut state, mut len) = (0u32, 0usize);
        for &t in &log[log.len().saturating_sub(window)..] {
            loop {
                if let Some(next) = self.states[state as usize].get(t) {
                    state = next;
                    len += 1;
                    break;
                }
                if state == 0 {
                    break;
                }
                state = self.states[state as usize].link;
                len = self.states[state as usize].len as usize;
            }
        }
        Match { len, state }
    }

    /// Up to `k` tokens that followed `found` where it first occurred (fewer where its text
    /// ended sooner); none for an empty match.
    pub fn continuation(&self, found: Match, k: usize) -> Vec<u32> {
        if found.len == 0 {
            return Vec::new();
        }
        let start = self.states[found.state as usize].end as usize + 1;
        self.corpus[start..]
            .iter()
            .take(k)
            .take_while(|&&t| t < SEPARATORS)
            .copied()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::SuffixIndex;

    /// The longest suffix of `log` found in one of `texts`, and what followed its first
    /// occurrence, by brute force.
    fn brute(texts: &[Vec<u32>], log: &[u32], k: usize) -> (usize, Vec<u32>) {
        for len in (1..=log.len()).rev() {
            let suffix = &log[log.len() - len..];
            for text in texts {
                if let Some(at) = text.windows(len).position(|w| w == suffix) {
                    let next = text[at + len..].iter().take(k).copied().collect();
                    return (len, next);
                }
            }
        }
        (0, Vec::new())
    }

    /// A small deterministic generator (xorshift), so that the cases are the same every run.
    fn tokens(seed: &mut u64, n: usize, vocabulary: u64) -> Vec<u32> {
        (0..n)
            .map(|_| {
                *seed ^= *seed << 13;
                *seed ^= *seed >> 7;
                *seed ^= *seed << 17;
                (*seed % vocabulary) as u32
            })
            .collect()
    }

    #[test]
    fn matches_and_continuations_equal_a_brute_force_search() {
        let mut seed = 0x9E37_79B9_7F4A_7C15;
        for case in 0..200 {
            let vocabulary = 2 + case % 5;
            let texts: Vec<Vec<u32>> = (0..1 + case % 4)
                .map(|_| tokens(&mut seed, 1 + (case as usize * 7) % 40, vocabulary))
                .collect();
            let mut index = SuffixIndex::new(10_000);
            for text in &texts {
                index.add(text);
            }
            let log = tokens(&mut seed, 12, vocabulary);
            let found = index.longest_match(&log, log.len());
            let (len, next) = brute(&texts, &log, 5);
            assert_eq!(found.len, len, "case {case}: {texts:?} / {log:?}");
            // The first occurrence in the corpus: the same text and place the brute force finds
            // first, since texts are searched oldest first.
            assert_eq!(index.continuation(found, 5), next, "case {case}");
        }
    }

    #[test]
    fn a_match_never_spans_two_texts_and_stops_at_its_texts_end() {
        let mut index = SuffixIndex::new(100);
        index.add(&[1, 2, 3]);
        index.add(&[4, 5, 6, 7]);
        // "3 4" is in neither text: the longest match is "4".
        let found = index.longest_match(&[3, 4], 8);
        assert_eq!(
            (found.len, index.continuation(found, 3)),
            (1, vec![5, 6, 7])
        );
        let found = index.longest_match(&[9, 1, 2], 8);
        assert_eq!((found.len, index.continuation(found, 5)), (2, vec![3]));
        assert_eq!(index.longest_match(&[8, 9], 8).len, 0);
        assert!(
            index
                .continuation(index.longest_match(&[], 8), 3)
                .is_empty()
        );
    }

    #[test]
    fn the_oldest_texts_go_first_and_the_budget_holds() {
        let mut index = SuffixIndex::new(10);
        index.add(&[1, 2, 3, 4]);
        index.add(&[5, 6, 7, 8]);
        assert_eq!(index.tokens(), 8);
        // A third text passes the budget: the oldest are dropped until half of it is left.
        index.add(&[9, 10, 11]);
        assert_eq!(index.tokens(), 3);
        assert_eq!(index.longest_match(&[1, 2], 8).len, 0);
        assert_eq!(index.longest_match(&[6, 7], 8).len, 0);
        let found = index.longest_match(&[9, 10], 8);
        assert_eq!(index.continuation(found, 4), vec![11]);
        // A text longer than the budget keeps its end.
        index.add(&(100..120).collect::<Vec<u32>>());
        assert_eq!(index.tokens(), 10);
        let found = index.longest_match(&[110, 111], 8);
        assert_eq!(index.continuation(found, 2), vec![112, 113]);
        assert_eq!(index.longest_match(&[109], 8).len, 0);
    }

    #[test]
    fn only_the_window_is_looked_at() {
        let mut index = SuffixIndex::new(100);
        index.add(&[1, 2, 3, 4, 5]);
        assert_eq!(index.longest_match(&[1, 2, 3, 4], 2).len, 2);
        assert_eq!(index.longest_match(&[1, 2, 3, 4], 8).len, 4);
    }
}
