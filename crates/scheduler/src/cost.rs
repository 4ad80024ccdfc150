//! Step-time model: predicted time of a step from its tokens, their context lengths and the
//! model's shape, as FLOPs over the device's rate and bytes over its bandwidth, plus a per-step
//! overhead; calibrated from measured step times by least squares.
//!
//! The default device is one H200 (1,400 TFLOP/s FP8, 4.25 TB/s, the measured ceilings of
//! docs/GPU.md, at a 50% achieved fraction until measured) and the default model V4-Flash's shape
//! (about 13 B active parameters per token; KV per MODEL_V4.md §11). These are an analytic model,
//! not measurements: calibration replaces them once step timings exist.

use serde::Serialize;

/// Model shape as the cost model needs it.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ModelShape {
    /// Parameters touched per token (dense + shared + top-k experts).
    pub active_params: f64,
    /// Weight bytes of everything but the routed experts.
    pub dense_bytes: f64,
    /// Weight bytes of one routed expert, summed over layers.
    pub expert_bytes: f64,
    pub experts: f64,
    pub top_k: f64,
    pub layers: f64,
    pub heads: f64,
    pub head_dim: f64,
    pub window: f64,
    /// Fraction of layers that are CSA (ratio 4, top-k rows) and HCA (ratio 128, all rows).
    pub csa_layers: f64,
    pub hca_layers: f64,
    pub index_topk: f64,
    /// Bytes per KV row (FP8 nope + bf16 rope).
    pub kv_row_bytes: f64,
    /// Compressed KV bytes a token adds (for transfers between replicas and storage loads).
    pub kv_bytes_per_token: f64,
}

impl ModelShape {
    pub fn v4_flash() -> ModelShape {
        ModelShape {
            active_params: 13.0e9,
            dense_bytes: 6.0e9,
            // 3 x 4096 x 2048 FP4 weights (+ scales) per expert and layer, 43 layers.
            expert_bytes: 43.0 * 3.0 * 4096.0 * 2048.0 * 0.53,
            experts: 256.0,
            top_k: 6.0,
            layers: 43.0,
            heads: 64.0,
            head_dim: 512.0,
            window: 128.0,
            csa_layers: 21.0,
            hca_layers: 20.0,
            index_topk: 512.0,
            kv_row_bytes: 576.0,
            kv_bytes_per_token: 3_500.0,
        }
    }
}

/// A device's ceilings.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct DeviceRates {
    pub flops: f64,
    pub bytes_per_s: f64,
    /// Per-step fixed cost (launches, sampling, host work not overlapped), seconds.
    pub overhead: f64,
}

impl DeviceRates {
    pub fn h200() -> DeviceRates {
        DeviceRates { flops: 0.5 * 1.4e15, bytes_per_s: 0.8 * 4.25e12, overhead: 1.0e-3 }
    }

    /// A node of `gpus` H200s serving one replica with experts sharded across them (expert
    /// parallelism): rates add up; the step overhead grows by the all-to-all dispatch/combine
    /// (0.25 ms per extra GPU, an estimate until measured).
    pub fn h200_node(gpus: usize) -> DeviceRates {
        let g = gpus.max(1) as f64;
        let one = DeviceRates::h200();
        DeviceRates {
            flops: g * one.flops,
            bytes_per_s: g * one.bytes_per_s,
            overhead: one.overhead + 0.25e-3 * (g - 1.0),
        }
    }
}

/// One sequence's part of a step: `tokens` new tokens after `context` cached ones.
#[derive(Debug, Clone, Copy)]
pub struct StepItem {
    pub tokens: usize,
    pub context: usize,
}

/// A step's cost terms summed over its items, so adding one more item is O(1).
#[derive(Debug, Clone, Copy, Default)]
pub struct StepLoad {
    pub tokens: f64,
    pub attn_flops: f64,
    pub kv_bytes: f64,
}

impl StepLoad {
    pub fn plus(self, o: StepLoad) -> StepLoad {
        StepLoad {
            tokens: self.tokens + o.tokens,
            attn_flops: self.attn_flops + o.attn_flops,
            kv_bytes: self.kv_bytes + o.kv_bytes,
        }
    }
}

/// Predicted step time, with calibration.
#[derive(Debug, Clone, Serialize)]
pub struct CostModel {
    pub shape: ModelShape,
    pub rates: DeviceRates,
    /// Calibrated: time = scale * roofline + offset (initially 1 and the device overhead).
    pub scale: f64,
    pub offset: f64,
    #[serde(skip)]
    samples: Vec<(f64, f64)>,
}

impl CostModel {
    pub fn new(shape: ModelShape, rates: DeviceRates) -> CostModel {
        CostModel { shape, rates, scale: 1.0, offset: rates.overhead, samples: Vec::new() }
    }

    /// Attention FLOPs of one query at `pos`: window + selected compressed rows, QK and PV, all
    /// heads and layers.
    fn attn_flops(&self, pos: f64) -> f64 {
        let s = &self.shape;
        let window = s.window.min(pos + 1.0);
        let rows_per_layer =
            s.layers * window + s.csa_layers * (pos / 4.0).min(s.index_topk) + s.hca_layers * pos / 128.0;
        4.0 * s.heads * s.head_dim * rows_per_layer
    }

    /// KV bytes one query reads at `pos` (the single shared KV head is read once for all heads).
    fn kv_bytes(&self, pos: f64) -> f64 {
        let s = &self.shape;
        let rows = s.layers * s.window.min(pos + 1.0)
            + s.csa_layers * (pos / 4.0).min(s.index_topk)
            + s.hca_layers * pos / 128.0;
        rows * s.kv_row_bytes
    }

    /// One item's cost terms.
    pub fn item_load(&self, it: StepItem) -> StepLoad {
        // Attention over a chunk: its positions' cost, approximated at the chunk's middle; a decode
        // reads its whole context's selected KV once.
        let mid = it.context as f64 + it.tokens as f64 / 2.0;
        StepLoad {
            tokens: it.tokens as f64,
            attn_flops: it.tokens as f64 * self.attn_flops(mid),
            kv_bytes: if it.tokens == 1 { self.kv_bytes(it.context as f64) } else { 0.0 },
        }
    }

    /// Sum of the items' cost terms.
    pub fn load(&self, items: &[StepItem]) -> StepLoad {
        items.iter().fold(StepLoad::default(), |a, i| a.plus(self.item_load(*i)))
    }

    /// Roofline time of summed cost terms: max(FLOPs / rate, bytes / bandwidth).
    pub fn roofline_load(&self, l: StepLoad) -> f64 {
        let s = &self.shape;
        if l.tokens == 0.0 {
            return 0.0;
        }
        let flops = 2.0 * s.active_params * l.tokens + l.attn_flops;
        // Experts a step touches: each token picks top_k of E; expected distinct experts.
        let touched = s.experts * (1.0 - (1.0 - s.top_k / s.experts).powf(l.tokens));
        let bytes = s.dense_bytes + touched * s.expert_bytes + l.kv_bytes;
        (flops / self.rates.flops).max(bytes / self.rates.bytes_per_s)
    }

    /// The roofline time of a step (no calibration).
    pub fn roofline(&self, items: &[StepItem]) -> f64 {
        self.roofline_load(self.load(items))
    }

    /// Predicted time of summed cost terms.
    pub fn predict_load(&self, l: StepLoad) -> f64 {
        if l.tokens == 0.0 {
            return 0.0;
        }
        self.scale * self.roofline_load(l) + self.offset
    }

    /// Predicted step time, seconds.
    pub fn predict(&self, items: &[StepItem]) -> f64 {
        if items.is_empty() {
            return 0.0;
        }
        self.scale * self.roofline(items) + self.offset
    }

    /// Record a measured step time and refit scale and offset by least squares (both kept
    /// positive; with one distinct sample only the scale moves).
    pub fn observe(&mut self, items: &[StepItem], measured: f64) {
        let x = self.roofline(items);
        if x <= 0.0 || !measured.is_finite() || measured <= 0.0 {
            return;
        }
        self.samples.push((x, measured));
        if self.samples.len() > 256 {
            self.samples.remove(0);
        }
        let n = self.samples.len() as f64;
        let (mx, my) =
            (self.samples.iter().map(|s| s.0).sum::<f64>() / n, self.samples.iter().map(|s| s.1).sum::<f64>() / n);
        let sxx: f64 = self.samples.iter().map(|s| (s.0 - mx).powi(2)).sum();
        let sxy: f64 = self.samples.iter().map(|s| (s.0 - mx) * (s.1 - my)).sum();
        if sxx > 1e-18 * n {
            self.scale = (sxy / sxx).max(1e-3);
            self.offset = (my - self.scale * mx).max(0.0);
        } else {
            self.scale = ((my - self.offset) / mx).max(1e-3);
        }
    }

    /// The largest prefill chunk (at least 1 token, at most `max_tokens`) that keeps a step with
    /// `others` (the items already in it) within `budget` seconds.
    pub fn chunk_for_budget(&self, others: &[StepItem], context: usize, max_tokens: usize, budget: f64) -> usize {
        self.chunk_for_budget_load(self.load(others), context, max_tokens, budget)
    }

    /// As `chunk_for_budget`, with the other items already summed (O(log n) predictions of O(1)).
    pub fn chunk_for_budget_load(&self, base: StepLoad, context: usize, max_tokens: usize, budget: f64) -> usize {
        let fits = |n: usize| self.predict_load(base.plus(self.item_load(StepItem { tokens: n, context }))) <= budget;
        if max_tokens == 0 || !fits(1) {
            return max_tokens.min(1);
        }
        let (mut lo, mut hi) = (1usize, max_tokens);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_is_bandwidth_bound_and_prefill_compute_bound() {
        let m = CostModel::new(ModelShape::v4_flash(), DeviceRates::h200());
        let dec: Vec<StepItem> = (0..32).map(|_| StepItem { tokens: 1, context: 4096 }).collect();
        let pre = [StepItem { tokens: 8192, context: 0 }];
        let t_dec = m.predict(&dec);
        let t_pre = m.predict(&pre);
        assert!(t_dec > 0.005 && t_dec < 0.2, "{t_dec}");
        assert!(t_pre > 8192.0 * 2.0 * 13e9 / 0.7e15, "{t_pre}");
        // Longer prefix, same chunk: more attention, more time.
        assert!(
            m.predict(&[StepItem { tokens: 4096, context: 100_000 }])
                > m.predict(&[StepItem { tokens: 4096, context: 0 }])
        );
    }

    #[test]
    fn calibration_recovers_a_linear_truth() {
        let mut m = CostModel::new(ModelShape::v4_flash(), DeviceRates::h200());
        for n in [1usize, 64, 512, 2048, 8192] {
            let items = [StepItem { tokens: n, context: 1000 }];
            let truth = 1.7 * m.roofline(&items) + 0.004;
            m.observe(&items, truth);
        }
        assert!((m.scale - 1.7).abs() < 1e-6 && (m.offset - 0.004).abs() < 1e-9, "{} {}", m.scale, m.offset);
    }

    #[test]
    fn chunk_size_respects_the_time_budget() {
        let m = CostModel::new(ModelShape::v4_flash(), DeviceRates::h200());
        let decodes: Vec<StepItem> = (0..16).map(|_| StepItem { tokens: 1, context: 2000 }).collect();
        let n = m.chunk_for_budget(&decodes, 0, 100_000, 0.05);
        let mut items = decodes.clone();
        items.push(StepItem { tokens: n, context: 0 });
        assert!(m.predict(&items) <= 0.05);
        items.pop();
        items.push(StepItem { tokens: n + 1, context: 0 });
        assert!(m.predict(&items) > 0.05);
    }
}
