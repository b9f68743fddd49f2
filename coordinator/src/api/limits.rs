//! Per-client concurrency on the public APIs (`coordinator serve --max-requests-per-client N`):
//! a client with N generations in flight gets RESOURCE_EXHAUSTED / HTTP 429 with `Retry-After`
//! for the next, at once. A client is the API key it presented where keys are required (keys
//! are checked first; which of the configured keys, not the key, is kept), else its IP address
//! (an IPv6 client by its /64, which one host is usually given whole).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use tandem_proto::Error;

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
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                Self::Ip(IpAddr::V6(bits.into()))
            }
            (None, Some(ip)) => Self::Ip(ip),
            (None, None) => Self::Unknown,
        }
    }
}

/// A generation's place in its client's count; given back on drop.
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
