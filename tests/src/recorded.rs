//! References' answers recorded in the repository (`tests/references/`), for references too
//! heavy to run on every test run: transformers needs torch (~3 GB of wheels), llama.cpp a
//! build from source (llama-cpp-python: ~6 minutes on 2 cores), llama.cpp's converter torch
//! too. Each record names exactly what it answered (a file's or a checkpoint's SHA-256, the
//! request, the reference's pinned release); a test whose input changed fails and says how to
//! record anew: the variable that makes the test run the reference and rewrite the record.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::python::{LLAMA_CPP_PYTHON, llama_cpp_answer};

/// The variable that records llama.cpp's answers (and its converter's files) anew.
pub const REFRESH_LLAMA_CPP: &str = "TANDEM_REFRESH_LLAMA_CPP";
/// The variable that records transformers' answers anew.
pub const REFRESH_TRANSFORMERS: &str = "TANDEM_REFRESH_TRANSFORMERS";

/// `tests/references/FOLDER/NAME.json`.
pub fn record_path(folder: &str, name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("references")
        .join(folder)
        .join(format!("{name}.json"))
}

/// Whether `variable` asks for records to be made anew.
pub fn refreshing(variable: &str) -> bool {
    std::env::var_os(variable).is_some_and(|v| !v.is_empty() && v != "0")
}

/// The answer recorded at `path` for `key` (an object: what the answer depends on). Where
/// `refresh` is set, `answer` computes it first and the record is rewritten; otherwise a record
/// made for another key fails the test, naming the field that differs and `refresh`.
pub fn recorded(path: &Path, key: Value, refresh: &str, answer: impl FnOnce() -> Value) -> Value {
    let key = key
        .as_object()
        .expect("a record's key is an object")
        .clone();
    if refreshing(refresh) {
        let mut record = key.clone();
        record.insert("answer".into(), answer());
        std::fs::create_dir_all(path.parent().expect("folder")).expect("mkdir");
        let text = serde_json::to_string(&record).expect("json") + "\n";
        std::fs::write(path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e} (record it with {refresh}=1)", path.display()));
    let mut record: serde_json::Map<String, Value> =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    for (field, want) in &key {
        assert_eq!(
            record.get(field),
            Some(want),
            "{}: recorded for another {field} than this test's: record anew with {refresh}=1",
            path.display()
        );
    }
    record.remove("answer").expect("a record's answer")
}

/// llama.cpp's answer to `tests/references/SCRIPT` for `gguf` and `request`, as recorded in
/// `tests/references/llama_cpp/NAME.json` for that file's bytes, that request and the pinned
/// llama-cpp-python; with `TANDEM_REFRESH_LLAMA_CPP=1`, run first ([`llama_cpp_answer`]: the
/// tests' venv gets llama-cpp-python, built from source) and recorded.
pub fn llama_cpp(name: &str, script: &str, gguf: &Path, request: &Value) -> Value {
    let key = serde_json::json!({
        "file_sha256": file_sha256(gguf),
        "script": script,
        "request": request,
        "llama_cpp_python": LLAMA_CPP_PYTHON.1,
    });
    recorded(
        &record_path("llama_cpp", name),
        key,
        REFRESH_LLAMA_CPP,
        || llama_cpp_answer(script, gguf, request),
    )
}

/// A file's SHA-256, in hex.
pub fn file_sha256(path: &Path) -> String {
    use sha2::Digest;
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    format!("{:x}", sha2::Sha256::digest(&bytes))
}

/// SHA-256 over a folder's files in name order (each name, then its bytes; a JSON file's
/// content with its keys sorted, so that how a writer orders or spaces keys does not count).
pub fn folder_sha256(folder: &Path) -> String {
    use sha2::Digest;
    fn sorted(v: Value) -> Value {
        match v {
            Value::Object(map) => {
                let mut entries: Vec<_> = map.into_iter().collect();
                entries.sort_by(|a, b| a.0.cmp(&b.0));
                Value::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
            }
            Value::Array(items) => Value::Array(items.into_iter().map(sorted).collect()),
            other => other,
        }
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(folder)
        .expect("read folder")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    let mut hash = sha2::Sha256::new();
    for file in files {
        hash.update(file.file_name().expect("name").as_encoded_bytes());
        let bytes = std::fs::read(&file).expect("read");
        if file.extension().is_some_and(|e| e == "json") {
            let value = serde_json::from_slice(&bytes).expect("json");
            hash.update(serde_json::to_vec(&sorted(value)).expect("json"));
        } else {
            hash.update(bytes);
        }
    }
    format!("{:x}", hash.finalize())
}
