//! Several hosts on one machine: each node in a network namespace of its own, joined to this
//! one by a veth pair (`ip netns`, `ip link`; needs root, which CI has). A link can be cut and
//! healed (its veth set down and up: packets are dropped, no connection is reset — a silent
//! peer) or shaped with tc `tbf` (netem is not available on these machines).

use std::net::{Ipv4Addr, SocketAddr};
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

/// Whether this process may make namespaces (root); else why not.
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

    /// The `/etc/hosts` that programs started on this host see (`ip netns exec` mounts
    /// `/etc/netns/NS/hosts` over it): `localhost`, and `name` for each of `addresses`.
    pub fn set_hosts(&self, name: &str, addresses: &[Ipv4Addr]) {
        let dir = std::path::Path::new("/etc/netns").join(&self.ns);
        std::fs::create_dir_all(&dir).expect("/etc/netns/NS");
        let mut text = String::from("127.0.0.1 localhost\n");
        for a in addresses {
            text += &format!("{a} {name}\n");
        }
        std::fs::write(dir.join("hosts"), text).expect("hosts");
    }

    /// `ip netns exec` prefix that runs a program on this host.
    pub fn exec_prefix(&self) -> [&str; 3] {
        ["netns", "exec", &self.ns]
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.link])
            .output();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
        let _ = std::fs::remove_dir_all(std::path::Path::new("/etc/netns").join(&self.ns));
    }
}
