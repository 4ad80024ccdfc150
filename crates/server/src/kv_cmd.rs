//! `deepinfer kv ...`: the KV system from the command line.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use deepinfer_kv::trace::{load_trace_file, replay};
use deepinfer_kv::EvictionPolicy;

#[derive(clap::Subcommand)]
pub enum KvCommand {
    /// Replay a Mooncake-format trace through the prefix cache; prints the prefix hit rate as JSON.
    Replay(ReplayArgs),
}

#[derive(clap::Args)]
pub struct ReplayArgs {
    /// JSONL trace: one {"timestamp", "input_length", "output_length", "hash_ids"} per line.
    #[arg(long)]
    trace: PathBuf,
    /// Cache capacity in blocks (default: unlimited).
    #[arg(long)]
    capacity_blocks: Option<usize>,
    /// Tokens per block (the trace's hash granularity).
    #[arg(long, default_value_t = 512)]
    block_tokens: usize,
    /// Eviction: tail-first (default) or lru (naive block LRU, for comparison).
    #[arg(long, default_value = "tail-first")]
    eviction: String,
}

pub fn run(cmd: KvCommand) -> Result<ExitCode> {
    match cmd {
        KvCommand::Replay(a) => {
            let policy = match a.eviction.as_str() {
                "tail-first" => EvictionPolicy::TailFirst,
                "lru" => EvictionPolicy::Lru,
                other => anyhow::bail!("--eviction: `{other}` is not tail-first or lru"),
            };
            anyhow::ensure!(a.block_tokens > 0, "--block-tokens must be positive");
            anyhow::ensure!(a.capacity_blocks != Some(0), "--capacity-blocks must be positive");
            let reqs = load_trace_file(&a.trace).with_context(|| format!("reading {}", a.trace.display()))?;
            let report = replay(&reqs, a.capacity_blocks, a.block_tokens, policy);
            println!("{}", serde_json::to_string(&report)?);
            Ok(ExitCode::SUCCESS)
        }
    }
}
