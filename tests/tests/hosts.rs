//! Several hosts (issue 13): the target-node and the draft-node each in a network namespace of
//! its own, the coordinator here, links over veth pairs. A link is cut mid-generation (packets
//! dropped, no reset: a silent peer) and healed, and the draft's link is limited to 2 Mbit/s
//! with tc `tbf`: every generation ends with target-only's output. Needs root (CI has it) or,
//! without it, unprivileged user namespaces: each test then runs again as root of one of its
//! own. Where neither, or with `TANDEM_SKIP_NETNS=1`, it is counted as not run (`not_run`; a
//! failure in CI).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tandem_proto::v1;
use tandem_runtime::SamplingParams;
use tandem_tests::held::Held;
use tandem_tests::netns::{self, Host};
use tandem_tests::processes::Proc;
use tandem_tests::*;

fn story(n: u32, k: u32) -> v1::GenerateRequest {
    let prompt = tokenizer(&stories())
        .encode("Once upon a time")
        .expect("encode");
    request(&prompt, n, k, &SamplingParams::greedy())
}

fn node_on(host: &Host, name: &str, model: &std::path::Path) -> Proc {
    node_at(host, name, model, host.addr(50051))
}

fn node_at(host: &Host, name: &str, model: &std::path::Path, addr: SocketAddr) -> Proc {
    let (model, listen) = (model.display().to_string(), addr.to_string());
    Proc::start_on(host, name, &["--model", &model, "--listen", &listen])
}

/// Whether `test`'s body runs here: network namespaces are available (root). Without root it
/// runs again as root of a user namespace of its own where the kernel allows one (its result
/// asserted here, [`netns::run_in_user_namespace`]); where neither, or where
/// TANDEM_SKIP_NETNS says to skip, it is counted as not run ([`not_run`]: a failure in CI).
fn runs_here(test: &str) -> bool {
    let why = if std::env::var_os("TANDEM_SKIP_NETNS").is_some() {
        "TANDEM_SKIP_NETNS is set".to_string()
    } else {
        let root = match netns::available() {
            Ok(()) => return true,
            Err(why) => why,
        };
        match netns::user_namespaces() {
            Ok(()) => {
                netns::run_in_user_namespace(test);
                return false;
            }
            Err(why) => format!("it needs network namespaces: {root}; {why}"),
        }
    };
    not_run(&format!("hosts::{test}"), &why);
    false
}

#[tokio::test]
async fn cut_and_healed_links_between_hosts_keep_the_output_exact() {
    if !runs_here("cut_and_healed_links_between_hosts_keep_the_output_exact") {
        return;
    }
    let (target_host, draft_host) = (Host::new(1), Host::new(2));
    let _target = node_on(&target_host, "target-node", &stories());
    let _draft = node_on(&draft_host, "draft-node", &stories_q8());
    draft_host.shape("2mbit");
    let coordinator = Proc::coordinator(
        &format!("http://{}", target_host.addr(50051)),
        &format!("http://{}", draft_host.addr(50051)),
        &["--target-retry-secs", "60"],
        None,
    );
    let want = in_process(&stories(), None, &story(400, 0)).token_ids;

    // The draft's link cut mid-generation (the client holds it after its first delta): its
    // step is abandoned at its deadline, the target goes on alone.
    let held = Held::start(coordinator.url(), story(400, 4)).await;
    draft_host.cut();
    let (ids, done) = held.finish().await;
    let done = done.expect("the generation ends");
    assert_eq!(ids, want, "draft link cut");
    assert_eq!(done.token_ids, want);
    let stats = done.stats.expect("stats");
    assert!(
        stats.draft_stalls > 0 || stats.draft_lost,
        "the silent draft was noticed: {stats:?}"
    );
    draft_host.heal();

    // The target's link cut for a second, then healed: TCP delivers what was held back.
    let held = Held::start(coordinator.url(), story(400, 4)).await;
    target_host.cut();
    let healed = target_host.heal_after(Duration::from_secs(1));
    let (ids, done) = held.finish().await;
    done.expect("the generation ends");
    assert_eq!(ids, want, "target link cut for 1 s");
    healed.join().expect("healed");

    // Cut for longer than keepalive allows (5 s ping + 5 s to answer): the connection is
    // declared dead, the session lost; once healed, it is rebuilt from the log.
    let held = Held::start(coordinator.url(), story(400, 4)).await;
    let start = Instant::now();
    target_host.cut();
    let healed = target_host.heal_after(Duration::from_secs(14));
    let (ids, done) = held.finish().await;
    assert_eq!(ids, want, "target link cut for 14 s");
    let stats = done.expect("the generation ends").stats.expect("stats");
    assert!(stats.repairs >= 1, "the session was rebuilt: {stats:?}");
    assert!(
        start.elapsed() < Duration::from_secs(40),
        "back soon after the link: {:?}",
        start.elapsed()
    );
    healed.join().expect("healed");
}

#[tokio::test]
async fn a_host_name_with_two_addresses_is_two_replicas() {
    if !runs_here("a_host_name_with_two_addresses_is_two_replicas") {
        return;
    }
    // A headless Service's name: `targets` is both addresses of the host.
    let mut host = Host::new(3);
    let second = host.add_address();
    host.set_hosts("targets", &[host.ip, second]);
    let (a_addr, b_addr) = (host.addr(50051), SocketAddr::from((second, 50051)));
    let a = node_at(&host, "target-node", &stories(), a_addr);
    let _b = node_at(&host, "target-node", &stories(), b_addr);
    let listen = host.addr(50050);
    let coordinator = Proc::start_on(
        &host,
        "coordinator",
        &[
            "serve",
            "--target",
            "http://targets:50051",
            "--listen",
            &listen.to_string(),
        ],
    );
    coordinator.wait_ready();
    let want = in_process(&stories(), None, &story(400, 0)).token_ids;
    // The first address is the first replica: killed mid-generation, the other goes on.
    let held = Held::start(coordinator.url(), story(400, 0)).await;
    drop(a);
    let (ids, done) = held.finish().await;
    assert_eq!(ids, want);
    let stats = done.expect("the generation ends").stats.expect("stats");
    assert!(stats.repairs >= 1, "moved to the other address: {stats:?}");
}
