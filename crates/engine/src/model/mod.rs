//! The DeepSeek-V4 model on the CPU backend: weights under the official names, dequantised to
//! f32; a varlen batch forward in which every sequence brings its own cache state, so the same
//! code runs a full prefill (empty state, all tokens), chunked prefill and decode (one token);
//! and the MTP head.

mod attention;
mod cache;
mod compressor;
mod linear;
mod mhc;
mod moe_block;

use std::collections::BTreeMap;
use std::path::Path;

use deepinfer_kernels_ffi::RopeConfig;
use deepinfer_moe::Router;
use thiserror::Error;

use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::config::{AttentionKind, ConfigError, ExpertDtype, ModelConfig};
use attention::{Attention, AttentionState, Indexer, LayerCtx};
pub use compressor::{Compressor, CompressorState, RowFinish};
use linear::rms_norm_rows;
pub use linear::Linear;
use mhc::{HcHead, HcParams, HcShape};
use moe_block::MoeError;
pub use moe_block::{Expert, MoeBlock};

#[derive(Debug, Error)]
pub enum ModelError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("MoE: {0}")]
    Moe(#[from] MoeError),
    #[error("device: {0}")]
    Device(#[from] deepinfer_kernels_ffi::FfiError),
    #[error("invalid input `{field}`: {problem}")]
    Input { field: &'static str, problem: String },
}

/// Arithmetic of the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Numerics {
    /// f32 on dequantised weights: the transformers reference (fixture parity).
    #[default]
    Reference,
    /// Plus the official runtime rounding (MODEL_V4.md §12): FP8 activations before FP8/FP4
    /// GEMMs, FP8 KV QAT, Hadamard + FP4 indexer QAT, bf16 attention probabilities.
    Official,
}

/// Per-layer intermediate results of a forward, for parity checks (rows in batch order).
#[derive(Debug, Default)]
pub struct Trace {
    /// Residual streams after each layer, [N, hc, D].
    pub layer_out: Vec<Vec<f32>>,
    /// Attention sublayer outputs of each layer, [N, D] (before the mHC merge).
    pub attn_out: Vec<Vec<f32>>,
    /// Sorted expert ids per token, per MoE layer.
    pub router_topk: BTreeMap<usize, Vec<Vec<u32>>>,
    /// Sorted compressed rows each query attended to, per CSA layer.
    pub indexer_topk: BTreeMap<usize, Vec<Vec<usize>>>,
}

/// Which rows of a forward get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogitRows {
    /// Every token (parity checks, speculative verification).
    #[default]
    All,
    /// Each sequence's last token (generation).
    Last,
    /// No logits: only the final streams of every row ([`Model::forward_tails`] runs the head itself).
    None,
}

/// One sequence's cache state: what the next chunk of tokens needs from the tokens before it.
#[derive(Debug, Clone, Default)]
pub struct SequenceState {
    /// Tokens processed so far (the next token's position).
    pub len: usize,
    layers: Vec<AttentionState>,
}

impl SequenceState {
    /// Compressed rows cached in each layer (0 for sliding layers).
    pub fn compressed_rows(&self) -> Vec<usize> {
        self.layers.iter().map(|l| l.compressor.count).collect()
    }
}

/// A sequence's place in a batch: rows start..start+len, first position pos0.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SeqSpan {
    pub start: usize,
    pub len: usize,
    pub pos0: usize,
}

/// The token rows of a varlen batch.
pub(crate) struct Batch {
    pub seqs: Vec<SeqSpan>,
    pub positions: Vec<i32>,
    pub ids: Vec<u32>,
}

impl Batch {
    pub fn tokens(&self) -> usize {
        self.positions.len()
    }
}

/// Output for one sequence of a forward.
#[derive(Debug, Clone)]
pub struct SeqOutput {
    /// [T, vocab]
    pub logits: Vec<f32>,
    /// Residual streams after the last layer, [T, hc, D] (the MTP head's input).
    pub streams: Vec<f32>,
    /// Input of the head (after hc_head and the final norm), [T, D].
    pub final_hidden: Vec<f32>,
}

/// One decoder block: mHC-wrapped attention and MoE.
#[derive(Debug, Clone)]
struct Block {
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    hc_attn: HcParams,
    hc_ffn: HcParams,
    attn: Attention,
    moe: MoeBlock,
}

/// The extra weights of an MTP layer around its block.
#[derive(Debug, Clone)]
struct MtpLayer {
    block: Block,
    e_proj: Linear,
    h_proj: Linear,
    enorm: Vec<f32>,
    hnorm: Vec<f32>,
    norm: Vec<f32>,
    hc_head: HcHead,
}

pub struct Model {
    cfg: ModelConfig,
    embed: Vec<f32>,
    head: Linear,
    norm: Vec<f32>,
    hc_head: HcHead,
    blocks: Vec<Block>,
    mtp: Vec<MtpLayer>,
    main_rope: Vec<f32>,
    compress_rope: Vec<f32>,
}

struct Loader<'a> {
    ck: &'a Checkpoint,
    cfg: &'a ModelConfig,
    block: [usize; 2],
}

impl Loader<'_> {
    fn lin(&self, name: &str, out: usize, inp: usize) -> Result<Linear, CheckpointError> {
        Ok(Linear::new(out, inp, self.ck.f32(name, &[out, inp], self.block)?))
    }
    fn vec(&self, name: &str, len: usize) -> Result<Vec<f32>, CheckpointError> {
        self.ck.f32(name, &[len], self.block)
    }
    fn hc(&self, p: &str, site: &str) -> Result<HcParams, CheckpointError> {
        let (n, d) = (self.cfg.hc_mult, self.cfg.hidden_size);
        let mix = (2 + n) * n;
        let s = self.vec(&format!("{p}.hc_{site}_scale"), 3)?;
        Ok(HcParams {
            fn_: self.lin(&format!("{p}.hc_{site}_fn"), mix, n * d)?,
            base: self.vec(&format!("{p}.hc_{site}_base"), mix)?,
            scale: [s[0], s[1], s[2]],
        })
    }
    fn hc_head(&self, p: &str) -> Result<HcHead, CheckpointError> {
        let (n, d) = (self.cfg.hc_mult, self.cfg.hidden_size);
        Ok(HcHead {
            fn_: self.lin(&format!("{p}hc_head_fn"), n, n * d)?,
            base: self.vec(&format!("{p}hc_head_base"), n)?,
            scale: self.vec(&format!("{p}hc_head_scale"), 1)?[0],
        })
    }
    fn compressor(&self, p: &str, ratio: usize, width: usize, overlap: bool) -> Result<Compressor, CheckpointError> {
        let d = self.cfg.hidden_size;
        let cw = if overlap { 2 * width } else { width };
        Ok(Compressor {
            ratio,
            width,
            overlap,
            wkv: self.lin(&format!("{p}.wkv.weight"), cw, d)?,
            wgate: self.lin(&format!("{p}.wgate.weight"), cw, d)?,
            ape: self.ck.f32(&format!("{p}.ape"), &[ratio, cw], self.block)?,
            norm: self.vec(&format!("{p}.norm.weight"), width)?,
        })
    }
    fn expert(&self, p: &str, inter: usize) -> Result<Expert, CheckpointError> {
        let d = self.cfg.hidden_size;
        Ok(Expert {
            w1: self.lin(&format!("{p}.w1.weight"), inter, d)?,
            w2: self.lin(&format!("{p}.w2.weight"), d, inter)?,
            w3: self.lin(&format!("{p}.w3.weight"), inter, d)?,
        })
    }

    fn block(&self, p: &str, kind: AttentionKind, hash: bool) -> Result<Block, ModelError> {
        let c = self.cfg;
        let (d, h, hd) = (c.hidden_size, c.num_heads, c.head_dim);
        let a = format!("{p}.attn");
        let compressor = match kind {
            AttentionKind::Sliding => None,
            AttentionKind::Csa => Some(self.compressor(&format!("{a}.compressor"), c.csa_ratio, hd, true)?),
            AttentionKind::Hca => Some(self.compressor(&format!("{a}.compressor"), c.hca_ratio, hd, false)?),
        };
        let indexer = if kind == AttentionKind::Csa {
            Some(Indexer {
                wq_b: self.lin(&format!("{a}.indexer.wq_b.weight"), c.index_heads * c.index_head_dim, c.q_lora_rank)?,
                weights_proj: self.lin(&format!("{a}.indexer.weights_proj.weight"), c.index_heads, d)?,
                compressor: self.compressor(&format!("{a}.indexer.compressor"), c.csa_ratio, c.index_head_dim, true)?,
                heads: c.index_heads,
                head_dim: c.index_head_dim,
                topk: c.index_topk,
            })
        } else {
            None
        };
        let attn = Attention {
            kind,
            heads: h,
            head_dim: hd,
            rope_dim: c.rope_dim,
            window: c.sliding_window,
            groups: c.o_groups,
            sink: self.vec(&format!("{a}.attn_sink"), h)?,
            wq_a: self.lin(&format!("{a}.wq_a.weight"), c.q_lora_rank, d)?,
            q_norm: self.vec(&format!("{a}.q_norm.weight"), c.q_lora_rank)?,
            wq_b: self.lin(&format!("{a}.wq_b.weight"), h * hd, c.q_lora_rank)?,
            wkv: self.lin(&format!("{a}.wkv.weight"), hd, d)?,
            kv_norm: self.vec(&format!("{a}.kv_norm.weight"), hd)?,
            wo_a: self.lin(&format!("{a}.wo_a.weight"), c.o_groups * c.o_lora_rank, h * hd / c.o_groups)?,
            wo_b: self.lin(&format!("{a}.wo_b.weight"), d, c.o_groups * c.o_lora_rank)?,
            compressor,
            indexer,
        };
        let f = format!("{p}.ffn");
        let e = c.n_experts;
        let experts = (0..e)
            .map(|i| self.expert(&format!("{f}.experts.{i}"), c.moe_intermediate))
            .collect::<Result<Vec<_>, _>>()?;
        let shared = if c.n_shared_experts == 1 {
            Some(self.expert(&format!("{f}.shared_experts"), c.moe_intermediate)?)
        } else {
            None
        };
        let (bias, tid2eid) = if hash {
            (None, Some(self.ck.i64(&format!("{f}.gate.tid2eid"), &[c.vocab_size, c.top_k])?))
        } else {
            (Some(self.vec(&format!("{f}.gate.bias"), e)?), None)
        };
        let moe = MoeBlock {
            gate: self.lin(&format!("{f}.gate.weight"), e, d)?,
            bias,
            tid2eid,
            router: Router::new(e, c.top_k, c.routed_scaling_factor).map_err(MoeError::from)?,
            experts,
            shared,
            limit: c.swiglu_limit,
        };
        Ok(Block {
            attn_norm: self.vec(&format!("{p}.attn_norm.weight"), d)?,
            ffn_norm: self.vec(&format!("{p}.ffn_norm.weight"), d)?,
            hc_attn: self.hc(p, "attn")?,
            hc_ffn: self.hc(p, "ffn")?,
            attn,
            moe,
        })
    }
}

impl Model {
    /// Load `dir/config.json` and the checkpoint beside it.
    pub fn load(dir: &Path) -> Result<Model, ModelError> {
        Model::load_with_progress(dir, &mut |_, _| {})
    }

    /// `load`, calling `progress(done, total)` as layers are loaded (for progress bars).
    pub fn load_with_progress(dir: &Path, progress: &mut dyn FnMut(usize, usize)) -> Result<Model, ModelError> {
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let ck = Checkpoint::open_dir(dir)?;
        Model::from_checkpoint_with_progress(cfg, &ck, progress)
    }

    pub fn from_checkpoint(cfg: ModelConfig, ck: &Checkpoint) -> Result<Model, ModelError> {
        Model::from_checkpoint_with_progress(cfg, ck, &mut |_, _| {})
    }

    fn from_checkpoint_with_progress(
        cfg: ModelConfig,
        ck: &Checkpoint,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Model, ModelError> {
        if cfg.expert_dtype == ExpertDtype::Fp4 && !cfg.hidden_size.is_multiple_of(32) {
            return Err(ConfigError::Field {
                field: "expert_dtype".into(),
                problem: format!("fp4 experts need hidden_size {} divisible by 32", cfg.hidden_size),
            }
            .into());
        }
        let block = cfg.quant.as_ref().map_or([128, 128], |q| q.block);
        let l = Loader { ck, cfg: &cfg, block };
        let (v, d) = (cfg.vocab_size, cfg.hidden_size);
        let embed = ck.f32("embed.weight", &[v, d], block)?;
        let head = if cfg.tie_word_embeddings && !ck.contains("head.weight") {
            Linear::new(v, d, embed.clone())
        } else {
            l.lin("head.weight", v, d)?
        };
        let total = cfg.num_layers + cfg.num_mtp_layers + 1;
        progress(1, total);
        let blocks = (0..cfg.num_layers)
            .map(|i| {
                let b = l.block(&format!("layers.{i}"), cfg.attention[i], i < cfg.num_hash_layers);
                progress(i + 2, total);
                b
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut mtp = Vec::new();
        for j in 0..cfg.num_mtp_layers {
            let p = format!("mtp.{j}");
            mtp.push(MtpLayer {
                block: l.block(&p, cfg.attention[cfg.num_layers + j], false)?,
                e_proj: l.lin(&format!("{p}.e_proj.weight"), d, d)?,
                h_proj: l.lin(&format!("{p}.h_proj.weight"), d, d)?,
                enorm: l.vec(&format!("{p}.enorm.weight"), d)?,
                hnorm: l.vec(&format!("{p}.hnorm.weight"), d)?,
                norm: l.vec(&format!("{p}.norm.weight"), d)?,
                hc_head: l.hc_head(&format!("{p}."))?,
            });
        }
        let main_rope = RopeConfig { theta: cfg.rope_theta, rope_dim: cfg.rope_dim, yarn: None }.inv_freq();
        let compress_rope = RopeConfig {
            theta: cfg.compress_rope_theta,
            rope_dim: cfg.rope_dim,
            yarn: cfg.yarn.map(|y| deepinfer_kernels_ffi::Yarn {
                factor: y.factor,
                original_max_position: y.original_max_position,
                beta_fast: y.beta_fast,
                beta_slow: y.beta_slow,
            }),
        }
        .inv_freq();
        Ok(Model {
            norm: l.vec("norm.weight", d)?,
            hc_head: l.hc_head("")?,
            embed,
            head,
            blocks,
            mtp,
            main_rope,
            compress_rope,
            cfg,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// An empty cache state for a new sequence.
    pub fn new_state(&self) -> SequenceState {
        SequenceState { len: 0, layers: vec![AttentionState::default(); self.blocks.len()] }
    }

    /// An empty state for MTP layer 0's block.
    pub fn new_mtp_state(&self) -> SequenceState {
        SequenceState { len: 0, layers: vec![AttentionState::default(); self.mtp.len().min(1)] }
    }

    fn shape(&self) -> HcShape {
        HcShape {
            n: self.cfg.hc_mult,
            dim: self.cfg.hidden_size,
            sinkhorn_iters: self.cfg.hc_sinkhorn_iters,
            hc_eps: self.cfg.hc_eps,
            norm_eps: self.cfg.rms_norm_eps,
        }
    }

    fn rope_for(&self, kind: AttentionKind) -> &[f32] {
        match kind {
            AttentionKind::Sliding => &self.main_rope,
            _ => &self.compress_rope,
        }
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<(), ModelError> {
        if let Some(t) = tokens.iter().find(|t| **t as usize >= self.cfg.vocab_size) {
            return Err(ModelError::Input {
                field: "tokens",
                problem: format!("token id {t} is outside the vocabulary of {}", self.cfg.vocab_size),
            });
        }
        Ok(())
    }

    /// Forward a varlen batch: for each sequence, its new tokens and its cache state (updated).
    /// Returns each sequence's logits and final streams, and the batch's trace when asked.
    pub fn forward(
        &self,
        batch: &mut [(&[u32], &mut SequenceState)],
        numerics: Numerics,
        want_trace: bool,
    ) -> Result<(Vec<SeqOutput>, Option<Trace>), ModelError> {
        self.forward_rows(batch, numerics, want_trace, LogitRows::All)
    }

    /// `forward`, computing the head only for the rows `rows` asks for (the engine needs each
    /// sequence's last row: the head is the largest matmul of a prefill chunk).
    pub fn forward_rows(
        &self,
        batch: &mut [(&[u32], &mut SequenceState)],
        numerics: Numerics,
        want_trace: bool,
        rows: LogitRows,
    ) -> Result<(Vec<SeqOutput>, Option<Trace>), ModelError> {
        let mut seqs = Vec::new();
        let (mut positions, mut ids) = (Vec::new(), Vec::new());
        for (tokens, state) in batch.iter() {
            self.check_tokens(tokens)?;
            if tokens.is_empty() {
                return Err(ModelError::Input {
                    field: "tokens",
                    problem: "a sequence in the batch has no tokens".into(),
                });
            }
            seqs.push(SeqSpan { start: ids.len(), len: tokens.len(), pos0: state.len });
            positions.extend((0..tokens.len()).map(|i| (state.len + i) as i32));
            ids.extend_from_slice(tokens);
        }
        let b = Batch { seqs, positions, ids };
        let (n, hc, d) = (b.tokens(), self.cfg.hc_mult, self.cfg.hidden_size);
        let mut x = vec![0f32; n * hc * d];
        for (t, id) in b.ids.iter().enumerate() {
            let e = &self.embed[*id as usize * d..(*id as usize + 1) * d];
            for j in 0..hc {
                x[(t * hc + j) * d..(t * hc + j + 1) * d].copy_from_slice(e);
            }
        }
        let mut trace = want_trace.then(Trace::default);
        for (li, blk) in self.blocks.iter().enumerate() {
            let mut states: Vec<&mut AttentionState> = batch.iter_mut().map(|(_, s)| &mut s.layers[li]).collect();
            self.run_block(blk, &mut x, &b, &mut states, numerics, &mut trace.as_mut(), li)?;
            if let Some(tr) = trace.as_mut() {
                tr.layer_out.push(x.clone());
            }
        }
        let w = self.cfg.hc_mult * self.cfg.hidden_size;
        let outs = match rows {
            LogitRows::All => self.finish(&x, &b, &self.hc_head, &self.norm),
            LogitRows::Last => self.finish_last(&x, &b),
            LogitRows::None => b
                .seqs
                .iter()
                .map(|sp| SeqOutput {
                    logits: Vec::new(),
                    streams: x[sp.start * w..(sp.start + sp.len) * w].to_vec(),
                    final_hidden: Vec::new(),
                })
                .collect(),
        };
        for (tokens, state) in batch.iter_mut() {
            state.len += tokens.len();
        }
        Ok((outs, trace))
    }

    #[allow(clippy::too_many_arguments)] // the block's inputs, states and trace: bundling them hides nothing
    fn run_block(
        &self,
        blk: &Block,
        x: &mut [f32],
        b: &Batch,
        states: &mut [&mut AttentionState],
        numerics: Numerics,
        trace: &mut Option<&mut Trace>,
        layer: usize,
    ) -> Result<(), ModelError> {
        let s = self.shape();
        let n = b.tokens();
        let eps = self.cfg.rms_norm_eps;
        let (mix, mut xa) = blk.hc_attn.split(x, n, &s);
        rms_norm_rows(&mut xa, &blk.attn_norm, eps);
        let ctx = LayerCtx { inv_freq: self.rope_for(blk.attn.kind), eps, numerics, layer };
        let a = blk.attn.forward(&xa, b, states, &ctx, trace);
        if let Some(tr) = trace.as_deref_mut() {
            tr.attn_out.push(a.clone());
        }
        mix.merge(x, &a, &s);
        let (mix, mut xf) = blk.hc_ffn.split(x, n, &s);
        rms_norm_rows(&mut xf, &blk.ffn_norm, eps);
        let m = blk.moe.forward(&xf, &b.ids, numerics, trace, layer)?;
        mix.merge(x, &m, &s);
        Ok(())
    }

    /// hc_head collapse, final norm and head, split per sequence.
    fn finish(&self, x: &[f32], b: &Batch, hc_head: &HcHead, norm: &[f32]) -> Vec<SeqOutput> {
        let s = self.shape();
        let (n, hc, d, v) = (b.tokens(), s.n, s.dim, self.cfg.vocab_size);
        let mut hdn = hc_head.collapse(x, n, &s);
        rms_norm_rows(&mut hdn, norm, self.cfg.rms_norm_eps);
        let logits = self.head.forward(&hdn, n);
        b.seqs
            .iter()
            .map(|sp| SeqOutput {
                logits: logits[sp.start * v..(sp.start + sp.len) * v].to_vec(),
                streams: x[sp.start * hc * d..(sp.start + sp.len) * hc * d].to_vec(),
                final_hidden: hdn[sp.start * d..(sp.start + sp.len) * d].to_vec(),
            })
            .collect()
    }

    /// hc_head collapse, final norm and head over `m` rows of streams [m, hc, D]: (logits, hidden).
    fn head_rows(&self, rows: &[f32], m: usize) -> (Vec<f32>, Vec<f32>) {
        let mut hdn = self.hc_head.collapse(rows, m, &self.shape());
        rms_norm_rows(&mut hdn, &self.norm, self.cfg.rms_norm_eps);
        (self.head.forward(&hdn, m), hdn)
    }

    /// The streams of each sequence's last `tails[i]` rows, concatenated.
    fn tail_rows(&self, x: &[f32], b: &Batch, tails: &[usize]) -> Vec<f32> {
        let w = self.cfg.hc_mult * self.cfg.hidden_size;
        b.seqs
            .iter()
            .zip(tails)
            .flat_map(|(sp, &t)| x[(sp.start + sp.len - t) * w..(sp.start + sp.len) * w].iter().copied())
            .collect()
    }

    /// `finish` for each sequence's last row only (streams and final_hidden hold that row).
    fn finish_last(&self, x: &[f32], b: &Batch) -> Vec<SeqOutput> {
        let (w, d, v) = (self.cfg.hc_mult * self.cfg.hidden_size, self.cfg.hidden_size, self.cfg.vocab_size);
        let m = b.seqs.len();
        let last = self.tail_rows(x, b, &vec![1; m]);
        let (logits, hdn) = self.head_rows(&last, m);
        (0..m)
            .map(|i| SeqOutput {
                logits: logits[i * v..(i + 1) * v].to_vec(),
                streams: last[i * w..(i + 1) * w].to_vec(),
                final_hidden: hdn[i * d..(i + 1) * d].to_vec(),
            })
            .collect()
    }

    /// A forward whose outputs hold each sequence's logits for its last `tails[i]` new rows
    /// ([tail, vocab]; 0 rows for a prefill chunk that samples nothing) and its final streams for
    /// every new row ([T, hc, D], the MTP drafter's input); `final_hidden` is left empty. A
    /// speculative step verifies k drafts with a tail of k + 1.
    pub fn forward_tails(
        &self,
        batch: &mut [(&[u32], &mut SequenceState)],
        numerics: Numerics,
        tails: &[usize],
    ) -> Result<Vec<SeqOutput>, ModelError> {
        if tails.len() != batch.len() {
            return Err(ModelError::Input {
                field: "tails",
                problem: format!("{} tails for {} sequences", tails.len(), batch.len()),
            });
        }
        if let Some(i) = (0..batch.len()).find(|&i| tails[i] > batch[i].0.len()) {
            return Err(ModelError::Input {
                field: "tails",
                problem: format!("sequence {i} asks for {} logit rows of {} new tokens", tails[i], batch[i].0.len()),
            });
        }
        // The body of forward_rows, then the head over the tails alone.
        let (mut outs, _) = self.forward_rows(batch, numerics, false, LogitRows::None)?;
        let w = self.cfg.hc_mult * self.cfg.hidden_size;
        let v = self.cfg.vocab_size;
        let mut rows = Vec::new();
        for (o, &t) in outs.iter().zip(tails) {
            rows.extend_from_slice(&o.streams[o.streams.len() - t * w..]);
        }
        let m: usize = tails.iter().sum();
        let (logits, _) = if m > 0 { self.head_rows(&rows, m) } else { (Vec::new(), Vec::new()) };
        let mut at = 0;
        for (o, &t) in outs.iter_mut().zip(tails) {
            o.logits = logits[at * v..(at + t) * v].to_vec();
            at += t;
        }
        Ok(outs)
    }

    /// MTP head 0 (MODEL_V4.md §9): row t combines the main model's final streams at t
    /// (`streams` [T, hc, D]) with the embedding of the following token `next[t]`, runs the MTP
    /// block at the state's next positions, and returns logits [T, vocab] predicting token t+2.
    pub fn mtp_forward(
        &self,
        streams: &[f32],
        next: &[u32],
        state: &mut SequenceState,
        numerics: Numerics,
    ) -> Result<Vec<f32>, ModelError> {
        Ok(self.mtp_forward_out(streams, next, state, numerics)?.logits)
    }

    /// [`Model::mtp_forward`] with the MTP block's output streams [T, hc, D] too: applied
    /// autoregressively, as DeepSeek drafts with it, a draft's streams are the next row's input.
    pub fn mtp_forward_out(
        &self,
        streams: &[f32],
        next: &[u32],
        state: &mut SequenceState,
        numerics: Numerics,
    ) -> Result<SeqOutput, ModelError> {
        let m =
            self.mtp.first().ok_or(ModelError::Input { field: "mtp", problem: "the model has no MTP layer".into() })?;
        self.check_tokens(next)?;
        let (hc, d) = (self.cfg.hc_mult, self.cfg.hidden_size);
        let t = next.len();
        if streams.len() != t * hc * d {
            return Err(ModelError::Input {
                field: "streams",
                problem: format!("{} values for {t} tokens of {hc}x{d}", streams.len()),
            });
        }
        let eps = self.cfg.rms_norm_eps;
        let mut e: Vec<f32> =
            next.iter().flat_map(|id| self.embed[*id as usize * d..(*id as usize + 1) * d].to_vec()).collect();
        rms_norm_rows(&mut e, &m.enorm, eps);
        let mut h = streams.to_vec();
        rms_norm_rows(&mut h, &m.hnorm, eps);
        let ep = m.e_proj.forward(&e, t);
        let mut x = m.h_proj.forward(&h, t * hc);
        for ti in 0..t {
            for j in 0..hc {
                let row = &mut x[(ti * hc + j) * d..(ti * hc + j + 1) * d];
                for (r, v) in row.iter_mut().zip(&ep[ti * d..(ti + 1) * d]) {
                    *r += v;
                }
            }
        }
        let b = Batch {
            seqs: vec![SeqSpan { start: 0, len: t, pos0: state.len }],
            positions: (0..t).map(|i| (state.len + i) as i32).collect(),
            ids: next.to_vec(),
        };
        let mut states: Vec<&mut AttentionState> = state.layers.iter_mut().take(1).collect();
        self.run_block(&m.block, &mut x, &b, &mut states, numerics, &mut None, self.blocks.len())?;
        state.len += t;
        Ok(self.finish(&x, &b, &m.hc_head, &m.norm).remove(0))
    }
}
