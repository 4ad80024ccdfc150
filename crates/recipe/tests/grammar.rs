//! Constraints compiled with llguidance against the vendored tokenizer: valid outputs pass the
//! token mask at every step and end accepting; invalid ones are refused.

use deepinfer_recipe::{Constraint, DeepseekTokenizer, GrammarEnv};

fn env() -> (DeepseekTokenizer, GrammarEnv) {
    let tok = DeepseekTokenizer::builtin().unwrap();
    let g = GrammarEnv::new(&tok).unwrap();
    (tok, g)
}

/// Feed `text`'s tokens through the matcher: Ok(accepting at the end) when every token is in the
/// mask, Err(index) at the first token the mask refuses.
fn run(tok: &DeepseekTokenizer, g: &GrammarEnv, c: &Constraint, text: &str) -> Result<bool, usize> {
    // As a model emits it: the `｜DSML｜` marker is its control token, the rest plain text.
    let dsml = tok.special_id("｜DSML｜").unwrap();
    let parts: Vec<String> = text.split("｜DSML｜").map(str::to_string).collect();
    let enc = tok.encode_batch(&parts).unwrap();
    let mut ids = Vec::new();
    for (i, p) in enc.into_iter().enumerate() {
        if i > 0 {
            ids.push(dsml);
        }
        ids.extend(p);
    }
    let mut m = g.matcher(c).unwrap();
    for (i, t) in ids.iter().enumerate() {
        let mask = m.compute_mask().unwrap();
        if !mask.is_allowed(*t) {
            return Err(i);
        }
        m.consume_token(*t).unwrap();
    }
    Ok(m.is_accepting().unwrap())
}

fn c(kind: &str, schema: &str) -> Constraint {
    Constraint { kind: kind.into(), schema: schema.into() }
}

#[test]
fn json_schema_accepts_valid_and_refuses_invalid() {
    let (tok, g) = env();
    let schema = r#"{"type":"object","properties":{"answer":{"type":"string"},"score":{"type":"number"}},"required":["answer"],"additionalProperties":false}"#;
    assert_eq!(run(&tok, &g, &c("json", schema), r#"{"answer": "yes", "score": 0.5}"#), Ok(true));
    assert!(run(&tok, &g, &c("json", schema), r#"{"wrong": 1}"#).is_err());
    assert_eq!(run(&tok, &g, &c("json", ""), r#"{"any": [1, 2, {"x": null}]}"#), Ok(true), "json_object: any object");
    assert!(run(&tok, &g, &c("json", ""), "not json").is_err());
}

#[test]
fn regex_and_lark_constraints() {
    let (tok, g) = env();
    assert_eq!(run(&tok, &g, &c("regex", "[0-9]{3}-[a-z]+"), "123-abc"), Ok(true));
    assert!(run(&tok, &g, &c("regex", "[0-9]{3}-[a-z]+"), "12a").is_err());
    let lark = "start: \"yes\" | \"no\"";
    assert_eq!(run(&tok, &g, &c("lark", lark), "no"), Ok(true));
    assert!(run(&tok, &g, &c("lark", lark), "maybe").is_err());
    assert!(g.matcher(&c("lark", "start: ( unclosed")).is_err(), "a bad grammar is a named error");
}

#[test]
fn tool_call_constraint_accepts_a_dsml_call_of_a_declared_tool() {
    let (tok, g) = env();
    let tools = r#"[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]"#;
    let call = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    assert_eq!(run(&tok, &g, &c("tool_call", tools), call), Ok(true));
    let other = call.replace("get_weather", "delete_files");
    assert!(run(&tok, &g, &c("tool_call", tools), &other).is_err(), "undeclared tools are refused");
}
