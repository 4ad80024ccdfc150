//! Shared by the engine commands: the model directory (given, or the built-in tiny model), loading
//! it with a progress bar, the tokenizer, and the engine configuration from flags and DeepInfer's
//! environment variables.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use deepinfer_engine::engine::KvDirConfig;
use deepinfer_engine::{tiny, Engine, EngineConfig, Model};
use deepinfer_recipe::DeepseekTokenizer;

use crate::progress::Progress;

/// Flags every engine command takes.
#[derive(clap::Args, Clone)]
pub struct EngineArgs {
    /// Model directory (config.json, safetensors, optional tokenizer.json). Default: the trained
    /// tiny DeepSeek-V4 model shipped in the checkout (models/deepinfer-tiny-v4), or, for a binary
    /// moved away from its checkout, a random-weight model of the same shape.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// cpu, or cuda (refused for now: the kernels exist, the GPU model that runs them does not).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Keep published KV blocks in this directory too (prefix reuse across runs and processes).
    #[arg(long)]
    pub kv_dir: Option<PathBuf>,
    /// Most tokens a step computes.
    #[arg(long, default_value_t = 512)]
    pub token_budget: usize,
    /// Most requests running at once.
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Longest prompt + output.
    #[arg(long, default_value_t = 65536)]
    pub max_context: usize,
}

/// The trained tiny model shipped in the repository (`models/deepinfer-tiny-v4`, made by
/// tools/tiny-model), found when the binary runs from its checkout.
pub fn shipped_model() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/deepinfer-tiny-v4");
    dir.join("model.safetensors").is_file().then(|| dir.canonicalize().unwrap_or(dir))
}

/// What runs without `--model`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Builtin {
    /// `--model` was given.
    No,
    /// The shipped trained model.
    Trained,
    /// Random weights (the shipped model is not where this binary was built).
    Random,
}

pub fn builtin_model() -> Result<PathBuf> {
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

pub struct Loaded {
    pub engine: Engine,
    pub tok: DeepseekTokenizer,
    pub builtin: Builtin,
    pub dir: PathBuf,
}

impl Builtin {
    /// A note for the summary line.
    pub fn note(self) -> &'static str {
        match self {
            Builtin::No => "",
            Builtin::Trained => {
                " (built-in deepinfer-tiny-v4: 7.5M parameters trained on public-domain and permissively licensed text; \
                 expect short, simple answers)"
            }
            Builtin::Random => " (built-in random weights: the text is noise)",
        }
    }
}

pub fn load(a: &EngineArgs) -> Result<Loaded> {
    match a.device.as_str() {
        "cpu" => {}
        "cuda" => bail!(
            "--device cuda: the GPU model is not assembled yet (the CUDA kernels exist and pass parity; the forward that \
             drives them does not); use --device cpu"
        ),
        o => bail!("--device: `{o}` is not cpu or cuda"),
    }
    let t0 = Instant::now();
    let (dir, builtin) = match &a.model {
        Some(d) => {
            if !d.join("config.json").is_file() {
                bail!("--model {}: no config.json there (expected a Hugging Face checkpoint directory)", d.display());
            }
            (d.clone(), Builtin::No)
        }
        None => match shipped_model() {
            Some(d) => (d, Builtin::Trained),
            None => (builtin_model()?, Builtin::Random),
        },
    };
    let mut bar = Progress::new("loading", 1);
    let model = Model::load_with_progress(&dir, &mut |done, total| {
        bar.set_total(total);
        bar.set(done, "layers");
    })
    .with_context(|| format!("loading {}", dir.display()))?;
    let tok = match dir.join("tokenizer.json") {
        p if p.is_file() => DeepseekTokenizer::from_file(&p)?,
        _ => DeepseekTokenizer::builtin()?,
    };
    let cfg = EngineConfig {
        token_budget: a.token_budget,
        max_running: a.max_running,
        max_context: a.max_context,
        kv_dir: a.kv_dir.as_ref().map(|d| KvDirConfig {
            dir: d.clone(),
            capacity_bytes: 64 << 30,
            host_bytes: 1 << 30,
        }),
        ..Default::default()
    }
    .with_env(model.config().sliding_window)?;
    let engine = Engine::new(model, cfg)?.with_tokenizer(tok.clone())?;
    eprintln!("loaded {} in {:.2}s{}", dir.display(), t0.elapsed().as_secs_f64(), builtin.note());
    Ok(Loaded { engine, tok, builtin, dir })
}
