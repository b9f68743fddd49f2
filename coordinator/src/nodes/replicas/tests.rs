//! The choice between replicas: load, affinity, health, host names.

use super::*;

fn targets(n: usize) -> Replicas {
    let handle = |i: usize| NodeHandle {
        endpoint: format!("http://127.0.0.1:{}", 1 + i),
        channel: tonic::transport::Endpoint::from_static("http://127.0.0.1:1").connect_lazy(),
        info: tandem_proto::v1::NodeInfo::default(),
    };
    let replicas = (0..n)
        .map(|i| {
            Arc::new(Replica {
                handle: handle(i),
                address: Address {
                    url: handle(i).endpoint,
                    name: None,
                },
                load: AtomicUsize::new(0),
                checked: AtomicBool::new(i == 0),
                failed: std::sync::Mutex::new(None),
                rtt_micros: AtomicU64::new(0),
                health: Arc::new(Health::new(
                    "target-node",
                    &handle(i).endpoint,
                    Arc::default(),
                )),
            })
        })
        .collect();
    Replicas {
        node: "target-node",
        model: handle(0),
        replicas: Arc::new(RwLock::new(replicas)),
        affinity: Default::default(),
    }
}

#[tokio::test]
async fn generations_go_to_the_least_loaded_replica_and_leave_it_when_they_end() {
    let targets = targets(3);
    let mut leases = Vec::new();
    let mut picked = Vec::new();
    for _ in 0..4 {
        let i = targets.pick();
        picked.push(i);
        leases.push(targets.lease(i));
    }
    assert_eq!(picked, [0, 1, 2, 0], "one each, ties to the first listed");
    leases.remove(0);
    assert_eq!(
        targets.pick(),
        0,
        "replica 0 holds one again, as few as any"
    );
    // A replica that failed is passed over while it cools down, even if least loaded.
    let e = targets.failed(0, Error::NotReady("down".into()));
    assert_eq!(e.code(), tonic::Code::Unavailable);
    drop(leases);
    assert_eq!(targets.pick(), 1);
    assert_eq!(
        targets.endpoints(),
        "http://127.0.0.1:1, http://127.0.0.1:2, http://127.0.0.1:3"
    );
    assert_eq!(targets.primary().endpoint, "http://127.0.0.1:1");
    // A full replica's refusal is one to move on from, where there are others.
    let full = Error::Remote {
        node: "target-node",
        status: tonic::Status::resource_exhausted("too many sessions"),
    };
    assert_eq!(targets.failed(2, full).code(), tonic::Code::Unavailable);
}

/// A conversation returns to the replica that served its last turn (its prefix cache holds
/// it) while that one carries at most AFFINITY_SLACK more than the least loaded; another
/// conversation, or the same one of another tenant, goes to the least loaded; a replica
/// that just failed is passed over.
#[tokio::test]
async fn a_conversation_returns_to_its_replica_within_the_slack() {
    let targets = targets(3);
    let turn = |n: usize, seed: u32| -> Vec<u32> { (0..n as u32).map(|i| i * 7 + seed).collect() };
    let chat = turn(40, 1);
    let mut leases = vec![targets.lease(0)];
    // Replica 1 served the chat's first turn (it was the least loaded then).
    assert_eq!(targets.pick_for(&[], &chat), 1);
    targets.remember(&[], &chat, 1);
    let mut next = chat.clone();
    next.extend(turn(30, 500));
    for _ in 0..=AFFINITY_SLACK {
        assert_eq!(targets.pick_for(&[], &next), 1, "the chat's replica");
        leases.push(targets.lease(1));
    }
    // Replica 1 now carries 3, replica 2 none: past the slack, the least loaded.
    assert_eq!(targets.pick_for(&[], &next), 2);
    leases.truncate(2);
    assert_eq!(targets.pick_for(&[], &next), 1);
    // Another conversation: the least loaded; one shorter than a block: the same.
    assert_eq!(targets.pick_for(&[], &turn(40, 9)), 2);
    assert_eq!(targets.pick_for(&[], &chat[..10]), 2);
    // The same chat of another tenant (another salt): as another conversation.
    assert_eq!(targets.pick_for(b"another tenant", &next), 2);
    // The chat's replica failed just now: passed over.
    let _ = targets.failed(1, Error::NotReady("down".into()));
    assert_eq!(targets.pick_for(&[], &next), 2);
}

/// A replica that missed a deadline is picked last and skipped by an open while another
/// answers (none answers here: the open's last try names the replica it reached).
#[tokio::test]
async fn a_replica_that_is_down_is_neither_picked_nor_opened_while_another_answers() {
    let targets = targets(2);
    let _busy = targets.lease(1);
    targets.missed(0, "a verify within 10s");
    assert_eq!((targets.pick(), targets.pick_for(&[], &[1; 40])), (1, 1));
    assert_eq!(targets.down(), ["http://127.0.0.1:1"]);
    let spec = SessionSpec {
        session_id: "s".into(),
        sampling: Default::default(),
        max_len: 8,
        top_logprobs: None,
        constraint: None,
        cache_salt: Vec::new(),
    };
    let log = TokenLog::new(&[1, 2]);
    let opened = targets
        .open::<crate::nodes::links::Target>(1, &spec, &log)
        .await;
    assert_eq!(
        opened.handle.endpoint, "http://127.0.0.1:2",
        "replica 0 not tried"
    );
    assert!(targets.all_down().is_none());
    targets.missed(1, "a probe within 2s");
    assert!(
        targets
            .all_down()
            .is_some_and(|why| why.contains("a probe within 2s"))
    );
}

#[tokio::test]
async fn a_host_name_is_each_of_its_addresses_and_an_address_itself() {
    let urls = [
        "http://localhost:7".to_string(),
        "https://10.0.0.9:8".to_string(),
        "http://localhost:7".to_string(),
        "http://no-such-host.invalid:9".to_string(),
    ];
    let got = resolve_all(&urls).await;
    assert!(
        got.iter()
            .any(|a| a.url == "http://127.0.0.1:7" && a.name.as_deref() == Some("localhost")),
        "{got:?}"
    );
    assert_eq!(
        got.iter()
            .filter(|a| a.name.as_deref() == Some("localhost"))
            .count(),
        got.len() - 2,
        "localhost's addresses once each: {got:?}"
    );
    assert!(got.contains(&Address {
        url: "https://10.0.0.9:8".into(),
        name: None
    }));
    assert!(got.contains(&Address {
        url: "http://no-such-host.invalid:9".into(),
        name: None
    }));
    assert_eq!(
        host_name("https://target-node:50051").map(|h| h.2),
        Some(50051)
    );
    assert_eq!(host_name("http://[::1]:1"), None);
}
