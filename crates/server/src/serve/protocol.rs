//! The three recipe protocols over HTTP (`/v1/chat/completions`, `/v1/responses`, `/v1/messages`):
//! body -> recipe conversion -> engine requests (`n` of them for Chat Completions) -> the official
//! stream processor over the engine's tokens as they are sampled -> SSE events or one JSON body.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use deepinfer_engine::engine::Event;
use deepinfer_engine::FinishReason;
use deepinfer_recipe::{
    convert_with, live_events, live_response, sse_done_data, ConversionOptions, Converted, InferenceChunk,
    InferenceFinishReason, InferenceTokenLogprob, LiveContext, ModelVersion, PromptUsage, Protocol, StreamEvent,
};
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use super::errors::{ApiError, Dialect, Kind};
use super::request::{read_json, response_id};
use super::state::{AppState, Flight};
use crate::api_request::map_body;

/// Most choices one Chat Completions body may ask for.
const MAX_N: u64 = 16;

pub fn dialect(p: Protocol) -> Dialect {
    if p == Protocol::Messages {
        Dialect::Anthropic
    } else {
        Dialect::OpenAi
    }
}

/// The recipe's options for this server: the served name maps to the checkpoint's encoding (the
/// name a client sends never chooses the prompt format), and `--default-thinking`.
pub fn conversion_options(s: &AppState) -> ConversionOptions {
    let version = match s.cfg.encoding {
        deepinfer_recipe::Encoding::V4 => ModelVersion::DeepseekV4Pro,
        deepinfer_recipe::Encoding::V41 => ModelVersion::DeepseekV41Flash,
    };
    let mut o = ConversionOptions::new().with_model_versions_by_name([(s.cfg.served.clone(), version)]);
    o.default_thinking_mode = s.cfg.default_thinking;
    o
}

pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A recipe failure as the protocol's error (conversion errors are the client's: 400).
fn recipe_error(d: Dialect, e: deepinfer_recipe::RecipeError) -> ApiError {
    let kind = if e.status() >= 500 { Kind::Internal } else { Kind::BadRequest };
    ApiError::new(d, kind, e.to_string())
}

pub async fn handle(s: Arc<AppState>, headers: HeaderMap, body: Body, p: Protocol) -> Response {
    match run(s, headers, body, p).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(s: Arc<AppState>, headers: HeaderMap, body: Body, p: Protocol) -> Result<Response, ApiError> {
    let d = dialect(p);
    let mut body = read_json(&s, &headers, body, d).await?;
    // The recipe accepts only n = 1; the server runs n engine requests and merges their choices.
    let n = match body.get("n") {
        None | Some(Value::Null) => 1,
        Some(v) if p == Protocol::Chat => match v.as_u64() {
            Some(n @ 1..=MAX_N) => n,
            _ => return Err(ApiError::bad(d, format!("`n` must be an integer in [1, {MAX_N}]")).with_param("n")),
        },
        Some(_) => return Err(ApiError::bad(d, "`n` is a Chat Completions field").with_param("n")),
    };
    if let Some(o) = body.as_object_mut() {
        o.remove("n");
    }
    developer_as_system(&mut body, p);
    let conv = convert_with(p, &body, conversion_options(&s)).map_err(|e| recipe_error(d, e))?;
    let mut reqs = Vec::with_capacity(n as usize);
    for i in 0..n {
        let m = map_body(&conv, &body, s.next_id(), &s.tok, s.cfg.max_context, &s.cfg.defaults)
            .map_err(|e| ApiError::bad(d, e))?;
        if i == 0 {
            for (field, asked, used) in &m.overridden {
                eprintln!(
                    "warning: request {}: `{field}` {asked} overridden to {used} by the model's policy \
                     (thinking mode; `--default-thinking off` or `thinking: {{\"type\": \"disabled\"}}` keeps it)",
                    m.request.id
                );
            }
        }
        let mut r = m.request;
        if let Some(seed) = r.sampling.seed.as_mut() {
            *seed = seed.wrapping_add(i); // distinct choices, reproducible together
        }
        reqs.push(r);
    }
    let mut flights = s.submit(reqs, d)?;
    // The first event of each: `Admitted` (with the prefix-cache hit), or `Done` for a request the
    // engine refused (a prompt past the context, a grammar that does not compile): a 400 then.
    let mut firsts = Vec::with_capacity(flights.len());
    for f in flights.iter_mut() {
        match f.next().await {
            Some(Event::Done(o)) if o.finish == FinishReason::Error => {
                return Err(ApiError::bad(d, o.error.unwrap_or_else(|| "the engine refused the request".into())));
            }
            Some(e) => firsts.push(e),
            None => return Err(ApiError::new(d, Kind::Internal, "the engine stopped")),
        }
    }
    let usage = match &firsts[0] {
        Event::Admitted { prompt_tokens, cached_tokens, .. } => {
            PromptUsage { prompt_tokens: *prompt_tokens, prompt_cache_hit_tokens: *cached_tokens }
        }
        _ => PromptUsage { prompt_tokens: flights[0].prompt_len, prompt_cache_hit_tokens: 0 },
    };
    let ctx = LiveContext { response_id: response_id(p), created: unix_now(), tokenizer: s.tok.clone() };
    let logprobs = conv.request.inference_options.logprobs;
    let errors: Arc<Mutex<Option<String>>> = Default::default();
    let inputs: Vec<_> =
        flights.into_iter().zip(firsts).map(|(f, first)| bridge(f, first, logprobs, errors.clone())).collect();
    if conv.request.stream {
        Ok(stream_response(conv, ctx, inputs, errors))
    } else {
        let mut bodies = Vec::with_capacity(inputs.len());
        for inp in inputs {
            bodies.push(live_response(&conv, &ctx, inp, usage).await.map_err(|e| recipe_error(d, e))?);
        }
        if let Some(e) = errors.lock().take() {
            return Err(ApiError::new(d, Kind::Internal, format!("generation failed: {e}")));
        }
        Ok((StatusCode::OK, axum::Json(merge_choices(bodies))).into_response())
    }
}

/// OpenAI's `developer` role is its newer name for `system` (the clients send it for o-series
/// style prompts); the V4 template has one system role, so the server renames it before conversion.
fn developer_as_system(body: &mut Value, p: Protocol) {
    let list = match p {
        Protocol::Chat => body.get_mut("messages"),
        Protocol::Responses => body.get_mut("input"),
        _ => None,
    };
    for m in list.and_then(Value::as_array_mut).into_iter().flatten() {
        if m.get("role").and_then(Value::as_str) == Some("developer") {
            m["role"] = Value::from("system");
        }
    }
}

/// The engine's events of one request as the recipe's inference chunks. A task owns the flight: when
/// the consumer goes away (client disconnected), the flight drops and the request is cancelled.
fn bridge(
    mut f: Flight,
    first: Event,
    logprobs: bool,
    errors: Arc<Mutex<Option<String>>>,
) -> UnboundedReceiverStream<InferenceChunk> {
    let (tx, rx) = unbounded_channel();
    tokio::spawn(async move {
        let mut next = Some(first);
        loop {
            let e = match next.take() {
                Some(e) => e,
                None => tokio::select! {
                    e = f.next() => match e { Some(e) => e, None => break },
                    _ = tx.closed() => break,
                },
            };
            let chunk = match e {
                Event::Admitted { prompt_tokens, cached_tokens, .. } => InferenceChunk::Ready {
                    system_fingerprint: None,
                    prompt_usage: PromptUsage { prompt_tokens, prompt_cache_hit_tokens: cached_tokens },
                },
                // End-of-sequence tokens end the output; the protocol never shows them.
                Event::Token { token, .. } if f.stop_ids.contains(&token) => continue,
                Event::Token { token, logprob, top, .. } => InferenceChunk::Tokens {
                    token_ids: vec![token],
                    logprobs: logprobs.then(|| vec![InferenceTokenLogprob { logprob, top_logprobs: top }]),
                },
                Event::Done(o) => {
                    if o.finish == FinishReason::Error {
                        *errors.lock() = Some(o.error.unwrap_or_else(|| "unknown engine error".into()));
                    }
                    let finish_reason = match o.finish {
                        FinishReason::Length => InferenceFinishReason::Length,
                        _ => InferenceFinishReason::Stop,
                    };
                    let _ = tx.send(InferenceChunk::Finish { finish_reason });
                    break;
                }
            };
            if tx.send(chunk).is_err() {
                break;
            }
        }
    });
    UnboundedReceiverStream::new(rx)
}

/// Several choices' final bodies as one: choice `i` gets index `i`, completion usage adds up.
fn merge_choices(mut bodies: Vec<Value>) -> Value {
    if bodies.len() == 1 {
        return bodies.remove(0);
    }
    let mut all = Vec::new();
    let mut completion = 0;
    for (i, b) in bodies.iter_mut().enumerate() {
        completion += b["usage"]["completion_tokens"].as_u64().unwrap_or(0);
        if let Some(cs) = b.get_mut("choices").and_then(Value::as_array_mut) {
            for mut c in cs.drain(..) {
                c["index"] = json!(i);
                all.push(c);
            }
        }
    }
    let mut out = bodies.swap_remove(0);
    out["choices"] = Value::Array(all);
    if out.get("usage").is_some_and(Value::is_object) {
        let prompt = out["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
        out["usage"]["completion_tokens"] = json!(completion);
        out["usage"]["total_tokens"] = json!(prompt + completion);
    }
    out
}

fn sse_bytes(ev: &StreamEvent) -> Bytes {
    Bytes::from(match &ev.event {
        Some(name) => format!("event: {name}\ndata: {}\n\n", ev.data),
        None => format!("data: {}\n\n", ev.data),
    })
}

/// The SSE body: every choice's events as they come (Chat chunks re-indexed by choice), one usage
/// chunk for all choices, the protocol's error event if generation failed, and its final message.
fn stream_response(
    conv: Converted,
    ctx: LiveContext,
    inputs: Vec<UnboundedReceiverStream<InferenceChunk>>,
    errors: Arc<Mutex<Option<String>>>,
) -> Response {
    let (out, rx) = unbounded_channel::<Result<Bytes, Infallible>>();
    let n = inputs.len();
    let (merged, mut merged_rx) = unbounded_channel::<(usize, Result<StreamEvent, String>)>();
    for (i, inp) in inputs.into_iter().enumerate() {
        let mut events = live_events(&conv, &ctx, inp);
        let merged: UnboundedSender<_> = merged.clone();
        tokio::spawn(async move {
            while let Some(e) = events.next().await {
                if merged.send((i, e.map_err(|e| e.to_string()))).is_err() {
                    break;
                }
            }
        });
    }
    drop(merged);
    let protocol = conv.protocol;
    tokio::spawn(async move {
        let mut usage: Option<Value> = None;
        while let Some((i, e)) = merged_rx.recv().await {
            let mut ev = match e {
                Ok(ev) => ev,
                Err(msg) => {
                    *errors.lock() = Some(msg);
                    continue;
                }
            };
            if n > 1 {
                let has_usage = ev.data.get("usage").is_some_and(Value::is_object);
                match ev.data.get_mut("choices").and_then(Value::as_array_mut) {
                    // The usage-only chunk of each choice: one chunk for all, at the end.
                    Some(cs) if cs.is_empty() && has_usage => {
                        let c = ev.data["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                        match usage.as_mut() {
                            None => usage = Some(ev.data.clone()),
                            Some(u) => {
                                let total = u["usage"]["completion_tokens"].as_u64().unwrap_or(0) + c;
                                let prompt = u["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
                                u["usage"]["completion_tokens"] = json!(total);
                                u["usage"]["total_tokens"] = json!(prompt + total);
                            }
                        }
                        continue;
                    }
                    Some(cs) => cs.iter_mut().for_each(|c| c["index"] = json!(i)),
                    None => {}
                }
            }
            if out.send(Ok(sse_bytes(&ev))).is_err() {
                return; // client gone: dropping the streams cancels the requests
            }
        }
        if let Some(u) = usage {
            let _ = out.send(Ok(sse_bytes(&StreamEvent { event: None, data: u })));
        }
        if let Some(msg) = errors.lock().take() {
            let err = ApiError::new(dialect(protocol), Kind::Internal, format!("generation failed: {msg}"));
            let event = (protocol == Protocol::Messages).then(|| "error".to_string());
            let _ = out.send(Ok(sse_bytes(&StreamEvent { event, data: err.body() })));
        }
        if let Some(done) = sse_done_data(protocol) {
            let _ = out.send(Ok(Bytes::from(format!("data: {done}\n\n"))));
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(UnboundedReceiverStream::new(rx)))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn developer_messages_become_system_messages_in_chat_and_responses_only() {
        let mut chat = json!({"messages": [{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}]});
        developer_as_system(&mut chat, Protocol::Chat);
        assert_eq!(chat["messages"][0]["role"], "system");
        assert_eq!(chat["messages"][1]["role"], "user");
        let mut resp = json!({"input": [{"role": "developer", "content": "x"}]});
        developer_as_system(&mut resp, Protocol::Responses);
        assert_eq!(resp["input"][0]["role"], "system");
        let mut msgs = json!({"messages": [{"role": "developer", "content": "x"}]});
        developer_as_system(&mut msgs, Protocol::Messages);
        assert_eq!(msgs["messages"][0]["role"], "developer", "Anthropic has no such role: left for its error");
        let mut text = json!({"input": "plain"});
        developer_as_system(&mut text, Protocol::Responses);
        assert_eq!(text["input"], "plain");
    }

    #[test]
    fn merged_choices_are_reindexed_and_usage_adds_up() {
        let b = |t: &str| {
            json!({"choices": [{"index": 0, "message": {"content": t}}],
                   "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})
        };
        let m = merge_choices(vec![b("a"), b("b"), b("c")]);
        let idx: Vec<u64> = m["choices"].as_array().unwrap().iter().map(|c| c["index"].as_u64().unwrap()).collect();
        assert_eq!(idx, vec![0, 1, 2]);
        assert_eq!(m["choices"][2]["message"]["content"], "c");
        assert_eq!(
            (m["usage"]["completion_tokens"].as_u64(), m["usage"]["total_tokens"].as_u64()),
            (Some(6), Some(11))
        );
    }

    #[test]
    fn sse_lines_name_their_event_when_the_protocol_does() {
        let e = StreamEvent { event: Some("message_stop".into()), data: json!({"type": "message_stop"}) };
        assert_eq!(&sse_bytes(&e)[..], b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
        let e = StreamEvent { event: None, data: json!(1) };
        assert_eq!(&sse_bytes(&e)[..], b"data: 1\n\n");
    }
}
