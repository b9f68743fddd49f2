//! A second tenant probing the prefix cache (issue 51 item 1): with two API keys, tenant B sends
//! the long prompt tenant A sent and is told none of it was cached (`cached_tokens`), while A
//! sending it again, or B its own again, reuses it; keys that give the same `cache_salt` share
//! on purpose, and `--shared-prefix-cache` makes every key one tenant. Every answer is the one
//! the uncached generation gave: the cache changes speed, never output. The three binaries as
//! processes; the draft-node's side in this process, where its cache can be looked in.

use std::net::SocketAddr;

use tandem_coordinator::Discard;
use tandem_coordinator::engine::job::tenant_salt;
use tandem_node::{LimitsArgs, NodeState};
use tandem_proto::v1;
use tandem_tests::processes::Proc;
use tandem_tests::*;

/// Several 16-token blocks of stories260K's tokens.
const STORY: &str = "Once upon a time, there was a little girl named Lily. She loved to play \
     outside in the park with her friends. One day, she saw a big red ball under a tree.";
const OTHER: &str = "Tom had a small dog called Max. Every morning they ran to the river \
     and looked at the fish. One morning the river was full of little boats.";

const KEY_A: &str = "tenant-a-s3cr3t";
const KEY_B: &str = "tenant-b-s3cr3t";

/// What one completion gave: its text, its prompt's tokens, and those the nodes had cached.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Completion {
    text: String,
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// The coordinator's HTTP API over two nodes of its own, keys A and B, `extra` flags.
fn serve(extra: &[&str]) -> (Proc, Proc, Proc) {
    let target = Proc::node("target-node", &stories(), &[]);
    let draft = Proc::node("draft-node", &stories_q8(), &[]);
    let mut args = vec!["--api-key", KEY_A, "--api-key", KEY_B];
    args.extend_from_slice(&["--http-listen", "127.0.0.1:0"]);
    args.extend_from_slice(extra);
    let coordinator = Proc::coordinator(&target.url(), &draft.url(), &args, None);
    (target, draft, coordinator)
}

/// A greedy completion of `prompt` presenting `key`, with `cache_salt` where given.
async fn complete(http: SocketAddr, key: &str, prompt: &str, salt: Option<&str>) -> Completion {
    let mut body = serde_json::json!({"prompt": prompt, "max_tokens": 16, "temperature": 0});
    if let Some(salt) = salt {
        body["cache_salt"] = salt.into();
    }
    let header = format!("Authorization: Bearer {key}\r\n");
    let (status, _, reply) =
        http_exchange_with(http, "POST", "/v1/completions", &header, &body.to_string()).await;
    assert_eq!(status, 200, "{reply}");
    let reply: serde_json::Value = serde_json::from_str(&reply).expect("JSON");
    let usage = &reply["usage"];
    let count = |v: &serde_json::Value| v.as_u64().unwrap_or_else(|| panic!("{reply}"));
    Completion {
        text: reply["choices"][0]["text"].as_str().expect("text").into(),
        prompt_tokens: count(&usage["prompt_tokens"]),
        cached_tokens: count(&usage["prompt_tokens_details"]["cached_tokens"]),
    }
}

/// A greedy generation of `prompt` over gRPC presenting `key`.
async fn generate_grpc(url: String, key: &str, prompt: &str) {
    let request = v1::GenerateRequest {
        prompt: prompt.into(),
        max_tokens: 16,
        ..Default::default()
    };
    let request = with_metadata(request, "authorization", &format!("Bearer {key}"));
    generate_over_grpc(url, request).await;
}

/// Tenant B is told nothing of what A sent; each reuses its own prompts; keys that give one
/// `cache_salt` share what they send with it, and only that; a tenant is its key over gRPC as
/// over HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_tenant_finds_none_of_the_first_tenants_prompt() {
    let (_target, _draft, coordinator) = serve(&[]);
    let http = coordinator.http();
    let a = complete(http, KEY_A, STORY, None).await;
    assert!(a.prompt_tokens >= 3 * 16, "several blocks: {a:?}");
    assert_eq!(a.cached_tokens, 0, "{a:?}");
    let fresh = |c: &Completion| Completion {
        cached_tokens: 0,
        ..c.clone()
    };
    let reused = |c: &Completion| Completion {
        cached_tokens: c.prompt_tokens - 1,
        ..c.clone()
    };
    // B sends what A sent: nothing cached for B.
    assert_eq!(complete(http, KEY_B, STORY, None).await, fresh(&a));
    // Each finds its own.
    assert_eq!(complete(http, KEY_A, STORY, None).await, reused(&a));
    assert_eq!(complete(http, KEY_B, STORY, None).await, reused(&a));

    // A and B share on purpose: both give one salt; a key's own tenant and another salt are
    // others.
    let shared = Some("a-and-b-share-this");
    let first = complete(http, KEY_A, OTHER, shared).await;
    assert_eq!(first.cached_tokens, 0, "{first:?}");
    assert_eq!(complete(http, KEY_B, OTHER, shared).await, reused(&first));
    assert_eq!(complete(http, KEY_A, OTHER, None).await, fresh(&first));
    let another = complete(http, KEY_B, OTHER, Some("b-alone")).await;
    assert_eq!(another, fresh(&first));

    // A's prompt sent over gRPC is found by A over HTTP, not by B.
    let third = "The sun was hot and the cat slept under the big green bush all day long \
         until a bird sang on the fence and woke her up.";
    generate_grpc(coordinator.url(), KEY_A, third).await;
    let by_b = complete(http, KEY_B, third, None).await;
    assert_eq!(by_b.cached_tokens, 0, "{by_b:?}");
    assert_eq!(complete(http, KEY_A, third, None).await, reused(&by_b));
}

/// `--shared-prefix-cache`: every key one tenant, B reuses what A sent; a request's own
/// `cache_salt` still separates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_shared_prefix_cache_every_key_is_one_tenant() {
    let (_target, _draft, coordinator) = serve(&["--shared-prefix-cache"]);
    let http = coordinator.http();
    let a = complete(http, KEY_A, STORY, None).await;
    assert_eq!(a.cached_tokens, 0, "{a:?}");
    let b = complete(http, KEY_B, STORY, None).await;
    assert_eq!(
        b,
        Completion {
            cached_tokens: a.prompt_tokens - 1,
            ..a.clone()
        }
    );
    let salted = complete(http, KEY_B, STORY, Some("b-alone")).await;
    assert_eq!(salted, a, "nothing cached under B's own salt");
}

/// Waits until `node`'s prefix cache holds `tokens` for the tenant `salt` (a session's prompt
/// goes there once prefilled).
async fn holds(node: &NodeState, salt: &[u8], tokens: &[u32]) {
    let held = || node.prefixes.lookup(salt, tokens).is_some();
    assert!(
        eventually(async || held()).await,
        "the prompt never reached the prefix cache"
    );
}

/// The draft-node's sessions are opened with the tenant's salt too: what a tenant's generation
/// left in either node's cache is found under its salt only, not under another tenant's nor
/// under none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_nodes_keep_a_tenants_prompt_under_its_salt_only() {
    let served = cluster(&stories(), Some(&stories_q8()), &LimitsArgs::default()).await;
    let engine = patient_engine(&served, 4).await;
    let prompt = tokenizer(&stories()).encode(STORY).expect("encode");
    let req = v1::GenerateRequest {
        draft_tokens: Some(4),
        ..request(&prompt, 16, 4, &Default::default())
    };
    let (a, b) = (tenant_salt("api-key", KEY_A), tenant_salt("api-key", KEY_B));
    let job = engine.prepare_for(&req, &a).expect("job");
    let out = within("a generation", engine.generate(&job, &mut Discard)).await;
    let out = out.expect("generated");
    assert!(out.stats.base.drafted > 0, "the draft drafted");
    let draft = served.draft.as_ref().expect("a draft-node");
    for node in [&served.target, draft] {
        holds(node, &a, &prompt).await;
        assert!(node.prefixes.lookup(&b, &prompt).is_none());
        assert!(node.prefixes.lookup(&[], &prompt).is_none());
    }
}
