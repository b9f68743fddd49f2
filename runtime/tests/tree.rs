//! Token trees in one forward pass (issue 31): every row of a tree sits at the position of its
//! depth and attends to the cache and its own path, so its logits are those of its path fed
//! alone, bit for bit; keeping one path of the tree's keys and values leaves the cache as if
//! that path had been fed as a chain.

mod common;

use common::*;
use tandem_runtime::quantize::QuantType;
use tandem_runtime::{KvCache, Logits, Model};

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// A cache holding `tokens`, computed in one block.
fn holding(model: &Model, tokens: &[u32]) -> KvCache {
    let mut cache = model.new_cache();
    model
        .forward(tokens, &mut cache, Logits::Last)
        .expect("forward");
    cache
}

/// A cache holding `tokens`, its first 12 a shared prefix (read in pieces).
fn sharing(model: &Model, tokens: &[u32]) -> KvCache {
    let prefix = holding(model, &tokens[..12])
        .into_prefix(&tokens[..12])
        .expect("a prefix");
    let mut cache = model.new_cache();
    cache.attach(&prefix).expect("attach");
    model
        .forward(&tokens[12..], &mut cache, Logits::Last)
        .expect("forward");
    cache
}

/// `prompt` and `n` tokens of the model's greedy decoding after it, by plain target steps.
fn greedy(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    use tandem_runtime::{SamplingParams, Verifier};
    let mut plain = Verifier::new(model, SamplingParams::greedy());
    plain.prefill(prompt).expect("prefill");
    let mut tokens = prompt.to_vec();
    for _ in 0..n {
        let v = plain.verify(&tokens, &[], &[], 0).expect("step");
        tokens.push(v.verdict.next);
    }
    tokens
}

/// Row i's path (its ancestors and itself, root first).
fn path(parents: &[Option<usize>], i: usize) -> Vec<usize> {
    let mut path = vec![i];
    while let Some(p) = parents[*path.last().expect("a row")] {
        path.push(p);
    }
    path.reverse();
    path
}

/// A cache holding the given tokens, made one way or another.
type Start = fn(&Model, &[u32]) -> KvCache;

/// Both models (f32 and its Q8_0 copy), each with a cache computed in one block and one that
/// starts with a shared prefix.
fn models_and_starts() -> Vec<(Model, Start)> {
    [load(&stories_dir()), load(&stories_gguf(QuantType::Q8_0))]
        .into_iter()
        .flat_map(|m| [(m.clone(), holding as Start), (m, sharing)])
        .collect()
}

/// Each of a tree's `rows` of logits is its path's fed alone after `prefix`, bit for bit.
fn assert_rows_are_paths<'a>(
    model: &Model,
    prefix: &[u32],
    (tokens, parents): (&[u32], &[Option<usize>]),
    rows: impl Iterator<Item = &'a Vec<f32>>,
) {
    for (i, row) in rows.enumerate() {
        let fed: Vec<u32> = path(parents, i).iter().map(|&r| tokens[r]).collect();
        let mut alone = holding(model, prefix);
        let want = model
            .forward(&fed, &mut alone, Logits::Last)
            .expect("forward");
        assert!(same_bits(row, &want[0]), "row {i}: {fed:?}");
    }
}

/// Keeping `kept` of the tree's rows (after the story's first 20 tokens: the story's own path)
/// leaves the cache as if they had been fed as a chain: decoding the story on from there gives
/// its fresh logits.
fn assert_kept_as_chain(model: &Model, mut cache: KvCache, kept: &[usize]) {
    let story = story_tokens();
    let at = 20 + kept.len();
    cache.keep_rows(20, kept).expect("keep");
    assert_eq!(cache.len(), at);
    let on = model
        .forward(&story[at..30], &mut cache, Logits::All)
        .expect("forward");
    let fresh = fresh_logits(model, &story[..30]);
    for (got, want) in on.iter().zip(&fresh[at..]) {
        assert!(same_bits(got, want), "after keeping the path");
    }
}

#[test]
fn each_row_of_a_tree_gets_its_paths_logits_and_one_path_is_kept() {
    let story = story_tokens();
    let (prefix, next) = (&story[..20], &story[20..30]);
    for (model, start) in models_and_starts() {
        // The last committed token, then two candidates for each of two depths, and the
        // story's own continuation down one path: rows 0, 1, 3, 6.
        let tokens = [next[0], next[1], 77, next[2], 91, 120, next[3]];
        let parents = [None, Some(0), Some(0), Some(1), Some(1), Some(2), Some(3)];
        let mut cache = start(&model, prefix);
        let tree = model
            .forward_tree(&tokens, &parents, &mut cache)
            .expect("a tree");
        assert_eq!((tree.len(), cache.len()), (7, 27));
        assert_rows_are_paths(&model, prefix, (&tokens, &parents), tree.iter());
        assert_kept_as_chain(&model, cache, &[0, 1, 3, 6]);
    }
}

/// A tree grown over several forward passes (as a draft grows one): the second pass's rows
/// hang under rows the first fed, and each gets its path's logits; one path is kept after.
#[test]
fn a_tree_grown_over_two_passes_is_one_tree() {
    let story = story_tokens();
    let (prefix, next) = (&story[..20], &story[20..30]);
    for (model, start) in models_and_starts() {
        // Pass one: the story's next token and another beside it. Pass two: a child of each,
        // and a grandchild of the story's path (rows 0, 2, 4 are the story).
        let tokens = [next[0], 77, next[1], 91, next[2]];
        let parents = [None, None, Some(0), Some(1), Some(2)];
        let mut cache = start(&model, prefix);
        let first = model
            .forward_tree(&tokens[..2], &parents[..2], &mut cache)
            .expect("pass one");
        let second = model
            .forward_tree(&tokens[2..], &parents, &mut cache)
            .expect("pass two");
        assert_eq!((second.len(), cache.len()), (3, 25));
        let rows = first.iter().chain(&second);
        assert_rows_are_paths(&model, prefix, (&tokens, &parents), rows);
        assert_kept_as_chain(&model, cache, &[0, 2, 4]);
        // Parents that name more cached rows than the cache holds are refused.
        let mut short = holding(&model, &prefix[..1]);
        let too_many = vec![None; 3];
        assert!(
            model
                .forward_tree(&tokens[..1], &too_many, &mut short)
                .is_err()
        );
    }
}

#[test]
fn a_malformed_tree_is_refused_and_the_cache_untouched() {
    let model = load(&stories_dir());
    let story = story_tokens();
    let mut cache = holding(&model, &story[..20]);
    for parents in [
        vec![None, Some(2), Some(0)],
        vec![None, Some(1), Some(0)],
        vec![None, Some(0)],
    ] {
        let refused = model.forward_tree(&story[20..23], &parents, &mut cache);
        assert!(refused.is_err(), "{parents:?}");
        assert_eq!(cache.len(), 20);
    }
    assert!(cache.keep_rows(20, &[1, 0]).is_err(), "not ascending");
    assert!(cache.keep_rows(20, &[0]).is_err(), "past what it holds");
}

/// A verifier decoding with trees commits what it commits with plain steps: greedy, each round
/// a tree with a wrong and a right child at the first depth and a right and a wrong one under
/// the right one (the right path is kept, its cache as a chain's); sampled, a chain given as a
/// tree commits what the chain commits, draw for draw.
#[test]
fn a_verifier_decodes_through_trees_as_through_plain_steps() {
    use tandem_runtime::speculative::tree::{DraftTree, TreeLimits};
    use tandem_runtime::{Distribution, SamplingParams, Verifier};
    let model = load(&stories_dir());
    let prompt = &story_tokens()[..12];
    let limits = TreeLimits {
        max_nodes: 8,
        max_depth: 4,
    };
    let want = greedy(&model, prompt, 30);
    // Each token's log-probabilities as plain steps report them.
    let mut steps = Verifier::new(&model, SamplingParams::greedy());
    steps.report_logprobs(Some(3));
    steps.prefill(prompt).expect("prefill");
    let mut stepped = Vec::new();
    while prompt.len() + stepped.len() < want.len() {
        let log = &want[..prompt.len() + stepped.len()];
        stepped.extend(steps.verify(log, &[], &[], 0).expect("step").logprobs);
    }
    let mut v = Verifier::new(&model, SamplingParams::greedy());
    v.report_logprobs(Some(3));
    v.prefill(prompt).expect("prefill");
    let mut log = prompt.to_vec();
    while log.len() + 3 <= want.len() {
        let (right, next) = (want[log.len()], want[log.len() + 1]);
        let wrong = |t: u32| (t + 1) % 512;
        // prefix ─ wrong
        //        └ right ─ next
        //                └ wrong(next)
        let tree = DraftTree::new(
            &[wrong(right), right, next, wrong(next)],
            &[0, 0, 2, 2],
            limits,
        )
        .expect("tree");
        let q: Vec<Distribution> = tree
            .tokens()
            .iter()
            .map(|&t| Distribution::OneHot(t))
            .collect();
        let verified = v.verify_tree(&log, &tree, &q, 8).expect("verify");
        assert_eq!(verified.verdict.path, [1, 2]);
        // One log-probability per committed token, the plain steps' (the path's rows).
        let at = log.len() - prompt.len();
        assert_eq!(
            verified.logprobs,
            stepped[at..at + verified.committed.len()]
        );
        log.extend_from_slice(&verified.committed);
        assert_eq!(log[..], want[..log.len()]);
    }
    let sampled = SamplingParams {
        temperature: 0.9,
        seed: 5,
        ..SamplingParams::greedy()
    };
    let (mut chain, mut tree_side) = (
        Verifier::new(&model, sampled.clone()),
        Verifier::new(&model, sampled),
    );
    chain.prefill(prompt).expect("prefill");
    tree_side.prefill(prompt).expect("prefill");
    let mut log = prompt.to_vec();
    for round in 0..10 {
        let drafts: Vec<u32> = (0..3).map(|i| want[(round + i) % want.len()]).collect();
        let q: Vec<Distribution> = drafts.iter().map(|&t| Distribution::OneHot(t)).collect();
        let a = chain.verify(&log, &drafts, &q, 8).expect("chain");
        let b = tree_side
            .verify_tree(&log, &DraftTree::chain(&drafts), &q, 8)
            .expect("tree");
        assert_eq!(a.verdict.committed(&drafts), b.committed, "round {round}");
        log.extend_from_slice(&b.committed);
    }
}

/// A greedy drafter asked for K drafts and B more nodes grows a tree of its K + B likeliest
/// nodes (its chain of its own choices first, as long as it is among them, branches where it is
/// least sure, some with drafts of their own), greedy decoding through those trees commits
/// target-only's text, some rounds down a branch, and the draft's cache after each tree (its
/// chain kept) proposes what a fresh draft would.
#[test]
fn a_drafters_trees_decode_as_target_only() {
    use tandem_runtime::speculative::ProposeJob;
    use tandem_runtime::speculative::tree::{DraftTree, TreeLimits};
    use tandem_runtime::{Drafter, SamplingParams, Verifier};
    let target = load(&stories_dir());
    let draft = load(&stories_gguf(QuantType::Q4_0));
    let prompt = &story_tokens()[..8];
    let limits = TreeLimits {
        max_nodes: 16,
        max_depth: 8,
    };
    let want = greedy(&target, prompt, 80);
    let propose = |drafter: &mut Drafter, log: &[u32]| {
        let mut jobs = [ProposeJob {
            drafter,
            log,
            k: 4,
            branches: 4,
            min_confidence: 0.0,
        }];
        Drafter::propose_batch(&mut jobs)
            .remove(0)
            .expect("proposal")
    };
    let mut drafter = Drafter::new(&draft, SamplingParams::greedy());
    let mut verifier = Verifier::new(&target, SamplingParams::greedy());
    verifier.prefill(prompt).expect("prefill");
    let (mut log, mut branch_hits, mut deep_branches) = (prompt.to_vec(), 0, 0);
    while log.len() < want.len() {
        let proposal = propose(&mut drafter, &log);
        let mut fresh = Drafter::new(&draft, SamplingParams::greedy());
        fresh.prefill(&log).expect("prefill");
        assert_eq!(
            proposal,
            propose(&mut fresh, &log),
            "as a fresh draft proposes"
        );
        assert_eq!(
            proposal.tokens.len(),
            8,
            "the budget: four drafts and four more"
        );
        // Where the draft is sure its likeliest nodes are one path: a chain.
        let tree = match proposal.parents.is_empty() {
            true => DraftTree::chain(&proposal.tokens),
            false => DraftTree::new(&proposal.tokens, &proposal.parents, limits).expect("a tree"),
        };
        assert_eq!(tree.parent(0), None, "the chain first");
        assert!(tree.max_depth() <= 8, "no deeper than its nodes");
        let chain = (0..tree.len())
            .take_while(|&i| tree.parent(i) == i.checked_sub(1))
            .count();
        deep_branches += usize::from((chain..tree.len()).any(|i| tree.parent(i) >= Some(chain)));
        let v = verifier
            .verify_tree(&log, &tree, &proposal.q, 16)
            .expect("verify");
        assert!(v.refused.is_none(), "{:?}", v.refused);
        branch_hits += usize::from(v.verdict.path.iter().any(|&n| n >= chain));
        log.extend(&v.committed);
    }
    log.truncate(want.len());
    assert_eq!(log, want);
    assert!(branch_hits > 0, "no branch was ever right");
    assert!(deep_branches > 0, "no branch had drafts of its own");
}

/// Sampled speculation through the draft's grown trees (temperature 1, a low-acceptance pair:
/// many rejections, so residuals after rejected siblings are drawn from): the first generated
/// token follows the target's p exactly, and the second, given the most frequent first, its
/// conditional p; the trees branch at the first depth and at the second, and paths down a
/// branch commit.
#[test]
fn sampled_trees_follow_the_target_distribution() {
    use tandem_runtime::speculative::ProposeJob;
    use tandem_runtime::speculative::tree::{DraftTree, TreeLimits};
    use tandem_runtime::{Drafter, SamplingParams, Verifier};
    let (target, draft) = (load(&tiny_random(21)), load(&tiny_random(22)));
    let prompt = tokenizer().encode("Once upon a time").expect("encode");
    let limits = TreeLimits {
        max_nodes: 8,
        max_depth: 4,
    };
    let (mut pairs, mut later_branches, mut branch_paths) = (Vec::new(), 0, 0);
    for seed in 0..12_000u64 {
        let sampling = SamplingParams {
            temperature: 1.0,
            seed,
            ..Default::default()
        };
        let mut drafter = Drafter::new(&draft, sampling.clone());
        let mut verifier = Verifier::new(&target, sampling);
        verifier.prefill(&prompt).expect("prefill");
        let mut log = prompt.clone();
        while log.len() < prompt.len() + 2 {
            let mut jobs = [ProposeJob {
                drafter: &mut drafter,
                log: &log,
                k: 2,
                branches: 2,
                min_confidence: 0.0,
            }];
            let proposal = Drafter::propose_batch(&mut jobs)
                .remove(0)
                .expect("proposal");
            let tree = DraftTree::new(&proposal.tokens, &proposal.parents, limits).expect("a tree");
            let branching = |depth: usize| {
                (0..tree.len())
                    .filter(|&n| tree.depth(n) == depth - 1)
                    .any(|n| tree.children(Some(n)).count() > 1)
            };
            later_branches += usize::from(branching(2));
            let v = verifier
                .verify_tree(&log, &tree, &proposal.q, 8)
                .expect("verify");
            branch_paths += usize::from(v.verdict.path.iter().any(|&n| n >= 2));
            log.extend(&v.committed);
        }
        pairs.push((log[prompt.len()], log[prompt.len() + 1]));
    }
    assert!(
        later_branches > 100,
        "trees branched past the first depth {later_branches} times"
    );
    assert!(
        branch_paths > 100,
        "paths went down a branch {branch_paths} times"
    );
    let sampling = SamplingParams {
        temperature: 1.0,
        ..Default::default()
    };
    let exact = |context: &[u32]| target_distribution(&target, &sampling, context);
    assert_first_two_follow(&pairs, &prompt, exact, "sampled trees");
}
