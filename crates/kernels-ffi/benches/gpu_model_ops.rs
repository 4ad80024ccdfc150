//! The small ops around the big GEMMs at V4-Flash shapes on the GPU (issue #7): the device sampler
//! (batch 64 over the 129,280-token vocabulary, one row per block), the mHC site before a sublayer
//! (n = 4 streams of 4096, fused with the sublayer's RMSNorm), the merge after it, and the
//! embedding gather into the streams. Prints a table and, with DEEPINFER_BENCH_JSON set, writes
//! JSON; prints that it skipped without a GPU.
//!
//! Floor = bytes each op must move (logits; streams in and out, the fn weights once) over 4.3 TB/s.
//! Method: CUDA events around batches of 20 calls, 2 warm-up batches, median of 10.

use deepinfer_kernels_ffi::hc::{embed_streams, hc_post, hc_pre, HcShape, HcSite};
use deepinfer_kernels_ffi::sampling::{sample, SampleRow, SamplerWorkspace, Truncation};
use deepinfer_kernels_ffi::testing::{cuda_device_or_skip, SplitMix};
use deepinfer_kernels_ffi::Stream;
use half::bf16;

const BYTES_PER_S: f64 = 4.3e12;

fn time_ms(s: &Stream, mut f: impl FnMut()) -> f64 {
    let mut times = Vec::new();
    for rep in 0..12 {
        let a = s.record_event().unwrap();
        for _ in 0..20 {
            f();
        }
        let e = s.record_event().unwrap();
        if rep >= 2 {
            times.push(a.elapsed_ms(&e).unwrap() as f64 / 20.0);
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    times[times.len() / 2]
}

fn record(results: &mut Vec<serde_json::Value>, op: &str, case: &str, bytes: f64, ms: f64) {
    let floor_ms = bytes / BYTES_PER_S * 1e3;
    println!(
        "{op:<14} {case:<44} {:>8.2} MB  median {ms:.4} ms  floor {floor_ms:.4} ms  achieved/floor {:.3}",
        bytes / 1e6,
        floor_ms / ms
    );
    results.push(serde_json::json!({"op": op, "case": case, "bytes": bytes, "median_ms": ms, "floor_ms": floor_ms,
        "achieved_over_floor": floor_ms / ms}));
}

fn main() {
    let Some(dev) = cuda_device_or_skip("gpu_model_ops bench") else { return };
    let s = dev.default_stream();
    let mut rng = SplitMix(0x5a3);
    let mut results = Vec::new();

    // Sampling: batch 64 x 129,280 logits (scale 4: a realistic spread of a few nats).
    let (batch, vocab) = (64usize, 129_280usize);
    let logits = s.upload(&rng.vec(batch * vocab).into_iter().map(|v| v * 4.0).collect::<Vec<_>>()).unwrap();
    let mut ws = SamplerWorkspace::new(&s, batch, vocab, 5).unwrap();
    let t = |temperature, top_k, top_p, min_p, top_logprobs| Truncation {
        temperature,
        top_k,
        top_p,
        min_p,
        seed: 7,
        top_logprobs,
    };
    for (case, tr) in [
        ("greedy", t(0.0, 0, 1.0, 0.0, 0)),
        ("greedy + 5 logprobs", t(0.0, 0, 1.0, 0.0, 5)),
        ("temperature 1 (plain)", t(1.0, 0, 1.0, 0.0, 0)),
        ("top_p 0.9", t(1.0, 0, 0.9, 0.0, 0)),
        ("top_k 50 + top_p 0.9 + 5 logprobs", t(0.7, 50, 0.9, 0.0, 5)),
        ("min_p 0.05", t(1.0, 0, 1.0, 0.05, 0)),
    ] {
        let rows: Vec<SampleRow> = (0..batch).map(|i| SampleRow { truncation: tr, position: i as u64 }).collect();
        let ms = time_ms(&s, || sample(&s, &logits, &rows, &mut ws).unwrap());
        record(
            &mut results,
            "sample",
            &format!("{case} (batch {batch}, vocab {vocab})"),
            (batch * vocab * 4) as f64,
            ms,
        );
    }
    drop((logits, ws));

    // mHC at V4-Flash: n = 4 streams of 4096, fn [24, 16384] f32.
    let (n, dim) = (4usize, 4096usize);
    let hs = HcShape { n, dim, sinkhorn_iters: 20, hc_eps: 1e-6, norm_eps: 1e-6 };
    let nd = n * dim;
    let fn_w = s.upload(&rng.vec(hs.site_width() * nd).into_iter().map(|v| v * 0.02).collect::<Vec<_>>()).unwrap();
    let base = s.upload(&rng.vec(hs.site_width())).unwrap();
    let scale = s.upload(&[0.5f32, 0.7, 0.9]).unwrap();
    let norm = s.upload(&vec![1.0f32; dim]).unwrap();
    let table = s.upload(&rng.vec(4096 * dim).into_iter().map(bf16::from_f32).collect::<Vec<_>>()).unwrap();
    for tokens in [1usize, 64, 4096] {
        let mut x = s.upload(&rng.vec(tokens * nd)).unwrap();
        let (mut post, mut comb) = (s.zeros::<f32>(tokens * n).unwrap(), s.zeros::<f32>(tokens * n * n).unwrap());
        let mut out = s.zeros::<bf16>(tokens * dim).unwrap();
        let site = HcSite { fn_w: &fn_w, base: &base, scale: &scale };
        let ms = time_ms(&s, || hc_pre(&s, &x, &site, &norm, &mut post, &mut comb, &mut out, tokens, &hs).unwrap());
        let bytes = (tokens * nd * 4 + hs.site_width() * nd * 4 + tokens * dim * 2) as f64;
        record(&mut results, "hc_pre", &format!("{tokens} tokens, n 4, D 4096"), bytes, ms);
        let y = s.zeros::<bf16>(tokens * dim).unwrap();
        let ms = time_ms(&s, || hc_post(&s, &mut x, &y, &post, &comb, tokens, &hs).unwrap());
        record(
            &mut results,
            "hc_post",
            &format!("{tokens} tokens, n 4, D 4096"),
            (tokens * (2 * nd * 4 + dim * 2)) as f64,
            ms,
        );
        let ids = s.upload(&(0..tokens).map(|i| ((i * 7919) % 4096) as i32).collect::<Vec<_>>()).unwrap();
        let mut st = s.zeros::<i32>(1).unwrap();
        let ms = time_ms(&s, || embed_streams(&s, &ids, &table, &mut x, &mut st, tokens, &hs).unwrap());
        record(
            &mut results,
            "embed_streams",
            &format!("{tokens} tokens, n 4, D 4096"),
            (tokens * (dim * 2 + nd * 4)) as f64,
            ms,
        );
    }

    let report = deepinfer_kernels_ffi::report::SystemReport::gather();
    let doc = serde_json::json!({
        "bench": "kernels-ffi gpu_model_ops",
        "device": report.gpus.first().map(|g| g.name.clone()).unwrap_or_default(),
        "driver": report.driver_version.unwrap_or_else(|e| e),
        "bytes_per_s": BYTES_PER_S,
        "method": "CUDA events around batches of 20 calls, 2 warm-up batches, median of 10",
        "results": results,
    });
    if let Some(path) = std::env::var_os("DEEPINFER_BENCH_JSON") {
        std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    }
}
