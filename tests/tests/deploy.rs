//! The Kubernetes manifests in deploy/k8s: the base and every overlay render and validate
//! against the Kubernetes schemas (kubernetes-validate, offline; the Prometheus operator's
//! ServiceMonitor against deploy/k8s/schemas), and a broken manifest fails; the mutual-TLS
//! component's certificate script makes certificates the nodes accept; the Grafana dashboard and
//! the autoscaler query only metrics docs/metrics.md documents.

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

#[tokio::test]
async fn make_certs_writes_secrets_whose_certificates_a_node_accepts() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = Command::new(k8s_dir().join("components/mtls/make-certs.sh"))
        .arg(dir.path())
        .stdout(std::process::Stdio::piped())
        .output()
        .expect("run make-certs.sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let yaml = String::from_utf8_lossy(&out.stdout);
    for name in ["coordinator", "target-node", "draft-node"] {
        assert!(yaml.contains(&format!("name: tandem-tls-{name}")), "{yaml}");
    }
    assert_eq!(yaml.matches("  tls.key: ").count(), 3, "{yaml}");

    // The target-node serves mutual TLS with its certificate; the coordinator's is let in.
    let (node, coordinator) = (
        dir.path().join("target-node"),
        dir.path().join("coordinator"),
    );
    let path = |p: std::path::PathBuf| p.display().to_string();
    let (cert, key, ca) = (
        path(node.join("tls.crt")),
        path(node.join("tls.key")),
        path(node.join("ca.crt")),
    );
    let target = tandem_tests::processes::Proc::node(
        "target-node",
        &tandem_tests::stories(),
        &[
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--tls-client-ca",
            &ca,
        ],
    );
    let addr = target.addr;
    let pem = |f: &str| std::fs::read(coordinator.join(f)).expect("read PEM");
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(pem("ca.crt")))
        .identity(tonic::transport::Identity::from_pem(
            pem("tls.crt"),
            pem("tls.key"),
        ))
        // The name in the certificate: the Service's, as the coordinator dials it in a cluster.
        .domain_name("target-node");
    let channel = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
        .expect("URL")
        .tls_config(tls)
        .expect("TLS")
        .connect()
        .await
        .expect("a TLS connection");
    tandem_proto::v1::node_service_client::NodeServiceClient::new(channel)
        .info(tandem_proto::v1::InfoRequest::default())
        .await
        .expect("the node answers the coordinator's certificate");
}
