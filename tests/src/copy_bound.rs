//! What model-free drafting could make of an answer at most: the prompts bench's bound for
//! n-gram lookup (issue 54). At each position of the answer, the longest run of it that follows
//! any earlier occurrence of its last [`MIN_MATCH`] tokens, in the prompt, the answer so far or
//! the tenant's earlier answers. A drafter that knew which of its matches holds would propose
//! exactly that run: rounds of at most as many drafts as the policy drafts verify it, each
//! costing the target's verify of its drafts ([`VerifyCost`]); where nothing holds, a
//! round is one step. A match in the text itself continues past its end as a loop, as the
//! drafter proposes one. A real drafter proposes some tokens that are refused, misses some runs
//! (it continues the latest, longest match and a few branches, not every occurrence), and pays
//! for its proposals where the target alone would have been cheaper, so it stays below this
//! bound.

use crate::drafting_bound::{Drafter, fastest};

/// The shortest suffix looked up: the n-gram drafter's own shortest match.
pub const MIN_MATCH: usize = 2;

/// What the target's verify costs, in its steps, by the drafts it checks (0: a plain step), up
/// to the most a round drafts.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyCost(Vec<f64>);

impl VerifyCost {
    /// A step plus `per_position` of a step for each draft, up to `max_drafts`.
    pub fn linear(per_position: f64, max_drafts: usize) -> Self {
        Self(
            (0..=max_drafts)
                .map(|k| 1.0 + per_position * k as f64)
                .collect(),
        )
    }

    /// Measured: `steps[k]` for `k` drafts (`steps[0]` is 1); a round drafts at most
    /// `steps.len() - 1`.
    pub fn measured(steps: Vec<f64>) -> anyhow::Result<Self> {
        anyhow::ensure!(
            steps.len() >= 2 && steps[0] == 1.0 && steps.windows(2).all(|w| w[0] <= w[1]),
            "verify costs start at 1 (a step) and never fall: {steps:?}"
        );
        Ok(Self(steps))
    }

    /// The most drafts a round verifies.
    pub fn max_drafts(&self) -> usize {
        self.0.len() - 1
    }

    /// The verify of `k` drafts (at most [`Self::max_drafts`]), in steps.
    pub fn of(&self, k: usize) -> f64 {
        self.0[k]
    }
}

/// One answer's bound.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CopyBound {
    /// Answer tokens that rounds of copied text carried (each round's last token, the target's
    /// own, is not counted).
    pub copied: usize,
    pub tokens: usize,
    /// Answer tokens per step of cost: the most n-gram lookup could speed this answer up.
    pub speedup: f64,
}

/// At each position of `answer` (after `prompt`), the longest run of it from there on that
/// follows an occurrence of the text's last [`MIN_MATCH`] tokens, in the text itself or in the
/// tenant's `earlier` answers: what a drafter that knew which match holds would propose there.
pub fn copy_runs(earlier: &[Vec<u32>], prompt: &[u32], answer: &[u32]) -> Vec<usize> {
    let mut text = prompt.to_vec();
    let mut runs = Vec::with_capacity(answer.len());
    for (i, &token) in answer.iter().enumerate() {
        let rest = &answer[i..];
        let run = earlier
            .iter()
            .map(|t| longest_run(t, &text, rest, false))
            .chain(std::iter::once(longest_run(&text, &text, rest, true)))
            .max()
            .unwrap_or(0);
        runs.push(run);
        text.push(token);
    }
    runs
}

/// The bound of `answer` to `prompt`, with `earlier` answers of the same tenant to copy from
/// too, when verifying a block costs `verify`: the cheapest schedule of rounds over the copy
/// runs ([`crate::drafting_bound::fastest`]).
pub fn copy_bound(
    earlier: &[Vec<u32>],
    prompt: &[u32],
    answer: &[u32],
    verify: &VerifyCost,
) -> CopyBound {
    let runs = copy_runs(earlier, prompt, answer);
    let copying = Drafter {
        runs: &runs,
        per_token: 0.0,
    };
    let schedule = fastest(&[copying], verify);
    CopyBound {
        copied: schedule.drafted,
        tokens: answer.len(),
        speedup: schedule.speedup,
    }
}

/// `tokens` per step of `cost`; 1 (the target alone) for an empty answer.
pub(crate) fn per_step(tokens: usize, cost: f64) -> f64 {
    if cost > 0.0 {
        tokens as f64 / cost
    } else {
        1.0
    }
}

/// What a drafter's own proposals could make of one answer ([`replay`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Replay {
    /// Answer tokens its proposals carried.
    pub copied: usize,
    /// Answer tokens per step where each round verifies the whole proposal (as a round that
    /// drafts it does; a position with no proposal is a step).
    pub whole: f64,
    /// Answer tokens per step where each round verifies only the part that holds (a policy that
    /// knew where a proposal fails), as the copy bound counts a round.
    pub knowing: f64,
}

/// `answer` replayed against `propose` (the text so far → the drafter's proposal): at each
/// position one round verifies the proposal and commits its accepted prefix and the target's
/// token. Set beside [`copy_bound`], it says how much of the bound the drafter's choice of match
/// leaves (here, not in the policy), with a verify costing `verify`.
pub fn replay(
    prompt: &[u32],
    answer: &[u32],
    verify: &VerifyCost,
    mut propose: impl FnMut(&[u32]) -> Vec<u32>,
) -> Replay {
    let mut text = prompt.to_vec();
    let (mut i, mut whole, mut knowing, mut copied) = (0, 0.0, 0.0, 0);
    while i < answer.len() {
        let rest = &answer[i..];
        let mut proposal = propose(&text);
        proposal.truncate(verify.max_drafts());
        let run = proposal
            .iter()
            .zip(rest)
            .take_while(|(a, b)| a == b)
            .count()
            .min(rest.len() - 1);
        whole += verify.of(proposal.len());
        knowing += verify.of(run);
        copied += run;
        text.extend_from_slice(&rest[..=run]);
        i += run + 1;
    }
    Replay {
        copied,
        whole: per_step(answer.len(), whole),
        knowing: per_step(answer.len(), knowing),
    }
}

/// The longest prefix of `rest` that follows an occurrence in `source` of `text`'s last
/// [`MIN_MATCH`] tokens. In the text itself (`periodic`), a match `d` tokens back continues past
/// its end with period `d`, as the n-gram drafter proposes a loop.
fn longest_run(source: &[u32], text: &[u32], rest: &[u32], periodic: bool) -> usize {
    let Some(key) = text.len().checked_sub(MIN_MATCH).map(|s| &text[s..]) else {
        return 0;
    };
    source
        .windows(MIN_MATCH)
        .enumerate()
        .filter(|(_, w)| *w == key)
        .map(|(s, _)| {
            let after = &source[s + MIN_MATCH..];
            match (periodic, after.len()) {
                (_, 0) => 0,
                (true, d) => (0..rest.len())
                    .take_while(|&j| after[j % d] == rest[j])
                    .count(),
                (false, _) => after.iter().zip(rest).take_while(|(a, b)| a == b).count(),
            }
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copied_run_costs_one_round_and_the_rest_a_step_each() {
        // The answer copies 5 6 7 8 after "3 4" (the prompt's), then says 9 and 10, unseen.
        let prompt = [1, 2, 3, 4, 5, 6, 7, 8];
        let answer = [3, 4, 5, 6, 7, 8, 9, 10];
        let b = copy_bound(&[], &prompt, &answer, &VerifyCost::linear(0.25, 8));
        // Rounds: 3 (nothing before it to match: the key is the prompt's "7 8", never followed
        // by 3), 4 ("8 3" never seen), 5 6 7 8 9 (after "3 4": 4 copied, 9 the target's), 10.
        assert_eq!(b.copied, 4);
        assert_eq!(b.tokens, 8);
        let cost = 1.0 + 1.0 + (1.0 + 4.0 * 0.25) + 1.0;
        assert!((b.speedup - 8.0 / cost).abs() < 1e-12, "{b:?}");
    }

    #[test]
    fn any_occurrence_counts_and_so_do_earlier_answers() {
        // "1 2" occurs twice in the prompt: followed by 9, then by 3 4 5. The longer run holds.
        let prompt = [1, 2, 9, 0, 1, 2, 3, 4, 5, 0, 1, 2];
        let answer = [3, 4, 5, 6, 0];
        assert_eq!(
            copy_bound(&[], &prompt, &answer, &VerifyCost::linear(0.25, 8)).copied,
            3
        );
        // An earlier answer that went on with 6 carries one more.
        let earlier = vec![vec![1, 2, 3, 4, 5, 6, 7]];
        assert_eq!(
            copy_bound(&earlier, &prompt, &answer, &VerifyCost::linear(0.25, 8)).copied,
            4
        );
        // With nothing to copy the bound is the target alone.
        let b = copy_bound(&[], &[7, 7], &[8, 9], &VerifyCost::linear(0.25, 8));
        assert_eq!((b.copied, b.speedup), (0, 1.0));
    }

    #[test]
    fn a_replay_verifies_each_proposal_and_commits_what_holds() {
        // The drafter proposes 5 6 7 after "... 4" and nothing elsewhere; the answer holds 5 6
        // then goes 0.
        let propose = |text: &[u32]| match text.last() {
            Some(4) => vec![5, 6, 7],
            _ => Vec::new(),
        };
        let r = replay(
            &[1, 2, 3, 4],
            &[5, 6, 0, 9],
            &VerifyCost::linear(0.25, 8),
            propose,
        );
        assert_eq!(r.copied, 2);
        // Rounds: 5 6 0 (3 proposed, 2 held), 9 (nothing proposed).
        let (whole, knowing) = (1.0 + 3.0 * 0.25 + 1.0, 1.0 + 2.0 * 0.25 + 1.0);
        assert!((r.whole - 4.0 / whole).abs() < 1e-12, "{r:?}");
        assert!((r.knowing - 4.0 / knowing).abs() < 1e-12, "{r:?}");
    }

    #[test]
    fn a_loop_is_followed_past_the_end_of_the_text() {
        // "1 2 3" twice: after "2 3" (3 back) the loop goes on 1 2 3 1 2 3, past the text's end.
        let prompt = [9, 1, 2, 3, 1, 2, 3];
        let answer = [1, 2, 3, 1, 2, 3, 5];
        let b = copy_bound(&[], &prompt, &answer, &VerifyCost::linear(0.25, 8));
        assert_eq!(b.copied, 6);
        assert!(
            (b.speedup - 7.0 / (1.0 + 6.0 * 0.25)).abs() < 1e-12,
            "{b:?}"
        );
    }

    #[test]
    fn a_measured_verify_is_its_table() {
        let v = VerifyCost::measured(vec![1.0, 1.2, 1.5]).expect("valid");
        assert_eq!((v.of(0), v.of(2), v.max_drafts()), (1.0, 1.5, 2));
        assert_eq!(VerifyCost::linear(0.25, 4).of(4), 2.0);
        // Not a step at 0 drafts, or falling: refused.
        assert!(VerifyCost::measured(vec![1.2, 1.5]).is_err());
        assert!(VerifyCost::measured(vec![1.0, 1.5, 1.4]).is_err());
        assert!(VerifyCost::measured(vec![1.0]).is_err());
    }
}
