//! Shared KV prefixes (issue 30): a cache that starts with another sequence's positions, shared
//! read-only, gives the logits of computing them itself, bit for bit (the attention reads the
//! prefix's segments and its own storage as one sequence); rolled back into the prefix, it
//! computes on without touching the prefix, which still serves others the same; chains of
//! prefixes (a chat's turns) read the same, however long; batched sequences sharing a prefix
//! read the same as alone.

mod common;

use common::*;
use tandem_runtime::quantize::QuantType;
use tandem_runtime::{KvCache, KvPrefix, Logits, Model, SamplingParams, Verifier};

fn same_bits(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()))
}

/// A prefix of `tokens`, computed by a cache of its own in chunks of `chunk`.
fn shared(model: &Model, tokens: &[u32], chunk: usize) -> KvPrefix {
    let mut cache = model.new_cache();
    for piece in tokens.chunks(chunk) {
        model
            .forward(piece, &mut cache, Logits::Last)
            .expect("forward");
    }
    cache.share(tokens).expect("share")
}

fn attached(model: &Model, prefix: &KvPrefix) -> KvCache {
    let mut cache = model.new_cache();
    cache.attach(prefix).expect("attach");
    assert_eq!(cache.len(), prefix.len());
    cache
}

fn models() -> Vec<(&'static str, Model)> {
    vec![
        ("stories260K f32", load(&stories_dir())),
        ("stories260K Q8_0", load(&stories_gguf(QuantType::Q8_0))),
    ]
}

#[test]
fn a_cache_starting_with_a_shared_prefix_gives_the_same_logits() {
    let tokens = story_tokens();
    assert!(tokens.len() > 40, "{}", tokens.len());
    for (name, model) in models() {
        let want = fresh_logits(&model, &tokens);
        for (cut, chunk) in [(1, 1), (17, 5), (32, 32)] {
            let prefix = shared(&model, &tokens[..cut], chunk);
            let mut cache = attached(&model, &prefix);
            let got = model
                .forward(&tokens[cut..], &mut cache, Logits::All)
                .expect("forward");
            assert!(
                same_bits(&got, &want[cut..]),
                "{name}: prefix of {cut} in chunks of {chunk}"
            );
            assert_eq!(prefix.segment_bytes(), cut * cache.bytes_per_position());
        }
    }
}

#[test]
fn rolling_back_into_a_shared_prefix_never_touches_it() {
    let tokens = story_tokens();
    let (name, model) = models().remove(0);
    let want = fresh_logits(&model, &tokens);
    let prefix = shared(&model, &tokens[..24], 8);
    let mut a = attached(&model, &prefix);
    model
        .forward(&tokens[24..30], &mut a, Logits::All)
        .expect("forward");
    // Back to 20, inside the shared positions, and on with other tokens there: written to
    // the cache's own storage, not the prefix.
    a.truncate(20).expect("truncate");
    assert_eq!(a.prefix().map(KvPrefix::len), Some(20));
    let other: Vec<u32> = tokens[20..30].iter().map(|t| (t + 7) % 512).collect();
    model.forward(&other, &mut a, Logits::All).expect("forward");
    a.truncate(20).expect("truncate");
    let got = model
        .forward(&tokens[20..], &mut a, Logits::All)
        .expect("forward");
    assert!(same_bits(&got, &want[20..]), "{name}: after the rollback");
    // The prefix serves another cache as before.
    let mut b = attached(&model, &prefix);
    let got = model
        .forward(&tokens[24..], &mut b, Logits::All)
        .expect("forward");
    assert!(same_bits(&got, &want[24..]), "{name}: the prefix unharmed");
    // Back to nothing: an empty cache again, that computes from the start.
    b.truncate(0).expect("truncate");
    assert!(b.prefix().is_none());
    let got = model
        .forward(&tokens, &mut b, Logits::All)
        .expect("forward");
    assert!(same_bits(&got, &want), "{name}: from empty");
}

/// A chat's turns: each turn's cache starts with the last one's prefix and shares itself on,
/// one segment per turn (only its own positions copied), past the number of pieces attention
/// reads (where a chain is copied into one segment).
#[test]
fn chains_of_prefixes_read_as_one_sequence() {
    let (_, model) = models().remove(0);
    let story = story_tokens();
    let tokens: Vec<u32> = story.iter().cycle().take(200).copied().collect();
    let want = fresh_logits(&model, &tokens);
    let mut prefix = shared(&model, &tokens[..2], 2);
    let (mut at, mut flattened) = (2, 0);
    while at < 190 {
        let mut cache = attached(&model, &prefix);
        let step = 1 + at % 3;
        let got = model
            .forward(&tokens[at..at + step], &mut cache, Logits::All)
            .expect("forward");
        assert!(same_bits(&got, &want[at..at + step]), "turn at {at}");
        // As a finished session leaves it (no copy), or shared from a live one (a copy).
        let per = cache.bytes_per_position();
        let next = if at % 2 == 0 {
            cache.into_prefix(&tokens[at..at + step]).expect("a prefix")
        } else {
            cache.share(&tokens[at..at + step]).expect("share")
        };
        assert!(!next.same_segment(&prefix));
        let depth = next.held().len();
        if depth == 1 {
            // Copied into one segment: every position in it.
            flattened += 1;
            assert!(next.segment_bytes() >= (at + step) * per);
        } else {
            assert_eq!(depth, prefix.held().len() + 1, "one segment more");
            assert!(depth < 16, "no more pieces than attention reads");
            if at % 2 == 1 {
                assert_eq!(
                    next.segment_bytes(),
                    step * per,
                    "only the turn's own positions"
                );
            }
        }
        assert_eq!(next.tokens(), tokens[..at + step]);
        prefix = next;
        at += step;
    }
    assert!(
        flattened >= 1,
        "more turns than the pieces attention reads: copied once"
    );
    assert!(flattened <= 16, "{flattened}");
}

#[test]
fn batched_sequences_sharing_a_prefix_read_as_alone() {
    let (_, model) = models().remove(1);
    let tokens = story_tokens();
    let prefix = shared(&model, &tokens[..20], 20);
    let (mut a, mut b) = (attached(&model, &prefix), attached(&model, &prefix));
    let mut fresh = model.new_cache();
    let alone = model
        .forward(&tokens, &mut fresh, Logits::All)
        .expect("forward");
    let other = [tokens[3], tokens[9], tokens[1]];
    let batched = model
        .forward_batch(&mut [
            (&tokens[20..], &mut a, Logits::All),
            (&other[..], &mut b, Logits::All),
        ])
        .expect("batch");
    assert!(same_bits(&batched[0], &alone[20..]));
    let mut c = attached(&model, &prefix);
    let other_alone = model.forward(&other, &mut c, Logits::All).expect("forward");
    assert!(same_bits(&batched[1], &other_alone));
}

/// A verifier started with a shared prefix decodes what one that computed it decodes, and
/// computes only the prompt's tokens after it (or from the first that differs).
#[test]
fn a_verifier_started_with_a_prefix_decodes_the_same() {
    let (_, model) = models().remove(0);
    let tokens = story_tokens();
    let decode = |v: &mut Verifier, prompt: &[u32]| -> Vec<u32> {
        v.prefill(prompt).expect("prefill");
        let mut log = prompt.to_vec();
        for _ in 0..24 {
            let verified = v.verify(&log, &[], &[], 0).expect("verify");
            log.push(verified.verdict.next);
        }
        log[prompt.len()..].to_vec()
    };
    let prompt = &tokens[..30];
    let want = decode(&mut Verifier::new(&model, SamplingParams::greedy()), prompt);
    let mut first = Verifier::new(&model, SamplingParams::greedy());
    first.prefill(&tokens[..20]).expect("prefill");
    let prefix = first.share_prefix().expect("share");
    assert_eq!(
        prefix.len(),
        19,
        "the prefill leaves the last token for the first step"
    );
    let mut v = Verifier::new(&model, SamplingParams::greedy());
    v.start_with(&prefix).expect("start");
    assert_eq!(v.shared_tokens(), 19);
    assert_eq!(decode(&mut v, prompt), want);
    // A prompt that differs inside the prefix: computed from there.
    let mut changed = prompt.to_vec();
    changed[10] = (changed[10] + 1) % 512;
    let want = decode(
        &mut Verifier::new(&model, SamplingParams::greedy()),
        &changed,
    );
    let mut v = Verifier::new(&model, SamplingParams::greedy());
    v.start_with(&prefix).expect("start");
    assert_eq!(decode(&mut v, &changed), want);
    assert_eq!(v.shared_tokens(), 10);
    assert!(
        v.start_with(&prefix).is_err(),
        "only an empty sequence starts with one"
    );
}

/// A live sequence publishes its prompt ([`Verifier::publish`]): it decodes on from the
/// published prefix as it would have, and another sequence started with it (while the first
/// lives, rolls back into it and writes other tokens) decodes the same too.
#[test]
fn a_published_prompt_serves_live_sequences_the_same() {
    let (_, model) = models().remove(1);
    let tokens = story_tokens();
    let prompt = &tokens[..30];
    let decode = |v: &mut Verifier, n: usize| -> Vec<u32> {
        let mut log = prompt.to_vec();
        for _ in 0..n {
            let verified = v.verify(&log, &[], &[], 0).expect("verify");
            log.push(verified.verdict.next);
        }
        log[prompt.len()..].to_vec()
    };
    let mut alone = Verifier::new(&model, SamplingParams::greedy());
    alone.prefill(prompt).expect("prefill");
    let want = decode(&mut alone, 24);
    let mut first = Verifier::new(&model, SamplingParams::greedy());
    first.prefill(prompt).expect("prefill");
    let own = first.cache_bytes();
    let published = first.publish().expect("publish");
    assert_eq!((published.len(), first.shared_tokens()), (29, 29));
    assert_eq!(first.cache_bytes(), 0, "its own storage handed over");
    let per = published.segment_bytes() / 29;
    assert!(
        per * 29 == published.segment_bytes() && per * 30 <= own,
        "copied tight"
    );
    let mut second = Verifier::new(&model, SamplingParams::greedy());
    second.start_with(&published).expect("start");
    assert_eq!(decode(&mut first, 24), want);
    // Back into the published positions and on with other tokens: the prefix untouched.
    let mut other = Verifier::new(&model, SamplingParams::greedy());
    other.start_with(&published).expect("start");
    let odd: Vec<u32> = tokens[..12].iter().map(|t| (t + 5) % 512).collect();
    let mut log = odd.clone();
    other.verify(&log, &[], &[], 0).expect("a rollback to 0");
    log.push(1);
    other.verify(&log, &[], &[], 0).expect("on");
    assert_eq!(decode(&mut second, 24), want);
}
