//! Fuzzing `deepinfer serve` over real HTTP: >= 10,000 mutated and garbage bodies across every
//! endpoint (broken JSON, wrong types, huge and negative numbers, NaN, deep nesting, lone
//! surrogates, invalid UTF-8, 10 MB strings, control-token spellings in content). The server must
//! answer every one with a status below 500, within a bound, and serve a valid request afterwards.
//!
//! Deterministic (a fixed-seed xorshift), so a failure names the case that reproduces it.

mod server_proc;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use server_proc::{post_bytes, Server};

const MODEL: &str = "deepinfer-tiny-v4";
const CASES: usize = 10_240;
const THREADS: usize = 8;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// A valid body per endpoint, each asking for at most two tokens.
fn seeds() -> Vec<(&'static str, Value)> {
    let msgs = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]);
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
        "properties": {"a": {"type": "string", "maxLength": 4}}, "required": ["a"]}}}]);
    vec![
        ("/v1/chat/completions", json!({"model": MODEL, "messages": msgs, "max_tokens": 2, "temperature": 0})),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": msgs, "max_tokens": 2, "stream": true, "logprobs": true,
                   "top_logprobs": 2, "stream_options": {"include_usage": true}, "n": 2, "seed": 3}),
        ),
        ("/v1/chat/completions", json!({"model": MODEL, "messages": msgs, "max_tokens": 2, "tools": tools})),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": msgs, "max_tokens": 2,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                       "schema": {"type": "object", "properties": {"k": {"type": "integer"}}}}}}),
        ),
        ("/v1/completions", json!({"model": MODEL, "prompt": "Once", "max_tokens": 2, "stop": ["\n"]})),
        ("/v1/responses", json!({"model": MODEL, "input": "Hi", "max_output_tokens": 2, "stream": true})),
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 2, "system": "Be brief.",
                   "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
        ),
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 2, "stream": true, "messages": [{"role": "user", "content": "Hi"}],
                                "thinking": {"type": "enabled", "budget_tokens": 1024}}),
        ),
        ("/v1/messages/count_tokens", json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})),
    ]
}

const PATHS: &[&str] =
    &["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"];

/// Raw JSON texts a value may become (wrong types, extremes, NaN spellings, control tokens).
const WEIRD: &[&str] = &[
    "null",
    "true",
    "-1",
    "0",
    "1.5",
    "-0.0",
    "1e400",
    "-1e400",
    "18446744073709551616",
    "9007199254740993",
    "-9223372036854775809",
    "NaN",
    "Infinity",
    "\"\"",
    "\"NaN\"",
    "[]",
    "{}",
    "[[[[[[[[[[]]]]]]]]]]",
    "\"\\ud800\"",
    "\"\\udfff\\ud800\"",
    "\"<｜end▁of▁sentence｜>\"",
    "\"<｜DSML｜tool_calls>\"",
    "\"</think>\"",
    "\"<｜begin▁of▁sentence｜><｜User｜>\"",
    "\"\\u0000\\u0001\\u001b\"",
    "{\"type\":\"nope\"}",
    "[{\"role\":1}]",
    "\"user\"",
    "\"assistant\"",
    "\"tool\"",
    "[{\"type\":\"image_url\"}]",
    "\"ｔｅｘｔ\"",
];

/// The mutated JSON text of one case.
fn mutate(rng: &mut Rng, seed: &Value) -> Vec<u8> {
    let mut v = seed.clone();
    // 1-3 structural mutations, then maybe byte-level damage.
    for _ in 0..1 + rng.below(3) {
        let weird: Value = serde_json::from_str(rng.pick::<&str>(WEIRD)).unwrap_or(Value::Null);
        mutate_value(rng, &mut v, weird, 0);
    }
    let mut text = serde_json::to_string(&v).unwrap();
    // serde_json writes no NaN or out-of-range literals: splice some in raw.
    if rng.below(6) == 0 {
        let w = *rng.pick(WEIRD);
        if let Some(at) = text.find(":2") {
            text.replace_range(at + 1..at + 2, w);
        }
    }
    let mut bytes = text.into_bytes();
    match rng.below(10) {
        0 => bytes.truncate(rng.below(bytes.len().max(1))),
        1 => {
            let i = rng.below(bytes.len());
            bytes[i] = rng.next() as u8;
        }
        2 => {
            let i = rng.below(bytes.len());
            bytes.insert(i, *rng.pick(b"{}[]\",:\\\x00\xff\xc3"));
        }
        _ => {}
    }
    bytes
}

/// Replace, delete or duplicate something somewhere in `v`. A `max_*tokens` cap is never deleted,
/// nulled or raised: a valid request then asks for the default 8192 tokens, which is slow, not wrong.
fn mutate_value(rng: &mut Rng, v: &mut Value, weird: Value, depth: usize) {
    match v {
        Value::Object(o) if !o.is_empty() => {
            let keys: Vec<String> = o.keys().cloned().collect();
            let k = rng.pick(&keys).clone();
            let cap = k.starts_with("max_");
            match rng.below(4) {
                0 if !cap => {
                    o.remove(&k);
                }
                1 if depth < 4 && !cap => mutate_value(rng, o.get_mut(&k).unwrap(), weird, depth + 1),
                2 => {
                    o.insert(format!("{k}_x"), weird);
                }
                _ if cap && (weird.is_null() || weird.as_u64().is_some_and(|n| n > 0)) => {}
                _ => {
                    o.insert(k, weird);
                }
            }
        }
        Value::Array(a) if !a.is_empty() => {
            let i = rng.below(a.len());
            match rng.below(3) {
                0 => a[i] = weird,
                1 if depth < 4 => mutate_value(rng, &mut a[i], weird, depth + 1),
                _ => a.push(weird),
            }
        }
        _ => *v = weird,
    }
}

/// Garbage of one case: random bytes, deep nesting, or (rarely) a 10 MB string.
fn garbage(rng: &mut Rng, case: usize) -> Vec<u8> {
    match rng.below(6) {
        0 => (0..rng.below(512)).map(|_| rng.next() as u8).collect(),
        1 => {
            let d = 1 + rng.below(20_000);
            format!("{}{}", "[".repeat(d), "]".repeat(d)).into_bytes()
        }
        2 => {
            let d = 1 + rng.below(5_000);
            format!("{{\"model\":\"{MODEL}\",\"messages\":{}", "{\"a\":".repeat(d)).into_bytes()
        }
        3 if case % 2048 == 3 => {
            // 10 MB of content: under the server's default 16 MiB body limit, far past the context.
            let big = "x".repeat(10 << 20);
            serde_json::to_vec(
                &json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": big}]}),
            )
            .unwrap()
        }
        _ => {
            let s: String =
                (0..rng.below(64)).map(|_| *rng.pick(&['{', '}', '"', ':', ',', '[', ']', 'a', '1', ' '])).collect();
            s.into_bytes()
        }
    }
}

#[test]
fn ten_thousand_mutated_and_garbage_bodies_get_no_5xx_and_no_hang() {
    let srv = Server::start(&["--default-thinking", "off"]);
    let addr = srv.addr();
    let seeds = Arc::new(seeds());
    let next = Arc::new(AtomicUsize::new(0));
    let failures: Arc<Mutex<Vec<String>>> = Default::default();
    let counts: Arc<Mutex<std::collections::BTreeMap<u16, usize>>> = Default::default();
    let workers: Vec<_> = (0..THREADS)
        .map(|_| {
            let (addr, seeds, next, failures, counts) =
                (addr.clone(), seeds.clone(), next.clone(), failures.clone(), counts.clone());
            std::thread::spawn(move || loop {
                let case = next.fetch_add(1, Ordering::Relaxed);
                if case >= CASES {
                    return;
                }
                let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (case as u64 + 1).wrapping_mul(0x2545_F491_4F6C_DD1D));
                let (path, body) = if rng.below(4) == 0 {
                    (*rng.pick(PATHS), garbage(&mut rng, case))
                } else {
                    let (p, s) = rng.pick(&seeds);
                    // Sometimes a body meant for one endpoint goes to another.
                    let p = if rng.below(8) == 0 { rng.pick(PATHS) } else { p };
                    (*p, mutate(&mut rng, s))
                };
                match post_bytes(&addr, path, &body, Duration::from_secs(120)) {
                    Ok(code) if (200..500).contains(&code) => *counts.lock().unwrap().entry(code).or_default() += 1,
                    other => {
                        let shown = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
                        failures.lock().unwrap().push(format!("case {case} {path} -> {other:?}: {shown}"));
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    let failures = failures.lock().unwrap();
    let counts = counts.lock().unwrap();
    println!("statuses over {CASES} cases: {counts:?}");
    assert!(
        failures.is_empty(),
        "{} of {CASES} cases failed:\n{}\nserver log:\n{}",
        failures.len(),
        failures.iter().take(20).cloned().collect::<Vec<_>>().join("\n"),
        srv.log()
    );
    assert!(counts.get(&200).copied().unwrap_or(0) > 100, "some mutations stay valid and are served: {counts:?}");
    assert!(counts.get(&400).copied().unwrap_or(0) > CASES / 4, "most are refused: {counts:?}");
    let ok =
        serde_json::to_vec(&json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}))
            .unwrap();
    assert_eq!(post_bytes(&addr, "/v1/chat/completions", &ok, Duration::from_secs(60)), Ok(200));
}
