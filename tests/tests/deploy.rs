//! The Kubernetes manifests in deploy/k8s: the base and every overlay render and validate
//! against the Kubernetes schemas (kubernetes-validate, offline), and a broken manifest fails.

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
    for target in ["base", "gpu", "cpu", "cpu-hub"] {
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
