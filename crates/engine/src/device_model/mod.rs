//! The DeepSeek-V4 forward on a device (issue #37), written once against `kernels-ffi`'s op set so
//! the same code runs on the cpu backend (CI checks it against the reference [`crate::Model`]) and
//! on CUDA: embedding into the mHC streams, per layer the mHC site, attention (query and K=V
//! projections, sliding window over a per-sequence ring of K=V rows, the CSA compressor and
//! lightning indexer's top-k, the HCA compressor), the merge, the MoE sublayer
//! (`deepinfer_moe::layer`), and the head.
//!
//! Cache state lives in device pools, one set per layer, sized when the model loads for `slots`
//! sequences of up to `max_len` tokens (see [`DeviceKvConfig`]). Per slot and layer: a ring of
//! `window + max_chunk` K=V rows (a chunk of new tokens writes its rows before any of its queries
//! reads the window, so the ring holds the window of the chunk's first query too), then
//! `max_len / ratio` compressed rows; CSA layers add as many indexer keys; each compressor has a
//! state slot for its open window. A sequence holds a slot from [`DeviceModel::new_seq`] until its
//! [`DeviceSeq`] is dropped.
//!
//! Numerics ([`Numerics`]): every activation is stored as bf16 between ops (as the official
//! inference kernels do); `Official` adds the rounding of MODEL_V4.md §12 (FP8 activations inside
//! the FP8/FP4 GEMMs, the FP8 KV QAT, the Hadamard + FP4 indexer QAT). The CPU reference model
//! keeps f32 between ops; tests/device_model.rs argues the tolerances.

mod weights;

use std::path::Path;
use std::sync::Arc;

use deepinfer_kernels_ffi::attention::{attention_decode, DecodeAttnShape};
use deepinfer_kernels_ffi::compressor::{
    compress, pack_seqs, CompressSeq, CompressShape, CompressState, PoolShape, RowQat,
};
use deepinfer_kernels_ffi::hc::{embed_streams, hc_head, hc_post, hc_pre, HcShape};
use deepinfer_kernels_ffi::indexer::{indexer_decode, IndexerShape};
use deepinfer_kernels_ffi::moe::router_logits;
use deepinfer_kernels_ffi::ops::{rms_norm, rope};
use deepinfer_kernels_ffi::rows::{copy_2d, offset_rows, qat_rows, scatter_rows, RowQatKind};
use deepinfer_kernels_ffi::{Device, DeviceBuffer, RmsNormParams, RopeConfig, RopeParams, Stream, Yarn};
use deepinfer_moe::layer::{forward as moe_forward, MoeWorkspace};
use half::bf16;
use parking_lot::Mutex;

use crate::checkpoint::Checkpoint;
use crate::config::{AttentionKind, ModelConfig};
use crate::model::{LogitRows, ModelError, Numerics};
use weights::{Block, Loader, Weights};

/// How much cache state the device pools hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceKvConfig {
    /// Sequences that may hold state at once.
    pub slots: usize,
    /// Most tokens a sequence may reach (prompt and output).
    pub max_len: usize,
    /// Most new tokens of one sequence in one forward.
    pub max_chunk: usize,
}

const GIB: f64 = (1u64 << 30) as f64;

/// Wall time per section of the forward, each section ended by a stream synchronisation (so it
/// includes its launch gaps and host work): the step breakdown `deepinfer bench` reports with
/// `DEEPINFER_PROFILE=1`. Off by default (the synchronisations cost throughput).
/// (a pure decode step?, section name)
type SectionKey = (bool, &'static str);

#[derive(Default)]
struct Profile {
    on: bool,
    /// Whether the forward under way is a pure decode step (one new token a sequence): its
    /// sections are kept apart from those of forwards that prefill.
    decode: std::sync::atomic::AtomicBool,
    /// (decode step?, section) -> (seconds, times entered)
    sections: Mutex<std::collections::BTreeMap<SectionKey, (f64, u64)>>,
}

impl Profile {
    /// Close the section that began at `*last` as `name` (no-op when off).
    fn mark(&self, s: &Stream, last: &mut std::time::Instant, name: &'static str) -> Result<(), ModelError> {
        if self.on {
            s.synchronize()?;
            let mut m = self.sections.lock();
            let e = m.entry((self.decode.load(std::sync::atomic::Ordering::Relaxed), name)).or_default();
            e.0 += last.elapsed().as_secs_f64();
            e.1 += 1;
            *last = std::time::Instant::now();
        }
        Ok(())
    }
}

/// Bytes of the tensors the device model loads (all but the MTP layers'), as stored.
pub fn checkpoint_bytes(ck: &Checkpoint) -> usize {
    ck.names().filter(|name| !name.starts_with("mtp.")).filter_map(|name| ck.raw(name).ok().map(|r| r.2.len())).sum()
}

impl DeviceKvConfig {
    /// Device bytes of the pools for `cfg`: per slot and layer the window ring (window + max_chunk
    /// bf16 K=V rows), the compressed rows and indexer keys (max_len / ratio + 1 each), and the
    /// compressors' f32 state (open window and, overlapping, the previous window's values and gates).
    pub fn cache_bytes(&self, cfg: &ModelConfig) -> usize {
        let ring = cfg.sliding_window + self.max_chunk;
        let per_slot: usize = cfg.attention[..cfg.num_layers]
            .iter()
            .map(|kind| {
                let ratio = cfg.ratio(*kind);
                let mut b = ring * cfg.head_dim * 2;
                if let Some(cap) = self.max_len.checked_div(ratio).map(|c| c + 1) {
                    let overlap = *kind == AttentionKind::Csa;
                    let state = |w: usize| {
                        2 * ratio * w * if overlap { 2 } else { 1 } * 4 + if overlap { 2 * ratio * w * 4 } else { 0 }
                    };
                    b += cap * cfg.head_dim * 2 + state(cfg.head_dim);
                    if overlap {
                        b += cap * cfg.index_head_dim * 2 + state(cfg.index_head_dim);
                    }
                }
                b
            })
            .sum();
        self.slots * per_slot
    }

    /// This configuration with `max_len` lowered (in steps of 256 tokens) until the pools fit
    /// `budget` bytes; an error names the flags to change when not even 2 x max_chunk tokens fit.
    pub fn fit(self, cfg: &ModelConfig, budget: usize) -> Result<DeviceKvConfig, ModelError> {
        let mut k = self;
        while k.cache_bytes(cfg) > budget && k.max_len > 2 * k.max_chunk {
            k.max_len = (k.max_len - 256).max(2 * k.max_chunk);
        }
        if k.cache_bytes(cfg) > budget {
            return Err(input(
                "kv",
                format!(
                    "the device cache for {} sequences of {} tokens needs {:.2} GiB, {:.2} GiB are left after the \
                     weights; lower --max-running or --token-budget, or raise --gpu-memory-utilization",
                    k.slots,
                    k.max_len,
                    k.cache_bytes(cfg) as f64 / GIB,
                    budget as f64 / GIB
                ),
            ));
        }
        Ok(k)
    }
}

/// A sequence's handle on the device state: its slot (given back when dropped) and the tokens
/// computed so far.
#[derive(Debug)]
pub struct DeviceSeq {
    slot: usize,
    /// Tokens processed so far (the next token's position).
    pub len: usize,
    /// Tokens whose compressed rows came from the prefix cache: windows ending at or before it are
    /// present, and a replay over them only rebuilds the compressor state.
    restored: usize,
    /// First position with a K=V row in the ring: 0, or the replay start after a restore (the
    /// reference model's ring likewise starts empty there).
    win_from: usize,
    free: Arc<Mutex<Vec<bool>>>,
}

impl Drop for DeviceSeq {
    fn drop(&mut self) {
        self.free.lock()[self.slot] = true;
    }
}

/// Per-layer cache pools.
struct LayerKv {
    /// [slots·ring + slots·comp_cap, head_dim]: the window rings, then the compressed rows.
    kv: DeviceBuffer<bf16>,
    /// CSA: [slots·comp_cap, index_head_dim] indexer keys.
    index: Option<DeviceBuffer<bf16>>,
    comp: Option<CompressState>,
    index_comp: Option<CompressState>,
}

struct Pools {
    layers: Vec<LayerKv>,
    status: DeviceBuffer<i32>,
}

pub struct DeviceModel {
    cfg: ModelConfig,
    kvc: DeviceKvConfig,
    stream: Stream,
    w: Weights,
    /// All-ones [head_dim] (the weightless per-head RMSNorm of q).
    ones: DeviceBuffer<bf16>,
    main_rope: DeviceBuffer<f32>,
    compress_rope: DeviceBuffer<f32>,
    official: bool,
    ring: usize,
    pools: Mutex<Pools>,
    free: Arc<Mutex<Vec<bool>>>,
    prof: Profile,
}

/// One sequence's rows in a batch.
struct Span {
    start: usize,
    len: usize,
    pos0: usize,
    slot: usize,
    restored: usize,
    win_from: usize,
}

/// A batch's host-built index lists for one layer kind, uploaded once per forward.
struct KindLists {
    /// Attention key rows [tokens, max_keys] and counts [tokens].
    rows: DeviceBuffer<i32>,
    rows_host: Vec<i32>,
    counts: DeviceBuffer<i32>,
    max_keys: usize,
    /// Where each token's window rows end (CSA: where its selected rows go).
    at: DeviceBuffer<i32>,
    /// Compressor descriptors [batch, 4] and the pool rows of the windows each closes.
    seqs: DeviceBuffer<i32>,
    out_rows: DeviceBuffer<i32>,
    index_out_rows: DeviceBuffer<i32>,
    max_windows: usize,
    /// CSA: the indexer's candidate rows [tokens, max_cand], their counts, and each token's first
    /// compressed pool row.
    cand: DeviceBuffer<i32>,
    cand_counts: DeviceBuffer<i32>,
    max_cand: usize,
    comp_base: DeviceBuffer<i32>,
}

fn input(field: &'static str, problem: String) -> ModelError {
    ModelError::Input { field, problem }
}

impl DeviceModel {
    /// Load `dir` (config.json and safetensors) onto `device` with pools for `kvc`, calling
    /// `progress(done, total)` per layer.
    pub fn load(
        dir: &Path,
        device: &Device,
        kvc: DeviceKvConfig,
        numerics: Numerics,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<DeviceModel, ModelError> {
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let ck = Checkpoint::open_dir(dir)?;
        DeviceModel::from_checkpoint(cfg, &ck, device, kvc, numerics, progress)
    }

    /// `numerics`: `Official` rounds as MODEL_V4.md §12 says (activations before FP8/FP4 GEMMs,
    /// the KV and indexer QAT); `Reference` rounds only to bf16 between ops (to compare with the f32
    /// reference model without the official rounding).
    pub fn from_checkpoint(
        cfg: ModelConfig,
        ck: &Checkpoint,
        device: &Device,
        kvc: DeviceKvConfig,
        numerics: Numerics,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<DeviceModel, ModelError> {
        let official = numerics == Numerics::Official;
        if kvc.slots == 0 || kvc.max_len == 0 || kvc.max_chunk == 0 {
            return Err(input("kv", format!("slots, max_len and max_chunk must be positive: {kvc:?}")));
        }
        let stream = device.default_stream();
        let (v, d, n) = (cfg.vocab_size, cfg.hidden_size, cfg.hc_mult);
        // Fail before loading when the weights and the cache cannot fit.
        if let Some((free, _)) = device.memory_info()? {
            let weights = checkpoint_bytes(ck);
            let cache = kvc.cache_bytes(&cfg);
            if weights + cache > free {
                return Err(input(
                    "model",
                    format!(
                        "needs {:.2} GiB on {} ({:.2} GiB of weights, {:.2} GiB of cache), {:.2} GiB free",
                        (weights + cache) as f64 / GIB,
                        device.label(),
                        weights as f64 / GIB,
                        cache as f64 / GIB,
                        free as f64 / GIB
                    ),
                ));
            }
        }
        let mut l = Loader { ck, cfg: &cfg, s: &stream, bytes: 0, round_act: official };
        let total = cfg.num_layers + 1;
        let embed = l.bf16("embed.weight", &[v, d])?;
        let head_name =
            if cfg.tie_word_embeddings && !ck.contains("head.weight") { "embed.weight" } else { "head.weight" };
        let head = l.bf16(head_name, &[v, d])?;
        let norm = l.f32("norm.weight", &[d])?;
        let hc_head = l.site("hc_head_fn", "hc_head_base", "hc_head_scale", n, 1)?;
        progress(1, total);
        let mut blocks = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            blocks.push(l.block(&format!("layers.{i}"), cfg.attention[i], i < cfg.num_hash_layers)?);
            progress(i + 2, total);
        }
        let bytes = l.bytes;
        let rope_of = |theta: f32, yarn: bool| {
            RopeConfig {
                theta,
                rope_dim: cfg.rope_dim,
                yarn: if yarn {
                    cfg.yarn.map(|y| Yarn {
                        factor: y.factor,
                        original_max_position: y.original_max_position,
                        beta_fast: y.beta_fast,
                        beta_slow: y.beta_slow,
                    })
                } else {
                    None
                },
            }
            .inv_freq()
        };
        let main_rope = stream.upload(&rope_of(cfg.rope_theta, false))?;
        let compress_rope = stream.upload(&rope_of(cfg.compress_rope_theta, true))?;
        let ring = cfg.sliding_window + kvc.max_chunk;
        let mut layers = Vec::with_capacity(blocks.len());
        for b in &blocks {
            let comp_cap = b.attn.compressor.as_ref().map_or(0, |c| kvc.max_len / c.ratio + 1);
            let rows = kvc.slots * (ring + comp_cap);
            let comp = match &b.attn.compressor {
                Some(c) => Some(CompressState::new(
                    &stream,
                    kvc.slots,
                    PoolShape { ratio: c.ratio, width: c.width, overlap: c.overlap },
                )?),
                None => None,
            };
            let (index, index_comp) = match &b.attn.indexer {
                Some(ix) => {
                    let c = &ix.compressor;
                    (
                        Some(stream.zeros(kvc.slots * comp_cap * c.width)?),
                        Some(CompressState::new(
                            &stream,
                            kvc.slots,
                            PoolShape { ratio: c.ratio, width: c.width, overlap: c.overlap },
                        )?),
                    )
                }
                None => (None, None),
            };
            layers.push(LayerKv { kv: stream.zeros(rows * cfg.head_dim)?, index, comp, index_comp });
        }
        let pools = Pools { layers, status: stream.zeros(1)? };
        Ok(DeviceModel {
            ones: stream.upload(&vec![bf16::ONE; cfg.head_dim])?,
            official,
            w: Weights { embed, head, norm, hc_head, blocks, bytes },
            main_rope,
            compress_rope,
            ring,
            pools: Mutex::new(pools),
            free: Arc::new(Mutex::new(vec![true; kvc.slots])),
            prof: Profile { on: std::env::var("DEEPINFER_PROFILE").is_ok_and(|v| v == "1"), ..Default::default() },
            kvc,
            stream,
            cfg,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The step breakdown so far (section, seconds, times), empty unless `DEEPINFER_PROFILE=1`;
    /// sections are named `decode: ...` for pure decode steps and `prefill: ...` for the others.
    pub fn profile(&self) -> Vec<(String, f64, u64)> {
        let phase = |decode: bool| if decode { "decode" } else { "prefill" };
        self.prof.sections.lock().iter().map(|((d, k), v)| (format!("{}: {k}", phase(*d)), v.0, v.1)).collect()
    }

    /// Bytes of the weights on the device.
    pub fn weight_bytes(&self) -> usize {
        self.w.bytes
    }

    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// A new sequence's state: a free slot of the pools.
    pub fn new_seq(&self) -> Result<DeviceSeq, ModelError> {
        let mut free = self.free.lock();
        let slot = free.iter().position(|f| *f).ok_or_else(|| {
            input("kv", format!("all {} sequence slots of the device cache are in use", self.kvc.slots))
        })?;
        free[slot] = false;
        Ok(DeviceSeq { slot, len: 0, restored: 0, win_from: 0, free: self.free.clone() })
    }

    /// Give a sequence's slot back (the same as dropping it).
    pub fn release(&self, seq: DeviceSeq) {
        drop(seq);
    }

    /// Pool rows of a slot's compressed rows in a layer of `ratio` (kv pool) and of its indexer
    /// keys (index pool).
    fn comp_rows(&self, slot: usize, ratio: usize) -> (usize, usize) {
        let cap = self.comp_cap(ratio);
        (self.kvc.slots * self.ring + slot * cap, slot * cap)
    }

    /// Identity of the configuration, the numerics, the payload encoding (bf16 rows) and a sample
    /// of the weights: the prefix cache's model key.
    pub fn fingerprint(&self) -> String {
        use deepinfer_kv::{block_hashes, ExtraKeys};
        let s = &self.stream;
        let (v, d) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let mut bits: Vec<u32> = Vec::new();
        for row in [0, v / 3, v - 1] {
            if let Ok(r) = s.download_range(&self.w.embed, row * d, d.min(64)) {
                bits.extend(r.iter().map(|x| x.to_bits() as u32));
            }
            if let Ok(r) = s.download_range(&self.w.head, row * d, d.min(64)) {
                bits.extend(r.iter().map(|x| x.to_bits() as u32));
            }
        }
        for b in &self.w.blocks {
            if let Ok(r) = s.download_range(&b.attn.sink, 0, b.attn.sink.len()) {
                bits.extend(r.iter().map(|x| x.to_bits()));
            }
        }
        let keys = ExtraKeys {
            model: format!("{:?}", self.cfg),
            encoding: format!("device-bf16-rows official={}", self.official),
            cache_salt: None,
        };
        block_hashes(&bits, bits.len().max(1), &keys).last().map(|h| h.to_hex()).unwrap_or_default()
    }

    /// The payload of block `block` (tokens block·bt .. (block+1)·bt) of a sequence that has
    /// computed them: for every CSA/HCA layer in order its bt / ratio compressed rows, then (CSA)
    /// as many indexer keys, as little-endian bf16.
    pub fn block_payload(&self, seq: &DeviceSeq, block: usize, bt: usize) -> Result<Vec<u8>, ModelError> {
        if (block + 1) * bt > seq.len {
            return Err(input("block", format!("block {block} of {bt} tokens is past the {} computed", seq.len)));
        }
        let s = &self.stream;
        let pools = self.pools.lock();
        let mut out = Vec::new();
        let mut push = |v: Vec<bf16>| out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
        for (blk, kv) in self.w.blocks.iter().zip(&pools.layers) {
            let Some(c) = &blk.attn.compressor else { continue };
            let per = bt / c.ratio;
            let (kv_row, ix_row) = self.comp_rows(seq.slot, c.ratio);
            let hd = c.width;
            push(s.download_range(&kv.kv, (kv_row + block * per) * hd, per * hd)?);
            if let (Some(ix), Some(pool)) = (&blk.attn.indexer, &kv.index) {
                let w = ix.compressor.width;
                push(s.download_range(pool, (ix_row + block * per) * w, per * w)?);
            }
        }
        Ok(out)
    }

    /// A sequence holding the compressed rows of `blocks` (consecutive blocks from the start) whose
    /// next token is `replay_from`, a multiple of every compress ratio: the caller replays the
    /// tokens from there to rebuild the window rings and the compressors' open windows (the
    /// replayed windows' rows are not recomputed).
    pub fn restore_state(&self, blocks: &[&[u8]], bt: usize, replay_from: usize) -> Result<DeviceSeq, ModelError> {
        let bad = |problem: String| input("cached blocks", problem);
        let expect = self.cfg.kv_layout(bt, 2).map_err(|e| bad(e.to_string()))?.block_bytes();
        if let Some((i, b)) = blocks.iter().enumerate().find(|(_, b)| b.len() != expect) {
            return Err(bad(format!("block {i} has {} bytes, the layout needs {expect}", b.len())));
        }
        if replay_from > blocks.len() * bt {
            return Err(bad(format!("replay from {replay_from} is past the {} cached tokens", blocks.len() * bt)));
        }
        if blocks.len() * bt > self.kvc.max_len {
            return Err(bad(format!(
                "{} cached tokens exceed the device cache's {}",
                blocks.len() * bt,
                self.kvc.max_len
            )));
        }
        let mut seq = self.new_seq()?;
        let s = &self.stream;
        let mut pools = self.pools.lock();
        let rows = |b: &[u8]| -> Vec<bf16> { b.chunks_exact(2).map(|x| bf16::from_le_bytes([x[0], x[1]])).collect() };
        let mut offset = 0;
        for (blk, kv) in self.w.blocks.iter().zip(pools.layers.iter_mut()) {
            let Some(c) = &blk.attn.compressor else { continue };
            if !replay_from.is_multiple_of(c.ratio) {
                return Err(bad(format!("replay start {replay_from} is not a multiple of ratio {}", c.ratio)));
            }
            let per = bt / c.ratio;
            let (kv_row, ix_row) = self.comp_rows(seq.slot, c.ratio);
            let rb = per * c.width * 2;
            let ib = blk.attn.indexer.as_ref().map_or(0, |ix| per * ix.compressor.width * 2);
            for (i, b) in blocks.iter().enumerate() {
                s.write_range(&mut kv.kv, (kv_row + i * per) * c.width, &rows(&b[offset..offset + rb]))?;
                if let (Some(ix), Some(pool)) = (&blk.attn.indexer, kv.index.as_mut()) {
                    let w = ix.compressor.width;
                    s.write_range(pool, (ix_row + i * per) * w, &rows(&b[offset + rb..offset + rb + ib]))?;
                }
            }
            offset += rb + ib;
        }
        seq.len = replay_from;
        seq.restored = blocks.len() * bt;
        seq.win_from = replay_from;
        Ok(seq)
    }

    fn shape(&self) -> HcShape {
        let c = &self.cfg;
        HcShape {
            n: c.hc_mult,
            dim: c.hidden_size,
            sinkhorn_iters: c.hc_sinkhorn_iters,
            hc_eps: c.hc_eps,
            norm_eps: c.rms_norm_eps,
        }
    }

    fn comp_cap(&self, ratio: usize) -> usize {
        self.kvc.max_len / ratio + 1
    }

    /// Forward a varlen batch: for each sequence its new tokens and its state (advanced). Returns
    /// logits per sequence: [T, vocab] for `LogitRows::All`, [vocab] (its last row) for `Last`.
    pub fn forward(
        &self,
        batch: &mut [(&[u32], &mut DeviceSeq)],
        rows: LogitRows,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        self.forward_traced(batch, rows, None)
    }

    /// `forward`, also pushing, per layer, the attention output ([tokens, D]) and the residual
    /// streams after the layer ([tokens, hc, D], batch order) onto `trace` when given (for parity
    /// checks against [`crate::Trace`]'s `attn_out` and `layer_out`).
    pub fn forward_traced(
        &self,
        batch: &mut [(&[u32], &mut DeviceSeq)],
        rows: LogitRows,
        mut trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let c = &self.cfg;
        if matches!(rows, LogitRows::None) {
            return Err(input(
                "rows",
                "the device model has no streams-only forward (speculation runs on the reference model for now)".into(),
            ));
        }
        let mut spans = Vec::with_capacity(batch.len());
        let (mut ids, mut positions) = (Vec::new(), Vec::new());
        for (tokens, seq) in batch.iter() {
            if tokens.is_empty() {
                return Err(input("tokens", "a sequence in the batch has no tokens".into()));
            }
            if let Some(t) = tokens.iter().find(|t| **t as usize >= c.vocab_size) {
                return Err(input("tokens", format!("token id {t} is outside the vocabulary of {}", c.vocab_size)));
            }
            if tokens.len() > self.kvc.max_chunk {
                return Err(input(
                    "tokens",
                    format!("{} new tokens exceed the chunk limit {}", tokens.len(), self.kvc.max_chunk),
                ));
            }
            if seq.len + tokens.len() > self.kvc.max_len {
                return Err(input(
                    "tokens",
                    format!(
                        "{} tokens exceed the device cache's {} per sequence",
                        seq.len + tokens.len(),
                        self.kvc.max_len
                    ),
                ));
            }
            spans.push(Span {
                start: ids.len(),
                len: tokens.len(),
                pos0: seq.len,
                slot: seq.slot,
                restored: seq.restored,
                win_from: seq.win_from,
            });
            positions.extend((0..tokens.len()).map(|i| (seq.len + i) as i32));
            ids.extend(tokens.iter().map(|t| *t as i32));
        }
        let s = &self.stream;
        let mut pools = self.pools.lock();
        self.prof.decode.store(spans.iter().all(|sp| sp.len == 1), std::sync::atomic::Ordering::Relaxed);
        let mut t = std::time::Instant::now();
        let sh = self.shape();
        let (n, d) = (ids.len(), c.hidden_size);
        let ids_d = s.upload(&ids)?;
        let pos_d = s.upload(&positions)?;
        let mut x = s.zeros::<f32>(n * c.hc_mult * d)?;
        embed_streams(s, &ids_d, &self.w.embed, &mut x, &mut pools.status, n, &sh)?;
        let mut lists: Vec<(AttentionKind, KindLists)> = Vec::new();
        for kind in [AttentionKind::Sliding, AttentionKind::Csa, AttentionKind::Hca] {
            if self.w.blocks.iter().any(|b| b.attn.kind == kind) {
                lists.push((kind, self.lists(kind, &spans, &positions)?));
            }
        }
        self.prof.mark(s, &mut t, "host: inputs, key lists, embedding")?;
        let mut ws = MoeWorkspace::new(s, &self.w.blocks[0].moe, n as u32)?;
        let pools = &mut *pools;
        for (li, blk) in self.w.blocks.iter().enumerate() {
            let kl = &lists.iter().find(|(k, _)| *k == blk.attn.kind).expect("lists per kind").1;
            let (mut post, mut comb) = (s.zeros::<f32>(n * sh.n)?, s.zeros::<f32>(n * sh.n * sh.n)?);
            let mut xa = s.zeros::<bf16>(n * d)?;
            hc_pre(s, &x, &blk.hc_attn.view(), &blk.attn_norm, &mut post, &mut comb, &mut xa, n, &sh)?;
            self.prof.mark(s, &mut t, "mhc + norms")?;
            let a = self.attention(blk, &xa, &pos_d, &spans, kl, &mut pools.layers[li], &mut pools.status, &mut t)?;
            if let Some(t) = trace.as_deref_mut() {
                t.push(s.download(&a)?.iter().map(|v| v.to_f32()).collect());
            }
            hc_post(s, &mut x, &a, &post, &comb, n, &sh)?;
            let mut xf = s.zeros::<bf16>(n * d)?;
            hc_pre(s, &x, &blk.hc_ffn.view(), &blk.ffn_norm, &mut post, &mut comb, &mut xf, n, &sh)?;
            self.prof.mark(s, &mut t, "mhc + norms")?;
            let mut m = s.zeros::<bf16>(n * d)?;
            moe_forward(s, &blk.moe, &xf, Some(&ids_d), &mut ws, &mut m)?;
            self.prof.mark(s, &mut t, "moe")?;
            hc_post(s, &mut x, &m, &post, &comb, n, &sh)?;
            self.prof.mark(s, &mut t, "mhc + norms")?;
            if let Some(t) = trace.as_deref_mut() {
                t.push(s.download(&x)?);
            }
        }
        let mut hidden = s.zeros::<bf16>(n * d)?;
        hc_head(s, &x, &self.w.hc_head.view(), &self.w.norm, &mut hidden, n, &sh)?;
        self.prof.mark(s, &mut t, "mhc + norms")?;
        let (head_in, m) = match rows {
            LogitRows::All | LogitRows::None => (hidden, n),
            LogitRows::Last => {
                let mut pick = vec![-1i32; n];
                for (i, sp) in spans.iter().enumerate() {
                    pick[sp.start + sp.len - 1] = i as i32;
                }
                let mut last = s.zeros::<bf16>(spans.len() * d)?;
                scatter_rows(s, &hidden, &s.upload(&pick)?, &mut last, &mut pools.status, n, d)?;
                (last, spans.len())
            }
        };
        let v = c.vocab_size;
        let mut logits = s.zeros::<f32>(m * v)?;
        router_logits(s, &head_in, &self.w.head, &mut logits, m as u32, v as u32, d as u32)?;
        let all = s.download(&logits)?;
        self.prof.mark(s, &mut t, "head (f32 logits) + download")?;
        for ((tokens, seq), _) in batch.iter_mut().zip(&spans) {
            seq.len += tokens.len();
        }
        Ok(match rows {
            LogitRows::All | LogitRows::None => {
                spans.iter().map(|sp| all[sp.start * v..(sp.start + sp.len) * v].to_vec()).collect()
            }
            LogitRows::Last => all.chunks_exact(v).map(<[f32]>::to_vec).collect(),
        })
    }

    /// The index lists of one layer kind for this batch.
    fn lists(&self, kind: AttentionKind, spans: &[Span], positions: &[i32]) -> Result<KindLists, ModelError> {
        let c = &self.cfg;
        let s = &self.stream;
        let (w, ring, slots) = (c.sliding_window, self.ring, self.kvc.slots);
        let ratio = c.ratio(kind);
        let comp_cap = if ratio > 0 { self.comp_cap(ratio) } else { 0 };
        let comp_base = |slot: usize| (slots * ring + slot * comp_cap) as i32;
        let k = if kind == AttentionKind::Csa { c.index_topk } else { 0 };
        let n = positions.len();
        let (mut lists, mut at, mut cands, mut bases) =
            (Vec::with_capacity(n), Vec::with_capacity(n), Vec::new(), Vec::new());
        let mut counts = Vec::with_capacity(n);
        for sp in spans {
            for t in 0..sp.len {
                let p = sp.pos0 + t;
                let lo = (p + 1).saturating_sub(w).max(sp.win_from);
                let mut l: Vec<i32> = (lo..=p).map(|q| (sp.slot * ring + q % ring) as i32).collect();
                at.push(l.len() as i32);
                let visible = (p + 1).checked_div(ratio).unwrap_or(0);
                let mut count = l.len();
                match kind {
                    AttentionKind::Sliding => {}
                    AttentionKind::Hca => {
                        l.extend((0..visible).map(|j| comp_base(sp.slot) + j as i32));
                        count = l.len();
                    }
                    AttentionKind::Csa => {
                        count += visible.min(k);
                        cands.push((0..visible).map(|j| (sp.slot * comp_cap + j) as i32).collect::<Vec<_>>());
                        bases.push(comp_base(sp.slot));
                    }
                }
                counts.push(count as i32);
                lists.push(l);
            }
        }
        let max_keys = lists.iter().map(|l| l.len()).max().unwrap_or(0).max(1) + k;
        let mut rows = vec![-1i32; n * max_keys];
        for (t, l) in lists.iter().enumerate() {
            rows[t * max_keys..t * max_keys + l.len()].copy_from_slice(l);
        }
        // Compressor descriptors: the windows each sequence closes and their pool rows.
        let mut seqs = Vec::new();
        let mut closes: Vec<(usize, usize)> = Vec::new();
        if ratio > 0 {
            for sp in spans {
                let cs = CompressSeq {
                    tok_start: sp.start as i32,
                    tok_count: sp.len as i32,
                    pos0: sp.pos0 as i32,
                    slot: sp.slot as i32,
                };
                closes.push((sp.pos0.checked_div(ratio).unwrap_or(0), cs.closes(ratio)));
                seqs.push(cs);
            }
        }
        let max_windows = closes.iter().map(|c| c.1).max().unwrap_or(0).max(1);
        let (mut out_rows, mut index_out_rows) =
            (vec![-1i32; spans.len() * max_windows], vec![-1i32; spans.len() * max_windows]);
        for (b, (sp, (first, count))) in spans.iter().zip(&closes).enumerate() {
            // A window whose row came from the prefix cache only rebuilds the state (-1).
            for j in (0..*count).filter(|j| (first + j + 1) * ratio > sp.restored) {
                out_rows[b * max_windows + j] = comp_base(sp.slot) + (first + j) as i32;
                index_out_rows[b * max_windows + j] = (sp.slot * comp_cap + first + j) as i32;
            }
        }
        let max_cand = cands.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut cand = vec![-1i32; cands.len().max(1) * max_cand];
        for (t, l) in cands.iter().enumerate() {
            cand[t * max_cand..t * max_cand + l.len()].copy_from_slice(l);
        }
        let cand_counts: Vec<i32> = cands.iter().map(|l| l.len() as i32).collect();
        let up = |v: &[i32]| s.upload(if v.is_empty() { &[0][..] } else { v });
        Ok(KindLists {
            rows: s.upload(&rows)?,
            rows_host: rows,
            counts: s.upload(&counts)?,
            max_keys,
            at: s.upload(&at)?,
            seqs: up(&pack_seqs(&seqs))?,
            out_rows: s.upload(&out_rows)?,
            index_out_rows: s.upload(&index_out_rows)?,
            max_windows,
            cand: s.upload(&cand)?,
            cand_counts: up(&cand_counts)?,
            max_cand,
            comp_base: up(&bases)?,
        })
    }

    /// One layer's attention output [tokens, D] for its normalised input `xa`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        blk: &Block,
        xa: &DeviceBuffer<bf16>,
        pos: &DeviceBuffer<i32>,
        spans: &[Span],
        kl: &KindLists,
        kv: &mut LayerKv,
        status: &mut DeviceBuffer<i32>,
        t: &mut std::time::Instant,
    ) -> Result<DeviceBuffer<bf16>, ModelError> {
        let c = &self.cfg;
        let s = &self.stream;
        let a = &blk.attn;
        let n = pos.len();
        let (d, h, hd, rd, eps) = (c.hidden_size, c.num_heads, c.head_dim, c.rope_dim, c.rms_norm_eps);
        let inv = if a.kind == AttentionKind::Sliding { &self.main_rope } else { &self.compress_rope };
        let q8 = self.official;
        // Query: wq_a, q_norm, wq_b, a weightless RMSNorm per head, rope.
        let mut cq = s.zeros::<bf16>(n * c.q_lora_rank)?;
        a.wq_a.run(s, xa, &mut cq, n, q8)?;
        let mut cqn = s.zeros::<bf16>(n * c.q_lora_rank)?;
        rms_norm(s, &cq, &a.q_norm, &mut cqn, &RmsNormParams::packed(n as u32, c.q_lora_rank as u32, eps))?;
        let mut q0 = s.zeros::<bf16>(n * h * hd)?;
        a.wq_b.run(s, &cqn, &mut q0, n, q8)?;
        let mut q = s.zeros::<bf16>(n * h * hd)?;
        rms_norm(s, &q0, &self.ones, &mut q, &RmsNormParams::packed((n * h) as u32, hd as u32, eps))?;
        rope(s, &mut q, pos, inv, &RopeParams::new(n as u32, h as u32, hd as u32, rd as u32, false))?;
        // K=V row: wkv, kv_norm, rope, KV QAT; into the ring.
        let mut kv0 = s.zeros::<bf16>(n * hd)?;
        a.wkv.run(s, xa, &mut kv0, n, q8)?;
        let mut kvr = s.zeros::<bf16>(n * hd)?;
        rms_norm(s, &kv0, &a.kv_norm, &mut kvr, &RmsNormParams::packed(n as u32, hd as u32, eps))?;
        rope(s, &mut kvr, pos, inv, &RopeParams::new(n as u32, 1, hd as u32, rd as u32, false))?;
        if self.official {
            qat_rows(s, &mut kvr, None, n, hd, RowQatKind::Fp8Nope { rope_dim: rd as u32 })?;
        }
        let ring_rows: Vec<i32> = spans
            .iter()
            .flat_map(|sp| (sp.pos0..sp.pos0 + sp.len).map(move |p| (sp.slot * self.ring + p % self.ring) as i32))
            .collect();
        scatter_rows(s, &kvr, &s.upload(&ring_rows)?, &mut kv.kv, status, n, hd)?;
        self.prof.mark(s, t, "attn: q/kv projections, norms, rope")?;
        // Compressed rows (and indexer keys) of the windows this batch closes.
        let batch = spans.len();
        let fp8_qat = if self.official { RowQat::Fp8Blocks64 } else { RowQat::None };
        if let (Some(comp), Some(state)) = (&a.compressor, kv.comp.as_mut()) {
            self.compress_into(comp, xa, kl, &kl.out_rows, state, &mut kv.kv, status, batch, fp8_qat)?;
        }
        self.prof.mark(s, t, "attn: compressor")?;
        let mut key_rows = None;
        if let (Some(ix), Some(state), Some(pool)) = (&a.indexer, kv.index_comp.as_mut(), kv.index.as_mut()) {
            let ic = &ix.compressor;
            self.compress_into(ic, xa, kl, &kl.index_out_rows, state, pool, status, batch, RowQat::None)?;
            if self.official {
                let rows = batch * kl.max_windows;
                qat_rows(s, pool, Some(&kl.index_out_rows), rows, ic.width, RowQatKind::HadamardFp4)?;
            }
            let (ih, id) = (c.index_heads, c.index_head_dim);
            let mut qi = s.zeros::<bf16>(n * ih * id)?;
            ix.wq_b.run(s, &cqn, &mut qi, n, q8)?;
            rope(s, &mut qi, pos, inv, &RopeParams::new(n as u32, ih as u32, id as u32, rd as u32, false))?;
            if self.official {
                qat_rows(s, &mut qi, None, n * ih, id, RowQatKind::HadamardFp4)?;
            }
            let mut wts = s.zeros::<f32>(n * ih)?;
            router_logits(s, xa, &ix.weights_proj, &mut wts, n as u32, ih as u32, d as u32)?;
            let k = c.index_topk;
            let shape = IndexerShape {
                batch: n as u32,
                heads: ih as u32,
                dim: id as u32,
                max_rows: kl.max_cand as u32,
                k: k as u32,
            };
            let mut scores = s.zeros::<f32>(n * kl.max_cand)?;
            let mut topk = s.zeros::<i32>(n * k)?;
            let scale = (id as f32).powf(-0.5) * (ih as f32).powf(-0.5);
            indexer_decode(
                s,
                &qi,
                &wts,
                pool,
                &kl.cand,
                &kl.cand_counts,
                &mut scores,
                &mut topk,
                status,
                shape,
                scale,
            )?;
            // The layer's own copy of the window rows, the selection written after each token's window.
            let mut rows = s.upload(&kl.rows_host)?;
            offset_rows(s, &topk, &kl.comp_base, &kl.at, &mut rows, n, k, kl.max_keys)?;
            key_rows = Some(rows);
        }
        self.prof.mark(s, t, "attn: indexer (compressor, q, top-k)")?;
        let key_rows = key_rows.as_ref().unwrap_or(&kl.rows);
        let mut o = s.zeros::<bf16>(n * h * hd)?;
        let shape =
            DecodeAttnShape { batch: n as u32, heads: h as u32, head_dim: hd as u32, max_keys: kl.max_keys as u32 };
        attention_decode(s, &q, &kv.kv, key_rows, &kl.counts, &a.sink, &mut o, status, shape, (hd as f32).powf(-0.5))?;
        self.prof.mark(s, t, "attn: attention kernel")?;
        rope(s, &mut o, pos, inv, &RopeParams::new(n as u32, h as u32, hd as u32, rd as u32, true))?;
        // Grouped output LoRA: group g's columns of o through its wo_a, side by side, then wo_b.
        let (g, olr) = (c.o_groups, c.o_lora_rank);
        let gin = h * hd / g;
        let (mut og, mut ug) = (s.zeros::<bf16>(n * gin)?, s.zeros::<bf16>(n * olr)?);
        let mut u = s.zeros::<bf16>(n * g * olr)?;
        for (gi, wg) in a.wo_a.iter().enumerate() {
            copy_2d(s, &o, h * hd, gi * gin, &mut og, gin, 0, n, gin)?;
            wg.run(s, &og, &mut ug, n, false)?;
            copy_2d(s, &ug, olr, 0, &mut u, g * olr, gi * olr, n, olr)?;
        }
        let mut out = s.zeros::<bf16>(n * d)?;
        a.wo_b.run(s, &u, &mut out, n, q8)?;
        self.prof.mark(s, t, "attn: inverse rope, grouped wo_a, wo_b")?;
        Ok(out)
    }

    /// A compressor over the batch: its f32 projections of `xa`, then the windows it closes into
    /// `pool` at `out_rows`.
    #[allow(clippy::too_many_arguments)]
    fn compress_into(
        &self,
        comp: &weights::Compressor,
        xa: &DeviceBuffer<bf16>,
        kl: &KindLists,
        out_rows: &DeviceBuffer<i32>,
        state: &mut CompressState,
        pool: &mut DeviceBuffer<bf16>,
        status: &mut DeviceBuffer<i32>,
        batch: usize,
        qat: RowQat,
    ) -> Result<(), ModelError> {
        let s = &self.stream;
        let c = &self.cfg;
        let (n, d, cw) = (xa.len() / c.hidden_size, c.hidden_size, comp.token_width());
        let (mut ckv, mut cg) = (s.zeros::<f32>(n * cw)?, s.zeros::<f32>(n * cw)?);
        router_logits(s, xa, &comp.wkv, &mut ckv, n as u32, cw as u32, d as u32)?;
        router_logits(s, xa, &comp.wgate, &mut cg, n as u32, cw as u32, d as u32)?;
        let shape = CompressShape {
            pool: PoolShape { ratio: comp.ratio, width: comp.width, overlap: comp.overlap },
            rope_dim: c.rope_dim,
            batch,
            max_windows: kl.max_windows,
            tokens: n,
        };
        compress(
            s,
            &ckv,
            &cg,
            &comp.ape,
            &comp.norm,
            &self.compress_rope,
            &kl.seqs,
            out_rows,
            state,
            pool,
            status,
            shape,
            qat,
            c.rms_norm_eps,
        )?;
        Ok(())
    }
}
