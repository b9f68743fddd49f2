//! Prefix caching on both nodes (issue 30): a chat's next turn starts with what the last turn's
//! sessions computed, on the target-node and on the draft-node, and answers exactly as without
//! the cache (greedy and seeded sampled); a cache under a small budget evicts and still answers
//! the same.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_coordinator::Engine;

use tandem_node::{LimitsArgs, NodeState};
use tandem_proto::v1;
use tandem_runtime::SamplingParams;
use tandem_tests::held::HeldAtFirstCommit;
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
        .lookup(&[], tokens)
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
    let engine = Arc::new(
        Engine::connect(
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
            let other = tok.encode("Lily and Ben went to the park").expect("encode");
            held = Some(HeldAtFirstCommit::start(&engine, &request(&other, 40, 4, &greedy)).await);
        }
    }
    held.expect("held").finish().await;
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

/// 64 sessions whose prompts start with one system prompt, all open at once: the first's
/// prompt is shared as soon as it is prefilled, the other 63 start with it, and the node holds
/// it once (every session reads the same segment; what they hold together is that segment and
/// their own positions, not 64 copies). Each answers as target-only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_sessions_sharing_a_system_prompt_hold_it_once() {
    let served = cluster(&stories(), Some(&stories_q8()), &LimitsArgs::default()).await;
    let engine = Arc::new(patient_engine(&served, 4).await);
    let tok = tokenizer(&stories());
    let system = tok
        .encode(&"Lily and Ben played in the park with a big red ball. ".repeat(12))
        .expect("encode");
    assert!(system.len() >= 150, "{}", system.len());
    let greedy = SamplingParams::greedy();
    let requests: Vec<_> = (0..64)
        .map(|i| {
            let user = tok.encode_raw(&format!(" Story {i}:")).expect("encode");
            request(&[system.clone(), user].concat(), 8, 4, &greedy)
        })
        .collect();
    let held = HeldAtFirstCommit::start_all(&engine, &requests).await;
    let draft = served.draft.as_ref().expect("a draft-node");
    assert!(
        eventually(async || draft.sessions.active() == 64).await,
        "all 64 open on the draft-node too"
    );
    let per = load(&stories()).new_cache().bytes_per_position();
    let copies = 64 * system.len() * per;
    for (name, node) in [("target", &served.target), ("draft", draft)] {
        assert_eq!(node.sessions.active(), 64, "{name}");
        assert_eq!(
            node.sessions.read_segments().len(),
            1,
            "{name}: every session reads the one published prompt"
        );
        let holding = node.sessions.kv_bytes();
        assert!(
            holding * 3 < copies,
            "{name}: {holding} bytes held by 64 sessions, 64 copies of the system prompt {copies}"
        );
        assert!(
            node.metrics.prefix_cache_hits.get() >= 63 * system.len() as u64,
            "{name}: the system prompt reused 63 times"
        );
    }
    let tandem_model = load(&stories());
    for (req, h) in requests.iter().zip(held) {
        let out = h.finish().await;
        assert!(out.stats.cached_tokens as usize >= system.len() || req == &requests[0]);
        let alone = in_process_with(
            &tandem_model,
            None,
            &tok,
            &request(&req.prompt_tokens, 8, 0, &greedy),
        );
        assert_eq!(out.token_ids, alone.token_ids);
    }
}

/// A small prefix cache evicts while sessions are live: what an open session reads stays (it
/// costs the cache nothing), the finished sessions' caches go least recently used first, and a
/// session that shares the start of a live one's prompt and diverges answers as target-only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_while_sessions_live_keeps_what_they_read() {
    let per = load(&stories()).new_cache().bytes_per_position();
    let small = LimitsArgs {
        prefix_cache_bytes: Some(200 * per as u64),
        ..LimitsArgs::default()
    };
    let served = cluster(&stories(), Some(&stories_q8()), &small).await;
    let engine = Arc::new(patient_engine(&served, 4).await);
    let tok = tokenizer(&stories());
    let greedy = SamplingParams::greedy();
    let text = |t: &str| tok.encode(t).expect("encode");
    let live = text(&"Once upon a time there was a kind old dog. ".repeat(5));
    assert!(live.len() > 48, "{}", live.len());
    let held = HeldAtFirstCommit::start(&engine, &request(&live, 24, 4, &greedy)).await;
    let target = &served.target;
    let mut outcomes = Vec::new();
    for (i, other) in ["Tom had a red car.", "The sun was hot.", "A bird sang."]
        .iter()
        .enumerate()
    {
        let prompt = text(&other.repeat(10 + i));
        let out = generate(&engine, &request(&prompt, 64, 4, &greedy)).await;
        holds(
            target,
            &[prompt.clone(), out.token_ids.clone()].concat(),
            prompt.len(),
        )
        .await;
        outcomes.push((prompt, out));
    }
    assert!(
        target.prefixes.evicted_bytes() > 0,
        "the small cache evicted"
    );
    assert!(target.prefixes.bytes() <= 200 * per);
    // Shares the live session's first 48 tokens, then differs.
    let diverging = [&live[..48], &text("Then a cat came by.")[1..]].concat();
    let out = generate(&engine, &request(&diverging, 24, 4, &greedy)).await;
    assert!(out.stats.cached_tokens >= 48, "{}", out.stats.cached_tokens);
    outcomes.push((diverging, out));
    outcomes.push((live, held.finish().await));
    let model = load(&stories());
    for (prompt, out) in outcomes {
        let alone = in_process_with(
            &model,
            None,
            &tok,
            &request(&prompt, out.token_ids.len() as u32, 0, &greedy),
        );
        assert_eq!(out.token_ids, alone.token_ids);
    }
}

/// A target-node restarted between turns starts with an empty cache (the next turn reuses
/// nothing there) and answers exactly as before; the turn after reuses its prompt again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_starts_cold_and_answers_the_same() {
    use tandem_tests::faults::FaultProxy;
    use tandem_tests::processes::Proc;
    let target = Proc::node("target-node", &stories(), &[]);
    let gate = FaultProxy::passing(target.addr);
    let gate_url = gate.clone().serve().await;
    let draft = Proc::node("draft-node", &stories_q8(), &[]);
    let http = ["--http-listen", "127.0.0.1:0"];
    let coordinator = Proc::coordinator(&gate_url, &draft.url(), &http, None);
    let body = serde_json::json!({
        "prompt": "Once upon a time, there was a little girl named Lily. She loved to play",
        "max_tokens": 24, "temperature": 0,
    })
    .to_string();
    let turn = async || {
        let (status, reply) =
            http_request(coordinator.http(), "POST", "/v1/completions", &body).await;
        assert_eq!(status, 200, "{reply}");
        let reply: serde_json::Value = serde_json::from_str(&reply).expect("JSON");
        let usage = &reply["usage"];
        (
            reply["choices"][0]["text"].clone(),
            usage["prompt_tokens"].as_u64().expect("prompt tokens"),
            usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
        )
    };
    let (first, prompt, cold) = turn().await;
    assert_eq!(cold, Some(0));
    let (again, _, warm) = turn().await;
    assert_eq!((&again, warm), (&first, Some(prompt - 1)), "reused");
    // SIGKILL, and a new process where the old one was reached.
    drop(target);
    let restarted = Proc::node("target-node", &stories(), &[]);
    gate.upstream.point_to(restarted.addr);
    let (after, _, restarted_cold) = turn().await;
    assert_eq!(
        (&after, restarted_cold),
        (&first, Some(0)),
        "nothing cached there"
    );
    let (last, _, warm_again) = turn().await;
    assert_eq!((&last, warm_again), (&first, Some(prompt - 1)));
}

/// OpenAI's `n`: the choices of one prompt share it (the first's prompt prefilled once on each
/// node, the others starting with it); choice i is seeded `seed + i` and equals a request of
/// that seed alone; streamed, the same texts come under each choice's index, each with its own
/// end, and the usage counts every choice's tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_share_their_prompt() {
    let served = cluster(&stories(), Some(&stories_q8()), &LimitsArgs::default()).await;
    let router = router_over(&served, Vec::new()).await;
    let draft = served.draft.as_ref().expect("a draft-node");
    let body = |n: u32, seed: u64, stream: bool| {
        let mut body = serde_json::json!({
            "prompt": "Once upon a time, there was a little girl named Lily. She loved to play",
            "max_tokens": 24, "temperature": 0.8, "seed": seed, "n": n, "stream": stream,
        });
        if stream {
            body["stream_options"] = serde_json::json!({"include_usage": true});
        }
        post_json("/v1/completions", &body)
    };
    let hits = |n: &NodeState| n.metrics.prefix_cache_hits.get();
    let before = [hits(&served.target), hits(draft)];
    let (status, _, whole) = call(&router, body(4, 11, false)).await;
    assert_eq!(status, 200, "{whole}");
    let prompt = whole["usage"]["prompt_tokens"]
        .as_u64()
        .expect("prompt tokens");
    assert!(prompt > 16, "more than a block: {prompt}");
    for (name, (now, then)) in ["target", "draft"]
        .iter()
        .zip([hits(&served.target), hits(draft)].into_iter().zip(before))
    {
        assert!(
            now - then >= 3 * (prompt - 1),
            "{name}: the 3 other choices start with the first's prompt ({} tokens)",
            now - then
        );
    }
    let choices = whole["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 4, "{whole}");
    let (mut texts, mut tokens) = (Vec::new(), Vec::new());
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i);
        let (status, _, alone) = call(&router, body(1, 11 + i as u64, false)).await;
        assert_eq!(status, 200, "{alone}");
        assert_eq!(choice["text"], alone["choices"][0]["text"], "choice {i}");
        tokens.push(
            alone["usage"]["completion_tokens"]
                .as_u64()
                .expect("tokens"),
        );
        texts.push(choice["text"].as_str().expect("text").to_string());
    }
    assert_eq!(
        whole["usage"]["completion_tokens"],
        tokens.iter().sum::<u64>()
    );
    assert!(
        texts.iter().any(|t| t != &texts[0]),
        "seeded apart: {texts:?}"
    );
    let streamed = events(&router, body(3, 11, true)).await;
    let mut pieces = vec![String::new(); 3];
    let mut ends = [0; 3];
    for event in &streamed {
        for choice in event["choices"].as_array().expect("choices") {
            let i = choice["index"].as_u64().expect("index") as usize;
            pieces[i].push_str(choice["text"].as_str().expect("text"));
            ends[i] += usize::from(!choice["finish_reason"].is_null());
        }
    }
    assert_eq!(pieces, texts[..3], "streamed as whole");
    assert_eq!(ends, [1; 3], "one end each");
    let usage = &streamed.last().expect("events")["usage"];
    assert_eq!(usage["completion_tokens"], tokens[..3].iter().sum::<u64>());
    let (status, _, refused) = call(&router, body(17, 11, false)).await;
    assert_eq!(
        (status, &refused["error"]["param"]),
        (400, &serde_json::json!("n"))
    );
}
