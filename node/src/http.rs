//! The node's HTTP side: `/metrics` (Prometheus text), `/health` and `/ready`.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;

use crate::metrics::PROMETHEUS_TEXT;
use crate::state::NodeState;

/// The node's metrics in the Prometheus text format, the session table's gauges as it stands.
fn exposition(state: &NodeState) -> String {
    let m = &state.metrics;
    let (reserved, budget) = state.sessions.kv_reserved();
    let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
    m.sessions_active.set(gauge(state.sessions.active()));
    m.kv_cache_bytes.set(gauge(state.sessions.kv_bytes()));
    m.kv_cache_reserved_bytes.set(gauge(reserved));
    m.kv_cache_budget_bytes.set(gauge(budget));
    m.prefix_cache_bytes.set(gauge(state.prefixes.bytes()));
    m.prefix_cache_evicted_bytes
        .set(i64::try_from(state.prefixes.evicted_bytes()).unwrap_or(i64::MAX));
    m.kv_cache_usage_perc.set(if budget > 0 {
        reserved as f64 / budget as f64
    } else {
        0.0
    });
    m.encode()
}

async fn metrics(State(state): State<Arc<NodeState>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, PROMETHEUS_TEXT)],
        exposition(&state),
    )
}

/// Ready once the model is loaded and has run a first forward (the server starts after both),
/// whether or not any other node is up, until draining starts.
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
