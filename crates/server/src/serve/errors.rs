//! Errors as each protocol's clients expect them: OpenAI's `{"error": {message, type, param, code}}`
//! and Anthropic's `{"type": "error", "error": {type, message}}`, with the status codes the
//! official clients turn into their typed exceptions (400, 401, 404, 413, 429 / Anthropic 529, 500).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Which error body a route answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    OpenAi,
    Anthropic,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    BadRequest,
    Unauthorized,
    NotFound,
    TooLarge,
    /// Past `--max-queued`.
    Overloaded,
    Internal,
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub kind: Kind,
    pub message: String,
    /// The request field at fault, where one is.
    pub param: Option<String>,
    pub dialect: Dialect,
}

/// Seconds a client is asked to wait after an overload answer.
const RETRY_AFTER_S: &str = "1";

impl ApiError {
    pub fn new(dialect: Dialect, kind: Kind, message: impl Into<String>) -> ApiError {
        ApiError { kind, message: message.into(), param: None, dialect }
    }

    pub fn bad(dialect: Dialect, message: impl Into<String>) -> ApiError {
        ApiError::new(dialect, Kind::BadRequest, message)
    }

    pub fn with_param(mut self, p: impl Into<String>) -> ApiError {
        self.param = Some(p.into());
        self
    }

    pub fn status(&self) -> StatusCode {
        match (self.kind, self.dialect) {
            (Kind::BadRequest, _) => StatusCode::BAD_REQUEST,
            (Kind::Unauthorized, _) => StatusCode::UNAUTHORIZED,
            (Kind::NotFound, _) => StatusCode::NOT_FOUND,
            (Kind::TooLarge, _) => StatusCode::PAYLOAD_TOO_LARGE,
            (Kind::Overloaded, Dialect::OpenAi) => StatusCode::TOO_MANY_REQUESTS,
            // Anthropic's "overloaded_error" status.
            (Kind::Overloaded, Dialect::Anthropic) => {
                StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE)
            }
            (Kind::Internal, _) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The error body's JSON.
    pub fn body(&self) -> serde_json::Value {
        match self.dialect {
            Dialect::OpenAi => {
                let (ty, code) = match self.kind {
                    Kind::BadRequest => ("invalid_request_error", "invalid_request_error"),
                    Kind::Unauthorized => ("authentication_error", "invalid_api_key"),
                    Kind::NotFound => ("invalid_request_error", "model_not_found"),
                    Kind::TooLarge => ("invalid_request_error", "request_too_large"),
                    Kind::Overloaded => ("rate_limit_error", "rate_limit_exceeded"),
                    Kind::Internal => ("internal_error", "internal_error"),
                };
                json!({"error": {"message": self.message, "type": ty, "param": self.param, "code": code}})
            }
            Dialect::Anthropic => {
                let ty = match self.kind {
                    Kind::BadRequest => "invalid_request_error",
                    Kind::Unauthorized => "authentication_error",
                    Kind::NotFound => "not_found_error",
                    Kind::TooLarge => "request_too_large",
                    Kind::Overloaded => "overloaded_error",
                    Kind::Internal => "api_error",
                };
                json!({"type": "error", "error": {"type": ty, "message": self.message}})
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status(), axum::Json(self.body())).into_response();
        if self.kind == Kind::Overloaded {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static(RETRY_AFTER_S));
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_bodies_follow_each_dialect() {
        let o = ApiError::new(Dialect::OpenAi, Kind::Overloaded, "busy");
        assert_eq!(o.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(o.body()["error"]["type"], "rate_limit_error");
        let a = ApiError::new(Dialect::Anthropic, Kind::Overloaded, "busy");
        assert_eq!(a.status().as_u16(), 529);
        assert_eq!(a.body()["error"]["type"], "overloaded_error");
        assert_eq!(a.body()["type"], "error");
        let b = ApiError::bad(Dialect::OpenAi, "`n` must be positive").with_param("n");
        assert_eq!((b.status(), b.body()["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("n")));
        let r = ApiError::new(Dialect::OpenAi, Kind::Overloaded, "busy").into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
    }
}
