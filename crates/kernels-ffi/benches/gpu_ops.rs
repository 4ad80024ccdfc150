//! Bandwidth of the CUDA elementwise kernels against the memory floor, at sizes far above the
//! H200's 60 MB L2 (so every pass goes to HBM). Prints a table and, with DEEPINFER_BENCH_JSON set,
//! writes the numbers as JSON. Without a GPU it prints that it skipped.
//!
//! Method (GPU.md): output poisoned with NaN first and checked against the CPU reference; warm-up,
//! then each launch timed with CUDA events; median of the runs. Floor = bytes that must move /
//! 4.25 TB/s (the measured device-to-device copy rate of the H200).

use deepinfer_kernels_ffi::testing::{cuda_device_or_skip, rel_err, SplitMix};
use deepinfer_kernels_ffi::{ops, Element, RmsNormParams, RopeConfig, RopeParams, Stream};
use half::bf16;

const FLOOR_BYTES_PER_S: f64 = 4.25e12;
const WARMUP: usize = 5;
const RUNS: usize = 50;

fn median(mut v: Vec<f32>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2] as f64
}

fn time_ms(s: &Stream, mut f: impl FnMut()) -> f64 {
    for _ in 0..WARMUP {
        f();
    }
    let mut t = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let a = s.record_event().unwrap();
        f();
        let b = s.record_event().unwrap();
        t.push(a.elapsed_ms(&b).unwrap());
    }
    median(t)
}

fn to<T: Element>(v: &[f32]) -> Vec<T> {
    v.iter().map(|x| T::from_f32(*x)).collect()
}

fn rms_case<T: Element>(s: &Stream, rng: &mut SplitMix, rows: u32, dim: u32) -> serde_json::Value {
    let n = (rows * dim) as usize;
    let x: Vec<T> = to(&rng.vec(n));
    let w: Vec<T> = to(&rng.vec(dim as usize).iter().map(|v| 1.0 + 0.1 * v).collect::<Vec<_>>());
    let p = RmsNormParams::packed(rows, dim, 1e-6);
    let xb = s.upload(&x).unwrap();
    let wb = s.upload(&w).unwrap();
    let mut out = s.upload(&to::<T>(&vec![f32::NAN; n])).unwrap();
    ops::rms_norm(s, &xb, &wb, &mut out, &p).unwrap();
    let got: Vec<f32> = s.download(&out).unwrap().iter().map(|v| v.to_f32()).collect();
    let mut want = vec![T::from_f32(0.0); n];
    deepinfer_kernels_ffi::cpu::rms_norm(&x, &w, &mut want, &p);
    let want: Vec<f32> = want.iter().map(|v| v.to_f32()).collect();
    let (rel, _) = rel_err(&got, &want);
    assert!(rel < 4e-3, "rms_norm {:?} {rows}x{dim}: rel_err {rel:e} against the CPU", T::DTYPE);
    let ms = time_ms(s, || ops::rms_norm(s, &xb, &wb, &mut out, &p).unwrap());
    let bytes = (2 * n + dim as usize) as f64 * T::DTYPE.size_bytes() as f64;
    let floor_ms = bytes / FLOOR_BYTES_PER_S * 1e3;
    let gbps = bytes / (ms * 1e-3) / 1e9;
    let kernel = ops::rms_norm_cuda_kernel::<T>(&p).unwrap_or_default();
    println!(
        "rms_norm {:>4?} {rows:>6}x{dim:<5} {kernel:<22} {:>8.1} MB  median {ms:>8.4} ms  {gbps:>7.0} GB/s  floor {floor_ms:.4} ms  achieved/floor {:.3}  rel_err {rel:.1e}",
        T::DTYPE,
        bytes / 1e6,
        floor_ms / ms
    );
    serde_json::json!({"op": "rms_norm", "kernel": kernel, "dtype": format!("{:?}", T::DTYPE), "rows": rows, "dim": dim, "bytes": bytes,
        "median_ms": ms, "floor_ms": floor_ms, "achieved_over_floor": floor_ms / ms, "gb_per_s": gbps, "rel_err_vs_cpu": rel})
}

fn rope_case(s: &Stream, rng: &mut SplitMix, tokens: u32) -> serde_json::Value {
    let (heads, hd, rd) = (64u32, 512u32, 64u32);
    let n = (tokens * heads * hd) as usize;
    let x: Vec<bf16> = to(&rng.vec(n));
    let mut xb = s.upload(&x).unwrap();
    let pos: Vec<i32> = (0..tokens as i32).collect();
    let pb = s.upload(&pos).unwrap();
    let fb = s.upload(&RopeConfig { theta: 10000.0, rope_dim: rd as usize, yarn: None }.inv_freq()).unwrap();
    let p = RopeParams::new(tokens, heads, hd, rd, false);
    let ms = time_ms(s, || ops::rope(s, &mut xb, &pb, &fb, &p).unwrap());
    // Only the rope tail moves: read and write tokens*heads*rope_dim bf16 values.
    let bytes = (tokens * heads * rd) as f64 * 2.0 * 2.0;
    let floor_ms = bytes / FLOOR_BYTES_PER_S * 1e3;
    println!("rope     BF16 {tokens:>6} tok x 64 heads x 512 (rope 64)  median {ms:>8.4} ms  floor {floor_ms:.4} ms  achieved/floor {:.3}", floor_ms / ms);
    serde_json::json!({"op": "rope", "dtype": "BF16", "tokens": tokens, "heads": heads, "head_dim": hd, "rope_dim": rd,
        "bytes": bytes, "median_ms": ms, "floor_ms": floor_ms, "achieved_over_floor": floor_ms / ms})
}

fn main() {
    let Some(dev) = cuda_device_or_skip("gpu_ops bench") else {
        return;
    };
    let s = dev.default_stream();
    let mut rng = SplitMix(0x5eed);
    let results = vec![
        // 32768 x 4096 bf16: 256 MiB in + 256 MiB out, ~9x the L2.
        rms_case::<bf16>(&s, &mut rng, 32768, 4096),
        rms_case::<bf16>(&s, &mut rng, 16384, 7168),
        rms_case::<f32>(&s, &mut rng, 16384, 4096),
        // Decode-sized rows: latency-bound, reported for reference, not against the floor target.
        rms_case::<bf16>(&s, &mut rng, 64, 4096),
        rope_case(&s, &mut rng, 8192),
    ];
    let report = deepinfer_kernels_ffi::report::SystemReport::gather();
    let gpu = report.gpus.first().map(|g| g.name.clone()).unwrap_or_default();
    let doc = serde_json::json!({
        "bench": "kernels-ffi gpu_ops",
        "device": gpu,
        "driver": report.driver_version.unwrap_or_else(|e| e),
        "floor_bytes_per_s": FLOOR_BYTES_PER_S,
        "method": "CUDA events per launch, 5 warm-up + 50 timed, median; output checked against the CPU backend",
        "results": results,
    });
    if let Some(path) = std::env::var_os("DEEPINFER_BENCH_JSON") {
        std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    }
}
