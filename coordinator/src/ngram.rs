//! The n-gram drafter (prompt lookup): the continuation of the latest earlier occurrence of the
//! session's last tokens, in the prompt and the text generated so far. It needs no model and
//! runs in the coordinator in microseconds; code editing, quoting and repetitive text accept
//! most of it. Its q is one-hot on each proposed token (the proposal is deterministic), which the
//! acceptance rule handles exactly.

/// Longest and shortest suffix looked up; a longer match is tried first.
const MAX_MATCH: usize = 4;
const MIN_MATCH: usize = 2;

/// Up to `k` tokens continuing the latest earlier occurrence of the longest suffix of `tokens`
/// (between [`MIN_MATCH`] and [`MAX_MATCH`] tokens long); empty when none recurs. A match `d`
/// tokens back says the text repeats with period `d`: the proposal follows that period past
/// the end of the log, so a loop of any length is proposed `k` tokens at a time.
pub fn propose(tokens: &[u32], k: usize) -> Vec<u32> {
    let len = tokens.len();
    for n in (MIN_MATCH..=MAX_MATCH.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // Latest start first: the occurrence may overlap the suffix (a short loop).
        if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
            let period = len - n - start;
            let mut proposal: Vec<u32> = Vec::with_capacity(k);
            for i in 0..k {
                let next = if i < period {
                    tokens[len - period + i]
                } else {
                    proposal[i - period]
                };
                proposal.push(next);
            }
            return proposal;
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::propose;

    #[test]
    fn the_longest_latest_match_is_continued() {
        // "a b c d" then later "x b c" : the suffix "b c" matched at its latest occurrence.
        let tokens = [1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3];
        assert_eq!(propose(&tokens, 2), vec![5, 7]);
        // A longer suffix wins over a later shorter one: "1 2 3" occurs once, earlier.
        let tokens = [1, 2, 3, 4, 5, 8, 2, 3, 6, 1, 2, 3];
        assert_eq!(propose(&tokens, 3), vec![4, 5, 8]);
    }

    #[test]
    fn a_loop_is_continued_past_the_end_of_the_log_for_k_tokens() {
        let tokens = [7, 8, 9, 7, 8];
        assert_eq!(propose(&tokens, 8), vec![9, 7, 8, 9, 7, 8, 9, 7]);
        assert_eq!(propose(&tokens, 1), vec![9]);
        // A token repeated: period 1.
        assert_eq!(propose(&[4, 5, 5, 5], 3), vec![5, 5, 5]);
        // A match far back continues what followed it, then repeats with its period.
        let tokens = [1, 2, 3, 4, 1, 2];
        assert_eq!(propose(&tokens, 4), vec![3, 4, 1, 2]);
    }

    #[test]
    fn no_recurrence_no_proposal() {
        assert!(propose(&[1, 2, 3, 4, 5], 4).is_empty());
        assert!(propose(&[1], 4).is_empty());
        assert!(propose(&[], 4).is_empty());
        // A single recurring token is below the shortest match.
        assert!(propose(&[5, 6, 5], 4).is_empty());
    }
}
