//! Continuous batching: a forward over the rows of several sequences gives each the logits it
//! gets alone, and verifying the blocks of many sessions in one pass commits, per session, the
//! tokens it commits alone, whoever joins, leaves or sends a bad block, chains and token trees
//! together.

mod common;

use common::*;
use tandem_runtime::quantize::QuantType;
use tandem_runtime::speculative::tree::{DraftTree, TreeLimits};
use tandem_runtime::speculative::{BlockVerified, Drafter, ProposeJob, Verifier, VerifyJob};
use tandem_runtime::{Logits, Model, SamplingParams};

/// A matmul over more rows may sum in another order: logits agree to this much.
const TOLERANCE: f32 = 1e-3;

fn prompts() -> Vec<Vec<u32>> {
    let tok = tokenizer();
    [
        "Once upon a time",
        "The little dog ran to the park and saw a big red ball",
        "Tom",
        "One day, a girl named Sue went to the beach with her mom",
    ]
    .iter()
    .map(|p| tok.encode(p).expect("encode"))
    .collect()
}

fn assert_batch_matches_solo(model: &Model) {
    let prompts = prompts();
    let modes = [Logits::All, Logits::Last, Logits::All, Logits::Last];
    // Solo: each prompt after a shared first token, so that every sequence has a cached past.
    let mut solo = Vec::new();
    for (p, &mode) in prompts.iter().zip(&modes) {
        let mut cache = model.new_cache();
        model
            .forward(&p[..1], &mut cache, Logits::Last)
            .expect("head");
        solo.push(model.forward(&p[1..], &mut cache, mode).expect("solo"));
    }
    let mut caches: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
    for (p, cache) in prompts.iter().zip(&mut caches) {
        model.forward(&p[..1], cache, Logits::Last).expect("head");
    }
    let mut items: Vec<(&[u32], _, Logits)> = prompts
        .iter()
        .zip(caches.iter_mut())
        .zip(&modes)
        .map(|((p, cache), &mode)| (&p[1..], cache, mode))
        .collect();
    let batched = model.forward_batch(&mut items).expect("batch");
    assert_eq!(batched.len(), prompts.len());
    for (i, (b, s)) in batched.iter().zip(&solo).enumerate() {
        assert_eq!(b.len(), s.len(), "sequence {i}: rows");
        for (rb, rs) in b.iter().zip(s) {
            let diff = max_diff(rb, rs);
            assert!(diff <= TOLERANCE, "sequence {i}: logits differ by {diff}");
        }
    }
    for (p, cache) in prompts.iter().zip(&caches) {
        assert_eq!(cache.len(), p.len(), "each cache advanced by its own block");
    }
}

#[test]
fn a_batched_forward_gives_each_sequence_its_solo_logits() {
    assert_batch_matches_solo(&load(&stories_dir()));
    assert_batch_matches_solo(&load(&stories_gguf(QuantType::Q8_0)));
}

/// One session of the simulation: its own draft and target sides and the committed log.
struct Session {
    drafter: Drafter,
    verifier: Verifier,
    log: Vec<u32>,
    prompt_len: usize,
    max_new: usize,
    k: usize,
    /// Sibling leaves its draft adds (a token tree); 0: chains.
    branches: usize,
    /// Its drafts are replaced by ids outside the vocabulary: every block is refused.
    lying: bool,
}

impl Session {
    fn new(target: &Model, draft: &Model, prompt: &[u32], max_new: usize, k: usize) -> Self {
        let mut drafter = Drafter::new(draft, SamplingParams::greedy());
        drafter.prefill(prompt).expect("draft prefill");
        let mut verifier = Verifier::new(target, SamplingParams::greedy());
        verifier.prefill(prompt).expect("target prefill");
        Self {
            drafter,
            verifier,
            log: prompt.to_vec(),
            prompt_len: prompt.len(),
            max_new,
            k,
            branches: 0,
            lying: false,
        }
    }

    fn done(&self) -> bool {
        self.log.len() - self.prompt_len >= self.max_new
    }
}

/// Target-only greedy continuation of `prompt`.
fn target_only(target: &Model, prompt: &[u32], max_new: usize) -> Vec<u32> {
    let mut verifier = Verifier::new(target, SamplingParams::greedy());
    verifier.prefill(prompt).expect("prefill");
    let mut log = prompt.to_vec();
    while log.len() - prompt.len() < max_new {
        let v = verifier.verify(&log, &[], &[], 0).expect("step");
        log.push(v.verdict.next);
    }
    log
}

#[test]
fn batched_verification_commits_what_each_session_commits_alone() {
    let target = load(&stories_dir());
    // A Q4_0 draft: wrong often enough that trees commit siblings.
    let draft = load(&stories_gguf(QuantType::Q4_0));
    let vocab = target.config().vocab_size as u32;
    let prompts = prompts();
    // Sessions of different lengths and K, joining at different rounds; two send trees, one
    // lies.
    let plan: Vec<(usize, usize, usize)> = vec![(0, 40, 4), (0, 25, 2), (3, 30, 8), (6, 20, 1)];
    let mut waiting: Vec<(usize, usize, Session)> = plan
        .iter()
        .zip(&prompts)
        .enumerate()
        .map(|(i, (&(join, max_new, k), p))| {
            (i, join, Session::new(&target, &draft, p, max_new, k))
        })
        .collect();
    waiting[3].2.lying = true;
    waiting[0].2.branches = 3;
    waiting[2].2.branches = 2;
    let limits = TreeLimits {
        max_nodes: 16,
        max_depth: 16,
    };
    let (mut mixed_batches, mut sibling_hits) = (0, 0);
    let mut active: Vec<(usize, Session)> = Vec::new();
    let mut finished: Vec<(usize, Session)> = Vec::new();
    let mut refusals = 0;
    let mut widest = 0;
    for round in 0.. {
        // Sessions join between rounds...
        let (joining, rest): (Vec<_>, Vec<_>) =
            waiting.into_iter().partition(|(_, join, _)| *join <= round);
        waiting = rest;
        active.extend(joining.into_iter().map(|(i, _, s)| (i, s)));
        if active.is_empty() && waiting.is_empty() {
            break;
        }
        // ...draft alone, and are verified together.
        let mut blocks = Vec::new();
        for (_, s) in &mut active {
            let room = s.max_new - (s.log.len() - s.prompt_len) - 1;
            let k = s.k.min(room);
            let mut job = [ProposeJob {
                drafter: &mut s.drafter,
                log: &s.log,
                k,
                branches: s.branches.min(k),
                min_confidence: 0.0,
            }];
            let mut p = Drafter::propose_batch(&mut job)
                .pop()
                .expect("one")
                .expect("propose");
            if s.lying {
                p.tokens.iter_mut().for_each(|t| *t = vocab + 7);
            }
            let tree = (!p.parents.is_empty())
                .then(|| DraftTree::new(&p.tokens, &p.parents, limits).expect("a tree"));
            blocks.push((p, tree));
        }
        let mut jobs: Vec<VerifyJob<'_>> = active
            .iter_mut()
            .zip(&blocks)
            .map(|((_, s), (p, tree))| VerifyJob {
                verifier: &mut s.verifier,
                log: &s.log,
                drafts: &p.tokens,
                q: &p.q,
                max_drafts: 16,
                refused: None,
                tree: tree.as_ref(),
            })
            .collect();
        widest = widest.max(jobs.len());
        let trees = jobs.iter().filter(|j| j.tree.is_some()).count();
        mixed_batches += usize::from(trees > 0 && jobs.len() > trees);
        let results = Verifier::verify_batch(&mut jobs);
        drop(jobs);
        for (((_, s), (p, tree)), r) in active.iter_mut().zip(&blocks).zip(results) {
            let committed = match r.expect("verified") {
                BlockVerified::Chain(v) => {
                    assert!(tree.is_none(), "a tree's block got a chain's verdict");
                    refusals += usize::from(v.refused.is_some());
                    let drafts = if v.refused.is_some() {
                        &[][..]
                    } else {
                        &p.tokens
                    };
                    v.verdict.committed(drafts)
                }
                BlockVerified::Tree(t) => {
                    assert!(tree.is_some(), "a chain's block got a tree's verdict");
                    // The chain's drafts come first (node i the child of node i - 1), then the
                    // siblings.
                    let chain = (p.parents.iter().enumerate())
                        .take_while(|&(i, &parent)| parent as usize == i)
                        .count();
                    sibling_hits += usize::from(t.verdict.path.iter().any(|&n| n >= chain));
                    t.committed
                }
            };
            // A greedy tree may reach past K (its K + B likeliest nodes): what is past the
            // session's room is dropped, as a transcript drops it.
            let room = s.max_new - (s.log.len() - s.prompt_len);
            s.log.extend(committed.into_iter().take(room));
        }
        // ...and leave when done.
        let (done, going): (Vec<_>, Vec<_>) = active.into_iter().partition(|(_, s)| s.done());
        finished.extend(done);
        active = going;
    }
    assert_eq!(widest, 4, "all four sessions shared a batch at some point");
    assert!(mixed_batches > 0, "trees and chains shared a batch");
    assert!(sibling_hits > 0, "a tree committed a sibling");
    assert!(refusals > 0, "the lying session's blocks were refused");
    assert_eq!(finished.len(), prompts.len());
    for (i, s) in &finished {
        let expected = target_only(&target, &prompts[*i], s.max_new);
        assert_eq!(s.log, expected, "session {i}");
    }
}

#[test]
fn a_block_that_cannot_run_fails_alone() {
    let model = load(&stories_dir());
    let limit = model.config().max_context;
    let prompts = prompts();
    let mut ok = Verifier::new(&model, SamplingParams::greedy());
    ok.prefill(&prompts[0]).expect("prefill");
    let mut full = Verifier::new(&model, SamplingParams::greedy());
    let long: Vec<u32> = prompts[1].iter().copied().cycle().take(limit).collect();
    full.prefill(&long).expect("prefill to the limit");
    let over: Vec<u32> = long.iter().copied().chain([5, 6]).collect();
    let mut jobs = vec![
        VerifyJob {
            verifier: &mut full,
            log: &over,
            drafts: &[9],
            q: &[],
            max_drafts: 8,
            refused: None,
            tree: None,
        },
        VerifyJob {
            verifier: &mut ok,
            log: &prompts[0],
            drafts: &[],
            q: &[],
            max_drafts: 8,
            refused: None,
            tree: None,
        },
    ];
    let results = Verifier::verify_batch(&mut jobs);
    let err = results[0].as_ref().expect_err("over the context");
    assert!(err.to_string().contains("exceeds the context"), "{err}");
    let alone = target_only(&model, &prompts[0], 1);
    let Ok(BlockVerified::Chain(v)) = &results[1] else {
        panic!("the other job runs: {:?}", results[1]);
    };
    assert_eq!(v.verdict.next, alone[prompts[0].len()]);
}

#[test]
fn batched_draft_steps_propose_what_each_drafter_proposes_alone() {
    let model = load(&stories_dir());
    let prompts = prompts();
    let params = |i: usize| {
        if i.is_multiple_of(2) {
            SamplingParams::greedy()
        } else {
            SamplingParams {
                temperature: 0.8,
                seed: i as u64,
                ..SamplingParams::default()
            }
        }
    };
    let new = |i: usize| {
        let mut d = Drafter::new(&model, params(i));
        d.prefill(&prompts[i][..2]).expect("prefill");
        d
    };
    let mut batched: Vec<Drafter> = (0..prompts.len()).map(new).collect();
    let mut alone: Vec<Drafter> = (0..prompts.len()).map(new).collect();
    // Steps of different K (a catch-up among them) over logs of different lengths, twice: the
    // second round starts from caches the first left.
    for ks in [[4, 0, 7, 1], [2, 5, 0, 3]] {
        let mut jobs: Vec<ProposeJob<'_>> = batched
            .iter_mut()
            .zip(&prompts)
            .zip(ks)
            .map(|((drafter, log), k)| ProposeJob {
                drafter,
                log,
                k,
                branches: 0,
                min_confidence: 0.0,
            })
            .collect();
        let together = Drafter::propose_batch(&mut jobs);
        drop(jobs);
        for (i, (got, k)) in together.into_iter().zip(ks).enumerate() {
            let got = got.expect("proposed");
            let want = alone[i].propose(&prompts[i], k).expect("proposed alone");
            assert_eq!(got.tokens, want.tokens, "drafter {i}, K = {k}");
            assert_eq!(got.tokens.len(), k);
            assert_eq!(batched[i].cached_tokens(), alone[i].cached_tokens());
        }
    }
}

#[test]
fn prompts_prefilled_together_give_each_sequence_its_own_prefill() {
    let model = load(&stories_dir());
    let prompts = prompts();
    let heads: usize = prompts.iter().map(|p| p.len() - 1).sum();
    let mut together: Vec<Drafter> = prompts
        .iter()
        .map(|_| Drafter::new(&model, SamplingParams::greedy()))
        .collect();
    // At most 10 tokens a pass, the least left first: every pass feeds 10 but the last, each
    // sequence is complete once its whole head is fed, and the first pass completes the short
    // prompts that fit in it whatever their place (the long ones come first in `prompts`).
    let mut by_length: Vec<usize> = (0..prompts.len()).collect();
    by_length.sort_by_key(|&i| prompts[i].len());
    let mut fits = Vec::new();
    let mut sum = 0;
    for &i in &by_length {
        sum += prompts[i].len() - 1;
        if sum <= 10 {
            fits.push(i);
        }
    }
    assert!(
        fits.contains(&2) && !fits.contains(&1),
        "{fits:?}: a short prompt after a long one"
    );
    let mut passes = 0;
    loop {
        let before: usize = together.iter().map(|d| d.cached_tokens()).sum();
        let mut items: Vec<(&mut tandem_runtime::SequenceState, &[u32])> = together
            .iter_mut()
            .zip(&prompts)
            .map(|(d, p)| (&mut **d, p.as_slice()))
            .collect();
        let done = tandem_runtime::SequenceState::prefill_batch(&mut items, 10);
        drop(items);
        let fed = together.iter().map(|d| d.cached_tokens()).sum::<usize>() - before;
        passes += 1;
        if passes == 1 {
            for &i in &fits {
                assert!(
                    *done[i].as_ref().expect("prefilled"),
                    "prompt {i} after one pass"
                );
            }
        }
        for ((d, p), done) in together.iter().zip(&prompts).zip(&done) {
            let complete = d.cached_tokens() == p.len() - 1;
            assert_eq!(*done.as_ref().expect("prefilled"), complete);
        }
        if done.iter().all(|d| *d.as_ref().expect("prefilled")) {
            assert_eq!(
                fed,
                heads - 10 * (passes - 1),
                "the last pass feeds the rest"
            );
            break;
        }
        assert_eq!(fed, 10, "pass {passes}");
    }
    assert_eq!(passes, heads.div_ceil(10));
    for (i, (d, p)) in together.iter_mut().zip(&prompts).enumerate() {
        let mut alone = Drafter::new(&model, SamplingParams::greedy());
        alone.prefill(p).expect("prefill alone");
        assert_eq!(d.cached_tokens(), alone.cached_tokens(), "sequence {i}");
        let got = d.propose(p, 6).expect("proposed");
        let want = alone.propose(p, 6).expect("proposed alone");
        assert_eq!(got.tokens, want.tokens, "sequence {i}");
    }
}
