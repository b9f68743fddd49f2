//! The Kubernetes manifests in deploy/k8s: the base and every overlay render and validate
//! against the Kubernetes schemas (kubernetes-validate, offline; the Prometheus operator's
//! ServiceMonitor against deploy/k8s/schemas), and a broken manifest fails; the coordinator's
//! API keys come from a Secret in every overlay and from a file in the compose file; the
//! mutual-TLS component's certificate script makes per-role certificates (a target-node admits
//! the coordinator's, not a draft-node's), which the compose file mounts one per process; the
//! Grafana dashboard and the autoscaler query only metrics docs/metrics.md documents.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tandem_tests::python::python_with;

fn k8s_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/k8s")
}

fn validate(dir: &Path) -> Output {
    let python = python_with(&[
        ("kubernetes_validate", "kubernetes-validate"),
        ("yaml", "pyyaml"),
    ]);
    Command::new(python)
        .arg(k8s_dir().join("validate.py"))
        .arg(dir)
        .output()
        .expect("run validate.py")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read dir") {
        let path = entry.expect("entry").path();
        let dest = to.join(path.file_name().expect("name"));
        if path.is_dir() {
            copy_dir(&path, &dest);
        } else {
            std::fs::copy(&path, &dest).expect("copy");
        }
    }
}

#[test]
fn manifests_validate_against_the_kubernetes_schemas() {
    let out = validate(&k8s_dir());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for target in ["base", "gpu", "cpu", "cpu-hub", "edge-mtls", "monitoring"] {
        assert!(
            text.contains(&format!("{target}: rendered and checked")),
            "{text}"
        );
    }
    assert!(text.contains(" 0 invalid"), "{text}");
}

#[test]
fn a_broken_manifest_is_caught_and_named() {
    let scratch = tempfile::tempdir().expect("temp dir");
    copy_dir(&k8s_dir(), scratch.path());
    let hpa = scratch.path().join("base/coordinator.yaml");
    let text = std::fs::read_to_string(&hpa).expect("read");
    std::fs::write(&hpa, text.replace("minReplicas: 2", "minReplicas: two")).expect("write");
    let out = validate(scratch.path());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("HorizontalPodAutoscaler/coordinator: spec.minReplicas"),
        "{text}"
    );

    // A misspelt field of a ServiceMonitor (a kind Kubernetes does not define) too.
    copy_dir(&k8s_dir(), scratch.path());
    let monitors = scratch
        .path()
        .join("components/monitoring/servicemonitors.yaml");
    let text = std::fs::read_to_string(&monitors).expect("read");
    std::fs::write(&monitors, text.replacen("port: http", "prot: http", 1)).expect("write");
    let out = validate(scratch.path());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains(
            "monitoring: servicemonitors.yaml: ServiceMonitor/coordinator: spec.endpoints.0"
        ),
        "{text}"
    );
}

/// Every `tandem_*` metric name in `text`, a histogram's series (`_bucket`, `_sum`, `_count`)
/// named by their histogram.
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("tandem_"))
        .map(|w| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| w.strip_suffix(s).filter(|h| h.ends_with("_seconds")))
                .unwrap_or(w)
                .to_string()
        })
        .collect()
}

#[test]
fn the_dashboard_and_the_autoscaler_query_only_documented_metrics() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let doc = std::fs::read_to_string(root.join("docs/metrics.md")).expect("docs/metrics.md");
    let documented = metric_names(&doc);
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("deploy/grafana/tandem.json")).expect("dashboard"),
    )
    .expect("the dashboard is JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut queried = std::collections::BTreeSet::new();
    for panel in panels.iter().filter(|p| p["type"] != "row") {
        let targets = panel["targets"].as_array().expect("a panel's queries");
        assert!(!targets.is_empty(), "{panel}");
        for target in targets {
            let expr = target["expr"].as_str().expect("a PromQL query");
            let names = metric_names(expr);
            assert!(!names.is_empty(), "{expr} queries no Tandem metric");
            queried.extend(names);
        }
    }
    let autoscaler = std::fs::read_to_string(
        root.join("deploy/k8s/components/monitoring/target-node-autoscaler.yaml"),
    )
    .expect("autoscaler");
    let scaled_on = metric_names(&autoscaler);
    assert_eq!(
        scaled_on.iter().collect::<Vec<_>>(),
        ["tandem_num_requests_waiting"]
    );
    queried.extend(scaled_on);
    let undocumented: Vec<_> = queried.difference(&documented).collect();
    assert!(
        undocumented.is_empty(),
        "not in docs/metrics.md: {undocumented:?}"
    );
    // The dashboard shows the speculative metrics users read first.
    for name in [
        "tandem_spec_decode_num_accepted_tokens_total",
        "tandem_time_to_first_token_seconds",
        "tandem_round_part_seconds",
        "tandem_node_kv_cache_usage_perc",
    ] {
        assert!(queried.contains(name), "{name}");
    }
}

/// The info of the node at `addr`, asked with the certificate of `role` in `certs` (as
/// make-certs.sh writes them) and dialled by the name `node`, as in a cluster.
async fn info_as(
    addr: std::net::SocketAddr,
    certs: &Path,
    role: &str,
    node: &str,
) -> Result<tandem_proto::v1::NodeInfo, String> {
    let pem = |f: &str| std::fs::read(certs.join(role).join(f)).expect("read PEM");
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(pem("ca.crt")))
        .identity(tonic::transport::Identity::from_pem(
            pem("tls.crt"),
            pem("tls.key"),
        ))
        .domain_name(node);
    let channel = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
        .expect("URL")
        .tls_config(tls)
        .expect("TLS")
        .connect()
        .await
        .map_err(|e| tandem_proto::error_chain(&e))?;
    tandem_proto::v1::node_service_client::NodeServiceClient::new(channel)
        .info(tandem_proto::v1::InfoRequest::default())
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| format!("{s:?}"))
}

/// Runs make-certs.sh into `dir`; returns what it printed (the Secrets).
fn make_certs(dir: &Path) -> String {
    let out = Command::new(k8s_dir().join("components/mtls/make-certs.sh"))
        .arg(dir)
        .stdout(std::process::Stdio::piped())
        .output()
        .expect("run make-certs.sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A target-node serving mutual TLS with its certificate from make-certs.sh in `certs`, with
/// the environment `env` besides.
fn target_with_certs(certs: &Path, env: &[(&str, &str)]) -> tandem_tests::processes::Proc {
    let node = certs.join("target-node");
    let path = |f: &str| node.join(f).display().to_string();
    let (cert, key, ca) = (path("tls.crt"), path("tls.key"), path("ca.crt"));
    let model = tandem_tests::stories().display().to_string();
    tandem_tests::processes::Proc::start_with_env(
        "target-node",
        &[
            "--model",
            &model,
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--tls-client-ca",
            &ca,
        ],
        env,
    )
}

#[tokio::test]
async fn make_certs_writes_secrets_whose_certificates_a_node_accepts() {
    let dir = tempfile::tempdir().expect("temp dir");
    let yaml = make_certs(dir.path());
    for name in ["coordinator", "target-node", "draft-node"] {
        assert!(yaml.contains(&format!("name: tandem-tls-{name}")), "{yaml}");
    }
    assert_eq!(yaml.matches("  tls.key: ").count(), 3, "{yaml}");

    // The target-node serves mutual TLS with its certificate; the coordinator's is let in,
    // dialled by the name in the certificate: the Service's, as in a cluster.
    let target = target_with_certs(dir.path(), &[]);
    info_as(target.addr, dir.path(), "coordinator", "target-node")
        .await
        .expect("the node answers the coordinator's certificate");
    // A draft-node's certificate (server auth only) calls nothing on the target-node: the
    // handshake refuses it (TLS 1.3: at the first call, the connection closed).
    info_as(target.addr, dir.path(), "draft-node", "target-node")
        .await
        .expect_err("the target-node answers a draft-node's certificate");
}

/// What `script` prints as JSON, run by the test venv's Python (pyyaml, kubernetes-validate)
/// with `arg`.
fn python_json(script: &str, arg: &Path) -> serde_json::Value {
    let python = python_with(&[
        ("kubernetes_validate", "kubernetes-validate"),
        ("yaml", "pyyaml"),
    ]);
    let out = Command::new(python)
        .args(["-c", script])
        .arg(arg)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

/// The value of the variable `name` in a container's or compose service's `env`.
fn env_entry<'a>(env: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    env.as_array()?.iter().find(|e| e["name"] == name)
}

#[test]
fn every_overlay_takes_the_api_keys_from_a_secret_and_mtls_nodes_admit_the_coordinator() {
    // The containers of each rendered target, by target and workload name.
    let rendered = python_json(
        "import json, pathlib, sys\n\
         sys.path.insert(0, sys.argv[1])\n\
         import validate\n\
         root = pathlib.Path(sys.argv[1])\n\
         targets = [root / 'base'] + sorted(p for p in (root / 'overlays').iterdir() if p.is_dir())\n\
         print(json.dumps({t.name: {d['metadata']['name']: d['spec']['template']['spec']['containers'][0]\n\
             for d, _ in validate.render(t) if d['kind'] in ('Deployment', 'DaemonSet')}\n\
             for t in targets}))",
        &k8s_dir(),
    );
    let targets = rendered.as_object().expect("targets");
    assert!(targets.len() >= 6, "{rendered}");
    for (target, workloads) in targets {
        let coordinator = &workloads["coordinator"];
        let keys = env_entry(&coordinator["env"], "TANDEM_API_KEYS")
            .unwrap_or_else(|| panic!("{target}: no TANDEM_API_KEYS: {coordinator}"));
        assert_eq!(
            keys["valueFrom"]["secretKeyRef"],
            serde_json::json!({"name": "tandem-api-keys", "key": "keys"}),
            "{target}"
        );
        assert!(
            !coordinator.to_string().contains("--api-key"),
            "{target}: {coordinator}"
        );
        // Where the nodes serve mutual TLS, they admit the coordinator's role alone.
        for node in ["target-node", "draft-node"] {
            let env = &workloads[node]["env"];
            if env_entry(env, "TANDEM_TLS_CLIENT_CA").is_some() {
                let allowed = env_entry(env, "TANDEM_ALLOW_CLIENTS").expect("an allow-list");
                assert_eq!(allowed["value"], "coordinator", "{target}: {node}");
            }
        }
    }
    assert!(
        env_entry(
            &targets["edge-mtls"]["target-node"]["env"],
            "TANDEM_TLS_CLIENT_CA"
        )
        .is_some(),
        "{rendered}"
    );
}

#[tokio::test]
async fn the_compose_file_gives_each_role_its_certificate_and_the_keys_from_a_file() {
    let compose_path = k8s_dir().join("../docker-compose.yml");
    let compose = python_json(
        "import json, sys, yaml\nprint(json.dumps(yaml.safe_load(open(sys.argv[1]))))",
        &compose_path,
    );
    let services = &compose["services"];
    let coordinator = &services["coordinator"];
    assert_eq!(coordinator["env_file"], serde_json::json!(["api-keys.env"]));
    let text = std::fs::read_to_string(&compose_path).expect("compose file");
    assert!(!text.contains("--api-key"), "a key in the compose file");
    assert!(
        coordinator["environment"].get("TANDEM_API_KEYS").is_none(),
        "a key in the compose file"
    );
    let command = coordinator["command"].to_string();
    for url in ["--target=https://", "--draft=https://"] {
        assert!(command.contains(url), "{command}");
    }
    // Each process mounts its own role's certificate; the CA's key stays with `certs`.
    for role in ["coordinator", "target-node", "draft-node"] {
        assert_eq!(
            services[role]["volumes"],
            serde_json::json!([format!("pki-{role}:/tls:ro")]),
            "{role}"
        );
    }
    assert!(
        services["certs"]["volumes"]
            .to_string()
            .contains("\"pki-ca:/pki\""),
        "{compose}"
    );

    // The target-node with the compose file's environment (its /tls in a directory here)
    // admits the coordinator's certificate and refuses the draft-node's.
    let dir = tempfile::tempdir().expect("temp dir");
    make_certs(dir.path());
    let tls = dir.path().join("target-node").display().to_string();
    let env: Vec<(String, String)> = services["target-node"]["environment"]
        .as_object()
        .expect("the target-node's environment")
        .iter()
        .map(|(k, v)| {
            let v = v.as_str().expect("a string");
            (k.clone(), v.replacen("/tls", &tls, 1))
        })
        .collect();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let model = tandem_tests::stories().display().to_string();
    let target = tandem_tests::processes::Proc::start_with_env(
        "target-node",
        &["--model", &model, "--listen", "127.0.0.1:0"],
        &env,
    );
    info_as(target.addr, dir.path(), "coordinator", "target-node")
        .await
        .expect("the coordinator's certificate");
    info_as(target.addr, dir.path(), "draft-node", "target-node")
        .await
        .expect_err("a draft-node's certificate");
}
