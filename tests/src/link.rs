//! A link emulator: a TCP proxy on 127.0.0.1 that delays every byte by a one-way latency and
//! caps the bandwidth, in both directions (a draft-node on an edge box 20 ms away, behind a
//! 10 Mbit/s uplink). netem is not available here; this does in user space what it would.
//!
//! Each direction is a queue: a chunk read at time t leaves the link at
//! `max(t, link free) + bytes · 8 / rate` and is written `delay` later, so a burst waits behind
//! the bytes before it, as on a real link. With no delay and no cap it is a plain relay whose
//! upstream a test may set late or change. [`Link::silence`] makes it a silent link: connections
//! stay open (no reset, no FIN, new ones accepted) but no byte crosses until it is healed, when
//! what was held is delivered.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// What a link does to traffic.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkSpec {
    /// Round-trip time (half of it each way).
    pub rtt: Duration,
    /// Bits per second each way; `None`: unlimited.
    pub bits_per_second: Option<f64>,
}

impl LinkSpec {
    /// No delay, no cap: a plain relay.
    pub const DIRECT: Self = Self {
        rtt: Duration::ZERO,
        bits_per_second: None,
    };

    pub fn label(&self) -> String {
        let rate = match self.bits_per_second {
            Some(b) => format!("{:.0} Mbit/s", b / 1e6),
            None => "unlimited".into(),
        };
        format!("RTT {} ms, {rate}", self.rtt.as_millis())
    }
}

/// A running link; serves until the runtime it was started on ends. Its upstream may be set
/// later or changed (the stable address of a Service whose node is not up yet, or came back
/// elsewhere): until it is first set, the port is bound but not listening, so connections are
/// refused as by a machine where nothing listens yet.
#[derive(Debug)]
pub struct Link {
    pub addr: SocketAddr,
    spec: LinkSpec,
    upstream: Arc<Mutex<Option<SocketAddr>>>,
    /// The bound socket, until [`Self::point_to`] makes it listen.
    socket: Mutex<Option<TcpSocket>>,
    /// Whether it holds every byte ([`Self::silence`]).
    silent: watch::Sender<bool>,
    /// Bytes it has carried toward the upstream.
    carried: Arc<std::sync::atomic::AtomicU64>,
}

impl Link {
    /// Starts a link on 127.0.0.1:0 in front of `upstream` (call inside a tokio runtime).
    pub async fn start(upstream: SocketAddr, spec: LinkSpec) -> std::io::Result<Self> {
        let link = Self::unbound(spec)?;
        link.point_to(upstream);
        Ok(link)
    }

    /// A link on 127.0.0.1:0 with no upstream yet: see [`Self::point_to`].
    pub fn unbound(spec: LinkSpec) -> std::io::Result<Self> {
        let socket = TcpSocket::new_v4()?;
        socket.bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
        Ok(Self {
            addr: socket.local_addr()?,
            spec,
            upstream: Arc::default(),
            socket: Mutex::new(Some(socket)),
            silent: watch::Sender::new(false),
            carried: Arc::default(),
        })
    }

    /// Sends the connections made from now on to `upstream` (the first call starts listening;
    /// call inside a tokio runtime).
    pub fn point_to(&self, upstream: SocketAddr) {
        *self.upstream.lock().expect("upstream") = Some(upstream);
        let Some(socket) = self.socket.lock().expect("socket").take() else {
            return;
        };
        let listener = socket.listen(1024).expect("listen");
        let (to, spec) = (Arc::clone(&self.upstream), self.spec);
        let gate = Gate {
            silent: self.silent.subscribe(),
            carried: Arc::clone(&self.carried),
        };
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Some(upstream) = *to.lock().expect("upstream") else {
                    continue;
                };
                let gate = gate.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        carry(client, server, spec, gate).await;
                    }
                });
            }
        });
    }

    /// Silences the link (`true`: every byte held, connections kept open, as behind a router
    /// that stopped forwarding) or heals it (`false`: what was held is delivered).
    pub fn silence(&self, silent: bool) {
        self.silent.send_replace(silent);
    }

    /// Bytes carried toward the upstream so far (held ones not counted).
    pub fn carried(&self) -> u64 {
        self.carried.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// What every connection's bytes wait for: the link not being silent; and where bytes toward
/// the upstream are counted.
#[derive(Debug, Clone)]
struct Gate {
    silent: watch::Receiver<bool>,
    carried: Arc<std::sync::atomic::AtomicU64>,
}

async fn carry(client: TcpStream, server: TcpStream, spec: LinkSpec, gate: Gate) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let back = Gate {
        carried: Arc::default(),
        ..gate.clone()
    };
    tokio::join!(
        direction(client_read, server_write, spec, gate),
        direction(server_read, client_write, spec, back)
    );
}

/// One direction: a reader stamps each chunk with its delivery time, a writer delivers it then.
async fn direction(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    spec: LinkSpec,
    mut gate: Gate,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let one_way = spec.rtt / 2;
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut free_at = Instant::now();
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let now = Instant::now();
            let sent = match spec.bits_per_second {
                Some(rate) => {
                    free_at = free_at.max(now) + Duration::from_secs_f64(n as f64 * 8.0 / rate);
                    free_at
                }
                None => now,
            };
            if tx.send((sent + one_way, buf[..n].to_vec())).is_err() {
                break;
            }
        }
    };
    let writer = async move {
        while let Some((at, bytes)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if gate.silent.wait_for(|silent| !silent).await.is_err()
                || to.write_all(&bytes).await.is_err()
            {
                break;
            }
            let n = bytes.len() as u64;
            gate.carried
                .fetch_add(n, std::sync::atomic::Ordering::SeqCst);
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}
