//! What the engine receives for a request: token ids, sampling after the model's policy, stops,
//! `max_tokens` resolved against the context, the output constraint and a KV retention class.

use deepseek_recipe::request::OutputConstraint;
use serde::Serialize;
use serde_json::Value;

use crate::error::RecipeError;
use crate::protocol::Converted;
use crate::render::{render, Encoding, Rendered};
use crate::tokenizer::DeepseekTokenizer;

/// Sampling parameters after the model's policy (thinking mode forces temperature 1.0; `top_p`
/// resolved per model version by the official conversion).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_p: f32,
    pub seed: Option<u64>,
    pub logprobs: bool,
    pub top_logprobs: Option<u8>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
}

/// A constraint the sampler enforces with token masks.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Constraint {
    /// `tool_call`, `json_object`, `json_schema` or `regex` (the official kinds).
    pub kind: String,
    /// The grammar source: JSON schema text, regex, or the tool-call grammar's schema.
    pub schema: String,
}

/// How long the prompt's KV is kept in the durable tier.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CacheClass {
    /// Requests with tools or tool results: agent loops (kept 3 days by default).
    Agent,
    /// Everything else (kept 7 days by default).
    Chat,
}

#[derive(Debug, Clone, Serialize)]
pub struct EngineRequest {
    pub token_ids: Vec<u32>,
    pub encoding: Encoding,
    pub sampling: SamplingParams,
    pub max_tokens: u32,
    pub stop_strings: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub constraint: Option<Constraint>,
    pub cache_class: CacheClass,
    pub stream: bool,
}

/// The penalties are validated by the official conversion and then omitted from it; the engine
/// supports them, so they are read from the body.
fn penalty(body: &Value, key: &str) -> f32 {
    body.get(key).and_then(Value::as_f64).unwrap_or(0.0) as f32
}

/// Build the engine request of a converted body: render and tokenize in the model version's
/// encoding, then resolve `max_tokens` against `context_limit`.
pub fn build(
    conv: &Converted,
    body: &Value,
    tok: &DeepseekTokenizer,
    context_limit: u32,
) -> Result<(EngineRequest, Rendered), RecipeError> {
    let encoding = Encoding::of(conv.model_version());
    let rendered = render(&conv.request, encoding, Some(tok));
    let ids = rendered.token_ids.clone().ok_or_else(|| {
        RecipeError::Tokenizer(
            rendered.encode_error.clone().unwrap_or_else(|| "the prompt could not be encoded".into()),
        )
    })?;
    let r = &conv.request;
    let io = &r.inference_options;
    let max_tokens = r.resolve_max_tokens(ids.len() as u32, context_limit)?;
    let conversation = &r.conversation;
    let agent =
        !conversation.tools.is_empty() || conversation.messages.iter().any(|m| format!("{m:?}").contains("tool_call"));
    let eos = tok.special_id("<｜end▁of▁sentence｜>");
    Ok((
        EngineRequest {
            token_ids: ids,
            encoding,
            sampling: SamplingParams {
                temperature: io.temperature.unwrap_or(1.0),
                top_p: io.top_p.unwrap_or(1.0),
                seed: io.seed,
                logprobs: io.logprobs,
                top_logprobs: io.top_logprobs,
                presence_penalty: penalty(body, "presence_penalty"),
                frequency_penalty: penalty(body, "frequency_penalty"),
            },
            max_tokens,
            stop_strings: r.parsing_options.stop_sequences.iter().map(|s| s.to_string()).collect(),
            stop_token_ids: eos.into_iter().collect(),
            constraint: io
                .output_constraint
                .as_ref()
                .map(|c: &OutputConstraint| Constraint { kind: c.kind().to_string(), schema: c.schema() }),
            cache_class: if agent { CacheClass::Agent } else { CacheClass::Chat },
            stream: r.stream,
        },
        rendered,
    ))
}
