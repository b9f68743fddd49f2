//! A link that goes silent (issue 51 item 4): every byte held, no reset, no FIN, as behind a
//! router that stopped forwarding ([`Link::silence`]). A node behind it is marked down after one
//! missed deadline; generations that start while it is down neither open a session there nor
//! wait for one, and decode exactly what the target alone does; when it answers again, drafting
//! resumes. The nodes run in this process ([`cluster`]), each link in front of one of them.

use tandem_coordinator::{CommitSink, Engine, LocalCluster};
use tandem_proto::v1;
use tandem_runtime::Commit;
use tandem_tests::link::{Link, LinkSpec};
use tandem_tests::*;

/// A greedy request of `tokens` tokens at K = `k` (0: the target alone).
fn greedy(k: u32, tokens: u32) -> v1::GenerateRequest {
    let prompt = tokenizer(&stories())
        .encode("Once upon a time")
        .expect("encode");
    request(&prompt, tokens, k, &Default::default())
}

/// An engine on `targets` with the draft-node at `draft` (if any), K = `k` unless a request says
/// otherwise, the product's own deadlines.
async fn engine(targets: &[String], draft: Option<&str>, k: usize) -> Engine {
    let drafts: Vec<String> = draft.into_iter().map(str::to_string).collect();
    Engine::connect(targets, &drafts, Some(k), &Default::default())
        .await
        .expect("engine")
}

/// Both nodes in this process, the draft-node behind a link, and an engine on them at K = 4 (the
/// cluster lives as long as the engine's nodes must).
async fn draft_behind_a_link() -> (LocalCluster, Link, Engine) {
    let cluster = cluster(&stories(), Some(&stories_q8()), &Default::default()).await;
    let link = Link::start(cluster.draft_addr.expect("draft"), LinkSpec::DIRECT)
        .await
        .expect("link");
    let target = format!("http://{}", cluster.target_addr);
    let engine = engine(&[target], Some(&link.url()), 4).await;
    (cluster, link, engine)
}

/// Waits until the engine's draft-node is down (every replica).
async fn draft_down(engine: &Engine) {
    let drafts = engine
        .draft
        .get()
        .expect("the draft-node answered at start");
    assert!(
        eventually(async || drafts.all_down().is_some()).await,
        "the silent draft-node was never marked down"
    );
}

/// Waits until a generation on `engine` drafts with its draft model (a loaded machine may
/// abandon a first open or step at its deadline), each equal to `alone`.
async fn drafting(engine: &Engine, alone: &[u32]) {
    let drafted = eventually(async || {
        let outcome = generate(engine, &greedy(4, 40)).await;
        assert_eq!(outcome.token_ids, alone, "exact");
        outcome.stats.model_rounds > 0
    })
    .await;
    assert!(drafted, "no generation drafted with the draft model");
}

/// Generations that start while the draft's link is silent make no call to it once it is down
/// (the reason they give says so, not a transport error found after waiting) and equal the
/// target alone; once the link is healed the node is up again and drafts are used.
#[tokio::test]
async fn generations_do_not_wait_on_a_silent_draft_link_and_drafting_resumes_after() {
    let (_cluster, link, engine) = draft_behind_a_link().await;
    let alone = generate(&engine, &greedy(0, 40)).await.token_ids;
    drafting(&engine, &alone).await;

    link.silence(true);
    // The first generation may find the link itself: its draft session is not waited for past
    // the grace beside the target's open.
    let first = generate(&engine, &greedy(4, 40)).await;
    assert_eq!(first.token_ids, alone);
    let why = &first.stats.draft_lost_reason;
    assert!(
        why.contains("draft-node did not answer within") || why.contains("is down"),
        "the open was abandoned, not waited for until the connection died: {why}"
    );
    draft_down(&engine).await;
    for _ in 0..3 {
        let outcome = generate(&engine, &greedy(4, 40)).await;
        assert_eq!(outcome.token_ids, alone, "exact without the draft");
        assert_eq!(outcome.stats.model_rounds, 0);
        let why = &outcome.stats.draft_lost_reason;
        assert!(
            why.contains(&format!("draft-node at {} is down", link.url())),
            "no call made to a node that is down: {why}"
        );
    }

    link.silence(false);
    let drafts = engine.draft.get().expect("draft");
    assert!(
        eventually(async || drafts.all_down().is_none()).await,
        "the healed draft-node was never marked up"
    );
    drafting(&engine, &alone).await;
}

/// Silences a link at a generation's first commit: the rest of it runs behind a silent link.
struct SilenceAtFirstCommit<'a>(&'a Link);

impl CommitSink for SilenceAtFirstCommit<'_> {
    async fn send(&mut self, _: &Commit, _: &[tandem_runtime::sampling::TokenLogprobs]) -> bool {
        self.0.silence(true);
        true
    }
}

/// A generation whose draft link goes silent after its first commit ends exact with the link
/// still silent (the step is abandoned at its deadline), and the node is then down: the next
/// generation makes no call to it.
#[tokio::test]
async fn a_link_that_goes_silent_mid_generation_costs_one_deadline() {
    let (_cluster, link, engine) = draft_behind_a_link().await;
    let alone = generate(&engine, &greedy(0, 200)).await.token_ids;
    // Until the draft model drafted before the silence (a loaded machine may leave it out of a
    // generation's start): each time exact, healed after.
    let mut tries = 0;
    let outcome = loop {
        tries += 1;
        assert!(
            tries <= 20,
            "the draft model never drafted before the silence"
        );
        link.silence(false);
        drafting(&engine, &alone[..40]).await;
        let job = engine.prepare(&greedy(4, 200)).expect("valid");
        let mut sink = SilenceAtFirstCommit(&link);
        let outcome = within("the generation", engine.generate(&job, &mut sink))
            .await
            .expect("generation");
        assert_eq!(outcome.token_ids, alone, "exact");
        if outcome.stats.model_rounds > 0 {
            break outcome;
        }
    };
    assert!(
        outcome.stats.draft_stalls > 0 || outcome.stats.draft_lost,
        "the draft step was abandoned: {:?}",
        outcome.stats
    );
    draft_down(&engine).await;
    let next = generate(&engine, &greedy(4, 40)).await;
    assert_eq!(next.token_ids[..], alone[..40]);
    assert!(
        next.stats.draft_lost_reason.contains("is down"),
        "{}",
        next.stats.draft_lost_reason
    );
}

/// Two target replicas, one behind a silent link: once it is down, generations open on the
/// other, and the silent one receives no session even after its link heals (nothing was sent
/// toward it while it was down to be delivered late).
#[tokio::test]
async fn a_silent_target_replica_is_passed_over_once_down() {
    let a = cluster(&stories(), None, &Default::default()).await;
    let b = cluster(&stories(), None, &Default::default()).await;
    let link = Link::start(a.target_addr, LinkSpec::DIRECT)
        .await
        .expect("link");
    let targets = [link.url(), format!("http://{}", b.target_addr)];
    let engine = engine(&targets, None, 0).await;
    let alone = generate(&engine, &greedy(0, 40)).await.token_ids;

    link.silence(true);
    assert!(
        eventually(async || engine.targets.down() == [link.url()]).await,
        "the silent replica was never marked down: {:?}",
        engine.targets.down()
    );
    let opened_at_a = a.target.metrics.sessions_opened.get();
    for _ in 0..3 {
        assert_eq!(generate(&engine, &greedy(0, 40)).await.token_ids, alone);
    }
    link.silence(false);
    assert!(
        eventually(async || engine.targets.down().is_empty()).await,
        "the healed replica was never marked up"
    );
    assert_eq!(
        a.target.metrics.sessions_opened.get(),
        opened_at_a,
        "a session was opened toward the replica that was down"
    );
}
