//! `deepinfer random-model`: a random-weight checkpoint of a DeepSeek-V4 shape in the official
//! formats (FP8 attention projections and shared expert with 128x128 block scales, FP4 routed
//! experts with 1x32 scales, bf16/f32 elsewhere), so GPU runs and benchmarks need no download.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use deepinfer_engine::tiny;

use crate::progress::Progress;

#[derive(clap::Args)]
pub struct Args {
    /// Directory to write (config.json and safetensors shards).
    #[arg(long)]
    out: PathBuf,
    /// v4-flash: DeepSeek-V4-Flash's layer shapes (hidden 4096, 64 heads of 512, 256 experts of
    /// 2048, vocabulary 129,280).
    #[arg(long, default_value = "v4-flash")]
    shape: String,
    /// Layers (the real model has 43; the first two are sliding, then CSA and HCA alternate).
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Routed experts per layer.
    #[arg(long, default_value_t = 256)]
    experts: usize,
    #[arg(long, default_value_t = 20261207)]
    seed: u64,
    /// Safetensors files to split the checkpoint into.
    #[arg(long, default_value_t = 4)]
    shards: usize,
}

pub fn run(a: Args) -> Result<ExitCode> {
    if a.shape != "v4-flash" {
        bail!("--shape: `{}` is not v4-flash", a.shape);
    }
    if !(1..=43).contains(&a.layers) {
        bail!("--layers: {} is not in 1..=43", a.layers);
    }
    if !(6..=512).contains(&a.experts) {
        bail!("--experts: {} is not in 6..=512 (6 are routed per token)", a.experts);
    }
    if a.shards == 0 {
        bail!("--shards: must be positive");
    }
    if a.out.join("config.json").exists() {
        bail!("--out {}: a checkpoint is already there", a.out.display());
    }
    let t0 = std::time::Instant::now();
    let c = tiny::v4_flash_config(a.layers, a.experts);
    let mut bar = Progress::new("experts", a.layers);
    tiny::write_random_official(&a.out, &c, a.seed, a.shards, &mut |done, _| bar.set(done, "layers"))
        .with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!(
        "wrote {} ({} layers, {} experts) in {:.0}s",
        a.out.display(),
        a.layers,
        a.experts,
        t0.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}
