//! Shared by the engine commands: the model directory (given, or the built-in tiny model), loading
//! it with a progress bar, the tokenizer, and the engine configuration from flags and DeepInfer's
//! environment variables.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use deepinfer_engine::engine::KvDirConfig;
use std::sync::Arc;

use deepinfer_engine::checkpoint::Checkpoint;
use deepinfer_engine::device_model::{checkpoint_bytes, DeviceKvConfig, DeviceModel};
use deepinfer_engine::{tiny, Engine, EngineConfig, ForwardModel, Model, ModelConfig, Numerics};
use deepinfer_kernels_ffi::Device;
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
    /// cpu (the reference model), or cuda / cuda:N (the device model on that GPU; it runs
    /// checkpoints in the official formats, FP8 attention and FP4 or FP8 experts, with V4's
    /// attention geometry).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Fraction of the GPU's memory the weights and the cache may take (the cache gets what the
    /// weights leave; the longest context shrinks to fit when it would not).
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
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
    /// Speculative decoding: MTP drafts verified per decode step (0: off). Lossless: outputs equal
    /// those without it, greedy and seeded. Overrides DEEPINFER_USE_NEXTN_DECODE.
    #[arg(long)]
    pub speculative_tokens: Option<usize>,
}

/// The trained tiny model shipped in the repository (`models/deepinfer-tiny-v4`, made by
/// tools/tiny-model), found when the binary runs from its checkout.
pub fn shipped_model() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/deepinfer-tiny-v4");
    deepinfer_engine::checkpoint::file_or_gz(&dir, "model.safetensors")
        .is_file()
        .then(|| dir.canonicalize().unwrap_or(dir))
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

/// The GPU of `--device` (None for cpu), with a one-line error where it cannot be used.
fn gpu_of(a: &EngineArgs) -> Result<Option<Device>> {
    if a.device == "cpu" {
        return Ok(None);
    }
    if a.device != "cuda" && !a.device.starts_with("cuda:") {
        bail!("--device: `{}` is not cpu, cuda or cuda:N", a.device);
    }
    if !(a.gpu_memory_utilization > 0.0 && a.gpu_memory_utilization <= 1.0) {
        bail!("--gpu-memory-utilization: {} is not in (0, 1]", a.gpu_memory_utilization);
    }
    Device::parse(&a.device).map(Some).map_err(|e| anyhow::anyhow!("--device {}: {e}", a.device))
}

/// The device model on `gpu` with a cache sized from its free memory.
fn load_device_model(
    a: &EngineArgs,
    dir: &std::path::Path,
    gpu: &Device,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(DeviceModel, usize)> {
    let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
    let ck = Checkpoint::open_dir(dir)?;
    let weights = checkpoint_bytes(&ck);
    let (free, total) = gpu.memory_info()?.unwrap_or((usize::MAX / 4, usize::MAX / 4));
    let allowed = (total as f64 * a.gpu_memory_utilization) as usize;
    let used = total.saturating_sub(free);
    let budget = allowed.saturating_sub(used).saturating_sub(weights);
    if budget == 0 {
        bail!(
            "--device {}: the weights need {:.2} GiB, {:.2} GiB of the {:.2} GiB allowed are free",
            a.device,
            weights as f64 / (1u64 << 30) as f64,
            allowed.saturating_sub(used) as f64 / (1u64 << 30) as f64,
            allowed as f64 / (1u64 << 30) as f64
        );
    }
    let want = DeviceKvConfig { slots: a.max_running, max_len: a.max_context, max_chunk: a.token_budget };
    let kvc = want.fit(&cfg, budget)?;
    if kvc.max_len < want.max_len {
        eprintln!(
            "--device {}: the longest context is {} tokens (not {}) so that {} sequences' caches fit {:.2} GiB",
            a.device,
            kvc.max_len,
            want.max_len,
            kvc.slots,
            budget as f64 / (1u64 << 30) as f64
        );
    }
    let m = DeviceModel::from_checkpoint(cfg, &ck, gpu, kvc, Numerics::Official, progress)?;
    eprintln!(
        "{}: {:.2} GiB of weights, {:.2} GiB of cache ({} sequences x {} tokens)",
        a.device,
        m.weight_bytes() as f64 / (1u64 << 30) as f64,
        kvc.cache_bytes(m.config()) as f64 / (1u64 << 30) as f64,
        kvc.slots,
        kvc.max_len
    );
    Ok((m, kvc.max_len))
}

/// The model directory's `tokenizer.json`, else the built-in DeepSeek V4 tokenizer.
pub fn tokenizer_for(dir: &std::path::Path) -> Result<DeepseekTokenizer> {
    Ok(match dir.join("tokenizer.json") {
        p if p.is_file() => DeepseekTokenizer::from_file(&p)?,
        _ => DeepseekTokenizer::builtin()?,
    })
}

pub fn load(a: &EngineArgs) -> Result<Loaded> {
    let gpu = gpu_of(a)?;
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
    let mut progress = |done, total| {
        bar.set_total(total);
        bar.set(done, "layers");
    };
    let (model, max_context): (Arc<dyn ForwardModel>, usize) = match &gpu {
        None => (
            Arc::new(
                Model::load_with_progress(&dir, &mut progress).with_context(|| format!("loading {}", dir.display()))?,
            ),
            a.max_context,
        ),
        Some(g) => {
            let (m, max_len) =
                load_device_model(a, &dir, g, &mut progress).with_context(|| format!("loading {}", dir.display()))?;
            (Arc::new(m), max_len)
        }
    };
    let tok = tokenizer_for(&dir)?;
    let mut cfg = EngineConfig {
        token_budget: a.token_budget,
        max_running: a.max_running,
        max_context,
        kv_dir: a.kv_dir.as_ref().map(|d| KvDirConfig {
            dir: d.clone(),
            capacity_bytes: 64 << 30,
            host_bytes: 1 << 30,
        }),
        ..Default::default()
    }
    .with_env(model.config().sliding_window)?;
    if let Some(k) = a.speculative_tokens {
        cfg.speculative_tokens = k;
    }
    if gpu.is_some() {
        // The device cache holds every slot's whole context: the scheduler may fill it (its
        // default of 4096 blocks preempted 256 sequences of 4.6k tokens that the GPU had room for).
        cfg.kv_blocks = a.max_running * max_context.div_ceil(model.block_tokens_at_least(cfg.block_tokens));
    }
    let engine = Engine::with_model(model, cfg)?.with_tokenizer(tok.clone())?;
    eprintln!("loaded {} in {:.2}s{}", dir.display(), t0.elapsed().as_secs_f64(), builtin.note());
    Ok(Loaded { engine, tok, builtin, dir })
}
