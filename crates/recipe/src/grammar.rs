//! Output constraints compiled with llguidance against the tokenizer: JSON (json_object and
//! json_schema), regex, the DSML tool-call block of a request's tools, and user-supplied
//! Lark/EBNF grammars. The sampler asks the resulting [`Matcher`] for a token mask each step.
//!
//! The token environment is built here from the `tokenizers` vocabulary (byte-level BPE strings
//! mapped back to bytes; added tokens as toktrie special tokens), so llguidance sees exactly the
//! tokenizer the prompts were encoded with.

use std::collections::HashMap;
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::engine_request::Constraint;
use crate::error::RecipeError;
use crate::tokenizer::DeepseekTokenizer;

/// GPT-2's byte-to-character table, inverted: the character a byte-level BPE vocabulary uses
/// for each byte.
fn byte_decoder() -> HashMap<char, u8> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    cs.into_iter().zip(bs).filter_map(|(c, b)| char::from_u32(c).map(|c| (c, b as u8))).collect()
}

struct Env {
    trie: TokTrie,
    tok: DeepseekTokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let text = String::from_utf8_lossy(s).to_string();
        self.tok.encode_batch(&[text]).map(|mut v| v.remove(0)).unwrap_or_default()
    }
}

/// The grammar machinery for one tokenizer (built once: the token trie of the whole vocabulary).
#[derive(Clone)]
pub struct GrammarEnv {
    factory: Arc<ParserFactory>,
    dsml: Option<u32>,
}

impl GrammarEnv {
    pub fn new(tok: &DeepseekTokenizer) -> Result<GrammarEnv, RecipeError> {
        let t = tok.tokenizer();
        let vocab = t.get_vocab(true);
        let size = t.get_vocab_size(true).max(vocab.values().map(|v| *v as usize + 1).max().unwrap_or(0));
        let added: HashMap<u32, bool> = t
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, a)| (id, a.special || a.content.starts_with('<')))
            .collect();
        let dec = byte_decoder();
        let mut words = vec![Vec::new(); size];
        for (s, id) in &vocab {
            words[*id as usize] = if added.get(id).copied().unwrap_or(false) {
                let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                w.extend_from_slice(s.as_bytes());
                w
            } else {
                s.chars()
                    .flat_map(|c| dec.get(&c).map(|b| vec![*b]).unwrap_or_else(|| c.to_string().into_bytes()))
                    .collect()
            };
        }
        let eos = tok.special_id("<｜end▁of▁sentence｜>").unwrap_or(1);
        let trie = TokTrie::from(&TokRxInfo::new(size as u32, eos), &words);
        let env: TokEnv = Arc::new(Env { trie, tok: tok.clone() });
        let factory =
            ParserFactory::new_simple(&env).map_err(|e| RecipeError::Tokenizer(format!("grammar setup: {e}")))?;
        Ok(GrammarEnv { factory: Arc::new(factory), dsml: tok.special_id("｜DSML｜") })
    }

    /// A matcher enforcing `c` from the first output token of the constrained region.
    pub fn matcher(&self, c: &Constraint) -> Result<Matcher, RecipeError> {
        let grammar = grammar_of(c, self.dsml)?;
        let parser = self.factory.create_parser(grammar);
        let m = Matcher::new(parser);
        if let Some(e) = m.get_error() {
            return Err(RecipeError::Conversion {
                status: 400,
                message: format!("{} constraint does not compile: {e}", c.kind),
                kind: "invalid_request_error".into(),
            });
        }
        Ok(m)
    }
}

fn lark_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// A Lark string literal for `text` in which every `｜DSML｜` is the control token (the V4
/// template renders the marker as a token, so a model emits its id, never its characters).
fn dsml_literal(text: &str, dsml: Option<u32>) -> String {
    match dsml {
        Some(id) => text.split("｜DSML｜").map(lark_str).collect::<Vec<_>>().join(&format!(" <[{id}]> ")),
        None => lark_str(text),
    }
}

/// The DSML tool-call block (the V4 encoding's format) as a Lark grammar over `tools` (a JSON
/// list of {"type": "function", "function": {"name", "parameters"}}): one or more invocations of
/// declared tools with declared parameter names, after free text unless `required` (the official
/// kinds `tool_call` for `auto` and `tool_call_required` for `required` and named choices).
/// `dsml` is the id of the `｜DSML｜` token.
fn tool_call_grammar(schema: &str, dsml: Option<u32>, required: bool) -> Result<String, RecipeError> {
    let d = |t: &str| dsml_literal(t, dsml);
    let tools: Vec<Value> =
        serde_json::from_str(schema).map_err(|e| RecipeError::Stream(format!("tool_call schema: {e}")))?;
    let mut invokes = Vec::new();
    let mut rules = String::new();
    for (i, t) in tools.iter().enumerate() {
        let f = &t["function"];
        let name = f["name"].as_str().unwrap_or_default();
        let props = f["parameters"]["properties"].as_object();
        let required: Vec<&str> =
            f["parameters"]["required"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        // One rule per declared parameter, in the schema's order (serde_json's `preserve_order` is on
        // in this workspace); required ones are mandatory, each at most once.
        let mut seq = Vec::new();
        for (j, (pname, pschema)) in props.into_iter().flatten().enumerate() {
            let rule = format!("p{i}_{j}");
            let value = param_value(pschema)?;
            rules.push_str(&format!(
                "{rule}: {} {value} {}\n",
                d(&format!("<｜DSML｜parameter name=\"{pname}\" string=\"")),
                d("</｜DSML｜parameter>\n"),
            ));
            seq.push(if required.contains(&pname.as_str()) { rule } else { format!("{rule}?") });
        }
        rules.push_str(&format!(
            "inv{i}: {} {} {}\n",
            d(&format!("<｜DSML｜invoke name=\"{name}\">\n")),
            seq.join(" "),
            d("</｜DSML｜invoke>\n"),
        ));
        invokes.push(format!("inv{i}"));
    }
    if invokes.is_empty() {
        return Err(RecipeError::Stream("tool_call constraint without tools".into()));
    }
    // The block opens with `<` then the marker token. With `required` the output is the block;
    // otherwise (`auto`) any text, or text whose last character is that `<` and then the block
    // (the marker is a token no text lexeme can contain, so the two alternatives part there).
    let block_rest = format!("{} invoke+ {}", d("｜DSML｜tool_calls>\n"), d("</｜DSML｜tool_calls>"));
    let start = if required {
        format!("start: \"<\" {block_rest}\n")
    } else {
        format!("start: PROSE | LEAD {block_rest}\nPROSE: /(?s:.*)/\nLEAD: /(?s:.*<)/\n")
    };
    Ok(format!("{start}invoke: {}\n{rules}", invokes.join(" | ")))
}

/// The grammar of one parameter's value as the V4 template writes it: a string raw after
/// `string="true">` (its `enum` or `maxLength` kept), anything else as JSON after `string="false">`
/// matching the parameter's schema.
fn param_value(schema: &Value) -> Result<String, RecipeError> {
    if schema["type"].as_str() == Some("string") {
        let body = if let Some(values) = schema["enum"].as_array() {
            let alts: Vec<String> = values.iter().filter_map(Value::as_str).map(lark_str).collect();
            if alts.is_empty() {
                return Err(RecipeError::Stream("a string parameter's `enum` lists no strings".into()));
            }
            format!("({})", alts.join(" | "))
        } else {
            match schema["maxLength"].as_u64() {
                Some(n) => format!("/[^<]{{0,{n}}}/"),
                None => "/[^<]*/".to_string(),
            }
        };
        return Ok(format!("{} {body}", lark_str("true\">")));
    }
    let mut schema = schema.clone();
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(
            || serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    Ok(format!("{} %json {schema}", lark_str("false\">")))
}

fn grammar_of(c: &Constraint, dsml: Option<u32>) -> Result<TopLevelGrammar, RecipeError> {
    Ok(match c.kind.as_str() {
        "json" | "json_object" | "json_schema" => {
            let schema = serde_json::from_str::<Value>(&c.schema)
                .ok()
                .filter(|v| v.is_object() && v.as_object().is_some_and(|o| !o.is_empty()));
            let mut schema = schema.unwrap_or_else(|| serde_json::json!({"type": "object"}));
            // Fixed separators unless the schema sets its own: flexible whitespace lets a model
            // pad forever (and a random one does), so outputs read as `{"a": 1, "b": [2, 3]}`.
            if let Some(o) = schema.as_object_mut() {
                o.entry("x-guidance").or_insert_with(
                    || serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
                );
            }
            TopLevelGrammar::from_json_schema(schema)
        }
        "regex" => TopLevelGrammar::from_regex(&c.schema),
        "lark" | "ebnf" => TopLevelGrammar::from_lark(c.schema.clone()),
        "tool_call" => TopLevelGrammar::from_lark(tool_call_grammar(&c.schema, dsml, false)?),
        "tool_call_required" => TopLevelGrammar::from_lark(tool_call_grammar(&c.schema, dsml, true)?),
        other => {
            return Err(RecipeError::Conversion {
                status: 400,
                message: format!("unknown constraint kind `{other}`"),
                kind: "invalid_request_error".into(),
            })
        }
    })
}
