//! The K controller on synthetic costs.

use super::costs::Ewma;
use super::*;

mod costs;
mod probes;

#[derive(Clone, Copy)]
pub(super) struct Pair {
    alpha: f64,
    t_d: f64,
    rtt: f64,
    t1: f64,
    slope: f64,
    hidden: f64,
    pipelining: bool,
    /// A round whose block drafted ahead stalls: abandoned at the engine's deadline, 8 times
    /// its expected time plus 0.5 s.
    stall_at: Option<usize>,
}

pub(super) fn pair(alpha: f64, t_d: f64, rtt: f64, t1: f64, slope: f64) -> Pair {
    Pair {
        alpha,
        t_d,
        rtt,
        t1,
        slope,
        hidden: 0.0,
        pipelining: true,
        stall_at: None,
    }
}

/// Feeds `rounds` rounds of a synthetic pair: a draft accepted with chance `alpha` per
/// position, costing `rtt + k·t_d`, and a target whose verify costs
/// `t_v(n) = t1 · (1 + slope · (n − 1))`; a drafted round also costs `hidden` seconds that
/// neither part shows. As the engine does, a block is drafted ahead during the verify where
/// the policy says it fits (the round then lasts the longer of the two), and used by the
/// next round when every draft was accepted and the draft's guess of the bonus token (one more
/// draft, as likely right) was the target's.
/// Returns the plans chosen.
fn simulate(pair: Pair, rounds: usize) -> Vec<RoundPlan> {
    let mut policy = KPolicy::new(ADAPTIVE_MAX_K);
    simulate_on(&mut policy, pair, rounds)
}

/// A fixed-seed generator of uniform numbers in [0, 1).
fn uniform() -> impl FnMut() -> f64 {
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Teaches `policy` a round of `plan` without a draft model: `accepted` drafts, the verify (the
/// whole round) `wall` seconds.
fn observe_verify(policy: &mut KPolicy, plan: RoundPlan, accepted: usize, wall: f64) {
    let costs = RoundCosts {
        drafted: plan.k,
        accepted,
        verify_wall: wall,
        round_wall: wall,
        ..RoundCosts::default()
    };
    policy.observe(plan, &costs);
}

/// [`simulate`] from `policy` as it stands.
pub(super) fn simulate_on(policy: &mut KPolicy, pair: Pair, rounds: usize) -> Vec<RoundPlan> {
    let Pair {
        alpha,
        t_d,
        rtt,
        t1,
        slope,
        hidden,
        pipelining,
        mut stall_at,
    } = pair;
    policy.set_pipelining(pipelining);
    let mut plans = Vec::new();
    // A fixed-seed generator: each position is accepted with chance alpha.
    let mut uniform = uniform();
    // The length of the block drafted ahead and ready for the next round.
    let mut ready = 0;
    for round_index in 0..rounds {
        let plan = policy.choose(true, ready, NgramOffer::default(), 1000);
        let drafted_ahead = plan.k > 0 && ready > 0;
        let k = if drafted_ahead {
            plan.k.min(ready)
        } else {
            plan.k
        };
        let accepted = (0..k).take_while(|_| uniform() < alpha).count();
        let draft = if k == 0 || drafted_ahead {
            0.0
        } else {
            rtt + k as f64 * t_d
        };
        let verify = t1 * (1.0 + slope * k as f64);
        // As the engine: the block drafted ahead is one longer than this one where it fits.
        let next = policy.ahead_len(k);
        let ahead = k > 0 && next >= k;
        let stalled = ahead && stall_at.is_some_and(|at| round_index >= at) && {
            stall_at = None;
            true
        };
        let round = if stalled {
            let deadline = 8.0 * (rtt + (next + 1) as f64 * t_d) + 0.5;
            policy.observe_stall(next + 1, deadline);
            draft + verify.max(deadline)
        } else if ahead {
            draft + verify.max(rtt + (next + 1) as f64 * t_d)
        } else {
            draft + verify
        };
        let hidden = if k > 0 { hidden } else { 0.0 };
        let drafts_next = ahead && !stalled;
        // The guess of the bonus token is one more draft: right with chance alpha.
        let guess = (drafts_next && accepted == k).then(|| uniform() < alpha);
        ready = if guess == Some(true) { next } else { 0 };
        if let Some(right) = guess {
            policy.observe_guess_after(k, right, true);
        }
        policy.observe(
            RoundPlan { k, ..plan },
            &RoundCosts {
                drafted: k,
                drafted_ahead,
                drafted_next: if drafts_next { next + 1 } else { 0 },
                accepted,
                draft_wall: draft,
                draft_compute: if drafted_ahead { 0.0 } else { k as f64 * t_d },
                verify_wall: verify,
                // The engine does not calibrate on a round whose step ahead failed.
                round_wall: if stalled { 0.0 } else { round + hidden },
                siblings: 0,
            },
        );
        plans.push(plan);
    }
    plans
}

/// A policy that has measured a verify of `verify` seconds at 1 to 4 positions (flat), a draft
/// of `t_d` seconds a token with no fixed cost, and the model's drafts accepted with chance
/// `accept` at every depth (100 rounds each).
pub(super) fn measured(verify: f64, t_d: f64, accept: f64) -> KPolicy {
    let mut policy = KPolicy::new(8);
    for n in [1, 1, 2, 3, 4] {
        policy.verify.observe(n, verify);
    }
    policy.model.overhead.add(0.0);
    policy.model.compute.observe(1, t_d);
    policy.model.compute.observe(2, 2.0 * t_d);
    policy.model.accept = [accept; ADAPTIVE_MAX_K];
    policy.model.tried = [100; ADAPTIVE_MAX_K];
    policy
}

fn settled_k(plans: &[RoundPlan]) -> usize {
    let tail = &plans[plans.len() - 40..];
    let mut ks: Vec<usize> = tail.iter().map(|p| p.k).collect();
    ks.sort_unstable();
    ks[ks.len() / 2]
}

#[test]
fn a_good_cheap_draft_drafts_long_blocks() {
    // α = 0.9, draft 1/20 of the target, free link, verify nearly flat in n (a GPU).
    let plans = simulate(pair(0.9, 0.001, 0.0, 0.02, 0.02), 300);
    assert!(settled_k(&plans) >= 6, "{:?}", &plans[plans.len() - 10..]);
}

#[test]
fn a_useless_draft_or_a_slow_link_settles_on_target_only_with_rare_probes() {
    for (alpha, rtt) in [(0.05, 0.0), (0.8, 0.5)] {
        let plans = simulate(pair(alpha, 0.004, rtt, 0.02, 0.25), 400);
        assert_eq!(settled_k(&plans), 0, "alpha {alpha}, rtt {rtt}");
        let probes = plans[200..].iter().filter(|p| p.k > 0).count();
        // The budget: probes lose at most 2% of the time, a dozen of these in 200 rounds.
        assert!(
            probes <= 12,
            "alpha {alpha}, rtt {rtt}: {probes} probes in 200 rounds"
        );
    }
}

/// Drafted rounds measured far faster than their parts (on a loaded machine, the target-only
/// rounds' verifies slowed and the drafted ones ran in a lull): the calibration falls to its
/// floor, yet a draft never accepted cannot beat the target alone, as a round takes at least
/// its own verify.
#[test]
fn a_useless_draft_in_rounds_faster_than_their_parts_stays_out() {
    let lull = Pair {
        hidden: -0.02,
        ..pair(0.0, 0.004, 0.0, 0.02, 0.25)
    };
    let plans = simulate(lull, 400);
    assert_eq!(settled_k(&plans), 0);
    let drafted = plans[200..].iter().filter(|p| p.k > 0).count();
    assert!(drafted <= 12, "{drafted} drafted rounds in 200");
}

#[test]
fn a_cost_the_parts_do_not_show_is_learnt_from_the_rounds() {
    // α = 0.8 with a cheap draft pays (see below), unless each drafted round also loses
    // 50 ms that neither the draft's nor the verify's time shows: then drafting at any K is
    // slower than the target alone (K = 6: 3.95 tokens in 88 ms against 1 in 20 ms), and
    // the rounds' measured time must teach the policy so.
    let honest = simulate(pair(0.8, 0.002, 0.0, 0.02, 0.1), 300);
    assert!(settled_k(&honest) > 0);
    let hidden = simulate(
        Pair {
            hidden: 0.05,
            ..pair(0.8, 0.002, 0.0, 0.02, 0.1)
        },
        300,
    );
    assert_eq!(settled_k(&hidden), 0);
    let drafted = hidden[100..].iter().filter(|p| p.k > 0).count();
    assert!(drafted <= 12, "{drafted} drafted rounds of 200");
}

#[test]
fn one_stalled_step_ahead_does_not_shut_the_draft_out() {
    // A good cheap draft whose block drafted ahead stalls once, at round 100: it is priced
    // at its deadline, yet the drafter keeps drafting and, once rounds go as predicted again,
    // settles on the K it had without the stall (a stall once priced as the cost of K + 1
    // tokens kept K below that for good).
    let good = pair(0.8, 0.002, 0.0, 0.02, 0.1);
    let calm = settled_k(&simulate(good, 300));
    let plans = simulate(
        Pair {
            stall_at: Some(100),
            ..good
        },
        300,
    );
    let drafted = plans[110..].iter().filter(|p| p.k > 0).count();
    assert!(
        drafted >= 180,
        "{drafted} drafted rounds of 190 after the stall"
    );
    assert_eq!(settled_k(&plans), calm);
}

#[test]
fn a_longer_link_picks_a_longer_block_while_drafting_still_pays() {
    // α = 0.8 with a cheap draft, drafting then verifying: the round trip is paid once per
    // round, so a longer link calls for more tokens per round.
    let serial = |rtt| Pair {
        pipelining: false,
        ..pair(0.8, 0.002, rtt, 0.02, 0.1)
    };
    let near = settled_k(&simulate(serial(0.0), 300));
    let far = settled_k(&simulate(serial(0.02), 300));
    assert!(far >= near && far > 0, "near {near}, far {far}");
    // Drafting during the verify, the 20 ms link still pays.
    let pipelined = simulate(pair(0.8, 0.002, 0.02, 0.02, 0.1), 300);
    assert!(settled_k(&pipelined) > 0);
}

#[test]
fn the_choice_maximises_the_cost_model() {
    let mut policy = KPolicy::new(8);
    // Known costs: verify 10 ms flat, model free and always right, n-gram as well.
    for n in [1, 1, 2, 3, 4, 5, 6, 7, 8, 9] {
        policy.verify.observe(n, 0.010);
    }
    policy.model.accept = [1.0; ADAPTIVE_MAX_K];
    policy.model.tried = [100; ADAPTIVE_MAX_K];
    policy.model.overhead.add(0.0);
    policy.model.compute.observe(1, 0.001);
    assert_eq!(
        policy.choose(true, 0, NgramOffer::default(), 100),
        RoundPlan {
            drafter: Some(DrafterKind::Model),
            k: 8
        }
    );
    // Only 3 tokens left: K = 2 at most (the last token is the bonus).
    assert_eq!(policy.choose(true, 0, NgramOffer::default(), 3).k, 2);
    // A perfect, free n-gram match beats a model that costs time: acceptance is kept per class
    // of match length, so a long match does not vouch for a short one.
    let offer = |matched| NgramOffer { len: 8, matched };
    policy.ngram[2].accept = [1.0; ADAPTIVE_MAX_K];
    policy.ngram[2].tried = [100; ADAPTIVE_MAX_K];
    policy.ngram[0].accept = [0.1; ADAPTIVE_MAX_K];
    policy.ngram[0].tried = [100; ADAPTIVE_MAX_K];
    assert_eq!(
        policy.choose(true, 0, offer(6), 100),
        RoundPlan {
            drafter: Some(DrafterKind::Ngram),
            k: 8
        }
    );
    assert_eq!(
        policy.choose(true, 0, offer(2), 100).drafter,
        Some(DrafterKind::Model)
    );
    // Without a model or a match: target only.
    assert_eq!(
        policy.choose(false, 0, NgramOffer::default(), 100),
        RoundPlan::TARGET_ONLY
    );
    // Its 8 drafts fit in the verify's 10 ms: drafted ahead (9 ms with the guess), they cost
    // time only when the guess of the bonus token (0.6, the prior) misses.
    assert_eq!(policy.ahead_k(8), 8);
    let expected = 9.0 / (0.010 + 0.4 * 0.008);
    assert!((policy.rate(DrafterKind::Model, 8) - expected).abs() < 1e-9);
}

#[test]
fn a_new_session_starts_from_what_the_last_one_learnt() {
    let mut first = KPolicy::new(8);
    for n in [1, 1, 9] {
        first.verify.observe(n, 0.010);
    }
    first.model.overhead.add(0.0);
    first.model.compute.observe(8, 0.008);
    first.model.accept = [1.0; ADAPTIVE_MAX_K];
    first.model.tried = [100; ADAPTIVE_MAX_K];
    let mut next = first.continued(8);
    // No target-only warm-up and no probe needed: the model drafts from the first round.
    assert_eq!(
        next.choose(true, 0, NgramOffer::default(), 100),
        RoundPlan {
            drafter: Some(DrafterKind::Model),
            k: 8
        }
    );
    // Acceptance carries as a prior only: four misses bring position 1 from 1 to 0.6.
    for _ in 0..4 {
        next.observe(
            RoundPlan {
                drafter: Some(DrafterKind::Model),
                k: 1,
            },
            &RoundCosts {
                drafted: 1,
                verify_wall: 0.010,
                ..RoundCosts::default()
            },
        );
    }
    assert!(next.model.accept[0] < 0.61, "{:?}", next.model.accept);
    // A session with a lower bound on K (a request that fixes K = 4) learns from it too.
    assert_eq!(
        first
            .continued(4)
            .choose(true, 0, NgramOffer::default(), 100),
        RoundPlan {
            drafter: Some(DrafterKind::Model),
            k: 4
        }
    );
}

#[test]
fn a_new_session_starts_from_the_verify_costs_of_the_last_ones_first_rounds() {
    let target_only = |policy: &mut KPolicy, seconds: f64| {
        policy.observe(
            RoundPlan::TARGET_ONLY,
            &RoundCosts {
                verify_wall: seconds,
                ..RoundCosts::default()
            },
        );
    };
    // A step costs 0.1 ms at the start of a generation, 0.25 ms where it ends (attention over
    // a longer context), rising a little each round.
    let mut first = KPolicy::new(8);
    for round in 0..256 {
        target_only(&mut first, 1e-4 + 1.5e-4 * f64::from(round) / 255.0);
    }
    assert!(
        first.verify_seconds(1) > 2.2e-4,
        "{}",
        first.verify_seconds(1)
    );
    let next = first.continued(8);
    assert!(
        next.verify_seconds(1) < 1.1e-4,
        "{}",
        next.verify_seconds(1)
    );
    // A session shorter than that passes on its costs as they end.
    let mut short = KPolicy::new(8);
    for _ in 0..EARLY_ROUNDS - 1 {
        target_only(&mut short, 3e-4);
    }
    assert!((short.continued(8).verify_seconds(1) - 3e-4).abs() < 1e-12);
}

#[test]
fn a_nearly_perfect_draft_reaches_the_best_long_block() {
    // Drafting then verifying on a CPU-like target (verify +30 % per position), a cheap draft:
    // tokens per second by K from the geometric model, against what the policy settles on.
    // A position first reached by an exploration round starts from the position before it.
    for alpha in [0.7, 0.9, 0.98] {
        let p = Pair {
            pipelining: false,
            ..pair(alpha, 0.001, 0.0, 0.012, 0.3)
        };
        let rate = |k: usize| {
            let tokens = (1.0 - alpha.powi(k as i32 + 1)) / (1.0 - alpha);
            tokens / (k as f64 * p.t_d + p.t1 * (1.0 + p.slope * k as f64))
        };
        let best = (0..=ADAPTIVE_MAX_K).map(rate).fold(0.0, f64::max);
        let settled = settled_k(&simulate(p, 300));
        assert!(
            rate(settled) >= 0.97 * best,
            "alpha {alpha}: K = {settled} gives {:.0} tok/s of the best {best:.0}",
            rate(settled)
        );
    }
    // Drafting ahead during the verify: the block drafted ahead is one longer than the last, so
    // that the policy's longer blocks (its explorations) happen though every round is a pipeline
    // hit. Held to the last K by the pipeline, it stayed at K = 3 after 200 rounds.
    let pipelined = simulate(pair(0.98, 0.001, 0.0, 0.012, 0.3), 100);
    assert!(settled_k(&pipelined) >= 6, "{:?}", &pipelined[60..]);
}

#[test]
fn drafts_held_ready_cost_the_round_no_drafting() {
    // Verify 10 ms flat; a draft of 8 ms a token accepted 9 times in 10; n-gram lookup offers
    // two drafts accepted 8 times in 10, at no cost.
    let mut policy = measured(0.010, 0.008, 0.9);
    let class = ngram::class(4);
    policy.ngram[class].accept = [0.8; ADAPTIVE_MAX_K];
    policy.ngram[class].tried = [100; ADAPTIVE_MAX_K];
    let offer = NgramOffer { len: 2, matched: 4 };
    // Drafted first, the model's round costs its drafts: the free lookup is chosen.
    assert_eq!(
        policy.choose(true, 0, offer, 100).drafter,
        Some(DrafterKind::Ngram)
    );
    // With two of its drafts ready (drafted during the last verify), its round costs the
    // verify alone, as the lookup's: its better drafts win.
    assert_eq!(
        policy.choose(true, 2, offer, 100),
        RoundPlan {
            drafter: Some(DrafterKind::Model),
            k: 2
        }
    );
    // Past what is held, a model block is priced with its drafting again.
    policy.held = 1;
    let held = policy.round_seconds(DrafterKind::Model, 1, 0.010);
    let drafted = policy.round_seconds(DrafterKind::Model, 2, 0.010);
    assert!(held <= 0.010 && drafted >= 0.016, "{held} {drafted}");
}

#[test]
fn a_block_drafted_ahead_is_one_longer_only_where_that_fits_in_the_verify() {
    // Verify 10 ms flat, a draft always right. At 4 ms a token, the guess and one draft (8 ms)
    // fit in the verify of K = 1, the guess and two (12 ms) would delay it: one is drafted
    // ahead. At 3 ms a token two fit (9 ms).
    for (t_d, len) in [(0.004, 1), (0.003, 2)] {
        let policy = measured(0.010, t_d, 1.0);
        assert_eq!(policy.ahead_len(1), len, "{t_d}");
    }
}

#[test]
fn a_block_drafted_ahead_grows_to_the_long_run_k_where_that_saves_more_than_it_delays() {
    // Verify 10 ms flat, 4 ms a draft, always right. At K = 1 one is drafted past the guess;
    // where K = 2 is the long-run choice, two (12 ms: the round waits 2 ms, the next saves 8).
    let mut policy = measured(0.010, 0.004, 1.0);
    policy.steady = 2;
    assert_eq!(policy.ahead_len(1), 2);
    // Not past what fits in twice the verify (the guess and four drafts, 20 ms).
    policy.steady = 5;
    assert_eq!(policy.ahead_len(1), 1);
}

#[test]
fn a_right_guess_is_the_next_positions_acceptance_where_greedy() {
    let mut policy = measured(0.010, 0.004, 0.5);
    policy.observe_guess_after(1, true, false);
    assert_eq!(policy.model.accept[1], 0.5);
    policy.observe_guess_after(1, true, true);
    assert!(policy.model.accept[1] > 0.5 && policy.model.accept[0] == 0.5);
    assert_eq!(policy.model.tried[1], 101);
}

#[test]
fn a_block_is_drafted_ahead_only_where_that_pays() {
    // Verify 10 ms flat; a draft of 8 ms a token. Drafting 2 ahead (the guess and one more)
    // during the verify of K = 1 takes 16 ms: every round would wait 6 ms past the verify, and
    // save its 8 ms draft only on a hit.
    // A poor draft (half its drafts accepted, its guess of the bonus at the prior 0.6): a hit
    // in 0.3 of the rounds saves 2.4 ms of the 6 lost; drafted then verified, 18 ms a round.
    let mut policy = measured(0.010, 0.008, 0.5);
    assert_eq!(policy.ahead_k(1), 1);
    assert_eq!(policy.ahead_len(1), 0);
    assert!((policy.round_seconds(DrafterKind::Model, 1, 0.010) - 0.018).abs() < 1e-12);
    // A draft always right, its guess too: every round's drafts are ready, and a round takes
    // the 16 ms of the step ahead against 18 drafted then verified.
    policy.model.accept = [1.0; ADAPTIVE_MAX_K];
    for _ in 0..200 {
        policy.observe_guess(true);
    }
    assert_eq!(policy.ahead_len(1), 1);
    assert!(policy.round_seconds(DrafterKind::Model, 1, 0.010) < 0.0165);
}

#[test]
fn a_draft_that_could_not_pay_even_if_always_right_is_not_probed() {
    // A target of 0.25 ms a token behind a link whose round trip (3 ms) outweighs any block:
    // nine tokens in at least 3.9 ms against 0.25 ms each. Then a draft-node next to it.
    let mut policy = KPolicy::new(8);
    for n in [1, 1, 9] {
        policy
            .verify
            .observe(n, 0.00025 * (1.0 + 0.1 * (n - 1) as f64));
    }
    policy.model.overhead.add(0.003);
    policy.model.compute.observe(1, 0.0001);
    policy.model.compute.observe(8, 0.0008);
    assert!(!policy.model_could_pay());
    policy.idle_seconds = 100.0;
    // (the target as fast beside the draft's work: only the draft's hopelessness says no)
    on_a_machine_of_its_own(&mut policy, 0.00025);
    assert!(!policy.catch_up_soon(true));
    assert_eq!(
        policy.choose(true, 0, NgramOffer::default(), 100),
        RoundPlan::TARGET_ONLY
    );
    policy.model.overhead = Ewma::default();
    policy.model.overhead.add(0.0);
    assert!(policy.model_could_pay());
    assert_eq!(
        policy.choose(true, 0, NgramOffer::default(), 100).drafter,
        Some(DrafterKind::Model)
    );
}

#[test]
fn an_ngram_class_never_tried_starts_from_the_nearest_class_tried() {
    let mut policy = KPolicy::new(8);
    policy.ngram[2].accept = [0.95; ADAPTIVE_MAX_K];
    policy.ngram[2].tried = [50; ADAPTIVE_MAX_K];
    policy.choose(false, 0, NgramOffer { len: 4, matched: 3 }, 100);
    assert_eq!(policy.ngram[1].accept, [0.95; ADAPTIVE_MAX_K]);
    assert_eq!(policy.ngram[1].tried, [PRIOR_WEIGHT; ADAPTIVE_MAX_K]);
    // A class already tried keeps its own.
    policy.ngram[0].accept = [0.2; ADAPTIVE_MAX_K];
    policy.ngram[0].tried = [9; ADAPTIVE_MAX_K];
    policy.choose(false, 0, NgramOffer { len: 4, matched: 2 }, 100);
    assert_eq!(policy.ngram[0].accept, [0.2; ADAPTIVE_MAX_K]);
    // A class is never seeded below its own prior: two-token matches refused in prose say
    // nothing of copied text's five.
    let mut policy = KPolicy::new(8);
    policy.ngram[0].accept = [0.05; ADAPTIVE_MAX_K];
    policy.ngram[0].tried = [50; ADAPTIVE_MAX_K];
    policy.ngram[0].accept[1] = 0.9;
    let prior = policy.ngram[2].accept;
    policy.choose(false, 0, NgramOffer { len: 4, matched: 5 }, 100);
    assert!(prior[0] > 0.5);
    // Raised where the donor is above it (and weighted as a prior there), kept elsewhere.
    assert_eq!(policy.ngram[2].accept[0], prior[0]);
    assert_eq!(policy.ngram[2].tried[0], 0);
    assert_eq!(policy.ngram[2].accept[1], 0.9);
    assert_eq!(policy.ngram[2].tried[1], PRIOR_WEIGHT);
}

/// Drafts that cannot pay, as a fresh process meets them: every round n-gram lookup offers a
/// match (of 2, 3–4 and 5+ tokens in turn) whose drafts the target never takes, and the draft
/// model is never right. Greedy output is the target's whatever is drafted; what the policy may
/// lose is time, learning that they do not pay. A fresh policy's answer of 96 tokens (the
/// real-prompt benchmark's length) takes at most 1/0.97 of target-only's time, on a verify whose
/// extra positions cost 5 %, 10 % or 25 % of one (a GPU, the real pair on a CPU core, the prior).
#[test]
fn drafts_that_cannot_pay_cost_a_fresh_policy_under_three_percent() {
    let t1 = 0.085;
    for slope in [0.05, 0.1, 0.25] {
        let verify = |n: usize| t1 * (1.0 + slope * (n - 1) as f64);
        let mut policy = KPolicy::new(ADAPTIVE_MAX_K);
        // As the engine: a first probe of the model is priced at what opening its session took.
        policy.set_first_probe_cost(0.3);
        let (mut committed, mut seconds, mut drafted) = (0, 0.0, 0);
        for round in 0.. {
            if committed >= 96 {
                break;
            }
            let matched = [2, 3, 5][round % 3];
            let offer = NgramOffer { len: 8, matched };
            let plan = policy.choose(true, 0, offer, 96 - committed);
            let k = plan.k;
            // The draft model: 0.03 s a token behind a free link.
            let draft = match plan.drafter {
                Some(DrafterKind::Model) => 0.03 * k as f64,
                _ => 0.0,
            };
            let v = verify(k + 1);
            seconds += draft + v;
            committed += 1;
            drafted += usize::from(k > 0);
            let costs = RoundCosts {
                drafted: k,
                accepted: 0,
                draft_wall: draft,
                draft_compute: draft,
                verify_wall: v,
                round_wall: draft + v,
                ..RoundCosts::default()
            };
            policy.observe(plan, &costs);
        }
        let ratio = 96.0 * t1 / seconds;
        assert!(
            ratio >= 0.97,
            "slope {slope}: {ratio:.3}× target-only, {drafted} drafted rounds"
        );
    }
}

/// A session whose n-gram rounds ran 4 times slower than predicted (the machine busy) prices
/// n-gram lookup out of its own choices; the next session starts without that, and the model's
/// excess is halved, so neither is shut out of every later session by one session's luck.
#[test]
fn one_sessions_calibration_does_not_shut_a_drafter_out_of_the_next() {
    let mut policy = KPolicy::new(8);
    for _ in 0..20 {
        policy.ngram[2].calibrate(4.0);
        policy.model.calibrate(4.0);
    }
    assert!(policy.ngram[2].calibration > 3.0 && policy.model.calibration > 3.0);
    let next = policy.continued(8);
    assert_eq!(next.ngram[2].calibration, 1.0);
    let excess = policy.model.calibration - 1.0;
    assert!((next.model.calibration - (1.0 + excess / 2.0)).abs() < 1e-12);
}

/// A target whose verify is nearly flat in the block's size (a CPU's first positions) and
/// short n-gram matches accepted half the time: n-gram lookup pays, but at the prior slope
/// (never measured where nothing drafts) its short matches looked as if they could not, and a
/// fresh policy drafted nothing. One n-gram round times the verify of two positions.
#[test]
fn a_fresh_policy_times_a_block_and_drafts_short_matches_on_a_flat_verify() {
    let verify = |n: usize| 0.05 * (1.0 + 0.02 * (n - 1) as f64);
    let mut policy = KPolicy::new(ADAPTIVE_MAX_K);
    let mut uniform = {
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64
        }
    };
    let mut ngram_rounds = 0;
    for _ in 0..200 {
        let plan = policy.choose(false, 0, NgramOffer { len: 1, matched: 2 }, 1000);
        let k = plan.k;
        let accepted = usize::from(k > 0 && uniform() < 0.5);
        ngram_rounds += usize::from(plan.drafter == Some(DrafterKind::Ngram));
        observe_verify(&mut policy, plan, accepted, verify(k + 1));
    }
    assert!(ngram_rounds >= 150, "{ngram_rounds} n-gram rounds of 200");
}

#[test]
fn a_draft_better_on_this_text_than_the_last_grows_k_past_the_block_it_holds() {
    // The real pair in split, roughly: a step of 84 ms, a verify of 2 positions 21 ms more, a
    // draft of 35 ms a token plus 5 ms. A session on prose (α = 0.6) then one on a tool call
    // (α = 0.95) that starts from what the first learnt. Drafts held ready cost nothing, so K
    // stayed at the length of the block drafted ahead, 1, for 50 rounds: position 2's
    // acceptance was the prose's, and no round drafted it (10 rounds of the first 60 at K ≥ 2,
    // against 54 for a fresh session). The guess of the bonus token is position 2's draft.
    let (prose, tool_call) = (
        pair(0.6, 0.035, 0.005, 0.084, 0.25),
        pair(0.95, 0.035, 0.005, 0.084, 0.25),
    );
    let grown = |plans: &[RoundPlan]| plans[..60].iter().filter(|p| p.k >= 2).count();
    let fresh = simulate(tool_call, 60);
    let mut first = KPolicy::new(ADAPTIVE_MAX_K);
    simulate_on(&mut first, prose, 200);
    let continued = simulate_on(&mut first.continued(ADAPTIVE_MAX_K), tool_call, 60);
    assert!(
        2 * grown(&continued) >= grown(&fresh),
        "{:?}",
        continued.iter().map(|p| p.k).collect::<Vec<_>>()
    );
}

/// The draft-node on a machine of its own: the target's step of `step` seconds is as fast
/// beside the draft's background work as alone.
pub(super) fn on_a_machine_of_its_own(policy: &mut KPolicy, step: f64) {
    policy.observe_target_step(false, step);
    policy.observe_target_step(true, step);
}

#[test]
fn a_slow_first_block_does_not_price_ngram_lookup_out_for_good() {
    // Copied text (n-gram lookup right 9 times in 10) on a target whose verify costs 40 ms and
    // 37 % more per position. The first drafted block takes 4 times its cost (a page fault,
    // a step beside them): measured as they were, the verify line through them priced every
    // block out for the rest of the process (1 drafted round of 300 after one slow block).
    let v = |n: usize| 0.040 * (1.0 + 0.37 * (n as f64 - 1.0));
    for slow_blocks in [0, 1] {
        let mut policy = KPolicy::new(ADAPTIVE_MAX_K);
        let offer = NgramOffer { len: 8, matched: 6 };
        let mut uniform = uniform();
        let (mut slow, mut drafted) = (slow_blocks, 0);
        for _ in 0..300 {
            let plan = policy.choose(false, 0, offer, 1000);
            let k = plan.k;
            let accepted = (0..k).take_while(|_| uniform() < 0.9).count();
            let mut wall = v(k + 1);
            if k > 0 {
                drafted += 1;
                if slow > 0 {
                    slow -= 1;
                    wall *= 4.0;
                }
            }
            observe_verify(&mut policy, plan, accepted, wall);
        }
        assert!(
            drafted >= 250,
            "{slow_blocks} slow: {drafted} of 300 rounds drafted"
        );
    }
}
