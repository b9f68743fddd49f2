//! A Python with the packages a test needs (the `openai` client), in a virtual environment under
//! the target directory, created and filled from PyPI on first use.

use std::path::PathBuf;
use std::process::Command;

/// The venv's python, with `packages` importable (`(import name, pip requirement)`).
pub fn python_with(packages: &[(&str, &str)]) -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().expect("venv lock");
    let venv = crate::processes::profile_dir().join("tandem-test-venv");
    let python = venv.join("bin/python");
    if !python.exists() {
        let system = std::env::var("TANDEM_PYTHON").unwrap_or_else(|_| "python3".into());
        let ok = Command::new(&system)
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            ok,
            "`{system} -m venv {}` failed: the tests need Python 3 with venv",
            venv.display()
        );
    }
    for (module, requirement) in packages {
        let present = Command::new(&python)
            .args(["-c", &format!("import {module}")])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !present {
            let ok = Command::new(&python)
                .args(["-m", "pip", "install", "--quiet", requirement])
                .status()
                .is_ok_and(|s| s.success());
            assert!(
                ok,
                "pip install {requirement} failed (PyPI must be reachable)"
            );
        }
    }
    python
}
