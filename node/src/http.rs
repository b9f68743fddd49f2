//! The node's HTTP side: `/metrics` (Prometheus text), `/health` and `/ready`.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;

use crate::metrics::{Exposition, PROMETHEUS_TEXT};
use crate::state::NodeState;

/// The node's metrics in the Prometheus text format.
fn exposition(state: &NodeState) -> String {
    let m = &state.metrics;
    let (reserved, budget) = state.sessions.kv_reserved();
    let mut e = Exposition::default();
    e.gauge(
        "tandem_node_sessions_active",
        "Sessions open on this node.",
        state.sessions.active() as f64,
    )
    .gauge(
        "tandem_node_kv_cache_bytes",
        "KV-cache bytes held by open sessions.",
        state.sessions.kv_bytes() as f64,
    )
    .gauge(
        "tandem_node_kv_cache_reserved_bytes",
        "KV-cache bytes open sessions may grow to (what admission counts).",
        reserved as f64,
    )
    .gauge(
        "tandem_node_kv_cache_budget_bytes",
        "KV-cache bytes all sessions together may grow to (--kv-cache-bytes).",
        budget as f64,
    )
    .counter(
        "tandem_node_sessions_opened_total",
        "Sessions opened.",
        m.sessions_opened.get(),
    )
    .counter(
        "tandem_node_prefill_chunks_total",
        "Chunks of prompts prefilled (other sessions' work runs between two chunks).",
        m.prefill_chunks.get(),
    )
    .counter(
        "tandem_node_requests_total",
        "Draft steps or verify blocks answered.",
        m.requests.get(),
    )
    .counter(
        "tandem_node_tokens_total",
        "Tokens proposed (draft-node) or committed (target-node).",
        m.tokens.get(),
    )
    .histogram(
        "tandem_node_compute_seconds",
        "Model time per draft step or verify block.",
        &m.compute,
    )
    .labeled(
        "tandem_node_errors_total",
        "Refused or failed requests by gRPC code.",
        "kind",
        &m.errors,
    )
    .counter(
        "tandem_node_repeated_blocks_total",
        "Verify blocks that repeated the last one, answered without a forward pass.",
        m.repeated_blocks.get(),
    )
    .counter(
        "tandem_node_batches_total",
        "Batches of sessions' work run as one forward pass (continuous batching).",
        m.batches.get(),
    )
    .counter(
        "tandem_node_batched_requests_total",
        "Requests run in those batches (over batches: the mean batch size).",
        m.batched_requests.get(),
    )
    .labeled(
        "tandem_node_draft_blocks_refused_total",
        "Drafted blocks the target-node refused (run as plain target steps), by reason.",
        "reason",
        &m.draft_blocks_refused,
    );
    e.finish()
}

async fn metrics(State(state): State<Arc<NodeState>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, PROMETHEUS_TEXT)],
        exposition(&state),
    )
}

/// Ready once the model is loaded (the server starts after it is), until draining starts.
async fn ready(State(state): State<Arc<NodeState>>) -> axum::response::Response {
    if state.draining.load(std::sync::atomic::Ordering::Relaxed) {
        (axum::http::StatusCode::SERVICE_UNAVAILABLE, "draining").into_response()
    } else {
        "ready".into_response()
    }
}

/// Serves `/metrics`, `/health` and `/ready` until `shutdown` resolves.
pub(crate) async fn serve_http(
    listener: tokio::net::TcpListener,
    state: Arc<NodeState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .with_state(state);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}
