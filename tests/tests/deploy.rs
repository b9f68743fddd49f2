//! The Kubernetes manifests in deploy/k8s: the base and every overlay render and validate
//! against the Kubernetes schemas (kubernetes-validate, offline), and a broken manifest fails;
//! the mutual-TLS component's certificate script makes certificates the nodes accept.

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
    for target in ["base", "gpu", "cpu", "cpu-hub", "edge-mtls"] {
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
        .info(tandem_proto::v1::InfoRequest {})
        .await
        .expect("the node answers the coordinator's certificate");
}
