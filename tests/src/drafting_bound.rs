//! What any chain of drafts could make of an answer at most, the draft model's and copying's
//! together: the prompts bench's bound for speculation itself (issue 54), beside the copy bound
//! ([`crate::copy_bound`]) that counts copying alone.
//!
//! Each drafter is known by its runs: at each position of the answer, how many of the answer's
//! tokens from there on its chain would hold (the draft model's greedy chain holds as long as its
//! choice at each position, given the answer so far, is the answer's token; n-gram lookup's
//! longest copy holds as [`crate::copy_bound`] counts it). An oracle that knew every run would
//! schedule rounds to spend the least: a round drafts a run of K tokens with one drafter (or
//! none) and costs the target's verify of K drafts ([`VerifyCost`]) and the drafter's own cost
//! per token (the draft model's step; copying's is nothing). [`fastest`] finds
//! that schedule. No real policy knows the runs, nor drafts for free, so every chain policy over
//! these drafters stays below it; with the draft model's cost set to 0 (drafting wholly hidden
//! behind verifies, as drafting ahead at best would) it bounds any pipelining of them as well.

use tandem_runtime::{Logits, Model};

use crate::copy_bound::{VerifyCost, per_step};

/// One drafter: where its chain would hold, and what each drafted token costs it in steps of the
/// target (besides the verify).
#[derive(Debug, Clone, Copy)]
pub struct Drafter<'a> {
    /// At each position of the answer, the tokens from there on that its chain would hold.
    pub runs: &'a [usize],
    pub per_token: f64,
}

/// At each position, how many positions from there on in a row are `held`.
pub fn runs_where(held: &[bool]) -> Vec<usize> {
    let mut runs = vec![0; held.len()];
    let mut run = 0;
    for (r, &h) in runs.iter_mut().zip(held).rev() {
        run = if h { run + 1 } else { 0 };
        *r = run;
    }
    runs
}

/// The cheapest schedule of rounds over some drafters ([`fastest`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    /// Answer tokens per step: 1 (the target alone) for an empty answer.
    pub speedup: f64,
    /// Answer tokens its rounds drafted (the rest are the target's own).
    pub drafted: usize,
}

/// The cheapest schedule of rounds over `drafters` (all of one answer's length): each round
/// drafts at most [`VerifyCost::max_drafts`] tokens that hold with one drafter (or none) and
/// commits them and the target's next.
pub fn fastest(drafters: &[Drafter], verify: &VerifyCost) -> Schedule {
    let n = drafters.iter().map(|d| d.runs.len()).max().unwrap_or(0);
    // cost[i]: the least to commit the answer from position i on; drafts[i]: the drafts of
    // the round that starts there.
    let mut cost = vec![0.0_f64; n + 1];
    let mut drafts = vec![0; n];
    for i in (0..n).rev() {
        cost[i] = 1.0 + cost[i + 1];
        for d in drafters {
            // A round's last token is the target's own: at most n - 1 - i drafts.
            for k in 1..=d.runs[i].min(n - 1 - i).min(verify.max_drafts()) {
                let round = verify.of(k) + d.per_token * k as f64 + cost[i + k + 1];
                if round < cost[i] {
                    (cost[i], drafts[i]) = (round, k);
                }
            }
        }
    }
    let (mut i, mut drafted) = (0, 0);
    while i < n {
        drafted += drafts[i];
        i += drafts[i] + 1;
    }
    Schedule {
        speedup: per_step(n, cost[0]),
        drafted,
    }
}

/// Answer tokens per step where each round drafts a chain of at most `k` tokens (and at most
/// [`VerifyCost::max_drafts`]) with the drafter of `runs`, stopping before a draft (but its
/// first) whose `confidence` is below `min_confidence`, as the policy's chains do (no oracle:
/// the round pays for every draft and commits the part that holds and the target's token).
///
/// `ahead`: `None` drafts then verifies. `Some(slowdown)` drafts ahead, as the engine's pipeline
/// does: during each round's verify the drafter drafts its guess of the target's token and the
/// next round's chain past it (on another core), the round taking the longer of the two, its
/// verify slowed by `slowdown` (a fraction) where the two share one machine; the next round's
/// chain is then free where this round's chain held whole and the run went on (the guess right),
/// and drafted serially again where not.
pub fn chained(
    drafter: Drafter,
    confidence: &[f32],
    (k, min_confidence): (usize, f32),
    verify: &VerifyCost,
    ahead: Option<f64>,
) -> f64 {
    let n = drafter.runs.len();
    let most = |i: usize| k.min((n - 1).saturating_sub(i)).min(verify.max_drafts());
    let (mut i, mut cost, mut free) = (0, 0.0, false);
    while i < n {
        let drafted = (0..most(i))
            .take_while(|&j| j == 0 || confidence[i + j] >= min_confidence)
            .count();
        let held = drafter.runs[i].min(drafted);
        let per_token = if free { 0.0 } else { drafter.per_token };
        cost += per_token * drafted as f64;
        let next = i + held + 1;
        match ahead {
            // The guess and the next chain (none past the answer's end).
            Some(slowdown) if drafted > 0 && next < n => {
                let step = drafter.per_token * (most(next) + 1) as f64;
                cost += (verify.of(drafted) * (1.0 + slowdown)).max(step);
                free = drafter.runs[i] > drafted;
            }
            _ => {
                cost += verify.of(drafted);
                free = false;
            }
        }
        i = next;
    }
    per_step(n, cost)
}

/// How a model reads an answer: at each of its tokens, the token's rank among the model's
/// logits (0: the model's greedy choice) and the model's confidence there (its largest
/// probability).
#[derive(Debug, Clone, Default)]
pub struct Reading {
    pub rank: Vec<usize>,
    pub confidence: Vec<f32>,
}

/// `model` reading `answer` after `prompt`, as the target wrote it.
pub fn read(model: &Model, prompt: &[u32], answer: &[u32]) -> anyhow::Result<Reading> {
    let Some((_, before_last)) = answer.split_last() else {
        return Ok(Reading::default());
    };
    let mut cache = model.new_cache();
    let mut rows = model.forward(prompt, &mut cache, Logits::Last)?;
    if !before_last.is_empty() {
        rows.extend(model.forward(before_last, &mut cache, Logits::All)?);
    }
    anyhow::ensure!(rows.len() == answer.len(), "one row of logits per token");
    let mut reading = Reading::default();
    for (row, &t) in rows.iter().zip(answer) {
        let own = row[t as usize];
        reading.rank.push(row.iter().filter(|&&x| x > own).count());
        let top = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = row.iter().map(|&x| (x - top).exp()).sum();
        reading.confidence.push(1.0 / sum);
    }
    Ok(reading)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_counts_the_held_positions_that_follow_in_a_row() {
        let held = [true, true, false, true, false, false, true];
        assert_eq!(runs_where(&held), vec![2, 1, 0, 1, 0, 0, 1]);
        assert!(runs_where(&[]).is_empty());
    }

    #[test]
    fn the_fastest_schedule_drafts_each_run_with_its_cheapest_drafter() {
        // 6 tokens. The model holds 0..4 (4 tokens), copying holds 2..5 (3 tokens).
        let model = runs_where(&[true, true, true, true, false, false]);
        let copy = runs_where(&[false, false, true, true, true, false]);
        let p = &VerifyCost::linear(0.25, 8);
        // The target alone: 6 steps.
        assert_eq!(fastest(&[], p).speedup, 1.0);
        let m = Drafter {
            runs: &model,
            per_token: 0.5,
        };
        let c = Drafter {
            runs: &copy,
            per_token: 0.0,
        };
        // Model alone: draft 4 at 0 (1 + 4 · 0.75 = 4 steps for 5 tokens), then a step: 5 steps.
        assert!((fastest(&[m], p).speedup - 6.0 / 5.0).abs() < 1e-12);
        // Both: the model's 1 draft at 0 (1.75 for tokens 0 and 1), then copying's 3 at 2 (1.75
        // for 2..5) = 3.5, cheaper than the model's 4 at 0 (5 in all) or steps to 2 then copying
        // (3.75).
        assert!((fastest(&[m, c], p).speedup - 6.0 / 3.5).abs() < 1e-12);
        assert_eq!(fastest(&[m, c], p).drafted, 4);
        // A drafter that costs nothing and holds everywhere: one round of 5 drafts.
        let all = runs_where(&[true; 6]);
        let free = Drafter {
            runs: &all,
            per_token: 0.0,
        };
        assert!((fastest(&[free], p).speedup - 6.0 / 2.25).abs() < 1e-12);
    }

    #[test]
    fn a_run_longer_than_a_round_drafts_takes_several_rounds() {
        // Copying holds the whole answer of 6 tokens; a round drafts at most 2.
        let runs = runs_where(&[true; 6]);
        let copying = Drafter {
            runs: &runs,
            per_token: 0.0,
        };
        let s = fastest(&[copying], &VerifyCost::linear(0.25, 2));
        // Rounds at 0 (0 1 drafted, 2 the target's: 1.5 steps) and 3 (3 4, then 5: 1.5).
        assert_eq!(s.drafted, 4);
        assert!((s.speedup - 6.0 / 3.0).abs() < 1e-12);
        // Where an extra draft costs more than a step, it is not drafted.
        let steep = VerifyCost::measured(vec![1.0, 1.2, 2.5]).expect("valid");
        assert_eq!(fastest(&[copying], &steep).drafted, 3);
    }

    #[test]
    fn a_chain_pays_for_every_draft_and_stops_where_the_draft_is_unsure() {
        // 6 tokens; the model holds 0..3 and 4..5.
        let runs = runs_where(&[true, true, true, false, true, false]);
        let model = Drafter {
            runs: &runs,
            per_token: 0.5,
        };
        let sure = [1.0; 6];
        let p = &VerifyCost::linear(0.25, 8);
        // K = 2, rounds at 0 (0 1 drafted and held, 2 the target's: 2.5 steps), 3 (3 4 drafted,
        // 3 refused: 2.5), 4 (the last draft, 4, held: 1.75).
        assert!((chained(model, &sure, (2, 0.0), p, None) - 6.0 / 6.75).abs() < 1e-12);
        // Unsure at 1 and 4: a round drafts only its first token there.
        let unsure = [1.0, 0.2, 1.0, 1.0, 0.2, 1.0];
        // Rounds at 0 (0 drafted, cut before 1: 1.75 for 0 1), 2 (2 3 drafted, 3 refused: 2.5
        // for 2 3), 4 (4 drafted: 1.75 for 4 5).
        assert!((chained(model, &unsure, (2, 0.5), p, None) - 6.0 / 6.0).abs() < 1e-12);
        // Drafting ahead, sure: the round at 0 (2.5) drafted the guess of 2 and the chain at 3
        // during its verify (3 tokens, 1.5: as long as the verify), and held both drafts and
        // the guess, so the round at 3 had its drafts free (the verify beside the guess and the
        // one draft left at 4: 1.5); the one at 4 follows a refusal and pays, nothing to draft
        // ahead past the end (1.75).
        assert!((chained(model, &sure, (2, 0.0), p, Some(0.0)) - 6.0 / 5.75).abs() < 1e-12);
        // A verify a fifth slower beside the step drafting ahead: 1.8 where one was beside.
        let slowed = 2.8 + 1.8 + 1.75;
        assert!((chained(model, &sure, (2, 0.0), p, Some(0.2)) - 6.0 / slowed).abs() < 1e-12);
        // A draft step of 0.8: the step drafting ahead outlasts the verify (2.4 against 1.5 at
        // 0, 1.6 at 3), and the round waits for it.
        let slow = Drafter {
            runs: &runs,
            per_token: 0.8,
        };
        let waited = (1.6 + 2.4) + 1.6 + (0.8 + 1.25);
        assert!((chained(slow, &sure, (2, 0.0), p, Some(0.0)) - 6.0 / waited).abs() < 1e-12);
    }
}
