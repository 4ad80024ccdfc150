//! `/v1/completions`, OpenAI's legacy text completion: a raw prompt (text, or token ids), no chat
//! template and no recipe parsing; the engine's own stop strings and incremental text.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use deepinfer_engine::engine::Event;
use deepinfer_engine::sampler::SamplingParams;
use deepinfer_engine::{FinishReason, GenerateRequest};
use serde_json::{json, Value};
use tokio::sync::mpsc::unbounded_channel;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::errors::{ApiError, Dialect, Kind};
use super::protocol::unix_now;
use super::request::read_json;
use super::state::{AppState, Flight};

const D: Dialect = Dialect::OpenAi;

fn field_err(field: &'static str, what: &str) -> ApiError {
    ApiError::bad(D, format!("`{field}` {what}")).with_param(field)
}

fn num(b: &Value, field: &'static str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    match b.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() && (lo..=hi).contains(&x) => Ok(Some(x)),
            _ => Err(field_err(field, &format!("must be a number in [{lo}, {hi}]"))),
        },
    }
}

fn int(b: &Value, field: &'static str, lo: u64, hi: u64) -> Result<Option<u64>, ApiError> {
    match b.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
            _ => Err(field_err(field, &format!("must be an integer in [{lo}, {hi}]"))),
        },
    }
}

/// The prompts of a body: a string, a list of strings, a list of token ids, or a list of those.
fn prompts(s: &AppState, b: &Value) -> Result<Vec<Vec<u32>>, ApiError> {
    let vocab = s.engine.model().config().vocab_size as u64;
    let ids = |v: &Vec<Value>| -> Result<Vec<u32>, ApiError> {
        v.iter()
            .map(|t| match t.as_u64() {
                Some(t) if t < vocab => Ok(t as u32),
                _ => Err(field_err("prompt", &format!("token ids must be integers below the vocabulary size {vocab}"))),
            })
            .collect()
    };
    let bos = s.tok.special_id("<｜begin▁of▁sentence｜>");
    let texts = |ts: Vec<String>| -> Result<Vec<Vec<u32>>, ApiError> {
        let enc = s.tok.encode_batch(&ts).map_err(|e| ApiError::new(D, Kind::Internal, e.to_string()))?;
        Ok(enc.into_iter().map(|t| bos.into_iter().chain(t).collect()).collect())
    };
    let out = match b.get("prompt") {
        Some(Value::String(t)) => texts(vec![t.clone()])?,
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_string) => {
            texts(a.iter().filter_map(|v| v.as_str().map(String::from)).collect())?
        }
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_array) => {
            a.iter().map(|v| ids(v.as_array().unwrap_or(&Vec::new()))).collect::<Result<_, _>>()?
        }
        Some(Value::Array(a)) if !a.is_empty() => vec![ids(a)?],
        _ => return Err(field_err("prompt", "must be a string, a list of strings or a list of token ids")),
    };
    if out.len() > 64 || out.iter().any(Vec::is_empty) {
        return Err(field_err("prompt", "must hold 1 to 64 non-empty prompts"));
    }
    Ok(out)
}

fn requests(s: &AppState, b: &Value) -> Result<Vec<GenerateRequest>, ApiError> {
    for f in ["echo", "suffix", "best_of"] {
        if b.get(f).is_some_and(|v| !v.is_null() && v != &json!(false) && v != &json!(1)) {
            return Err(field_err(f, "is not supported by this server"));
        }
    }
    if b.get("logprobs").is_some_and(|v| !v.is_null()) {
        return Err(field_err("logprobs", "is not supported on /v1/completions yet; use /v1/chat/completions"));
    }
    let n = int(b, "n", 1, 16)?.unwrap_or(1);
    let max_tokens = int(b, "max_tokens", 1, u32::MAX as u64)?.unwrap_or(16) as usize;
    let top_k = match b.get("top_k").and_then(Value::as_i64) {
        Some(-1) | None => 0,
        Some(k) if k >= 0 => k as usize,
        Some(_) => return Err(field_err("top_k", "must be -1 (off) or a non-negative integer")),
    };
    let sampling = SamplingParams {
        temperature: num(b, "temperature", 0.0, 2.0)?.unwrap_or(1.0) as f32,
        top_p: num(b, "top_p", 1e-9, 1.0)?.unwrap_or(1.0) as f32,
        top_k,
        min_p: num(b, "min_p", 0.0, 1.0)?.unwrap_or(0.0) as f32,
        repetition_penalty: num(b, "repetition_penalty", 1e-6, 100.0)?.unwrap_or(1.0) as f32,
        presence_penalty: num(b, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        frequency_penalty: num(b, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        seed: int(b, "seed", 0, u64::MAX)?,
        top_logprobs: 0,
    };
    let stop: Vec<String> = match b.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(t)) => vec![t.clone()],
        Some(Value::Array(a)) if a.len() <= 8 && a.iter().all(Value::is_string) => {
            a.iter().filter_map(|v| v.as_str().map(String::from)).collect()
        }
        _ => return Err(field_err("stop", "must be a string or a list of at most 8 strings")),
    };
    // vLLM's extension: generate exactly max_tokens (benchmarks and load tests count on it).
    let ignore_eos = match b.get("ignore_eos") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(x)) => *x,
        Some(_) => return Err(field_err("ignore_eos", "must be a boolean")),
    };
    let eos = s.tok.special_id("<｜end▁of▁sentence｜>").filter(|_| !ignore_eos);
    let mut out = Vec::new();
    for p in prompts(s, b)? {
        if p.len() + max_tokens > s.cfg.max_context {
            return Err(field_err(
                "max_tokens",
                &format!("plus the prompt's {} tokens is over the context of {} tokens", p.len(), s.cfg.max_context),
            ));
        }
        for i in 0..n {
            let mut sp = sampling.clone();
            sp.seed = sp.seed.map(|x| x.wrapping_add(i));
            let mut r = GenerateRequest::new(s.next_id(), p.clone(), max_tokens, sp);
            r.stop_strings = stop.clone();
            r.stop_token_ids = eos.into_iter().collect();
            out.push(r);
        }
    }
    Ok(out)
}

fn finish_name(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

pub async fn handle(s: Arc<AppState>, headers: HeaderMap, body: Body) -> Response {
    match run(s, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(s: Arc<AppState>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let b = read_json(&s, &headers, body, D).await?;
    let stream = match b.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(x)) => *x,
        Some(_) => return Err(field_err("stream", "must be a boolean")),
    };
    let include_usage = b.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false);
    let reqs = requests(&s, &b)?;
    let prompt_tokens: usize = reqs.iter().map(|r| r.prompt.len()).sum();
    let flights = s.submit(reqs, D)?;
    let id = format!("cmpl-{}", &super::request::response_id(deepinfer_recipe::Protocol::Chat)[9..]);
    let model = s.cfg.served.clone();
    let created = unix_now();
    if !stream {
        let mut choices = Vec::new();
        let (mut completion, mut cached) = (0, 0);
        for (i, mut f) in flights.into_iter().enumerate() {
            let o = finish(&mut f).await?;
            completion += o.tokens.len();
            cached += o.cached_tokens;
            choices.push(json!({"index": i, "text": o.text.unwrap_or_default(), "logprobs": null,
                                "finish_reason": finish_name(o.finish)}));
        }
        let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                           "total_tokens": prompt_tokens + completion,
                           "prompt_tokens_details": {"cached_tokens": cached}});
        let body = json!({"id": id, "object": "text_completion", "created": created, "model": model,
                          "choices": choices, "usage": usage});
        return Ok((StatusCode::OK, axum::Json(body)).into_response());
    }
    let (out, rx) = unbounded_channel::<Result<Bytes, Infallible>>();
    let (merged, mut merged_rx) = unbounded_channel::<(usize, Event)>();
    for (i, mut f) in flights.into_iter().enumerate() {
        let merged = merged.clone();
        tokio::spawn(async move {
            while let Some(e) = tokio::select! { e = f.next() => e, _ = merged.closed() => None } {
                if merged.send((i, e)).is_err() {
                    break;
                }
            }
        });
    }
    drop(merged);
    tokio::spawn(async move {
        let (mut completion, mut cached) = (0, 0);
        let chunk = |i: usize, text: &str, fin: Option<&str>| {
            let c = json!({"id": id, "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": i, "text": text, "logprobs": null, "finish_reason": fin}]});
            Bytes::from(format!("data: {c}\n\n"))
        };
        while let Some((i, e)) = merged_rx.recv().await {
            let msg = match e {
                Event::Token { text, .. } => {
                    completion += 1;
                    if text.is_empty() {
                        continue;
                    }
                    chunk(i, &text, None)
                }
                Event::Done(o) if o.finish == FinishReason::Error => {
                    let e = ApiError::new(D, Kind::Internal, o.error.unwrap_or_default());
                    Bytes::from(format!("data: {}\n\n", e.body()))
                }
                Event::Done(o) => chunk(i, "", Some(finish_name(o.finish))),
                Event::Admitted { cached_tokens, .. } => {
                    cached += cached_tokens;
                    continue;
                }
            };
            if out.send(Ok(msg)).is_err() {
                return;
            }
        }
        if include_usage {
            let u = json!({"id": id, "object": "text_completion", "created": created, "model": model, "choices": [],
                           "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                     "total_tokens": prompt_tokens + completion,
                                     "prompt_tokens_details": {"cached_tokens": cached}}});
            let _ = out.send(Ok(Bytes::from(format!("data: {u}\n\n"))));
        }
        let _ = out.send(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
    });
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(UnboundedReceiverStream::new(rx)))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response()))
}

/// A flight's final output (a 400 for a request the engine refused, a 500 for a failure).
async fn finish(f: &mut Flight) -> Result<deepinfer_engine::GenerateOutput, ApiError> {
    let mut got_token = false;
    while let Some(e) = f.next().await {
        match e {
            Event::Done(o) if o.finish == FinishReason::Error => {
                let kind = if got_token { Kind::Internal } else { Kind::BadRequest };
                return Err(ApiError::new(D, kind, o.error.unwrap_or_else(|| "the engine refused the request".into())));
            }
            Event::Done(o) => return Ok(o),
            Event::Token { .. } => got_token = true,
            Event::Admitted { .. } => {}
        }
    }
    Err(ApiError::new(D, Kind::Internal, "the engine stopped"))
}
