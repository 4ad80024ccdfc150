//! `deepinfer simulate`: replay a serving trace against N prefill and M decode replicas.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use deepinfer_scheduler::sim::{load_trace, simulate, SimConfig};
use deepinfer_scheduler::Policy;

#[derive(clap::Args)]
pub struct Args {
    /// Mooncake JSONL (with block hashes) or Azure CSV trace.
    #[arg(long)]
    trace: PathBuf,
    /// Prefill replicas (with --colocated: replicas that do both, together with --decode).
    #[arg(long, default_value_t = 1)]
    prefill: usize,
    /// Decode replicas.
    #[arg(long, default_value_t = 1)]
    decode: usize,
    /// Routing policy: ours (default), least-loaded, round-robin, cache-affinity.
    #[arg(long, default_value = "ours")]
    policy: String,
    /// Every replica prefills and decodes (prefill + decode replicas in total).
    #[arg(long)]
    colocated: bool,
    /// Shared prefix-cache capacity in 512-token blocks: a number, `unlimited` (default) or 0.
    #[arg(long, default_value = "unlimited")]
    prefix_cache_blocks: String,
    /// Multiply the trace's request rate.
    #[arg(long, default_value_t = 1.0)]
    rate_scale: f64,
    /// Only the first N requests.
    #[arg(long)]
    max_requests: Option<usize>,
    /// H200 GPUs per replica (experts sharded across them).
    #[arg(long, default_value_t = 8)]
    gpus_per_replica: usize,
}

pub fn run(a: Args) -> Result<ExitCode> {
    anyhow::ensure!(a.prefill + a.decode > 0, "--prefill and --decode: at least one replica");
    anyhow::ensure!(
        a.colocated || (a.prefill > 0 && a.decode > 0),
        "--prefill/--decode: disaggregated serving needs both (or --colocated)"
    );
    anyhow::ensure!(a.rate_scale > 0.0 && a.rate_scale.is_finite(), "--rate-scale must be positive");
    anyhow::ensure!(a.gpus_per_replica > 0, "--gpus-per-replica must be positive");
    let policy: Policy = a.policy.parse().map_err(|e: String| anyhow::anyhow!("--policy: {e}"))?;
    let cache = match a.prefix_cache_blocks.as_str() {
        "unlimited" => None,
        n => Some(
            n.parse::<usize>()
                .with_context(|| format!("--prefix-cache-blocks: `{n}` is not a number or `unlimited`"))?,
        ),
    };
    let mut reqs = load_trace(&a.trace).with_context(|| format!("reading {}", a.trace.display()))?;
    if let Some(n) = a.max_requests {
        reqs.truncate(n);
    }
    let cfg = SimConfig {
        prefill: a.prefill,
        decode: a.decode,
        colocated: a.colocated,
        policy,
        prefix_cache_blocks: cache,
        rate_scale: a.rate_scale,
        rates: deepinfer_scheduler::DeviceRates::h200_node(a.gpus_per_replica),
        ..SimConfig::default()
    };
    let report = simulate(&reqs, &cfg);
    println!("{}", serde_json::to_string(&report)?);
    Ok(ExitCode::SUCCESS)
}
