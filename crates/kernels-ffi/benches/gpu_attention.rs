//! Decode attention and the lightning indexer at V4-Flash shapes on the GPU (issue #8): batch 64, 64 heads of 512, one K=V
//! head, keys gathered from a paged pool: a CSA layer (128 window + 512 top-k rows, any context
//! past 2k), HCA layers at 8k (128 + 64), 16k, 32k and 128k (128 + 1024), a sliding-only layer (128). Prints
//! a table and, with DEEPINFER_BENCH_JSON set, writes JSON; prints that it skipped without a GPU.
//! The PyTorch peer (transformers' DeepseekV4 eager attention function) runs from
//! `benches/peers/attention_decode_torch.py` in the same visit.
//!
//! Floor = KV bytes read (batch x keys x 512 x 2) + q and out, over 4.3 TB/s; the FLOPs (4 x batch x
//! heads x keys x 512) are reported too. Method: output checked against the CPU on one sequence;
//! key pools rotate (> 256 MiB in all, so reads come from HBM); CUDA events around batches of 20
//! launches, median of 20 batches. The Hopper kernels run with programmatic dependent launch (the
//! default: each call sets up under the one before it) and without it ("/nopdl"), and with each
//! sequence's heads as two blocks over all of its keys where the default splits keys
//! (`di_attn_decode_hs`, and "+halves" on the S-warpgroup kernel).

use deepinfer_kernels_ffi::attention::{
    attention_decode, cuda_kernel, decode_splits, head_halves_max_tiles, s_half_first, set_head_halves_max_tiles,
    set_head_halves_sp, set_merge_f32, set_s_half_first, set_s_warpgroup, set_tma_runs, set_wgmma, DecodeAttnShape,
};
use deepinfer_kernels_ffi::ops;
use deepinfer_kernels_ffi::testing::{
    cuda_device_or_skip, paged_key_rows, rel_err, switch_kernels, BenchOnly, SplitMix,
};
use half::bf16;

const BYTES_PER_S: f64 = 4.3e12;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let Some(dev) = cuda_device_or_skip("gpu_attention bench") else { return };
    let s = dev.default_stream();
    let mut rng = SplitMix(0xa77);
    let (batch, heads, d) = (64u32, 64u32, 512usize);
    let scale = 1.0 / (d as f32).sqrt();
    let mut results = Vec::new();
    // DEEPINFER_BENCH_ONLY (`testing::BenchOnly`) runs only the cases whose label ("attention_decode
    // HCA 8k paged", "indexer_decode indexer 8k", "indexer_prefill", "attention_prefill sliding
    // prefill 32k", "compress CSA") contains one of its texts.
    let only = BenchOnly::from_env();
    // DEEPINFER_ATTN_NO_HALVES (any value): no head-halves rows (a visit whose GPU tests failed on
    // them still gets the other rows).
    let no_halves = std::env::var_os("DEEPINFER_ATTN_NO_HALVES").is_some();
    let mut failed: Vec<String> = Vec::new();
    let wanted = |label: &str| only.wants(label);
    // Rows: random pool rows, or (paged) a paged cache's layout: each sequence's 128-row window
    // starting inside a 64-row page (its tiles straddle pages), then its compressed rows as whole
    // pages, the pages of all sequences shuffled over the pool.
    for (what, keys, paged) in [
        ("CSA (128 window + 512 top-k)", 640u32, false),
        ("HCA 8k (128 + 64)", 192, false),
        ("HCA 16k (128 + 128)", 256, false),
        ("HCA 32k (128 + 256)", 384, false),
        ("HCA 128k (128 + 1024)", 1152, false),
        ("sliding only (128)", 128, false),
        ("HCA 8k paged", 192, true),
        ("HCA 128k paged", 1152, true),
    ] {
        if !wanted(&format!("attention_decode {what}")) {
            continue;
        }
        let shape = DecodeAttnShape { batch, heads, head_dim: d as u32, max_keys: keys };
        let pool = (batch * keys) as usize * 2;
        let b = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
        let q = b(rng.vec(batch as usize * heads as usize * d).into_iter().map(|v| v * 8.0).collect());
        let kv = b(rng.vec(pool * d));
        let rows: Vec<i32> = if paged {
            paged_key_rows(&mut rng, batch, keys, pool)
        } else {
            (0..batch * keys).map(|_| (rng.next_u64() % pool as u64) as i32).collect()
        };
        let counts = vec![keys as i32; batch as usize];
        let sink: Vec<f32> = rng.vec(heads as usize);
        let copies = ((256usize << 20) / (pool * d * 2)).max(2);
        let pools: Vec<_> = (0..copies).map(|_| s.upload(&kv).unwrap()).collect();
        let (qb, rb, cb, sb) =
            (s.upload(&q).unwrap(), s.upload(&rows).unwrap(), s.upload(&counts).unwrap(), s.upload(&sink).unwrap());
        let mut out = s.zeros::<bf16>(q.len()).unwrap();
        let mut st = s.zeros::<i32>(1).unwrap();
        // Every kernel this GPU runs (on sm_90 the warpgroup-MMA kernel and the mma.sync one).
        for (wgmma, kernel) in switch_kernels(set_wgmma, || cuda_kernel(&s, shape)) {
            set_wgmma(wgmma);
            // Paged lists on the Hopper kernel: with the page tiles by TMA (the default) and gathered
            // row by row ("/gather").
            let variants: &[bool] = if paged && wgmma { &[true, false] } else { &[true] };
            // Where sm_90 takes an S-warpgroup kernel (the default), the turn-taking one too.
            let kernels: &[bool] = if kernel.starts_with("di_attn_decode_sp") { &[true, false] } else { &[true] };
            // Two splits on the Hopper cluster kernels: the merge's partial as scaled f16 (the
            // default) and as fp32 ("/f32merge").
            let merges: &[bool] = if wgmma && decode_splits(shape).0 == 2 { &[false, true] } else { &[false] };
            // The Hopper kernels' defaults also: without programmatic dependent launch ("/nopdl");
            // each sequence's heads as two blocks over all of its keys whatever its length
            // ("+halves", `set_head_halves_max_tiles`) and never; S on a tile's first half of dims
            // before the second lands, switched from the default ("/shalf" on, "/noshalf" off).
            let (default_halves, default_shalf) = (head_halves_max_tiles(), s_half_first());
            // (tma, s_wg, f32_merge, pdl, head halves up to, their S-warpgroup form, S half first)
            let mut configs = Vec::new();
            for &t in variants {
                for &k in kernels {
                    for &m in merges {
                        configs.push((t, k, m, true, default_halves, false, default_shalf));
                        if wgmma && t && k && !m {
                            configs.push((t, k, m, false, default_halves, false, default_shalf));
                            if !no_halves {
                                configs.push((t, k, m, true, 0, false, default_shalf));
                                configs.push((t, k, m, true, u32::MAX, false, default_shalf));
                                configs.push((t, k, m, true, u32::MAX, true, default_shalf));
                            }
                            configs.push((t, k, m, true, default_halves, false, !default_shalf));
                        }
                    }
                }
            }
            let mut seen = Vec::new();
            for (tma, s_wg, f32_merge, pdl, halves, halves_sp, shalf) in configs {
                set_tma_runs(tma);
                set_s_warpgroup(s_wg);
                set_merge_f32(f32_merge);
                ops::set_pdl(pdl);
                set_head_halves_max_tiles(halves);
                set_head_halves_sp(halves_sp);
                set_s_half_first(shalf);
                let kernel = cuda_kernel(&s, shape).unwrap_or_default();
                // A setting the kernel ignores, or a forced one that picks what another row already
                // ran, is not run again.
                let shalf = shalf && kernel.starts_with("di_attn_decode_sp");
                let key = (tma, s_wg, f32_merge, pdl, kernel, shalf);
                if seen.contains(&key) {
                    continue;
                }
                seen.push(key);
                let kernel = format!(
                    "{kernel}{}{}{}{}",
                    if tma { "" } else { "/gather" },
                    if f32_merge { "/f32merge" } else { "" },
                    if pdl { "" } else { "/nopdl" },
                    match (shalf == default_shalf, shalf) {
                        (true, _) => "",
                        (false, true) => "/shalf",
                        (false, false) => "/noshalf",
                    }
                );
                attention_decode(&s, &qb, &pools[0], &rb, &cb, &sb, &mut out, &mut st, shape, scale).unwrap();
                // Check sequence 0 against the CPU.
                let one = DecodeAttnShape { batch: 1, ..shape };
                let mut want = vec![bf16::ZERO; heads as usize * d];
                deepinfer_kernels_ffi::cpu::attention::attention_decode(
                    &q[..heads as usize * d],
                    &kv,
                    &rows[..keys as usize],
                    &counts[..1],
                    &sink,
                    &mut want,
                    one,
                    scale,
                );
                let got: Vec<f32> =
                    s.download_range(&out, 0, heads as usize * d).unwrap().iter().map(|v| v.to_f32()).collect();
                let (rel, _) = rel_err(&got, &want.iter().map(|v| v.to_f32()).collect::<Vec<_>>());
                // A row that fails its check is reported and not timed; the bench fails at the end
                // (after the other rows: an experimental kernel costs no one else's figures).
                if rel.is_nan() || rel >= 1e-2 {
                    println!("attention_decode {kernel:<17} {what:<30} FAILED: rel_err {rel:e} against the CPU");
                    failed.push(format!("{kernel} {what}: rel_err {rel:e}"));
                    continue;
                }
                let mut i = 0;
                let mut times = Vec::new();
                for rep in 0..22 {
                    let a = s.record_event().unwrap();
                    for _ in 0..20 {
                        i = (i + 1) % copies;
                        attention_decode(&s, &qb, &pools[i], &rb, &cb, &sb, &mut out, &mut st, shape, scale).unwrap();
                    }
                    let e = s.record_event().unwrap();
                    if rep >= 2 {
                        times.push(a.elapsed_ms(&e).unwrap() as f64 / 20.0);
                    }
                }
                let ms = median(times);
                // The same 20 calls as one CUDA graph: the GPU's time without the host's submission
                // of each call in between (which an empty launch of this kernel shows to be ~9 us).
                s.synchronize().unwrap();
                let gs = dev.new_stream().unwrap();
                let graph = gs
                    .capture(|g| {
                        for k in 0..20 {
                            attention_decode(
                                g,
                                &qb,
                                &pools[k % copies],
                                &rb,
                                &cb,
                                &sb,
                                &mut out,
                                &mut st,
                                shape,
                                scale,
                            )?;
                        }
                        Ok(())
                    })
                    .unwrap();
                let mut gtimes = Vec::new();
                for rep in 0..12 {
                    let a = gs.record_event().unwrap();
                    graph.launch().unwrap();
                    let e = gs.record_event().unwrap();
                    if rep >= 2 {
                        gtimes.push(a.elapsed_ms(&e).unwrap() as f64 / 20.0);
                    }
                }
                gs.synchronize().unwrap();
                let graph_ms = median(gtimes);
                let bytes = (batch * keys) as f64 * d as f64 * 2.0 + 2.0 * q.len() as f64 * 2.0;
                let flops = 4.0 * batch as f64 * heads as f64 * keys as f64 * d as f64;
                let floor_ms = bytes / BYTES_PER_S * 1e3;
                // Head halves split no keys: one split of every tile (and twice the blocks).
                let (splits, per) = if kernel.starts_with("di_attn_decode_hs") || kernel.contains("+halves") {
                    (1, keys.div_ceil(64))
                } else {
                    decode_splits(shape)
                };
                println!(
                    "attention_decode {kernel:<17} {what:<30} batch={batch} heads={heads} keys={keys:<5} splits={splits}x{per}  {:>7.1} MB  median {ms:.4} ms  floor {floor_ms:.4} ms  achieved/floor {:.3}  {:.0} GB/s  {:.0} TFLOP/s  rel_err {rel:.1e}  graph {graph_ms:.4} ms  {:.3}",
                    bytes / 1e6,
                    floor_ms / ms,
                    bytes / (ms * 1e-3) / 1e9,
                    flops / (ms * 1e-3) / 1e12,
                    floor_ms / graph_ms
                );
                results.push(
                    serde_json::json!({"op": "attention_decode", "kernel": kernel, "case": what, "batch": batch, "heads": heads, "head_dim": d,
                    "keys": keys, "splits": splits, "tiles_per_split": per, "bytes": bytes, "flops": flops, "median_ms": ms,
                    "floor_ms": floor_ms, "achieved_over_floor": floor_ms / ms, "graph_median_ms": graph_ms,
                    "graph_achieved_over_floor": floor_ms / graph_ms, "tflop_per_s": flops / (ms * 1e-3) / 1e12,
                    "rel_err_vs_cpu_seq0": rel}),
                );
            }
            set_tma_runs(true);
            set_s_warpgroup(true);
            set_merge_f32(false);
            ops::set_pdl(true);
            set_head_halves_max_tiles(default_halves);
            set_head_halves_sp(false);
            set_s_half_first(default_shalf);
        }
        set_wgmma(true);
        drop(pools);
    }
    // The lightning indexer at decode: 64 sequences, 64 heads x 128, k = 512, over the compressed
    // indexer keys of 8k and 128k contexts (2048 and 32768 candidate rows, ratio 4).
    for (what, rows_n) in [("indexer 8k (2048 rows)", 2048u32), ("indexer 128k (32768 rows)", 32768)] {
        use deepinfer_kernels_ffi::indexer::{indexer_decode, IndexerShape};
        if !wanted(&format!("indexer_decode {what}")) {
            continue;
        }
        let shape = IndexerShape { batch, heads: 64, dim: 128, max_rows: rows_n, k: 512 };
        let pool = (batch * rows_n) as usize;
        let b = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
        let qb = s.upload(&b(rng.vec(batch as usize * 64 * 128))).unwrap();
        let wb = s.upload(&rng.vec(batch as usize * 64)).unwrap();
        let copies = ((256usize << 20) / (pool * 256)).max(1);
        let keys: Vec<_> = (0..copies).map(|_| s.upload(&b(rng.vec(pool * 128))).unwrap()).collect();
        // Each sequence's keys in its own pages, in a shuffled order.
        let rows: Vec<i32> = (0..pool as u64).map(|i| ((i * 2654435761) % pool as u64) as i32).collect();
        let (rb, cb) = (s.upload(&rows).unwrap(), s.upload(&vec![rows_n as i32; batch as usize]).unwrap());
        let mut sc = s.zeros::<f32>(pool).unwrap();
        let mut tk = s.zeros::<i32>(batch as usize * 512).unwrap();
        let mut st = s.zeros::<i32>(1).unwrap();
        let scale = 1.0 / (64f32 * 128.0).sqrt();
        let mut i = 0;
        let mut times = Vec::new();
        for rep in 0..12 {
            let a = s.record_event().unwrap();
            for _ in 0..5 {
                i = (i + 1) % copies;
                indexer_decode(&s, &qb, &wb, &keys[i], &rb, &cb, &mut sc, &mut tk, &mut st, shape, scale).unwrap();
            }
            let e = s.record_event().unwrap();
            if rep >= 2 {
                times.push(a.elapsed_ms(&e).unwrap() as f64 / 5.0);
            }
        }
        let ms = median(times);
        let bytes = pool as f64 * 256.0 + pool as f64 * 4.0 * 2.0;
        let flops = 2.0 * pool as f64 * 64.0 * 128.0;
        let floor_ms = bytes / BYTES_PER_S * 1e3;
        println!(
            "indexer_decode {what:<26} batch={batch} k=512  {:>7.1} MB  median {ms:.4} ms  floor {floor_ms:.4} ms  achieved/floor {:.3}  {:.0} TFLOP/s",
            bytes / 1e6,
            floor_ms / ms,
            flops / (ms * 1e-3) / 1e12
        );
        results.push(serde_json::json!({"op": "indexer_decode", "case": what, "batch": batch, "rows": rows_n, "k": 512,
            "bytes": bytes, "flops": flops, "median_ms": ms, "floor_ms": floor_ms, "achieved_over_floor": floor_ms / ms}));
    }
    // The lightning indexer for a prefill chunk: 4096 tokens at the end of a 128k context share
    // their sequence's 32768 compressed rows (token t sees the windows closed by its position), k =
    // 512. Floor: the FLOPs (2 x 64 x 128 a token and row) at the bf16 matrix-unit rate, the larger
    // of that and the bytes (keys once, the scores written and read back).
    if wanted("indexer_prefill") {
        use deepinfer_kernels_ffi::indexer::{indexer_prefill, prefill_cuda_kernel, set_wgmma, IndexerShape};
        const BF16_FLOP_PER_S: f64 = 790e12;
        let (tokens, rows_n, k) = (4096u32, 32768u32, 512u32);
        let pos0 = 131072 - tokens as usize;
        let shape = IndexerShape { batch: tokens, heads: 64, dim: 128, max_rows: rows_n, k };
        let b = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
        let qb = s.upload(&b(rng.vec(tokens as usize * 64 * 128))).unwrap();
        let wb = s.upload(&rng.vec(tokens as usize * 64)).unwrap();
        let keys = s.upload(&b(rng.vec(rows_n as usize * 128))).unwrap();
        let list: Vec<i32> = (0..rows_n as u64).map(|i| ((i * 2654435761) % rows_n as u64) as i32).collect();
        let counts: Vec<i32> = (0..tokens as usize).map(|t| ((pos0 + t + 1) / 4) as i32).collect();
        let (rb, cb) = (s.upload(&list).unwrap(), s.upload(&counts).unwrap());
        let mut sc = s.zeros::<f32>(tokens as usize * rows_n as usize).unwrap();
        let mut tk = s.zeros::<i32>(tokens as usize * k as usize).unwrap();
        let mut st = s.zeros::<i32>(1).unwrap();
        let scale = 1.0 / (64f32 * 128.0).sqrt();
        for (wgmma, kernel) in switch_kernels(set_wgmma, || prefill_cuda_kernel(&s)) {
            set_wgmma(wgmma);
            let mut times = Vec::new();
            for rep in 0..6 {
                let a = s.record_event().unwrap();
                indexer_prefill(&s, &qb, &wb, &keys, &rb, &cb, &mut sc, &mut tk, &mut st, shape, scale).unwrap();
                let e = s.record_event().unwrap();
                if rep >= 1 {
                    times.push(a.elapsed_ms(&e).unwrap() as f64);
                }
            }
            let ms = median(times);
            let flops = 2.0 * tokens as f64 * rows_n as f64 * 64.0 * 128.0;
            let bytes = rows_n as f64 * 256.0 + 2.0 * tokens as f64 * rows_n as f64 * 4.0;
            let floor_ms = (flops / BF16_FLOP_PER_S).max(bytes / BYTES_PER_S) * 1e3;
            println!(
                "indexer_prefill {kernel:<29} 128k context, chunk of {tokens} tokens  rows={rows_n} k={k}  median {ms:.3} ms  {:.0} TFLOP/s  floor {floor_ms:.3} ms  achieved/floor {:.3}",
                flops / (ms * 1e-3) / 1e12,
                floor_ms / ms
            );
            results.push(
                serde_json::json!({"op": "indexer_prefill", "kernel": kernel, "case": "128k context, 4096-token chunk", "tokens": tokens,
                "rows": rows_n, "k": k, "flops": flops, "bytes": bytes, "median_ms": ms, "floor_ms": floor_ms,
                "achieved_over_floor": floor_ms / ms, "tflop_per_s": flops / (ms * 1e-3) / 1e12}),
            );
        }
        set_wgmma(true);
    }
    // Prefill attention for one 32k-token chunk (each query its own rows, the decode kernel's
    // gathered form): CSA (128 window + 512 selected rows) and sliding-only (128). Floor: the bf16
    // matrix-unit rate (790 TFLOP/s measured on this kind) over the FLOPs the masks need
    // (4 x heads x 512 x keys per query).
    {
        use deepinfer_kernels_ffi::attention::{attention_prefill, PrefillAttnShape};
        const BF16_FLOP_PER_S: f64 = 790e12;
        let tokens = 32768u32;
        for (what, keys) in [("CSA prefill 32k (128 + 512)", 640u32), ("sliding prefill 32k (128)", 128)] {
            if !wanted(&format!("attention_prefill {what}")) {
                continue;
            }
            let shape = PrefillAttnShape { tokens, heads, head_dim: d as u32, max_keys: keys };
            let pool = tokens as usize + 8192;
            let b = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
            let qb = s.upload(&b(rng.vec(tokens as usize * heads as usize * d))).unwrap();
            let kvb = s.upload(&b(rng.vec(pool * d))).unwrap();
            // Query t: its 128-row window ending at t, then (CSA) 512 rows spread over the pool.
            let rows: Vec<i32> = (0..tokens as usize)
                .flat_map(|t| {
                    (0..keys as usize).map(move |j| {
                        if j < 128 {
                            (t + 8192 - 127 + j) as i32
                        } else {
                            ((t * 7919 + j * 104729) % 8192) as i32
                        }
                    })
                })
                .collect();
            let (rb, cb) = (s.upload(&rows).unwrap(), s.upload(&vec![keys as i32; tokens as usize]).unwrap());
            let sb = s.upload(&rng.vec(heads as usize)).unwrap();
            let mut out = s.zeros::<bf16>(tokens as usize * heads as usize * d).unwrap();
            let mut st = s.zeros::<i32>(1).unwrap();
            let as_decode = DecodeAttnShape { batch: tokens, heads, head_dim: d as u32, max_keys: keys };
            for (wgmma, kernel) in switch_kernels(set_wgmma, || cuda_kernel(&s, as_decode)) {
                set_wgmma(wgmma);
                // On the Hopper kernel the window tiles (64 consecutive rows) by TMA (the default)
                // and gathered row by row ("/gather").
                let variants: &[bool] = if wgmma { &[true, false] } else { &[true] };
                for &tma in variants {
                    set_tma_runs(tma);
                    let kernel = if tma { kernel.to_string() } else { format!("{kernel}/gather") };
                    let mut times = Vec::new();
                    for rep in 0..5 {
                        let a = s.record_event().unwrap();
                        attention_prefill(&s, &qb, &kvb, &rb, &cb, &sb, &mut out, &mut st, shape, scale).unwrap();
                        let e = s.record_event().unwrap();
                        if rep >= 1 {
                            times.push(a.elapsed_ms(&e).unwrap() as f64);
                        }
                    }
                    let ms = median(times);
                    let flops = 4.0 * tokens as f64 * heads as f64 * keys as f64 * d as f64;
                    let floor_ms = flops / BF16_FLOP_PER_S * 1e3;
                    println!(
                        "attention_prefill {kernel:<17} {what:<28} tokens={tokens} heads={heads} keys={keys}  median {ms:.3} ms  {:.0} TFLOP/s  bf16 floor {floor_ms:.3} ms  achieved/floor {:.3}",
                        flops / (ms * 1e-3) / 1e12,
                        floor_ms / ms
                    );
                    results.push(serde_json::json!({"op": "attention_prefill", "kernel": kernel, "case": what, "tokens": tokens, "heads": heads,
                        "head_dim": d, "keys_per_query": keys, "flops": flops, "median_ms": ms, "floor_ms": floor_ms,
                        "achieved_over_floor": floor_ms / ms, "tflop_per_s": flops / (ms * 1e-3) / 1e12}));
                }
                set_tma_runs(true);
            }
            set_wgmma(true);
        }
    }
    // The compressors: decode (64 sequences, one token each, every one closing a window) and a
    // 4096-token prefill chunk of one sequence; CSA (ratio 4, overlapping, 512 wide, KV QAT), the
    // indexer's (ratio 4, overlapping, 128 wide) and HCA (ratio 128, 512 wide).
    {
        use deepinfer_kernels_ffi::compressor::{
            compress, pack_seqs, CompressSeq, CompressShape, CompressState, PoolShape, RowQat,
        };
        for (name, ratio, width, overlap, qat) in [
            ("CSA", 4usize, 512usize, true, RowQat::Fp8Blocks64),
            ("indexer", 4, 128, true, RowQat::None),
            ("HCA", 128, 512, false, RowQat::Fp8Blocks64),
        ] {
            if !wanted(&format!("compress {name}")) {
                continue;
            }
            let shape = PoolShape { ratio, width, overlap };
            let cw = shape.token_width();
            for (case, seqs_n, len) in [("decode", 64usize, 1usize), ("prefill", 1, 4096)] {
                let tokens = seqs_n * len;
                let seqs: Vec<CompressSeq> = (0..seqs_n)
                    .map(|b| {
                        let pos0 = if len == 1 { (1000 * ratio + ratio - 1) as i32 } else { 0 };
                        CompressSeq { tok_start: (b * len) as i32, tok_count: len as i32, pos0, slot: b as i32 }
                    })
                    .collect();
                let max_windows = seqs.iter().map(|q| q.closes(ratio)).max().unwrap();
                let windows = seqs_n * max_windows;
                let kv = s.upload(&rng.vec(tokens * cw)).unwrap();
                let gate = s.upload(&rng.vec(tokens * cw)).unwrap();
                let ape = s.upload(&rng.vec(ratio * cw)).unwrap();
                let norm = s.upload(&vec![1.0f32; width]).unwrap();
                let invf = s.upload(&[0.01f32; 32]).unwrap();
                let seqb = s.upload(&pack_seqs(&seqs)).unwrap();
                let rows = s.upload(&(0..windows as i32).collect::<Vec<_>>()).unwrap();
                let mut state = CompressState::new(&s, seqs_n, shape).unwrap();
                let mut pool = s.zeros::<bf16>(windows * width).unwrap();
                let mut st = s.zeros::<i32>(1).unwrap();
                let cs = CompressShape { pool: shape, rope_dim: 64, batch: seqs_n, max_windows, tokens };
                let mut times = Vec::new();
                for rep in 0..12 {
                    let a = s.record_event().unwrap();
                    for _ in 0..20 {
                        compress(
                            &s, &kv, &gate, &ape, &norm, &invf, &seqb, &rows, &mut state, &mut pool, &mut st, cs, qat,
                            1e-6,
                        )
                        .unwrap();
                    }
                    let e = s.record_event().unwrap();
                    if rep >= 2 {
                        times.push(a.elapsed_ms(&e).unwrap() as f64 / 20.0);
                    }
                }
                let ms = median(times);
                // Inputs read once, ape, state (open buffer and prev read for decode), rows written.
                let state_bytes =
                    if len == 1 { seqs_n * ratio * (cw + if overlap { width } else { 0 }) * 4 * 2 } else { 0 };
                let bytes = (tokens * cw * 4 * 2 + ratio * cw * 4 + state_bytes + windows * width * 2) as f64;
                let floor_ms = bytes / BYTES_PER_S * 1e3;
                println!(
                    "compress {name:<8} {case:<8} seqs={seqs_n} tokens={tokens} windows={windows}  {:>7.2} MB  median {ms:.4} ms  floor {floor_ms:.4} ms  achieved/floor {:.3}",
                    bytes / 1e6,
                    floor_ms / ms
                );
                results.push(serde_json::json!({"op": "compress", "case": format!("{name} {case}"), "sequences": seqs_n,
                    "tokens": tokens, "windows": windows, "ratio": ratio, "width": width, "bytes": bytes, "median_ms": ms,
                    "floor_ms": floor_ms, "achieved_over_floor": floor_ms / ms}));
            }
        }
    }
    let report = deepinfer_kernels_ffi::report::SystemReport::gather();
    let doc = serde_json::json!({
        "bench": "kernels-ffi gpu_attention",
        "device": report.gpus.first().map(|g| g.name.clone()).unwrap_or_default(),
        "driver": report.driver_version.unwrap_or_else(|e| e),
        "bytes_per_s": BYTES_PER_S,
        "method": "bf16 pool, random rows; pools rotate (> 256 MiB); CUDA events around batches of 20 launches, 2 warm-up batches, median of 20",
        "results": results,
    });
    if let Some(path) = std::env::var_os("DEEPINFER_BENCH_JSON") {
        std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    }
    assert!(failed.is_empty(), "rows that failed their check against the CPU: {failed:#?}");
}
