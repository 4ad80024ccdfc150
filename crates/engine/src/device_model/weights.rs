//! The device model's weights, read from the checkpoint in their stored formats (FP8 block-scaled
//! and FP4 bytes as they are, bf16 as bf16, f32 where the model computes in f32) straight into
//! device buffers: nothing is dequantised to f32 on the device.

use deepinfer_kernels_ffi::hc::HcSite;
use deepinfer_kernels_ffi::ops::{gemm_bf16, gemm_lowp, WeightFormat};
use deepinfer_kernels_ffi::{DeviceBuffer, GemmParams, Stream};
use deepinfer_moe::layer::{ExpertWeights, HashTable, MoeWeights};
use half::bf16;
use safetensors::Dtype;

use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::config::{AttentionKind, ModelConfig};
use crate::model::ModelError;

/// A dense projection `y[m, out] = x[m, inp]·Wᵀ` as stored: bf16, or FP8 e4m3 with ue8m0 scales
/// over 128×128 blocks.
pub(super) enum Dense {
    Bf16(DeviceBuffer<bf16>),
    Fp8 { w: DeviceBuffer<u8>, scale: DeviceBuffer<u8> },
}

pub(super) struct Linear {
    pub out: usize,
    pub inp: usize,
    pub w: Dense,
}

impl Linear {
    /// y = x·Wᵀ for m rows. `quantize`: the official FP8 rounding of x per 1×128 block before an FP8
    /// GEMM (bf16 weights never round x).
    pub fn run(
        &self,
        s: &Stream,
        x: &DeviceBuffer<bf16>,
        y: &mut DeviceBuffer<bf16>,
        m: usize,
        quantize: bool,
    ) -> Result<(), ModelError> {
        match &self.w {
            Dense::Bf16(w) => {
                gemm_bf16(s, x, w, y, &GemmParams::new(m as u32, self.out as u32, self.inp as u32, false))?
            }
            Dense::Fp8 { w, scale } => {
                let p = GemmParams::new(m as u32, self.out as u32, self.inp as u32, quantize);
                gemm_lowp(s, WeightFormat::Fp8Block128, x, w, scale, y, &p)?
            }
        }
        Ok(())
    }

    fn bytes(&self) -> usize {
        match &self.w {
            Dense::Bf16(w) => w.len() * 2,
            Dense::Fp8 { w, scale } => w.len() + scale.len(),
        }
    }
}

/// An mHC site: fn [width, n·D], base [width], scale [3] (or [1] for the head's collapse), f32.
pub(super) struct Site {
    pub fn_w: DeviceBuffer<f32>,
    pub base: DeviceBuffer<f32>,
    pub scale: DeviceBuffer<f32>,
}

impl Site {
    pub fn view(&self) -> HcSite<'_> {
        HcSite { fn_w: &self.fn_w, base: &self.base, scale: &self.scale }
    }
}

/// A compressor's weights: projections with f32 outputs (bf16 weights), ape [ratio, cw] and norm.
pub(super) struct Compressor {
    pub ratio: usize,
    pub width: usize,
    pub overlap: bool,
    /// [cw, D] bf16 each (cw = 2·width when overlapping).
    pub wkv: DeviceBuffer<bf16>,
    pub wgate: DeviceBuffer<bf16>,
    pub ape: DeviceBuffer<f32>,
    pub norm: DeviceBuffer<f32>,
}

impl Compressor {
    pub fn token_width(&self) -> usize {
        if self.overlap {
            2 * self.width
        } else {
            self.width
        }
    }
}

pub(super) struct Indexer {
    pub wq_b: Linear,
    /// [heads, D] bf16 (f32 outputs).
    pub weights_proj: DeviceBuffer<bf16>,
    pub compressor: Compressor,
}

pub(super) struct Attention {
    pub kind: AttentionKind,
    pub sink: DeviceBuffer<f32>,
    pub wq_a: Linear,
    pub q_norm: DeviceBuffer<bf16>,
    pub wq_b: Linear,
    pub wkv: Linear,
    pub kv_norm: DeviceBuffer<bf16>,
    /// wo_a split by head group: group g's [o_lora_rank, H·hd/G].
    pub wo_a: Vec<Linear>,
    pub wo_b: Linear,
    pub compressor: Option<Compressor>,
    pub indexer: Option<Indexer>,
}

pub(super) struct Block {
    pub attn_norm: DeviceBuffer<f32>,
    pub ffn_norm: DeviceBuffer<f32>,
    pub hc_attn: Site,
    pub hc_ffn: Site,
    pub attn: Attention,
    pub moe: MoeWeights,
}

pub(super) struct Weights {
    pub embed: DeviceBuffer<bf16>,
    /// [vocab, D] bf16: f32 logits.
    pub head: DeviceBuffer<bf16>,
    pub norm: DeviceBuffer<f32>,
    pub hc_head: Site,
    pub blocks: Vec<Block>,
    /// Bytes of every weight on the device.
    pub bytes: usize,
}

fn bad(name: &str, problem: String) -> ModelError {
    ModelError::Checkpoint(CheckpointError::Tensor { name: name.to_string(), file: String::new(), problem })
}

fn bf16_bits(bytes: &[u8]) -> Vec<bf16> {
    bytes.chunks_exact(2).map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))).collect()
}

/// Reads tensors of one checkpoint onto one stream, counting the bytes it placed.
pub(super) struct Loader<'a> {
    pub ck: &'a Checkpoint,
    pub cfg: &'a ModelConfig,
    pub s: &'a Stream,
    pub bytes: usize,
    /// The official activation rounding in the experts (see `MoeWeights::round_act`).
    pub round_act: bool,
}

impl Loader<'_> {
    fn check_shape(&self, name: &str, want: &[usize]) -> Result<(Dtype, Vec<u8>), ModelError> {
        let (dtype, shape, bytes) = self.ck.raw(name)?;
        // Packed FP4 stores [n, k/2] bytes for a logical [n, k].
        let logical: Vec<usize> =
            if dtype == Dtype::I8 && shape.len() == 2 { vec![shape[0], shape[1] * 2] } else { shape.to_vec() };
        if logical != want {
            return Err(bad(name, format!("shape {shape:?} ({dtype:?}), the configuration needs {want:?}")));
        }
        Ok((dtype, bytes.to_vec()))
    }

    /// A bf16 tensor (bf16 as stored; f32 rounded once).
    pub fn bf16(&mut self, name: &str, shape: &[usize]) -> Result<DeviceBuffer<bf16>, ModelError> {
        let (dtype, bytes) = self.check_shape(name, shape)?;
        let v = match dtype {
            Dtype::BF16 => bf16_bits(&bytes),
            Dtype::F32 | Dtype::F16 => self.ck.f32(name, shape, [128, 128])?.into_iter().map(bf16::from_f32).collect(),
            d => return Err(bad(name, format!("dtype {d:?}: a bf16 tensor is stored as BF16, F16 or F32"))),
        };
        self.bytes += v.len() * 2;
        Ok(self.s.upload(&v)?)
    }

    /// An f32 tensor (from any float dtype, exactly).
    pub fn f32(&mut self, name: &str, shape: &[usize]) -> Result<DeviceBuffer<f32>, ModelError> {
        self.check_shape(name, shape)?;
        let v = self.ck.f32(name, shape, [128, 128])?;
        self.bytes += v.len() * 4;
        Ok(self.s.upload(&v)?)
    }

    /// `{p}.weight` (+ `{p}.scale` when FP8) as a dense projection [out, inp].
    pub fn linear(&mut self, p: &str, out: usize, inp: usize) -> Result<Linear, ModelError> {
        let name = format!("{p}.weight");
        let (dtype, _, _) = self.ck.raw(&name)?;
        let w = match dtype {
            Dtype::F8_E4M3 => {
                let (w, scale) = self.lowp(p, WeightFormat::Fp8Block128, out, inp)?;
                Dense::Fp8 { w: self.s.upload(&w)?, scale: self.s.upload(&scale)? }
            }
            _ => Dense::Bf16(self.bf16(&name, &[out, inp])?),
        };
        let l = Linear { out, inp, w };
        if matches!(l.w, Dense::Fp8 { .. }) {
            self.bytes += l.bytes();
        }
        Ok(l)
    }

    /// Weight and scale bytes of `{p}` in `format` (checked against the logical [n, k]).
    fn lowp(&self, p: &str, format: WeightFormat, n: usize, k: usize) -> Result<(Vec<u8>, Vec<u8>), ModelError> {
        let (wn, sn) = (format!("{p}.weight"), format!("{p}.scale"));
        let (wd, w) = self.check_shape(&wn, &[n, k])?;
        let (want_w, want_s) = match format {
            WeightFormat::Fp8Block128 => (Dtype::F8_E4M3, [n.div_ceil(128), k.div_ceil(128)]),
            WeightFormat::Fp4Row32 => (Dtype::I8, [n, k / 32]),
        };
        if wd != want_w {
            return Err(bad(&wn, format!("dtype {wd:?}, expected {want_w:?} for {format:?}")));
        }
        let (sd, s) = self.check_shape(&sn, &want_s)?;
        if sd != Dtype::F8_E8M0 && sd != Dtype::U8 {
            return Err(bad(&sn, format!("dtype {sd:?}, expected F8_E8M0 scales")));
        }
        Ok((w, s))
    }

    pub fn site(
        &mut self,
        fn_name: &str,
        base: &str,
        scale: &str,
        width: usize,
        scales: usize,
    ) -> Result<Site, ModelError> {
        let nd = self.cfg.hc_mult * self.cfg.hidden_size;
        Ok(Site {
            fn_w: self.f32(fn_name, &[width, nd])?,
            base: self.f32(base, &[width])?,
            scale: self.f32(scale, &[scales])?,
        })
    }

    fn compressor(&mut self, p: &str, ratio: usize, width: usize, overlap: bool) -> Result<Compressor, ModelError> {
        let d = self.cfg.hidden_size;
        let cw = if overlap { 2 * width } else { width };
        Ok(Compressor {
            ratio,
            width,
            overlap,
            wkv: self.bf16(&format!("{p}.wkv.weight"), &[cw, d])?,
            wgate: self.bf16(&format!("{p}.wgate.weight"), &[cw, d])?,
            ape: self.f32(&format!("{p}.ape"), &[ratio, cw])?,
            norm: self.f32(&format!("{p}.norm.weight"), &[width])?,
        })
    }

    /// Every expert of `{f}.experts.*` (or the shared one, `{f}.shared_experts`) in one format,
    /// gate and up stacked.
    fn experts(&mut self, names: &[String], d: usize, inter: usize) -> Result<ExpertWeights, ModelError> {
        let first = format!("{}.w1.weight", names[0]);
        let format = match self.ck.raw(&first)?.0 {
            Dtype::F8_E4M3 => WeightFormat::Fp8Block128,
            Dtype::I8 => WeightFormat::Fp4Row32,
            other => {
                return Err(bad(
                    &first,
                    format!(
                        "dtype {other:?}: the device MoE runs FP8 (F8_E4M3) or FP4 (I8) experts as the official \
                         checkpoints store them; this checkpoint's bf16 experts run on the CPU model (--device cpu)"
                    ),
                ))
            }
        };
        let (mut w13, mut s13, mut w2, mut s2) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for p in names {
            for which in ["w1", "w3"] {
                let (w, s) = self.lowp(&format!("{p}.{which}"), format, inter, d)?;
                w13.extend_from_slice(&w);
                s13.extend_from_slice(&s);
            }
            let (w, s) = self.lowp(&format!("{p}.w2"), format, d, inter)?;
            w2.extend_from_slice(&w);
            s2.extend_from_slice(&s);
        }
        self.bytes += w13.len() + s13.len() + w2.len() + s2.len();
        Ok(ExpertWeights {
            format,
            count: names.len() as u32,
            w13: (self.s.upload(&w13)?, self.s.upload(&s13)?),
            w2: (self.s.upload(&w2)?, self.s.upload(&s2)?),
        })
    }

    pub fn block(&mut self, p: &str, kind: AttentionKind, hash: bool) -> Result<Block, ModelError> {
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
                wq_b: self.linear(&format!("{a}.indexer.wq_b"), c.index_heads * c.index_head_dim, c.q_lora_rank)?,
                weights_proj: self.bf16(&format!("{a}.indexer.weights_proj.weight"), &[c.index_heads, d])?,
                compressor: self.compressor(&format!("{a}.indexer.compressor"), c.csa_ratio, c.index_head_dim, true)?,
            })
        } else {
            None
        };
        let (g, olr) = (c.o_groups, c.o_lora_rank);
        let gin = h * hd / g;
        // wo_a [G·olr, gin]: group g's rows, each its own matrix (FP8 scale rows split alike).
        let wo_a = self.split_rows(&format!("{a}.wo_a"), g, olr, gin)?;
        let attn = Attention {
            kind,
            sink: self.f32(&format!("{a}.attn_sink"), &[h])?,
            wq_a: self.linear(&format!("{a}.wq_a"), c.q_lora_rank, d)?,
            q_norm: self.bf16(&format!("{a}.q_norm.weight"), &[c.q_lora_rank])?,
            wq_b: self.linear(&format!("{a}.wq_b"), h * hd, c.q_lora_rank)?,
            wkv: self.linear(&format!("{a}.wkv"), hd, d)?,
            kv_norm: self.bf16(&format!("{a}.kv_norm.weight"), &[hd])?,
            wo_a,
            wo_b: self.linear(&format!("{a}.wo_b"), d, g * olr)?,
            compressor,
            indexer,
        };
        let f = format!("{p}.ffn");
        let names: Vec<String> = (0..c.n_experts).map(|i| format!("{f}.experts.{i}")).collect();
        let routed = self.experts(&names, d, c.moe_intermediate)?;
        let shared = if c.n_shared_experts == 1 {
            Some(self.experts(&[format!("{f}.shared_experts")], d, c.moe_intermediate)?)
        } else {
            None
        };
        let (bias, hash_table) = if hash {
            let t = self.ck.i64(&format!("{f}.gate.tid2eid"), &[c.vocab_size, c.top_k])?;
            let t: Vec<i32> = t.iter().map(|v| *v as i32).collect();
            self.bytes += t.len() * 4;
            (None, Some(HashTable { tid2eid: self.s.upload(&t)?, vocab: c.vocab_size as u32 }))
        } else {
            (Some(self.f32(&format!("{f}.gate.bias"), &[c.n_experts])?), None)
        };
        let moe = MoeWeights {
            dim: d as u32,
            inter: c.moe_intermediate as u32,
            top_k: c.top_k as u32,
            scaling: c.routed_scaling_factor,
            limit: c.swiglu_limit,
            gate: self.bf16(&format!("{f}.gate.weight"), &[c.n_experts, d])?,
            bias,
            hash: hash_table,
            routed,
            shared,
            round_act: self.round_act,
        };
        let mix = (2 + c.hc_mult) * c.hc_mult;
        Ok(Block {
            attn_norm: self.f32(&format!("{p}.attn_norm.weight"), &[d])?,
            ffn_norm: self.f32(&format!("{p}.ffn_norm.weight"), &[d])?,
            hc_attn: self.site(
                &format!("{p}.hc_attn_fn"),
                &format!("{p}.hc_attn_base"),
                &format!("{p}.hc_attn_scale"),
                mix,
                3,
            )?,
            hc_ffn: self.site(
                &format!("{p}.hc_ffn_fn"),
                &format!("{p}.hc_ffn_base"),
                &format!("{p}.hc_ffn_scale"),
                mix,
                3,
            )?,
            attn,
            moe,
        })
    }

    /// `{p}` [groups·rows, k] as `groups` matrices of [rows, k] (FP8: rows a multiple of 128).
    fn split_rows(&mut self, p: &str, groups: usize, rows: usize, k: usize) -> Result<Vec<Linear>, ModelError> {
        let name = format!("{p}.weight");
        let (dtype, _, _) = self.ck.raw(&name)?;
        if dtype == Dtype::F8_E4M3 {
            if !rows.is_multiple_of(128) {
                return Err(bad(
                    &name,
                    format!("FP8 groups of {rows} rows do not align with the 128-row scale blocks"),
                ));
            }
            let (w, s) = self.lowp(p, WeightFormat::Fp8Block128, groups * rows, k)?;
            let (wg, sg) = (rows * k, rows / 128 * k.div_ceil(128));
            self.bytes += w.len() + s.len();
            return (0..groups)
                .map(|g| {
                    Ok(Linear {
                        out: rows,
                        inp: k,
                        w: Dense::Fp8 {
                            w: self.s.upload(&w[g * wg..(g + 1) * wg])?,
                            scale: self.s.upload(&s[g * sg..(g + 1) * sg])?,
                        },
                    })
                })
                .collect();
        }
        let (_, bytes) = self.check_shape(&name, &[groups * rows, k])?;
        let all: Vec<bf16> = if dtype == Dtype::BF16 {
            bf16_bits(&bytes)
        } else {
            self.ck.f32(&name, &[groups * rows, k], [128, 128])?.into_iter().map(bf16::from_f32).collect()
        };
        self.bytes += all.len() * 2;
        (0..groups)
            .map(|g| {
                Ok(Linear { out: rows, inp: k, w: Dense::Bf16(self.s.upload(&all[g * rows * k..(g + 1) * rows * k])?) })
            })
            .collect()
    }
}
