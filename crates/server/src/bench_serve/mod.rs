//! `deepinfer bench-serve`: a serving benchmark client in the manner of vLLM's `bench serve`. It
//! sends streaming `/v1/completions` requests with token-id prompts (exact lengths, `ignore_eos`,
//! greedy by default) to any OpenAI-compatible server, with arrivals from a trace's timestamps, a
//! Poisson process or all at once, and reports TTFT, ITL, TPOT and end-to-end latency p50/p99,
//! throughput and goodput under SLOs, plus a ledger (every request accounted for once: completed,
//! rejected with 429, failed, dropped) and the server's KV usage before and after from /metrics.
//!
//! Traces: Mooncake JSONL (its chained 512-token block ids become shared prompt prefixes: equal
//! ids, equal tokens) or Azure CSV (no prefix data: every prompt is distinct). `--token-scale`
//! shrinks lengths and blocks together so a trace fits a small model.

mod http;

use std::collections::{BTreeMap, HashSet};
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use deepinfer_engine::tiny::Rng;
use deepinfer_scheduler::sim::load_trace;
use deepinfer_scheduler::sim::Percentiles;
use serde_json::{json, Value};

use crate::progress::Progress;
use http::{Endpoint, Request, SseLines};

#[derive(clap::Args)]
pub struct Args {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// Model name to send (default: the first one GET /v1/models lists).
    #[arg(long)]
    model: Option<String>,
    /// Sent as `Authorization: Bearer KEY`. Also DEEPINFER_API_KEY.
    #[arg(long)]
    api_key: Option<String>,
    /// Trace to replay: Mooncake .jsonl or Azure .csv (either optionally .gz). Without one:
    /// --num-requests requests of --input-len and --output-len tokens.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Requests to send (the trace's first N).
    #[arg(long, default_value_t = 100)]
    num_requests: usize,
    #[arg(long, default_value_t = 256)]
    input_len: usize,
    #[arg(long, default_value_t = 64)]
    output_len: usize,
    /// Multiply a trace's token counts (and its 512-token prefix blocks) by this.
    #[arg(long, default_value_t = 1.0)]
    token_scale: f64,
    /// Caps after scaling.
    #[arg(long)]
    max_input_len: Option<usize>,
    #[arg(long)]
    max_output_len: Option<usize>,
    /// Arrivals: `inf` (all at once), `trace` (the trace's timestamps divided by --time-scale), or
    /// a rate in requests/s (Poisson).
    #[arg(long, default_value = "inf")]
    rate: String,
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Most requests in flight at once (default: no limit).
    #[arg(long)]
    max_concurrency: Option<usize>,
    /// SLOs for goodput: time to first token and time per output token, milliseconds.
    #[arg(long, default_value_t = 2000.0)]
    slo_ttft_ms: f64,
    #[arg(long, default_value_t = 100.0)]
    slo_tpot_ms: f64,
    /// Close each stream after this many text chunks, as clients that go away do.
    #[arg(long)]
    drop_after: Option<usize>,
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Token ids the prompts are drawn from (LO..HI, below the model's vocabulary).
    #[arg(long, default_value = "100..4000")]
    token_range: String,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Give up on one request after this many seconds (it counts as failed).
    #[arg(long, default_value_t = 600.0)]
    timeout: f64,
    /// Also write the JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One request to send: when (seconds after the start), its prompt and its output length.
#[derive(Debug, Clone)]
struct Planned {
    arrival: f64,
    prompt: Vec<u32>,
    output: usize,
}

/// What happened to one request. Times are seconds after the benchmark's start.
#[derive(Debug, Default)]
struct Outcome {
    /// HTTP status; 0 when no response came (connection refused, timeout).
    status: u16,
    error: Option<String>,
    start: f64,
    end: f64,
    /// Arrival of each chunk that carried text.
    chunks: Vec<f64>,
    usage_tokens: Option<usize>,
    cached_tokens: usize,
    id: Option<String>,
    dropped: bool,
    done: bool,
}

impl Outcome {
    /// Time per output token after the first (None for a single token).
    fn tpot(&self) -> Option<f64> {
        let n = self.usage_tokens.unwrap_or(self.chunks.len());
        let first = self.chunks.first().copied().unwrap_or(self.end);
        (n > 1).then(|| (self.end - first) / (n - 1) as f64)
    }
}

fn token_range(s: &str) -> Result<(u64, u64)> {
    let (lo, hi) = s.split_once("..").context("--token-range: expected LO..HI")?;
    let (lo, hi): (u64, u64) = (lo.trim().parse()?, hi.trim().parse()?);
    if lo >= hi {
        bail!("--token-range {s}: LO must be below HI");
    }
    Ok((lo, hi))
}

fn tokens(rng: &mut Rng, n: usize, (lo, hi): (u64, u64)) -> Vec<u32> {
    (0..n).map(|_| (lo + rng.below(hi - lo)) as u32).collect()
}

/// The requests of a run, in arrival order.
fn plan(a: &Args) -> Result<Vec<Planned>> {
    let range = token_range(&a.token_range)?;
    if !(a.token_scale > 0.0 && a.time_scale > 0.0) {
        bail!("--token-scale and --time-scale must be positive");
    }
    let scale = |n: usize, cap: Option<usize>| {
        ((n as f64 * a.token_scale).round() as usize).clamp(1, cap.unwrap_or(usize::MAX))
    };
    let mut rng = Rng(a.seed ^ 0x5EED_BE4C);
    let mut out = Vec::new();
    match &a.trace {
        Some(path) => {
            let reqs = load_trace(path).with_context(|| format!("--trace {}", path.display()))?;
            let block = ((512.0 * a.token_scale).round() as usize).max(1);
            for (i, r) in reqs.into_iter().take(a.num_requests).enumerate() {
                let input = scale(r.input, a.max_input_len);
                let mut prompt = Vec::with_capacity(input + block);
                for h in &r.hash_ids {
                    if prompt.len() >= input {
                        break;
                    }
                    // Equal block ids (a shared prefix in the trace) give equal tokens.
                    let mut b = Rng(a.seed ^ h.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xB10C);
                    prompt.extend(tokens(&mut b, block, range));
                }
                let mut own = Rng(a.seed ^ (i as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03));
                let fill = input.saturating_sub(prompt.len());
                prompt.extend(tokens(&mut own, fill, range));
                prompt.truncate(input);
                out.push(Planned { arrival: r.arrival, prompt, output: scale(r.output, a.max_output_len) });
            }
        }
        None => {
            for _ in 0..a.num_requests {
                out.push(Planned {
                    arrival: 0.0,
                    prompt: tokens(&mut rng, a.input_len.max(1), range),
                    output: a.output_len.max(1),
                });
            }
        }
    }
    match a.rate.as_str() {
        "inf" => out.iter_mut().for_each(|p| p.arrival = 0.0),
        "trace" if a.trace.is_some() => out.iter_mut().for_each(|p| p.arrival /= a.time_scale),
        "trace" => bail!("--rate trace needs --trace"),
        r => {
            let rate: f64 = r.parse().ok().filter(|x: &f64| *x > 0.0 && x.is_finite()).with_context(|| {
                format!("--rate {r}: expected inf, trace or a positive number of requests per second")
            })?;
            let mut t = 0.0;
            for p in out.iter_mut() {
                p.arrival = t;
                let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                t += -(1.0 - u).ln() / rate;
            }
        }
    }
    Ok(out)
}

/// The server's metrics (name without labels -> value; the last sample of a name wins).
async fn scrape(ep: &Endpoint, headers: &[(String, String)]) -> Result<BTreeMap<String, f64>> {
    let (status, body) = http::fetch(ep, &Request { method: "GET", path: "/metrics", headers, body: b"" }).await?;
    if status != 200 {
        bail!("GET /metrics: status {status}");
    }
    let mut m = BTreeMap::new();
    for line in String::from_utf8_lossy(&body).lines().filter(|l| !l.starts_with('#')) {
        let Some((key, value)) = line.rsplit_once(' ') else { continue };
        let name = key.split('{').next().unwrap_or(key).to_string();
        if let Ok(v) = value.parse::<f64>() {
            m.insert(name, v);
        }
    }
    Ok(m)
}

async fn first_model(ep: &Endpoint, headers: &[(String, String)]) -> Result<String> {
    let (status, body) = http::fetch(ep, &Request { method: "GET", path: "/v1/models", headers, body: b"" })
        .await
        .with_context(|| format!("is a server listening at {}?", ep.addr))?;
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    match (status, v.pointer("/data/0/id").and_then(Value::as_str)) {
        (200, Some(id)) => Ok(id.to_string()),
        _ => bail!("GET /v1/models: status {status}, no model listed (pass --model)"),
    }
}

/// Send one request and follow its stream.
async fn one(
    ep: &Endpoint,
    headers: &[(String, String)],
    body: Vec<u8>,
    t0: Instant,
    drop_after: Option<usize>,
) -> Outcome {
    let mut o = Outcome { start: t0.elapsed().as_secs_f64(), ..Default::default() };
    let mut sse = SseLines::default();
    let mut raw = Vec::new();
    let res = http::send(ep, &Request { method: "POST", path: "/v1/completions", headers, body: &body }, |bytes| {
        if raw.len() < 4096 {
            raw.extend_from_slice(&bytes[..bytes.len().min(4096)]);
        }
        sse.feed(bytes, |data| {
            if data == "[DONE]" {
                o.done = true;
                return ControlFlow::Continue(());
            }
            let Ok(v) = serde_json::from_str::<Value>(data) else { return ControlFlow::Continue(()) };
            if let Some(e) = v.get("error") {
                o.error = Some(e.to_string());
            }
            if o.id.is_none() {
                o.id = v.get("id").and_then(Value::as_str).map(String::from);
            }
            if v.pointer("/choices/0/text").and_then(Value::as_str).is_some_and(|t| !t.is_empty()) {
                o.chunks.push(t0.elapsed().as_secs_f64());
                if drop_after.is_some_and(|n| o.chunks.len() >= n) {
                    o.dropped = true;
                    return ControlFlow::Break(());
                }
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                o.usage_tokens = u.get("completion_tokens").and_then(Value::as_u64).map(|n| n as usize);
                o.cached_tokens =
                    u.pointer("/prompt_tokens_details/cached_tokens").and_then(Value::as_u64).unwrap_or(0) as usize;
            }
            ControlFlow::Continue(())
        })
    })
    .await;
    o.end = t0.elapsed().as_secs_f64();
    match res {
        Ok(s) => {
            o.status = s;
            if s != 200 && o.error.is_none() {
                o.error = Some(String::from_utf8_lossy(&raw[..raw.len().min(300)]).into_owned());
            }
        }
        Err(e) => o.error = Some(format!("{e:#}")),
    }
    o
}

fn ms(p: Percentiles) -> Value {
    json!({"p50": p.p50 * 1e3, "p90": p.p90 * 1e3, "p99": p.p99 * 1e3, "mean": p.mean * 1e3})
}

/// The report of a finished run.
fn report(a: &Args, plan: &[Planned], outs: &[Outcome], lost: usize) -> Value {
    let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
    for o in outs {
        *statuses.entry(o.status.to_string()).or_default() += 1;
    }
    let ok: Vec<(usize, &Outcome)> =
        outs.iter().enumerate().filter(|(_, o)| o.status == 200 && o.done && o.error.is_none() && !o.dropped).collect();
    let dropped = outs.iter().filter(|o| o.dropped).count();
    let rejected = outs.iter().filter(|o| o.status == 429).count();
    let failed = outs.len() - ok.len() - dropped - rejected;
    let mismatched = ok.iter().filter(|(i, o)| o.usage_tokens != Some(plan[*i].output)).count();
    let ids: Vec<&String> = outs.iter().filter_map(|o| o.id.as_ref()).collect();
    let duplicate_ids = ids.len() - ids.iter().collect::<HashSet<_>>().len();
    let duration = outs.iter().map(|o| o.end).fold(0.0, f64::max).max(1e-9);
    let out_tokens: usize = ok.iter().map(|(_, o)| o.usage_tokens.unwrap_or(o.chunks.len())).sum();
    let in_tokens: usize = ok.iter().map(|(i, _)| plan[*i].prompt.len()).sum();
    let cached: usize = ok.iter().map(|(_, o)| o.cached_tokens).sum();
    let ttft: Vec<f64> = ok.iter().filter_map(|(_, o)| o.chunks.first().map(|f| f - o.start)).collect();
    let tpot: Vec<f64> = ok.iter().filter_map(|(_, o)| o.tpot()).collect();
    let itl: Vec<f64> = ok.iter().flat_map(|(_, o)| o.chunks.windows(2).map(|w| w[1] - w[0])).collect();
    let e2e: Vec<f64> = ok.iter().map(|(_, o)| o.end - o.start).collect();
    let good = ok
        .iter()
        .filter(|(_, o)| {
            let first = o.chunks.first().copied().unwrap_or(o.end);
            (first - o.start) * 1e3 <= a.slo_ttft_ms && o.tpot().unwrap_or(0.0) * 1e3 <= a.slo_tpot_ms
        })
        .count();
    // Steady decode, as in-process `bench` measures it: the window from the last request's first
    // chunk to the first request's end, where every request decodes (0 when there is none).
    let last_first = ok.iter().filter_map(|(_, o)| o.chunks.first().copied()).fold(0.0, f64::max);
    let first_end = ok.iter().map(|(_, o)| o.end).fold(f64::INFINITY, f64::min);
    let in_window: usize =
        ok.iter().map(|(_, o)| o.chunks.iter().filter(|t| **t > last_first && **t <= first_end).count()).sum();
    let steady = if first_end > last_first { in_window as f64 / (first_end - last_first) } else { 0.0 };
    let errors: Vec<&String> = outs.iter().filter_map(|o| o.error.as_ref()).take(5).collect();
    json!({
        "requests": plan.len(),
        "completed": ok.len(),
        "rejected_429": rejected,
        "dropped": dropped,
        "failed": failed,
        "lost": lost,
        "statuses": statuses,
        "token_count_mismatches": mismatched,
        "duplicate_ids": duplicate_ids,
        "first_errors": errors,
        "duration_s": duration,
        "request_throughput": ok.len() as f64 / duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "cached_prompt_tokens": cached,
        "prefix_hit_rate": if in_tokens > 0 { cached as f64 / in_tokens as f64 } else { 0.0 },
        "output_tokens_per_s": out_tokens as f64 / duration,
        "total_tokens_per_s": (in_tokens + out_tokens) as f64 / duration,
        "steady_decode_chunks_per_s": steady,
        "ttft_ms": ms(Percentiles::of(ttft)),
        "tpot_ms": ms(Percentiles::of(tpot)),
        "itl_ms": ms(Percentiles::of(itl)),
        "e2e_ms": ms(Percentiles::of(e2e)),
        "goodput": {"slo_ttft_ms": a.slo_ttft_ms, "slo_tpot_ms": a.slo_tpot_ms,
                    "requests_per_s": good as f64 / duration, "fraction": good as f64 / plan.len().max(1) as f64},
    })
}

pub fn run(a: Args) -> Result<ExitCode> {
    let ep = Endpoint::parse(&a.url)?;
    let plan = plan(&a)?;
    if plan.is_empty() {
        bail!("no requests to send (--num-requests 0, or an empty trace)");
    }
    let key = a.api_key.clone().or_else(|| std::env::var("DEEPINFER_API_KEY").ok().filter(|k| !k.is_empty()));
    let headers: Vec<(String, String)> =
        key.map(|k| ("Authorization".to_string(), format!("Bearer {k}"))).into_iter().collect();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let report = rt.block_on(async {
        let model = match &a.model {
            Some(m) => m.clone(),
            None => first_model(&ep, &headers).await?,
        };
        let before = scrape(&ep, &headers).await.ok();
        let (ep, headers) = (Arc::new(ep.clone()), Arc::new(headers.clone()));
        let limit = Arc::new(tokio::sync::Semaphore::new(a.max_concurrency.unwrap_or(plan.len()).max(1)));
        let timeout = Duration::from_secs_f64(a.timeout.max(0.001));
        let t0 = Instant::now();
        let tasks: Vec<_> = plan
            .iter()
            .map(|p| {
                let body = serde_json::to_vec(&json!({
                    "model": model, "prompt": p.prompt, "max_tokens": p.output, "stream": true,
                    "stream_options": {"include_usage": true}, "ignore_eos": true, "temperature": a.temperature,
                }))
                .expect("a JSON body");
                let (ep, headers, limit, arrival, drop_after) =
                    (ep.clone(), headers.clone(), limit.clone(), p.arrival, a.drop_after);
                tokio::spawn(async move {
                    tokio::time::sleep_until((t0 + Duration::from_secs_f64(arrival)).into()).await;
                    let _permit = limit.acquire_owned().await;
                    let start = t0.elapsed().as_secs_f64();
                    match tokio::time::timeout(timeout, one(&ep, &headers, body, t0, drop_after)).await {
                        Ok(o) => o,
                        Err(_) => Outcome {
                            start,
                            end: t0.elapsed().as_secs_f64(),
                            error: Some("timed out".into()),
                            ..Default::default()
                        },
                    }
                })
            })
            .collect();
        let mut bar = Progress::new("bench-serve", tasks.len());
        let (mut outs, mut lost) = (Vec::new(), 0);
        for (i, t) in tasks.into_iter().enumerate() {
            match t.await {
                Ok(o) => outs.push(o),
                Err(_) => {
                    lost += 1;
                    outs.push(Outcome { error: Some("the client task failed".into()), ..Default::default() });
                }
            }
            bar.set(i + 1, "requests");
        }
        // The server settles (dropped streams are cancelled), then its KV usage is read again.
        let mut after = None;
        let settle = Instant::now();
        while settle.elapsed() < Duration::from_secs(30) {
            match scrape(&ep, &headers).await {
                Ok(m)
                    if m.get("vllm:num_requests_running").copied().unwrap_or(0.0) == 0.0
                        && m.get("vllm:num_requests_waiting").copied().unwrap_or(0.0) == 0.0 =>
                {
                    after = Some(m);
                    break;
                }
                Ok(m) => after = Some(m),
                Err(_) => break,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut r = report(&a, &plan, &outs, lost);
        let kv =
            |m: &Option<BTreeMap<String, f64>>| m.as_ref().and_then(|m| m.get("vllm:kv_cache_usage_perc").copied());
        r["url"] = json!(a.url);
        r["model"] = json!(model);
        r["arrivals"] = json!(a.rate);
        r["max_concurrency"] = json!(a.max_concurrency);
        r["kv_cache_usage_before"] = json!(kv(&before));
        r["kv_cache_usage_after"] = json!(kv(&after));
        r["running_after"] = json!(after.as_ref().and_then(|m| m.get("vllm:num_requests_running").copied()));
        anyhow::Ok(r)
    })?;
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(p) = &a.out {
        std::fs::write(p, &text).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: Args,
    }

    fn args(extra: &[&str]) -> Args {
        Cli::parse_from(std::iter::once("bench-serve").chain(extra.iter().copied())).a
    }

    #[test]
    fn poisson_arrivals_have_the_asked_mean_rate() {
        let p = plan(&args(&["--num-requests", "4000", "--input-len", "4", "--rate", "20"])).unwrap();
        let span = p.last().unwrap().arrival;
        let rate = (p.len() - 1) as f64 / span;
        assert!((rate - 20.0).abs() < 1.5, "rate {rate}");
        assert!(p.windows(2).all(|w| w[0].arrival <= w[1].arrival));
    }

    #[test]
    fn equal_trace_blocks_give_equal_prompt_prefixes() {
        let dir = std::env::temp_dir().join(format!("bench-serve-plan-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("t.jsonl");
        std::fs::write(
            &f,
            "{\"timestamp\": 0, \"input_length\": 1100, \"output_length\": 10, \"hash_ids\": [0, 1, 2]}\n\
             {\"timestamp\": 500, \"input_length\": 1500, \"output_length\": 20, \"hash_ids\": [0, 1, 3]}\n",
        )
        .unwrap();
        let t = f.to_str().unwrap();
        let p = plan(&args(&["--trace", t, "--token-scale", "0.25", "--rate", "trace", "--time-scale", "2"])).unwrap();
        assert_eq!((p[0].prompt.len(), p[1].prompt.len()), (275, 375));
        assert_eq!((p[0].output, p[1].output), (3, 5));
        assert_eq!(p[0].prompt[..256], p[1].prompt[..256], "blocks 0 and 1 (128 tokens each) are shared");
        assert_ne!(p[0].prompt[256..], p[1].prompt[256..275]);
        assert_eq!((p[0].arrival, p[1].arrival), (0.0, 0.25));
        assert!(p.iter().flat_map(|r| &r.prompt).all(|&t| (100..4000).contains(&t)));
        let e = plan(&args(&["--rate", "trace"])).unwrap_err().to_string();
        assert!(e.contains("--trace"), "{e}");
        let e = plan(&args(&["--rate=-3"])).unwrap_err().to_string();
        assert!(e.contains("--rate -3"), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_report_accounts_for_every_request_and_measures_decode_where_all_decode() {
        let planned = |output| Planned { arrival: 0.0, prompt: vec![1; 8], output };
        let plan = vec![planned(4), planned(4), planned(4), planned(4)];
        let done = |chunks: Vec<f64>, end, id: &str| Outcome {
            status: 200,
            start: 0.0,
            end,
            usage_tokens: Some(chunks.len()),
            chunks,
            id: Some(id.into()),
            done: true,
            ..Default::default()
        };
        let outs = vec![
            // First chunks at 1.0 and 2.0; the first request ends at 4.0: the window is (2, 4].
            done(vec![1.0, 2.5, 3.0, 4.0], 4.0, "a"),
            done(vec![2.0, 3.0, 4.0, 5.0], 5.0, "b"),
            Outcome { status: 429, end: 0.1, ..Default::default() },
            done(vec![0.5, 0.6, 0.7], 0.8, "a"),
        ];
        let r = report(&args(&[]), &plan, &outs, 0);
        assert_eq!(r["completed"], 3);
        assert_eq!(r["rejected_429"], 1);
        assert_eq!(r["failed"], 0);
        assert_eq!(r["token_count_mismatches"], 1, "the fourth request got 3 of its 4 tokens");
        assert_eq!(r["duplicate_ids"], 1);
        assert_eq!(r["output_tokens"], 11);
        // The third request ended before the second began decoding: no window where all decode.
        assert_eq!(r["steady_decode_chunks_per_s"], 0.0);
        let r = report(&args(&[]), &plan[..2], &outs[..2], 0);
        // Chunks in (2, 4]: 2.5, 3.0, 4.0 of the first, 3.0, 4.0 of the second: 5 in 2 s.
        assert_eq!(r["steady_decode_chunks_per_s"], 2.5);
    }
}
