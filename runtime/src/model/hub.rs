//! Models named by Hugging Face Hub reference: `org/name[@revision]` for a safetensors folder,
//! `org/name[@revision]:file.gguf` for one GGUF file. Files land in the standard Hub cache (the
//! layout `huggingface_hub` and `hf-hub` share) and a cached file is used without a request.
//!
//! Environment, as the Python client reads it: `HF_ENDPOINT`, `HF_HUB_CACHE` (else
//! `HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`),
//! `HF_TOKEN` (else the token file `huggingface-cli login` writes) and `HF_HUB_OFFLINE`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use hf_hub::api::Progress;
use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};

use crate::{Error, Result};

/// The Hub's default address.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// Files at least this large report download progress on stderr.
const PROGRESS_FROM_BYTES: usize = 8 << 20;
/// Files of a safetensors model folder besides the weights, fetched when the repository has them.
const FOLDER_FILES: [&str; 5] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors.index.json",
];

/// Where and how the Hub is reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubConfig {
    pub endpoint: String,
    pub cache_dir: PathBuf,
    pub token: Option<String>,
    /// Use the cache only; a file missing from it is an error, never a request.
    pub offline: bool,
}

impl HubConfig {
    /// The configuration the environment describes.
    pub fn from_env() -> Self {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The configuration a variable lookup describes (`from_env` with `std::env::var`).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let set = |name: &str| var(name).filter(|v| !v.is_empty());
        let hf_home = set("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            let cache = set("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| set("HOME").map(|home| Path::new(&home).join(".cache")))
                .unwrap_or_else(|| PathBuf::from(".cache"));
            cache.join("huggingface")
        });
        let cache_dir = set("HF_HUB_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("hub"));
        let token_file = set("HF_TOKEN_PATH")
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("token"));
        let token = set("HF_TOKEN").or_else(|| {
            std::fs::read_to_string(token_file)
                .ok()
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
        });
        let offline = set("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
        });
        Self {
            endpoint: set("HF_ENDPOINT")
                .map(|e| e.trim_end_matches('/').to_string())
                .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string()),
            cache_dir,
            token,
            offline,
        }
    }
}

/// A parsed Hub reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubRef {
    pub repo: String,
    pub revision: String,
    /// One file of the repository (a GGUF); `None` names the whole model folder.
    pub file: Option<String>,
}

impl HubRef {
    /// Parses `org/name[@revision][:file]`; `None` when `spec` does not have that shape.
    pub fn parse(spec: &str) -> Option<Self> {
        let (rest, file) = match spec.split_once(':') {
            Some((rest, file)) if !file.is_empty() => (rest, Some(file.to_string())),
            Some(_) => return None,
            None => (spec, None),
        };
        let (repo, revision) = match rest.split_once('@') {
            Some((repo, rev)) if !rev.is_empty() => (repo, rev.to_string()),
            Some(_) => return None,
            None => (rest, "main".to_string()),
        };
        let name_ok = |s: &str| {
            !s.is_empty()
                && !s.starts_with('.')
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        let (org, name) = repo.split_once('/')?;
        // Relative paths inside the repository (and `refs/pr/N` revisions), which the cache
        // also uses as paths: nothing that could leave it.
        let path_ok = |p: &str| {
            !p.starts_with('/')
                && !p.contains('\\')
                && !p.chars().any(char::is_control)
                && !p.split('/').any(|part| part == ".." || part == ".")
        };
        let file_ok = file.as_deref().is_none_or(path_ok);
        (name_ok(org) && name_ok(name) && file_ok && path_ok(&revision)).then(|| Self {
            repo: repo.to_string(),
            revision,
            file,
        })
    }
}

impl std::fmt::Display for HubRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.repo, self.revision)?;
        match &self.file {
            Some(file) => write!(f, ":{file}"),
            None => Ok(()),
        }
    }
}

/// A model argument made local: an existing path is returned as it is; a Hub reference is
/// fetched into the cache (or found there) and its local path returned.
pub fn resolve(spec: &str) -> Result<PathBuf> {
    resolve_with(spec, &HubConfig::from_env())
}

/// [`resolve`] with an explicit configuration.
pub fn resolve_with(spec: &str, config: &HubConfig) -> Result<PathBuf> {
    let path = Path::new(spec);
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    match HubRef::parse(spec) {
        Some(reference) => fetch(&reference, config),
        None => Err(Error::MissingFile {
            path: path.to_path_buf(),
            what: "expected a Hugging Face model folder, a .gguf file, or a Hub reference \
                   org/name[@revision][:file.gguf]",
        }),
    }
}

/// Fetches (or finds in the cache) what `reference` names.
pub fn fetch(reference: &HubRef, config: &HubConfig) -> Result<PathBuf> {
    let repo = Repo::with_revision(
        reference.repo.clone(),
        RepoType::Model,
        reference.revision.clone(),
    );
    let cached = Cache::new(config.cache_dir.clone()).repo(repo.clone());
    let hub_error = |detail: String| Error::Hub {
        reference: reference.to_string(),
        detail,
    };
    if config.offline {
        let wanted = reference.file.as_deref().unwrap_or("config.json");
        let found = cached.get(wanted).ok_or_else(|| {
            hub_error(format!(
                "HF_HUB_OFFLINE is set and `{wanted}` is not in the cache at {}; fetch it once \
                 online or unset HF_HUB_OFFLINE",
                config.cache_dir.display()
            ))
        })?;
        return Ok(match reference.file {
            Some(_) => found,
            None => parent_dir(&found),
        });
    }
    let client = ApiBuilder::from_cache(Cache::new(config.cache_dir.clone()))
        .with_endpoint(config.endpoint.clone())
        .with_token(config.token.clone())
        .with_progress(false)
        .build()
        .map_err(|e| hub_error(describe(e, config)))?;
    // A file from the cache if it is there, else downloaded, at `repo`'s revision.
    let get_at = |repo: &Repo, file: &str| {
        if let Some(path) = Cache::new(config.cache_dir.clone())
            .repo(repo.clone())
            .get(file)
        {
            return Ok(path);
        }
        client
            .repo(repo.clone())
            .download_with_progress(file, StderrProgress::new(&reference.repo))
            .map_err(|e| hub_error(format!("`{file}`: {}", describe(e, config))))
    };
    if let Some(file) = &reference.file {
        return get_at(&repo, file);
    }
    let (files, commit): (Vec<String>, String) = match client.repo(repo.clone()).info() {
        Ok(info) => (
            info.siblings.into_iter().map(|s| s.rfilename).collect(),
            info.sha,
        ),
        // Unreachable Hub: a folder fetched before is still usable.
        Err(e) => match cached.get("config.json") {
            Some(config_json) => {
                tracing::warn!(reference = %reference, error = %e, "hub unreachable; using the cached folder");
                return Ok(parent_dir(&config_json));
            }
            None => return Err(hub_error(describe(e, config))),
        },
    };
    // Every file from the commit the listing names: a branch that moves meanwhile cannot mix
    // two snapshots in one folder.
    let pinned = Repo::with_revision(reference.repo.clone(), RepoType::Model, commit.clone());
    let get = |file: &str| get_at(&pinned, file);
    let weights: Vec<&String> = files.iter().filter(|f| is_weight(f)).collect();
    if !files.iter().any(|f| f == "config.json") || weights.is_empty() {
        let ggufs: Vec<&str> = files
            .iter()
            .filter(|f| f.ends_with(".gguf"))
            .map(String::as_str)
            .collect();
        return match ggufs.as_slice() {
            [one] => get(one),
            [] => Err(hub_error(
                "the repository has neither config.json with safetensors weights nor a .gguf file"
                    .into(),
            )),
            many => Err(hub_error(format!(
                "the repository holds {} .gguf files; name one as `{}:FILE`, e.g. {}",
                many.len(),
                reference.repo,
                many.iter().take(6).copied().collect::<Vec<_>>().join(", ")
            ))),
        };
    }
    let mut config_json = None;
    for file in FOLDER_FILES
        .iter()
        .filter(|f| files.iter().any(|name| name == *f))
        .map(|f| f.to_string())
        .chain(weights.into_iter().cloned())
    {
        let path = get(&file)?;
        if file == "config.json" {
            config_json = Some(path);
        }
    }
    let config_json = config_json.ok_or_else(|| hub_error("config.json missing".into()))?;
    // The revision named (a branch, a tag) now points at that commit, for offline use.
    cached
        .create_ref(&commit)
        .map_err(|e| hub_error(format!("cannot record the revision in the cache: {e}")))?;
    Ok(parent_dir(&config_json))
}

/// Weights of a safetensors folder at its top level.
fn is_weight(file: &str) -> bool {
    !file.contains('/') && file.ends_with(".safetensors")
}

fn parent_dir(file: &Path) -> PathBuf {
    file.parent().unwrap_or(Path::new(".")).to_path_buf()
}

/// What went wrong talking to the Hub, in terms of what to fix.
fn describe(error: ApiError, config: &HubConfig) -> String {
    let endpoint = &config.endpoint;
    let ApiError::RequestError(request) = &error else {
        return error.to_string();
    };
    match request.as_ref() {
        ureq::Error::Status(code, response) => {
            let kind = response.header("x-error-code").unwrap_or_default();
            let auth = if config.token.is_some() {
                "check that HF_TOKEN grants access"
            } else {
                "set HF_TOKEN if it is private or gated"
            };
            match (code, kind) {
                (_, "RepoNotFound") | (401, _) => {
                    format!(
                        "repository not found at {endpoint} (http {code}); check the name, or {auth}"
                    )
                }
                (_, "RevisionNotFound") => {
                    format!("revision not found at {endpoint} (http {code})")
                }
                (_, "EntryNotFound") | (404, _) => {
                    format!("file not found in the repository at {endpoint} (http {code})")
                }
                (403, _) | (_, "GatedRepo") => format!(
                    "access refused by {endpoint} (http {code}); accept the model's terms on its page and {auth}"
                ),
                _ => format!("{endpoint} answered http {code}"),
            }
        }
        ureq::Error::Transport(transport) => format!(
            "cannot reach {endpoint}: {transport}; set HF_ENDPOINT for a mirror, or \
             HF_HUB_OFFLINE=1 to use the cache at {} only",
            config.cache_dir.display()
        ),
    }
}

/// Download progress on stderr, every tenth of a file of at least [`PROGRESS_FROM_BYTES`].
#[derive(Debug)]
struct StderrProgress {
    repo: String,
    file: String,
    size: usize,
    done: usize,
    reported_tenths: usize,
    started: Instant,
}

impl StderrProgress {
    fn new(repo: &str) -> Self {
        Self {
            repo: repo.to_string(),
            file: String::new(),
            size: 0,
            done: 0,
            reported_tenths: 0,
            started: Instant::now(),
        }
    }

    fn shown(&self) -> bool {
        self.size >= PROGRESS_FROM_BYTES
    }
}

impl Progress for StderrProgress {
    fn init(&mut self, size: usize, filename: &str) {
        if self.file != filename {
            self.started = Instant::now();
            self.file = filename.to_string();
            self.done = 0;
            self.reported_tenths = 0;
            self.size = size;
            if self.shown() {
                eprintln!(
                    "downloading {}/{} ({:.1} MB)",
                    self.repo,
                    self.file,
                    size as f64 / 1e6
                );
            }
        }
    }

    fn update(&mut self, bytes: usize) {
        self.done += bytes;
        let tenths = (self.done * 10).checked_div(self.size).unwrap_or(10);
        if self.shown() && tenths > self.reported_tenths && tenths < 10 {
            self.reported_tenths = tenths;
            let secs = self.started.elapsed().as_secs_f64().max(1e-3);
            eprintln!(
                "  {}: {}% ({:.1} MB/s)",
                self.file,
                tenths * 10,
                self.done as f64 / 1e6 / secs
            );
        }
    }

    fn finish(&mut self) {
        if self.shown() && self.done >= self.size {
            eprintln!(
                "  {}: done in {:.1} s",
                self.file,
                self.started.elapsed().as_secs_f64()
            );
        }
    }
}
