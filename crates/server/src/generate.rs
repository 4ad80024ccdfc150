//! `deepinfer generate`: prompts in (text rendered as a chat turn by the recipe, or API bodies),
//! tokens out, through the engine loop on the CPU model.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use deepinfer_engine::sampler::SamplingParams;
use deepinfer_engine::{tiny, Engine, EngineConfig, GenerateRequest, Model};
use deepinfer_recipe::{convert, render, DeepseekTokenizer, Encoding, Protocol};
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct Args {
    /// A user message, rendered as a DeepSeek-V4 chat turn (thinking off).
    #[arg(long, conflicts_with = "prompts")]
    prompt: Option<String>,
    /// A JSONL file with one API request body (Chat Completions, Responses or Messages) per line.
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Model directory (config.json, safetensors, optional tokenizer.json). Default: a built-in
    /// tiny DeepSeek-V4 model with random weights (its text is noise) and the V4 tokenizer.
    #[arg(long)]
    model: Option<PathBuf>,
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
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// cpu (the CUDA model path is not built yet).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// text or json.
    #[arg(long, default_value = "text")]
    output: String,
}

fn builtin_model() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("deepinfer-builtin-tiny-v4-{}", env!("CARGO_PKG_VERSION")));
    if !dir.join("config.json").is_file() {
        eprintln!("writing the built-in tiny random model to {} ...", dir.display());
        let tmp = dir.with_extension(format!("tmp{}", std::process::id()));
        tiny::write_model(&tmp, &tiny::builtin_config(), 20261129, 1).context("writing the built-in model")?;
        if std::fs::rename(&tmp, &dir).is_err() {
            let _ = std::fs::remove_dir_all(&tmp); // another process won the race
        }
    }
    Ok(dir)
}

pub fn run(a: Args) -> Result<ExitCode> {
    if a.device != "cpu" {
        bail!(
            "--device {}: only the cpu backend runs the model so far (the CUDA model path is not built yet)",
            a.device
        );
    }
    if !["text", "json"].contains(&a.output.as_str()) {
        bail!("--output: `{}` is not text or json", a.output);
    }
    let t0 = Instant::now();
    let (dir, builtin) = match &a.model {
        Some(d) => (d.clone(), false),
        None => (builtin_model()?, true),
    };
    let model = Model::load(&dir).with_context(|| format!("loading {}", dir.display()))?;
    let tok = match dir.join("tokenizer.json") {
        p if p.is_file() => DeepseekTokenizer::from_file(&p)?,
        _ => DeepseekTokenizer::builtin()?,
    };
    eprintln!(
        "loaded {} in {:.2}s{}",
        dir.display(),
        t0.elapsed().as_secs_f64(),
        if builtin { " (built-in random weights: the text is noise)" } else { "" }
    );
    let bodies: Vec<Value> = match (&a.prompt, &a.prompts) {
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
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        min_p: a.min_p,
        seed: a.seed,
        ..Default::default()
    };
    let eos = tok.special_id("<｜end▁of▁sentence｜>").into_iter().collect::<Vec<_>>();
    let mut reqs = Vec::new();
    for (i, b) in bodies.iter().enumerate() {
        let p = Protocol::detect(b).unwrap_or(Protocol::Chat);
        let conv = convert(p, b).map_err(|e| anyhow::anyhow!("request {}: {e}", i + 1))?;
        let r = render(&conv.request, Encoding::V4, Some(&tok));
        let ids = r.token_ids.with_context(|| format!("request {}: {}", i + 1, r.encode_error.unwrap_or_default()))?;
        reqs.push(GenerateRequest {
            id: i as u64,
            prompt: ids,
            max_tokens: a.max_tokens,
            sampling: SamplingParams { seed: a.seed + i as u64, ..sampling.clone() },
            stop_token_ids: eos.clone(),
            priority: 0,
        });
    }
    let engine = Engine::new(model, EngineConfig::default());
    eprintln!("generating {} request(s) ...", reqs.len());
    let (outs, stats) = engine.generate(reqs);
    let mut stdout = std::io::stdout().lock();
    let mut failed = false;
    for o in &outs {
        let text = tok.decode(&o.tokens).unwrap_or_default();
        failed |= o.error.is_some();
        if a.output == "json" {
            writeln!(
                stdout,
                "{}",
                json!({"id": o.id, "text": text, "tokens": o.tokens, "finish": o.finish, "error": o.error, "prompt_tokens": o.prompt_tokens, "ttft_s": o.ttft_s})
            )?;
        } else if let Some(e) = &o.error {
            writeln!(stdout, "[{}] error: {e}", o.id)?;
        } else {
            writeln!(stdout, "[{}] {text}", o.id)?;
        }
    }
    let ttft = outs.iter().map(|o| o.ttft_s).fold(0.0, f64::max);
    eprintln!(
        "prompt tokens {}, generated tokens {}, TTFT {:.3}s, {:.1} tokens/s, {} steps, prefix-cache hits 0 (prefix reuse not wired yet)",
        stats.prompt_tokens,
        stats.generated_tokens,
        ttft,
        stats.generated_tokens as f64 / stats.seconds.max(1e-9),
        stats.steps
    );
    Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}
