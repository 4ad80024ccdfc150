//! The HTTP routes, and the small endpoints: models, health, metrics, token counting.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use deepinfer_recipe::{convert_with, render, Encoding, Protocol};
use serde_json::{json, Value};

use super::errors::{ApiError, Dialect, Kind};
use super::protocol::{conversion_options, unix_now};
use super::request::{check_key, read_json};
use super::state::AppState;
use super::{completions, protocol};

type S = State<Arc<AppState>>;

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route(
            "/v1/chat/completions",
            post(|State(s): S, h: HeaderMap, b: Body| protocol::handle(s, h, b, Protocol::Chat)),
        )
        .route(
            "/v1/responses",
            post(|State(s): S, h: HeaderMap, b: Body| protocol::handle(s, h, b, Protocol::Responses)),
        )
        .route("/v1/messages", post(|State(s): S, h: HeaderMap, b: Body| protocol::handle(s, h, b, Protocol::Messages)))
        .route("/v1/completions", post(|State(s): S, h: HeaderMap, b: Body| completions::handle(s, h, b)))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        // Bodies are read with the server's own limit, so that a 413 comes in the protocol's JSON.
        .layer(DefaultBodyLimit::disable())
        .with_state(state)
}

async fn not_found(uri: Uri) -> Response {
    let d = if uri.path().starts_with("/v1/messages") { Dialect::Anthropic } else { Dialect::OpenAi };
    ApiError::new(d, Kind::NotFound, format!("no route {}", uri.path())).into_response()
}

async fn models(State(s): S, headers: HeaderMap) -> Response {
    if let Err(e) = check_key(&s, &headers, Dialect::OpenAi) {
        return e.into_response();
    }
    let m = json!({"id": s.cfg.served, "object": "model", "created": unix_now(), "owned_by": "deepinfer",
                   "root": s.cfg.served, "max_model_len": s.cfg.max_context,
                   // Anthropic's models list reads these.
                   "type": "model", "display_name": s.cfg.served, "created_at": "1970-01-01T00:00:00Z"});
    axum::Json(
        json!({"object": "list", "data": [m], "has_more": false, "first_id": s.cfg.served, "last_id": s.cfg.served}),
    )
    .into_response()
}

/// 200 once the model is loaded and the engine runs; 503 while shutting down.
async fn health(State(s): S) -> Response {
    if s.ready.load(Ordering::SeqCst) {
        StatusCode::OK.into_response()
    } else {
        StatusCode::SERVICE_UNAVAILABLE.into_response()
    }
}

async fn metrics(State(s): S) -> Response {
    let text = s.metrics.render(&s.cfg.served, &s.gauges());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// Anthropic's token counting: the prompt the request would render, in tokens.
async fn count_tokens(State(s): S, headers: HeaderMap, body: Body) -> Response {
    let d = Dialect::Anthropic;
    let r = async {
        let mut b = read_json(&s, &headers, body, d).await?;
        if b.get("max_tokens").is_none() {
            b["max_tokens"] = Value::from(1); // not part of a count request; the conversion wants one
        }
        let conv = convert_with(Protocol::Messages, &b, conversion_options(&s))
            .map_err(|e| ApiError::bad(d, e.to_string()))?;
        let r = render(&conv.request, Encoding::of(conv.model_version()), Some(&s.tok));
        let ids = r.token_ids.ok_or_else(|| ApiError::bad(d, r.encode_error.unwrap_or_default()))?;
        Ok::<_, ApiError>(axum::Json(json!({"input_tokens": ids.len()})).into_response())
    };
    r.await.unwrap_or_else(|e| e.into_response())
}
