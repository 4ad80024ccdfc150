//! Partial interleaved RoPE on the last `rope_dim` channels of each head (MODEL_V4.md §2).

use crate::element::Element;
use crate::params::RopeParams;

/// Rotate the tail pairs of one head vector in place at position `pos`. `inverse` negates the
/// angle (V4's inverse rotation of the attention output at the query position).
pub fn rope_row<T: Element>(head: &mut [T], rope_dim: usize, pos: i32, inv_freq: &[f32], inverse: bool) {
    let start = head.len() - rope_dim;
    for (i, f) in inv_freq.iter().enumerate().take(rope_dim / 2) {
        // The angle is one f32 product, as in the reference; sin/cos of it are taken in f64 and
        // rounded, i.e. correctly rounded fp32 values.
        let phi = pos as f32 * f;
        let (mut s, c) = (phi as f64).sin_cos();
        if inverse {
            s = -s;
        }
        let (s, c) = (s as f32, c as f32);
        let (ia, ib) = (start + 2 * i, start + 2 * i + 1);
        let (a, b) = (head[ia].to_f32(), head[ib].to_f32());
        head[ia] = T::from_f32(a * c - b * s);
        head[ib] = T::from_f32(b * c + a * s);
    }
}

/// RoPE over x[tokens, heads, head_dim] with one position per token.
pub fn rope<T: Element>(x: &mut [T], positions: &[i32], inv_freq: &[f32], p: &RopeParams) {
    let (hd, heads) = (p.head_dim as usize, p.heads as usize);
    for (t, tok) in x.chunks_exact_mut(hd * heads).take(p.tokens as usize).enumerate() {
        for head in tok.chunks_exact_mut(hd) {
            rope_row(head, p.rope_dim as usize, positions[t], inv_freq, p.inverse != 0);
        }
    }
}
