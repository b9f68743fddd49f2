//! Command-line and `TANDEM_*` environment configuration shared by both nodes.

use std::net::SocketAddr;

use clap::Args;

/// What every node is started with.
#[derive(Debug, Clone, Args)]
pub struct NodeArgs {
    #[command(flatten)]
    pub source: ModelSource,
    /// Address to listen on for gRPC (port 0: a free one). Once bound, the addresses are printed
    /// on stdout as one line, `listening grpc=ADDR [http=ADDR]`.
    #[arg(long, env = "TANDEM_LISTEN")]
    pub listen: SocketAddr,
    /// Address of the HTTP side: `/metrics` (Prometheus), `/health`, `/ready`; unset serves none.
    #[arg(long, env = "TANDEM_HTTP_LISTEN")]
    pub http_listen: Option<SocketAddr>,
    #[command(flatten)]
    pub limits: LimitsArgs,
    #[command(flatten)]
    pub tls: tandem_proto::tls::ServerTls,
}

/// Which model a node serves, and where.
#[derive(Debug, Clone, Args)]
pub struct ModelSource {
    /// Model: a Hugging Face folder, a .gguf file, or a Hub reference `org/name[@revision]`
    /// (safetensors) or `org/name[@revision]:file.gguf`, fetched into the Hub cache (`HF_HOME`,
    /// `HF_HUB_CACHE`; `HF_ENDPOINT`, `HF_TOKEN` and `HF_HUB_OFFLINE` apply).
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: String,
    /// Device: cpu, or cuda:N (needs the `cuda` feature).
    #[arg(long, env = "TANDEM_DEVICE", default_value = "cpu")]
    pub device: String,
    /// Weights and activations type on a GPU: f32, f16 or bf16 (default bf16; a GGUF file's
    /// weights are dequantized to it once, at load). On the CPU, f32 (a GGUF file keeps its
    /// quantized types).
    #[arg(long, env = "TANDEM_DTYPE")]
    pub dtype: Option<String>,
    /// Caps the context below the model's own (sizes rope tables and caches).
    #[arg(long, env = "TANDEM_MAX_CONTEXT")]
    pub max_context: Option<usize>,
    /// A draft-node's vocabulary: logits for the token ids below this and the added tokens only,
    /// so that its output projection reads those rows alone (docs/architecture.md "The draft's
    /// vocabulary"). 0: every token. Default: 100000 where the tokenizer is a byte-level BPE
    /// (whose ids follow its merges, the commonest first; Qwen's and Llama 3's other scripts
    /// lie above), every token otherwise. A target-node computes every token's logits and
    /// refuses this.
    #[arg(long, env = "TANDEM_DRAFT_VOCAB")]
    pub draft_vocab: Option<usize>,
}

/// Per-node limits; a request beyond one is refused with a status naming it.
#[derive(Debug, Clone, Args)]
pub struct LimitsArgs {
    /// Sessions open at once.
    #[arg(long, env = "TANDEM_MAX_SESSIONS", default_value_t = 64)]
    pub max_sessions: usize,
    /// Largest committed length (prompt + generated tokens) of one session; 0: the model's
    /// context.
    #[arg(long, env = "TANDEM_MAX_SESSION_TOKENS", default_value_t = 0)]
    pub max_session_tokens: usize,
    /// Largest K of one draft step or verify block.
    #[arg(long, env = "TANDEM_MAX_DRAFT_TOKENS", default_value_t = 32)]
    pub max_draft_tokens: usize,
    /// A session with no message for this long is closed and its cache freed.
    #[arg(long, env = "TANDEM_IDLE_TIMEOUT_SECS", default_value_t = 300)]
    pub idle_timeout_secs: u64,
    /// KV-cache memory, in bytes, that all sessions together may grow to; a session that would
    /// pass it is refused at once (RESOURCE_EXHAUSTED). 0: 80 % of the memory free once the
    /// model is loaded (the host's on the CPU, the GPU's on CUDA).
    #[arg(long, env = "TANDEM_KV_CACHE_BYTES", default_value_t = 0)]
    pub kv_cache_bytes: u64,
    /// Most bytes the prefix cache may hold: what finished sessions computed, for a session
    /// whose prompt starts with the same tokens (a chat's next turn, a repeated system prompt)
    /// to start with instead of prefilling it. It holds only what the sessions do not reserve of
    /// --kv-cache-bytes, and gives way (least recently used first) to a session admitted. 0:
    /// off. Default: the KV-cache budget (off where the device's free memory is unknown and
    /// --kv-cache-bytes is not set).
    #[arg(long, env = "TANDEM_PREFIX_CACHE_BYTES")]
    pub prefix_cache_bytes: Option<u64>,
    /// Prompt tokens prefilled in one forward pass: a longer prompt is fed in chunks, and the
    /// work of other sessions runs between two chunks (a long prompt delays their rounds by at
    /// most one chunk's time).
    #[arg(long, env = "TANDEM_PREFILL_CHUNK", default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Most sessions whose work one forward pass runs together (continuous batching: what is
    /// ready when the model comes free runs as one batch); 1 runs sessions one at a time.
    #[arg(long, env = "TANDEM_MAX_BATCH", default_value_t = 64)]
    pub max_batch: usize,
    /// Microseconds a batch waits, while fewer sessions are ready than the last batch held, for
    /// the others to come back from their round trip through the coordinator (their work then
    /// runs in this forward pass, not in the next); where models in one process take turns on
    /// the CPU, counted from when the other's pass ended. 0: a batch runs with what is ready.
    #[arg(long, env = "TANDEM_BATCH_WAIT_US", default_value_t = 2000)]
    pub batch_wait_us: u64,
}

impl Default for LimitsArgs {
    fn default() -> Self {
        Self {
            max_sessions: 64,
            max_session_tokens: 0,
            max_draft_tokens: 32,
            idle_timeout_secs: 300,
            kv_cache_bytes: 0,
            prefix_cache_bytes: None,
            prefill_chunk: 512,
            max_batch: 64,
            batch_wait_us: 2000,
        }
    }
}
