//! Low-precision-weight GEMMs y = x·Wᵀ (see [`GemmParams`]): f32 math, products summed per scale
//! block and scaled once per block (the order the kernels use), rounded once to bf16.

use half::bf16;

use crate::params::GemmParams;
use crate::quant::{e4m3_to_f32, e8m0_to_f32, fp8_round_trip, FP4_LUT};

fn e4m3_lut() -> &'static [f32; 256] {
    static LUT: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    LUT.get_or_init(|| std::array::from_fn(|b| e4m3_to_f32(b as u8)))
}

/// Row m of x as f32, FP8-rounded per 1×128 block when asked (the official activation quantisation).
fn x_row(x: &[bf16], m: usize, k: usize, quantize: bool) -> Vec<f32> {
    let mut r: Vec<f32> = x[m * k..(m + 1) * k].iter().map(|v| v.to_f32()).collect();
    if quantize {
        fp8_round_trip(&mut r, 128, 1e-4);
    }
    r
}

/// bf16 W [n, k]: y[m, n] = Σ_k x[m, k]·W[n, k] in f32, rounded once.
pub fn gemm_bf16(x: &[bf16], w: &[bf16], y: &mut [bf16], p: &GemmParams) {
    let (m, n, k) = (p.m as usize, p.n as usize, p.k as usize);
    for mi in 0..m {
        let xr: Vec<f32> = x[mi * k..(mi + 1) * k].iter().map(|v| v.to_f32()).collect();
        for ni in 0..n {
            let acc: f32 = w[ni * k..(ni + 1) * k].iter().zip(&xr).map(|(a, b)| a.to_f32() * b).sum();
            y[mi * n + ni] = bf16::from_f32(acc);
        }
    }
}

/// FP8 e4m3 W [n, k] with ue8m0 scales over 128×128 blocks.
pub fn gemm_fp8(x: &[bf16], w: &[u8], scale: &[u8], y: &mut [bf16], p: &GemmParams) {
    let (m, n, k) = (p.m as usize, p.n as usize, p.k as usize);
    let (lut, kb) = (e4m3_lut(), k.div_ceil(128));
    for mi in 0..m {
        let xr = x_row(x, mi, k, p.quantize_x != 0);
        for ni in 0..n {
            let row = &w[ni * k..(ni + 1) * k];
            let mut acc = 0f32;
            for (b, (wc, xc)) in row.chunks(128).zip(xr.chunks(128)).enumerate() {
                let s: f32 = wc.iter().zip(xc).map(|(q, v)| lut[*q as usize] * v).sum();
                acc += s * e8m0_to_f32(scale[(ni / 128) * kb + b]);
            }
            y[mi * n + ni] = bf16::from_f32(acc);
        }
    }
}

/// FP4 e2m1 W packed [n, k/2] (low nibble first) with ue8m0 scales per 1×32 ([n, k/32]); x is
/// FP8-rounded per 1×128 block first when asked (the official MoE activation quantisation).
pub fn gemm_fp4(x: &[bf16], w: &[u8], scale: &[u8], y: &mut [bf16], p: &GemmParams) {
    let (m, n, k) = (p.m as usize, p.n as usize, p.k as usize);
    for mi in 0..m {
        let xr = x_row(x, mi, k, p.quantize_x != 0);
        for ni in 0..n {
            let row = &w[ni * k / 2..(ni + 1) * k / 2];
            let mut acc = 0f32;
            for (g, (wc, xc)) in row.chunks(16).zip(xr.chunks(32)).enumerate() {
                let mut s = 0f32;
                for (j, byte) in wc.iter().enumerate() {
                    s += FP4_LUT[(byte & 0x0f) as usize] * xc[2 * j] + FP4_LUT[(byte >> 4) as usize] * xc[2 * j + 1];
                }
                acc += s * e8m0_to_f32(scale[ni * (k / 32) + g]);
            }
            y[mi * n + ni] = bf16::from_f32(acc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequant_fp4_rows, dequant_fp8_blocks};
    use crate::testing::SplitMix;

    /// Against the plain definition: dequantise W, (round x), dot.
    #[test]
    fn block_sums_equal_dequantise_then_dot() {
        let mut g = SplitMix(5);
        let (m, n, k) = (3usize, 130usize, 256usize);
        let x: Vec<bf16> = g.vec(m * k).into_iter().map(bf16::from_f32).collect();
        let w: Vec<u8> = (0..n * k).map(|_| crate::quant::random_e4m3(g.next_u64())).collect();
        let s8: Vec<u8> = (0..n.div_ceil(128) * k / 128).map(|_| 120 + (g.next_u64() % 10) as u8).collect();
        for q in [false, true] {
            let p = GemmParams::new(m as u32, n as u32, k as u32, q);
            let mut y = vec![bf16::ZERO; m * n];
            gemm_fp8(&x, &w, &s8, &mut y, &p);
            let wd = dequant_fp8_blocks(&w, &s8, n, k, [128, 128]);
            for mi in 0..m {
                let xr = x_row(&x, mi, k, q);
                for ni in 0..n {
                    let want: f32 = (0..k).map(|j| xr[j] * wd[ni * k + j]).sum();
                    let got = y[mi * n + ni].to_f32();
                    assert!((got - want).abs() <= 1e-2 * want.abs() + 1e-3, "fp8 q={q} {mi},{ni}: {got} vs {want}");
                }
            }
        }
        let w4: Vec<u8> = (0..n * k / 2).map(|_| (g.next_u64() % 256) as u8).collect();
        let s4: Vec<u8> = (0..n * k / 32).map(|_| 124 + (g.next_u64() % 6) as u8).collect();
        let p = GemmParams::new(m as u32, n as u32, k as u32, false);
        let mut y = vec![bf16::ZERO; m * n];
        gemm_fp4(&x, &w4, &s4, &mut y, &p);
        let wd = dequant_fp4_rows(&w4, &s4, n, k);
        for mi in 0..m {
            for ni in 0..n {
                let want: f32 = (0..k).map(|j| x[mi * k + j].to_f32() * wd[ni * k + j]).sum();
                let got = y[mi * n + ni].to_f32();
                assert!((got - want).abs() <= 1e-2 * want.abs() + 1e-3, "fp4 {mi},{ni}: {got} vs {want}");
            }
        }
    }
}
