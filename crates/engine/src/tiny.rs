//! Tiny random DeepSeek-V4 checkpoints under the official names, written as real safetensors
//! files (single or sharded with an index): the engine's built-in default model until a trained
//! one lands (its text is noise), and the tests' source of configurations other than the
//! fixtures'. Deterministic for a seed.

use std::collections::HashMap;
use std::path::Path;

use deepinfer_kernels_ffi::testing::SplitMix;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::{json, Value};

/// A tensor ready to write: name, dtype, shape, little-endian bytes.
pub type RawTensor = (String, Dtype, Vec<usize>, Vec<u8>);

/// Deterministic random numbers for weights: `kernels-ffi`'s SplitMix64 (the state is the seed
/// it advances), with the distributions the generator needs.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        let mut s = SplitMix(self.0);
        let v = s.next_u64();
        self.0 = s.0;
        v
    }
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Roughly normal (sum of uniforms), mean 0, sd ~1.
    pub fn normal(&mut self) -> f32 {
        (0..4).map(|_| self.unit()).sum::<f32>() * 1.732 - 3.464
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// A random small V4 config (official keys).
pub fn random_config(rng: &mut Rng) -> Value {
    let layers = 2 + rng.below(3) as usize;
    let mut ratios: Vec<u64> = (0..layers).map(|_| [0u64, 4, 128][rng.below(3) as usize]).collect();
    ratios.push(0); // MTP layer: sliding
    let head_dim = [16u64, 32][rng.below(2) as usize];
    let mut pick = |choices: &[u64]| choices[rng.below(choices.len() as u64) as usize];
    let (hidden, heads, rope) = (pick(&[32, 64]), pick(&[2, 4]), pick(&[4, 8]));
    let (hca, hc) = (pick(&[4, 8]), pick(&[2, 4]));
    let (vocab, window, topk, iters, hash) =
        (40 + rng.below(40), 2 + rng.below(6), 1 + rng.below(3), 1 + rng.below(20), rng.below(2));
    json!({
        "model_type": "deepseek_v4",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "qk_rope_head_dim": rope,
        "q_lora_rank": 16,
        "o_groups": 2,
        "o_lora_rank": 8,
        "sliding_window": window,
        "compress_ratios": ratios,
        "compress_rate_hca": hca,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": topk,
        "hc_mult": hc,
        "hc_sinkhorn_iters": iters,
        "hc_eps": 1e-6,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 16,
        "num_hash_layers": hash,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 1.5,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1},
        "num_nextn_predict_layers": 1
    })
}

/// A field of a config made by this module (random_config / builtin_config).
fn u(v: &Value, k: &str) -> usize {
    v[k].as_u64().unwrap() as usize
}

/// (name, shape, kind) of every tensor, as make_tiny_v4.py's `official_param_specs`.
fn specs(c: &Value) -> Vec<(String, Vec<usize>, &'static str)> {
    let (d, v, h, hd) = (u(c, "hidden_size"), u(c, "vocab_size"), u(c, "num_attention_heads"), u(c, "head_dim"));
    let (qr, og, olr, inter, e, k) = (
        u(c, "q_lora_rank"),
        u(c, "o_groups"),
        u(c, "o_lora_rank"),
        u(c, "moe_intermediate_size"),
        u(c, "n_routed_experts"),
        u(c, "num_experts_per_tok"),
    );
    let (hc, ih, ihd) = (u(c, "hc_mult"), u(c, "index_n_heads"), u(c, "index_head_dim"));
    let hca = c.get("compress_rate_hca").and_then(Value::as_u64).unwrap_or(128) as usize;
    let mix = (2 + hc) * hc;
    let ratios: Vec<usize> =
        c["compress_ratios"].as_array().unwrap().iter().map(|r| r.as_u64().unwrap() as usize).collect();
    let n_main = u(c, "num_hidden_layers");
    let mut s: Vec<(String, Vec<usize>, &str)> = vec![
        ("embed.weight".into(), vec![v, d], "embed"),
        ("head.weight".into(), vec![v, d], "lin"),
        ("norm.weight".into(), vec![d], "norm"),
        ("hc_head_fn".into(), vec![hc, hc * d], "hcfn"),
        ("hc_head_base".into(), vec![hc], "hcbase"),
        ("hc_head_scale".into(), vec![1], "hcscale"),
    ];
    let block = |p: &str, ratio: usize, hash: bool, s: &mut Vec<(String, Vec<usize>, &'static str)>| {
        s.push((format!("{p}.attn_norm.weight"), vec![d], "norm"));
        s.push((format!("{p}.ffn_norm.weight"), vec![d], "norm"));
        for w in ["attn", "ffn"] {
            s.push((format!("{p}.hc_{w}_fn"), vec![mix, hc * d], "hcfn"));
            s.push((format!("{p}.hc_{w}_base"), vec![mix], "hcbase"));
            s.push((format!("{p}.hc_{w}_scale"), vec![3], "hcscale"));
        }
        let a = format!("{p}.attn");
        s.push((format!("{a}.attn_sink"), vec![h], "sink"));
        s.push((format!("{a}.wq_a.weight"), vec![qr, d], "lin"));
        s.push((format!("{a}.q_norm.weight"), vec![qr], "norm"));
        s.push((format!("{a}.wq_b.weight"), vec![h * hd, qr], "lin"));
        s.push((format!("{a}.wkv.weight"), vec![hd, d], "lin"));
        s.push((format!("{a}.kv_norm.weight"), vec![hd], "norm"));
        s.push((format!("{a}.wo_a.weight"), vec![og * olr, h * hd / og], "lin"));
        s.push((format!("{a}.wo_b.weight"), vec![d, og * olr], "lin"));
        if ratio > 0 {
            let r = if ratio == 128 { hca } else { ratio };
            let coff = if ratio == 4 { 2 } else { 1 };
            s.push((format!("{a}.compressor.ape"), vec![r, coff * hd], "ape"));
            s.push((format!("{a}.compressor.wkv.weight"), vec![coff * hd, d], "lin"));
            s.push((format!("{a}.compressor.wgate.weight"), vec![coff * hd, d], "lin"));
            s.push((format!("{a}.compressor.norm.weight"), vec![hd], "norm"));
            if ratio == 4 {
                s.push((format!("{a}.indexer.wq_b.weight"), vec![ih * ihd, qr], "lin"));
                s.push((format!("{a}.indexer.weights_proj.weight"), vec![ih, d], "lin"));
                s.push((format!("{a}.indexer.compressor.ape"), vec![4, 2 * ihd], "ape"));
                s.push((format!("{a}.indexer.compressor.wkv.weight"), vec![2 * ihd, d], "lin"));
                s.push((format!("{a}.indexer.compressor.wgate.weight"), vec![2 * ihd, d], "lin"));
                s.push((format!("{a}.indexer.compressor.norm.weight"), vec![ihd], "norm"));
            }
        }
        let f = format!("{p}.ffn");
        s.push((format!("{f}.gate.weight"), vec![e, d], "lin"));
        if hash {
            s.push((format!("{f}.gate.tid2eid"), vec![v, k], "tid2eid"));
        } else {
            s.push((format!("{f}.gate.bias"), vec![e], "gbias"));
        }
        for x in 0..e {
            s.push((format!("{f}.experts.{x}.w1.weight"), vec![inter, d], "lin"));
            s.push((format!("{f}.experts.{x}.w2.weight"), vec![d, inter], "lin"));
            s.push((format!("{f}.experts.{x}.w3.weight"), vec![inter, d], "lin"));
        }
        s.push((format!("{f}.shared_experts.w1.weight"), vec![inter, d], "lin"));
        s.push((format!("{f}.shared_experts.w2.weight"), vec![d, inter], "lin"));
        s.push((format!("{f}.shared_experts.w3.weight"), vec![inter, d], "lin"));
    };
    for (i, ratio) in ratios.iter().enumerate().take(n_main) {
        block(&format!("layers.{i}"), *ratio, i < u(c, "num_hash_layers"), &mut s);
    }
    for j in 0..u(c, "num_nextn_predict_layers") {
        let p = format!("mtp.{j}");
        block(&p, ratios[n_main + j], false, &mut s);
        for (n, sh, kind) in [
            ("e_proj.weight", vec![d, d], "lin"),
            ("h_proj.weight", vec![d, d], "lin"),
            ("enorm.weight", vec![d], "norm"),
            ("hnorm.weight", vec![d], "norm"),
            ("norm.weight", vec![d], "norm"),
            ("hc_head_fn", vec![hc, hc * d], "hcfn"),
            ("hc_head_base", vec![hc], "hcbase"),
            ("hc_head_scale", vec![1], "hcscale"),
        ] {
            s.push((format!("{p}.{n}"), sh, kind));
        }
    }
    s
}

/// Random tensors for `c` (f32 except embeddings/linears in bf16), as (name, dtype, shape, bytes).
pub fn random_tensors(c: &Value, rng: &mut Rng) -> Vec<RawTensor> {
    random_tensors_except(c, rng, &|_| false)
}

/// [`random_tensors`] without the tensors `skip` names.
fn random_tensors_except(c: &Value, rng: &mut Rng, skip: &dyn Fn(&str) -> bool) -> Vec<RawTensor> {
    let e = u(c, "n_routed_experts") as u64;
    specs(c)
        .into_iter()
        .filter(|(name, _, _)| !skip(name))
        .map(|(name, shape, kind)| {
            let n: usize = shape.iter().product();
            let fan_in = *shape.last().unwrap() as f32;
            if kind == "tid2eid" {
                let k = shape[1];
                let mut bytes = Vec::new();
                for _ in 0..shape[0] {
                    let mut row: Vec<i64> = (0..e as i64).collect();
                    for i in (1..row.len()).rev() {
                        row.swap(i, rng.below(i as u64 + 1) as usize);
                    }
                    row[..k].iter().for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
                }
                return (name, Dtype::I64, shape, bytes);
            }
            let vals: Vec<f32> = (0..n)
                .map(|_| match kind {
                    "lin" | "hcfn" => rng.normal() / fan_in.sqrt(),
                    "embed" | "sink" => rng.normal(),
                    "norm" => 1.0 + 0.1 * rng.normal(),
                    "hcbase" | "ape" => 0.5 * rng.normal(),
                    "hcscale" => 0.5 + rng.unit(),
                    "gbias" => 0.3 * rng.normal(),
                    _ => unreachable!("{kind}"),
                })
                .collect();
            if matches!(kind, "lin" | "embed" | "norm") {
                let b: Vec<u8> = vals.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
                (name, Dtype::BF16, shape, b)
            } else {
                (name, Dtype::F32, shape, vals.iter().flat_map(|v| v.to_le_bytes()).collect())
            }
        })
        .collect()
}

/// Write tensors as safetensors files: one `model.safetensors`, or `shards` files plus
/// `model.safetensors.index.json`.
pub fn write_checkpoint(dir: &Path, tensors: &[RawTensor], shards: usize) -> std::io::Result<()> {
    let mut groups: Vec<Vec<&RawTensor>> = vec![Vec::new(); shards.max(1)];
    for (i, t) in tensors.iter().enumerate() {
        groups[i % shards.max(1)].push(t);
    }
    let mut weight_map = serde_json::Map::new();
    for (gi, g) in groups.iter().enumerate() {
        let file = if shards <= 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{shards:05}.safetensors", gi + 1)
        };
        let views = g
            .iter()
            .map(|(n, dt, sh, b)| TensorView::new(*dt, sh.clone(), b).map(|v| (n.clone(), v)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(std::io::Error::other)?;
        let bytes =
            safetensors::tensor::serialize(views, None::<HashMap<String, String>>).map_err(std::io::Error::other)?;
        std::fs::write(dir.join(&file), bytes)?;
        for (n, ..) in g {
            weight_map.insert(n.clone(), json!(file));
        }
    }
    if shards > 1 {
        let idx = json!({"metadata": {}, "weight_map": weight_map});
        std::fs::write(dir.join("model.safetensors.index.json"), idx.to_string())?;
    }
    Ok(())
}

/// Which stored format a weight of the official V4 checkpoints takes: FP8 (e4m3, ue8m0 scales per
/// 128x128 block) for the attention projections and the shared expert, FP4 (e2m1 packed two a byte,
/// ue8m0 scales per 1x32) for the routed experts, bf16/f32 for the rest.
fn official_format(name: &str) -> Option<deepinfer_kernels_ffi::ops::WeightFormat> {
    use deepinfer_kernels_ffi::ops::WeightFormat;
    const FP8: [&str; 9] = [
        ".attn.wq_a.weight",
        ".attn.wq_b.weight",
        ".attn.wkv.weight",
        ".attn.wo_a.weight",
        ".attn.wo_b.weight",
        ".attn.indexer.wq_b.weight",
        ".shared_experts.w1.weight",
        ".shared_experts.w2.weight",
        ".shared_experts.w3.weight",
    ];
    if FP8.iter().any(|f| name.ends_with(f)) {
        Some(WeightFormat::Fp8Block128)
    } else if name.contains(".experts.") && !name.contains("shared") {
        Some(WeightFormat::Fp4Row32)
    } else {
        None
    }
}

/// The ue8m0 byte of a power of two.
fn e8m0_code(s: f32) -> u8 {
    ((s.to_bits() >> 23) & 0xff) as u8
}

/// An [n, k] f32 weight as e4m3 codes and ue8m0 scales per 128x128 block (the official layout).
pub fn quantize_fp8_blocks(w: &[f32], n: usize, k: usize) -> (Vec<u8>, Vec<u8>) {
    use deepinfer_kernels_ffi::quant::{e4m3_code, pow2_ceil_bits, round_e4m3};
    let (nb, kb) = (n.div_ceil(128), k.div_ceil(128));
    let mut scales = vec![0u8; nb * kb];
    let mut codes = vec![0u8; n * k];
    for bi in 0..nb {
        for bj in 0..kb {
            let (r1, c1) = ((bi * 128 + 128).min(n), (bj * 128 + 128).min(k));
            let amax = (bi * 128..r1)
                .flat_map(|r| w[r * k + bj * 128..r * k + c1].iter())
                .fold(1e-4f32, |m, v| m.max(v.abs()));
            let sc = pow2_ceil_bits(amax / 448.0);
            scales[bi * kb + bj] = e8m0_code(sc);
            for r in bi * 128..r1 {
                for c in bj * 128..c1 {
                    codes[r * k + c] = e4m3_code(round_e4m3(w[r * k + c] / sc));
                }
            }
        }
    }
    (codes, scales)
}

/// An [n, k] f32 weight (k % 32 == 0) as packed e2m1 codes (element 2j in the low nibble of byte j)
/// and ue8m0 scales per 1x32 block.
pub fn quantize_fp4_rows(w: &[f32], n: usize, k: usize) -> (Vec<u8>, Vec<u8>) {
    use deepinfer_kernels_ffi::quant::{pow2_ceil_bits, round_e2m1, FP4_LUT};
    let mut packed = vec![0u8; n * k / 2];
    let mut scales = vec![0u8; n * k / 32];
    for (b, blk) in w.chunks_exact(32).enumerate() {
        let amax = blk.iter().fold(6.0 * 2f32.powi(-126), |m, v| m.max(v.abs()));
        let sc = pow2_ceil_bits(amax / 6.0);
        scales[b] = e8m0_code(sc);
        for (i, v) in blk.iter().enumerate() {
            let q = round_e2m1(v / sc);
            let mag = FP4_LUT[..8].iter().position(|x| *x == q.abs()).unwrap_or(0) as u8;
            let code = mag | if q.is_sign_negative() && mag != 0 { 8 } else { 0 };
            let at = (b * 32 + i) / 2;
            packed[at] |= if i % 2 == 0 { code } else { code << 4 };
        }
    }
    (packed, scales)
}

/// `tensors` with the weights of the official FP8/FP4 formats quantised as the official
/// checkpoints store them (see [`official_format`]): `<p>.weight` becomes the codes (F8_E4M3, or I8
/// holding the packed FP4 bytes, [n, k/2]) beside `<p>.scale` (F8_E8M0).
pub fn quantize_tensors(tensors: Vec<RawTensor>) -> Vec<RawTensor> {
    use deepinfer_kernels_ffi::ops::WeightFormat;
    let mut out = Vec::with_capacity(tensors.len() * 2);
    for (name, dtype, shape, bytes) in tensors {
        let Some(format) = official_format(&name) else {
            out.push((name, dtype, shape, bytes));
            continue;
        };
        let (n, k) = (shape[0], shape[1]);
        let w: Vec<f32> = bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
        let stem = name.trim_end_matches(".weight").to_string();
        match format {
            WeightFormat::Fp8Block128 => {
                let (codes, scales) = quantize_fp8_blocks(&w, n, k);
                out.push((name, Dtype::F8_E4M3, shape, codes));
                out.push((format!("{stem}.scale"), Dtype::F8_E8M0, vec![n.div_ceil(128), k.div_ceil(128)], scales));
            }
            WeightFormat::Fp4Row32 => {
                let (packed, scales) = quantize_fp4_rows(&w, n, k);
                out.push((name, Dtype::I8, vec![n, k / 2], packed));
                out.push((format!("{stem}.scale"), Dtype::F8_E8M0, vec![n, k / 32], scales));
            }
        }
    }
    out
}

/// `c` declaring the official formats (`quantization_config`, `expert_dtype: fp4`), written as
/// `dir/config.json` (the directory made first).
fn write_official_config(dir: &Path, c: &Value) -> std::io::Result<Value> {
    std::fs::create_dir_all(dir)?;
    let mut c = c.clone();
    c["quantization_config"] = json!({
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]
    });
    c["expert_dtype"] = json!("fp4");
    std::fs::write(dir.join("config.json"), c.to_string())?;
    Ok(c)
}

/// Write a random model for `c` in the official checkpoint formats (FP8 attention projections and
/// shared expert, FP4 routed experts: [`quantize_tensors`]) into `dir`; the written config.json
/// declares them (`quantization_config`, `expert_dtype: fp4`).
pub fn write_quantized_model(dir: &Path, c: &Value, seed: u64, shards: usize) -> std::io::Result<()> {
    let c = write_official_config(dir, c)?;
    let tensors = quantize_tensors(random_tensors(&c, &mut Rng(seed)));
    write_checkpoint(dir, &tensors, shards)
}

/// A routed expert's matrix drawn directly in FP4 (random e2m1 codes, every code equally likely,
/// with ue8m0 scales of 2^-e giving entries of about 1/sqrt(k)): at V4-Flash sizes (3.2 GB of
/// experts a layer) drawing normals and quantising them would take minutes a layer.
fn random_fp4(rng: &mut Rng, n: usize, k: usize) -> (Vec<u8>, Vec<u8>) {
    let mut packed = vec![0u8; n * k / 2];
    for chunk in packed.chunks_mut(8) {
        let v = rng.next_u64().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    // Codes average |v| ~ 2.4 (rms ~ 3.1): scale so the entries' rms is ~ 1/sqrt(k).
    let scale = quant_pow2(1.0 / (3.1 * (k as f32).sqrt()));
    (packed, vec![e8m0_code(scale); n * k / 32])
}

/// The power of two nearest below or at x.
fn quant_pow2(x: f32) -> f32 {
    f32::from_bits(x.to_bits() & 0xff80_0000)
}

/// The V4-Flash configuration (MODEL_V4.md §1) cut to `layers` layers (the schedule's first
/// layers: two sliding, then CSA and HCA alternating; hash routing in the first three) and
/// `experts` routed experts (256 in the real model).
pub fn v4_flash_config(layers: usize, experts: usize) -> Value {
    let ratios: Vec<u64> = (0..layers)
        .map(|i| {
            if i < 2 {
                0
            } else if i % 2 == 0 {
                4
            } else {
                128
            }
        })
        .collect();
    json!({
        "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": layers,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
        "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
        "compress_ratios": ratios, "compress_rate_hca": 128, "index_n_heads": 64, "index_head_dim": 128,
        "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "n_routed_experts": experts,
        "num_experts_per_tok": 6usize.min(experts), "n_shared_experts": 1, "moe_intermediate_size": 2048,
        "num_hash_layers": 3usize.min(layers), "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-6, "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "num_nextn_predict_layers": 0, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": false
    })
}

/// [`write_quantized_model`] with the routed experts drawn directly in FP4 ([`random_fp4`]) instead
/// of quantised from normals: for checkpoints at V4-Flash sizes. `progress(done, total)` per layer.
pub fn write_random_official(
    dir: &Path,
    c: &Value,
    seed: u64,
    shards: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> std::io::Result<()> {
    let c = write_official_config(dir, c)?;
    let is_routed = |name: &str| name.contains(".experts.");
    let mut rng = Rng(seed);
    let mut tensors = quantize_tensors(random_tensors_except(&c, &mut rng, &is_routed));
    let (d, inter, e) = (u(&c, "hidden_size"), u(&c, "moe_intermediate_size"), u(&c, "n_routed_experts"));
    let layers = u(&c, "num_hidden_layers") + u(&c, "num_nextn_predict_layers");
    let n_main = u(&c, "num_hidden_layers");
    for l in 0..layers {
        let p = if l < n_main { format!("layers.{l}.ffn") } else { format!("mtp.{}.ffn", l - n_main) };
        for x in 0..e {
            for (w, n, k) in [("w1", inter, d), ("w2", d, inter), ("w3", inter, d)] {
                let (packed, scales) = random_fp4(&mut rng, n, k);
                tensors.push((format!("{p}.experts.{x}.{w}.weight"), Dtype::I8, vec![n, k / 2], packed));
                tensors.push((format!("{p}.experts.{x}.{w}.scale"), Dtype::F8_E8M0, vec![n, k / 32], scales));
            }
        }
        progress(l + 1, layers);
    }
    write_checkpoint(dir, &tensors, shards)
}

/// Write a random model for `c` (config.json + checkpoint) into `dir`.
pub fn write_model(dir: &Path, c: &Value, seed: u64, shards: usize) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("config.json"), c.to_string())?;
    let tensors = random_tensors(c, &mut Rng(seed));
    write_checkpoint(dir, &tensors, shards)
}

/// The built-in default: a 2-layer model (one CSA, one HCA layer, one hash layer, MTP) with the
/// DeepSeek V4 tokenizer's 129,280-token vocabulary and deterministic random weights.
pub fn builtin_config() -> Value {
    json!({
        "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "qk_rope_head_dim": 8,
        "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8, "sliding_window": 16,
        "compress_ratios": [4, 128, 0], "compress_rate_hca": 16, "index_n_heads": 2, "index_head_dim": 16,
        "index_topk": 4, "hc_mult": 2, "hc_sinkhorn_iters": 10, "hc_eps": 1e-6, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 16, "num_hash_layers": 1,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "compress_rope_theta": 160000, "rope_scaling": {"type": "yarn", "factor": 16,
        "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
        "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1
    })
}

#[cfg(test)]
mod official_tests {
    use super::*;
    use crate::config::ModelConfig;

    #[test]
    fn v4_flash_configs_parse_with_the_real_schedule() {
        let c = ModelConfig::from_json(&v4_flash_config(43, 256)).unwrap();
        assert_eq!(c.attention.iter().filter(|k| **k == crate::AttentionKind::Csa).count(), 21);
        assert_eq!(c.attention.iter().filter(|k| **k == crate::AttentionKind::Hca).count(), 20);
        let short = ModelConfig::from_json(&v4_flash_config(4, 16)).unwrap();
        assert_eq!(short.num_layers, 4);
        assert_eq!(short.top_k, 6);
    }

    #[test]
    fn fp4_and_fp8_quantisers_round_trip_through_the_dequantisers() {
        use deepinfer_kernels_ffi::quant::{dequant_fp4_rows, dequant_fp8_blocks, round_e2m1};
        let mut rng = Rng(3);
        let (n, k) = (130, 256);
        let w: Vec<f32> = (0..n * k).map(|_| rng.normal() * 0.05).collect();
        let (codes, scales) = quantize_fp8_blocks(&w, n, k);
        let back = dequant_fp8_blocks(&codes, &scales, n, k, [128, 128]);
        let rel = w.iter().zip(&back).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / 0.2;
        assert!(rel < 0.1, "fp8 round trip {rel}");
        let (packed, s4) = quantize_fp4_rows(&w, n, k);
        let back4 = dequant_fp4_rows(&packed, &s4, n, k);
        // Every dequantised FP4 value is the rounding of its input at its block scale.
        for (i, (a, b)) in w.iter().zip(&back4).enumerate() {
            let sc = deepinfer_kernels_ffi::quant::e8m0_to_f32(s4[i / 32]);
            assert_eq!(*b, round_e2m1(a / sc) * sc, "element {i}");
        }
    }
}
