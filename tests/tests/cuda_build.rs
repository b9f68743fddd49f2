//! The CUDA path compiles (issue 55), on a machine with no CUDA toolkit and no GPU:
//! `scripts/build-cuda.sh --check` takes nvcc 13.0 and the CUDA headers from PyPI, type-checks
//! `tandem-runtime` with `--features cuda` (its library, tests and benchmarks; the nodes only
//! pass the feature on), nvcc compiling candle's kernels as a build does, and compiles Tandem's
//! own attention kernel with nvcc. A change that breaks the GPU build fails here, not on the
//! first GPU that runs it. It shares the suite's target directory (its build scripts and
//! procedural macros; without this test's package variables, which would make build scripts
//! run again); what it checks, it checks with the `cuda` feature, apart from the rest.

use std::path::Path;
use std::process::Command;

use tandem_tests::processes::without_package_env;

#[test]
fn the_cuda_path_compiles_with_nvcc_from_pypi() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = without_package_env(&mut Command::new("bash"))
        .arg(root.join("scripts/build-cuda.sh"))
        .args(["--check", "-p", "tandem-runtime", "--all-targets"])
        .current_dir(&root)
        .env("CARGO_INCREMENTAL", "0")
        .output()
        .expect("run scripts/build-cuda.sh");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "scripts/build-cuda.sh --check failed (PyPI must be reachable for nvcc's wheels):\n{stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("attention.cu compiles"),
        "nvcc did not compile the attention kernel: {stdout}"
    );
}
