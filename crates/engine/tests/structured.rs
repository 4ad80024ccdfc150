//! Structured output end to end: 50 generated JSON schemas and 20 regexes, sampled (temperature 1,
//! seeded) from the built-in tiny random model with the V4 tokenizer: every output must parse and
//! validate. A random model is the adversary here: left alone it never emits valid JSON, so every
//! valid output is the grammar mask's doing.

mod support;

use deepinfer_engine::sampler::SamplingParams;
use deepinfer_engine::tiny::Rng;
use deepinfer_engine::{Engine, EngineConfig, FinishReason, GenerateRequest, Model};
use deepinfer_recipe::{Constraint, DeepseekTokenizer};
use serde_json::{json, Map, Value};

/// A random schema of bounded size: objects of integers (with ranges), booleans,
/// enums, bounded strings and arrays, nested up to `depth`.
fn schema(rng: &mut Rng, depth: u32) -> Value {
    let pick = if depth == 0 { rng.below(5) } else { rng.below(7) };
    match pick {
        0 => {
            let lo = rng.below(100) as i64 - 50;
            json!({"type": "integer", "minimum": lo, "maximum": lo + rng.below(1000) as i64})
        }
        1 => json!({"type": "boolean"}),
        2 => json!({"type": "string", "maxLength": 1 + rng.below(12)}),
        3 => {
            let n = 2 + rng.below(4);
            json!({"enum": (0..n).map(|i| format!("opt{i}_{}", rng.below(100))).collect::<Vec<_>>()})
        }
        // (Unbounded `number`s are left out: a fraction may have any number of digits, and a
        // random model never stops writing them.)
        4 => json!({"type": "integer", "minimum": 0, "maximum": 9}),
        5 => json!({"type": "array", "items": schema(rng, depth - 1), "minItems": 1, "maxItems": 1 + rng.below(3)}),
        _ => object(rng, depth - 1),
    }
}

fn object(rng: &mut Rng, depth: u32) -> Value {
    let n = 1 + rng.below(4);
    let mut props = Map::new();
    for i in 0..n {
        props.insert(format!("k{i}_{}", rng.below(1000)), schema(rng, depth));
    }
    let required: Vec<String> = props.keys().cloned().collect();
    json!({"type": "object", "properties": props, "required": required, "additionalProperties": false})
}

/// Validation of the schema subset `schema` generates.
fn validate(v: &Value, s: &Value) -> Result<(), String> {
    if let Some(options) = s.get("enum").and_then(Value::as_array) {
        return options.contains(v).then_some(()).ok_or(format!("{v} not in {options:?}"));
    }
    let num = |x: &Value| x.as_f64();
    let range = |x: f64| -> Result<(), String> {
        let lo = s.get("minimum").and_then(num).unwrap_or(f64::MIN);
        let hi = s.get("maximum").and_then(num).unwrap_or(f64::MAX);
        (lo <= x && x <= hi).then_some(()).ok_or(format!("{x} outside [{lo}, {hi}]"))
    };
    match s["type"].as_str().unwrap() {
        // JSON Schema: an integer is a number without a fractional part (`-0` included).
        "integer" => range(v.as_f64().filter(|x| x.fract() == 0.0).ok_or(format!("{v} is not an integer"))?),
        "boolean" => v.as_bool().map(|_| ()).ok_or(format!("{v} is not a boolean")),
        "string" => {
            let t = v.as_str().ok_or(format!("{v} is not a string"))?;
            let max = s["maxLength"].as_u64().unwrap() as usize;
            (t.chars().count() <= max).then_some(()).ok_or(format!("{t:?} longer than {max}"))
        }
        "array" => {
            let a = v.as_array().ok_or(format!("{v} is not an array"))?;
            let (lo, hi) = (s["minItems"].as_u64().unwrap() as usize, s["maxItems"].as_u64().unwrap() as usize);
            if a.len() < lo || a.len() > hi {
                return Err(format!("{} items outside [{lo}, {hi}]", a.len()));
            }
            a.iter().try_for_each(|x| validate(x, &s["items"]))
        }
        "object" => {
            let o = v.as_object().ok_or(format!("{v} is not an object"))?;
            let props = s["properties"].as_object().unwrap();
            if let Some(k) = o.keys().find(|k| !props.contains_key(*k)) {
                return Err(format!("unexpected key {k}"));
            }
            for (k, ps) in props {
                validate(o.get(k).ok_or(format!("missing {k}"))?, ps)?;
            }
            Ok(())
        }
        t => Err(format!("unknown type {t}")),
    }
}

const REGEXES: [&str; 20] = [
    r"[0-9]{3}-[a-z]{2,5}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{1,8} [A-Z][a-z]{1,8}",
    r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)",
    r"#[0-9a-f]{6}",
    r"(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])(\.(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])){3}",
    r"-?[0-9]{1,4}\.[0-9]{2}",
    r"(true|false)",
    r"[A-Z]{3}[0-9]{4}",
    r"\+1 [0-9]{3}-[0-9]{3}-[0-9]{4}",
    r"(red|green|blue)(, (red|green|blue)){0,3}",
    r"v[0-9]\.[0-9]{1,2}\.[0-9]{1,2}",
    r"[a-z_]{1,10}\([a-z, ]{0,12}\)",
    r"(Mon|Tue|Wed|Thu|Fri|Sat|Sun) [0-2][0-9]:[0-5][0-9]",
    r"<b>[a-z ]{1,10}</b>",
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}",
    r"(GET|POST|PUT) /[a-z]{1,8}(/[a-z0-9]{1,6}){0,2}",
    r"[1-9][0-9]{0,2}(,[0-9]{3}){0,2}",
    r"Answer: [A-D]",
];

#[test]
fn fifty_json_schemas_and_twenty_regexes_always_parse_and_validate() {
    let dir = support::random_model_dir("structured", &support::builtin_config(), 91, 1);
    let tok = DeepseekTokenizer::builtin().unwrap();
    let eos = tok.special_id("<｜end▁of▁sentence｜>").unwrap();
    let engine =
        Engine::new(Model::load(&dir).unwrap(), EngineConfig::default()).unwrap().with_tokenizer(tok.clone()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let prompt = tok.encode_batch(&["Answer in the requested format:".to_string()]).unwrap().remove(0);
    let mut rng = Rng(2026);
    let schemas: Vec<Value> = (0..50).map(|i| object(&mut rng, 1 + i % 2)).collect();
    let mut reqs = Vec::new();
    let constraints = schemas
        .iter()
        .map(|s| Constraint { kind: "json_schema".into(), schema: s.to_string() })
        .chain(REGEXES.iter().map(|r| Constraint { kind: "regex".into(), schema: r.to_string() }));
    for (i, c) in constraints.enumerate() {
        let sampling = SamplingParams { temperature: 1.0, seed: Some(i as u64), ..Default::default() };
        let mut r = GenerateRequest::new(i as u64, prompt.clone(), 400, sampling);
        r.stop_token_ids = vec![eos];
        r.constraint = Some(c);
        reqs.push(r);
    }
    let (outs, _) = engine.generate(reqs);
    for (i, o) in outs.iter().enumerate() {
        let text = o.text.as_deref().unwrap();
        assert_eq!(o.finish, FinishReason::Stop, "request {i} must end by the grammar, not by length: {text:?}");
        if i < 50 {
            let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("schema {i}: {e}: {text:?}"));
            validate(&v, &schemas[i]).unwrap_or_else(|e| panic!("schema {i}: {e}\n{text}\n{}", schemas[i]));
        } else {
            let re = regex::Regex::new(&format!("^(?:{})$", REGEXES[i - 50])).unwrap();
            assert!(re.is_match(text), "regex {}: {text:?}", REGEXES[i - 50]);
        }
    }
}

#[test]
fn a_constraint_that_does_not_compile_fails_only_its_request() {
    let dir = support::random_model_dir("structured-bad", &support::builtin_config(), 92, 1);
    let tok = DeepseekTokenizer::builtin().unwrap();
    let engine =
        Engine::new(Model::load(&dir).unwrap(), EngineConfig::default()).unwrap().with_tokenizer(tok.clone()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let mut bad = GenerateRequest::new(0, vec![5, 6, 7], 5, SamplingParams::default());
    bad.constraint = Some(Constraint { kind: "lark".into(), schema: "start: ( unclosed".into() });
    let good = GenerateRequest::new(1, vec![5, 6, 7], 5, SamplingParams::default());
    let (outs, _) = engine.generate(vec![bad, good]);
    assert_eq!(outs[0].finish, FinishReason::Error);
    assert!(outs[0].error.as_deref().unwrap().contains("`constraint`"), "{:?}", outs[0].error);
    assert_eq!(outs[1].finish, FinishReason::Length);
}
