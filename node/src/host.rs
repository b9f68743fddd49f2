//! Which machine and which of its CPUs this node runs on, for [`tandem_proto::v1::NodeInfo`]:
//! a coordinator compares a draft-node's with the target-node's to know whether they share
//! cores (one machine, overlapping CPU sets), which no URL can say (two nodes on one host may
//! be pinned to cores of their own; one host may have several names).

/// Linux's boot id (one per boot of a host or VM, shared by its containers); empty elsewhere.
pub fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// The CPUs this process may run on (Linux: `Cpus_allowed_list` of /proc/self/status); empty
/// where unknown.
pub fn cpus() -> Vec<u32> {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .and_then(|list| cpu_list(list.trim()))
        })
        .unwrap_or_default()
}

/// A kernel CPU list (`0-3,8,10-11`); `None` if it does not parse.
fn cpu_list(list: &str) -> Option<Vec<u32>> {
    let mut cpus = Vec::new();
    for part in list.split(',').filter(|p| !p.is_empty()) {
        let (first, last): (u32, u32) = match part.split_once('-') {
            Some((a, b)) => (a.parse().ok()?, b.parse().ok()?),
            None => (part.parse().ok()?, part.parse().ok()?),
        };
        if last < first || last - first > 1 << 16 {
            return None;
        }
        cpus.extend(first..=last);
    }
    Some(cpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_as_the_kernel_writes_them() {
        assert_eq!(cpu_list("0-3,8,10-11"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(cpu_list("1"), Some(vec![1]));
        assert_eq!(cpu_list(""), Some(vec![]));
        assert_eq!(cpu_list("3-1"), None);
        assert_eq!(cpu_list("a-b"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_machine_and_its_cpus_are_known_on_linux() {
        assert!(!host_id().is_empty());
        let cpus = cpus();
        let parallelism = std::thread::available_parallelism().map_or(0, |n| n.get());
        // The standard library's count is the affinity's, or less under a CPU quota.
        assert!(cpus.len() >= parallelism && parallelism > 0, "{cpus:?}");
    }
}
