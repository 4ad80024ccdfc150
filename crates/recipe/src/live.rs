//! Live output: the official stream processor over a stream of inference chunks as they are
//! sampled, for a server. [`live_events`] yields each protocol event (SSE name and JSON data) as soon
//! as the processor emits it; [`live_response`] accumulates them into the protocol's final response
//! body. The offline [`crate::parse_output`] is the same processor over a finished output.

use std::pin::Pin;

use deepseek_recipe::anthropic::MessagesRequest;
use deepseek_recipe::openai::{ChatCompletionRequest, ResponsesRequest};
use deepseek_recipe::request::ProtocolRequest;
use deepseek_recipe::response::{Accumulate, ProtocolResponse};
use deepseek_recipe::stream::{ChunkGenerator, StreamProcessor};
pub use deepseek_recipe::stream::{InferenceChunk, InferenceTokenLogprob, PromptUsage};
use serde::Serialize;
use tokio_stream::{Stream, StreamExt};

use crate::error::RecipeError;
use crate::protocol::{Converted, Protocol};
use crate::stream::StreamEvent;
use crate::tokenizer::DeepseekTokenizer;

/// Protocol events as the processor emits them.
pub type EventStream = Pin<Box<dyn Stream<Item = Result<StreamEvent, RecipeError>> + Send>>;

/// What identifies one response.
#[derive(Clone)]
pub struct LiveContext {
    pub response_id: String,
    /// Unix seconds.
    pub created: u64,
    pub tokenizer: DeepseekTokenizer,
}

type Chunk<R> = <<<R as ProtocolRequest>::Response as ProtocolResponse>::ChunkGenerator as ChunkGenerator>::Chunk;

fn processor<R: ProtocolRequest>(
    conv: &Converted,
    ctx: &LiveContext,
) -> StreamProcessor<<R::Response as ProtocolResponse>::ChunkGenerator> {
    let generator = R::chunk_generator(&conv.request, ctx.response_id.clone(), conv.model.clone());
    StreamProcessor::new(generator, conv.request.parsing_options.clone())
        .with_tokenizer(ctx.tokenizer.tokenizer().clone())
}

fn events<R: ProtocolRequest>(
    conv: &Converted,
    ctx: &LiveContext,
    inference: impl Stream<Item = InferenceChunk> + Send + 'static,
) -> EventStream
where
    Chunk<R>: Serialize + Send,
{
    let s = processor::<R>(conv, ctx).into_protocol_stream(inference).map(|r| {
        let ev = r.map_err(|e| RecipeError::Stream(e.to_string()))?;
        let event = R::Response::sse_event_name(&ev).map(str::to_string);
        let data = serde_json::to_value(&ev).map_err(|e| RecipeError::Stream(e.to_string()))?;
        Ok(StreamEvent { event, data })
    });
    Box::pin(s)
}

async fn response<R: ProtocolRequest>(
    conv: &Converted,
    ctx: &LiveContext,
    inference: impl Stream<Item = InferenceChunk> + Send + 'static,
    usage: PromptUsage,
) -> Result<serde_json::Value, RecipeError>
where
    Chunk<R>: Serialize + Send,
{
    let mut resp = R::Response::new(
        ctx.response_id.clone(),
        conv.model.clone(),
        ctx.created,
        usage.prompt_tokens,
        usage.prompt_cache_hit_tokens,
    );
    let mut s = std::pin::pin!(processor::<R>(conv, ctx).into_protocol_stream(inference));
    while let Some(ev) = s.next().await {
        resp.accumulate(ev.map_err(|e| RecipeError::Stream(e.to_string()))?);
    }
    serde_json::to_value(&resp).map_err(|e| RecipeError::Stream(e.to_string()))
}

/// The request's protocol events over `inference` (which starts with `Ready` and ends with
/// `Finish`), each yielded as soon as the processor emits it.
pub fn live_events(
    conv: &Converted,
    ctx: &LiveContext,
    inference: impl Stream<Item = InferenceChunk> + Send + 'static,
) -> EventStream {
    match conv.protocol {
        Protocol::Chat => events::<ChatCompletionRequest>(conv, ctx, inference),
        Protocol::Responses => events::<ResponsesRequest>(conv, ctx, inference),
        Protocol::Messages => events::<MessagesRequest>(conv, ctx, inference),
    }
}

/// The protocol's final response body for `inference` (non-streaming requests). `usage` is the
/// prompt side the body reports; it should equal the stream's `Ready` chunk.
pub async fn live_response(
    conv: &Converted,
    ctx: &LiveContext,
    inference: impl Stream<Item = InferenceChunk> + Send + 'static,
    usage: PromptUsage,
) -> Result<serde_json::Value, RecipeError> {
    match conv.protocol {
        Protocol::Chat => response::<ChatCompletionRequest>(conv, ctx, inference, usage).await,
        Protocol::Responses => response::<ResponsesRequest>(conv, ctx, inference, usage).await,
        Protocol::Messages => response::<MessagesRequest>(conv, ctx, inference, usage).await,
    }
}

/// The data of the protocol's final SSE message (`[DONE]` for Chat Completions), if it has one.
pub fn sse_done_data(protocol: Protocol) -> Option<String> {
    match protocol {
        Protocol::Chat => <ChatCompletionRequest as ProtocolRequest>::Response::sse_done_data(),
        Protocol::Responses => <ResponsesRequest as ProtocolRequest>::Response::sse_done_data(),
        Protocol::Messages => <MessagesRequest as ProtocolRequest>::Response::sse_done_data(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ctx() -> LiveContext {
        LiveContext { response_id: "r1".into(), created: 7, tokenizer: DeepseekTokenizer::builtin().unwrap() }
    }

    fn chunks(tok: &DeepseekTokenizer, text: &str) -> Vec<InferenceChunk> {
        let ids = tok.encode_batch(&[text.to_string()]).unwrap().remove(0);
        let mut v = vec![InferenceChunk::Ready {
            system_fingerprint: None,
            prompt_usage: PromptUsage { prompt_tokens: 11, prompt_cache_hit_tokens: 4 },
        }];
        v.extend(ids.into_iter().map(|t| InferenceChunk::Tokens { token_ids: vec![t], logprobs: None }));
        v.push(InferenceChunk::Finish { finish_reason: deepseek_recipe::stream::InferenceFinishReason::Stop });
        v
    }

    #[test]
    fn live_events_and_response_agree_with_the_offline_parse() {
        let body = json!({"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "Hi"}],
                          "thinking": {"type": "disabled"}, "stream": true});
        for p in [Protocol::Chat, Protocol::Responses, Protocol::Messages] {
            let body = if p == Protocol::Responses {
                json!({"model": "DeepSeek-V4-Pro", "input": "Hi", "thinking": {"type": "disabled"}, "stream": true})
            } else {
                body.clone()
            };
            let conv = crate::convert(p, &body).unwrap();
            let c = ctx();
            let evs: Vec<StreamEvent> = crate::block_on::block_on(
                live_events(&conv, &c, tokio_stream::iter(chunks(&c.tokenizer, "Hello there"))).collect::<Vec<_>>(),
            )
            .into_iter()
            .collect::<Result<_, _>>()
            .unwrap();
            let text: String = evs.iter().map(|e| e.data.to_string()).collect();
            assert!(text.contains("Hello") && text.contains("there"), "{p:?}: {text}");
            let usage = PromptUsage { prompt_tokens: 11, prompt_cache_hit_tokens: 4 };
            let resp = crate::block_on::block_on(live_response(
                &conv,
                &c,
                tokio_stream::iter(chunks(&c.tokenizer, "Hello there")),
                usage,
            ))
            .unwrap();
            assert!(resp.to_string().contains("Hello there"), "{p:?}: {resp}");
            assert!(resp.to_string().contains('4'), "{p:?}: the cached prompt tokens are reported: {resp}");
        }
        assert_eq!(sse_done_data(Protocol::Chat).as_deref(), Some("[DONE]"));
        assert_eq!(sse_done_data(Protocol::Messages), None);
    }
}
