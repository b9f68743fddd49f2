//! The real binaries as processes: built on demand, started on free loopback ports, killed when
//! dropped.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The workspace's target directory, found from this test executable
/// (`target/<profile>/deps/<test>`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .to_path_buf()
}

/// The path of binary `name`, built first if this test run has not built it.
pub fn binary(name: &str) -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = profile_dir();
    let path = dir.join(name);
    if !path.exists() {
        // `cargo test` builds only the binaries of the packages whose tests use them.
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut build = Command::new(cargo);
        build
            .args(["build", "--workspace", "--bin", name])
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        if dir.file_name().is_some_and(|n| n == "release") {
            build.arg("--release");
        }
        let status = build.status().expect("run cargo build");
        assert!(status.success(), "cargo build --bin {name} failed");
    }
    path
}

/// A free loopback port (bound, then released for the child to take).
///
/// The port is below the system's ephemeral range: a port the system hands out (`:0`) is free
/// now, but any outgoing connection on the machine may take it before the process meant to
/// listen there starts (seen in CI: a coordinator started after its two nodes found its HTTP
/// port in use). Ports are tried from a point that differs per process and per call.
pub fn free_addr() -> SocketAddr {
    use std::sync::atomic::{AtomicU32, Ordering};
    static CALLS: AtomicU32 = AtomicU32::new(0);
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    let (first, span) = (10_000, ephemeral.saturating_sub(10_000).max(1));
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    let start = std::process::id()
        .wrapping_mul(7919)
        .wrapping_add(call.wrapping_mul(97));
    (0..span)
        .map(|i| first + start.wrapping_add(i) % span)
        .filter_map(|port| u16::try_from(port).ok())
        .find_map(|port| {
            TcpListener::bind(("127.0.0.1", port))
                .and_then(|l| l.local_addr())
                .ok()
        })
        .unwrap_or_else(|| {
            TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("free port")
        })
}

/// A child process, killed on drop.
#[derive(Debug)]
pub struct Proc {
    pub child: Child,
    pub addr: SocketAddr,
}

impl Proc {
    /// Starts `name` with `args` (which should make it listen on `addr`) and waits until it
    /// accepts connections.
    pub fn start(name: &str, args: &[&str], addr: SocketAddr) -> Self {
        Self::start_with_env(name, args, addr, &[])
    }

    /// [`Self::start`] with extra environment variables.
    pub fn start_with_env(
        name: &str,
        args: &[&str],
        addr: SocketAddr,
        env: &[(&str, &str)],
    ) -> Self {
        Self::spawn(name, Self::command(name, args, env), addr)
    }

    /// [`Self::start_with_env`], its standard error written to the file `log`.
    pub fn start_logged(
        name: &str,
        args: &[&str],
        addr: SocketAddr,
        env: &[(&str, &str)],
        log: &Path,
    ) -> Self {
        let mut command = Self::command(name, args, env);
        command.stderr(std::fs::File::create(log).expect("log file"));
        Self::spawn(name, command, addr)
    }

    /// [`Self::start`] on `host` (its network namespace).
    pub fn start_on(
        host: &crate::netns::Host,
        name: &str,
        args: &[&str],
        addr: SocketAddr,
    ) -> Self {
        let log = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
        let mut command = Command::new("ip");
        command
            .env("RUST_LOG", log)
            .args(host.exec_prefix())
            .arg(binary(name))
            .args(args);
        Self::spawn(name, command, addr)
    }

    fn command(name: &str, args: &[&str], env: &[(&str, &str)]) -> Command {
        let mut command = Command::new(binary(name));
        // Warnings only, unless the caller asks for more.
        let log = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
        command
            .env("RUST_LOG", log)
            .args(args)
            .envs(env.iter().copied());
        command
    }

    /// [`Self::start`] on the CPUs `cpus` names (`taskset -c`): one machine's cores for one
    /// node, as when two machines are emulated on one.
    pub fn start_pinned(name: &str, args: &[&str], addr: SocketAddr, cpus: &str) -> Self {
        let mut command = Command::new("taskset");
        // The node sizes its thread pools to the CPUs it may run on: pools inherited from this
        // process (sized to the whole machine) would fight over the one core.
        // Warnings only, unless the caller asks for more.
        let log = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
        command
            .env("RUST_LOG", log)
            .env_remove("RAYON_NUM_THREADS")
            .env_remove("CANDLE_NUM_THREADS")
            .args(["-c", cpus])
            .arg(binary(name))
            .args(args);
        Self::spawn(name, command, addr)
    }

    fn spawn(name: &str, mut command: Command, addr: SocketAddr) -> Self {
        let child = command
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        let mut proc = Self { child, addr };
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(addr).is_err() {
            if let Ok(Some(status)) = proc.child.try_wait() {
                panic!("{name} exited early: {status}");
            }
            assert!(Instant::now() < deadline, "{name} did not listen on {addr}");
            std::thread::sleep(Duration::from_millis(50));
        }
        proc
    }

    /// `coordinator serve` in front of the target-node and draft-node at these URLs, listening
    /// on `addr`, with `extra` arguments; pinned to `cpus` when given. Returns once it is ready
    /// (it has reached its nodes).
    pub fn coordinator(
        target_url: &str,
        draft_url: &str,
        addr: SocketAddr,
        extra: &[&str],
        cpus: Option<&str>,
    ) -> Self {
        let coordinator = Self::coordinator_starting(target_url, draft_url, addr, extra, cpus);
        coordinator.wait_ready();
        coordinator
    }

    /// Waits until the coordinator here says it serves (gRPC health: once it has reached its
    /// nodes; open to callers without an API key).
    pub fn wait_ready(&self) {
        let url = self.url();
        self.wait_ready_at(tonic::transport::Endpoint::from_shared(url).expect("URL"));
    }

    /// [`Self::wait_ready`] over `endpoint` (e.g. with TLS).
    pub fn wait_ready_at(&self, endpoint: tonic::transport::Endpoint) {
        let url = endpoint.uri().to_string();
        // A runtime of its own, on a thread of its own: callers may be async tests.
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async {
                use tonic_health::pb::health_check_response::ServingStatus;
                // One connection for every check (it is up: the port listens): a connection
                // per check would take an ephemeral port each time.
                let channel = endpoint.connect_lazy();
                let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
                let deadline = Instant::now() + Duration::from_secs(60);
                loop {
                    let status = health
                        .check(tonic_health::pb::HealthCheckRequest {
                            service: "tandem.v1.Coordinator".into(),
                        })
                        .await
                        .map(|r| r.into_inner().status)
                        .ok();
                    if status == Some(ServingStatus::Serving as i32) {
                        return;
                    }
                    assert!(
                        Instant::now() < deadline,
                        "the coordinator at {url} never got ready"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            });
        })
        .join()
        .expect("waiting for the coordinator");
    }

    /// [`Self::coordinator`], returning as soon as it listens (before it has reached its nodes).
    pub fn coordinator_starting(
        target_url: &str,
        draft_url: &str,
        addr: SocketAddr,
        extra: &[&str],
        cpus: Option<&str>,
    ) -> Self {
        let listen = addr.to_string();
        let mut args = vec![
            "serve", "--target", target_url, "--draft", draft_url, "--listen", &listen,
        ];
        args.extend_from_slice(extra);
        match cpus {
            Some(cpus) => Self::start_pinned("coordinator", &args, addr, cpus),
            None => Self::start("coordinator", &args, addr),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Sends SIGKILL: the machine's plug pulled.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs `coordinator generate --json` with `args` and `env` in the repository root, checks the
/// statistics it prints, and returns its token ids.
pub fn generate_cli(args: &[&str], env: &[(&str, &str)]) -> Vec<u32> {
    let out = Command::new(binary("coordinator"))
        .args(["generate", "--json", "--no-baseline", "--ignore-eos"])
        .args(args)
        .envs(env.iter().copied())
        .current_dir(crate::fixtures().join(".."))
        .output()
        .expect("run coordinator generate");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    for key in [
        "generated_tokens",
        "rounds",
        "drafted",
        "accepted",
        "acceptance_rate",
        "mean_accepted_length",
        "tokens_per_second",
    ] {
        assert!(json["stats"][key].is_number(), "stats.{key} in {json}");
    }
    assert!(json["text"].is_string());
    json["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect()
}
