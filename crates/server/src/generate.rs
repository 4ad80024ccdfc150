//! `deepinfer generate`: prompts in (text rendered as a chat turn by the recipe, or API bodies),
//! tokens and text out, through the engine loop on the CPU model.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use deepinfer_engine::engine::Event;
use deepinfer_engine::sampler::SamplingParams;
use deepinfer_engine::{GenerateOutput, GenerateRequest};
use deepinfer_recipe::{convert, Constraint, DeepseekTokenizer, Protocol};
use serde_json::{json, Value};

use crate::api_request::{map_body, Defaults};
use crate::progress::Progress;
use crate::setup::{self, EngineArgs};

#[derive(clap::Args)]
pub struct Args {
    /// A user message, rendered as a DeepSeek-V4 chat turn (thinking off).
    #[arg(long, conflicts_with = "prompts")]
    prompt: Option<String>,
    /// A JSONL file with one API request body (Chat Completions, Responses or Messages) per line;
    /// each body's own sampling, stop and response_format apply.
    #[arg(long)]
    prompts: Option<PathBuf>,
    #[command(flatten)]
    engine: EngineArgs,
    /// Output tokens per request (a body's own max_tokens wins).
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Base seed (request i uses seed + i). Default: random, or 0 with DEEPINFER_BATCH_INVARIANT=1.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop at this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Constrain --prompt's output to this JSON schema (a file).
    #[arg(long, conflicts_with = "regex")]
    json_schema: Option<PathBuf>,
    /// Constrain --prompt's output to this regular expression.
    #[arg(long)]
    regex: Option<String>,
    /// text or json.
    #[arg(long, default_value = "text")]
    output: String,
}

fn sampling_of(a: &Args, i: u64) -> SamplingParams {
    SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        min_p: a.min_p,
        repetition_penalty: a.repetition_penalty,
        seed: a.seed.map(|s| s.wrapping_add(i)),
        ..Default::default()
    }
}

/// One API body as an engine request (the recipe's conversion, encoding and policies); the flags
/// fill what the body leaves out.
fn from_body(body: &Value, i: u64, a: &Args, tok: &DeepseekTokenizer, context: usize) -> Result<GenerateRequest> {
    let p = Protocol::detect(body).unwrap_or(Protocol::Chat);
    let conv = convert(p, body).map_err(|e| anyhow::anyhow!("{e}"))?;
    let d = Defaults {
        max_tokens: Some(a.max_tokens),
        temperature: Some(a.temperature),
        top_k: a.top_k,
        min_p: a.min_p,
        repetition_penalty: a.repetition_penalty,
        seed: a.seed.map(|s| s.wrapping_add(i)),
    };
    let mut r = map_body(&conv, body, i, tok, context, &d).map_err(|e| anyhow::anyhow!("{e}"))?.request;
    r.stop_strings.extend(a.stop.iter().cloned());
    Ok(r)
}

pub fn run(a: Args) -> Result<ExitCode> {
    if !["text", "json"].contains(&a.output.as_str()) {
        bail!("--output: `{}` is not text or json", a.output);
    }
    let mut bodies: Vec<Value> = match (&a.prompt, &a.prompts) {
        (Some(p), _) => vec![
            json!({"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": p}], "thinking": {"type": "disabled"}}),
        ],
        (None, Some(f)) => {
            std::io::BufReader::new(std::fs::File::open(f).with_context(|| format!("opening {}", f.display()))?)
                .lines()
                .enumerate()
                .filter(|(_, l)| l.as_ref().map_or(true, |l| !l.trim().is_empty()))
                .map(|(i, l)| -> Result<Value> {
                    serde_json::from_str(&l?).with_context(|| format!("{}: line {} is not JSON", f.display(), i + 1))
                })
                .collect::<Result<_>>()?
        }
        (None, None) => bail!("give --prompt TEXT or --prompts FILE.jsonl"),
    };
    let constraint = match (&a.json_schema, &a.regex) {
        (Some(f), _) => {
            let text = std::fs::read_to_string(f).with_context(|| format!("--json-schema {}", f.display()))?;
            serde_json::from_str::<Value>(&text).with_context(|| format!("--json-schema {}: not JSON", f.display()))?;
            Some(Constraint { kind: "json_schema".into(), schema: text })
        }
        (None, Some(r)) => Some(Constraint { kind: "regex".into(), schema: r.clone() }),
        _ => None,
    };
    let loaded = setup::load(&a.engine)?;
    let tok = &loaded.tok;
    let mut reqs = Vec::new();
    for (i, b) in bodies.iter_mut().enumerate() {
        let mut r =
            from_body(b, i as u64, &a, tok, a.engine.max_context).with_context(|| format!("request {}", i + 1))?;
        if a.prompt.is_some() {
            r.sampling = SamplingParams { top_logprobs: 0, ..sampling_of(&a, i as u64) };
            r.max_tokens = a.max_tokens;
        }
        if r.constraint.is_none() {
            r.constraint = constraint.clone();
        }
        reqs.push(r);
    }
    let n = reqs.len();
    let prompt_tokens: usize = reqs.iter().map(|r| r.prompt.len()).sum();
    let engine = std::sync::Arc::new(loaded.engine);
    let t0 = Instant::now();
    let handle = engine.clone().start();
    let (tx, rx) = crossbeam::channel::unbounded();
    for r in reqs {
        handle.submit_to(r, tx.clone());
    }
    drop(tx);
    let mut bar = Progress::new("generating", n);
    let mut outs: HashMap<u64, GenerateOutput> = HashMap::new();
    let mut generated = 0usize;
    for e in rx.iter() {
        match e {
            Event::Token { .. } => generated += 1,
            Event::Admitted { .. } => {}
            Event::Done(o) => {
                outs.insert(o.id, o);
            }
        }
        let rate = generated as f64 / t0.elapsed().as_secs_f64().max(1e-9);
        bar.set(outs.len(), &format!("requests, {generated} tokens, {rate:.1} tokens/s"));
    }
    let stats = handle.shutdown();
    engine.flush().context("writing KV blocks to --kv-dir")?;
    let mut stdout = std::io::stdout().lock();
    let mut failed = false;
    for i in 0..n as u64 {
        let o = &outs[&i];
        let text = o.text.clone().unwrap_or_default();
        failed |= o.error.is_some();
        if a.output == "json" {
            writeln!(
                stdout,
                "{}",
                json!({"id": o.id, "text": text, "tokens": o.tokens, "finish": o.finish, "error": o.error,
                       "prompt_tokens": o.prompt_tokens, "cached_tokens": o.cached_tokens,
                       "replayed_tokens": o.replayed_tokens, "ttft_s": o.ttft_s, "seed": o.seed})
            )?;
        } else if let Some(e) = &o.error {
            writeln!(stdout, "[{}] error: {e}", o.id)?;
        } else {
            writeln!(stdout, "[{}] {text}", o.id)?;
        }
    }
    let ttfts: Vec<f64> = outs.values().filter(|o| !o.tokens.is_empty()).map(|o| o.ttft_s).collect();
    let ttft = ttfts.iter().sum::<f64>() / ttfts.len().max(1) as f64;
    eprintln!(
        "prompt tokens {prompt_tokens}, generated tokens {}, TTFT mean {:.3}s, {:.1} tokens/s, {} steps, \
         prefix-cache hits {} ({} cached tokens, {} replayed){}",
        stats.generated_tokens,
        ttft,
        stats.generated_tokens as f64 / stats.seconds.max(1e-9),
        stats.steps,
        stats.prefix_hits,
        stats.cached_tokens,
        stats.replayed_tokens,
        loaded.builtin.note()
    );
    Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}
