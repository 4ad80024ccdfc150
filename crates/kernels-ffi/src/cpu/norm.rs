//! RMSNorm: out = w ⊙ (x · (mean(x²) + ε)^−½), in f32, rounded once to the output type.

use crate::element::Element;
use crate::params::RmsNormParams;

/// Sum of squares with 8 independent f32 accumulators (vectorises, and keeps the rounding error
/// of long rows well below the 1e-6 relative the parity tests allow).
fn sum_squares<T: Element>(x: &[T]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            let f = v.to_f32();
            *a += f * f;
        }
    }
    let mut s: f32 = acc.iter().sum();
    for v in tail {
        let f = v.to_f32();
        s += f * f;
    }
    s
}

/// RMSNorm of one row into `out` (same length as `x`; `w` at least as long).
pub fn rms_norm_row<T: Element, W: Element, O: Element>(x: &[T], w: &[W], eps: f32, out: &mut [O]) {
    let inv = 1.0 / (sum_squares(x) / x.len() as f32 + eps).sqrt();
    for ((o, v), wv) in out.iter_mut().zip(x).zip(w) {
        *o = O::from_f32(wv.to_f32() * (v.to_f32() * inv));
    }
}

/// RMSNorm of `p.rows` rows, `p.row_stride` elements apart. The caller (or `ops::rms_norm`) has
/// checked the lengths.
pub fn rms_norm<T: Element>(x: &[T], w: &[T], out: &mut [T], p: &RmsNormParams) {
    let (dim, stride) = (p.dim as usize, p.row_stride as usize);
    for r in 0..p.rows as usize {
        let s = r * stride;
        rms_norm_row(&x[s..s + dim], &w[..dim], p.eps, &mut out[s..s + dim]);
    }
}
