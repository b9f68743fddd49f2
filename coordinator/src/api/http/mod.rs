//! The OpenAI-compatible HTTP API of the coordinator (axum): `POST /v1/completions`,
//! `POST /v1/chat/completions` (streaming as server-sent events ending in `data: [DONE]`, or
//! whole), `GET /v1/models`, `GET /health`, `GET /ready`.

pub mod chat;
mod choices;
mod error;
mod openai;
pub mod spec_metrics;
mod sse;
mod tools;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;
use tandem_proto::v1;
use tracing::Instrument;

use crate::api::auth::Access;
use crate::api::limits::ClientPermit;
use crate::engine::late_engine::LateEngine;
use crate::engine::{Engine, Job};
use error::ApiError;
use openai::{ChatRequest, Common, CompletionRequest, Head, Kind};
use spec_metrics::SpecMetrics;
use tools::Tools;

/// What the handlers share.
#[derive(Debug)]
pub struct HttpState {
    pub engine: LateEngine,
    /// Keys a `/v1/*` request must present ([`crate::api::auth`]), generations a client may have in
    /// flight ([`crate::api::limits`]).
    pub access: Access,
    /// The names clients may give as `model` (`--served-model-name`); the first is the one
    /// answers carry. None: the target's model name.
    pub served_names: Vec<String>,
    /// False while shutting down: `/ready` fails so load balancers stop sending.
    pub ready: AtomicBool,
    /// What responses say of their speculation (`--per-request-spec-decode-metrics`).
    pub spec_metrics: SpecMetrics,
    /// Response ids: this process's random prefix, then a count (unique across restarts and
    /// replicas, as OpenAI's are).
    id_prefix: u64,
    next_id: AtomicU64,
}

impl HttpState {
    pub fn new(
        engine: LateEngine,
        access: Access,
        served_names: Vec<String>,
        spec_metrics: SpecMetrics,
    ) -> Arc<Self> {
        Arc::new(Self {
            engine,
            access,
            served_names,
            ready: AtomicBool::new(true),
            spec_metrics,
            id_prefix: tandem_proto::random_seed(),
            next_id: AtomicU64::new(0),
        })
    }

    /// The model name answers carry, and every name a request may ask for.
    fn model_names(&self, engine: &Engine) -> (String, Vec<String>) {
        let target = engine.target().info.model_name.clone();
        match self.served_names.first() {
            Some(first) => (first.clone(), self.served_names.clone()),
            None => (target.clone(), vec![target]),
        }
    }

    /// The salt of the tenant of a request with `headers` in the nodes' prefix caches
    /// ([`Access::tenant`]).
    fn tenant(&self, headers: &HeaderMap) -> Vec<u8> {
        let authorization = crate::api::auth::http_authorization(headers);
        self.access.tenant(authorization)
    }

    /// The engine, and the head of a response naming the model clients name in `model` (the
    /// target's model name).
    fn head(&self, kind: Kind, requested: Option<&str>) -> Result<(Arc<Engine>, Head), ApiError> {
        let engine = self.engine.get()?;
        let (model, names) = self.model_names(&engine);
        if let Some(m) = requested.filter(|m| !names.iter().any(|n| n == m)) {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!(
                    "the model `{m}` does not exist: this server serves `{}`",
                    names.join("`, `")
                ),
                param: Some("model".into()),
                code: Some("model_not_found"),
            });
        }
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let prefix = if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        };
        let head = Head {
            id: format!("{prefix}-{:016x}{n:x}", self.id_prefix),
            created: now(),
            model,
            kind,
            spec_metrics: self.spec_metrics,
        };
        Ok((engine, head))
    }
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Where `/metrics` is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricsOn {
    /// With the API.
    Api,
    /// On a listener of its own (`--metrics-listen`): not with the API.
    Elsewhere,
}

/// The HTTP routes over `state`.
pub fn router(state: Arc<HttpState>, metrics: MetricsOn) -> Router {
    let api = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route_layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            require_key,
        ));
    let probes = Router::new()
        .merge(api)
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/ready", get(ready));
    match metrics {
        MetricsOn::Api => probes.route("/metrics", get(exposition)),
        MetricsOn::Elsewhere => probes,
    }
    .layer(axum::middleware::from_fn(openai_errors))
    .with_state(state)
}

/// Axum's own refusals (no route: 404, wrong method: 405, body over the limit: 413, bodies it
/// could not read) in OpenAI's error shape, as clients parse every error.
async fn openai_errors(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    let response = next.run(request).await;
    let status = response.status();
    let json = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if json || !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let allow = response.headers().get(axum::http::header::ALLOW).cloned();
    let text = axum::body::to_bytes(response.into_body(), 4096)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let message = match status {
        StatusCode::NOT_FOUND => format!(
            "`{method} {path}` is not an endpoint of this server: it serves POST \
             /v1/completions, POST /v1/chat/completions, GET /v1/models"
        ),
        StatusCode::METHOD_NOT_ALLOWED => format!("`{method}` is not allowed on `{path}`"),
        StatusCode::PAYLOAD_TOO_LARGE => {
            format!("the request body is over the limit of {MAX_BODY_BYTES} bytes")
        }
        _ if !text.is_empty() => text,
        _ => status.canonical_reason().unwrap_or("error").to_string(),
    };
    let mut out = ApiError {
        status,
        message,
        param: None,
        code: None,
    }
    .into_response();
    if let Some(allow) = allow {
        out.headers_mut().insert(axum::http::header::ALLOW, allow);
    }
    out
}

/// Largest request body (axum's default limit).
pub const MAX_BODY_BYTES: usize = 2 << 20;

/// `/metrics` alone, for a listener of its own (`--metrics-listen`: e.g. reachable by
/// Prometheus only, not by API clients).
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    state: Arc<HttpState>,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(exposition))
        .with_state(state);
    axum::serve(listener, app).await
}

/// 401 in OpenAI's shape unless the request presents one of the keys (when there are any).
async fn require_key(
    State(state): State<Arc<HttpState>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if state
        .access
        .keys
        .admits(crate::api::auth::http_authorization(request.headers()))
    {
        return next.run(request).await;
    }
    ApiError {
        status: StatusCode::UNAUTHORIZED,
        message: crate::api::auth::REFUSAL.into(),
        param: None,
        code: Some("invalid_api_key"),
    }
    .into_response()
}

/// A generation's place in its client's count (`--max-requests-per-client`), taken before the
/// body is read: 429 (with `Retry-After`) when the client has its limit in flight. The handler
/// hands it to the generation's tasks, which give it back when the last of them has ended (not
/// when a client that hung up dropped the handler's future).
#[derive(Debug)]
struct Slot(ClientPermit);

impl FromRequestParts<Arc<HttpState>> for Slot {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<HttpState>,
    ) -> Result<Self, ApiError> {
        let peer = parts
            .extensions
            .get::<ConnectInfo<std::net::SocketAddr>>()
            .map(|c| c.0.ip());
        let forwarded_for = parts.headers.get_all("x-forwarded-for");
        let permit = state.access.admit(
            crate::api::auth::http_authorization(&parts.headers),
            peer,
            forwarded_for.iter().filter_map(|v| v.to_str().ok()),
        )?;
        Ok(Self(permit))
    }
}

/// The request in `body`: an endpoint's own fields and the [`Common`] ones (read in two passes
/// rather than through `#[serde(flatten)]`, which loses the path of a wrong field). A refusal
/// names the field that was wrong (`messages[0].content`).
fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<(T, Common), ApiError> {
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(None, format!("invalid JSON body: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::invalid(
            None,
            "the body must be a JSON object with the request's fields",
        ));
    }
    fn named<U: serde::de::DeserializeOwned>(value: &serde_json::Value) -> Result<U, ApiError> {
        serde_path_to_error::deserialize(value).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            match path.as_str() {
                "." => ApiError::invalid(None, format!("invalid request: {inner}")),
                _ => ApiError::invalid(path.clone(), format!("invalid `{path}`: {inner}")),
            }
        })
    }
    Ok((named(&value)?, named(&value)?))
}

async fn completions(
    State(state): State<Arc<HttpState>>,
    Slot(slot): Slot,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let span = tracing::info_span!("http_completions");
    tandem_proto::trace::continue_http_trace(&headers, &span);
    let run = async {
        let (req, common): (CompletionRequest, Common) = parse(&body)?;
        let (engine, head) = state.head(Kind::Completion, common.model.as_deref())?;
        let request = req.prompt.into_request()?;
        let tenant = state.tenant(&headers);
        let max_tokens = openai::COMPLETION_MAX_TOKENS;
        let jobs = prepare(&engine, &common, request, max_tokens, &tenant)?;
        answer(engine, head, &common, jobs, None, slot).await
    };
    run.instrument(span)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_completions(
    State(state): State<Arc<HttpState>>,
    Slot(slot): Slot,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let span = tracing::info_span!("http_chat_completions");
    tandem_proto::trace::continue_http_trace(&headers, &span);
    let run = async {
        let (req, common): (ChatRequest, Common) = parse(&body)?;
        let (engine, head) = state.head(Kind::Chat, common.model.as_deref())?;
        let tok = &engine.tokenizer;
        let special = |id: Option<u32>| id.and_then(|i| tok.token(i)).unwrap_or_default();
        let tools = Tools::from_request(
            req.tools.as_ref(),
            req.tool_choice.as_ref(),
            req.parallel_tool_calls,
            tok.chat_template(),
        )?;
        let text = chat::render(
            tok.chat_template(),
            &req.messages,
            tools.as_ref().and_then(Tools::rendered),
            &special(tok.bos_id()),
            &special(tok.eos_id()),
            &req.chat_template_kwargs,
        )?;
        let request = v1::GenerateRequest {
            prompt_tokens: tok.encode_raw(&text).map_err(crate::error::Error::from)?,
            constraint: tools
                .as_ref()
                .and_then(Tools::grammar)
                .map(|lark| v1::Constraint {
                    kind: Some(v1::constraint::Kind::Lark(lark)),
                    start: 0,
                }),
            ..Default::default()
        };
        let tools = tools.filter(Tools::parsed);
        let tenant = state.tenant(&headers);
        let jobs = prepare(&engine, &common, request, openai::CHAT_MAX_TOKENS, &tenant)?;
        answer(engine, head, &common, jobs, tools, slot).await
    };
    run.instrument(span)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// The jobs of a request's choices ([`choices::jobs`]): `prompt` with the [`Common`] fields,
/// for the tenant `tenant` ([`Access::tenant`]).
fn prepare(
    engine: &Engine,
    common: &Common,
    prompt: v1::GenerateRequest,
    default_max_tokens: i64,
    tenant: &[u8],
) -> Result<Vec<Job>, ApiError> {
    let forced = prompt.constraint.is_some();
    let request = common.to_request(prompt, default_max_tokens)?;
    choices::jobs(engine, &request, common.choices()?, tenant).map_err(|e| {
        let mut e = ApiError::from(e);
        // The grammar that did not compile was made of the tools' parameter schemas.
        if forced && e.param.as_deref() == Some("response_format") {
            e.param = Some("tools".into());
        }
        e
    })
}

/// Runs a request's choices ([`choices`]), whole or streamed ([`sse`]), `slot` held until they
/// have ended; a chat's answers are read for calls of `tools`. A client that hangs up ends its
/// choices at their next commit (its end of their sinks is dropped with this future, or with
/// the stream's body).
async fn answer(
    engine: Arc<Engine>,
    head: Head,
    common: &Common,
    jobs: Vec<Job>,
    tools: Option<Tools>,
    slot: ClientPermit,
) -> Result<Response, ApiError> {
    if common.stream {
        return sse::answer(engine, head, common.include_usage(), jobs, tools, slot).await;
    }
    let job = jobs[0].clone();
    let (_client, sinks) = choices::whole(jobs.len());
    let mut answers = Vec::new();
    for (_, outcome) in choices::run(&engine, jobs, sinks, slot).await {
        let outcome = outcome?;
        let logprobs =
            openai::logprobs_json(head.kind, &engine.tokenizer, &outcome.logprobs, &mut 0);
        let reply = tools.as_ref().map(|tools| tools.read(&outcome.text));
        answers.push((outcome, logprobs, reply));
    }
    Ok(Json(head.response(&job, &answers)).into_response())
}

async fn models(State(state): State<Arc<HttpState>>) -> Result<Json<serde_json::Value>, ApiError> {
    let engine = state.engine.get()?;
    let (_, names) = state.model_names(&engine);
    let data: Vec<_> = names
        .iter()
        .map(|id| json!({"id": id, "object": "model", "created": now(), "owned_by": "tandem"}))
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

async fn exposition(State(state): State<Arc<HttpState>>) -> Response {
    let e = match state.engine.get() {
        Ok(e) => e,
        Err(not_ready) => return ApiError::from(not_ready).into_response(),
    };
    let text = e.exposition();
    (
        [(
            axum::http::header::CONTENT_TYPE,
            tandem_node::metrics::PROMETHEUS_TEXT,
        )],
        text,
    )
        .into_response()
}

async fn ready(State(state): State<Arc<HttpState>>) -> Response {
    if state.engine.get().is_err() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "waiting for the nodes", "reason": state.engine.why()})),
        )
            .into_response()
    } else if state.ready.load(Ordering::Relaxed) {
        Json(json!({"status": "ready"})).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "shutting down"})),
        )
            .into_response()
    }
}

/// Serves the HTTP API (with `/metrics` where `metrics` says) on `listener` until `shutdown`
/// resolves, then lets in-flight requests
/// finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<HttpState>,
    metrics: MetricsOn,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(state, metrics).into_make_service_with_connect_info::<std::net::SocketAddr>();
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}
