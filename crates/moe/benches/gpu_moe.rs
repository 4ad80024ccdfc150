//! One MoE sublayer at V4-Flash shapes on the GPU (issue #7): 256 routed experts with FP4 weights,
//! top-6, a shared expert with FP8 weights, hidden 4096, intermediate 2048; 1, 16, 64 and 4,096 tokens.
//! Prints a table and, with DEEPINFER_BENCH_JSON set, writes the numbers as JSON; prints that it
//! skipped without a GPU. The PyTorch peer (transformers' DeepseekV4SparseMoeBlock, bf16) runs
//! from `benches/peers/moe_layer_torch.py` in the same visit.
//!
//! Floor = the larger of (weight bytes of the experts the batch touches + shared + router) / 4.3
//! TB/s and the layer's FLOPs / 790 TFLOP/s (the bf16 matrix-unit rate measured on this H200
//! kind; Hopper has no FP4 matrix units, so expanded FP4 weights run at the bf16 rate).
//! Method: several different inputs rotate (different experts each call, so weights come from
//! HBM), warm-up, then CUDA events around batches of forwards, median of the batches.

use deepinfer_kernels_ffi::moe::{self as mops, GroupedInput, RouteBy};
use deepinfer_kernels_ffi::ops::{
    gemm_lowp, set_fp4_dec_pre, set_fp4_dec_wgmma, set_fp4_wgmma, set_moe_dispatch_small, set_pdl, WeightFormat,
};
use deepinfer_kernels_ffi::testing::{cuda_device_or_skip, SplitMix};
use deepinfer_kernels_ffi::GemmParams;
use deepinfer_kernels_ffi::{DeviceBuffer, Stream};
use deepinfer_moe::layer::{
    forward, set_settled_down, set_shared_expert_overlap, ExpertWeights, MoeWeights, MoeWorkspace, RandomMoe,
};
use half::bf16;

const BYTES_PER_S: f64 = 4.3e12;
const BF16_FLOP_PER_S: f64 = 790e12;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Milliseconds a step takes: CUDA events on `s` around 12 batches of `batch` steps, the first two
/// a warm-up, the median of the rest divided by `batch`.
fn batched_ms(s: &Stream, batch: usize, mut step: impl FnMut()) -> f64 {
    let mut times = Vec::new();
    for rep in 0..12 {
        let a = s.record_event().unwrap();
        for _ in 0..batch {
            step();
        }
        let b = s.record_event().unwrap();
        if rep >= 2 {
            times.push(a.elapsed_ms(&b).unwrap() as f64 / batch as f64);
        }
    }
    median(times)
}

/// The earlier FP4 grouped decode kernel (`true`: the Hopper FP8 tensor-core decode kernel switched
/// off, so decode chunks run the streaming mma.sync kernel) or the current ones (`false`, the
/// default). Prefill chunks run the Hopper wgmma kernel either way (its A/B against the tiled
/// kernel is in benches/results/2026-11-30-moe-prefill-wgmma).
fn earlier_fp4(on: bool) {
    set_fp4_dec_wgmma(!on);
}

/// An expert set's weights and scales.
type Mat = (DeviceBuffer<u8>, DeviceBuffer<u8>);

/// Separate w1 and w3 copies of stacked expert weights (the layout before the stacking).
fn unstack(s: &Stream, e: &ExpertWeights, inter: u32, dim: u32) -> (Mat, Mat) {
    let (wb, sb) = e.format.bytes(inter as usize, dim as usize);
    let halves = |buf: &DeviceBuffer<u8>, per: usize| {
        let (a, b) = ExpertWeights::unstack_gate_up(&s.download(buf).unwrap(), per).unwrap();
        (s.upload(&a).unwrap(), s.upload(&b).unwrap())
    };
    let ((w1, w3), (s1, s3)) = (halves(&e.w13.0, wb), halves(&e.w13.1, sb));
    ((w1, s1), (w3, s3))
}

fn case(
    s: &Stream,
    w: &MoeWeights,
    split: &(Mat, Mat),
    shared_split: &(Mat, Mat),
    tokens: u32,
    rng: &mut SplitMix,
) -> serde_json::Value {
    let (d, i, e, k) = (w.dim as usize, w.inter as usize, w.experts() as usize, w.top_k as usize);
    let inputs = (64 / tokens.min(64)).clamp(2, 32) as usize;
    let xs: Vec<_> = (0..inputs)
        .map(|_| {
            let x: Vec<bf16> = rng.vec(tokens as usize * d).into_iter().map(|v| bf16::from_f32(2.0 * v)).collect();
            s.upload(&x).unwrap()
        })
        .collect();
    let mut ws = MoeWorkspace::new(s, w, tokens).unwrap();
    let mut out = s.zeros::<bf16>(tokens as usize * d).unwrap();
    // Distinct experts each input touches (for the byte floor).
    let mut touched = Vec::new();
    for x in &xs {
        forward(s, w, x, None, &mut ws, &mut out).unwrap();
        let ids = s.download(&ws.routed.ids).unwrap();
        let mut seen = vec![false; e];
        ids.iter().filter(|v| **v >= 0).for_each(|v| seen[*v as usize] = true);
        touched.push(seen.iter().filter(|v| **v).count() as f64);
    }
    let got: Vec<f32> = s.download(&out).unwrap().iter().map(|v| v.to_f32()).collect();
    assert!(got.iter().all(|v| v.is_finite()), "MoE output not finite");
    let active = touched.iter().sum::<f64>() / touched.len() as f64;
    let batch = if tokens >= 1024 { 3 } else { 20 };
    let mut at = 0;
    let mut layer_ms = |ws: &mut MoeWorkspace, out: &mut deepinfer_kernels_ffi::DeviceBuffer<bf16>| {
        batched_ms(s, batch, || {
            at = (at + 1) % inputs;
            forward(s, w, &xs[at], None, ws, out).unwrap();
        })
    };
    // The routed GEMMs' kernels as they are (the default) and with the earlier FP4 decode kernel
    // (the Hopper FP8 tensor-core decode kernel switched off: the streaming mma.sync kernel).
    let gemm_kernels = || {
        let dsp = &ws.dispatch;
        let gate =
            mops::gemm_grouped_cuda_kernel(s, w.routed.format, dsp, 2 * w.inter, w.dim, true).unwrap_or_default();
        let down =
            mops::gemm_grouped_cuda_kernel(s, w.routed.format, dsp, w.dim, w.inter, dsp.tile <= 16).unwrap_or_default();
        (gate, down)
    };
    let kernels_on = gemm_kernels();
    earlier_fp4(true);
    let kernels_off = gemm_kernels();
    let ms_off = if kernels_off != kernels_on { Some(layer_ms(&mut ws, &mut out)) } else { None };
    earlier_fp4(false);
    // The shared expert on the caller's stream after the routed experts (the overlap off), then as
    // it runs by default.
    set_shared_expert_overlap(false);
    let ms_serial_shared = layer_ms(&mut ws, &mut out);
    set_shared_expert_overlap(true);
    // Every kernel launched without programmatic dependent launch (each waits for the one before
    // to finish before it even starts), then as by default.
    set_pdl(false);
    let ms_no_pdl = layer_ms(&mut ws, &mut out);
    set_pdl(true);
    // The routed SwiGLU and the down GEMM as plain launches, then as by default (the SwiGLU under
    // programmatic dependent launch and the down GEMM over a settled dispatch, streaming its
    // weights under the SwiGLU).
    set_settled_down(false);
    let ms_plain_down = layer_ms(&mut ws, &mut out);
    set_settled_down(true);
    let ms = layer_ms(&mut ws, &mut out);
    // Decode batches as one CUDA graph a forward (the same inputs, a graph each, on a stream of
    // the bench's own: CUDA cannot capture the legacy default stream): what the forward's host
    // time and launches cost. Replays are checked against a direct forward.
    let ms_graph = (tokens <= 64).then(|| {
        let gs = s.device().new_stream().unwrap();
        let mut gws = MoeWorkspace::new(&gs, w, tokens).unwrap();
        let mut gout = gs.zeros::<bf16>(tokens as usize * d).unwrap();
        forward(&gs, w, &xs[0], None, &mut gws, &mut gout).unwrap();
        let want = gs.download(&gout).unwrap();
        let graphs: Vec<_> =
            xs.iter().map(|x| gs.capture(|st| forward(st, w, x, None, &mut gws, &mut gout)).unwrap()).collect();
        graphs[0].launch().unwrap();
        assert_eq!(gs.download(&gout).unwrap(), want, "the graph's forward differs from the direct one");
        let mut g = 0;
        batched_ms(&gs, batch, || {
            g = (g + 1) % graphs.len();
            graphs[g].launch().unwrap();
        })
    });
    // Where the time goes: each stage alone on the last input's routing (same workspace).
    let x = &xs[at];
    let stage = |f: &mut dyn FnMut()| {
        let mut t = Vec::new();
        for _ in 0..7 {
            let a = s.record_event().unwrap();
            f();
            let b = s.record_event().unwrap();
            t.push(a.elapsed_ms(&b).unwrap() as f64);
        }
        median(t)
    };
    let (r, sh) = (&w.routed, w.shared.as_ref().unwrap());
    // The layer's routed gate/up and down GEMMs on a dispatch (the stage rows and the GPU-queued rows).
    // On a given stream (the graph rows capture them on a stream of their own).
    let gate_up_on = |st: &Stream, x: &DeviceBuffer<bf16>, dsp: &mops::MoeDispatch, gu: &mut DeviceBuffer<bf16>| {
        let xin = GroupedInput::Tokens(x);
        mops::gemm_grouped(st, r.format, xin, dsp, &r.w13.0, &r.w13.1, gu, 2 * w.inter, w.dim, true)
    };
    // `settled`: over a settled dispatch, as the layer can run it after the SwiGLU (the GPU-queued
    // calls cycle through dispatches made before them, so each is settled for the next call).
    let down_on =
        |settled: bool, st: &Stream, h: &DeviceBuffer<bf16>, dsp: &mops::MoeDispatch, y: &mut DeviceBuffer<bf16>| {
            let f = if settled { mops::gemm_grouped_settled } else { mops::gemm_grouped };
            f(st, r.format, GroupedInput::Rows(h), dsp, &r.w2.0, &r.w2.1, y, w.dim, w.inter, dsp.tile <= 16)
        };
    let gate_up_gemm = |x: &DeviceBuffer<bf16>, dsp: &mops::MoeDispatch, gu: &mut DeviceBuffer<bf16>| {
        gate_up_on(s, x, dsp, gu).unwrap()
    };
    let down_gemm = |h: &DeviceBuffer<bf16>, dsp: &mops::MoeDispatch, y: &mut DeviceBuffer<bf16>| {
        down_on(false, s, h, dsp, y).unwrap()
    };
    let pairs = tokens * w.top_k;
    let mut stages = serde_json::Map::new();
    stages.insert(
        "router_logits".into(),
        stage(&mut || mops::router_logits(s, x, &w.gate, &mut ws.logits, tokens, e as u32, d as u32).unwrap()).into(),
    );
    // The dispatch as one launch where the batch allows it (the default), and as count, plan and
    // place launches.
    for (name, small) in [("route_and_dispatch", true), ("route_and_dispatch_three_launches", false)] {
        if !small && pairs as usize > mops::DISPATCH_SMALL_MAX_PAIRS {
            continue;
        }
        set_moe_dispatch_small(small);
        let t = stage(&mut || {
            let by = RouteBy::Score { bias: w.bias.as_ref() };
            mops::route(s, &ws.logits, &by, w.scaling, ws.dispatch.shape, &mut ws.routed).unwrap();
            mops::dispatch(s, &ws.routed.ids, &mut ws.dispatch).unwrap();
        });
        set_moe_dispatch_small(true);
        stages.insert(name.into(), t.into());
    }
    // The router and dispatch as the layer runs them (`router_dispatch`: the GEMM, then the routing
    // folding its k splits, with the dispatch in the same launch up to 32 tokens): the stages above
    // less router_logits' fold launch, route's status reset and (decode) the dispatch's launch.
    stages.insert(
        "router_and_dispatch".into(),
        stage(&mut || {
            let by = RouteBy::Score { bias: w.bias.as_ref() };
            let (logits, routed, dsp) = (&mut ws.logits, &mut ws.routed, &mut ws.dispatch);
            mops::router_dispatch(s, x, &w.gate, logits, d as u32, &by, w.scaling, routed, dsp).unwrap();
        })
        .into(),
    );
    // The tile64 / tile128 entries are the tiled mma.sync kernel (the earlier kernels). Gate and up
    // are one GEMM over the stacked [2 inter, dim] expert matrices.
    for (name, tile, earlier) in [
        ("routed_gate_up_gemm", ws.dispatch.tile, false),
        ("routed_gate_up_gemm_earlier_kernel", ws.dispatch.tile, true),
        ("routed_gate_up_gemm_tile128", 128, true),
        ("routed_gate_up_gemm_tile64", 64, true),
    ] {
        let duplicate = name == "routed_gate_up_gemm_earlier_kernel" && kernels_off.0 == kernels_on.0;
        if (tokens < 1024 && tile >= 64 && name != "routed_gate_up_gemm") || duplicate {
            continue;
        }
        earlier_fp4(earlier);
        set_fp4_wgmma(tile < 64 || !earlier); // the tiled mma.sync kernel for the tile64 / tile128 rows
        let mut dsp = mops::MoeDispatch::with_tile(s, ws.dispatch.shape, tile).unwrap();
        mops::dispatch(s, &ws.routed.ids, &mut dsp).unwrap();
        let t = stage(&mut || gate_up_gemm(x, &dsp, &mut ws.gu));
        earlier_fp4(false);
        set_fp4_wgmma(true);
        stages.insert(name.to_string(), t.into());
    }
    // The same two products as two GEMMs over separate w1 and w3 copies (the layout before the
    // stacking), for the A/B in one visit.
    let (g_sep, u_sep) = (&mut ws.h, &mut ws.y);
    stages.insert(
        "routed_gate_and_up_separate".into(),
        stage(&mut || {
            for (m, out) in [(&split.0, &mut *g_sep), (&split.1, &mut *u_sep)] {
                mops::gemm_grouped(
                    s,
                    r.format,
                    GroupedInput::Tokens(x),
                    &ws.dispatch,
                    &m.0,
                    &m.1,
                    out,
                    w.inter,
                    w.dim,
                    true,
                )
                .unwrap()
            }
        })
        .into(),
    );
    stages.insert(
        "swiglu".into(),
        stage(&mut || {
            mops::swiglu(s, &ws.gu, &mut ws.h, Some((&ws.routed, &ws.dispatch)), pairs, w.inter, w.limit, true).unwrap()
        })
        .into(),
    );
    for (name, earlier) in [("routed_down_gemm", false), ("routed_down_gemm_earlier_kernel", true)] {
        if earlier && kernels_off.1 == kernels_on.1 {
            continue;
        }
        earlier_fp4(earlier);
        let t = stage(&mut || down_gemm(&ws.h, &ws.dispatch, &mut ws.y));
        earlier_fp4(false);
        stages.insert(name.into(), t.into());
    }
    stages.insert(
        "shared_gate_up_gemm".into(),
        stage(&mut || {
            gemm_lowp(
                s,
                sh.format,
                x,
                &sh.w13.0,
                &sh.w13.1,
                &mut ws.shared_gu,
                &GemmParams::new(tokens, 2 * w.inter, w.dim, true),
            )
            .unwrap()
        })
        .into(),
    );
    stages.insert(
        "shared_gate_and_up_separate".into(),
        stage(&mut || {
            for m in [&shared_split.0, &shared_split.1] {
                gemm_lowp(s, sh.format, x, &m.0, &m.1, &mut ws.shared_h, &GemmParams::new(tokens, w.inter, w.dim, true))
                    .unwrap()
            }
        })
        .into(),
    );
    stages.insert(
        "combine".into(),
        stage(&mut || {
            mops::combine(s, &ws.y, &ws.routed, &ws.dispatch, Some(&ws.shared_y), &mut out, w.dim, true).unwrap()
        })
        .into(),
    );
    println!("  stages (ms, each alone): {}", serde_json::Value::Object(stages.clone()));
    // Each routed GEMM stage against its weight bytes (the experts this input touches; gate and up
    // read two [inter, dim] matrices an expert, down one).
    let (eb, esb) = w.routed.format.bytes(i, d);
    let expert_bytes = (eb + esb) as f64;
    let ids = s.download(&ws.routed.ids).unwrap();
    let mut seen = vec![false; e];
    ids.iter().filter(|v| **v >= 0).for_each(|v| seen[*v as usize] = true);
    let mut gemm_floor = serde_json::Map::new();
    for (name, v) in &stages {
        if name.starts_with("routed_") {
            let matrices = if name.starts_with("routed_down") { 1.0 } else { 2.0 };
            let stage_bytes = matrices * seen.iter().filter(|v| **v).count() as f64 * expert_bytes;
            // ... and against its FLOPs at the bf16 matrix-unit rate (the bound at prefill sizes).
            let stage_flops = matrices * 2.0 * pairs as f64 * (d * i) as f64;
            let t = v.as_f64().unwrap();
            let f = stage_bytes / BYTES_PER_S * 1e3 / t;
            let tf = stage_flops / (t * 1e-3) / 1e12;
            println!(
                "  {name:<36} {t:.4} ms  {:.1} MB  achieved/byte floor {f:.3}  {tf:.1} TFLOP/s ({:.3} of bf16)",
                stage_bytes / 1e6,
                tf * 1e12 / BF16_FLOP_PER_S
            );
            gemm_floor.insert(name.clone(), f.into());
        }
    }
    // The routed GEMMs of decode batches GPU-queued, as the layer runs them: `batch` calls back to
    // back, each on the next input's routing, so consecutive calls read different experts' weights
    // (not what the call before left in L2). The stage rows above put events around one call, so
    // they also count the launch's own latency (~6 us: swiglu's row at one token).
    let mut queued = serde_json::Map::new();
    if tokens <= 64 {
        let dsps: Vec<_> = xs
            .iter()
            .map(|x| {
                mops::router_logits(s, x, &w.gate, &mut ws.logits, tokens, e as u32, d as u32).unwrap();
                let by = RouteBy::Score { bias: w.bias.as_ref() };
                mops::route(s, &ws.logits, &by, w.scaling, ws.dispatch.shape, &mut ws.routed).unwrap();
                let mut dsp = mops::MoeDispatch::with_tile(s, ws.dispatch.shape, ws.dispatch.tile).unwrap();
                mops::dispatch(s, &ws.routed.ids, &mut dsp).unwrap();
                dsp
            })
            .collect();
        // Achieved / byte floor of a call taking `t` ms over `matrices` weight matrices of the experts
        // each input touches (averaged over the inputs the calls cycle through).
        let of_floor = |matrices: f64, t: f64| matrices * active * expert_bytes / BYTES_PER_S * 1e3 / t;
        for earlier in [false, true] {
            if earlier && kernels_off == kernels_on {
                continue;
            }
            earlier_fp4(earlier);
            let mut q = 0;
            // Gate/up, then down, each `batch` calls back to back on the inputs' routings in turn.
            let time_both = |q: &mut usize, ws: &mut MoeWorkspace| {
                let gate_up = batched_ms(s, batch, || {
                    *q = (*q + 1) % dsps.len();
                    gate_up_gemm(&xs[*q], &dsps[*q], &mut ws.gu)
                });
                let down = batched_ms(s, batch, || {
                    *q = (*q + 1) % dsps.len();
                    down_gemm(&ws.h, &dsps[*q], &mut ws.y)
                });
                (gate_up, down)
            };
            let (gate_up, down) = time_both(&mut q, &mut ws);
            // The same calls as a captured decode step runs them: CUDA graphs of `inputs` calls
            // (one on each input's routing), replayed in turn (the current kernels only).
            let graphs = (!earlier).then(|| {
                s.synchronize().unwrap();
                let gs = s.device().new_stream().unwrap();
                // Once on the stream before capturing: per-stream scratch is made outside the graphs.
                gate_up_on(&gs, &xs[0], &dsps[0], &mut ws.gu).unwrap();
                down_on(false, &gs, &ws.h, &dsps[0], &mut ws.y).unwrap();
                let gu = gs
                    .capture(|g| xs.iter().zip(&dsps).try_for_each(|(x, dsp)| gate_up_on(g, x, dsp, &mut ws.gu)))
                    .unwrap();
                let dn =
                    gs.capture(|g| dsps.iter().try_for_each(|dsp| down_on(false, g, &ws.h, dsp, &mut ws.y))).unwrap();
                let per_call = |graph: &deepinfer_kernels_ffi::Graph| {
                    batched_ms(&gs, 1, || graph.launch().unwrap()) / dsps.len() as f64
                };
                (per_call(&gu), per_call(&dn))
            });
            if !earlier {
                // The down GEMM over settled dispatches: its chunks read and its weights issued
                // before the wait for the call before.
                let t = batched_ms(s, batch, || {
                    q = (q + 1) % dsps.len();
                    down_on(true, s, &ws.h, &dsps[q], &mut ws.y).unwrap()
                });
                s.synchronize().unwrap();
                let gs = s.device().new_stream().unwrap();
                down_on(true, &gs, &ws.h, &dsps[0], &mut ws.y).unwrap();
                let dn =
                    gs.capture(|g| dsps.iter().try_for_each(|dsp| down_on(true, g, &ws.h, dsp, &mut ws.y))).unwrap();
                let tg = batched_ms(&gs, 1, || dn.launch().unwrap()) / dsps.len() as f64;
                let (f, fg) = (of_floor(1.0, t), of_floor(1.0, tg));
                println!("  routed_down_gemm_settled  GPU-queued {t:.4} ms  achieved/byte floor {f:.3}; graph {tg:.4} ms, {fg:.3}");
                queued.insert(
                    "routed_down_gemm_settled".into(),
                    serde_json::json!({"ms": t, "achieved_over_byte_floor": f, "graph_ms": tg, "graph_achieved_over_byte_floor": fg}),
                );
            }
            // The W slots a block issues before its first x loads (the rest after them), forced.
            if !earlier {
                for pre in [1u32, 2, 3, 5, u32::MAX] {
                    set_fp4_dec_pre(pre);
                    let (gu, dn) = time_both(&mut q, &mut ws);
                    set_fp4_dec_pre(0);
                    let label = if pre == u32::MAX { "all".to_string() } else { pre.to_string() };
                    for (name, t, matrices) in [("routed_gate_up_gemm", gu, 2.0), ("routed_down_gemm", dn, 1.0)] {
                        let f = of_floor(matrices, t);
                        println!("  {name}_pre_{label:<10} GPU-queued {t:.4} ms  achieved/byte floor {f:.3}");
                        queued.insert(
                            format!("{name}_pre_{label}"),
                            serde_json::json!({"ms": t, "achieved_over_byte_floor": f}),
                        );
                    }
                }
            }
            earlier_fp4(false);
            let suffix = if earlier { "_earlier_kernel" } else { "" };
            let graph_times = graphs.map_or([None, None], |(a, b)| [Some(a), Some(b)]);
            for ((name, t, matrices), tg) in
                [("routed_gate_up_gemm", gate_up, 2.0), ("routed_down_gemm", down, 1.0)].into_iter().zip(graph_times)
            {
                let f = of_floor(matrices, t);
                let fg = tg.map(|tg| of_floor(matrices, tg));
                let graph = tg.zip(fg).map_or(String::new(), |(tg, fg)| format!("; graph {tg:.4} ms, {fg:.3}"));
                println!("  {name}{suffix:<16} GPU-queued {t:.4} ms  achieved/byte floor {f:.3}{graph}");
                queued.insert(
                    format!("{name}{suffix}"),
                    serde_json::json!({"ms": t, "achieved_over_byte_floor": f, "graph_ms": tg, "graph_achieved_over_byte_floor": fg}),
                );
            }
        }
    }
    println!("  routed GEMM kernels: gate/up {}, down {}", kernels_on.0, kernels_on.1);
    println!("  layer with the shared expert after the routed ones on one stream: {ms_serial_shared:.4} ms; overlapped on a second stream: {ms:.4} ms");
    println!(
        "  layer without programmatic dependent launch: {ms_no_pdl:.4} ms; with: {ms:.4} ms ({:.2}x)",
        ms_no_pdl / ms
    );
    println!(
        "  layer with the routed SwiGLU and down GEMM plain: {ms_plain_down:.4} ms; the down GEMM over a settled dispatch (default): {ms:.4} ms ({:.2}x)",
        ms_plain_down / ms
    );
    if let Some(gm) = ms_graph {
        println!("  layer as one CUDA graph a forward: {gm:.4} ms (direct launches {ms:.4} ms, {:.2}x)", ms / gm);
    }
    if let Some(off) = ms_off {
        println!(
            "  layer with the earlier FP4 kernels ({}, {}): {off:.4} ms; now: {ms:.4} ms ({:.2}x)",
            kernels_off.0,
            kernels_off.1,
            off / ms
        );
    }
    let bytes = w.bytes_read(active.round() as u32) as f64;
    let flops = 2.0 * tokens as f64 * ((k + 1) as f64 * 3.0 * (d * i) as f64 + (e * d) as f64);
    let (byte_ms, flop_ms) = (bytes / BYTES_PER_S * 1e3, flops / BF16_FLOP_PER_S * 1e3);
    let floor_ms = byte_ms.max(flop_ms);
    println!(
        "moe layer tokens={tokens:<5} experts touched {active:>6.1}  {:>8.1} MB  {:>8.1} GFLOP  median {ms:>8.4} ms  floor {floor_ms:.4} ms ({})  achieved/floor {:.3}  {:.1} TFLOP/s  {:.0} GB/s",
        bytes / 1e6,
        flops / 1e9,
        if byte_ms >= flop_ms { "bytes" } else { "flops" },
        floor_ms / ms,
        flops / (ms * 1e-3) / 1e12,
        bytes / (ms * 1e-3) / 1e9,
    );
    serde_json::json!({"op": "moe_layer", "tokens": tokens, "experts": e, "top_k": k, "dim": d, "inter": i,
        "routed_format": format!("{:?}", w.routed.format), "shared_format": "Fp8Block128", "experts_touched": active,
        "weight_bytes": bytes, "flops": flops, "median_ms": ms, "median_ms_plain_down": ms_plain_down, "byte_floor_ms": byte_ms, "flop_floor_ms": flop_ms,
        "floor_ms": floor_ms, "achieved_over_floor": floor_ms / ms, "tflop_per_s": flops / (ms * 1e-3) / 1e12,
        "inputs_rotated": inputs, "forwards_per_batch": batch, "stages_ms": stages,
        "routed_gemm_stage_achieved_over_byte_floor": gemm_floor, "routed_gemm_gpu_queued": queued,
        "routed_gemm_kernels": {"gate_up": kernels_on.0, "down": kernels_on.1},
        "median_ms_earlier_fp4_kernels": ms_off, "median_ms_shared_expert_on_one_stream": ms_serial_shared,
        "median_ms_cuda_graph": ms_graph, "median_ms_without_pdl": ms_no_pdl,
        "routed_gemm_kernels_earlier": {"gate_up": kernels_off.0, "down": kernels_off.1}})
}

fn main() {
    let Some(dev) = cuda_device_or_skip("gpu_moe bench") else {
        return;
    };
    let s = dev.default_stream();
    let spec = RandomMoe {
        dim: 4096,
        inter: 2048,
        experts: 256,
        top_k: 6,
        routed: WeightFormat::Fp4Row32,
        shared: true,
        hash_vocab: None,
        seed: 0x5eed,
    };
    let t0 = std::time::Instant::now();
    let w = MoeWeights::random(&s, spec).unwrap();
    s.synchronize().unwrap();
    println!("gpu_moe: random V4-Flash MoE weights made in {:.1} s", t0.elapsed().as_secs_f64());
    let mut rng = SplitMix(7);
    // DEEPINFER_MOE_TOKENS (comma-separated) runs only those batch sizes (profiling one case).
    let sizes: Vec<u32> = match std::env::var("DEEPINFER_MOE_TOKENS") {
        Ok(v) => v.split(',').map(|t| t.trim().parse().expect("DEEPINFER_MOE_TOKENS: token counts")).collect(),
        Err(_) => vec![1, 16, 64, 4096],
    };
    let split = unstack(&s, &w.routed, w.inter, w.dim);
    let shared_split = unstack(&s, w.shared.as_ref().unwrap(), w.inter, w.dim);
    let results: Vec<_> = sizes.into_iter().map(|t| case(&s, &w, &split, &shared_split, t, &mut rng)).collect();
    let report = deepinfer_kernels_ffi::report::SystemReport::gather();
    let doc = serde_json::json!({
        "bench": "moe gpu_moe",
        "device": report.gpus.first().map(|g| g.name.clone()).unwrap_or_default(),
        "driver": report.driver_version.unwrap_or_else(|e| e),
        "bytes_per_s": BYTES_PER_S,
        "bf16_flop_per_s": BF16_FLOP_PER_S,
        "method": "random V4-Flash MoE sublayer (FP4 routed, FP8 shared, score routing with bias); inputs rotate so each call routes differently; CUDA events around batches of forwards (20, or 3 at 4096 tokens), 2 warm-up batches, median of 10",
        "results": results,
    });
    if let Some(path) = std::env::var_os("DEEPINFER_BENCH_JSON") {
        std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    }
}
