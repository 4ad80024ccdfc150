//! The model configuration: an HF `config.json` of `model_type: deepseek_v4`, read with every
//! field MODEL_V4.md §1 lists and checked for consistency. Every error names the field.

use std::path::Path;

use deepinfer_kv::{KvError, KvLayout, LayerGeometry};
use serde_json::Value;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path} is not valid JSON: {source}")]
    Json { path: String, source: serde_json::Error },
    #[error("config field `{field}`: {problem}")]
    Field { field: String, problem: String },
}

fn field(field: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError::Field { field: field.to_string(), problem: problem.into() }
}

/// What a layer's attention adds to the sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKind {
    /// Sliding window only (compress ratio 0).
    Sliding,
    /// Compressed sparse attention: ratio-4 overlapping compressor + lightning indexer top-k.
    Csa,
    /// Heavily compressed attention: non-overlapping ratio-128 compressor, all rows visible.
    Hca,
}

/// YaRN scaling of the compress rope.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct YarnConfig {
    pub factor: f32,
    pub original_max_position: u32,
    pub beta_fast: f32,
    pub beta_slow: f32,
}

/// FP8 block quantisation of the dense weights (`quantization_config`).
#[derive(Debug, Clone, PartialEq)]
pub struct QuantConfig {
    pub block: [usize; 2],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertDtype {
    /// Stored like the dense weights (bf16/f32, or FP8 when quantised).
    Dense,
    /// FP4 e2m1 packed two per byte with ue8m0 1x32 scales.
    Fp4,
}

/// A parsed and validated DeepSeek-V4 configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub sliding_window: usize,
    /// One kind per main layer, then one per MTP layer.
    pub attention: Vec<AttentionKind>,
    pub csa_ratio: usize,
    pub hca_ratio: usize,
    pub index_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub n_experts: usize,
    pub top_k: usize,
    pub n_shared_experts: usize,
    pub moe_intermediate: usize,
    pub num_hash_layers: usize,
    pub routed_scaling_factor: f32,
    pub swiglu_limit: f32,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub compress_rope_theta: f32,
    pub yarn: Option<YarnConfig>,
    pub num_mtp_layers: usize,
    pub tie_word_embeddings: bool,
    pub quant: Option<QuantConfig>,
    pub expert_dtype: ExpertDtype,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub max_position_embeddings: usize,
}

struct Reader<'a>(&'a Value);

impl Reader<'_> {
    fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }
    fn usize(&self, k: &str) -> Result<usize, ConfigError> {
        let v = self.get(k).ok_or_else(|| field(k, "missing"))?;
        v.as_u64().map(|u| u as usize).ok_or_else(|| field(k, format!("expected a non-negative integer, got {v}")))
    }
    fn usize_or(&self, k: &str, d: usize) -> Result<usize, ConfigError> {
        if self.get(k).is_some() {
            self.usize(k)
        } else {
            Ok(d)
        }
    }
    fn f32(&self, k: &str) -> Result<f32, ConfigError> {
        let v = self.get(k).ok_or_else(|| field(k, "missing"))?;
        let f = v.as_f64().ok_or_else(|| field(k, format!("expected a number, got {v}")))?;
        if !f.is_finite() {
            return Err(field(k, "must be finite"));
        }
        Ok(f as f32)
    }
    fn f32_or(&self, k: &str, d: f32) -> Result<f32, ConfigError> {
        if self.get(k).is_some() {
            self.f32(k)
        } else {
            Ok(d)
        }
    }
    fn str_or<'b>(&'b self, k: &str, d: &'b str) -> Result<&'b str, ConfigError> {
        match self.get(k) {
            None => Ok(d),
            Some(v) => v.as_str().ok_or_else(|| field(k, format!("expected a string, got {v}"))),
        }
    }
    fn bool_or(&self, k: &str, d: bool) -> Result<bool, ConfigError> {
        match self.get(k) {
            None => Ok(d),
            Some(v) => v.as_bool().ok_or_else(|| field(k, format!("expected true or false, got {v}"))),
        }
    }
    fn token_id(&self, k: &str) -> Result<Option<u32>, ConfigError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => {
                v.as_u64().map(|u| Some(u as u32)).ok_or_else(|| field(k, format!("expected a token id, got {v}")))
            }
        }
    }
}

impl ModelConfig {
    /// Read and validate `config.json`.
    pub fn from_file(path: &Path) -> Result<ModelConfig, ConfigError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io { path: p.clone(), source })?;
        let v: Value = serde_json::from_str(&text).map_err(|source| ConfigError::Json { path: p, source })?;
        ModelConfig::from_json(&v)
    }

    /// Validate a parsed `config.json`.
    pub fn from_json(v: &Value) -> Result<ModelConfig, ConfigError> {
        if !v.is_object() {
            return Err(field("(root)", "expected a JSON object"));
        }
        let r = Reader(v);
        match r.get("model_type").and_then(Value::as_str) {
            Some("deepseek_v4") => {}
            Some(other) => {
                return Err(field("model_type", format!("`{other}` is not supported (expected deepseek_v4)")))
            }
            None => return Err(field("model_type", "missing (expected deepseek_v4)")),
        }
        let num_layers = r.usize("num_hidden_layers")?;
        let num_mtp_layers = r.usize_or("num_nextn_predict_layers", 0)?;
        let head_dim = r.usize("head_dim")?;
        let hidden_size = r.usize("hidden_size")?;
        let num_heads = r.usize("num_attention_heads")?;
        let kv_heads = r.usize_or("num_key_value_heads", 1)?;
        if kv_heads != 1 {
            return Err(field("num_key_value_heads", format!("{kv_heads}: DeepSeek-V4 has one shared K=V head")));
        }
        let rope_dim = r.usize("qk_rope_head_dim")?;
        if rope_dim == 0 || rope_dim % 2 == 1 || rope_dim > head_dim {
            return Err(field(
                "qk_rope_head_dim",
                format!("{rope_dim} must be even, positive and <= head_dim {head_dim}"),
            ));
        }
        let o_groups = r.usize("o_groups")?;
        if o_groups == 0 || num_heads % o_groups != 0 {
            return Err(field("o_groups", format!("{o_groups} must divide num_attention_heads {num_heads}")));
        }

        let csa_ratio = r.usize_or("compress_rate_csa", 4)?;
        let hca_ratio = r.usize_or("compress_rate_hca", 128)?;
        let ratios = r.get("compress_ratios").ok_or_else(|| field("compress_ratios", "missing"))?;
        let ratios = ratios.as_array().ok_or_else(|| field("compress_ratios", "expected an array"))?;
        if ratios.len() < num_layers + num_mtp_layers {
            return Err(field(
                "compress_ratios",
                format!("{} entries for {num_layers} layers + {num_mtp_layers} MTP layers", ratios.len()),
            ));
        }
        let mut attention = Vec::new();
        for (i, rv) in ratios.iter().take(num_layers + num_mtp_layers).enumerate() {
            attention.push(match rv.as_u64() {
                Some(0) => AttentionKind::Sliding,
                Some(4) => AttentionKind::Csa,
                Some(128) => AttentionKind::Hca,
                _ => return Err(field(&format!("compress_ratios[{i}]"), format!("{rv}: expected 0, 4 or 128"))),
            });
        }
        let has_csa = attention.contains(&AttentionKind::Csa);
        let (index_heads, index_head_dim, index_topk) = if has_csa {
            let ihd = r.usize("index_head_dim")?;
            if ihd < rope_dim {
                return Err(field("index_head_dim", format!("{ihd} is smaller than qk_rope_head_dim {rope_dim}")));
            }
            (r.usize("index_n_heads")?, ihd, r.usize("index_topk")?)
        } else {
            (r.usize_or("index_n_heads", 0)?, r.usize_or("index_head_dim", 0)?, r.usize_or("index_topk", 0)?)
        };

        let n_experts = r.usize("n_routed_experts")?;
        let top_k = r.usize("num_experts_per_tok")?;
        if top_k == 0 || top_k > n_experts {
            return Err(field("num_experts_per_tok", format!("{top_k} must be in 1..={n_experts}")));
        }
        let n_shared_experts = r.usize_or("n_shared_experts", 1)?;
        if n_shared_experts > 1 {
            return Err(field("n_shared_experts", format!("{n_shared_experts}: only 0 or 1 is supported")));
        }
        let num_hash_layers = r.usize_or("num_hash_layers", 0)?;
        if num_hash_layers > num_layers {
            return Err(field("num_hash_layers", format!("{num_hash_layers} exceeds num_hidden_layers {num_layers}")));
        }
        let scoring = r.str_or("scoring_func", "sqrtsoftplus")?;
        if scoring != "sqrtsoftplus" {
            return Err(field("scoring_func", format!("`{scoring}` is not supported (expected sqrtsoftplus)")));
        }
        let topk_method = r.str_or("topk_method", "noaux_tc")?;
        if topk_method != "noaux_tc" {
            return Err(field("topk_method", format!("`{topk_method}` is not supported (expected noaux_tc)")));
        }
        if !r.bool_or("norm_topk_prob", true)? {
            return Err(field("norm_topk_prob", "false is not supported: V4 renormalises the chosen scores"));
        }
        let act = r.str_or("hidden_act", "silu")?;
        if act != "silu" {
            return Err(field("hidden_act", format!("`{act}` is not supported (expected silu)")));
        }

        let yarn = match r.get("rope_scaling") {
            None => None,
            Some(rs) => {
                let rr = Reader(rs);
                let ty = rr.get("type").or_else(|| rr.get("rope_type")).and_then(Value::as_str).unwrap_or("default");
                match ty {
                    "yarn" => Some(YarnConfig {
                        factor: rr
                            .f32("factor")
                            .map_err(|_| field("rope_scaling.factor", "missing or not a number"))?,
                        original_max_position: rr.usize("original_max_position_embeddings").map_err(|_| {
                            field("rope_scaling.original_max_position_embeddings", "missing or not an integer")
                        })? as u32,
                        beta_fast: rr.f32_or("beta_fast", 32.0)?,
                        beta_slow: rr.f32_or("beta_slow", 1.0)?,
                    }),
                    "default" => None,
                    other => {
                        return Err(field("rope_scaling.type", format!("`{other}` is not supported (yarn or default)")))
                    }
                }
            }
        };

        let quant = match r.get("quantization_config") {
            None => None,
            Some(q) => {
                let qr = Reader(q);
                let method = qr.str_or("quant_method", "")?;
                if method != "fp8" {
                    return Err(field(
                        "quantization_config.quant_method",
                        format!("`{method}` is not supported (fp8)"),
                    ));
                }
                let fmt = qr.str_or("fmt", "e4m3")?;
                if fmt != "e4m3" {
                    return Err(field("quantization_config.fmt", format!("`{fmt}` is not supported (e4m3)")));
                }
                let sf = qr.str_or("scale_fmt", "ue8m0")?;
                if sf != "ue8m0" {
                    return Err(field("quantization_config.scale_fmt", format!("`{sf}` is not supported (ue8m0)")));
                }
                let block = match qr.get("weight_block_size").and_then(Value::as_array) {
                    Some(b) if b.len() == 2 && b.iter().all(|x| x.as_u64().is_some_and(|x| x > 0)) => {
                        [b[0].as_u64().unwrap_or(128) as usize, b[1].as_u64().unwrap_or(128) as usize]
                    }
                    _ => return Err(field("quantization_config.weight_block_size", "expected two positive integers")),
                };
                Some(QuantConfig { block })
            }
        };
        // V4 ships `expert_dtype` at the top level; V4.1 moves it into quantization_config.
        let ed = r
            .get("expert_dtype")
            .or_else(|| r.get("quantization_config").and_then(|q| q.get("expert_dtype")))
            .map(|v| v.as_str().ok_or_else(|| field("expert_dtype", format!("expected a string, got {v}"))))
            .transpose()?;
        let expert_dtype = match ed {
            None | Some("bf16") | Some("fp8") => ExpertDtype::Dense,
            Some("fp4") => ExpertDtype::Fp4,
            Some(other) => return Err(field("expert_dtype", format!("`{other}` is not supported (fp4, fp8 or bf16)"))),
        };

        let cfg = ModelConfig {
            vocab_size: r.usize("vocab_size")?,
            hidden_size,
            num_layers,
            num_heads,
            head_dim,
            rope_dim,
            q_lora_rank: r.usize("q_lora_rank")?,
            o_groups,
            o_lora_rank: r.usize("o_lora_rank")?,
            sliding_window: r.usize("sliding_window")?,
            attention,
            csa_ratio,
            hca_ratio,
            index_heads,
            index_head_dim,
            index_topk,
            hc_mult: r.usize("hc_mult")?,
            hc_sinkhorn_iters: r.usize("hc_sinkhorn_iters")?,
            hc_eps: r.f32("hc_eps")?,
            n_experts,
            top_k,
            n_shared_experts,
            moe_intermediate: r.usize("moe_intermediate_size")?,
            num_hash_layers,
            routed_scaling_factor: r.f32_or("routed_scaling_factor", 1.0)?,
            swiglu_limit: r.f32("swiglu_limit")?,
            rms_norm_eps: r.f32("rms_norm_eps")?,
            rope_theta: r.f32("rope_theta")?,
            compress_rope_theta: r.f32("compress_rope_theta")?,
            yarn,
            num_mtp_layers,
            tie_word_embeddings: r.bool_or("tie_word_embeddings", false)?,
            quant,
            expert_dtype,
            bos_token_id: r.token_id("bos_token_id")?,
            eos_token_id: r.token_id("eos_token_id")?,
            max_position_embeddings: r.usize_or("max_position_embeddings", 1 << 20)?,
        };
        cfg.check_positive()?;
        Ok(cfg)
    }

    fn check_positive(&self) -> Result<(), ConfigError> {
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_heads),
            ("head_dim", self.head_dim),
            ("q_lora_rank", self.q_lora_rank),
            ("o_lora_rank", self.o_lora_rank),
            ("sliding_window", self.sliding_window),
            ("hc_mult", self.hc_mult),
            ("hc_sinkhorn_iters", self.hc_sinkhorn_iters),
            ("moe_intermediate_size", self.moe_intermediate),
            ("compress_rate_csa", self.csa_ratio),
            ("compress_rate_hca", self.hca_ratio),
        ] {
            if v == 0 {
                return Err(field(name, "must be positive"));
            }
        }
        if self.attention.contains(&AttentionKind::Csa) && (self.index_heads == 0 || self.index_topk == 0) {
            return Err(field("index_n_heads", "CSA layers need index_n_heads and index_topk > 0"));
        }
        if self.rms_norm_eps < 0.0 {
            return Err(field("rms_norm_eps", "must not be negative"));
        }
        Ok(())
    }

    /// The prefix cache's geometry of the main layers with rows of `elem_bytes`-byte values (4 on
    /// the reference model, 2 on the device model).
    pub fn kv_layout(&self, block_tokens: usize, elem_bytes: usize) -> Result<KvLayout, KvError> {
        let hd = self.head_dim * elem_bytes;
        let ihd = self.index_head_dim * elem_bytes;
        let layers = self.attention[..self.num_layers]
            .iter()
            .map(|kind| match kind {
                AttentionKind::Sliding => LayerGeometry {
                    ratio: 0,
                    overlap: false,
                    row_bytes: 0,
                    indexer_row_bytes: 0,
                    window_row_bytes: hd,
                    partial_token_bytes: 0,
                    indexer_partial_token_bytes: 0,
                },
                AttentionKind::Csa => LayerGeometry {
                    ratio: self.csa_ratio,
                    overlap: true,
                    row_bytes: hd,
                    indexer_row_bytes: ihd,
                    window_row_bytes: hd,
                    partial_token_bytes: 2 * 2 * hd,
                    indexer_partial_token_bytes: 2 * 2 * ihd,
                },
                AttentionKind::Hca => LayerGeometry {
                    ratio: self.hca_ratio,
                    overlap: false,
                    row_bytes: hd,
                    indexer_row_bytes: 0,
                    window_row_bytes: hd,
                    partial_token_bytes: 2 * hd,
                    indexer_partial_token_bytes: 0,
                },
            })
            .collect();
        KvLayout::new(block_tokens, self.sliding_window, layers)
    }

    /// The smallest block size that is a multiple of every compress ratio the main layers use and
    /// at least `min`.
    pub fn block_tokens_at_least(&self, min: usize) -> usize {
        let mut l = 1usize;
        for kind in [AttentionKind::Csa, AttentionKind::Hca] {
            let r = self.ratio(kind);
            if r > 0 && self.attention[..self.num_layers].contains(&kind) {
                l = l / gcd(l, r) * r;
            }
        }
        min.max(1).div_ceil(l) * l
    }

    /// Tokens a replay must recompute after a block-aligned restore for the rebuilt state to equal
    /// a cold run's: every layer's window ring depends on the previous layer's ring, so the
    /// receptive field is layers × (window − 1), plus a compressor's open and previous window.
    pub fn exact_replay_tokens(&self) -> usize {
        let w = self.sliding_window.saturating_sub(1);
        let comp = self.attention[..self.num_layers]
            .iter()
            .map(|kind| match kind {
                AttentionKind::Sliding => 0,
                AttentionKind::Csa => 2 * self.csa_ratio,
                AttentionKind::Hca => self.hca_ratio,
            })
            .max()
            .unwrap_or(0);
        self.num_layers * w + comp
    }

    /// Compress ratio of a layer kind.
    pub fn ratio(&self, kind: AttentionKind) -> usize {
        match kind {
            AttentionKind::Sliding => 0,
            AttentionKind::Csa => self.csa_ratio,
            AttentionKind::Hca => self.hca_ratio,
        }
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    pub(crate) fn tiny() -> Value {
        json!({
            "model_type": "deepseek_v4", "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 3,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "qk_rope_head_dim": 4,
            "q_lora_rank": 8, "o_groups": 2, "o_lora_rank": 4, "sliding_window": 4,
            "compress_ratios": [0, 4, 128, 0], "compress_rate_hca": 8, "index_n_heads": 2,
            "index_head_dim": 8, "index_topk": 2, "hc_mult": 2, "hc_sinkhorn_iters": 5, "hc_eps": 1e-6,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "moe_intermediate_size": 8, "num_hash_layers": 1, "routed_scaling_factor": 1.5,
            "swiglu_limit": 2.0, "rms_norm_eps": 1e-6, "rope_theta": 10000, "compress_rope_theta": 160000,
            "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                             "beta_fast": 32, "beta_slow": 1},
            "num_nextn_predict_layers": 1
        })
    }

    #[test]
    fn parses_layer_kinds_and_hca_override() {
        let c = ModelConfig::from_json(&tiny()).unwrap();
        assert_eq!(
            c.attention,
            vec![AttentionKind::Sliding, AttentionKind::Csa, AttentionKind::Hca, AttentionKind::Sliding]
        );
        assert_eq!(c.ratio(AttentionKind::Hca), 8);
        assert_eq!(c.yarn.unwrap().original_max_position, 64);
    }

    #[test]
    fn errors_name_the_field() {
        let cases: Vec<(&str, Value, &str)> = vec![
            ("hidden_size", Value::Null, "hidden_size"),
            ("num_key_value_heads", json!(2), "num_key_value_heads"),
            ("compress_ratios", json!([0, 5, 0, 0]), "compress_ratios[1]"),
            ("compress_ratios", json!([0, 4]), "compress_ratios"),
            ("o_groups", json!(3), "o_groups"),
            ("scoring_func", json!("softmax"), "scoring_func"),
            ("model_type", json!("llama"), "model_type"),
            ("rope_scaling", json!({"type": "yarn"}), "rope_scaling.factor"),
            ("qk_rope_head_dim", json!(5), "qk_rope_head_dim"),
            ("head_dim", json!("big"), "head_dim"),
            ("expert_dtype", json!("int3"), "expert_dtype"),
        ];
        for (key, val, want) in cases {
            let mut v = tiny();
            v[key] = val;
            let err = ModelConfig::from_json(&v).unwrap_err().to_string();
            assert!(err.contains(&format!("`{want}`")), "{key}: {err}");
        }
    }

    #[test]
    fn quantization_config_is_checked() {
        let mut v = tiny();
        v["quantization_config"] =
            json!({"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]});
        v["expert_dtype"] = json!("fp4");
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.quant, Some(QuantConfig { block: [128, 128] }));
        assert_eq!(c.expert_dtype, ExpertDtype::Fp4);
        v["quantization_config"]["quant_method"] = json!("awq");
        let err = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(err.contains("quantization_config.quant_method"), "{err}");
    }

    proptest::proptest! {
        /// Arbitrary JSON values in any field never panic the parser.
        #[test]
        fn never_panics(key in proptest::sample::select(vec!["hidden_size", "compress_ratios", "rope_scaling",
            "quantization_config", "o_groups", "index_topk", "hc_eps", "vocab_size"]), n in proptest::num::i64::ANY, s in ".{0,8}") {
            for val in [json!(n), json!(s), json!([n]), json!({"x": n}), json!(n as f64 / 3.0), Value::Null] {
                let mut v = tiny();
                v[key] = val;
                let _ = ModelConfig::from_json(&v);
            }
        }
    }
}
