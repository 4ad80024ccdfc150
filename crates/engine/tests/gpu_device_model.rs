//! The device model on CUDA against the same model on the CPU backend (the same code, the same
//! rounding points: bf16 storage and the official FP8/FP4 rounding), on a random checkpoint in the
//! official formats with the V4 attention geometry the CUDA kernels are built for (64 heads of 512,
//! rope 64, indexer 64 x 128, mHC 4 streams) and small widths elsewhere, 4 layers: sliding, CSA,
//! HCA, CSA. Skipped without a GPU.
//!
//! Tolerance: the two backends differ only in summation order (f32 accumulators in other orders,
//! cuBLASLt for the bf16 GEMMs) and in the GPU's f32 sin/cos; each op's outputs agree to about one
//! bf16 ulp (kernels-ffi's parity tests), which through the official FP8 rounding and the discrete
//! choices (expert and indexer top-k) gives the same noise as tests/device_model.rs argues against
//! the f32 reference, smaller by the missing f32-vs-bf16 gap. The test requires the median step
//! within 2e-2 of the largest logit, no step past 0.6, and the greedy tokens of the CUDA run equal
//! to the CPU run's wherever the CPU's top-two margin exceeds 8e-2 and the step is within 3e-2.
//! It prints decode step times (a first figure, not the benchmark of issue #37).
//! `gpu_batch_invariance` (ignored: known to fail, see its note) checks that a sequence gives the
//! same tokens alone and in a batch of 4 on the GPU.

use std::time::Instant;

use deepinfer_engine::device_model::{DeviceKvConfig, DeviceModel, DeviceSeq};
use deepinfer_engine::tiny::write_quantized_model;
use deepinfer_engine::{LogitRows, Numerics};
use deepinfer_kernels_ffi::testing::cuda_device_or_skip;
use deepinfer_kernels_ffi::Device;
use serde_json::json;

fn config() -> serde_json::Value {
    json!({
        "model_type": "deepseek_v4", "vocab_size": 4096, "hidden_size": 1024, "num_hidden_layers": 4,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
        "q_lora_rank": 512, "o_groups": 8, "o_lora_rank": 128, "sliding_window": 128,
        "compress_ratios": [0, 4, 128, 4, 0], "compress_rate_hca": 128, "index_n_heads": 64, "index_head_dim": 128,
        "index_topk": 16, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "n_routed_experts": 16,
        "num_experts_per_tok": 4, "n_shared_experts": 1, "moe_intermediate_size": 256, "num_hash_layers": 1,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "compress_rope_theta": 160000, "rope_scaling": {"type": "yarn", "factor": 16,
        "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
        "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1
    })
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, x)| if *x > b.1 { (i, *x) } else { b }).0 as u32
}

fn margin(v: &[f32]) -> f32 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| b.total_cmp(a));
    (s[0] - s[1]) / v.iter().fold(0f32, |m, x| m.max(x.abs()))
}

fn scale_err(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97) >> 7) % 4096).collect()
}

/// Greedy decode of `steps` tokens after `p`, returning the tokens.
fn greedy(m: &DeviceModel, p: &[u32], steps: usize) -> Vec<u32> {
    let mut s = m.new_seq().unwrap();
    let mut next = p.to_vec();
    let mut out = Vec::new();
    for _ in 0..steps {
        let l = m.forward(&mut [(&next, &mut s)], LogitRows::Last).unwrap().remove(0);
        next = vec![argmax(&l)];
        out.push(next[0]);
    }
    m.release(s);
    out
}

/// Steps of greedy decode on both models (following the CPU's token): the error of every step and
/// the steps whose token was checked.
fn compare(cpu: &DeviceModel, cuda: &DeviceModel, label: &str) -> (Vec<f32>, usize) {
    let (mut errs, mut checked) = (Vec::new(), 0);
    for seed in 0..2u32 {
        let p = prompt(200 + 37 * seed as usize, seed);
        let (mut a, mut b) = (cpu.new_seq().unwrap(), cuda.new_seq().unwrap());
        let mut next = p.clone();
        for step in 0..24 {
            let want = cpu.forward(&mut [(&next, &mut a)], LogitRows::Last).unwrap().remove(0);
            let got = cuda.forward(&mut [(&next, &mut b)], LogitRows::Last).unwrap().remove(0);
            let e = scale_err(&got, &want);
            println!("{label} seed {seed} step {step}: error {e:.3e}, margin {:.3e}", margin(&want));
            assert!(e < 0.6, "{label} seed {seed} step {step}: error {e:.3e}");
            if margin(&want) > 8e-2 && e < 3e-2 {
                assert_eq!(argmax(&got), argmax(&want), "{label} seed {seed} step {step}");
                checked += 1;
            }
            errs.push(e);
            next = vec![argmax(&want)];
        }
        cpu.release(a);
        cuda.release(b);
    }
    errs.sort_by(f32::total_cmp);
    println!(
        "{label}: cuda vs cpu backend median {:.3e}, worst {:.3e}; tokens checked {checked} of {}",
        errs[errs.len() / 2],
        errs[errs.len() - 1],
        errs.len()
    );
    (errs, checked)
}

const KV: DeviceKvConfig = DeviceKvConfig { slots: 8, max_len: 1024, max_chunk: 256 };

/// The random checkpoint of [`config`], written to a fresh temporary folder.
fn checkpoint(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("deepinfer-gpu-device-model-{tag}-{}", std::process::id()));
    write_quantized_model(&dir, &config(), 7, 1).unwrap();
    dir
}

#[test]
fn gpu_device_model_follows_the_cpu_backend() {
    let Some(gpu) = cuda_device_or_skip("gpu_device_model") else { return };
    let t0 = Instant::now();
    let dir = checkpoint("parity");
    let kv = KV;
    // Without the official rounding the backends differ by summation order only: the structural check.
    let load = |d: &Device, n| DeviceModel::load(&dir, d, kv, n, &mut |_, _| {}).unwrap();
    let (cpu, cuda) = (load(&Device::cpu(), Numerics::Reference), load(&gpu, Numerics::Reference));
    println!(
        "checkpoint written and loaded twice in {:.1}s; {} MB of weights",
        t0.elapsed().as_secs_f64(),
        cuda.weight_bytes() >> 20
    );
    let (errs, checked) = compare(&cpu, &cuda, "bf16");
    assert!(errs[errs.len() / 2] < 2e-2, "median {:.3e}", errs[errs.len() / 2]);
    assert!(checked >= 10, "only {checked} steps had a clear margin");
    drop((cpu, cuda));
    // With it, a bf16 ulp moves values across FP8 steps (1/16 relative) in every projection and
    // the random-weight model amplifies that: reported, and bounded only against garbage.
    let (cpu, cuda) = (load(&Device::cpu(), Numerics::Official), load(&gpu, Numerics::Official));
    compare(&cpu, &cuda, "official");
    drop(cpu);

    // Decode step times (host-synchronised forward per step, no CUDA graphs yet).
    for bs in [1usize, 8] {
        let mut seqs: Vec<DeviceSeq> = (0..bs).map(|_| cuda.new_seq().unwrap()).collect();
        let ps: Vec<Vec<u32>> = (0..bs).map(|i| prompt(256, 50 + i as u32)).collect();
        let mut batch: Vec<(&[u32], &mut DeviceSeq)> = ps.iter().map(|v| v.as_slice()).zip(seqs.iter_mut()).collect();
        cuda.forward(&mut batch, LogitRows::Last).unwrap();
        let one = vec![vec![5u32]; bs];
        let steps = 32;
        let t = Instant::now();
        for _ in 0..steps {
            let mut batch: Vec<(&[u32], &mut DeviceSeq)> =
                one.iter().map(|v| v.as_slice()).zip(seqs.iter_mut()).collect();
            cuda.forward(&mut batch, LogitRows::Last).unwrap();
        }
        let dt = t.elapsed().as_secs_f64() / steps as f64;
        println!(
            "decode batch {bs}: {:.2} ms a step, {:.0} tok/s (4 layers, context 256, eager)",
            dt * 1e3,
            bs as f64 / dt
        );
        for s in seqs {
            cuda.release(s);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A sequence's greedy tokens alone and beside three others (prompts and decode steps batched).
/// Fails on the H100 (2026-12-07: 1 of 4 sequences agreed): the CUDA dispatch picks kernels by the
/// batch: decode attention's key splits (`decode_splits`, 132 / batch) and kernel, the FP8 GEMM's
/// decode kernel (m <= 16) against wgmma and its k splits by rows (`gemm_wgmma_splits`), the FP4
/// expert GEMMs by rows per expert, cuBLASLt's algorithm by m. A batch-invariant mode
/// (`DEEPINFER_BATCH_INVARIANT=1`) must fix each of those choices per row; until then this test
/// stays ignored and is run by hand on the device (`--ignored`).
#[test]
#[ignore = "#37: CUDA kernels are chosen by batch size; run with --ignored on a GPU"]
fn gpu_batch_invariance() {
    let Some(gpu) = cuda_device_or_skip("gpu_batch_invariance") else { return };
    let dir = checkpoint("invariance");
    let cuda = DeviceModel::load(&dir, &gpu, KV, Numerics::Official, &mut |_, _| {}).unwrap();
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(64 + 13 * i, 10 + i as u32)).collect();
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| greedy(&cuda, p, 16)).collect();
    let mut seqs: Vec<DeviceSeq> = (0..4).map(|_| cuda.new_seq().unwrap()).collect();
    let mut next: Vec<Vec<u32>> = prompts.clone();
    let mut batched = vec![Vec::new(); 4];
    for _ in 0..16 {
        let mut batch: Vec<(&[u32], &mut DeviceSeq)> = next.iter().map(|v| v.as_slice()).zip(seqs.iter_mut()).collect();
        let out = cuda.forward(&mut batch, LogitRows::Last).unwrap();
        for (i, l) in out.iter().enumerate() {
            batched[i].push(argmax(l));
        }
        next = batched.iter().map(|b| vec![*b.last().unwrap()]).collect();
    }
    for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
        let same = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        println!("sequence {i}: alone and in a batch of 4 agree on the first {same} of 16 tokens");
    }
    let agree = alone.iter().zip(&batched).filter(|(a, b)| a == b).count();
    assert!(agree >= 3, "only {agree} of 4 sequences gave the same tokens alone and batched");
    let _ = std::fs::remove_dir_all(&dir);
}
