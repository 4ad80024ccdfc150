//! The engine request: sampling after the model's policy, max_tokens against the context limit,
//! stops, constraint, cache class.

use deepinfer_recipe::{convert, engine_request, CacheClass, DeepseekTokenizer, Protocol};
use serde_json::json;

#[test]
fn thinking_mode_forces_temperature_one_and_defaults_max_tokens() {
    let tok = DeepseekTokenizer::builtin().unwrap();
    let body = json!({"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.2, "frequency_penalty": 0.5});
    let conv = convert(Protocol::Chat, &body).unwrap();
    let (req, _) = engine_request(&conv, &body, &tok, 1 << 20).unwrap();
    assert_eq!(req.sampling.temperature, 1.0, "thinking mode (the default) samples at 1.0");
    assert_eq!(req.sampling.frequency_penalty, 0.5);
    assert_eq!(req.max_tokens, 64 * 1024);
    assert_eq!(req.stop_token_ids, vec![tok.special_id("<｜end▁of▁sentence｜>").unwrap()]);
    assert_eq!(req.cache_class, CacheClass::Chat);
}

#[test]
fn non_thinking_keeps_temperature_and_max_tokens_fit_the_context() {
    let tok = DeepseekTokenizer::builtin().unwrap();
    let body = json!({"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled"}, "temperature": 0.2, "stop": ["END"]});
    let conv = convert(Protocol::Chat, &body).unwrap();
    let (req, r) = engine_request(&conv, &body, &tok, 1000).unwrap();
    assert!((req.sampling.temperature - 0.2).abs() < 1e-6);
    assert_eq!(req.max_tokens as usize, 1000 - r.token_ids.unwrap().len(), "the default is cut to the context left");
    assert_eq!(req.stop_strings, vec!["END".to_string()]);
    let too_long =
        json!({"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 995});
    let conv = convert(Protocol::Chat, &too_long).unwrap();
    let e = engine_request(&conv, &too_long, &tok, 1000).unwrap_err();
    assert_eq!(e.status(), 400);
    assert!(e.to_string().contains("maximum context length is 1000 tokens"), "{e}");
}

#[test]
fn tools_make_an_agent_request_with_a_tool_call_constraint() {
    // (The official rules reject tool_choice "required" in thinking mode.)
    let tok = DeepseekTokenizer::builtin().unwrap();
    let body = json!({"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {}}}}], "tool_choice": "required", "thinking": {"type": "disabled"}});
    let conv = convert(Protocol::Chat, &body).unwrap();
    let (req, _) = engine_request(&conv, &body, &tok, 1 << 20).unwrap();
    assert_eq!(req.cache_class, CacheClass::Agent);
    assert!(req.constraint.is_some());
}

#[test]
fn v41_with_the_v4_tokenizer_is_a_named_error() {
    let tok = DeepseekTokenizer::builtin().unwrap();
    let body = json!({"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "hi"}]});
    let conv = convert(Protocol::Chat, &body).unwrap();
    let e = engine_request(&conv, &body, &tok, 1 << 20).unwrap_err();
    assert!(e.to_string().contains("<｜System｜>"), "{e}");
}

#[test]
fn messages_errors_are_anthropic_shaped() {
    let body = json!({"model": "gpt", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}]});
    let e = match convert(Protocol::Messages, &body) {
        Err(e) => e,
        Ok(_) => panic!("converted"),
    };
    let b = e.body(Protocol::Messages);
    assert_eq!(b["type"], "error");
    assert_eq!(b["error"]["type"], "invalid_request_error");
    assert!(e.body(Protocol::Chat)["error"]["message"].as_str().unwrap().contains("gpt"));
}
