//! Per-client concurrency on the public APIs (`coordinator serve --max-requests-per-client N`):
//! a client with N generations in flight gets RESOURCE_EXHAUSTED / HTTP 429 with `Retry-After`
//! for the next, at once. A client is the API key it presented where keys are required (keys
//! are checked first; which of the configured keys, not the key, is kept), else its IP address
//! (an IPv6 client by its /64, which one host is usually given whole): the peer's, or, where the
//! peer is a proxy the operator trusts (`--trusted-proxy`), the one its `X-Forwarded-For` names
//! ([`TrustedProxies`]). A generation holds its place until it has ended, not until its client
//! has gone.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use crate::error::Error;

/// Generations in flight per client, against a limit.
#[derive(Debug, Clone, Default)]
pub struct ClientLimits {
    /// 0: no limit.
    max: usize,
    in_flight: Arc<Mutex<HashMap<Client, usize>>>,
}

/// Who a request comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Client {
    /// The index of the configured key it presented.
    Key(usize),
    Ip(IpAddr),
    Unknown,
}

impl Client {
    /// The client of a request: the configured key it presented (checked already), else its
    /// peer address (IPv6: its /64).
    pub fn of(key: Option<usize>, peer: Option<IpAddr>) -> Self {
        match (key, peer) {
            (Some(i), _) => Self::Key(i),
            (None, Some(IpAddr::V6(v6))) if v6.to_ipv4_mapped().is_none() => {
                Self::Ip(IpAddr::V6(network(v6.into(), 128, 64).into()))
            }
            (None, Some(ip)) => Self::Ip(ip),
            (None, None) => Self::Unknown,
        }
    }
}

/// An address or a block of them (`10.0.0.0/8`, `fd00::/8`, `192.0.2.7`), as
/// `--trusted-proxy` takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    fn contains(&self, ip: IpAddr) -> bool {
        let ((a, width), (b, ip_width)) = (bits(self.addr), bits(ip));
        width == ip_width && network(a, width, self.prefix) == network(b, width, self.prefix)
    }
}

/// An address's bits (an IPv4 address's in the low 32) and how many there are.
fn bits(ip: IpAddr) -> (u128, u8) {
    match ip {
        IpAddr::V4(a) => (u32::from(a).into(), 32),
        IpAddr::V6(a) => (a.into(), 128),
    }
}

/// `bits` of a `width`-bit address with all but the first `prefix` cleared.
fn network(bits: u128, width: u8, prefix: u8) -> u128 {
    match u32::from(width - prefix) {
        128 => 0,
        host => bits >> host << host,
    }
}

impl std::str::FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let wrong =
            || format!("`{s}` is not an IP address or a CIDR block (e.g. 10.0.0.0/8, fd00::/8)");
        let (addr, prefix) = match s.trim().split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (s.trim(), None),
        };
        let addr = addr.parse::<IpAddr>().map_err(|_| wrong())?.to_canonical();
        let width = bits(addr).1;
        let prefix = match prefix {
            Some(p) => p.parse().ok().filter(|&p| p <= width).ok_or_else(wrong)?,
            None => width,
        };
        Ok(Self { addr, prefix })
    }
}

/// The proxies whose `X-Forwarded-For` names the client (`coordinator serve --trusted-proxy`);
/// none: every client is its peer address. Only the rightmost entries can be believed: each
/// trusted proxy appends the address it was reached from, and whatever is left of that came
/// from the client. `Forwarded` (RFC 7239) is not read: where a proxy wrote only that one, a
/// client's own `X-Forwarded-For` would pass through it unchanged and be taken for the truth.
#[derive(Debug, Clone, Default)]
pub struct TrustedProxies(Arc<[Cidr]>);

impl TrustedProxies {
    pub fn new(blocks: impl IntoIterator<Item = Cidr>) -> Self {
        Self(blocks.into_iter().collect())
    }

    fn trusts(&self, ip: IpAddr) -> bool {
        self.0.iter().any(|b| b.contains(ip))
    }

    /// The client's address: `peer`, unless `peer` is a trusted proxy; then the rightmost
    /// address of `forwarded_for` (the request's `X-Forwarded-For` values, in order) that is
    /// not a trusted proxy (the leftmost where all are). An entry that is not an address stops
    /// the walk at the last trusted hop before it: garbage names no fresh client.
    pub fn client<'a>(
        &self,
        peer: IpAddr,
        forwarded_for: impl IntoIterator<Item = &'a str>,
    ) -> IpAddr {
        let mut client = peer.to_canonical();
        if !self.trusts(client) {
            return client;
        }
        let hops: Vec<&str> = forwarded_for
            .into_iter()
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|h| !h.is_empty())
            .collect();
        for hop in hops.into_iter().rev() {
            let Some(ip) = hop_address(hop) else { break };
            client = ip;
            if !self.trusts(ip) {
                break;
            }
        }
        client
    }
}

/// An `X-Forwarded-For` entry's address: `192.0.2.7`, `192.0.2.7:5000`, `2001:db8::1`,
/// `[2001:db8::1]` or `[2001:db8::1]:443`.
fn hop_address(hop: &str) -> Option<IpAddr> {
    let ip = hop
        .parse::<IpAddr>()
        .ok()
        .or_else(|| hop.parse::<SocketAddr>().ok().map(|s| s.ip()))
        .or_else(|| hop.strip_prefix('[')?.strip_suffix(']')?.parse().ok())?;
    Some(ip.to_canonical())
}

/// A generation's place in its client's count; given back on drop (by the generation's last
/// task, not by the handler that admitted it: a client that hung up keeps its place until its
/// generation has noticed and ended).
#[derive(Debug)]
pub struct ClientPermit {
    limits: Option<ClientLimits>,
    client: Client,
}

impl Drop for ClientPermit {
    fn drop(&mut self) {
        let Some(limits) = &self.limits else { return };
        let mut in_flight = limits.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = in_flight.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                in_flight.remove(&self.client);
            }
        }
    }
}

impl ClientLimits {
    pub fn new(max: usize) -> Self {
        Self {
            max,
            in_flight: Arc::default(),
        }
    }

    /// A permit for one more generation of `client`, or RESOURCE_EXHAUSTED naming the limit.
    pub fn acquire(&self, client: Client) -> Result<ClientPermit, Error> {
        if self.max == 0 {
            return Ok(ClientPermit {
                limits: None,
                client,
            });
        }
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        let n = in_flight.entry(client.clone()).or_default();
        if *n >= self.max {
            return Err(Error::TooManyRequests { limit: self.max });
        }
        *n += 1;
        Ok(ClientPermit {
            limits: Some(self.clone()),
            client,
        })
    }

    /// Clients with a generation in flight.
    pub fn clients(&self) -> usize {
        self.in_flight.lock().map_or(0, |m| m.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_past_its_limit_is_refused_and_let_in_once_one_ends() {
        let limits = ClientLimits::new(2);
        let a = Client::of(None, Some([10, 0, 0, 1].into()));
        let b = Client::of(None, Some([10, 0, 0, 2].into()));
        let first = limits.acquire(a.clone()).expect("first");
        let _second = limits.acquire(a.clone()).expect("second");
        let refused = limits.acquire(a.clone()).expect_err("third");
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert!(refused.to_string().contains("--max-requests-per-client"));
        let _other = limits
            .acquire(b)
            .expect("another client is not counted with it");
        drop(first);
        let _third = limits.acquire(a).expect("room again once one ended");
        assert_eq!(limits.clients(), 2);
    }

    fn proxies(blocks: &[&str]) -> TrustedProxies {
        TrustedProxies::new(blocks.iter().map(|b| b.parse().expect("block")))
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("address")
    }

    #[test]
    fn blocks_are_addresses_or_cidr_and_say_what_is_wrong() {
        let b: Cidr = "10.1.2.3/8".parse().expect("block");
        assert!(b.contains(ip("10.200.0.1")) && !b.contains(ip("11.0.0.1")));
        let one: Cidr = "192.0.2.7".parse().expect("address");
        assert!(one.contains(ip("192.0.2.7")) && !one.contains(ip("192.0.2.8")));
        let v6: Cidr = "fd00::/8".parse().expect("block");
        assert!(v6.contains(ip("fd12::1")) && !v6.contains(ip("fe80::1")));
        assert!(!v6.contains(ip("10.0.0.1")));
        let all: Cidr = "0.0.0.0/0".parse().expect("block");
        assert!(all.contains(ip("203.0.113.9")));
        // A v4-mapped address is its IPv4 one.
        let mapped: Cidr = "::ffff:10.0.0.1".parse().expect("address");
        assert!(mapped.contains(ip("10.0.0.1")));
        for wrong in ["10.0.0.0/33", "fd00::/129", "ingress", "10.0.0.0/x", ""] {
            let e = wrong.parse::<Cidr>().expect_err(wrong);
            assert!(e.contains("not an IP address or a CIDR block"), "{e}");
        }
    }

    #[test]
    fn a_trusted_proxy_names_the_client_and_an_untrusted_peer_cannot() {
        let trusted = proxies(&["10.0.0.0/8", "192.0.2.1"]);
        let ingress = ip("10.0.0.5");
        // Behind the ingress: the rightmost address that is not a trusted proxy.
        assert_eq!(trusted.client(ingress, ["203.0.113.1"]), ip("203.0.113.1"));
        assert_eq!(
            trusted.client(ingress, ["198.51.100.9, 203.0.113.1, 192.0.2.1"]),
            ip("203.0.113.1"),
            "what the client wrote itself (left) is not believed"
        );
        // Several header lines are one list, in order; ports and brackets are dropped.
        assert_eq!(
            trusted.client(ingress, ["198.51.100.9", "203.0.113.1:5000, 10.0.0.9"]),
            ip("203.0.113.1")
        );
        assert_eq!(
            trusted.client(ingress, ["[2001:db8::1]:443"]),
            ip("2001:db8::1")
        );
        // Every hop trusted: the leftmost; no header: the proxy itself.
        assert_eq!(
            trusted.client(ingress, ["10.0.0.7, 10.0.0.6"]),
            ip("10.0.0.7")
        );
        assert_eq!(trusted.client(ingress, []), ingress);
        // Garbage stops the walk at the last trusted hop.
        assert_eq!(trusted.client(ingress, ["unknown"]), ingress);
        assert_eq!(
            trusted.client(ingress, ["unknown, 10.0.0.6"]),
            ip("10.0.0.6")
        );
        // A peer that is not trusted is itself, whatever it sends.
        let stranger = ip("203.0.113.50");
        assert_eq!(trusted.client(stranger, ["198.51.100.1"]), stranger);
        assert_eq!(
            TrustedProxies::default().client(ingress, ["198.51.100.1"]),
            ingress
        );
    }

    #[test]
    fn clients_behind_a_trusted_proxy_get_a_slot_each_and_a_spoofer_does_not() {
        let (limits, trusted) = (ClientLimits::new(1), proxies(&["10.0.0.5"]));
        let behind = |xff: &str| {
            let ip = trusted.client(ip("10.0.0.5"), [xff]);
            limits.acquire(Client::of(None, Some(ip)))
        };
        let _a = behind("203.0.113.1").expect("a");
        let _b = behind("203.0.113.2").expect("another client behind the proxy");
        assert!(behind("203.0.113.1").is_err(), "the first at its limit");
        let direct = |xff: &str| {
            let ip = trusted.client(ip("198.51.100.7"), [xff]);
            limits.acquire(Client::of(None, Some(ip)))
        };
        let _c = direct("203.0.113.3").expect("a client of its own");
        assert!(
            direct("203.0.113.4").is_err(),
            "a new X-Forwarded-For from an untrusted peer is no new slot"
        );
    }

    #[test]
    fn clients_are_told_apart_by_key_else_by_address() {
        let ip = Some(IpAddr::from([10, 0, 0, 1]));
        assert_ne!(Client::of(Some(0), ip), Client::of(Some(1), ip));
        assert_eq!(Client::of(None, ip), Client::Ip([10, 0, 0, 1].into()));
        assert_eq!(Client::of(None, None), Client::Unknown);
        // One IPv6 host is one /64.
        let v6 = |s: &str| Some(s.parse::<IpAddr>().expect("address"));
        assert_eq!(
            Client::of(None, v6("2001:db8:1:2::1")),
            Client::of(None, v6("2001:db8:1:2:ffff::9"))
        );
        assert_ne!(
            Client::of(None, v6("2001:db8:1:2::1")),
            Client::of(None, v6("2001:db8:1:3::1"))
        );
        let limits = ClientLimits::new(0);
        let permits: Vec<_> = (0..100)
            .map(|_| limits.acquire(Client::Unknown).expect("no limit"))
            .collect();
        assert_eq!(permits.len(), 100);
        assert_eq!(limits.clients(), 0);
    }
}
