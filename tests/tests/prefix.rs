//! Prefix caching on both nodes (issue 30): a chat's next turn starts with what the last turn's
//! sessions computed, on the target-node and on the draft-node, and answers exactly as without
//! the cache (greedy and seeded sampled); a cache under a small budget evicts and still answers
//! the same.

use std::time::{Duration, Instant};

use tandem_node::{LimitsArgs, NodeState};
use tandem_proto::v1;
use tandem_runtime::SamplingParams;
use tandem_tests::*;

/// Waits until `node`'s prefix cache holds more than `entries` entries (a session's prompt
/// goes there once prefilled, before it answers).
async fn cached(node: &NodeState, entries: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while node.prefixes.entries() <= entries {
        assert!(
            Instant::now() < deadline,
            "no prompt reached the prefix cache"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until `node`'s prefix cache holds at least the first `n` tokens of `tokens`: an ended
/// session's whole cache goes there when its stream ends, after the generation has returned.
async fn holds(node: &NodeState, tokens: &[u32], n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while node
        .prefixes
        .lookup(tokens)
        .is_none_or(|(_, common)| common < n)
    {
        assert!(
            Instant::now() < deadline,
            "the ended session's cache never reached the prefix cache"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Three turns of a chat, each prompt the last one, its answer and more text; the answers.
async fn chat(limits: &LimitsArgs, sampling: &SamplingParams) -> (Vec<Vec<u32>>, [u64; 2]) {
    let served = cluster(&stories(), Some(&stories_q8()), limits).await;
    let engine = patient_engine(&served, 4).await;
    let tok = tokenizer(&stories());
    let mut prompt = tok.encode("Once upon a time").expect("encode");
    let mut answers = Vec::new();
    let draft = served.draft.as_ref().expect("a draft-node");
    for turn in ["Then", "The next day", "In the end"] {
        let asked = prompt.len();
        let req = v1::GenerateRequest {
            draft_tokens: Some(4),
            ..request(&prompt, 48, 4, sampling)
        };
        let out = generate(&engine, &req).await;
        assert!(out.stats.base.drafted > 0, "the draft drafted");
        prompt.extend_from_slice(&out.token_ids);
        prompt.extend(tok.encode_raw(&format!(" {turn}")).expect("encode"));
        answers.push(out.token_ids);
        if limits.prefix_cache_bytes != Some(0) {
            // Past this turn's prompt (which the cache held from the session's start).
            holds(&served.target, &prompt, asked).await;
            holds(draft, &prompt, asked).await;
        }
    }
    let hits = |n: &NodeState| n.metrics.prefix_cache_hits.get();
    (answers, [hits(&served.target), hits(draft)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_turn_starts_with_the_last_and_answers_as_without_the_cache() {
    let off = LimitsArgs {
        prefix_cache_bytes: Some(0),
        ..LimitsArgs::default()
    };
    let sampled = SamplingParams {
        temperature: 0.8,
        seed: 7,
        ..SamplingParams::greedy()
    };
    for sampling in [SamplingParams::greedy(), sampled] {
        let (with, hits) = chat(&LimitsArgs::default(), &sampling).await;
        let (without, none) = chat(&off, &sampling).await;
        assert_eq!(with, without, "T = {}", sampling.temperature);
        assert_eq!(none, [0, 0], "no cache, no hits");
        // Turns 2 and 3 each start with at least the last turn's prompt and answer.
        let least = (4 + 48) + (4 + 48 + 48);
        for (node, hit) in ["target", "draft"].iter().zip(hits) {
            assert!(hit >= least as u64, "{node}: {hit} tokens from the cache");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_budget_evicts_and_answers_the_same() {
    let per_position = load(&stories()).new_cache().bytes_per_position();
    // Room for about one turn's cache (its storage is allocated by doubling, from 64).
    let small = LimitsArgs {
        prefix_cache_bytes: Some(300 * per_position as u64),
        ..LimitsArgs::default()
    };
    let served = cluster(&stories(), Some(&stories_q8()), &small).await;
    let engine = patient_engine(&served, 4).await;
    let tok = tokenizer(&stories());
    let greedy = SamplingParams::greedy();
    let prompts = [
        "Once upon a time",
        "One day, a little",
        "There was a big",
        "Lily",
    ];
    for text in prompts {
        let prompt = tok.encode(text).expect("encode");
        let entries = served.target.prefixes.entries();
        let evicted = served.target.prefixes.evicted_bytes();
        let out = generate(&engine, &request(&prompt, 64, 4, &greedy)).await;
        let alone = in_process(&stories(), None, &request(&prompt, 64, 0, &greedy));
        assert_eq!(out.token_ids, alone.token_ids, "{text:?}");
        // Kept, or another dropped to keep it.
        let deadline = Instant::now() + Duration::from_secs(60);
        while served.target.prefixes.entries() <= entries
            && served.target.prefixes.evicted_bytes() == evicted
        {
            assert!(
                Instant::now() < deadline,
                "{text:?} never reached the cache"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(served.target.prefixes.bytes() <= 300 * per_position);
    }
    assert!(
        served.target.prefixes.evicted_bytes() > 0,
        "something was evicted"
    );
}

/// OpenAI's `usage.prompt_tokens_details.cached_tokens`: none the first time, the prompt (but
/// its last token, which the first step feeds) when it comes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_usage_says_how_much_of_the_prompt_was_cached() {
    let served = cluster(&stories(), Some(&stories_q8()), &LimitsArgs::default()).await;
    let router = router_over(&served, Vec::new()).await;
    let body = serde_json::json!({
        "prompt": "Once upon a time, there was a little girl named Lily. She loved to play",
        "max_tokens": 16, "temperature": 0,
    });
    let mut usages = Vec::new();
    for turn in 0..2 {
        let (status, _, reply) = call(&router, post_json("/v1/completions", &body)).await;
        assert_eq!(status, 200, "{reply}");
        usages.push(reply["usage"].clone());
        if turn == 0 {
            cached(&served.target, 0).await;
        }
    }
    let cached_tokens =
        |u: &serde_json::Value| u["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert_eq!(cached_tokens(&usages[0]), Some(0), "{usages:?}");
    let prompt = usages[1]["prompt_tokens"].as_u64().expect("prompt tokens");
    assert_eq!(cached_tokens(&usages[1]), Some(prompt - 1), "{usages:?}");
}

/// Holds its generation open at its first commit (its replica's count with it) until released.
struct Holding {
    started: Option<tokio::sync::oneshot::Sender<()>>,
    release: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl tandem_coordinator::CommitSink for Holding {
    async fn send(&mut self, _: &tandem_runtime::Commit, _: &[v1::TokenLogprobs]) -> bool {
        if let Some(started) = self.started.take() {
            let _ = started.send(());
        }
        if let Some(release) = self.release.take() {
            let _ = release.await;
        }
        true
    }
}

/// Two replicas of each node: a chat's next turn goes back to the target and the draft that
/// served the last (their caches hold it) though the other pair is less loaded (by one
/// generation, held open there), and only their caches are hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_returns_to_the_replicas_that_hold_it() {
    let limits = LimitsArgs::default();
    let (a, b) = (
        cluster(&stories(), Some(&stories_q8()), &limits).await,
        cluster(&stories(), Some(&stories_q8()), &limits).await,
    );
    let url = |addr: std::net::SocketAddr| format!("http://{addr}");
    let drafts = |c: &tandem_coordinator::LocalCluster| url(c.draft_addr.expect("a draft"));
    let engine = std::sync::Arc::new(
        tandem_coordinator::Engine::connect(
            &[url(b.target_addr), url(a.target_addr)],
            &[drafts(&b), drafts(&a)],
            Some(4),
            &Default::default(),
        )
        .await
        .expect("engine"),
    );
    let tok = tokenizer(&stories());
    let greedy = SamplingParams::greedy();
    // A first prompt of more than one block (16 tokens): what routing remembers.
    let mut prompt = tok
        .encode("Once upon a time, there was a little girl named Lily. She loved to play")
        .expect("encode");
    assert!(prompt.len() > 16);
    let mut held = None;
    for turn in 0..3 {
        let entries = b.target.prefixes.entries();
        let out = generate(&engine, &request(&prompt, 40, 4, &greedy)).await;
        prompt.extend_from_slice(&out.token_ids);
        prompt.extend(tok.encode_raw(" Then").expect("encode"));
        if turn == 2 {
            break;
        }
        cached(&b.target, entries).await;
        if turn == 0 {
            // Another conversation, held open on b (the first listed of two idle pairs): b
            // now carries one generation more than a.
            let (started, on) = tokio::sync::oneshot::channel();
            let (release, released) = tokio::sync::oneshot::channel();
            let other = tok.encode("Lily and Ben went to the park").expect("encode");
            let job = engine
                .prepare(&request(&other, 40, 4, &greedy))
                .expect("job");
            let e = std::sync::Arc::clone(&engine);
            let task = tokio::spawn(async move {
                let mut sink = Holding {
                    started: Some(started),
                    release: Some(released),
                };
                e.generate(&job, &mut sink).await.expect("generated")
            });
            on.await.expect("the other conversation started");
            held = Some((release, task));
        }
    }
    let (release, task) = held.expect("held");
    let _ = release.send(());
    task.await.expect("the other conversation");
    let hits = |c: &tandem_coordinator::LocalCluster| {
        let draft = c.draft.as_ref().expect("a draft");
        [
            c.target.metrics.prefix_cache_hits.get(),
            draft.metrics.prefix_cache_hits.get(),
        ]
    };
    let [target, draft] = hits(&b);
    assert!(
        target > 0 && draft > 0,
        "b's caches were hit: {target}, {draft}"
    );
    assert_eq!(hits(&a), [0, 0], "a never saw the chat");
    assert_eq!(
        a.target.metrics.sessions_opened.get(),
        0,
        "nor anything else"
    );
}
