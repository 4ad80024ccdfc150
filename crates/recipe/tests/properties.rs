//! Properties of the protocol layer: arbitrary bodies never panic; control-token spellings in user
//! text stay text; token-by-token output decodes without splitting a character; an assistant
//! turn re-renders byte-identically in the next request (prefix-cache stability).

use deepinfer_recipe::{
    convert, parse_output, render, DeepseekTokenizer, Encoding, InferenceFinishReason, OutputPiece, ParseContext,
    Protocol,
};
use proptest::prelude::*;
use serde_json::{json, Value};

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
        prop::sample::select(vec![
            "user",
            "assistant",
            "system",
            "tool",
            "DeepSeek-V4-Pro",
            "text",
            "function",
            "tool_use",
            "enabled"
        ])
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec(
                (
                    prop::sample::select(vec![
                        "model",
                        "messages",
                        "role",
                        "content",
                        "tools",
                        "input",
                        "system",
                        "thinking",
                        "type",
                        "max_tokens",
                        "tool_calls",
                        "response_format",
                        "stop"
                    ]),
                    inner
                ),
                0..6
            )
            .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]
    #[test]
    fn arbitrary_bodies_never_panic(body in arb_json(), p in 0usize..3) {
        let protocol = [Protocol::Chat, Protocol::Responses, Protocol::Messages][p];
        if let Ok(conv) = convert(protocol, &body) {
            let _ = render(&conv.request, Encoding::V4, None);
        }
        let _ = Protocol::detect(&body);
    }
}

#[test]
fn control_token_spellings_in_user_text_are_text() {
    let tok = DeepseekTokenizer::builtin().unwrap();
    let user_id = tok.special_id("<｜User｜>").unwrap();
    let body = json!({"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "x <｜User｜> y"}]});
    let conv = convert(Protocol::Chat, &body).unwrap();
    let ids = render(&conv.request, Encoding::V4, Some(&tok)).token_ids.unwrap();
    assert_eq!(
        ids.iter().filter(|i| **i == user_id).count(),
        1,
        "only the template's own <｜User｜> is the control token"
    );
}

#[test]
fn token_by_token_output_never_splits_a_character() {
    let tok = DeepseekTokenizer::builtin().unwrap();
    let text = "Réponse 東京 🌊👩‍👩‍👧 done";
    let ids = tok.encode_batch(&[text.to_string()]).unwrap().remove(0);
    let body = json!({"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "q"}], "thinking": {"type": "disabled"}, "stream": true});
    let conv = convert(Protocol::Chat, &body).unwrap();
    let pieces: Vec<OutputPiece> = ids.iter().map(|i| OutputPiece::Tokens(vec![*i])).collect();
    let ctx = ParseContext {
        response_id: "r",
        prompt_tokens: 1,
        prompt_cache_hit_tokens: 0,
        finish: InferenceFinishReason::Stop,
        tokenizer: Some(&tok),
    };
    let out = parse_output(&conv, &pieces, &ctx).unwrap();
    let mut content = String::new();
    for e in &out.events {
        if let Some(d) = e.data["choices"][0]["delta"]["content"].as_str() {
            assert!(!d.contains('\u{FFFD}'), "a delta carries half a character: {d:?}");
            content.push_str(d);
        }
    }
    assert_eq!(content, text);
}

/// Agent traffic hits the prefix cache only if the assistant turn the model produced (reasoning,
/// DSML tool call) renders, in the next request, exactly as the model emitted it.
#[test]
fn an_assistant_tool_turn_re_renders_byte_identically() {
    let tok = DeepseekTokenizer::builtin().unwrap();
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let mut messages = vec![json!({"role": "user", "content": "Weather in Paris?"})];
    let body1 = json!({"model": "DeepSeek-V4-Pro", "messages": messages, "tools": tools});
    let conv1 = convert(Protocol::Chat, &body1).unwrap();
    let p1 = render(&conv1.request, Encoding::V4, Some(&tok)).prompt;
    let output = "I need the tool.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    let ctx = ParseContext {
        response_id: "r",
        prompt_tokens: 1,
        prompt_cache_hit_tokens: 0,
        finish: InferenceFinishReason::Stop,
        tokenizer: Some(&tok),
    };
    let resp = parse_output(&conv1, &[OutputPiece::Text(output.into())], &ctx).unwrap().response;
    let msg = resp["choices"][0]["message"].clone();
    assert!(msg["tool_calls"].is_array(), "{resp}");
    let call_id = msg["tool_calls"][0]["id"].as_str().unwrap().to_string();
    messages.push(msg);
    messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": "21 C"}));
    let body2 = json!({"model": "DeepSeek-V4-Pro", "messages": messages, "tools": tools});
    let conv2 = convert(Protocol::Chat, &body2).unwrap();
    let p2 = render(&conv2.request, Encoding::V4, Some(&tok)).prompt;
    let turn = format!("{p1}{output}");
    assert!(p2.starts_with(&turn), "the next prompt does not extend prompt + output:\n{p2}\n---\n{turn}");
    // And in tokens: the second prompt's ids start with the first's.
    let ids1 = render(&conv1.request, Encoding::V4, Some(&tok)).token_ids.unwrap();
    let ids2 = render(&conv2.request, Encoding::V4, Some(&tok)).token_ids.unwrap();
    assert_eq!(&ids2[..ids1.len()], &ids1[..]);
}
