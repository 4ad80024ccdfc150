//! An API request body (Chat Completions, Responses or Messages) as engine requests: the recipe's
//! conversion, prompt encoding and policies, then the sampling fields the recipe leaves to the
//! engine (top_k, min_p, repetition_penalty: vLLM's extensions, Anthropic's top_k). Shared by
//! `generate --prompts` and `serve`.

use deepinfer_engine::sampler::SamplingParams;
use deepinfer_engine::GenerateRequest;
use deepinfer_kv::tier::CacheClass;
use deepinfer_recipe::{engine_request, Converted, DeepseekTokenizer};
use serde_json::Value;

/// What the CLI or server uses where a body says nothing.
#[derive(Debug, Clone, Default)]
pub struct Defaults {
    /// Output tokens when the body gives no limit (None: the context's room).
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_k: usize,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub seed: Option<u64>,
}

/// A body's request, and the sampling fields the model's policy overrode (thinking mode forces
/// temperature 1.0 and top_p): (field, asked, used).
pub struct Mapped {
    pub request: GenerateRequest,
    pub overridden: Vec<(&'static str, f64, f64)>,
}

/// A finite number field of the body (`what` names it in the error).
fn number(body: &Value, key: &'static str) -> Result<Option<f64>, String> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().filter(|x| x.is_finite()).map(Some).ok_or_else(|| format!("`{key}` must be a number")),
    }
}

/// The engine request of a converted body. `id` is the engine's request id.
pub fn map_body(
    conv: &Converted,
    body: &Value,
    id: u64,
    tok: &DeepseekTokenizer,
    context: usize,
    d: &Defaults,
) -> Result<Mapped, String> {
    let (er, _) = engine_request(conv, body, tok, context as u32).map_err(|e| e.to_string())?;
    let has_max = ["max_tokens", "max_completion_tokens", "max_output_tokens"].iter().any(|k| body.get(k).is_some());
    let max_tokens = match (has_max, d.max_tokens) {
        (false, Some(m)) => m.min(er.max_tokens as usize),
        _ => er.max_tokens as usize,
    };
    let top_k = match number(body, "top_k")? {
        Some(k) if k < 0.0 && k != -1.0 => return Err("`top_k` must be positive (or -1 for off)".into()),
        Some(k) if k > 0.0 => k as usize,
        Some(_) => 0,
        None => d.top_k,
    };
    let min_p = match number(body, "min_p")? {
        Some(p) if !(0.0..=1.0).contains(&p) => return Err("`min_p` must be in [0, 1]".into()),
        Some(p) => p as f32,
        None => d.min_p,
    };
    let repetition_penalty = match number(body, "repetition_penalty")? {
        Some(p) if p <= 0.0 => return Err("`repetition_penalty` must be positive".into()),
        Some(p) => p as f32,
        None => d.repetition_penalty,
    };
    let asked_t = number(body, "temperature")?;
    let temperature = match (asked_t, d.temperature) {
        (None, Some(t)) => t,
        _ => er.sampling.temperature,
    };
    let mut overridden = Vec::new();
    if let Some(t) = asked_t {
        if (t - temperature as f64).abs() > 1e-6 {
            overridden.push(("temperature", t, temperature as f64));
        }
    }
    if let Some(p) = number(body, "top_p")? {
        if (p - er.sampling.top_p as f64).abs() > 1e-6 {
            overridden.push(("top_p", p, er.sampling.top_p as f64));
        }
    }
    let mut r = GenerateRequest::new(
        id,
        er.token_ids,
        max_tokens,
        SamplingParams {
            temperature,
            top_p: er.sampling.top_p,
            presence_penalty: er.sampling.presence_penalty,
            frequency_penalty: er.sampling.frequency_penalty,
            seed: er.sampling.seed.or(d.seed),
            top_logprobs: if er.sampling.logprobs { er.sampling.top_logprobs.unwrap_or(0) as usize } else { 0 },
            top_k,
            min_p,
            repetition_penalty: if repetition_penalty > 0.0 { repetition_penalty } else { 1.0 },
        },
    );
    r.stop_token_ids = er.stop_token_ids;
    r.stop_strings = er.stop_strings;
    r.constraint = er.constraint;
    r.cache_class = match er.cache_class {
        deepinfer_recipe::CacheClass::Agent => CacheClass::Agent,
        deepinfer_recipe::CacheClass::Chat => CacheClass::Chat,
    };
    // Thinking mode: the grammar applies to the answer, after `</think>`.
    let think_open = tok.special_id("<think>");
    if r.constraint.is_some() && think_open.is_some() && r.prompt.last().copied() == think_open {
        r.constraint_after = tok.special_id("</think>");
    }
    Ok(Mapped { request: r, overridden })
}

#[cfg(test)]
mod tests {
    use super::*;
    use deepinfer_recipe::{convert, Protocol};
    use serde_json::json;

    /// A Chat Completions body (named: `thinking` would make detection say Messages).
    fn map(body: Value) -> Result<Mapped, String> {
        let tok = DeepseekTokenizer::builtin().unwrap();
        let conv = convert(Protocol::Chat, &body).map_err(|e| e.to_string())?;
        map_body(&conv, &body, 3, &tok, 4096, &Defaults { repetition_penalty: 1.0, ..Default::default() })
    }

    #[test]
    fn non_thinking_requests_keep_their_sampling_and_vllm_extensions() {
        let m = map(json!({"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "Hi"}],
                           "thinking": {"type": "disabled"}, "temperature": 0, "top_k": 5, "min_p": 0.1,
                           "repetition_penalty": 1.2, "seed": 9, "max_tokens": 7}))
        .unwrap();
        let s = &m.request.sampling;
        assert_eq!((s.temperature, s.top_k, s.min_p, s.repetition_penalty, s.seed), (0.0, 5, 0.1, 1.2, Some(9)));
        assert_eq!((m.request.id, m.request.max_tokens), (3, 7));
        assert!(m.overridden.is_empty());
    }

    #[test]
    fn thinking_mode_overrides_are_reported() {
        let m = map(json!({"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "Hi"}],
                           "temperature": 0}))
        .unwrap();
        assert_eq!(m.request.sampling.temperature, 1.0);
        assert_eq!(m.overridden, vec![("temperature", 0.0, 1.0)]);
    }

    #[test]
    fn bad_extension_fields_are_named() {
        let base = |k: &str, v: Value| {
            let mut b = json!({"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "Hi"}]});
            b[k] = v;
            b
        };
        for (k, v) in [("top_k", json!("x")), ("min_p", json!(2)), ("repetition_penalty", json!(-1))] {
            let e = map(base(k, v)).err().unwrap();
            assert!(e.contains(k), "{k}: {e}");
        }
    }
}
