//! A node's replicas (the target-node's, the draft-node's): every URL given (`--target`,
//! `--draft`), and every address of a URL's host name (a Kubernetes headless Service names one
//! address per ready pod). The names are resolved again
//! every [`REFRESH`]: a replica that appears is added, one whose address is gone is no longer
//! offered (sessions on it finish or move). A generation opens its session on the replica that
//! served the longest start of its tokens (a chat's last turn: its prefix cache holds it), unless
//! that one has [`AFFINITY_SLACK`] more generations than the least loaded, else on the least
//! loaded (ties: the first), and stays there; a session lost with its replica is rebuilt from the
//! log on the next one. The first replica that answers at start gives the model's info; the
//! others are reached lazily and their info is checked against it before their first session.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use tandem_proto::tls::ClientTls;
use tandem_proto::v1;
use tokio::sync::Notify;

use crate::nodes::health::{DOWN_PROBE, Health, Reachable};
use crate::nodes::links::{NodeSession, SessionSpec, Wire};
use crate::nodes::{NodeHandle, session_lost};
use tandem_runtime::TokenLog;
use tonic::Code;

/// How often host names are resolved again.
pub const REFRESH: Duration = Duration::from_secs(10);
/// How often each replica's round trip is measured (an `Info` call), and how long one may take
/// before the replica's round trip is unknown and the replica is down ([`Health`]; a down one is
/// asked every [`DOWN_PROBE`]).
pub const PROBE: Duration = Duration::from_secs(5);
const PROBE_DEADLINE: Duration = Duration::from_secs(2);

/// Where to reach one replica: a URL, and the host name its address came from (TLS checks the
/// certificate against it).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Address {
    url: String,
    name: Option<String>,
}

#[derive(Debug)]
struct Replica {
    handle: NodeHandle,
    address: Address,
    /// Generations whose session opened here.
    load: AtomicUsize,
    /// Whether its info was read and matches the model's.
    checked: AtomicBool,
    /// When it last failed to open or keep a session: for [`COOLDOWN`] it is picked only if
    /// every replica failed.
    failed: std::sync::Mutex<Option<Instant>>,
    /// The last round trip measured to it, in microseconds (0: none, or its probe failed).
    rtt_micros: AtomicU64,
    /// Whether it answers: a down replica is picked only when every one is down.
    health: Arc<Health>,
}

/// How long a replica that failed is passed over by [`Replicas::pick`].
pub const COOLDOWN: Duration = Duration::from_secs(2);

/// Generations a replica that holds a conversation may carry beyond the least loaded one and
/// still be picked for it: the cache it holds is worth that wait, a hot spot is not.
pub const AFFINITY_SLACK: usize = 2;

/// Block hashes of the tokens sessions were opened with remembered, per node (the oldest half
/// forgotten past this).
const AFFINITY_HASHES: usize = 1 << 16;

/// Which replica each start of a sequence was last opened on: block hash → (replica URL, when).
#[derive(Debug, Default)]
struct Affinity {
    by_hash: std::collections::HashMap<u64, (String, u64)>,
    clock: u64,
}

impl Replica {
    fn cooling(&self) -> bool {
        self.failed
            .lock()
            .map(|f| f.is_some_and(|at| at.elapsed() < COOLDOWN))
            .unwrap_or(false)
    }
}

/// A generation's count on its replica, given back on drop.
#[derive(Debug)]
pub struct Lease(Arc<Replica>);

impl Drop for Lease {
    fn drop(&mut self) {
        self.0.load.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The replicas of one node (the target-node, or the draft-node).
#[derive(Debug)]
pub struct Replicas {
    node: &'static str,
    /// The first replica that answered: the model's info.
    model: NodeHandle,
    replicas: Arc<RwLock<Vec<Arc<Replica>>>>,
    affinity: std::sync::Mutex<Affinity>,
}

/// A session opened on one of the replicas (or why not), and the replica's handle.
pub struct Opened<W: Wire> {
    pub handle: NodeHandle,
    pub session: Result<NodeSession<W>>,
}

impl<W: Wire> std::fmt::Debug for Opened<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened")
            .field("replica", &self.handle.endpoint)
            .field("opened", &self.session.is_ok())
            .finish()
    }
}

impl Replicas {
    /// Resolves `urls`, connects to the first replica of `node` that answers and reaches the
    /// others lazily; host names are resolved again every [`REFRESH`] while this lives.
    pub async fn connect(node: &'static str, urls: &[String], tls: &ClientTls) -> Result<Self> {
        let addresses = resolve_all(urls).await;
        let mut first_error = None;
        let mut model = None;
        for a in &addresses {
            match NodeHandle::connect_named(node, &a.url, a.name.as_deref(), tls).await {
                Ok(handle) => {
                    model = Some(handle);
                    break;
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        let Some(model) = model else {
            return Err(first_error.unwrap_or_else(|| Error::Unavailable {
                node,
                endpoint: urls.join(", "),
                reason: "no address to reach".into(),
            }));
        };
        // Wakes the probe when a replica goes down.
        let wake = Arc::new(Notify::new());
        let replicas = addresses
            .into_iter()
            .map(|a| {
                let checked = a.url == model.endpoint;
                replica(node, &model, a, tls, checked, &wake)
            })
            .collect::<Result<Vec<_>>>()?;
        let replicas = Arc::new(RwLock::new(replicas));
        if urls.iter().any(|u| host_name(u).is_some()) {
            let (weak, urls, tls) = (Arc::downgrade(&replicas), urls.to_vec(), tls.clone());
            let wake = Arc::clone(&wake);
            tokio::spawn(refresh(node, weak, model.clone(), urls, tls, wake));
        }
        tokio::spawn(probe(Arc::downgrade(&replicas), wake));
        Ok(Self {
            node,
            model,
            replicas,
            affinity: Default::default(),
        })
    }

    fn snapshot(&self) -> Vec<Arc<Replica>> {
        self.replicas
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The replica whose info is the model's.
    pub fn primary(&self) -> &NodeHandle {
        &self.model
    }

    /// Each replica's endpoint and the last round trip measured to it, in seconds (`None`: not
    /// measured yet, or its last probe got no answer).
    pub fn round_trips(&self) -> Vec<(String, Option<f64>)> {
        self.snapshot()
            .iter()
            .map(|r| {
                let micros = r.rtt_micros.load(Ordering::Relaxed);
                (
                    r.address.url.clone(),
                    (micros > 0).then_some(micros as f64 * 1e-6),
                )
            })
            .collect()
    }

    pub fn len(&self) -> usize {
        self.snapshot().len()
    }

    pub fn is_empty(&self) -> bool {
        self.snapshot().is_empty()
    }

    /// Every replica's URL, for errors.
    pub fn endpoints(&self) -> String {
        let urls: Vec<String> = self
            .snapshot()
            .iter()
            .map(|r| r.address.url.clone())
            .collect();
        urls.join(", ")
    }

    /// The least loaded replica (ties: the first) of those that answer and have not just
    /// failed.
    pub fn pick(&self) -> usize {
        let replicas = self.snapshot();
        (0..replicas.len())
            .min_by_key(|&i| {
                let r = &replicas[i];
                (
                    r.health.is_down(),
                    r.cooling(),
                    r.load.load(Ordering::Relaxed),
                )
            })
            .unwrap_or(0)
    }

    /// Why no replica can be used now, where every one is down ([`Health`]); `None` where one
    /// answers.
    pub fn all_down(&self) -> Option<String> {
        let replicas = self.snapshot();
        let why: Vec<String> = replicas
            .iter()
            .filter_map(|r| r.health.why_down())
            .collect();
        (why.len() == replicas.len()).then(|| why.join("; "))
    }

    /// The URLs of the replicas that are down now.
    pub fn down(&self) -> Vec<String> {
        let replicas = self.snapshot();
        let down = replicas.iter().filter(|r| r.health.is_down());
        down.map(|r| r.address.url.clone()).collect()
    }

    /// Replica `i` missed the deadline of a call (`what`): down until it answers again.
    pub fn missed(&self, i: usize, what: &str) {
        self.at(i).health.missed(what);
    }

    /// The replica for a session of `tokens` of the tenant `salt`: the one a session of the
    /// tenant holding the longest start of them was opened on (its prefix cache has it), if it
    /// has not just failed and carries at most [`AFFINITY_SLACK`] more generations than
    /// [`Self::pick`]'s; else that one.
    pub fn pick_for(&self, salt: &[u8], tokens: &[u32]) -> usize {
        let least = self.pick();
        let replicas = self.snapshot();
        let load = |i: usize| replicas[i].load.load(Ordering::Relaxed);
        let hashes = tandem_node::prefix_cache::block_hashes(salt, tokens);
        let affinity = self.affinity.lock().unwrap_or_else(|e| e.into_inner());
        hashes
            .iter()
            .rev()
            .filter_map(|h| affinity.by_hash.get(h))
            .find_map(|(url, _)| replicas.iter().position(|r| &r.address.url == url))
            .filter(|&i| {
                let r = &replicas[i];
                !r.cooling() && !r.health.is_down() && load(i) <= load(least) + AFFINITY_SLACK
            })
            .unwrap_or(least)
    }

    /// Remembers that a session of `tokens` of the tenant `salt` opened on replica `i`.
    fn remember(&self, salt: &[u8], tokens: &[u32], i: usize) {
        let url = self.at(i).address.url.clone();
        let mut a = self.affinity.lock().unwrap_or_else(|e| e.into_inner());
        a.clock += 1;
        let now = a.clock;
        for h in tandem_node::prefix_cache::block_hashes(salt, tokens) {
            a.by_hash.insert(h, (url.clone(), now));
        }
        if a.by_hash.len() > AFFINITY_HASHES {
            let mut stamps: Vec<u64> = a.by_hash.values().map(|(_, t)| *t).collect();
            let (_, &mut median, _) = stamps.select_nth_unstable(AFFINITY_HASHES / 2);
            a.by_hash.retain(|_, (_, t)| *t > median);
        }
    }

    /// Counts a generation on replica `i` until the lease drops.
    pub fn lease(&self, i: usize) -> Lease {
        let replica = self.at(i);
        replica.load.fetch_add(1, Ordering::Relaxed);
        Lease(replica)
    }

    /// Passes replica `i` over for [`COOLDOWN`].
    fn cool(&self, i: usize) -> Arc<Replica> {
        let replica = self.at(i);
        if let Ok(mut f) = replica.failed.lock() {
            *f = Some(Instant::now());
        }
        replica
    }

    /// After replica `i` failed a session with `e`: passed over for [`COOLDOWN`], and, where
    /// there are others, `e` made an error the caller moves on from (a replica that is full
    /// or serves another model may not be the last word).
    pub fn failed(&self, i: usize, e: Error) -> Error {
        let replica = self.cool(i);
        if self.len() > 1 && !session_lost(&e) {
            return Error::Unavailable {
                node: self.node,
                endpoint: replica.address.url.clone(),
                reason: tandem_proto::error_chain(&e),
            };
        }
        e
    }

    /// Replica `i`, modulo their number (never none: [`Self::connect`] starts from the one that
    /// answered, and a refresh keeps the list when it would empty it).
    fn at(&self, i: usize) -> Arc<Replica> {
        let replicas = self.snapshot();
        Arc::clone(&replicas[i % replicas.len()])
    }

    /// Replica `i` (modulo their number), its info checked against the model's the first time.
    pub async fn get(&self, i: usize) -> Result<NodeHandle> {
        let replica = self.at(i);
        if !replica.checked.load(Ordering::Relaxed) {
            return self.recheck(i).await;
        }
        Ok(replica.handle.clone())
    }

    /// Replica `i`, its info read again (after a lost session: the node may have come back
    /// serving another model, which is refused).
    pub async fn recheck(&self, i: usize) -> Result<NodeHandle> {
        let replica = self.at(i);
        replica.handle.check_same(self.node).await?;
        replica.checked.store(true, Ordering::Relaxed);
        Ok(replica.handle.clone())
    }

    /// What replica `i` says of session `id` (`session_working`, `session_answered`), where
    /// it answers in time ([`info_within`]).
    pub async fn info_on(&self, i: usize, id: &str) -> Option<v1::NodeInfo> {
        let ask = v1::InfoRequest {
            session_id: id.to_string(),
        };
        info_within(&self.at(i).handle.channel, ask).await
    }

    /// Replica `chosen`, then the others: where a draft session that lost `chosen` is opened
    /// again, each while it answers. (Their info is not read first: a draft can change the
    /// speed of a generation, never its output.)
    pub fn fallbacks(&self, chosen: &NodeHandle) -> Vec<Reachable> {
        let mut snapshot = self.snapshot();
        snapshot.sort_by_key(|r| r.handle.endpoint != chosen.endpoint);
        let reachable = snapshot.iter().map(|r| Reachable {
            channel: r.handle.channel.clone(),
            health: Arc::clone(&r.health),
        });
        reachable.collect()
    }

    /// No session, for `e`, from replica `i`.
    pub fn refused<W: Wire>(&self, i: usize, e: Error) -> Opened<W> {
        Opened {
            handle: self.at(i).handle.clone(),
            session: Err(e),
        }
    }

    /// Opens a session holding `log` on replica `i`, or (that one lost, unreachable or serving
    /// another model) on the next that answers; the session knows its replica.
    pub async fn open<W: Wire>(&self, i: usize, spec: &SessionSpec, log: &TokenLog) -> Opened<W> {
        let n = self.len();
        let mut last = None;
        let some_up = self.all_down().is_none();
        for i in (i..i + n).map(|i| i % n) {
            if some_up && self.at(i).health.is_down() {
                continue;
            }
            let handle = match self.get(i).await {
                Ok(handle) => handle,
                Err(e) => {
                    last = Some((self.at(i).handle.clone(), self.failed(i, e)));
                    continue;
                }
            };
            match NodeSession::<W>::open(handle.channel.clone(), spec.clone(), log).await {
                Ok(mut session) => {
                    self.at(i).health.answered();
                    session.replica = i;
                    self.remember(&spec.cache_salt, log.tokens(), i);
                    return Opened {
                        handle,
                        session: Ok(session),
                    };
                }
                // Lost, unreachable or full: the next one may take it.
                Err(e) if n > 1 && (session_lost(&e) || e.code() == Code::ResourceExhausted) => {
                    tracing::warn!(node = self.node, replica = %handle.endpoint,
                        error = %tandem_proto::error_chain(&e), "replica unavailable: trying the next");
                    self.cool(i);
                    last = Some((handle, e));
                }
                Err(e) => {
                    return Opened {
                        handle,
                        session: Err(e),
                    };
                }
            }
        }
        let (handle, e) = last.unwrap_or_else(|| {
            let why = Error::NotReady(format!("no {} replica", self.node));
            (self.model.clone(), why)
        });
        Opened {
            handle,
            session: Err(e),
        }
    }
}

/// A lazily connected replica at `address`, expected to serve `model`'s model.
fn replica(
    node: &'static str,
    model: &NodeHandle,
    address: Address,
    tls: &ClientTls,
    checked: bool,
    wake: &Arc<Notify>,
) -> Result<Arc<Replica>> {
    let handle = if checked {
        model.clone()
    } else {
        let channel = tls
            .endpoint_named(
                &address.url,
                address.name.as_deref(),
                Duration::from_secs(10),
            )
            .map_err(|reason| Error::Unavailable {
                node,
                endpoint: address.url.clone(),
                reason,
            })?
            .connect_lazy();
        NodeHandle {
            endpoint: address.url.clone(),
            channel,
            info: model.info.clone(),
        }
    };
    Ok(Arc::new(Replica {
        handle,
        load: AtomicUsize::new(0),
        checked: AtomicBool::new(checked),
        failed: std::sync::Mutex::new(None),
        rtt_micros: AtomicU64::new(0),
        health: Arc::new(Health::new(node, &address.url, Arc::clone(wake))),
        address,
    }))
}

/// The node's answer to `ask` over `channel`, if it comes within [`PROBE_DEADLINE`] (a node
/// answers `Info` from memory, however busy its model).
async fn info_within(
    channel: &tonic::transport::Channel,
    ask: v1::InfoRequest,
) -> Option<v1::NodeInfo> {
    let mut client = v1::node_service_client::NodeServiceClient::new(channel.clone());
    let reply = tokio::time::timeout(PROBE_DEADLINE, client.info(ask)).await;
    Some(reply.ok()?.ok()?.into_inner())
}

/// Measures each replica's round trip every [`PROBE`] (an `Info` call, which the node answers
/// from memory) until the replicas are dropped; one that does not answer within
/// [`PROBE_DEADLINE`] is down, one that does is up, and while one is down they are asked every
/// [`DOWN_PROBE`].
async fn probe(replicas: Weak<RwLock<Vec<Arc<Replica>>>>, wake: Arc<Notify>) {
    loop {
        let Some(current) = replicas
            .upgrade()
            .map(|r| r.read().unwrap_or_else(|e| e.into_inner()).clone())
        else {
            return;
        };
        for r in &current {
            let start = Instant::now();
            let answered = info_within(&r.handle.channel, v1::InfoRequest::default())
                .await
                .is_some();
            let micros = if answered {
                r.health.answered();
                u64::try_from(start.elapsed().as_micros())
                    .unwrap_or(u64::MAX)
                    .max(1)
            } else {
                r.health
                    .missed(&format!("no answer to a probe within {PROBE_DEADLINE:?}"));
                0
            };
            r.rtt_micros.store(micros, Ordering::Relaxed);
        }
        let any_down = current.iter().any(|r| r.health.is_down());
        let next = tokio::time::sleep(if any_down { DOWN_PROBE } else { PROBE });
        tokio::select! {
            () = next => {}
            () = wake.notified() => {}
        }
    }
}

/// Resolves the host names of `urls` again every [`REFRESH`] until the replicas are dropped:
/// new addresses become replicas, vanished ones are no longer offered.
async fn refresh(
    node: &'static str,
    replicas: Weak<RwLock<Vec<Arc<Replica>>>>,
    model: NodeHandle,
    urls: Vec<String>,
    tls: ClientTls,
    wake: Arc<Notify>,
) {
    loop {
        tokio::time::sleep(REFRESH).await;
        let mut found = Vec::new();
        for url in &urls {
            found.push((url, resolve(url).await));
        }
        let Some(replicas) = replicas.upgrade() else {
            return;
        };
        let current = replicas.read().unwrap_or_else(|e| e.into_inner()).clone();
        let mut next: Vec<Arc<Replica>> = Vec::new();
        for (url, addresses) in found {
            // A name that does not resolve now (a resolver timeout, no ready pod) keeps what
            // it had: the sessions there decide whether its replicas are alive.
            let Some(addresses) = addresses else {
                let host = host_name(url).map(|h| h.1);
                let kept = current
                    .iter()
                    .filter(|r| r.address.name == host || r.address.url == *url);
                next.extend(kept.cloned());
                continue;
            };
            for a in addresses {
                if next.iter().any(|r| r.address == a) {
                    continue;
                }
                match current.iter().find(|r| r.address == a) {
                    Some(r) => next.push(Arc::clone(r)),
                    None => {
                        tracing::info!(node, replica = %a.url, "replica found");
                        next.extend(replica(node, &model, a, &tls, false, &wake).ok());
                    }
                }
            }
        }
        for gone in current
            .iter()
            .filter(|r| !next.iter().any(|n| n.address == r.address))
        {
            tracing::info!(node, replica = %gone.address.url, "replica gone");
        }
        if !next.is_empty() {
            *replicas.write().unwrap_or_else(|e| e.into_inner()) = next;
        }
    }
}

/// The host of `url` when it is a name, not an address.
fn host_name(url: &str) -> Option<(String, String, u16)> {
    let uri: tonic::codegen::http::Uri = url.parse().ok()?;
    let host = uri.host()?.trim_matches(['[', ']']).to_string();
    if host.parse::<IpAddr>().is_ok() {
        return None;
    }
    let scheme = uri.scheme_str().unwrap_or("http").to_string();
    let port = uri
        .port_u16()
        .unwrap_or(if scheme == "https" { 443 } else { 80 });
    Some((scheme, host, port))
}

/// The addresses of `url`: itself when its host is an address; each address of its host name
/// (sorted); `None` when the name does not resolve now.
async fn resolve(url: &str) -> Option<Vec<Address>> {
    let Some((scheme, host, port)) = host_name(url) else {
        return Some(vec![Address {
            url: url.to_string(),
            name: None,
        }]);
    };
    let mut ips: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), port))
        .await
        .ok()?
        .collect();
    ips.sort();
    ips.dedup();
    let addresses = ips.into_iter().map(|a| Address {
        url: format!("{scheme}://{a}"),
        name: Some(host.clone()),
    });
    Some(addresses.collect())
}

/// Every address of every URL, in order, without repeats; a name that does not resolve now is
/// its URL as given (connecting will say why).
async fn resolve_all(urls: &[String]) -> Vec<Address> {
    let mut out: Vec<Address> = Vec::new();
    for url in urls {
        let addresses = resolve(url).await.unwrap_or_else(|| {
            vec![Address {
                url: url.clone(),
                name: None,
            }]
        });
        for a in addresses {
            if !out.contains(&a) {
                out.push(a);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
