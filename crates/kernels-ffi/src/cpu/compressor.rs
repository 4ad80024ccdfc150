//! The KV compressors' pooling (MODEL_V4.md §6), the specification a device compressor reproduces:
//! one compressed row from one window of per-token values and gates, softmax-pooled per channel.
//! HCA pools the window's `ratio` tokens; CSA and the indexer ("overlapping") pool 2·ratio slots,
//! the previous window's first-half series (`Ca`, absent for the first window: weight 0, as the
//! reference's -inf gate) and then this window's second-half series (`Cb`).

pub use crate::shapes::compressor::PoolShape;

/// The pooled row [width] of one window: `kv` and `gate` are the window's `ratio` tokens,
/// [ratio, token_width] each (gates with `ape` added); `prev` the previous window's `Ca` values and
/// gates, [ratio, width] each (overlapping shapes only). f32, per channel: max-subtracted softmax of
/// the slot gates, then the weighted sum of the slot values.
pub fn pool_window(shape: PoolShape, kv: &[f32], gate: &[f32], prev: Option<(&[f32], &[f32])>) -> Vec<f32> {
    let (w, cw, r) = (shape.width, shape.token_width(), shape.ratio);
    let off = if shape.overlap { w } else { 0 };
    let mut row = vec![0f32; w];
    let mut slots_v = Vec::with_capacity(2 * r);
    let mut slots_g = Vec::with_capacity(2 * r);
    for (c, out) in row.iter_mut().enumerate() {
        slots_v.clear();
        slots_g.clear();
        if let (true, Some((pv, pg))) = (shape.overlap, prev) {
            for t in 0..r {
                slots_v.push(pv[t * w + c]);
                slots_g.push(pg[t * w + c]);
            }
        }
        for t in 0..r {
            slots_v.push(kv[t * cw + off + c]);
            slots_g.push(gate[t * cw + off + c]);
        }
        let mx = slots_g.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b));
        let e: Vec<f32> = slots_g.iter().map(|g| (g - mx).exp()).collect();
        let mut sum = 0f32;
        for v in &e {
            sum += v;
        }
        let mut acc = 0f32;
        for (ev, v) in e.iter().zip(&slots_v) {
            acc += v * (ev / sum);
        }
        *out = acc;
    }
    row
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_gates_average_and_a_dominant_gate_selects() {
        let hca = PoolShape { ratio: 4, width: 2, overlap: false };
        let kv = [1.0, 10.0, 2.0, 20.0, 3.0, 30.0, 4.0, 40.0];
        assert_eq!(pool_window(hca, &kv, &[0.0; 8], None), vec![2.5, 25.0]);
        let mut g = [0.0f32; 8];
        g[5] = 100.0; // token 2, channel 1
        let row = pool_window(hca, &kv, &g, None);
        assert!((row[1] - 30.0).abs() < 1e-4 && (row[0] - 2.5).abs() < 1e-6);
        // Overlapping: the previous window's Ca slots join; without them only Cb counts.
        let csa = PoolShape { ratio: 2, width: 1, overlap: true };
        let kv = [9.0, 1.0, 9.0, 3.0]; // per token: [Ca, Cb]
        assert_eq!(pool_window(csa, &kv, &[0.0; 4], None), vec![2.0]);
        assert_eq!(pool_window(csa, &kv, &[0.0; 4], Some((&[5.0, 7.0], &[0.0, 0.0]))), vec![4.0]);
    }
}
