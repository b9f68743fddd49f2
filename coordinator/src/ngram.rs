//! The n-gram drafter (prompt lookup): the continuation of the latest earlier occurrence of the
//! session's last tokens, in the prompt and the text generated so far. It needs no model and
//! runs in the coordinator in microseconds; code editing, quoting and repetitive text accept
//! most of it. Its q is one-hot on each proposed token (the proposal is deterministic), which the
//! acceptance rule handles exactly.

/// Longest and shortest suffix looked up; a longer match is tried first.
const MAX_MATCH: usize = 4;
const MIN_MATCH: usize = 2;

/// Up to `k` tokens continuing the latest earlier occurrence of the longest suffix of `tokens`
/// (between [`MIN_MATCH`] and [`MAX_MATCH`] tokens long); empty when none recurs.
pub fn propose(tokens: &[u32], k: usize) -> Vec<u32> {
    let len = tokens.len();
    for n in (MIN_MATCH..=MAX_MATCH.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // Latest start first; the occurrence must end before the suffix itself starts.
        if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
            let from = start + n;
            return tokens[from..len.min(from + k)].to_vec();
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
    fn the_proposal_stops_at_k_and_at_the_end_of_the_log() {
        let tokens = [7, 8, 9, 7, 8];
        assert_eq!(propose(&tokens, 8), vec![9, 7, 8]);
        assert_eq!(propose(&tokens, 1), vec![9]);
    }

    #[test]
    fn no_recurrence_no_proposal() {
        assert!(propose(&[1, 2, 3, 4, 5], 4).is_empty());
        assert!(propose(&[1], 4).is_empty());
        assert!(propose(&[], 4).is_empty());
        // A single repeated token is below the shortest match.
        assert!(propose(&[5, 6, 5], 4).is_empty());
    }
}
