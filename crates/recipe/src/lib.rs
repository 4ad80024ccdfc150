//! The API protocol layer: Chat Completions, Responses and Anthropic Messages bodies to validated
//! conversations, DeepSeek V4/V4.1 prompt encodings and token ids, sampling policy and output
//! constraints (an engine request); and engine tokens back to each protocol's stream events
//! (incremental detokenization, reasoning / content / DSML tool-call parsing). Knows nothing of
//! devices.
//!
//! Built on DeepSeek's official `deepseek-recipe` 0.2.0 crates (conversion, encodings, stream
//! parsing); this crate is the engine-facing layer around them.
//!
//! ```
//! use deepinfer_recipe::{convert, render, DeepseekTokenizer, Encoding, Protocol};
//! let body = serde_json::json!({"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "Hi"}]});
//! let conv = convert(Protocol::Chat, &body)?;
//! let tok = DeepseekTokenizer::builtin()?;
//! let r = render(&conv.request, Encoding::of(conv.model_version()), Some(&tok));
//! assert!(r.prompt.contains("Hi") && r.token_ids.is_some());
//! # Ok::<(), deepinfer_recipe::RecipeError>(())
//! ```

mod block_on;
mod engine_request;
mod error;
mod grammar;
mod live;
mod protocol;
mod render;
mod stream;
mod tokenizer;

pub use deepseek_recipe::request::{ConversionOptions, ModelVersion};
pub use deepseek_recipe::stream::InferenceFinishReason;
pub use engine_request::{build as engine_request, CacheClass, Constraint, EngineRequest, SamplingParams};
pub use error::RecipeError;
pub use grammar::GrammarEnv;
pub use live::{
    live_events, live_response, sse_done_data, EventStream, InferenceChunk, InferenceTokenLogprob, LiveContext,
    PromptUsage,
};
pub use llguidance::Matcher;
pub use protocol::{convert, convert_with, Converted, Protocol};
pub use render::{render, Encoding, Rendered};
pub use stream::{parse_output, OutputPiece, ParseContext, ParsedOutput, StreamEvent};
pub use tokenizer::DeepseekTokenizer;
