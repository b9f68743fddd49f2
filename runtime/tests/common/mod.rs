//! Fixtures shared by the runtime's integration tests: the stories260K checkpoint, its GGUF
//! copies, and random-weight models written once per test binary.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tandem_runtime::quantize::{QuantType, quantize_to_gguf};
use tandem_runtime::synthetic::{SyntheticSpec, write_random_llama};
use tandem_runtime::{LoadOptions, Model, Tokenizer};

pub const REFERENCE_STORY: &str = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball. She wanted to play with it, but it was too high.";

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

pub fn stories_dir() -> PathBuf {
    fixtures().join("stories260K")
}

fn scratch() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"))
        .path()
}

/// A GGUF copy of stories260K, written once per test binary and quantization.
pub fn stories_gguf(quant: QuantType) -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().expect("fixture lock");
    let path = scratch().join(format!("stories260K-{quant:?}.gguf"));
    if !path.exists() {
        quantize_to_gguf(&stories_dir(), &path, quant).expect("quantize stories260K");
    }
    path
}

/// A tiny random-weight model with the stories260K tokenizer.
pub fn tiny_random(seed: u64) -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().expect("fixture lock");
    let dir = scratch().join(format!("tiny-{seed}"));
    if !dir.exists() {
        write_random_llama(&dir, &SyntheticSpec::tiny(seed), &stories_dir())
            .expect("write random model");
    }
    dir
}

pub fn load(path: &Path) -> Model {
    Model::load(path, &LoadOptions::default()).expect("load model")
}

pub fn tokenizer() -> Tokenizer {
    Tokenizer::for_model(&stories_dir()).expect("stories tokenizer")
}

/// Largest absolute difference between two logit rows.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
