//! `deepinfer`: the command-line entry point. Each subcommand lives in its own module and only
//! parses arguments and prints; the work is in the library crates.

mod bench;
mod bench_serve;
mod bench_spec;
mod check_parity;
mod doctor;
mod generate;
mod kv_cmd;
mod random_model;
mod recipe_cmd;
mod serve;
mod simulate;

use std::process::ExitCode;

// The shared modules live in the library (src/lib.rs); `crate::setup` etc. resolve through these.
use deepinfer::{api_request, progress, setup};

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "deepinfer", version, about = "DeepSeek-V4 inference engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from prompts with the engine (--device cpu or cuda).
    Generate(generate::Args),
    /// Serve the engine over HTTP: OpenAI (chat/completions, completions, responses) and Anthropic
    /// (messages) APIs, /health and Prometheus /metrics.
    Serve(serve::Args),
    /// Prefill and decode throughput through the engine loop (docs/BENCH.md); prints JSON.
    Bench(bench::Args),
    /// Benchmark a running server over HTTP (trace, Poisson or burst arrivals): TTFT, ITL, TPOT,
    /// goodput, and every request accounted for; prints JSON.
    BenchServe(bench_serve::Args),
    /// How many MTP drafts greedy verification keeps, for fixed draft lengths (tokens per target
    /// forward; acceptance only, not speed); prints JSON.
    BenchSpec(bench_spec::Args),
    /// Report the build accelerator, embedded kernels, driver, GPUs and loaded CUDA libraries.
    Doctor,
    /// Compare the CPU model with a fixture's reference logits; prints JSON, exits 0 only within tolerance.
    CheckParity(check_parity::Args),
    /// The KV cache system (trace replay).
    #[command(subcommand)]
    Kv(kv_cmd::KvCommand),
    /// The API protocol layer (render a request, parse model output).
    #[command(subcommand)]
    Recipe(recipe_cmd::RecipeCommand),
    /// Replay a serving trace against prefill/decode replicas; prints TTFT/TPOT/goodput JSON.
    Simulate(simulate::Args),
    /// Write a random-weight checkpoint of a V4 shape in the official FP8/FP4 formats.
    RandomModel(random_model::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Doctor => doctor::run(),
        Command::Generate(a) => generate::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Bench(a) => bench::run(a),
        Command::BenchServe(a) => bench_serve::run(a),
        Command::BenchSpec(a) => bench_spec::run(a),
        Command::CheckParity(a) => check_parity::run(a),
        Command::Kv(c) => kv_cmd::run(c),
        Command::Simulate(a) => simulate::run(a),
        Command::RandomModel(a) => random_model::run(a),
        Command::Recipe(c) => recipe_cmd::run(c),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
