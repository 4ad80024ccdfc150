//! `deepinfer bench-spec`: how many MTP drafts greedy verification keeps on a model, for fixed
//! draft lengths (issue #39's acceptance figures). For each prompt the target's greedy
//! continuation is computed once; speculation with k drafts a step is then replayed over it
//! (`engine::mtp::greedy_acceptance`), so the emitted tokens are the target's by construction and
//! the figure is target forwards saved: tokens per step (1.0 without speculation). It measures
//! acceptance, not wall-clock speed: verification steps in the engine loop are not built yet.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use deepinfer_engine::model::{Model, Numerics};
use deepinfer_engine::mtp::{greedy_acceptance_with, greedy_with_streams, Acceptance};
use deepinfer_spec::{choose_lengths, StepCost};
use serde_json::json;

use crate::progress::Progress;

#[derive(clap::Args)]
pub struct Args {
    /// Model directory (CPU). Default: the built-in trained model.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Draft lengths to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4")]
    k: Vec<usize>,
    /// Greedy tokens to generate after each prompt.
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// A text file with one prompt per line (default: 16 built-in English and code prompts).
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Also write the JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

const PROMPTS: &[&str] = &[
    "The SQLite database engine stores",
    "In Python, a list comprehension",
    "PostgreSQL supports several index types:",
    "def fibonacci(n):\n    ",
    "fn main() {\n    let v = vec![1, 2, 3];\n",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n",
    "The Django ORM lets you",
    "To create a table, use the CREATE TABLE statement",
    "A HashMap in Rust is",
    "The following example shows how to open a file:",
    "SELECT name, count(*) FROM",
    "class Stack:\n    def __init__(self):\n",
    "The transaction is committed when",
    "// Returns the number of bytes written.\nfunc (w *Writer) Write(p []byte) (n int, err error) {\n",
    "Exceptions are raised when",
    "The query planner chooses",
];

pub fn run(a: Args) -> Result<ExitCode> {
    let dir = match &a.model {
        Some(d) => d.clone(),
        None => {
            crate::setup::shipped_model().context("the built-in trained model is not in this checkout; pass --model")?
        }
    };
    if a.new_tokens < 2 {
        bail!("--new-tokens {}: at least 2 (a draft needs a token after it)", a.new_tokens);
    }
    let model = Model::load(&dir).with_context(|| format!("loading {}", dir.display()))?;
    let tok = crate::setup::tokenizer_for(&dir)?;
    let texts: Vec<String> = match &a.prompts {
        Some(f) => std::fs::read_to_string(f)
            .with_context(|| format!("--prompts {}", f.display()))?
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.replace("\\n", "\n"))
            .collect(),
        None => PROMPTS.iter().map(|s| s.to_string()).collect(),
    };
    if texts.is_empty() {
        bail!("--prompts: no prompt in the file");
    }
    let prompts = tok.encode_batch(&texts)?;
    let n = Numerics::Reference;
    let mut totals: Vec<Acceptance> =
        a.k.iter().map(|&k| Acceptance { k, steps: 0, tokens: 0, drafted: 0, accepted: 0 }).collect();
    // The target's step time for 1..=K+1 tokens after a prompt (CPU, median of 5), the cost model
    // confidence scheduling plans with.
    let max_k = a.k.iter().copied().max().unwrap_or(0);
    let mut points = Vec::new();
    {
        let mut base = model.new_state();
        model.forward(&mut [(&prompts[0], &mut base)], n, false)?;
        for t in 1..=max_k + 1 {
            let chunk: Vec<u32> = prompts[0].iter().cycle().take(t).copied().collect();
            let mut times: Vec<f64> = (0..5)
                .map(|_| {
                    let mut st = base.clone();
                    let t0 = std::time::Instant::now();
                    model.forward(&mut [(&chunk, &mut st)], n, false).map(|_| t0.elapsed().as_secs_f64())
                })
                .collect::<Result<_, _>>()?;
            times.sort_by(f64::total_cmp);
            points.push((t, times[2]));
        }
    }
    let cost = StepCost::new(points.clone())?;
    let step_s = |k: usize| cost.seconds(k + 1);
    let mut sched = Acceptance { k: max_k, steps: 0, tokens: 0, drafted: 0, accepted: 0 };
    let mut sched_s = 0.0;
    let mut fixed_s = vec![0.0; a.k.len()];
    let mut plain_s = 0.0;
    let mut bar = Progress::new("bench-spec", prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let (tokens, streams) = greedy_with_streams(&model, p, a.new_tokens, n)?;
        plain_s += a.new_tokens as f64 * step_s(0);
        for (t, secs) in totals.iter_mut().zip(fixed_s.iter_mut()) {
            let (r, lengths) =
                greedy_acceptance_with(&model, &tokens, &streams, p.len(), t.k, n, &mut |d| d.tokens.len())?;
            t.steps += r.steps;
            t.tokens += r.tokens;
            t.drafted += r.drafted;
            t.accepted += r.accepted;
            *secs += step_s(0) + lengths.iter().map(|&k| step_s(k)).sum::<f64>();
        }
        let mut choose =
            |d: &deepinfer_spec::Draft| choose_lengths(&[d.confidence()], max_k, &cost).map(|v| v[0]).unwrap_or(0);
        let (r, lengths) = greedy_acceptance_with(&model, &tokens, &streams, p.len(), max_k, n, &mut choose)?;
        sched.steps += r.steps;
        sched.tokens += r.tokens;
        sched.drafted += r.drafted;
        sched.accepted += r.accepted;
        sched_s += step_s(0) + lengths.iter().map(|&k| step_s(k)).sum::<f64>();
        bar.set(i + 1, "prompts");
    }
    let row = |t: &Acceptance, secs: f64| {
        json!({
            "k": t.k,
            "steps": t.steps,
            "tokens": t.tokens,
            "tokens_per_step": t.tokens_per_step(),
            "draft_acceptance_rate": if t.drafted > 0 { t.accepted as f64 / t.drafted as f64 } else { 0.0 },
            "est_tokens_per_s": t.tokens as f64 / secs,
        })
    };
    let rows: Vec<_> = totals
        .iter()
        .zip(&fixed_s)
        .map(|(t, &secs)| {
            json!({
                "est_tokens_per_s": t.tokens as f64 / secs,
                "k": t.k,
                "steps": t.steps,
                "tokens": t.tokens,
                "tokens_per_step": t.tokens_per_step(),
                "accepted_per_step": t.accepted as f64 / t.steps.max(1) as f64,
                "draft_acceptance_rate": if t.drafted > 0 { t.accepted as f64 / t.drafted as f64 } else { 0.0 },
            })
        })
        .collect();
    let report = json!({
        "model": dir.display().to_string(),
        "prompts": prompts.len(),
        "new_tokens": a.new_tokens,
        "verification": "greedy",
        "fixed_k": rows,
        "confidence_scheduled": row(&sched, sched_s),
        "no_speculation_est_tokens_per_s": (prompts.len() * a.new_tokens) as f64 / plain_s,
        "step_cost_s": points,
        "estimate": "tok/s estimated from the measured step time of a target forward over k+1 tokens at batch 1 \
                     (the engine loop does not run verification steps yet; MTP drafting time not counted)",
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(p) = &a.out {
        std::fs::write(p, &text).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}
