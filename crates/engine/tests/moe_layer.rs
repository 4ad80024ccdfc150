//! The device MoE sublayer (`deepinfer_moe::layer`, built from kernels-ffi ops) on the CPU backend
//! against the CPU model's `MoeBlock` (the definition checked against transformers' logits) with
//! the official numerics, on the same dequantised weights.
//!
//! Tolerance: the device path rounds the gate/up projections, the routed outputs and the shared
//! expert to bf16 where the model keeps f32. A bf16 ulp (2^-8 relative) moves a hidden value across
//! an FP8 rounding boundary (1/8 relative steps) for a few elements per thousand, so the layer
//! output differs by about 1e-2 relative; 3e-2 leaves room. Routing (f32 logits of the same
//! bf16-representable inputs) must agree exactly.

use deepinfer_engine::model::{Expert, Linear, MoeBlock};
use deepinfer_engine::Numerics;
use deepinfer_kernels_ffi::ops::WeightFormat;
use deepinfer_kernels_ffi::quant::{dequant_fp4_rows, dequant_fp8_blocks};
use deepinfer_kernels_ffi::testing::{rel_err, SplitMix};
use deepinfer_kernels_ffi::{Device, Stream};
use deepinfer_moe::layer::{forward, ExpertWeights, MoeWeights, MoeWorkspace, RandomMoe};
use deepinfer_moe::Router;
use half::bf16;

/// Expert `idx`'s w1 (which 0), w3 (1) or w2 (2) [n, k], dequantised. w1 and w3 are the two halves
/// of the expert's stacked w13 block.
fn dequant(s: &Stream, e: &ExpertWeights, which: usize, n: usize, k: usize, idx: usize) -> Linear {
    let (wb, sb) = e.format.bytes(n, k);
    let ((wq, sc), at) = if which == 2 {
        (&e.w2, (idx * wb, idx * sb))
    } else {
        (&e.w13, ((2 * idx + which) * wb, (2 * idx + which) * sb))
    };
    let w = s.download_range(wq, at.0, wb).unwrap();
    let sc = s.download_range(sc, at.1, sb).unwrap();
    let f = match e.format {
        WeightFormat::Fp8Block128 => dequant_fp8_blocks(&w, &sc, n, k, [128, 128]),
        WeightFormat::Fp4Row32 => dequant_fp4_rows(&w, &sc, n, k),
    };
    Linear::new(n, k, f)
}

fn experts(s: &Stream, e: &ExpertWeights, d: usize, i: usize) -> Vec<Expert> {
    (0..e.count as usize)
        .map(|x| Expert { w1: dequant(s, e, 0, i, d, x), w3: dequant(s, e, 1, i, d, x), w2: dequant(s, e, 2, d, i, x) })
        .collect()
}

fn check(spec: RandomMoe, tokens: usize) {
    let s = Device::cpu().default_stream();
    let w = MoeWeights::random(&s, spec).unwrap();
    let (d, i) = (spec.dim as usize, spec.inter as usize);
    let gate: Vec<f32> = s.download(&w.gate).unwrap().iter().map(|v| v.to_f32()).collect();
    let block = MoeBlock {
        gate: Linear::new(spec.experts as usize, d, gate),
        bias: w.bias.as_ref().map(|b| s.download(b).unwrap()),
        tid2eid: w.hash.as_ref().map(|h| s.download(&h.tid2eid).unwrap().iter().map(|v| *v as i64).collect()),
        router: Router::new(spec.experts as usize, spec.top_k as usize, w.scaling).unwrap(),
        experts: experts(&s, &w.routed, d, i),
        shared: w.shared.as_ref().map(|sh| experts(&s, sh, d, i).remove(0)),
        limit: w.limit,
    };
    let mut rng = SplitMix(spec.seed ^ 0xabc);
    let xb: Vec<bf16> = rng.vec(tokens * d).into_iter().map(|v| bf16::from_f32(2.0 * v)).collect();
    let x: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
    let ids: Vec<u32> = (0..tokens).map(|_| (rng.next_u64() % spec.hash_vocab.unwrap_or(50) as u64) as u32).collect();
    let mut trace = Some(deepinfer_engine::Trace::default());
    let want = block.forward(&x, &ids, Numerics::Official, &mut trace.as_mut(), 0).unwrap();
    let mut ws = MoeWorkspace::new(&s, &w, tokens as u32).unwrap();
    let mut out = s.zeros::<bf16>(tokens * d).unwrap();
    let ib = s.upload(&ids.iter().map(|v| *v as i32).collect::<Vec<_>>()).unwrap();
    forward(&s, &w, &s.upload(&xb).unwrap(), Some(&ib), &mut ws, &mut out).unwrap();
    // Same experts per token (the model records them sorted).
    let got_ids = s.download(&ws.routed.ids).unwrap();
    let k = spec.top_k as usize;
    let chosen = &trace.unwrap().router_topk[&0];
    for t in 0..tokens {
        let mut g: Vec<u32> = got_ids[t * k..(t + 1) * k].iter().map(|v| *v as u32).collect();
        g.sort_unstable();
        assert_eq!(g, chosen[t], "token {t}: experts differ");
    }
    let got: Vec<f32> = s.download(&out).unwrap().iter().map(|v| v.to_f32()).collect();
    let (rel, max) = rel_err(&got, &want);
    println!("moe layer vs MoeBlock {spec:?} tokens={tokens}: rel_err {rel:.3e} max_abs {max:.3e}");
    assert!(rel < 3e-2, "rel_err {rel:e}");
}

#[test]
fn device_moe_layer_on_cpu_matches_the_model() {
    let base = RandomMoe {
        dim: 256,
        inter: 256,
        experts: 16,
        top_k: 4,
        routed: WeightFormat::Fp4Row32,
        shared: true,
        hash_vocab: None,
        seed: 11,
    };
    check(base, 9);
    check(RandomMoe { routed: WeightFormat::Fp8Block128, inter: 384, seed: 12, ..base }, 20);
    check(RandomMoe { hash_vocab: Some(40), shared: false, seed: 13, ..base }, 7);
    // From 33 tokens the shared expert quantises x once for its gate and up GEMMs.
    check(RandomMoe { seed: 14, ..base }, 40);
}
