//! Several hosts on one machine: each node in a network namespace of its own, joined to this
//! one by a veth pair (`ip netns`, `ip link`). It needs root, which CI has, or else a user
//! namespace of the test's own where the kernel lets an unprivileged user make one: the test
//! then runs again as root of it ([`run_in_user_namespace`]). A link can be cut and healed (its
//! veth set down and up: packets are dropped, no connection is reset — a silent peer) or shaped
//! with tc `tbf` (netem is not available on these machines).

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A host: a namespace and the link to it. Removed on drop.
#[derive(Debug)]
pub struct Host {
    pub ns: String,
    /// The link's end on this side.
    link: String,
    /// Its end on the host.
    peer: String,
    /// The host's address.
    pub ip: Ipv4Addr,
    /// The `/etc/hosts` its programs see, where one was given ([`Host::set_hosts`]).
    hosts: Option<PathBuf>,
}

fn ip(args: &[&str]) {
    run("ip", args);
}

fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Whether this process may make namespaces (root, or root of a user namespace); else why not.
pub fn available() -> Result<(), String> {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map_err(|e| format!("`ip` not found: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    // Root: /proc/self/status's Uid line.
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or("?");
    if uid != "0" {
        return Err(format!("network namespaces need root (uid {uid})"));
    }
    Ok(())
}

/// `unshare`'s arguments for a user namespace of this process's own, where it is root, with a
/// network and a mount namespace.
const USER_NAMESPACE: [&str; 4] = ["--user", "--map-root-user", "--net", "--mount"];

/// Whether this user may make a user namespace of its own (as [`run_in_user_namespace`] does);
/// else why not, and what allows it.
pub fn user_namespaces() -> Result<(), String> {
    let out = Command::new("unshare")
        .args(USER_NAMESPACE)
        .arg("true")
        .output()
        .map_err(|e| format!("`unshare` (util-linux) not found: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let said = if stderr.trim().is_empty() {
        out.status.to_string()
    } else {
        stderr.trim().to_string()
    };
    Err(format!(
        "this kernel does not let an unprivileged user make a user namespace ({said}): \
         `sysctl kernel.unprivileged_userns_clone=1`, on Ubuntu 24.04 also \
         `kernel.apparmor_restrict_unprivileged_userns=0`, or run as root"
    ))
}

/// Runs test `name` of this test binary again, alone, as root of a user namespace of its own
/// (see [`user_namespaces`]): `/run` is a tmpfs there (where `ip netns` keeps its namespaces)
/// and loopback is up; everything it made goes with it. Panics with the run's output where the
/// test did not pass.
pub fn run_in_user_namespace(name: &str) {
    let exe = std::env::current_exe().expect("the test binary");
    let out = Command::new("unshare")
        .args(USER_NAMESPACE)
        .args([
            "sh",
            "-c",
            "mount -t tmpfs tmpfs /run && ip link set lo up && exec \"$@\"",
        ])
        .arg("sh")
        .arg(exe)
        .args([name, "--exact", "--nocapture", "--test-threads", "1"])
        .output()
        .expect("unshare");
    let output = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && output.contains("test result: ok. 1 passed"),
        "{name} in a user namespace: {}\n{output}",
        out.status
    );
    eprintln!("{name}: passed in a user namespace of its own (not root):\n{output}");
}

impl Host {
    /// Host number `n` (1–250) of this test process: namespace `tdm<pid>-<n>`, subnet
    /// 10.<pid's byte>.<n>.0/24, the host at .2.
    pub fn new(n: u8) -> Self {
        let pid = std::process::id();
        let ns = format!("tdm{pid}-{n}");
        let (link, peer) = (
            format!("tv{}a{n}", pid % 100_000),
            format!("tv{}b{n}", pid % 100_000),
        );
        let net = [10, (pid % 200) as u8 + 20, n];
        let (here, there) = (
            format!("{}.{}.{}.1/24", net[0], net[1], net[2]),
            format!("{}.{}.{}.2/24", net[0], net[1], net[2]),
        );
        ip(&["netns", "add", &ns]);
        ip(&["link", "add", &link, "type", "veth", "peer", "name", &peer]);
        ip(&["link", "set", &peer, "netns", &ns]);
        ip(&["addr", "add", &here, "dev", &link]);
        ip(&["link", "set", &link, "up"]);
        ip(&[
            "netns", "exec", &ns, "ip", "addr", "add", &there, "dev", &peer,
        ]);
        ip(&["netns", "exec", &ns, "ip", "link", "set", &peer, "up"]);
        ip(&["netns", "exec", &ns, "ip", "link", "set", "lo", "up"]);
        Self {
            ns,
            link,
            peer,
            ip: Ipv4Addr::new(net[0], net[1], net[2], 2),
            hosts: None,
        }
    }

    pub fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::from((self.ip, port))
    }

    /// Cuts the link: every packet to and from the host is dropped from now on.
    pub fn cut(&self) {
        ip(&["link", "set", &self.link, "down"]);
    }

    /// Heals a cut link.
    pub fn heal(&self) {
        ip(&["link", "set", &self.link, "up"]);
    }

    /// Heals the link `after` from now, on a thread of its own.
    pub fn heal_after(&self, after: std::time::Duration) -> std::thread::JoinHandle<()> {
        let link = self.link.clone();
        std::thread::spawn(move || {
            std::thread::sleep(after);
            ip(&["link", "set", &link, "up"]);
        })
    }

    /// Limits the link towards the host to `rate` (tc `tbf`, e.g. "1mbit").
    pub fn shape(&self, rate: &str) {
        run(
            "tc",
            &[
                "qdisc", "add", "dev", &self.link, "root", "tbf", "rate", rate, "burst", "32kbit",
                "latency", "400ms",
            ],
        );
    }

    /// Gives the host a second address (`.3` of its subnet); returns it.
    pub fn add_address(&self) -> Ipv4Addr {
        let o = self.ip.octets();
        let second = Ipv4Addr::new(o[0], o[1], o[2], 3);
        ip(&[
            "netns",
            "exec",
            &self.ns,
            "ip",
            "addr",
            "add",
            &format!("{second}/24"),
            "dev",
            &self.peer,
        ]);
        second
    }

    /// The `/etc/hosts` that programs started on this host see ([`Host::command`] mounts it
    /// over theirs): `localhost`, and `name` for each of `addresses`.
    pub fn set_hosts(&mut self, name: &str, addresses: &[Ipv4Addr]) {
        let path = std::env::temp_dir().join(format!("{}-hosts", self.ns));
        let mut text = String::from("127.0.0.1 localhost\n");
        for a in addresses {
            text += &format!("{a} {name}\n");
        }
        std::fs::write(&path, text).expect("hosts");
        self.hosts = Some(path);
    }

    /// A command that runs `program` on this host: `ip netns exec`, which gives it a mount
    /// namespace of its own, where the host's `/etc/hosts` is mounted over the machine's.
    pub fn command(&self, program: &Path) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.ns]);
        if let Some(hosts) = &self.hosts {
            command
                .args(["sh", "-c", "mount --bind \"$0\" /etc/hosts && exec \"$@\""])
                .arg(hosts);
        }
        command.arg(program);
        command
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.link])
            .output();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
        if let Some(hosts) = &self.hosts {
            let _ = std::fs::remove_file(hosts);
        }
    }
}
