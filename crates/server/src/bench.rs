//! `deepinfer bench` (docs/BENCH.md): prefill tokens/s for one sequence at several lengths, cold
//! and with a cached prefix (exact and bounded replay), and decode tokens/s with inter-token
//! latency at several batch sizes, through the real engine loop. Prints JSON.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use deepinfer_engine::engine::{Event, ReplayMode};
use deepinfer_engine::sampler::SamplingParams;
use deepinfer_engine::tiny::Rng;
use deepinfer_engine::{Engine, EngineConfig, EngineStats, GenerateRequest, Model};
use deepinfer_scheduler::sim::Percentiles;
use serde_json::{json, Value};

use crate::progress::Progress;
use crate::setup::{self, EngineArgs};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    engine: EngineArgs,
    /// Prompt lengths for the prefill runs (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "128,512,2048")]
    prefill: Vec<usize>,
    /// New tokens after a cached prefix.
    #[arg(long, default_value_t = 64)]
    suffix: usize,
    /// Batch sizes for the decode runs.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    decode_batch: Vec<usize>,
    /// Context (prompt tokens) of each decoding request.
    #[arg(long, default_value_t = 256)]
    decode_context: usize,
    /// Output tokens per decoding request.
    #[arg(long, default_value_t = 32)]
    decode_tokens: usize,
    /// Also write the JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn random_prompt(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    let (lo, span) = (100u64, (vocab as u64).saturating_sub(1100).max(1));
    (0..n).map(|_| (lo + rng.below(span)) as u32).collect()
}

fn greedy() -> SamplingParams {
    SamplingParams { temperature: 0.0, ..Default::default() }
}

/// Run `reqs` through a streaming engine; per request the token arrival times (seconds).
fn timed(engine: &Arc<Engine>, reqs: Vec<GenerateRequest>) -> Result<(HashMap<u64, Vec<f64>>, EngineStats)> {
    let t0 = Instant::now();
    let h = engine.clone().start();
    let (tx, rx) = crossbeam::channel::unbounded();
    for r in reqs {
        h.submit_to(r, tx.clone());
    }
    drop(tx);
    let mut times: HashMap<u64, Vec<f64>> = HashMap::new();
    for e in rx.iter() {
        match e {
            Event::Token { id, .. } => times.entry(id).or_default().push(t0.elapsed().as_secs_f64()),
            Event::Admitted { .. } => {}
            Event::Done(o) => {
                if let Some(err) = o.error {
                    bail!("request {} failed: {err}", o.id);
                }
            }
        }
    }
    Ok((times, h.shutdown()))
}

pub fn run(a: Args) -> Result<ExitCode> {
    let loaded = setup::load(&a.engine)?;
    let cfg = loaded.engine.model().config().clone();
    let (layers, vocab) = (cfg.num_layers, cfg.vocab_size);
    let base = loaded.engine.config().clone();
    let mut rng = Rng(20261130);
    let main = Arc::new(loaded.engine);
    // Bounded replay on a second engine: the reference model only (a second device model would
    // double the GPU's weights).
    let bounded = if a.engine.device == "cpu" {
        Some(Arc::new(Engine::new(
            Model::load(&loaded.dir)?,
            EngineConfig { replay: ReplayMode::Bounded { keep: cfg.sliding_window }, ..base.clone() },
        )?))
    } else {
        None
    };
    let mut bar = Progress::new("bench", a.prefill.len() * 2 + a.decode_batch.len());
    let mut step = 0;

    // Warm-up (thread start, page faults of the weights), not measured.
    timed(&main, vec![GenerateRequest::new(0, random_prompt(&mut rng, 64, vocab), 4, greedy())])?;

    let mut prefill = Vec::new();
    let mut cached = Vec::new();
    for &n in &a.prefill {
        if n + a.suffix + 1 > base.max_context {
            bail!("--prefill {n}: more than --max-context {}", base.max_context);
        }
        let prompt = random_prompt(&mut rng, n, vocab);
        let (t, _) = timed(&main, vec![GenerateRequest::new(0, prompt.clone(), 1, greedy())])?;
        let s = t[&0][0];
        prefill.push(json!({"tokens": n, "seconds": s, "tokens_per_s": n as f64 / s,
                            "token_layers_per_s": (n * layers) as f64 / s}));
        step += 1;
        bar.set(step, &format!("prefill {n}"));
        let mut longer = prompt;
        longer.extend(random_prompt(&mut rng, a.suffix, vocab));
        let modes = std::iter::once(("exact", &main)).chain(bounded.as_ref().map(|b| ("bounded", b)));
        for (mode, engine) in modes {
            if mode == "bounded" {
                timed(engine, vec![GenerateRequest::new(0, longer[..n].to_vec(), 1, greedy())])?;
                // warm its cache
            }
            let before = engine.kv_stats();
            let (t, _) = timed(engine, vec![GenerateRequest::new(1, longer.clone(), 1, greedy())])?;
            let after = engine.kv_stats();
            let s = t[&1][0];
            // A cold prefill of the whole prompt at the cold rate measured above.
            let cold_s = (n + a.suffix) as f64 / prefill.last().unwrap()["tokens_per_s"].as_f64().unwrap();
            cached.push(json!({"prefix": n, "new_tokens": a.suffix, "replay": mode, "seconds": s,
                               "hit_blocks": after.hit_blocks - before.hit_blocks,
                               "cold_seconds_estimate": cold_s, "speedup": cold_s / s}));
        }
        step += 1;
        bar.set(step, &format!("cached prefix {n}"));
    }

    let mut decode = Vec::new();
    let mut failures = 0;
    let mut profiles = Vec::new();
    for &b in &a.decode_batch {
        let p0 = main.model().profile();
        let reqs: Vec<GenerateRequest> = (0..b as u64)
            .map(|i| {
                let mut r = GenerateRequest::new(
                    i,
                    random_prompt(&mut rng, a.decode_context, vocab),
                    a.decode_tokens,
                    greedy(),
                );
                r.cache_salt = Some(format!("decode-{b}-{i}")); // no request reuses another's prefix
                r
            })
            .collect();
        let measured = timed(&main, reqs).and_then(|(times, st)| {
            // The window in which all b requests decode: from the last one's first token (before it,
            // steps carry prefill chunks of the later requests) to the first one's last token (after
            // it, the batch is smaller).
            let start = times.values().map(|t| t[0]).fold(0.0, f64::max);
            let end = times.values().map(|t| *t.last().unwrap()).fold(f64::INFINITY, f64::min);
            let inside = |x: f64| x > start && x <= end;
            let after: usize = times.values().map(|t| t.iter().filter(|x| inside(**x)).count()).sum();
            let window_steps = after / b.max(1);
            if window_steps < 2 {
                return Err(anyhow::anyhow!(
                    "--decode-tokens {}: at batch {b} the first requests finished while the last were still \
                     prefilling ({window_steps} steps with all {b} decoding); raise --decode-tokens",
                    a.decode_tokens
                ));
            }
            let gaps = Percentiles::of(
                times
                    .values()
                    .flat_map(|t| t.windows(2).filter(|w| w[0] >= start && inside(w[1])).map(|w| w[1] - w[0]))
                    .collect(),
            );
            let tps = after as f64 / (end - start).max(1e-9);
            let row = json!({"batch": b, "context": a.decode_context, "tokens_per_request": a.decode_tokens,
                           "window_steps": window_steps, "tokens_per_s": tps, "tokens_per_s_per_user": tps / b as f64,
                           "token_layers_per_s": tps * layers as f64,
                           "itl_p50_ms": gaps.p50 * 1e3, "itl_p99_ms": gaps.p99 * 1e3,
                           "speculative_tokens": main.config().speculative_tokens,
                           "spec_drafted": st.drafted_tokens, "spec_accepted": st.accepted_drafts,
                           "spec_tokens_per_step": (st.accepted_drafts + st.spec_steps) as f64 / st.spec_steps.max(1) as f64});
            Ok((row, gaps.p50))
        });
        let itl_p50 = match measured {
            Ok((row, p50)) => {
                decode.push(row);
                p50
            }
            Err(e) => {
                // Kept in the report, and the run goes on: the other batches' figures still count.
                eprintln!("bench: decode batch {b}: {e:#}");
                failures += 1;
                decode.push(json!({"batch": b, "context": a.decode_context, "error": format!("{e:#}")}));
                f64::NAN
            }
        };

        // The decode steps' share of the step breakdown (DEEPINFER_PROFILE=1), per step; what the
        // inter-token latency has beyond their sum is spent outside the forward (sampling, the
        // scheduler, streaming).
        let p1 = main.model().profile();
        let delta = |k: &str, sec: f64, n: u64| {
            let (s0, n0) = p0.iter().find(|x| x.0 == k).map_or((0.0, 0), |x| (x.1, x.2));
            (sec - s0, n - n0)
        };
        let steps =
            p1.iter().find(|x| x.0.starts_with("decode: host")).map_or(0, |(k, sec, n)| delta(k, *sec, *n).1).max(1);
        let secs: Vec<Value> = p1
            .iter()
            .filter(|x| x.0.starts_with("decode: "))
            .map(|(k, sec, n)| {
                let (ds, dn) = delta(k, *sec, *n);
                json!({"section": &k["decode: ".len()..], "ms_per_step": ds * 1e3 / steps as f64, "times_per_step": dn as f64 / steps as f64})
            })
            .collect();
        if !secs.is_empty() {
            let forward: f64 = secs.iter().map(|x| x["ms_per_step"].as_f64().unwrap_or(0.0)).sum();
            profiles.push(json!({"batch": b, "decode_steps": steps, "forward_ms_per_step": forward,
                                 "itl_p50_ms": itl_p50 * 1e3, "sections": secs}));
        }
        step += 1;
        bar.set(step, &format!("decode batch {b}"));
    }
    let report: Value = json!({
        "device": main.model().device_label(),
        "threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "model": {"dir": loaded.dir.display().to_string(), "builtin": format!("{:?}", loaded.builtin).to_lowercase(), "layers": layers,
                  "hidden": cfg.hidden_size, "vocab": vocab, "window": cfg.sliding_window,
                  "block_tokens": base.block_tokens, "exact_replay_tokens": main.model().exact_replay_tokens()},
        "prefill": prefill,
        "prefill_cached": cached,
        "decode": decode,
        // DEEPINFER_PROFILE=1: ms per decode step in each forward section, each closed by a sync.
        "decode_profile": profiles,
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(p) = &a.out {
        std::fs::File::create(p)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(if failures > 0 { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}
