//! Requests in: a protocol body -> the official conversion -> a conversation request.

use deepseek_recipe::anthropic::MessagesRequest;
use deepseek_recipe::openai::{ChatCompletionRequest, ResponsesRequest};
use deepseek_recipe::request::{
    ConversationRequest, ConversionError, ConversionOptions, ModelVersion, ProtocolRequest,
};
use serde_json::Value;

use crate::error::RecipeError;

/// The three API protocols.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// OpenAI Chat Completions.
    Chat,
    /// OpenAI Responses.
    Responses,
    /// Anthropic Messages.
    Messages,
}

impl std::str::FromStr for Protocol {
    type Err = String;
    fn from_str(s: &str) -> Result<Protocol, String> {
        match s {
            "chat" => Ok(Protocol::Chat),
            "responses" => Ok(Protocol::Responses),
            "messages" => Ok(Protocol::Messages),
            other => Err(format!("unknown protocol `{other}` (chat, responses, messages)")),
        }
    }
}

impl Protocol {
    /// Guess the protocol of a body by its fields (as the official oracle does): Responses has
    /// `input`/`instructions`; Messages has a top-level `system`, `stop_sequences`, Anthropic
    /// content blocks or `input_schema` tools; anything else with `messages` is Chat Completions.
    pub fn detect(body: &Value) -> Option<Protocol> {
        let has = |k: &str| body.get(k).is_some();
        if has("input") || has("instructions") || has("max_output_tokens") {
            return Some(Protocol::Responses);
        }
        if !has("messages") {
            return None;
        }
        if ["system", "stop_sequences", "output_config", "metadata", "top_k"].iter().any(|k| has(k)) {
            return Some(Protocol::Messages);
        }
        if body["tools"].as_array().is_some_and(|ts| ts.iter().any(|t| t.get("input_schema").is_some())) {
            return Some(Protocol::Messages);
        }
        for m in body["messages"].as_array().into_iter().flatten() {
            if let Some(blocks) = m.get("content").and_then(Value::as_array) {
                let anthropic = ["tool_use", "tool_result", "thinking", "redacted_thinking"];
                if blocks.iter().any(|b| b.get("type").and_then(Value::as_str).is_some_and(|t| anthropic.contains(&t)))
                {
                    return Some(Protocol::Messages);
                }
            }
            if m.get("role").and_then(Value::as_str).is_some_and(|r| ["system", "tool", "latest_reminder"].contains(&r))
            {
                return Some(Protocol::Chat);
            }
        }
        Some(Protocol::Chat)
    }
}

/// A converted request.
pub struct Converted {
    pub protocol: Protocol,
    pub model: String,
    pub request: ConversationRequest,
}

impl Converted {
    pub fn model_version(&self) -> ModelVersion {
        self.request.model_version
    }
}

fn parse<T: serde::de::DeserializeOwned>(body: &Value) -> Result<T, RecipeError> {
    T::deserialize(body).map_err(|e| ConversionError::bad_request(format!("invalid request body: {e}")).into())
}

/// Validate and convert a protocol body with the default conversion options (model names
/// `DeepSeek-V4-Pro` -> V4, `DeepSeek-V4.1-Flash` -> V4.1; thinking on by default).
pub fn convert(protocol: Protocol, body: &Value) -> Result<Converted, RecipeError> {
    convert_with(protocol, body, ConversionOptions::new())
}

pub fn convert_with(protocol: Protocol, body: &Value, options: ConversionOptions) -> Result<Converted, RecipeError> {
    let model = body.get("model").and_then(Value::as_str).unwrap_or_default().to_string();
    let request = match protocol {
        Protocol::Chat => parse::<ChatCompletionRequest>(body)?.convert(options)?,
        Protocol::Responses => parse::<ResponsesRequest>(body)?.convert(options)?,
        Protocol::Messages => parse::<MessagesRequest>(body)?.convert(options)?,
    };
    Ok(Converted { protocol, model, request })
}
