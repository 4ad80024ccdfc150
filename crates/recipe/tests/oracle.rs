//! Differential suite against the official deepseek-recipe 0.2.0 oracle (tools/recipe_oracle.py),
//! recorded by tools/recipe_cases.py into tests/fixtures: prompts for both encodings, V4 token ids
//! with the vendored tokenizer, inference options, conversion errors; stream events and final
//! responses (tool-call ids and timestamps normalised), including every two-chunk split.

use deepinfer_recipe::{
    convert, parse_output, render, DeepseekTokenizer, Encoding, InferenceFinishReason, OutputPiece, ParseContext,
    Protocol,
};
use serde_json::{json, Map, Value};

fn cases(name: &str) -> Vec<Value> {
    // Committed gzip-compressed (1.4 MB of JSON lines -> 55 KB).
    let p = format!("{}/tests/fixtures/{name}.gz", env!("CARGO_MANIFEST_DIR"));
    let mut text = String::new();
    std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(std::fs::File::open(&p).unwrap()), &mut text)
        .unwrap();
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn proto(c: &Value) -> Protocol {
    c["protocol"].as_str().unwrap().parse().unwrap()
}

#[test]
fn renders_match_the_oracle() {
    let tok = DeepseekTokenizer::builtin().unwrap();
    let all = cases("render_cases.jsonl");
    assert!(all.len() >= 300, "{} cases", all.len());
    let (mut ok, mut errors, mut by_proto) = (0, 0, [0usize; 3]);
    for c in &all {
        let id = &c["id"];
        let p = proto(c);
        by_proto[p as usize] += 1;
        match (convert(p, &c["request"]), c.get("error")) {
            (Err(e), Some(want)) => {
                assert_eq!(e.status() as u64, want["status"].as_u64().unwrap(), "case {id}");
                let msg = e.to_string();
                let want_msg = want["message"].as_str().unwrap();
                assert!(
                    msg == want_msg || (want["status"] == 400 && msg.starts_with("invalid request body")),
                    "case {id}: {msg:?} vs {want_msg:?}"
                );
                errors += 1;
            }
            (Ok(conv), None) => {
                for (key, enc) in [("v4", Encoding::V4), ("v41", Encoding::V41)] {
                    let r = render(&conv.request, enc, Some(&tok));
                    assert_eq!(r.prompt, c[key]["prompt"].as_str().unwrap(), "case {id} {key} prompt");
                    let want: Option<Vec<u32>> = serde_json::from_value(c[key]["token_ids"].clone()).unwrap();
                    assert_eq!(r.token_ids, want, "case {id} {key} token ids");
                }
                let io = &conv.request.inference_options;
                let want = &c["inference"];
                assert_eq!(json!(io.max_tokens), want["max_tokens"], "case {id}");
                assert_eq!(io.temperature.map(|t| t as f64), want["temperature"].as_f64(), "case {id}");
                assert_eq!(io.top_p.map(|t| t as f64), want["top_p"].as_f64(), "case {id}");
                assert_eq!(json!(io.seed), want["seed"], "case {id}");
                let oc = io.output_constraint.as_ref().map(|o| json!({"kind": o.kind(), "schema": o.schema()}));
                assert_eq!(oc.unwrap_or(Value::Null), want["output_constraint"], "case {id}");
                let stops: Vec<String> =
                    conv.request.parsing_options.stop_sequences.iter().map(|s| s.to_string()).collect();
                assert_eq!(json!(stops), c["stop_sequences"], "case {id}");
                ok += 1;
            }
            (Ok(_), Some(want)) => panic!("case {id}: converted, the oracle said {want}"),
            (Err(e), None) => panic!("case {id}: {e}"),
        }
    }
    println!("render cases: {ok} converted, {errors} errors, per protocol {by_proto:?}");
    assert!(ok >= 250 && errors >= 10);
}

/// The oracle's `--normalize`: generated tool-call ids `call_NN_[ET_]<24 alnum>` and timestamps.
fn normalize(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .map(|(k, x)| {
                    let ts = matches!(k.as_str(), "created" | "created_at" | "completed_at") && x.is_u64();
                    (k.clone(), if ts { json!("<ts>") } else { normalize(x) })
                })
                .collect::<Map<_, _>>(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(normalize).collect()),
        Value::String(s) => Value::String(normalize_ids(s)),
        other => other.clone(),
    }
}

fn normalize_ids(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = String::new();
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"call_")
            && b.len() >= i + 8
            && b[i + 5].is_ascii_digit()
            && b[i + 6].is_ascii_digit()
            && b[i + 7] == b'_'
        {
            let mut j = i + 8;
            let et = b[j..].starts_with(b"ET_");
            if et {
                j += 3;
            }
            if b.len() >= j + 24 && b[j..j + 24].iter().all(u8::is_ascii_alphanumeric) {
                out.push_str(&format!("call_{}_{}<id>", &s[i + 5..i + 7], if et { "ET_" } else { "" }));
                i = j + 24;
                continue;
            }
        }
        let ch = s[i..].chars().next().unwrap();
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

#[test]
fn stream_parsing_matches_the_oracle_including_every_split() {
    let tok = DeepseekTokenizer::builtin().unwrap();
    let all = cases("stream_cases.jsonl");
    let mut splits = 0;
    for c in &all {
        let id = &c["id"];
        let conv = convert(proto(c), &c["request"]).unwrap();
        let pieces: Vec<OutputPiece> = c["model_output"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| OutputPiece::Text(s.as_str().unwrap().to_string()))
            .collect();
        splits += (pieces.len() == 2) as usize;
        let finish =
            if c["finish_reason"] == "length" { InferenceFinishReason::Length } else { InferenceFinishReason::Stop };
        let ctx = ParseContext {
            response_id: "id-1",
            prompt_tokens: 100,
            prompt_cache_hit_tokens: 64,
            finish,
            tokenizer: Some(&tok),
        };
        let out = parse_output(&conv, &pieces, &ctx).unwrap();
        let events: Vec<Value> = out.events.iter().map(|e| json!({"event": e.event, "data": e.data})).collect();
        assert_eq!(normalize(&json!(events)), c["events"], "case {id} events");
        assert_eq!(normalize(&out.response), c["response"], "case {id} response");
        assert_eq!(json!(out.sse_done_data), c["sse_done_data"], "case {id}");
    }
    println!("stream cases: {} ({splits} two-chunk splits)", all.len());
    assert!(splits > 100);
}
