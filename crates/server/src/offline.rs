//! The offline API: one loaded engine running on its own threads, fed prompts (text or token ids,
//! vLLM's `LLM.generate`) or chat conversations (an OpenAI Chat Completions body through the
//! recipe, as `serve` takes it), and read back as event streams. The Python package
//! (`crates/python`) is a thin layer over this; every parameter error names the parameter.

use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crossbeam::channel::{self, Receiver};
use deepinfer_engine::engine::Event;
use deepinfer_engine::sampler::SamplingParams;
use deepinfer_engine::{Engine, EngineHandle, EngineStats, GenerateOutput, GenerateRequest};
use deepinfer_recipe::{
    convert, parse_output, Constraint, DeepseekTokenizer, InferenceFinishReason, OutputPiece, ParseContext, Protocol,
};
use parking_lot::Mutex;
use serde_json::{json, Value};

pub use deepinfer_recipe::Converted;

use crate::api_request::{map_body, Defaults};
use crate::setup::{self, Builtin, EngineArgs};

/// The model name chat bodies carry (it selects the V4 prompt encoding; `generate --prompt` uses it too).
pub const CHAT_MODEL: &str = "DeepSeek-V4-Pro";

/// A parameter the caller got wrong: its name and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamError {
    pub param: String,
    pub problem: String,
}

impl ParamError {
    pub fn new(param: &str, problem: impl Into<String>) -> ParamError {
        ParamError { param: param.into(), problem: problem.into() }
    }
}

impl fmt::Display for ParamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.param, self.problem)
    }
}

impl std::error::Error for ParamError {}

/// Sampling and output options of a raw prompt, with vLLM's names and defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// Outputs per prompt (output i samples with seed + i when a seed is given).
    pub n: usize,
    pub max_tokens: usize,
    /// The sampler's parameters (`top_logprobs` is vLLM's `logprobs`: alternatives per token).
    pub params: SamplingParams,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    /// Generate exactly `max_tokens` (end-of-sentence does not stop).
    pub ignore_eos: bool,
    /// Constrain the output to this JSON schema (text of a JSON object).
    pub json_schema: Option<String>,
    /// Constrain the output to this regular expression.
    pub regex: Option<String>,
}

impl Default for Sampling {
    fn default() -> Sampling {
        Sampling {
            n: 1,
            max_tokens: 16,
            params: SamplingParams::default(),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            json_schema: None,
            regex: None,
        }
    }
}

/// Most outputs one prompt may ask for, and most alternatives a token may report.
pub const MAX_N: usize = 64;
pub const MAX_LOGPROBS: usize = 20;

fn in_range(param: &str, x: f32, lo: f32, hi: f32, lo_open: bool) -> Result<(), ParamError> {
    let ok = x.is_finite() && x <= hi && if lo_open { x > lo } else { x >= lo };
    if ok {
        Ok(())
    } else {
        let open = if lo_open { "(" } else { "[" };
        Err(ParamError::new(param, format!("{x} is not in {open}{lo}, {hi}]")))
    }
}

impl Sampling {
    /// Check every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), ParamError> {
        if !(1..=MAX_N).contains(&self.n) {
            return Err(ParamError::new("n", format!("{} is not in [1, {MAX_N}]", self.n)));
        }
        if self.max_tokens == 0 {
            return Err(ParamError::new("max_tokens", "must be at least 1"));
        }
        let p = &self.params;
        in_range("temperature", p.temperature, 0.0, 100.0, false)?;
        in_range("top_p", p.top_p, 0.0, 1.0, true)?;
        in_range("min_p", p.min_p, 0.0, 1.0, false)?;
        in_range("presence_penalty", p.presence_penalty, -2.0, 2.0, false)?;
        in_range("frequency_penalty", p.frequency_penalty, -2.0, 2.0, false)?;
        in_range("repetition_penalty", p.repetition_penalty, 0.0, 100.0, true)?;
        if p.top_logprobs > MAX_LOGPROBS {
            return Err(ParamError::new("logprobs", format!("{} is over {MAX_LOGPROBS}", p.top_logprobs)));
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(ParamError::new("stop", "holds an empty string"));
        }
        if self.json_schema.is_some() && self.regex.is_some() {
            return Err(ParamError::new("regex", "give json_schema or regex, not both"));
        }
        if let Some(s) = &self.json_schema {
            match serde_json::from_str::<Value>(s) {
                Ok(Value::Object(_)) => {}
                Ok(_) => return Err(ParamError::new("json_schema", "is not a JSON object")),
                Err(e) => return Err(ParamError::new("json_schema", format!("is not JSON: {e}"))),
            }
        }
        Ok(())
    }

    /// The engine's sampling of output `i`.
    fn engine_params(&self, i: usize) -> SamplingParams {
        SamplingParams { seed: self.params.seed.map(|s| s.wrapping_add(i as u64)), ..self.params.clone() }
    }

    fn constraint(&self) -> Option<Constraint> {
        match (&self.json_schema, &self.regex) {
            (Some(s), _) => Some(Constraint { kind: "json_schema".into(), schema: s.clone() }),
            (None, Some(r)) => Some(Constraint { kind: "regex".into(), schema: r.clone() }),
            _ => None,
        }
    }
}

/// A raw prompt: text (tokenized as plain text after the begin-of-sentence token, as
/// `/v1/completions` does) or token ids as given.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// A chat body's `n` engine requests, with what the parse of their outputs needs.
pub struct ChatRequests {
    pub requests: Vec<GenerateRequest>,
    pub conv: Converted,
    /// Sampling fields the model's policy overrode (thinking mode): (field, asked, used).
    pub overridden: Vec<(&'static str, f64, f64)>,
}

/// A loaded engine, started.
pub struct Offline {
    engine: Arc<Engine>,
    handle: Mutex<Option<EngineHandle>>,
    tok: DeepseekTokenizer,
    next_id: AtomicU64,
    builtin: Builtin,
    dir: PathBuf,
    bos: Option<u32>,
    eos: Option<u32>,
}

impl Offline {
    /// Load the model of `args` (the built-in one without `--model`) and start its engine.
    pub fn load(args: &EngineArgs) -> anyhow::Result<Offline> {
        let l = setup::load(args)?;
        let engine = Arc::new(l.engine);
        let handle = engine.clone().start();
        Ok(Offline {
            engine,
            handle: Mutex::new(Some(handle)),
            bos: l.tok.special_id("<｜begin▁of▁sentence｜>"),
            eos: l.tok.special_id("<｜end▁of▁sentence｜>"),
            tok: l.tok,
            next_id: AtomicU64::new(0),
            builtin: l.builtin,
            dir: l.dir,
        })
    }

    pub fn tokenizer(&self) -> &DeepseekTokenizer {
        &self.tok
    }

    /// What was loaded: the model directory, whether it is the built-in model, the context limit.
    pub fn info(&self) -> Value {
        let c = self.engine.model().config();
        json!({
            "model": self.dir.display().to_string(),
            "builtin": match self.builtin { Builtin::No => "no", Builtin::Trained => "trained", Builtin::Random => "random" },
            "note": self.builtin.note().trim(),
            "max_context": self.engine.config().max_context,
            "vocab_size": c.vocab_size,
            "speculative_tokens": self.engine.config().speculative_tokens,
        })
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn check_room(&self, prompt_len: usize, max_tokens: usize) -> Result<(), ParamError> {
        let context = self.engine.config().max_context;
        if prompt_len + max_tokens > context {
            return Err(ParamError::new(
                "max_tokens",
                format!("{max_tokens} plus the prompt's {prompt_len} tokens is over the context of {context} tokens"),
            ));
        }
        Ok(())
    }

    /// The prompt's token ids (text gets the begin-of-sentence token first).
    pub fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>, ParamError> {
        let ids = match prompt {
            Prompt::Text(t) => {
                let enc = self
                    .tok
                    .encode_batch(std::slice::from_ref(t))
                    .map_err(|e| ParamError::new("prompts", e.to_string()))?;
                self.bos.into_iter().chain(enc.into_iter().flatten()).collect()
            }
            Prompt::Tokens(ids) => ids.clone(),
        };
        let vocab = self.engine.model().config().vocab_size;
        if ids.is_empty() {
            return Err(ParamError::new("prompts", "a prompt is empty"));
        }
        if let Some(t) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(ParamError::new("prompts", format!("token id {t} is not below the vocabulary size {vocab}")));
        }
        Ok(ids)
    }

    /// The `n` engine requests of a raw prompt.
    pub fn requests(&self, prompt: &Prompt, s: &Sampling) -> Result<Vec<GenerateRequest>, ParamError> {
        s.validate()?;
        let ids = self.prompt_ids(prompt)?;
        self.check_room(ids.len(), s.max_tokens)?;
        let stops: Vec<u32> =
            s.stop_token_ids.iter().copied().chain(self.eos.filter(|_| !s.ignore_eos)).collect::<Vec<_>>();
        Ok((0..s.n)
            .map(|i| {
                let mut r = GenerateRequest::new(self.next_id(), ids.clone(), s.max_tokens, s.engine_params(i));
                r.stop_strings = s.stop.clone();
                r.stop_token_ids = stops.clone();
                r.constraint = s.constraint();
                r
            })
            .collect())
    }

    /// A Chat Completions body (messages, tools, response_format, thinking and the sampling
    /// fields) as `n` engine requests (output i with seed + i), through the recipe as `serve` maps it.
    pub fn chat_requests(&self, body: &Value, n: usize) -> Result<ChatRequests, ParamError> {
        let conv = convert(Protocol::Chat, body).map_err(|e| {
            // The official conversion's messages name the field; the parameter is the first named.
            let m = e.to_string();
            let param = ["tools", "tool_choice", "response_format", "messages"]
                .into_iter()
                .filter_map(|p| m.find(p).map(|at| (at, p)))
                .min()
                .map_or("messages", |(_, p)| p);
            ParamError::new(param, m)
        })?;
        let d = Defaults { repetition_penalty: 1.0, ..Default::default() };
        let context = self.engine.config().max_context;
        let m = map_body(&conv, body, self.next_id(), &self.tok, context, &d).map_err(|e| {
            // map_body's messages quote the field: `top_k` must be ...
            let field = e.split('`').nth(1).unwrap_or("messages").to_string();
            ParamError { param: field, problem: e }
        })?;
        let first = m.request;
        let requests = (0..n.max(1) as u64)
            .map(|i| {
                let mut r = first.clone();
                if i > 0 {
                    r.id = self.next_id();
                }
                r.sampling.seed = r.sampling.seed.map(|s| s.wrapping_add(i));
                r
            })
            .collect();
        Ok(ChatRequests { requests, conv, overridden: m.overridden })
    }

    /// Queue a request; its events (ending with `Done`) arrive on the receiver. After
    /// [`Offline::shutdown`] the request ends at once with an error.
    pub fn submit(&self, r: GenerateRequest) -> Receiver<Event> {
        match self.handle.lock().as_ref() {
            Some(h) => h.submit(r),
            None => {
                let (tx, rx) = channel::bounded(1);
                let _ = tx.send(Event::Done(GenerateOutput::failed(&r, "the engine was closed")));
                rx
            }
        }
    }

    /// Stop a request (its stream ends with `Done`, finish `cancelled`).
    pub fn cancel(&self, id: u64) {
        if let Some(h) = self.handle.lock().as_ref() {
            h.cancel(id);
        }
    }

    /// Finish what was submitted, stop the engine, write KV blocks to the kv directory; None
    /// when already shut down.
    pub fn shutdown(&self) -> Option<anyhow::Result<EngineStats>> {
        let h = self.handle.lock().take()?;
        let stats = h.shutdown();
        Some(self.engine.flush().map(|()| stats).map_err(anyhow::Error::from))
    }
}

impl Drop for Offline {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

/// The assistant message of a chat output (OpenAI's shape: `content`, `reasoning_content`,
/// `tool_calls`), parsed by the recipe's stream processor from the output tokens; `stop_ids` (the
/// request's end tokens) end the output and are not shown, as in `serve`.
pub fn chat_message(
    conv: &Converted,
    o: &GenerateOutput,
    stop_ids: &[u32],
    tok: &DeepseekTokenizer,
) -> Result<Value, String> {
    let ctx = ParseContext {
        response_id: "chatcmpl-offline",
        prompt_tokens: o.prompt_tokens,
        prompt_cache_hit_tokens: o.cached_tokens,
        finish: match o.finish {
            deepinfer_engine::FinishReason::Length => InferenceFinishReason::Length,
            _ => InferenceFinishReason::Stop,
        },
        tokenizer: Some(tok),
    };
    let shown: Vec<u32> = o.tokens.iter().copied().filter(|t| !stop_ids.contains(t)).collect();
    let parsed = parse_output(conv, &[OutputPiece::Tokens(shown)], &ctx).map_err(|e| e.to_string())?;
    let choice = &parsed.response["choices"][0];
    Ok(json!({
        "message": choice["message"].clone(),
        "finish_reason": choice["finish_reason"].clone(),
    }))
}

/// A finished request as JSON: what vLLM's `RequestOutput` / `CompletionOutput` carry.
pub fn output_json(o: &GenerateOutput, prompt: &[u32], started: Instant) -> Value {
    json!({
        "request_id": o.id.to_string(),
        "prompt_token_ids": prompt,
        "token_ids": o.tokens,
        "text": o.text.clone().unwrap_or_default(),
        "logprobs": o.logprobs,
        "top_logprobs": o.top_logprobs,
        "finish_reason": o.finish,
        "error": o.error,
        "num_cached_tokens": o.cached_tokens,
        "replayed_tokens": o.replayed_tokens,
        "seed": o.seed,
        "ttft_s": o.ttft_s,
        "e2e_s": started.elapsed().as_secs_f64(),
    })
}

/// A streamed token as JSON.
pub fn token_json(token: u32, logprob: f32, top: &[(u32, f32)], text: &str) -> Value {
    json!({"token_id": token, "logprob": logprob, "top_logprobs": top, "text": text})
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bad_fields_are_named() {
        let bad = |f: fn(&mut Sampling)| {
            let mut s = Sampling::default();
            f(&mut s);
            s.validate().unwrap_err().param
        };
        assert_eq!(bad(|s| s.n = 0), "n");
        assert_eq!(bad(|s| s.max_tokens = 0), "max_tokens");
        assert_eq!(bad(|s| s.params.temperature = -0.1), "temperature");
        assert_eq!(bad(|s| s.params.temperature = f32::NAN), "temperature");
        assert_eq!(bad(|s| s.params.top_p = 0.0), "top_p");
        assert_eq!(bad(|s| s.params.min_p = 1.5), "min_p");
        assert_eq!(bad(|s| s.params.presence_penalty = 3.0), "presence_penalty");
        assert_eq!(bad(|s| s.params.repetition_penalty = 0.0), "repetition_penalty");
        assert_eq!(bad(|s| s.params.top_logprobs = 21), "logprobs");
        assert_eq!(bad(|s| s.stop = vec![String::new()]), "stop");
        assert_eq!(bad(|s| s.json_schema = Some("[1]".into())), "json_schema");
        assert_eq!(bad(|s| s.json_schema = Some("{".into())), "json_schema");
        assert_eq!(
            bad(|s| {
                s.json_schema = Some("{}".into());
                s.regex = Some("a".into());
            }),
            "regex"
        );
        assert!(Sampling::default().validate().is_ok());
    }

    #[test]
    fn output_i_samples_with_seed_plus_i() {
        let params = SamplingParams { seed: Some(u64::MAX), top_logprobs: 3, ..Default::default() };
        let s = Sampling { params, ..Default::default() };
        assert_eq!(s.engine_params(0).seed, Some(u64::MAX));
        assert_eq!(s.engine_params(1).seed, Some(0));
        assert_eq!(s.engine_params(2).top_logprobs, 3);
        assert_eq!(Sampling::default().engine_params(5).seed, None);
    }

    proptest! {
        /// Every value inside the documented ranges validates; the constraint follows the field given.
        #[test]
        fn values_in_range_validate(n in 1usize..=MAX_N, t in 0.0f32..=100.0, p in 0.001f32..=1.0, mp in 0.0f32..=1.0,
                                    pen in -2.0f32..=2.0, rep in 0.01f32..=100.0, lp in 0usize..=MAX_LOGPROBS,
                                    regex in proptest::option::of("[a-z]{1,8}")) {
            let params = SamplingParams { temperature: t, top_p: p, min_p: mp, presence_penalty: pen, frequency_penalty: -pen,
                                          repetition_penalty: rep, top_logprobs: lp, ..Default::default() };
            let s = Sampling { n, params, regex: regex.clone(), ..Default::default() };
            prop_assert!(s.validate().is_ok());
            prop_assert_eq!(s.constraint().map(|c| c.schema), regex);
        }
    }
}
