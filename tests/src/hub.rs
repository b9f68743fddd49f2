//! A Hugging Face Hub stand-in on 127.0.0.1 for the Hub-reference tests: the two routes a client
//! fetching models uses, answered as huggingface.co answers them.
//!
//! - `GET /api/models/{org}/{name}/revision/{rev}`: `{"sha", "siblings": [{"rfilename"}]}`.
//! - `GET /{org}/{name}/resolve/{rev}/{file}` with a `Range`: 206, `Content-Range`, `ETag` and
//!   `X-Repo-Commit`; 401 with `X-Error-Code: RepoNotFound` for an unknown (or private, without
//!   the token) repository and 404 with `EntryNotFound` for a missing file, as the Hub does.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::Response;

/// One repository: its files, and the token it requires if private.
#[derive(Debug, Clone, Default)]
pub struct StandInRepo {
    pub files: BTreeMap<String, Vec<u8>>,
    pub token: Option<String>,
}

impl StandInRepo {
    /// A repository of the files under `dir` (top level only), or of one file.
    pub fn from_path(path: &Path) -> Self {
        let mut files = BTreeMap::new();
        let entries: Vec<std::path::PathBuf> = if path.is_dir() {
            std::fs::read_dir(path)
                .expect("read fixture dir")
                .map(|e| e.expect("dir entry").path())
                .filter(|p| p.is_file())
                .collect()
        } else {
            vec![path.to_path_buf()]
        };
        for file in entries {
            let name = file.file_name().expect("file name").to_string_lossy();
            files.insert(
                name.into_owned(),
                std::fs::read(&file).expect("read fixture"),
            );
        }
        Self { files, token: None }
    }
}

/// What the stand-in serves and what it was asked.
#[derive(Debug, Default)]
struct Shared {
    repos: BTreeMap<String, StandInRepo>,
    requests: AtomicUsize,
    authorizations: Mutex<Vec<String>>,
}

/// A running stand-in; stops when dropped.
#[derive(Debug)]
pub struct StandInHub {
    pub endpoint: String,
    shared: Arc<Shared>,
    _runtime: tokio::runtime::Runtime,
}

/// The commit every stand-in repository is at.
pub const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

impl StandInHub {
    /// Serves `repos` (`org/name` → repository) on a free loopback port.
    pub fn start(repos: impl IntoIterator<Item = (String, StandInRepo)>) -> Self {
        let shared = Arc::new(Shared {
            repos: repos.into_iter().collect(),
            ..Shared::default()
        });
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind");
        let endpoint = format!("http://{}", listener.local_addr().expect("addr"));
        let state = shared.clone();
        let app = axum::Router::new().fallback(move |uri: Uri, headers: HeaderMap| {
            let state = state.clone();
            async move { answer(&state, &uri, &headers) }
        });
        runtime.spawn(async move { axum::serve(listener, app).await });
        Self {
            endpoint,
            shared,
            _runtime: runtime,
        }
    }

    /// Requests answered so far.
    pub fn requests(&self) -> usize {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// `Authorization` headers received so far.
    pub fn authorizations(&self) -> Vec<String> {
        self.shared
            .authorizations
            .lock()
            .expect("authorizations")
            .clone()
    }
}

fn error(status: StatusCode, code: &str) -> Response {
    Response::builder()
        .status(status)
        .header("x-error-code", code)
        .body(Body::from(code.to_string()))
        .expect("response")
}

fn answer(shared: &Shared, uri: &Uri, headers: &HeaderMap) -> Response {
    shared.requests.fetch_add(1, Ordering::SeqCst);
    let auth = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    if let Some(auth) = &auth {
        shared
            .authorizations
            .lock()
            .expect("authorizations")
            .push(auth.clone());
    }
    let path = uri.path().trim_start_matches('/');
    let (api, rest) = match path.strip_prefix("api/models/") {
        Some(rest) => (true, rest),
        None => (false, path),
    };
    let parts: Vec<&str> = rest.splitn(5, '/').collect();
    let [org, name, verb, _revision, file @ ..] = parts.as_slice() else {
        return error(StatusCode::NOT_FOUND, "RepoNotFound");
    };
    let repo = shared.repos.get(&format!("{org}/{name}")).filter(|repo| {
        repo.token
            .as_ref()
            .is_none_or(|t| auth.as_deref() == Some(&format!("Bearer {t}")))
    });
    let Some(repo) = repo else {
        return error(StatusCode::UNAUTHORIZED, "RepoNotFound");
    };
    match (api, *verb, file) {
        (true, "revision", []) => {
            let siblings: Vec<_> = repo
                .files
                .keys()
                .map(|f| serde_json::json!({ "rfilename": f }))
                .collect();
            let body = serde_json::json!({ "sha": COMMIT, "siblings": siblings });
            Response::builder()
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(body.to_string()))
                .expect("response")
        }
        (false, "resolve", [file]) => match repo.files.get(*file) {
            Some(bytes) => ranged(bytes, headers),
            None => error(StatusCode::NOT_FOUND, "EntryNotFound"),
        },
        _ => error(StatusCode::NOT_FOUND, "EntryNotFound"),
    }
}

/// The bytes a `Range: bytes=a-[b]` asks for, as a 206.
fn ranged(bytes: &[u8], headers: &HeaderMap) -> Response {
    let len = bytes.len();
    let (start, end) = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split_once('-'))
        .map(|(a, b)| {
            let start: usize = a.parse().unwrap_or(0);
            let end = b.parse::<usize>().map_or(len, |e| e + 1).min(len);
            (start.min(end), end)
        })
        .unwrap_or((0, len));
    let etag = format!("\"{:016x}\"", fnv(bytes));
    Response::builder()
        .status(StatusCode::PARTIAL_CONTENT)
        .header(header::ETAG, etag)
        .header("x-repo-commit", COMMIT)
        .header(
            header::CONTENT_RANGE,
            format!("bytes {start}-{}/{len}", end.saturating_sub(1)),
        )
        .body(Body::from(bytes[start..end].to_vec()))
        .expect("response")
}

/// A content hash for the ETag (the Hub's is the file's sha256).
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}
