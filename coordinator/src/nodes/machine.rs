//! Where the nodes run: whether a draft-node shares the target-node's cores (the all-in-one
//! mode, or two nodes on one machine), from what they say of themselves or from their URLs.

/// Whether a draft-node runs on the target-node's cores, from what they say of themselves: the
/// same machine (boot id) and CPU sets that overlap (an empty set: every CPU). `None` where
/// either does not say (an older node, not Linux): then [`same_machine`] guesses from the URLs.
pub fn shares_cores(
    target: &tandem_proto::v1::NodeInfo,
    draft: &tandem_proto::v1::NodeInfo,
) -> Option<bool> {
    if target.host_id.is_empty() || draft.host_id.is_empty() {
        return None;
    }
    let overlap = target.cpus.is_empty()
        || draft.cpus.is_empty()
        || target.cpus.iter().any(|c| draft.cpus.contains(c));
    Some(target.host_id == draft.host_id && overlap)
}

/// Whether two node URLs name the same machine: the same host, or loopback both (a draft-node
/// there runs on the target-node's cores). URLs that do not parse name no machine.
pub fn same_machine(a: &str, b: &str) -> bool {
    fn host(url: &str) -> Option<String> {
        let uri: tonic::codegen::http::Uri = url.parse().ok()?;
        Some(uri.host()?.trim_matches(['[', ']']).to_ascii_lowercase())
    }
    fn loopback(host: &str) -> bool {
        host == "localhost"
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    }
    match (host(a), host(b)) {
        (Some(a), Some(b)) => a == b || (loopback(&a) && loopback(&b)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn node_urls_on_one_machine_are_told_from_urls_on_two() {
        use super::same_machine;
        assert!(same_machine(
            "http://127.0.0.1:50051",
            "http://localhost:50052"
        ));
        assert!(same_machine("http://[::1]:1", "http://127.0.0.2:2"));
        assert!(same_machine(
            "http://Target.local:1",
            "https://target.local:2"
        ));
        assert!(!same_machine("http://10.0.0.1:1", "http://10.0.0.2:1"));
        assert!(!same_machine(
            "http://target-node:50051",
            "http://draft-node:50052"
        ));
        assert!(!same_machine("http://127.0.0.1:1", "http://edge.example:1"));
        assert!(!same_machine("not a url", "not a url"));
    }

    #[test]
    fn nodes_share_cores_on_one_machine_only_where_their_cpus_overlap() {
        use super::shares_cores;
        use tandem_proto::v1::NodeInfo;
        let node = |host: &str, cpus: &[u32]| NodeInfo {
            host_id: host.into(),
            cpus: cpus.to_vec(),
            ..NodeInfo::default()
        };
        let target = node("boot-a", &[0]);
        assert_eq!(shares_cores(&target, &node("boot-a", &[1])), Some(false));
        assert_eq!(shares_cores(&target, &node("boot-a", &[0, 1])), Some(true));
        assert_eq!(shares_cores(&target, &node("boot-a", &[])), Some(true));
        assert_eq!(shares_cores(&target, &node("boot-b", &[0])), Some(false));
        assert_eq!(shares_cores(&target, &node("", &[0])), None);
    }
}
