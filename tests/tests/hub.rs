//! Models by Hugging Face Hub reference, against a Hub stand-in on 127.0.0.1: a GGUF file and a
//! safetensors folder are fetched into the standard cache once and found there after (offline
//! too); a missing repository, file or cache entry, a private repository without its token and an
//! unreachable Hub are errors that say what to fix; the CLI runs from Hub references.

use std::path::Path;

use tandem_runtime::model::hub::{HubConfig, HubRef, resolve_with};
use tandem_runtime::{LoadOptions, Logits, Model, Tokenizer};
use tandem_tests::hub::{COMMIT, StandInHub, StandInRepo};
use tandem_tests::processes::{binary, generate_cli};
use tandem_tests::{stories, stories_q8};

const GGUF_REPO: &str = "tandem-test/stories260K-GGUF";
const FOLDER_REPO: &str = "tandem-test/stories260K";

fn gguf_ref() -> String {
    format!("{GGUF_REPO}:stories260K-q8_0.gguf")
}

fn hub() -> StandInHub {
    let mut several = StandInRepo::from_path(&stories_q8());
    several
        .files
        .insert("stories260K-f16.gguf".into(), b"GGUF".to_vec());
    let mut private = StandInRepo::from_path(&stories_q8());
    private.token = Some("hf_secret".into());
    StandInHub::start([
        (GGUF_REPO.to_string(), StandInRepo::from_path(&stories_q8())),
        (FOLDER_REPO.to_string(), StandInRepo::from_path(&stories())),
        ("tandem-test/several-GGUF".to_string(), several),
        ("tandem-test/private-GGUF".to_string(), private),
    ])
}

fn config(hub: &StandInHub, cache: &Path) -> HubConfig {
    HubConfig {
        endpoint: hub.endpoint.clone(),
        cache_dir: cache.to_path_buf(),
        token: None,
        offline: false,
    }
}

fn error_of(spec: &str, config: &HubConfig) -> String {
    resolve_with(spec, config)
        .expect_err("resolution must fail")
        .to_string()
}

fn last_logits(model: &Model) -> Vec<f32> {
    let mut rows = model
        .forward(&[1, 403, 407], &mut model.new_cache(), Logits::Last)
        .expect("forward");
    rows.pop().expect("one row")
}

#[test]
fn a_gguf_file_is_fetched_once_into_the_hub_cache_and_found_offline_after() {
    let hub = hub();
    let cache = tempfile::tempdir().expect("cache");
    let online = config(&hub, cache.path());
    let path = resolve_with(&gguf_ref(), &online).expect("fetch");
    // The standard cache layout, which huggingface_hub and other tools share.
    let snapshot = cache
        .path()
        .join("models--tandem-test--stories260K-GGUF/snapshots")
        .join(COMMIT);
    assert_eq!(path, snapshot.join("stories260K-q8_0.gguf"));
    assert_eq!(
        std::fs::read(&path).expect("read"),
        std::fs::read(stories_q8()).expect("read")
    );
    let from_hub = Model::load(&path, &LoadOptions::default()).expect("load");
    let local = Model::load(&stories_q8(), &LoadOptions::default()).expect("load");
    assert_eq!(last_logits(&from_hub), last_logits(&local));

    let asked = hub.requests();
    assert!(asked >= 2, "metadata and download: {asked} requests");
    assert_eq!(resolve_with(&gguf_ref(), &online).expect("cached"), path);
    assert_eq!(hub.requests(), asked, "a cached file costs no request");

    let endpoint = hub.endpoint.clone();
    drop(hub);
    let offline = HubConfig {
        offline: true,
        ..online
    };
    assert_eq!(resolve_with(&gguf_ref(), &offline).expect("offline"), path);
    assert!(offline.endpoint == endpoint);
}

#[test]
fn a_safetensors_folder_is_fetched_with_its_tokenizer_and_loads_as_the_local_one() {
    let hub = hub();
    let cache = tempfile::tempdir().expect("cache");
    let online = config(&hub, cache.path());
    let dir = resolve_with(&format!("{FOLDER_REPO}@{COMMIT}"), &online).expect("fetch");
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(dir.join(file).is_file(), "{file} in {}", dir.display());
    }
    let model = Model::load(&dir, &LoadOptions::default()).expect("load");
    let local = Model::load(&stories(), &LoadOptions::default()).expect("load");
    assert_eq!(last_logits(&model), last_logits(&local));
    let tokenizer = Tokenizer::for_model(&dir).expect("tokenizer");
    assert_eq!(
        tokenizer.vocab_hash(),
        Tokenizer::for_model(&stories())
            .expect("tokenizer")
            .vocab_hash()
    );

    // Unreachable Hub: the folder fetched before still resolves.
    drop(hub);
    let again = resolve_with(&format!("{FOLDER_REPO}@{COMMIT}"), &online).expect("cached");
    assert_eq!(again, dir);
    let offline = HubConfig {
        offline: true,
        ..online
    };
    assert_eq!(
        resolve_with(&format!("{FOLDER_REPO}@{COMMIT}"), &offline).expect("offline"),
        dir
    );
}

#[test]
fn a_missing_repository_file_or_cache_entry_is_an_error_that_says_what_to_fix() {
    let hub = hub();
    let cache = tempfile::tempdir().expect("cache");
    let online = config(&hub, cache.path());

    let missing = error_of("tandem-test/no-such-model:model.gguf", &online);
    assert!(
        missing.contains("tandem-test/no-such-model")
            && missing.contains("repository not found")
            && missing.contains(&hub.endpoint)
            && missing.contains("HF_TOKEN"),
        "{missing}"
    );
    let folder = error_of("tandem-test/no-such-model", &online);
    assert!(folder.contains("repository not found"), "{folder}");

    let no_file = error_of(&format!("{GGUF_REPO}:model-q2_k.gguf"), &online);
    assert!(
        no_file.contains("model-q2_k.gguf") && no_file.contains("file not found"),
        "{no_file}"
    );

    let several = error_of("tandem-test/several-GGUF", &online);
    assert!(
        several.contains("2 .gguf files")
            && several.contains("stories260K-f16.gguf")
            && several.contains("tandem-test/several-GGUF:FILE"),
        "{several}"
    );

    let before = hub.requests();
    let offline = HubConfig {
        offline: true,
        ..online.clone()
    };
    let not_cached = error_of(&gguf_ref(), &offline);
    assert!(
        not_cached.contains("HF_HUB_OFFLINE") && not_cached.contains("not in the cache"),
        "{not_cached}"
    );
    assert_eq!(hub.requests(), before, "offline makes no request");

    let unreachable = HubConfig {
        // Port 1 (tcpmux) has no listener: the connection is refused.
        endpoint: "http://127.0.0.1:1".into(),
        ..online
    };
    let down = error_of(&gguf_ref(), &unreachable);
    assert!(
        down.contains("cannot reach") && down.contains("HF_HUB_OFFLINE"),
        "{down}"
    );

    let neither = error_of("no/such/path.gguf", &config(&hub, cache.path()));
    assert!(
        neither.contains("no/such/path.gguf") && neither.contains("Hub reference"),
        "{neither}"
    );
}

#[test]
fn a_private_repository_needs_the_token_which_is_sent_as_a_bearer() {
    let hub = hub();
    let cache = tempfile::tempdir().expect("cache");
    let spec = "tandem-test/private-GGUF:stories260K-q8_0.gguf";
    let anonymous = error_of(spec, &config(&hub, cache.path()));
    assert!(
        anonymous.contains("repository not found") && anonymous.contains("set HF_TOKEN"),
        "{anonymous}"
    );
    let with_token = HubConfig {
        token: Some("hf_secret".into()),
        ..config(&hub, cache.path())
    };
    resolve_with(spec, &with_token).expect("fetch with the token");
    assert!(hub.authorizations().iter().any(|a| a == "Bearer hf_secret"));
}

#[test]
fn the_environment_configures_the_hub_as_the_python_client_reads_it() {
    let vars = |pairs: &'static [(&'static str, &'static str)]| {
        HubConfig::from_vars(move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
    };
    let default = vars(&[("HOME", "/home/u")]);
    assert_eq!(default.endpoint, "https://huggingface.co");
    assert_eq!(
        default.cache_dir,
        Path::new("/home/u/.cache/huggingface/hub")
    );
    assert_eq!((default.token, default.offline), (None, false));

    let xdg = vars(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "/xdg")]);
    assert_eq!(xdg.cache_dir, Path::new("/xdg/huggingface/hub"));
    let home = vars(&[("HF_HOME", "/models/hf"), ("XDG_CACHE_HOME", "/xdg")]);
    assert_eq!(home.cache_dir, Path::new("/models/hf/hub"));
    let cache = vars(&[("HF_HOME", "/models/hf"), ("HF_HUB_CACHE", "/fast/hub")]);
    assert_eq!(cache.cache_dir, Path::new("/fast/hub"));

    let set = vars(&[
        ("HF_ENDPOINT", "https://hf-mirror.example/"),
        ("HF_TOKEN", "hf_abc"),
        ("HF_HUB_OFFLINE", "1"),
    ]);
    assert_eq!(set.endpoint, "https://hf-mirror.example");
    assert_eq!(set.token.as_deref(), Some("hf_abc"));
    assert!(set.offline);
    for (value, offline) in [("true", true), ("ON", true), ("0", false), ("", false)] {
        let config = HubConfig::from_vars(|name| (name == "HF_HUB_OFFLINE").then(|| value.into()));
        assert_eq!(config.offline, offline, "HF_HUB_OFFLINE={value}");
    }

    // The token file `huggingface-cli login` writes, when HF_TOKEN is unset.
    let home_dir = tempfile::tempdir().expect("home");
    std::fs::write(home_dir.path().join("token"), "hf_from_file\n").expect("token file");
    let home = home_dir.path().to_string_lossy().into_owned();
    let from_file = HubConfig::from_vars(|name| (name == "HF_HOME").then(|| home.clone()));
    assert_eq!(from_file.token.as_deref(), Some("hf_from_file"));
}

#[test]
fn hub_references_parse_and_paths_that_are_not_references_are_refused() {
    let parsed = |s: &str| HubRef::parse(s).map(|r| (r.repo, r.revision, r.file));
    let owned = |repo: &str, rev: &str, file: Option<&str>| {
        Some((repo.to_string(), rev.to_string(), file.map(String::from)))
    };
    assert_eq!(
        parsed("Qwen/Qwen2.5-0.5B"),
        owned("Qwen/Qwen2.5-0.5B", "main", None)
    );
    assert_eq!(
        parsed("Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF:qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        owned(
            "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
            "main",
            Some("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
        )
    );
    assert_eq!(
        parsed("org/name@v1.0:sub/model.gguf"),
        owned("org/name", "v1.0", Some("sub/model.gguf"))
    );
    for bad in [
        "name",
        "a/b/c",
        "org/name:",
        "org/name@",
        "org/name@:x.gguf",
        "org/..",
        "org/name:../x.gguf",
        "org/name:/etc/passwd",
        "org/name@../../x",
        "org/name@refs/../main",
        "org/name@/abs",
        "/abs/model.gguf",
        "./org/name",
    ] {
        assert_eq!(HubRef::parse(bad), None, "{bad}");
    }
}

#[test]
fn the_cli_generates_from_hub_references_as_from_the_same_local_files() {
    let hub = hub();
    let home = tempfile::tempdir().expect("HF_HOME");
    let home_dir = home.path().to_string_lossy().into_owned();
    let args = |target: &str, draft: &str| {
        [
            "--target-model",
            target,
            "--draft-model",
            draft,
            "--max-tokens",
            "24",
            "--draft-tokens",
            "4",
        ]
        .map(String::from)
    };
    let env = [
        ("HF_ENDPOINT", hub.endpoint.as_str()),
        ("HF_HOME", home_dir.as_str()),
    ];
    let from_hub = args(FOLDER_REPO, &gguf_ref());
    let from_hub = generate_cli(&from_hub.each_ref().map(String::as_str), &env);
    let local = args(
        &stories().to_string_lossy(),
        &stories_q8().to_string_lossy(),
    );
    let local = generate_cli(&local.each_ref().map(String::as_str), &[]);
    assert_eq!(from_hub, local);
    assert!(
        home.path()
            .join("hub/models--tandem-test--stories260K")
            .is_dir()
    );
}

#[test]
fn coordinator_fetch_fills_the_cache_that_nodes_then_load_offline() {
    // What the Kubernetes component does: an init container fetches, the node runs offline.
    let hub = hub();
    let home = tempfile::tempdir().expect("HF_HOME");
    let home_dir = home.path().to_string_lossy().into_owned();
    let out = std::process::Command::new(binary("coordinator"))
        .args(["fetch", FOLDER_REPO, &gguf_ref()])
        .env("HF_ENDPOINT", &hub.endpoint)
        .env("HF_HOME", &home_dir)
        .output()
        .expect("run coordinator fetch");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    let paths: Vec<&Path> = printed.lines().map(Path::new).collect();
    assert_eq!(paths.len(), 2, "{printed}");
    assert!(
        paths[0].join("config.json").is_file() && paths[1].is_file(),
        "{printed}"
    );
    drop(hub);

    let offline = [
        ("HF_HOME", home_dir.as_str()),
        ("HF_HUB_OFFLINE", "1"),
        ("HF_ENDPOINT", "http://127.0.0.1:9"),
    ];
    let args = [
        "--target-model",
        FOLDER_REPO,
        "--draft-model",
        &gguf_ref(),
        "--max-tokens",
        "8",
    ]
    .map(String::from);
    let ids = generate_cli(&args.each_ref().map(String::as_str), &offline);
    assert_eq!(ids.len(), 8);
}
