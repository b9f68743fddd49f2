//! The real binaries as processes: built on demand, listening on ports the system chose (which
//! they print), reported with their standard error when they fail, killed when dropped.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
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

/// The path of binary `name`, brought up to date by cargo once per test process: `cargo test`
/// builds only the binaries of the packages whose tests use them, and a binary left from an
/// earlier build would run the code as it was then. Built with the workspace's tests, so that
/// its dependencies carry the features `cargo test --workspace` built them with (the
/// dev-dependencies' too) and are reused: built alone, 78 of them were built a second time, 5 of
/// the suite's minutes on 2 cores. With `TANDEM_PREBUILT` set (a machine with
/// the binaries carried beside the test's folder and no cargo, as the GPU machine), as they are.
pub fn binary(name: &str) -> PathBuf {
    if std::env::var_os("TANDEM_PREBUILT").is_some() {
        return profile_dir().join(name);
    }
    static BUILT: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut built = BUILT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = profile_dir();
    if !built.iter().any(|b| b == name) {
        let mut build = cargo();
        build
            .args(["build", "--quiet", "--workspace", "--tests", "--bin", name])
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        if dir.file_name().is_some_and(|n| n == "release") {
            build.arg("--release");
        }
        let status = build.status().expect("run cargo build");
        assert!(status.success(), "cargo build --bin {name} failed");
        built.push(name.to_string());
    }
    dir.join(name)
}

/// Cargo, for a build from a test: without what `cargo test` set for this test process to
/// describe its package. A build script that watches one of those variables (ring's,
/// `CARGO_MANIFEST_DIR`) would see it change, and the build here and the next `cargo test`
/// would each rebuild it and all above it (after the CUDA check ran with them, the next
/// binaries' build took 4 minutes).
pub fn cargo() -> Command {
    let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    without_package_env(&mut cargo);
    cargo
}

/// `command` without the variables `cargo test` set to describe this test's package (for a
/// command that runs cargo: [`cargo`]).
pub fn without_package_env(command: &mut Command) -> &mut Command {
    for (key, _) in std::env::vars_os() {
        let package = key.to_str().is_some_and(|k| {
            ["CARGO_MANIFEST_", "CARGO_PKG_", "CARGO_BIN_EXE_"]
                .iter()
                .any(|p| k.starts_with(p))
                || [
                    "CARGO_CRATE_NAME",
                    "CARGO_PRIMARY_PACKAGE",
                    "CARGO_TARGET_TMPDIR",
                ]
                .contains(&k)
        });
        if package {
            command.env_remove(key);
        }
    }
    command
}

/// How long a process may take to load its model and listen.
const START: Duration = Duration::from_secs(120);
/// How much of a child's standard error is kept to report when it fails.
const STDERR_KEPT: usize = 64 * 1024;

/// A child process, killed on drop. It listens where it said it does (`--listen 127.0.0.1:0`: the
/// system chose the port and the process printed it), so no port is picked by one process and
/// bound by another.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    pub child: Child,
    /// The gRPC address it listens on.
    pub addr: SocketAddr,
    /// Every address it announced, by name (`grpc`, `http`, `metrics`).
    listening: HashMap<String, SocketAddr>,
    /// The end of its standard error, unless it was sent to the file `log`.
    stderr: Arc<Mutex<Vec<u8>>>,
    log: Option<PathBuf>,
}

impl Proc {
    /// Starts `name` with `args` (which should make it listen on port 0, or on an address of
    /// its own network namespace) and waits until it says where it listens.
    pub fn start(name: &str, args: &[&str]) -> Self {
        Self::start_with_env(name, args, &[])
    }

    /// A node (`target-node` or `draft-node`) serving `model` on a free loopback port, with
    /// `extra` arguments.
    pub fn node(name: &str, model: &Path, extra: &[&str]) -> Self {
        Self::node_on(name, model, extra, None)
    }

    /// [`Self::node`] pinned to the CPUs `cpus` names, where it names some
    /// ([`Self::start_pinned`]).
    pub fn node_on(name: &str, model: &Path, extra: &[&str], cpus: Option<&str>) -> Self {
        let model = model.display().to_string();
        let mut args = vec!["--model", &model, "--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        match cpus {
            Some(cpus) => Self::start_pinned(name, &args, cpus),
            None => Self::start(name, &args),
        }
    }

    /// [`Self::start`] with extra environment variables.
    pub fn start_with_env(name: &str, args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::spawn(name, Self::command(name, args, env), None)
    }

    /// [`Self::start_with_env`], its standard error written to the file `log`.
    pub fn start_logged(name: &str, args: &[&str], env: &[(&str, &str)], log: &Path) -> Self {
        let mut command = Self::command(name, args, env);
        command.stderr(std::fs::File::create(log).expect("log file"));
        Self::spawn(name, command, Some(log))
    }

    /// [`Self::start`] on `host` (its network namespace).
    pub fn start_on(host: &crate::netns::Host, name: &str, args: &[&str]) -> Self {
        let mut command = host.command(&binary(name));
        command.env("RUST_LOG", log_level()).args(args);
        Self::spawn(name, command, None)
    }

    fn command(name: &str, args: &[&str], env: &[(&str, &str)]) -> Command {
        let mut command = Command::new(binary(name));
        command
            .env("RUST_LOG", log_level())
            .args(args)
            .envs(env.iter().copied());
        command
    }

    /// [`Self::start`] on the CPUs `cpus` names (`taskset -c`): one machine's cores for one
    /// node, as when two machines are emulated on one.
    pub fn start_pinned(name: &str, args: &[&str], cpus: &str) -> Self {
        let mut command = Command::new("taskset");
        // The node sizes its thread pools to the CPUs it may run on: pools inherited from this
        // process (sized to the whole machine) would fight over the one core.
        command
            .env("RUST_LOG", log_level())
            .env_remove("RAYON_NUM_THREADS")
            .env_remove("CANDLE_NUM_THREADS")
            .args(["-c", cpus])
            .arg(binary(name))
            .args(args);
        Self::spawn(name, command, None)
    }

    /// Spawns `command` and waits for its `listening grpc=ADDR ...` line; a child that exits
    /// first, or says nothing within [`START`], fails the test with its standard error.
    fn spawn(name: &str, mut command: Command, log: Option<&Path>) -> Self {
        use std::io::{BufRead, Read};
        command.stdout(Stdio::piped());
        if log.is_none() {
            command.stderr(Stdio::piped());
        }
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        let stderr = Arc::new(Mutex::new(Vec::new()));
        if let Some(mut pipe) = child.stderr.take() {
            let kept = Arc::clone(&stderr);
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = pipe.read(&mut buf) {
                    let mut kept = kept.lock().unwrap_or_else(PoisonError::into_inner);
                    kept.extend_from_slice(&buf[..n]);
                    let excess = kept.len().saturating_sub(STDERR_KEPT);
                    kept.drain(..excess);
                }
            });
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            // Read to the end: a child must never block on a full pipe.
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.strip_prefix("listening ") {
                    let _ = tx.send(rest.to_string());
                }
            }
        });
        let mut proc = Self {
            name: name.to_string(),
            child,
            addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            listening: HashMap::new(),
            stderr,
            log: log.map(Path::to_path_buf),
        };
        let deadline = Instant::now() + START;
        let line = loop {
            // Disconnected: stdout closed, the child is exiting (seen below).
            if let Ok(line) = rx.recv_timeout(Duration::from_millis(50)) {
                break line;
            }
            if let Ok(Some(status)) = proc.child.try_wait() {
                panic!(
                    "{name} exited before it listened: {status}{}",
                    proc.stderr_tail()
                );
            }
            assert!(
                Instant::now() < deadline,
                "{name} did not say where it listens within {START:?}{}",
                proc.stderr_tail()
            );
        };
        proc.listening = line
            .split_whitespace()
            .filter_map(|pair| {
                let (key, addr) = pair.split_once('=')?;
                Some((key.to_string(), addr.parse().ok()?))
            })
            .collect();
        proc.addr = proc.listening("grpc");
        proc
    }

    /// The address it announced as `name` (`grpc`, `http`, `metrics`).
    pub fn listening(&self, name: &str) -> SocketAddr {
        *self.listening.get(name).unwrap_or_else(|| {
            panic!(
                "{} announced no {name} listener: {:?}",
                self.name, self.listening
            )
        })
    }

    /// Its HTTP listener (`--http-listen 127.0.0.1:0`).
    pub fn http(&self) -> SocketAddr {
        self.listening("http")
    }

    /// The end of its standard error, to put in a failure's message.
    pub fn stderr_tail(&self) -> String {
        let mut kept = match &self.log {
            Some(log) => std::fs::read(log).unwrap_or_default(),
            None => self
                .stderr
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        };
        kept.drain(..kept.len().saturating_sub(STDERR_KEPT));
        if kept.is_empty() {
            return format!("\n({} wrote nothing on stderr)", self.name);
        }
        format!(
            "\n--- {} stderr (last {} bytes) ---\n{}",
            self.name,
            kept.len(),
            String::from_utf8_lossy(&kept)
        )
    }

    /// A coordinator's arguments that keep no tenant's earlier outputs: for benchmarks that
    /// repeat one prompt, whose repeats n-gram lookup would otherwise draft whole from the
    /// first run's output (a cache hit, not the speed of speculation).
    pub const NO_HISTORY: [&str; 2] = ["--history-tokens", "0"];

    /// `coordinator serve` in front of the target-node and draft-node at these URLs, on a free
    /// loopback port, with `extra` arguments; pinned to `cpus` when given. Returns once it is
    /// ready (it has reached its nodes).
    pub fn coordinator(
        target_url: &str,
        draft_url: &str,
        extra: &[&str],
        cpus: Option<&str>,
    ) -> Self {
        let coordinator = Self::coordinator_starting(target_url, draft_url, extra, cpus);
        coordinator.wait_ready();
        coordinator
    }

    /// `coordinator serve` with both models in its own process (`--target-model`,
    /// `--draft-model`: one machine), on a free loopback port, with `extra` arguments. Returns
    /// once it is ready.
    pub fn coordinator_serving(target: &Path, draft: &Path, extra: &[&str]) -> Self {
        let (target, draft) = (target.display().to_string(), draft.display().to_string());
        let mut args = vec![
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--target-model",
            &target,
            "--draft-model",
            &draft,
        ];
        args.extend_from_slice(extra);
        let coordinator = Self::start("coordinator", &args);
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
        let ready = std::thread::spawn(move || {
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
                let deadline = Instant::now() + START;
                while Instant::now() < deadline {
                    let status = health
                        .check(tonic_health::pb::HealthCheckRequest {
                            service: "tandem.v1.Coordinator".into(),
                        })
                        .await
                        .map(|r| r.into_inner().status)
                        .ok();
                    if status == Some(ServingStatus::Serving as i32) {
                        return true;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                false
            })
        })
        .join()
        .expect("waiting for the coordinator");
        assert!(
            ready,
            "the coordinator at {url} was not ready within {START:?}{}",
            self.stderr_tail()
        );
    }

    /// [`Self::coordinator`], returning as soon as it listens (before it has reached its nodes).
    pub fn coordinator_starting(
        target_url: &str,
        draft_url: &str,
        extra: &[&str],
        cpus: Option<&str>,
    ) -> Self {
        Self::serving("coordinator", (target_url, draft_url), extra, cpus)
    }

    /// [`Self::coordinator`] from the binary `name` beside the others (with `TANDEM_PREBUILT`:
    /// a build from before a change, copied there under another name), no extra arguments.
    pub fn coordinator_named(name: &str, target_url: &str, draft_url: &str, cpus: &str) -> Self {
        let coordinator = Self::serving(name, (target_url, draft_url), &[], Some(cpus));
        coordinator.wait_ready();
        coordinator
    }

    /// `name serve` in front of the target-node and draft-node at `nodes`' URLs.
    fn serving(name: &str, nodes: (&str, &str), extra: &[&str], cpus: Option<&str>) -> Self {
        let mut args = vec![
            "serve",
            "--target",
            nodes.0,
            "--draft",
            nodes.1,
            "--listen",
            "127.0.0.1:0",
        ];
        args.extend_from_slice(extra);
        match cpus {
            Some(cpus) => Self::start_pinned(name, &args, cpus),
            None => Self::start(name, &args),
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
        // A failing test says what its processes said.
        if std::thread::panicking() {
            eprintln!("{}", self.stderr_tail());
        }
    }
}

/// The children's log level: warnings only, unless the caller asks for more (`RUST_LOG`).
fn log_level() -> String {
    std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into())
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
