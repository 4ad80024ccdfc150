//! Errors of the protocol layer, with the HTTP status and body a server returns for them.

use serde_json::{json, Value};
use thiserror::Error;

use crate::Protocol;

#[derive(Debug, Error)]
pub enum RecipeError {
    /// The request is invalid or unsupported (400) or conversion failed internally (500); the
    /// message names the offending field (from the official conversion).
    #[error("{message}")]
    Conversion { status: u16, message: String, kind: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("stream: {0}")]
    Stream(String),
}

impl RecipeError {
    pub fn status(&self) -> u16 {
        match self {
            RecipeError::Conversion { status, .. } => *status,
            RecipeError::Tokenizer(_) | RecipeError::Stream(_) => 500,
        }
    }

    /// The official (OpenAI-shaped) error body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn openai_body(&self) -> Value {
        let (kind, message) = match self {
            RecipeError::Conversion { kind, message, .. } => (kind.as_str(), message.clone()),
            other => ("internal_error", other.to_string()),
        };
        let code = if self.status() >= 500 { kind } else { "invalid_request_error" };
        json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
    }

    /// The body for `protocol`: Anthropic Messages errors are `{"type": "error", "error": {...}}`.
    pub fn body(&self, protocol: Protocol) -> Value {
        match protocol {
            Protocol::Messages => {
                let kind = if self.status() >= 500 { "api_error" } else { "invalid_request_error" };
                json!({"type": "error", "error": {"type": kind, "message": self.to_string()}})
            }
            _ => self.openai_body(),
        }
    }
}

impl From<deepseek_recipe::request::ConversionError> for RecipeError {
    fn from(e: deepseek_recipe::request::ConversionError) -> Self {
        let status = e.status_code();
        let body = e.into_error_response();
        RecipeError::Conversion { status, message: body.error.message, kind: body.error.r#type }
    }
}
