//! `deepinfer recipe render|parse`: the protocol layer from the command line.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use deepinfer_recipe::{
    convert, parse_output, render, DeepseekTokenizer, Encoding, InferenceFinishReason, OutputPiece, ParseContext,
    Protocol,
};
use serde_json::{json, Value};

#[derive(clap::Subcommand)]
pub enum RecipeCommand {
    /// Read one request body on stdin; print {"prompt", "token_ids", "encoding"} (DeepSeek-V4-Pro
    /// renders the V4 encoding, DeepSeek-V4.1-Flash V4.1). Conversion errors print the error body
    /// and exit 1.
    Render {
        /// tokenizer.json (default: the vendored DeepSeek V4 tokenizer).
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        /// chat, responses or messages (default: detected from the body).
        #[arg(long)]
        protocol: Option<String>,
    },
    /// Read {"request": ..., "model_output": [chunks]} on stdin; print the stream events and final
    /// response of the request's protocol.
    Parse {
        #[arg(long)]
        protocol: String,
        #[arg(long)]
        tokenizer: Option<PathBuf>,
    },
}

fn stdin_json() -> Result<Value> {
    let mut s = String::new();
    std::io::stdin().read_to_string(&mut s).context("reading stdin")?;
    serde_json::from_str(&s).context("stdin is not JSON")
}

fn tokenizer(path: Option<PathBuf>) -> Result<DeepseekTokenizer> {
    Ok(match path {
        Some(p) => DeepseekTokenizer::from_file(&p)?,
        None => DeepseekTokenizer::builtin()?,
    })
}

fn protocol_of(arg: Option<&str>, body: &Value) -> Result<Protocol> {
    match arg {
        Some(p) => p.parse().map_err(|e: String| anyhow::anyhow!("--protocol: {e}")),
        None => {
            Protocol::detect(body).context("cannot detect the protocol: the body has neither `messages` nor `input`")
        }
    }
}

pub fn run(cmd: RecipeCommand) -> Result<ExitCode> {
    match cmd {
        RecipeCommand::Render { tokenizer: t, protocol } => {
            let body = stdin_json()?;
            let p = protocol_of(protocol.as_deref(), &body)?;
            let conv = match convert(p, &body) {
                Ok(c) => c,
                Err(e) => {
                    println!("{}", e.body(p));
                    return Ok(ExitCode::FAILURE);
                }
            };
            let tok = tokenizer(t)?;
            let r = render(&conv.request, Encoding::of(conv.model_version()), Some(&tok));
            println!("{}", serde_json::to_string(&r)?);
            Ok(ExitCode::SUCCESS)
        }
        RecipeCommand::Parse { protocol, tokenizer: t } => {
            let doc = stdin_json()?;
            let p: Protocol = protocol.parse().map_err(|e: String| anyhow::anyhow!("--protocol: {e}"))?;
            let body = doc.get("request").context("missing `request`")?;
            let conv = match convert(p, body) {
                Ok(c) => c,
                Err(e) => {
                    println!("{}", e.body(p));
                    return Ok(ExitCode::FAILURE);
                }
            };
            let pieces: Vec<OutputPiece> = match doc.get("model_output") {
                Some(Value::String(s)) => vec![OutputPiece::Text(s.clone())],
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|c| match c {
                        Value::String(s) => Ok(OutputPiece::Text(s.clone())),
                        Value::Object(o) if o.contains_key("token_ids") => Ok(OutputPiece::Tokens(
                            serde_json::from_value(o["token_ids"].clone()).context("model_output: bad token_ids")?,
                        )),
                        other => {
                            anyhow::bail!("model_output: chunk {other} is not a string or {{\"token_ids\": [...]}}")
                        }
                    })
                    .collect::<Result<_>>()?,
                _ => anyhow::bail!("missing `model_output` (a string or a list of chunks)"),
            };
            let finish = match doc.get("finish_reason").and_then(Value::as_str).unwrap_or("stop") {
                "stop" => InferenceFinishReason::Stop,
                "length" => InferenceFinishReason::Length,
                "content_filter" => InferenceFinishReason::ContentFilter,
                other => anyhow::bail!("finish_reason: `{other}` (stop, length, content_filter)"),
            };
            let tok = tokenizer(t)?;
            let n = |k: &str| doc.get(k).and_then(Value::as_u64).unwrap_or(0) as usize;
            let ctx = ParseContext {
                response_id: doc.get("response_id").and_then(Value::as_str).unwrap_or("id-1"),
                prompt_tokens: n("prompt_tokens"),
                prompt_cache_hit_tokens: n("prompt_cache_hit_tokens"),
                finish,
                tokenizer: Some(&tok),
            };
            let out = parse_output(&conv, &pieces, &ctx)?;
            println!("{}", json!({"events": out.events, "sse_done_data": out.sse_done_data, "response": out.response}));
            Ok(ExitCode::SUCCESS)
        }
    }
}
