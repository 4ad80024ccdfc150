//! The MoE sublayer's device steps on the host (the specification `kernels/cuda/moe.cu` is tested
//! against): router logits, routing, dispatch by expert, grouped expert GEMMs, SwiGLU and combine.
//! A (token, slot) pair is index `t * top_k + slot`; a permuted row holds one pair.

use half::bf16;

use crate::params::GemmParams;
use crate::quant::fp8_round_trip;
use crate::shapes::gemm::WeightFormat;

/// `sqrt(softplus(z))`, with torch's softplus threshold (linear above 20).
pub fn sqrt_softplus(z: f32) -> f32 {
    let sp = if z > 20.0 { z } else { z.exp().ln_1p() };
    sp.sqrt()
}

fn silu(v: f32) -> f32 {
    v * (1.0 / (1.0 + (-v).exp()))
}

/// logits[t, e] = Σ_d x[t, d]·w[e, d] in f32.
pub fn router_logits(x: &[bf16], w: &[bf16], logits: &mut [f32], tokens: usize, experts: usize, d: usize) {
    for t in 0..tokens {
        let xr: Vec<f32> = x[t * d..(t + 1) * d].iter().map(|v| v.to_f32()).collect();
        for e in 0..experts {
            logits[t * experts + e] = w[e * d..(e + 1) * d].iter().zip(&xr).map(|(a, b)| a.to_f32() * b).sum();
        }
    }
}

/// How [`route`] picks a token's experts.
pub enum HostRouteBy<'a> {
    /// Top-k of score + bias (no bias: zero).
    Score { bias: Option<&'a [f32]> },
    /// Row `token_ids[t]` of `tid2eid` [vocab, top_k].
    Hash { tid2eid: &'a [i32], token_ids: &'a [i32], vocab: usize },
}

/// Experts and weights per token ([tokens, top_k] each, choice order). Out-of-range token ids or
/// table entries give expert -1 and weight 0; the return value says whether any did.
pub fn route(
    logits: &[f32],
    by: &HostRouteBy<'_>,
    scaling: f32,
    (tokens, experts, top_k): (usize, usize, usize),
    ids: &mut [i32],
    weights: &mut [f32],
) -> bool {
    let mut bad = false;
    for t in 0..tokens {
        let scores: Vec<f32> = logits[t * experts..(t + 1) * experts].iter().map(|z| sqrt_softplus(*z)).collect();
        let chosen: Vec<i32> = match by {
            HostRouteBy::Score { bias } => {
                let key = |e: usize| {
                    let k = scores[e] + bias.map_or(0.0, |b| b[e]);
                    if k.is_nan() {
                        f32::NEG_INFINITY
                    } else {
                        k
                    }
                };
                let mut idx: Vec<usize> = (0..experts).collect();
                idx.sort_by(|a, b| key(*b).total_cmp(&key(*a)).then(a.cmp(b)));
                idx[..top_k].iter().map(|e| *e as i32).collect()
            }
            HostRouteBy::Hash { tid2eid, token_ids, vocab } => {
                let id = token_ids[t];
                (0..top_k)
                    .map(|i| {
                        let e = if id >= 0 && (id as usize) < *vocab { tid2eid[id as usize * top_k + i] } else { -1 };
                        if e >= 0 && (e as usize) < experts {
                            e
                        } else {
                            -1
                        }
                    })
                    .collect()
            }
        };
        let picked: Vec<f32> = chosen.iter().map(|&e| if e >= 0 { scores[e as usize] } else { 0.0 }).collect();
        let sum: f32 = picked.iter().sum();
        for (i, (&e, s)) in chosen.iter().zip(&picked).enumerate() {
            ids[t * top_k + i] = e;
            weights[t * top_k + i] = if e >= 0 { s / (sum + 1e-20) * scaling } else { 0.0 };
            bad |= e < 0;
        }
    }
    bad
}

/// The dispatch of routed pairs to experts (see `ops`' `MoeDispatch` for the layout).
pub struct HostDispatch<'a> {
    pub counts: &'a mut [i32],
    pub offsets: &'a mut [i32],
    pub chunks: &'a mut [i32],
    pub num_chunks: &'a mut [i32],
    pub row_pair: &'a mut [i32],
    pub pair_row: &'a mut [i32],
}

/// Group the pairs by expert: rows of expert e are offsets[e]..offsets[e+1], in pair order;
/// chunks of at most `tile` rows (expert, first row, rows, 0) cover them in expert order. Rows past
/// the routed ones point at pair 0; unrouted pairs (expert -1) get row -1.
pub fn dispatch(ids: &[i32], experts: usize, tile: usize, d: HostDispatch<'_>) {
    d.counts.iter_mut().for_each(|c| *c = 0);
    for &e in ids {
        if e >= 0 {
            d.counts[e as usize] += 1;
        }
    }
    let mut row = 0i32;
    let mut nch = 0usize;
    for e in 0..experts {
        d.offsets[e] = row;
        let cnt = d.counts[e];
        let mut r = 0;
        while r < cnt {
            let rows = (tile as i32).min(cnt - r);
            d.chunks[4 * nch..4 * nch + 4].copy_from_slice(&[e as i32, row + r, rows, 0]);
            nch += 1;
            r += tile as i32;
        }
        row += cnt;
    }
    d.offsets[experts] = row;
    d.num_chunks[0] = nch as i32;
    let mut next: Vec<i32> = d.offsets[..experts].to_vec();
    for (i, &e) in ids.iter().enumerate() {
        if e >= 0 {
            let r = next[e as usize];
            next[e as usize] += 1;
            d.row_pair[r as usize] = i as i32;
            d.pair_row[i] = r;
        } else {
            d.pair_row[i] = -1;
        }
    }
    d.row_pair[row as usize..].iter_mut().for_each(|v| *v = 0);
}

/// y[r, :] = W_{expert(r)}·x[src(r), :] for the routed rows r < offsets[E] (src(r) = row_pair[r] /
/// div with a gather, else r); other rows of y are left alone. `p.m` is the number of rows of y.
#[allow(clippy::too_many_arguments)]
pub fn gemm_grouped(
    format: WeightFormat,
    x: &[bf16],
    gather: Option<(&[i32], usize)>,
    offsets: &[i32],
    w: &[u8],
    scale: &[u8],
    y: &mut [bf16],
    p: &GemmParams,
) {
    let (n, k) = (p.n as usize, p.k as usize);
    let (wb, sb) = format.bytes(n, k);
    for e in 0..offsets.len() - 1 {
        let (r0, r1) = (offsets[e] as usize, offsets[e + 1] as usize);
        if r0 == r1 {
            continue;
        }
        let xe: Vec<bf16> = (r0..r1)
            .flat_map(|r| {
                let src = gather.map_or(r, |(g, div)| g[r] as usize / div);
                x[src * k..(src + 1) * k].to_vec()
            })
            .collect();
        let pe = GemmParams { m: (r1 - r0) as u32, ..*p };
        let (we, se) = (&w[e * wb..(e + 1) * wb], &scale[e * sb..(e + 1) * sb]);
        let ye = &mut y[r0 * n..r1 * n];
        match format {
            WeightFormat::Fp8Block128 => super::gemm_fp8(&xe, we, se, ye, &pe),
            WeightFormat::Fp4Row32 => super::gemm_fp4(&xe, we, se, ye, &pe),
        }
    }
}

/// h = silu(min(g, L))·clamp(u, ±L) with g = gu[r, j] and u = gu[r, inter + j] (times
/// weights[row_pair[r]] when given), FP8-rounded per 1×128 block of a row when `quantize`, then
/// rounded to bf16.
#[allow(clippy::too_many_arguments)]
pub fn swiglu(
    gu: &[bf16],
    h: &mut [bf16],
    weights: Option<(&[f32], &[i32])>,
    rows: usize,
    inter: usize,
    limit: f32,
    quantize: bool,
) {
    for r in 0..rows {
        let s = weights.map_or(1.0, |(w, rp)| w[rp[r] as usize]);
        let mut v: Vec<f32> = (0..inter)
            .map(|j| {
                let gv = gu[2 * r * inter + j].to_f32().min(limit);
                let uv = gu[(2 * r + 1) * inter + j].to_f32().clamp(-limit, limit);
                silu(gv) * uv * s
            })
            .collect();
        if quantize {
            fp8_round_trip(&mut v, 128, 1e-4);
        }
        for (o, v) in h[r * inter..(r + 1) * inter].iter_mut().zip(v) {
            *o = bf16::from_f32(v);
        }
    }
}

/// out[t] = Σ over t's routed pairs in increasing expert id of y[pair_row] (times the pair's weight
/// unless `pre_scaled`), plus shared[t], in f32, rounded once to bf16.
#[allow(clippy::too_many_arguments)]
pub fn combine(
    y: &[bf16],
    pair_row: &[i32],
    ids: &[i32],
    weights: &[f32],
    shared: Option<&[bf16]>,
    out: &mut [bf16],
    (tokens, top_k, dim): (usize, usize, usize),
    pre_scaled: bool,
) {
    for t in 0..tokens {
        let mut slots: Vec<usize> = (0..top_k).filter(|s| ids[t * top_k + s] >= 0).collect();
        slots.sort_by_key(|s| ids[t * top_k + s]);
        let mut acc = vec![0f32; dim];
        for s in slots {
            let pair = t * top_k + s;
            let w = if pre_scaled { 1.0 } else { weights[pair] };
            let r = pair_row[pair] as usize;
            for (a, v) in acc.iter_mut().zip(&y[r * dim..(r + 1) * dim]) {
                *a += v.to_f32() * w;
            }
        }
        if let Some(sh) = shared {
            for (a, v) in acc.iter_mut().zip(&sh[t * dim..(t + 1) * dim]) {
                *a += v.to_f32();
            }
        }
        for (o, a) in out[t * dim..(t + 1) * dim].iter_mut().zip(acc) {
            *o = bf16::from_f32(a);
        }
    }
}
