//! The MoE sublayer (MODEL_V4.md §8): router (score or hash), routed SwiGLU experts with clamps,
//! and the shared expert. Routing decisions come from `deepinfer-moe`, the definition the CUDA
//! path also tests against.

use deepinfer_moe::{Router, RoutingPolicy};

use super::linear::{silu, Linear};
use super::{Numerics, Trace};
use crate::quant;

/// One SwiGLU expert: w1 gate, w3 up, w2 down.
#[derive(Debug, Clone)]
pub struct Expert {
    pub w1: Linear,
    pub w2: Linear,
    pub w3: Linear,
}

#[derive(Debug, Clone)]
pub struct MoeBlock {
    /// [E, D]
    pub gate: Linear,
    /// Selection bias (score-routed layers).
    pub bias: Option<Vec<f32>>,
    /// [vocab, top_k] (hash-routed layers).
    pub tid2eid: Option<Vec<i64>>,
    pub router: Router,
    pub experts: Vec<Expert>,
    pub shared: Option<Expert>,
    pub limit: f32,
}

#[derive(Debug, thiserror::Error)]
pub enum MoeError {
    #[error("token id {token} is outside the hash table of {rows} rows")]
    TokenOutOfRange { token: u32, rows: usize },
    #[error("routing: {0}")]
    Routing(#[from] deepinfer_moe::RoutingError),
}

impl Expert {
    /// SwiGLU with clamps on x [n, D]: w2·(silu(min(w1x, L)) ⊙ clamp(w3x, ±L)), with the hidden
    /// activation scaled per row by `pre_scale` first when given (the reference's "weight before w2").
    fn forward(&self, x: &[f32], n: usize, limit: f32, pre_scale: Option<&[f32]>, official: bool) -> Vec<f32> {
        let g = self.w1.forward(x, n);
        let u = self.w3.forward(x, n);
        let inter = self.w1.out;
        let mut hdn: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(g.min(limit)) * u.clamp(-limit, limit)).collect();
        if let Some(s) = pre_scale {
            for (row, s) in hdn.chunks_exact_mut(inter).zip(s) {
                row.iter_mut().for_each(|v| *v *= s);
            }
        }
        if official {
            quant::fp8_round_trip(&mut hdn, 128, 1e-4);
        }
        self.w2.forward(&hdn, n)
    }
}

impl MoeBlock {
    /// MoE output [N, D] for the normalised input x [N, D] of tokens `ids`.
    pub fn forward(
        &self,
        x: &[f32],
        ids: &[u32],
        numerics: Numerics,
        trace: &mut Option<&mut Trace>,
        layer: usize,
    ) -> Result<Vec<f32>, MoeError> {
        let n = ids.len();
        let d = self.gate.inp;
        let official = numerics == Numerics::Official;
        let logits = self.gate.forward(x, n);
        let e = self.gate.out;
        let k = self.router.top_k();
        // Per expert: the tokens routed to it and their weights.
        let mut per_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); self.experts.len()];
        let mut chosen = Vec::with_capacity(n);
        for t in 0..n {
            let lt = &logits[t * e..(t + 1) * e];
            let r = match (&self.tid2eid, &self.bias) {
                (Some(table), _) => {
                    let row = ids[t] as usize;
                    let experts = table
                        .get(row * k..(row + 1) * k)
                        .ok_or(MoeError::TokenOutOfRange { token: ids[t], rows: table.len() / k })?;
                    self.router.route(lt, RoutingPolicy::Hash { experts })?
                }
                (None, Some(bias)) => self.router.route(lt, RoutingPolicy::Score { bias })?,
                (None, None) => self.router.route(lt, RoutingPolicy::Score { bias: &vec![0.0; e] })?,
            };
            for (ex, w) in r.experts.iter().zip(&r.weights) {
                per_expert[*ex as usize].push((t, *w));
            }
            let mut sorted = r.experts.clone();
            sorted.sort_unstable();
            chosen.push(sorted);
        }
        if let Some(tr) = trace.as_deref_mut() {
            tr.router_topk.insert(layer, chosen);
        }
        let xin: Vec<f32> = if official {
            let mut v = x.to_vec();
            quant::fp8_round_trip(&mut v, 128, 1e-4);
            v
        } else {
            x.to_vec()
        };
        // Experts in increasing id order, as the reference accumulates them.
        let mut routed = vec![0f32; n * d];
        for (ex, toks) in self.experts.iter().zip(&per_expert) {
            if toks.is_empty() {
                continue;
            }
            let xe: Vec<f32> = toks.iter().flat_map(|(t, _)| xin[t * d..(t + 1) * d].to_vec()).collect();
            let weights: Vec<f32> = toks.iter().map(|(_, w)| *w).collect();
            let pre = official.then_some(&weights[..]);
            let ye = ex.forward(&xe, toks.len(), self.limit, pre, official);
            for (i, (t, w)) in toks.iter().enumerate() {
                let scale = if official { 1.0 } else { *w };
                for (o, v) in routed[t * d..(t + 1) * d].iter_mut().zip(&ye[i * d..(i + 1) * d]) {
                    *o += v * scale;
                }
            }
        }
        if let Some(sh) = &self.shared {
            let ys = sh.forward(&xin, n, self.limit, None, official);
            for (o, v) in routed.iter_mut().zip(&ys) {
                *o += v;
            }
        }
        Ok(routed)
    }
}
