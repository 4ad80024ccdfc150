//! What every API request passes before its protocol sees it: the API key, the body size limit,
//! JSON, and the served model name.

use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Body;
use axum::http::{header, HeaderMap};
use deepinfer_recipe::Protocol;
use serde_json::Value;

use super::errors::{ApiError, Dialect, Kind};
use super::state::AppState;

/// `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic clients).
pub fn check_key(s: &AppState, headers: &HeaderMap, d: Dialect) -> Result<(), ApiError> {
    let Some(key) = &s.cfg.api_key else { return Ok(()) };
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let x = headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim);
    // Compared in constant time: the key must not leak through timing.
    let ok = |k: Option<&str>| {
        k.is_some_and(|k| k.len() == key.len() && k.bytes().zip(key.bytes()).fold(0u8, |a, (x, y)| a | (x ^ y)) == 0)
    };
    if ok(bearer) || ok(x) {
        Ok(())
    } else {
        Err(ApiError::new(d, Kind::Unauthorized, "missing or wrong API key"))
    }
}

/// The body as a JSON object naming the served model (401, 413, 400 or 404 otherwise).
pub async fn read_json(s: &AppState, headers: &HeaderMap, body: Body, d: Dialect) -> Result<Value, ApiError> {
    check_key(s, headers, d)?;
    let bytes = axum::body::to_bytes(body, s.cfg.max_body).await.map_err(|_| {
        ApiError::new(
            d,
            Kind::TooLarge,
            format!("the request body is over {} bytes (--max-body-bytes)", s.cfg.max_body),
        )
    })?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad(d, format!("the request body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad(d, "the request body must be a JSON object"));
    }
    match v.get("model") {
        Some(Value::String(m)) if *m == s.cfg.served => Ok(v),
        Some(Value::String(m)) => Err(ApiError::new(
            d,
            Kind::NotFound,
            format!("The model `{m}` does not exist. This server serves `{}`.", s.cfg.served),
        )
        .with_param("model")),
        None | Some(Value::Null) => Err(ApiError::bad(d, "`model` is required").with_param("model")),
        Some(_) => Err(ApiError::bad(d, "`model` must be a string").with_param("model")),
    }
}

/// A response id in the protocol's style (`chatcmpl-`, `resp_`, `msg_`, `cmpl-`), unique in this
/// process and unlikely to repeat across restarts.
pub fn response_id(p: Protocol) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let tag = format!("{:012x}{:06x}", (t as u64) & 0xffff_ffff_ffff, n & 0xff_ffff);
    match p {
        Protocol::Chat => format!("chatcmpl-{tag}"),
        Protocol::Responses => format!("resp_{tag}"),
        Protocol::Messages => format!("msg_{tag}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_ids_are_distinct_and_styled() {
        let a = response_id(Protocol::Chat);
        let b = response_id(Protocol::Chat);
        assert!(a.starts_with("chatcmpl-") && a != b);
        assert!(response_id(Protocol::Messages).starts_with("msg_"));
    }
}
