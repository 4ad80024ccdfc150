//! Outputs: model output (text chunks or token ids) -> the official stream parser (reasoning,
//! content, DSML tool calls, stop sequences, JSON mode) -> the protocol's stream events and the
//! accumulated final response, with usage including cached-token counts. Token ids are decoded
//! incrementally by the official decoder, which holds back an incomplete UTF-8 character.

use deepseek_recipe::anthropic::MessagesRequest;
use deepseek_recipe::openai::{ChatCompletionRequest, ResponsesRequest};
use deepseek_recipe::request::ProtocolRequest;
use deepseek_recipe::response::{Accumulate, ProtocolResponse};
use deepseek_recipe::stream::{ChunkGenerator, InferenceChunk, InferenceFinishReason, PromptUsage, StreamProcessor};
use serde::Serialize;
use serde_json::Value;

use crate::block_on::block_on;
use crate::error::RecipeError;
use crate::protocol::{Converted, Protocol};
use crate::tokenizer::DeepseekTokenizer;

/// One piece of model output.
#[derive(Debug, Clone)]
pub enum OutputPiece {
    Text(String),
    Tokens(Vec<u32>),
}

/// A stream event: SSE event name (if the protocol names events) and its data.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct StreamEvent {
    pub event: Option<String>,
    pub data: Value,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ParsedOutput {
    pub events: Vec<StreamEvent>,
    /// The protocol's final SSE data line (`[DONE]` for Chat Completions), if any.
    pub sse_done_data: Option<String>,
    pub response: Value,
}

/// Inputs of a parse besides the output itself.
pub struct ParseContext<'a> {
    pub response_id: &'a str,
    pub prompt_tokens: usize,
    pub prompt_cache_hit_tokens: usize,
    pub finish: InferenceFinishReason,
    pub tokenizer: Option<&'a DeepseekTokenizer>,
}

fn run<R: ProtocolRequest>(
    conv: &Converted,
    output: &[OutputPiece],
    ctx: &ParseContext<'_>,
) -> Result<ParsedOutput, RecipeError>
where
    <<R::Response as ProtocolResponse>::ChunkGenerator as ChunkGenerator>::Chunk: Serialize + Send,
{
    use tokio_stream_shim::iter;
    let generator = R::chunk_generator(&conv.request, ctx.response_id.to_string(), conv.model.clone());
    let mut proc = StreamProcessor::new(generator, conv.request.parsing_options.clone());
    if let Some(t) = ctx.tokenizer {
        proc = proc.with_tokenizer(t.tokenizer().clone());
    }
    let mut chunks = vec![InferenceChunk::Ready {
        system_fingerprint: None,
        prompt_usage: PromptUsage {
            prompt_tokens: ctx.prompt_tokens,
            prompt_cache_hit_tokens: ctx.prompt_cache_hit_tokens,
        },
    }];
    for p in output {
        chunks.push(match p {
            OutputPiece::Text(t) => InferenceChunk::Text { content: t.clone(), token_count: 1 },
            OutputPiece::Tokens(ids) => InferenceChunk::Tokens { token_ids: ids.clone(), logprobs: None },
        });
    }
    chunks.push(InferenceChunk::Finish { finish_reason: ctx.finish });
    let stream = proc.into_protocol_stream(iter(chunks));
    let collected = block_on(collect(stream))?;
    let mut resp = R::Response::new(
        ctx.response_id.to_string(),
        conv.model.clone(),
        0,
        ctx.prompt_tokens,
        ctx.prompt_cache_hit_tokens,
    );
    let mut events = Vec::new();
    for ev in collected {
        let name = R::Response::sse_event_name(&ev).map(str::to_string);
        let data = serde_json::to_value(&ev).map_err(|e| RecipeError::Stream(e.to_string()))?;
        events.push(StreamEvent { event: name, data });
        resp.accumulate(ev);
    }
    Ok(ParsedOutput {
        events,
        sse_done_data: R::Response::sse_done_data(),
        response: serde_json::to_value(&resp).map_err(|e| RecipeError::Stream(e.to_string()))?,
    })
}

async fn collect<S, T>(stream: S) -> Result<Vec<T>, RecipeError>
where
    S: tokio_stream_shim::Stream<Item = Result<T, deepseek_recipe::stream::StreamError>>,
{
    use tokio_stream_shim::StreamExt;
    let mut s = std::pin::pin!(stream);
    let mut out = Vec::new();
    while let Some(x) = s.next().await {
        out.push(x.map_err(|e| RecipeError::Stream(e.to_string()))?);
    }
    Ok(out)
}

/// Parse `output` as the response to `conv`, in its protocol.
pub fn parse_output(
    conv: &Converted,
    output: &[OutputPiece],
    ctx: &ParseContext<'_>,
) -> Result<ParsedOutput, RecipeError> {
    match conv.protocol {
        Protocol::Chat => run::<ChatCompletionRequest>(conv, output, ctx),
        Protocol::Responses => run::<ResponsesRequest>(conv, output, ctx),
        Protocol::Messages => run::<MessagesRequest>(conv, output, ctx),
    }
}

/// The `Stream` trait and helpers come from `tokio-stream`, the official crate's own dependency.
mod tokio_stream_shim {
    pub use tokio_stream::{iter, Stream, StreamExt};
}
