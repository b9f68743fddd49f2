//! Command-line and environment configuration, grouped by concern.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::api::http::spec_metrics::SpecMetrics;

#[derive(Debug, Parser)]
#[command(
    name = "coordinator",
    version,
    about = "Tandem: distributed speculative decoding"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate text: with both nodes started in this process on loopback gRPC, or with
    /// `--endpoint` from a running coordinator.
    Generate(GenerateArgs),
    /// Serve the public gRPC API over a running target-node and draft-node, or over models
    /// loaded in this process (`--target-model`, `--draft-model`: one machine).
    Serve(ServeArgs),
    /// Write a Hugging Face Llama/Qwen2 folder as a (quantized) GGUF file, e.g. a draft model.
    Quantize(QuantizeArgs),
    /// Fetch models named by Hub reference into the Hub cache (`HF_HOME`, `HF_HUB_CACHE`) and
    /// print their local paths, e.g. before starting nodes with `HF_HUB_OFFLINE=1`.
    Fetch(FetchArgs),
}

#[derive(Debug, Args)]
pub struct FetchArgs {
    /// Hub references `org/name[@revision]` or `org/name[@revision]:file.gguf`; local paths are
    /// printed as they are.
    #[arg(required = true, num_args = 1..)]
    pub models: Vec<String>,
}

/// The embedded pair the first command runs: stories260K and its Q8_0 copy.
const DEFAULT_TARGET: &str = "fixtures/stories260K";
const DEFAULT_DRAFT: &str = "fixtures/stories260K-q8_0.gguf";

#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Target model: a Hugging Face folder, a .gguf file, or a Hub reference
    /// `org/name[@revision]` (safetensors) or `org/name[@revision]:file.gguf`.
    #[arg(
        long,
        env = "TANDEM_TARGET_MODEL",
        default_value = DEFAULT_TARGET
    )]
    pub target_model: String,
    /// Draft model sharing the target's vocabulary.
    #[arg(
        long,
        env = "TANDEM_DRAFT_MODEL",
        default_value = DEFAULT_DRAFT
    )]
    pub draft_model: String,
    /// Device for both models: cpu, or cuda:N (needs the `cuda` feature).
    #[arg(long, env = "TANDEM_DEVICE", default_value = "cpu")]
    pub device: String,
}

impl ModelArgs {
    /// Whether these are the embedded pair.
    pub fn is_default(&self) -> bool {
        self.target_model == DEFAULT_TARGET && self.draft_model == DEFAULT_DRAFT
    }
}

#[derive(Debug, Args)]
pub struct SamplingArgs {
    /// 0 is greedy.
    #[arg(long, env = "TANDEM_TEMPERATURE", default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Subtracted from the logit of each of the last 64 tokens (OpenAI's), in [-2, 2].
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    pub presence_penalty: f32,
    /// Subtracted once per occurrence among the last 64 tokens (OpenAI's), in [-2, 2].
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    pub frequency_penalty: f32,
    /// Keys every random draw (same seed, same text); unset, a random one is chosen and
    /// reported.
    #[arg(long, env = "TANDEM_SEED")]
    pub seed: Option<u64>,
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// A running coordinator (e.g. http://coordinator:50050); unset runs everything here.
    #[arg(long, env = "TANDEM_ENDPOINT")]
    pub endpoint: Option<String>,
    /// Seconds to wait for the coordinator at --endpoint to be reachable and ready (its nodes
    /// answering) before the request is sent; 0 sends it at once.
    #[arg(long, env = "TANDEM_WAIT_READY", default_value_t = 60)]
    pub wait_ready: u64,
    #[command(flatten)]
    pub models: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[arg(long, default_value = "Once upon a time")]
    pub prompt: String,
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// K, tokens drafted per round: `auto` chooses it each round from measured acceptance and
    /// costs (0 included); a number fixes it; 0 decodes with the target alone.
    #[arg(long, env = "TANDEM_DRAFT_TOKENS", default_value = "auto")]
    pub draft_tokens: DraftTokens,
    /// Who drafts: `auto` (the draft model, and n-gram lookup where it pays more), `model`, or
    /// `ngram` (prompt lookup, no draft model).
    #[arg(long, env = "TANDEM_DRAFTER", default_value = "auto")]
    pub drafter: String,
    /// Draft, then verify, every round: no drafting of the next block during the verify.
    #[arg(long)]
    pub no_pipeline: bool,
    /// The draft's chain stops before a draft where its model's largest probability is below
    /// this (as llama.cpp's --draft-p-min; 0: never early). Unset: learned from acceptance.
    #[arg(long)]
    pub draft_min_confidence: Option<f32>,
    /// Text that ends the generation (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Skip the target-only runs that measure the speedup (without --endpoint; with it they
    /// run only on --compare).
    #[arg(long)]
    pub no_baseline: bool,
    /// With --endpoint: after the generation, measure the speedup there too (target-only and
    /// speculative runs, --baseline-runs pairs and more: many generations on a server others
    /// may share). Without --endpoint it is measured unless --no-baseline.
    #[arg(long, conflicts_with = "no_baseline")]
    pub compare: bool,
    /// Target-only and speculative runs of the same request, alternated, that measure the
    /// speedup: at least this many of each, and more (for 1 to 10 s) until the median speedup's
    /// 95 % confidence interval is within ±2 % (reported with the pairs' spread).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u16).range(1..))]
    pub baseline_runs: u16,
    /// Keep the model's EOS/BOS from ending the generation.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub constraint: ConstraintArgs,
    /// The API key presented to --endpoint (`authorization: Bearer KEY` metadata), for a
    /// coordinator serving with --api-key. Never printed.
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    pub api_key: Option<crate::api::auth::Secret>,
    /// The request's `cache_salt`: its prompt's cached keys and values are shared with the
    /// requests that give the same salt only, whatever their key.
    #[arg(long, env = "TANDEM_CACHE_SALT", hide_env_values = true)]
    pub cache_salt: Option<String>,
    /// TLS to `--endpoint` when it is an `https://` URL.
    #[command(flatten)]
    pub tls: tandem_proto::tls::ClientTlsArgs,
}

impl GenerateArgs {
    /// Whether the speedup is measured after the generation: with --endpoint where --compare
    /// asks, here unless --no-baseline; never for target-only decoding.
    pub fn compares(&self) -> bool {
        let asked = match self.endpoint {
            Some(_) => self.compare,
            None => !self.no_baseline,
        };
        asked && !self.draft_tokens.target_only()
    }
}

/// The grammar the output follows: one of them (exact under speculation: the target masks every
/// position with it, the draft its drafts).
#[derive(Debug, Args)]
pub struct ConstraintArgs {
    /// A JSON schema, as its text (`--json-schema "$(cat schema.json)"`): the output is JSON
    /// valid against it.
    #[arg(long, conflicts_with_all = ["regex", "grammar"])]
    pub json_schema: Option<String>,
    /// A regular expression the whole output matches.
    #[arg(long, conflicts_with = "grammar")]
    pub regex: Option<String>,
    /// A grammar in llguidance's Lark dialect (`start: ...`).
    #[arg(long)]
    pub grammar: Option<String>,
}

impl ConstraintArgs {
    /// The request's constraint, if one was given.
    pub fn to_wire(&self) -> Option<tandem_proto::v1::Constraint> {
        use tandem_proto::v1::constraint::Kind;
        let kind = match (&self.json_schema, &self.regex, &self.grammar) {
            (Some(schema), _, _) => Kind::JsonSchema(schema.clone()),
            (None, Some(rx), _) => Kind::Regex(rx.clone()),
            (None, None, Some(lark)) => Kind::Lark(lark.clone()),
            (None, None, None) => return None,
        };
        Some(tandem_proto::v1::Constraint {
            kind: Some(kind),
            start: 0,
        })
    }
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The target-node's URL; repeatable (or comma-separated) for replicas of the same model:
    /// each generation runs on the least loaded and moves to another if its replica is lost.
    #[arg(
        long = "target",
        env = "TANDEM_TARGET",
        value_delimiter = ',',
        required_unless_present = "target_model"
    )]
    pub targets: Vec<String>,
    /// The draft-node's URL; repeatable (or comma-separated) for replicas, and a host name is
    /// each of its addresses, as for `--target`. Unset decodes with the target alone.
    #[arg(long = "draft", env = "TANDEM_DRAFT", value_delimiter = ',')]
    pub drafts: Vec<String>,
    /// Address of the public gRPC API (port 0: a free one). Once bound, the addresses are
    /// printed on stdout as one line, `listening grpc=ADDR [http=ADDR] [metrics=ADDR]`.
    #[arg(long, env = "TANDEM_LISTEN", default_value = "0.0.0.0:50050")]
    pub listen: std::net::SocketAddr,
    /// K for requests that do not name one: `auto` (chosen each round) or a number.
    #[arg(long, env = "TANDEM_DRAFT_TOKENS", default_value = "auto")]
    pub draft_tokens: DraftTokens,
    /// Address of the OpenAI-compatible HTTP API (`/v1/completions`, `/v1/chat/completions`,
    /// `/v1/models`, `/health`, `/ready`); unset serves no HTTP.
    #[arg(long, env = "TANDEM_HTTP_LISTEN")]
    pub http_listen: Option<std::net::SocketAddr>,
    /// Address of a listener for `/metrics` alone (e.g. open to Prometheus, not to API
    /// clients); unset: `/metrics` is served with the HTTP API.
    #[arg(long, env = "TANDEM_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Adaptive K speculates only while at most this many generations run here (beyond, a
    /// batch of plain target steps is cheaper); 0: no limit. Default: 1 for a CPU target whose
    /// draft-node runs on its cores (the nodes report one machine and CPU sets that overlap;
    /// nodes that do not report: the same host or loopback both), no limit otherwise. Requests
    /// that fix K are not affected.
    #[arg(long, env = "TANDEM_MAX_SPECULATING_SESSIONS")]
    pub max_speculating_sessions: Option<usize>,
    /// How long a generation whose target-node was lost (stopped, restarted, unreachable, not
    /// answering) waits for it to come back, its session rebuilt from the log, before failing
    /// with UNAVAILABLE.
    #[arg(long, env = "TANDEM_TARGET_RETRY_SECS", default_value_t = 30)]
    pub target_retry_secs: u64,
    /// A draft step is abandoned (its round decoded by the target alone, the draft-node
    /// re-attached) after 8 times its expected time plus this many milliseconds: raise it for a
    /// link whose delay jitters by more.
    #[arg(long, env = "TANDEM_DRAFT_STEP_SLACK_MS", default_value_t = 500)]
    pub draft_step_slack_ms: u64,
    /// Once a generation's target session is open, its draft session is waited for as long
    /// again as that took, and at least this many milliseconds; past that the generation starts
    /// with the target alone and attaches the draft in the background (a silent draft link
    /// delays no generation).
    #[arg(long, env = "TANDEM_DRAFT_OPEN_GRACE_MS", default_value_t = 250)]
    pub draft_open_grace_ms: u64,
    /// Tokens of each tenant's earlier outputs that n-gram lookup may continue (a tenant: a
    /// request's `cache_salt`, else its API key; the oldest outputs go first, and the least
    /// recently seen of more than 64 tenants); 0 keeps none.
    #[arg(long, env = "TANDEM_HISTORY_TOKENS", default_value_t = crate::engine::history::DEFAULT_HISTORY_TOKENS)]
    pub history_tokens: usize,
    /// A file where what the adaptive policy learns (the nodes' costs, the drafts' acceptance,
    /// per load) is saved as generations end, and which a coordinator of the same models on
    /// the same devices starts from instead of priors. Missing: created; of another pair:
    /// replaced (with a warning).
    #[arg(long, env = "TANDEM_POLICY_FILE")]
    pub policy_file: Option<std::path::PathBuf>,
    /// A key clients must present (`Authorization: Bearer KEY`; gRPC: `authorization`
    /// metadata) on the public APIs; repeatable. Unset: the APIs are open. Health, readiness and
    /// metrics stay open.
    #[arg(
        long = "api-key",
        env = "TANDEM_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<crate::api::auth::Secret>,
    /// Every API key one tenant of the nodes' prefix caches: a request finds the prompts that
    /// requests of any key left there (and `cached_tokens` says how much of its own prompt they
    /// had sent). For deployments whose keys are all one tenant's; unset, each key's prompts are
    /// found by that key's requests only. A request's `cache_salt` still separates.
    #[arg(long, env = "TANDEM_SHARED_PREFIX_CACHE")]
    pub shared_prefix_cache: bool,
    /// A name clients give as `model` on the HTTP API, and answers carry (the first);
    /// repeatable. Unset: the target's model name.
    #[arg(
        long = "served-model-name",
        env = "TANDEM_SERVED_MODEL_NAMES",
        value_delimiter = ','
    )]
    pub served_model_names: Vec<String>,
    /// What the HTTP API's responses say of each request's speculation, in vLLM's
    /// `metrics.speculative_decoding`: `none`, `summary` (counts, acceptance rate, mean
    /// acceptance length, histogram of accepted drafts per verify), or `detailed` (and per
    /// verify, drafts proposed and accepted). Streamed: in the usage chunk.
    #[arg(
        long,
        env = "TANDEM_PER_REQUEST_SPEC_DECODE_METRICS",
        value_enum,
        default_value_t = SpecMetrics::None
    )]
    pub per_request_spec_decode_metrics: SpecMetrics,
    /// Generations one client (its API key where keys are required, else its IP address) may
    /// have in flight on the public APIs; one more gets RESOURCE_EXHAUSTED / HTTP 429 with
    /// `Retry-After`. 0: no limit.
    #[arg(long, env = "TANDEM_MAX_REQUESTS_PER_CLIENT", default_value_t = 0)]
    pub max_requests_per_client: usize,
    /// A proxy (an address or a CIDR block: 10.0.0.0/8) whose `X-Forwarded-For` (gRPC:
    /// `x-forwarded-for` metadata) says who the client is, for --max-requests-per-client where
    /// keys are not required: a request from one is the rightmost address there that is not a
    /// trusted proxy. Repeatable. Others' headers are ignored. Unset: the peer's address.
    #[arg(
        long = "trusted-proxy",
        env = "TANDEM_TRUSTED_PROXIES",
        value_delimiter = ','
    )]
    pub trusted_proxies: Vec<crate::api::limits::Cidr>,
    /// TLS of the public gRPC API; `--tls-cert`/`--tls-key` are also the certificate presented
    /// to nodes that ask for one (mutual TLS).
    #[command(flatten)]
    pub tls: tandem_proto::tls::ServerTls,
    /// CA (PEM) the nodes' certificates must chain to, for `https://` node URLs; unset: the Web
    /// PKI roots.
    #[arg(long, env = "TANDEM_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Nodes in this process instead of `--target`/`--draft`: one machine serving both models.
    #[command(flatten)]
    pub here: HereArgs,
}

/// `coordinator serve --target-model M [--draft-model D]`: the target (and draft) loaded in this
/// process, on one machine, as `coordinator generate` runs them: every model's kernels go
/// through the process's one CPU pool, so the cores go to whichever model runs (no split of the
/// cores between draft and target to choose, and no two pools spinning on the same cores).
#[derive(Debug, Args)]
#[command(next_help_heading = "Models served in this process (instead of --target/--draft)")]
pub struct HereArgs {
    /// The target model, loaded here: a Hugging Face folder, a .gguf file, or a Hub reference.
    #[arg(long, conflicts_with = "targets")]
    pub target_model: Option<String>,
    /// The draft model, loaded here beside --target-model; unset decodes with the target alone.
    #[arg(long, requires = "target_model", conflicts_with = "drafts")]
    pub draft_model: Option<String>,
    /// Device of the models loaded here: cpu, or cuda:N (needs the `cuda` feature).
    #[arg(long, default_value = "cpu", requires = "target_model")]
    pub device: String,
    #[command(flatten)]
    pub limits: tandem_node::LimitsArgs,
}

#[derive(Debug, Args)]
pub struct QuantizeArgs {
    /// Hugging Face model folder, or a Hub reference `org/name[@revision]`.
    #[arg(long)]
    pub model: String,
    /// Output .gguf path.
    #[arg(long)]
    pub out: PathBuf,
    /// f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k or q4_k_m.
    #[arg(long = "type", default_value = "q8_0")]
    pub quant_type: String,
}

/// `--draft-tokens`: `auto` or a fixed K.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftTokens(pub Option<usize>);

impl DraftTokens {
    /// True when K is fixed at 0: the target alone.
    pub fn target_only(self) -> bool {
        self.0 == Some(0)
    }
}

impl std::str::FromStr for DraftTokens {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self(None)),
            n => n
                .parse()
                .map(|k| Self(Some(k)))
                .map_err(|_| format!("expected `auto` or a number of tokens, got `{n}`")),
        }
    }
}

impl std::fmt::Display for DraftTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(k) => write!(f, "{k}"),
            None => f.write_str("auto"),
        }
    }
}
