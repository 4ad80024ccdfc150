//! `deepinfer check-parity --model DIR`: the CPU model against a fixture's reference outputs.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use deepinfer_engine::{parity, Numerics};

#[derive(clap::Args)]
pub struct Args {
    /// Fixture directory: config.json, model.safetensors, reference.safetensors (make_tiny_v4.py).
    #[arg(long)]
    model: PathBuf,
    /// Prefill length of the cached run (default: meta.json's prefill_len, else half the tokens).
    #[arg(long)]
    prefill: Option<usize>,
    /// Apply the official runtime rounding (FP8 activations and KV, FP4 indexer); the fixtures come
    /// from transformers, which has none, so expect differences.
    #[arg(long)]
    official_rounding: bool,
}

pub fn run(a: Args) -> Result<ExitCode> {
    let numerics = if a.official_rounding { Numerics::Official } else { Numerics::Reference };
    let report = parity::check(&a.model, a.prefill, numerics)?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(if report.passed { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
