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

#[test]
fn auto_tool_choice_allows_text_then_a_call_and_required_allows_only_the_call() {
    let (tok, g) = env();
    let tools = r#"[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]"#;
    let call = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    let auto = c("tool_call", tools);
    let required = c("tool_call_required", tools);
    assert_eq!(run(&tok, &g, &auto, "It is 3 < 4, so no tool."), Ok(true), "auto: plain text, `<` included");
    assert_eq!(run(&tok, &g, &auto, &format!("Let me check.\n\n{call}")), Ok(true), "auto: text, then a call");
    assert_eq!(run(&tok, &g, &auto, call), Ok(true), "auto: a call alone");
    let bad = format!("Sure.\n\n{}", call.replace("get_weather", "delete_files"));
    assert!(run(&tok, &g, &auto, &bad).is_err(), "auto: a call still names a declared tool");
    assert_eq!(run(&tok, &g, &required, call), Ok(true));
    assert!(run(&tok, &g, &required, "No tool today.").is_err(), "required: text instead of the call is refused");
    assert_eq!(run(&tok, &g, &required, "<｜DSML｜tool_calls>\n"), Ok(false), "required: an open block is not done");
}

#[test]
fn tool_call_parameters_follow_their_schemas() {
    let (tok, g) = env();
    let tools = r#"[{"type":"function","function":{"name":"book","parameters":{"type":"object","properties":{"city":{"type":"string","maxLength":8},"nights":{"type":"integer"},"class":{"type":"string","enum":["economy","first"]}},"required":["city","nights"]}}}]"#;
    let req = c("tool_call_required", tools);
    let param = |name: &str, string: bool, v: &str| {
        format!("<｜DSML｜parameter name=\"{name}\" string=\"{string}\">{v}</｜DSML｜parameter>\n")
    };
    let call = |params: &str| {
        format!(
            "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"book\">\n{params}</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
        )
    };
    let ok = call(&(param("city", true, "Oslo") + &param("nights", false, "3")));
    assert_eq!(run(&tok, &g, &req, &ok), Ok(true));
    // Parameters come in the schema's order (serde_json keeps it: `preserve_order` is on).
    let with_class =
        call(&(param("city", true, "Oslo") + &param("nights", false, "3") + &param("class", true, "first")));
    assert_eq!(run(&tok, &g, &req, &with_class), Ok(true), "an optional parameter in its place");
    assert!(run(&tok, &g, &req, &call(&param("city", true, "Oslo"))).is_err(), "a required parameter is missing");
    let bad_int = call(&(param("city", true, "Oslo") + &param("nights", false, "three")));
    assert!(run(&tok, &g, &req, &bad_int).is_err(), "a non-string value is JSON of its schema");
    let long = call(&(param("city", true, "Llanfairpwllgwyngyll") + &param("nights", false, "3")));
    assert!(run(&tok, &g, &req, &long).is_err(), "maxLength holds");
    let bad_enum =
        call(&(param("city", true, "Oslo") + &param("nights", false, "1") + &param("class", true, "steerage")));
    assert!(run(&tok, &g, &req, &bad_enum).is_err(), "enum holds");
}
