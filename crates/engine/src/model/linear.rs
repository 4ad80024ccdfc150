//! Dense f32 linear layers `y = W·x` (W stored [out, in], as the checkpoint), spread over the
//! machine's cores, plus the small vector helpers the model shares.

use std::thread;

/// A dense weight of shape [out, inp], row-major.
#[derive(Debug, Clone)]
pub struct Linear {
    pub out: usize,
    pub inp: usize,
    pub w: Vec<f32>,
}

/// Work (multiply-adds) below which a matmul runs on one thread: spawning costs ~20 us.
const PARALLEL_MIN_MACS: usize = 1 << 18;

/// Dot product with 8 independent f32 accumulators.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ta.iter().zip(tb) {
        s += x * y;
    }
    s
}

fn threads() -> usize {
    thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

impl Linear {
    pub fn new(out: usize, inp: usize, w: Vec<f32>) -> Linear {
        debug_assert_eq!(w.len(), out * inp);
        Linear { out, inp, w }
    }

    /// x [n, inp] -> [n, out].
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut y = vec![0f32; n * self.out];
        self.forward_into(x, n, &mut y);
        y
    }

    /// x [n, inp] -> y [n, out], overwriting y.
    pub fn forward_into(&self, x: &[f32], n: usize, y: &mut [f32]) {
        let (inp, out) = (self.inp, self.out);
        let t = threads();
        if t == 1 || n * out * inp < PARALLEL_MIN_MACS {
            rows(&self.w, inp, x, y, out);
            return;
        }
        if n >= 2 * t {
            // Split tokens: each thread owns contiguous output rows.
            let per = n.div_ceil(t);
            thread::scope(|s| {
                for (xc, yc) in x.chunks(per * inp).zip(y.chunks_mut(per * out)) {
                    s.spawn(|| rows(&self.w, inp, xc, yc, out));
                }
            });
        } else {
            // Few tokens (decode): split the output features; each thread fills its own block.
            let per = out.div_ceil(t);
            let parts: Vec<(usize, Vec<f32>)> = thread::scope(|s| {
                let handles: Vec<_> = (0..out)
                    .step_by(per)
                    .map(|o0| {
                        let o1 = (o0 + per).min(out);
                        s.spawn(move || {
                            let mut part = vec![0f32; n * (o1 - o0)];
                            rows(&self.w[o0 * inp..o1 * inp], inp, x, &mut part, o1 - o0);
                            (o0, part)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
            });
            for (o0, part) in parts {
                let width = part.len() / n.max(1);
                for r in 0..n {
                    y[r * out + o0..r * out + o0 + width].copy_from_slice(&part[r * width..(r + 1) * width]);
                }
            }
        }
    }
}

/// y[r, o] = dot(x[r], w[o]) for the rows of x.
fn rows(w: &[f32], inp: usize, x: &[f32], y: &mut [f32], out: usize) {
    for (xr, yr) in x.chunks_exact(inp).zip(y.chunks_exact_mut(out)) {
        for (o, v) in yr.iter_mut().enumerate() {
            *v = dot(xr, &w[o * inp..(o + 1) * inp]);
        }
    }
}

/// Weighted RMSNorm of each `dim`-row of x in place: w ⊙ x·(mean(x²)+ε)^−½ (the CPU reference op).
pub fn rms_norm_rows(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    let mut tmp = vec![0f32; dim];
    for row in x.chunks_exact_mut(dim) {
        deepinfer_kernels_ffi::cpu::rms_norm_row(row, w, eps, &mut tmp);
        row.copy_from_slice(&tmp);
    }
}

/// Unweighted RMSNorm of each `dim`-row in place: x·(mean(x²)+ε)^−½.
pub fn rms_rows(x: &mut [f32], dim: usize, eps: f32) {
    for row in x.chunks_exact_mut(dim) {
        let ms = dot(row, row) / dim as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        row.iter_mut().for_each(|v| *v *= inv);
    }
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_paths_equal_serial() {
        let (n, inp, out) = (5, 300, 400); // decode-like: split over outputs
        let w: Vec<f32> = (0..out * inp).map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0).collect();
        let x: Vec<f32> = (0..n * inp).map(|i| ((i * 17) % 89) as f32 / 44.0 - 1.0).collect();
        let lin = Linear::new(out, inp, w.clone());
        let mut serial = vec![0f32; n * out];
        rows(&w, inp, &x, &mut serial, out);
        assert_eq!(lin.forward(&x, n), serial);
        let n = 64; // prefill-like: split over tokens
        let x: Vec<f32> = (0..n * inp).map(|i| ((i * 13) % 97) as f32 / 48.0 - 1.0).collect();
        let mut serial = vec![0f32; n * out];
        rows(&w, inp, &x, &mut serial, out);
        assert_eq!(lin.forward(&x, n), serial);
    }
}
