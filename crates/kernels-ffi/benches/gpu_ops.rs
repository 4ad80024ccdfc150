//! Bandwidth of the CUDA elementwise kernels against the memory floor, at sizes far above the
//! H200's 60 MB L2 (so every pass goes to HBM). Prints a table and, with DEEPINFER_BENCH_JSON set,
//! writes the numbers as JSON. Without a GPU it prints that it skipped.
//!
//! Method (GPU.md): output poisoned with NaN first and checked against the CPU reference; warm-up,
//! then each launch timed with CUDA events; median of the runs. Floor = bytes that must move /
//! 4.25 TB/s (the measured device-to-device copy rate of the H200).

use deepinfer_kernels_ffi::testing::{cuda_device_or_skip, rel_err, BenchOnly, SplitMix};
use deepinfer_kernels_ffi::{ops, DeviceBuffer, Element, GemmParams, RmsNormParams, RopeConfig, RopeParams, Stream};
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

/// Milliseconds per call of `f`, from back-to-back batches of `BATCH` calls between two events
/// (median of 20 batches): decode GEMMs run a few microseconds, where one event pair per launch
/// would mostly time the launch itself; an engine step issues them back to back (or in a graph).
/// With `filler`, about a millisecond of other work (RMSNorms over 256 MiB) is queued before each
/// batch, so the whole batch is queued when its first call starts and the events time only the
/// GPU running the calls back to back (what a captured decode step would see).
fn time_batched_ms(
    s: &Stream,
    mut filler: Option<&mut (DeviceBufferF, DeviceBufferF, DeviceBufferF)>,
    mut f: impl FnMut(),
) -> f64 {
    const BATCH: usize = 20;
    for _ in 0..WARMUP {
        f();
    }
    let p = RmsNormParams::packed(16384, 4096, 1e-6);
    let mut t = Vec::with_capacity(20);
    for _ in 0..20 {
        if let Some(fl) = filler.as_deref_mut() {
            for _ in 0..12 {
                ops::rms_norm(s, &fl.0, &fl.1, &mut fl.2, &p).unwrap();
            }
        }
        let a = s.record_event().unwrap();
        for _ in 0..BATCH {
            f();
        }
        let b = s.record_event().unwrap();
        t.push(a.elapsed_ms(&b).unwrap() / BATCH as f32);
    }
    median(t)
}

type DeviceBufferF = deepinfer_kernels_ffi::DeviceBuffer<f32>;

/// Milliseconds per call as a captured decode step runs them: CUDA graphs of 20 calls each, call
/// `c` of graph `g` on rotating copy `(20 g + c) % copies` (so the graphs together stream every
/// copy, more than 4x the L2, and no replay reads what the one before left in L2), replayed round
/// robin; events around each replay, the first round a warm-up, median of the rest. Kernels
/// launched with programmatic dependent launch keep it in the graph (programmatic edges).
fn time_graph_ms(s: &Stream, copies: usize, mut call: impl FnMut(&Stream, usize)) -> f64 {
    const CALLS: usize = 20;
    s.synchronize().unwrap();
    let gs = s.device().new_stream().unwrap();
    // Once on the stream before capturing: the ops' per-stream scratch is made outside the graphs.
    call(&gs, 0);
    let graphs: Vec<_> = (0..copies.div_ceil(CALLS))
        .map(|g| {
            gs.capture(|st| {
                for c in 0..CALLS {
                    call(st, (g * CALLS + c) % copies);
                }
                Ok(())
            })
            .unwrap()
        })
        .collect();
    let rounds = 20usize.div_ceil(graphs.len()).max(2);
    let mut t = Vec::new();
    for round in 0..=rounds {
        for graph in &graphs {
            let a = gs.record_event().unwrap();
            graph.launch().unwrap();
            let b = gs.record_event().unwrap();
            if round > 0 {
                t.push(a.elapsed_ms(&b).unwrap() / CALLS as f32);
            }
        }
    }
    gs.synchronize().unwrap();
    median(t)
}

/// About a millisecond of other work to queue ahead of a timed call (RMSNorms over 256 MiB).
fn filler(s: &Stream) -> (DeviceBufferF, DeviceBufferF, DeviceBufferF) {
    (s.zeros::<f32>(16384 * 4096).unwrap(), s.upload(&vec![1f32; 4096]).unwrap(), s.zeros::<f32>(16384 * 4096).unwrap())
}

/// Milliseconds of one call of `f` as the GPU runs it: events around each call (median of RUNS),
/// each queued behind ~1 ms of filler so the call's launches (and their host work: tensor maps,
/// the quantisation launch) are queued before the GPU reaches them, as in an engine step that runs
/// ahead of the GPU. `time_ms` instead counts the host's launch time of an idle GPU.
fn time_queued_ms(s: &Stream, fl: &mut (DeviceBufferF, DeviceBufferF, DeviceBufferF), mut f: impl FnMut()) -> f64 {
    for _ in 0..WARMUP {
        f();
    }
    let p = RmsNormParams::packed(16384, 4096, 1e-6);
    let mut t = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        for _ in 0..12 {
            ops::rms_norm(s, &fl.0, &fl.1, &mut fl.2, &p).unwrap();
        }
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

/// RMSNorm fused with the FP8 activation quantisation (`rms_norm_fp8`, no bf16 output: what feeds an
/// FP8 GEMM) against the two ops it replaces (`rms_norm`, then `quantize_act_fp8`). Floor: x read
/// once, the codes and scales written.
fn rms_fp8_case(s: &Stream, rng: &mut SplitMix, rows: u32, dim: u32) -> serde_json::Value {
    let (r, d) = (rows as usize, dim as usize);
    let x: Vec<bf16> = to(&rng.vec(r * d));
    let w: Vec<bf16> = to(&rng.vec(d).iter().map(|v| 1.0 + 0.1 * v).collect::<Vec<_>>());
    let p = RmsNormParams::packed(rows, dim, 1e-6);
    let (xb, wb) = (s.upload(&x).unwrap(), s.upload(&w).unwrap());
    let mut out = s.zeros::<bf16>(r * d).unwrap();
    let mut xq = s.zeros::<u8>(r * d).unwrap();
    let mut sx = s.zeros::<f32>(r * d / 128).unwrap();
    ops::rms_norm_fp8(s, &xb, &wb, None, &mut xq, &mut sx, &p).unwrap();
    let fused = (s.download(&xq).unwrap(), s.download(&sx).unwrap());
    ops::rms_norm(s, &xb, &wb, &mut out, &p).unwrap();
    ops::quantize_act_fp8(s, &out, &mut xq, &mut sx, rows, dim).unwrap();
    let two = (s.download(&xq).unwrap(), s.download(&sx).unwrap());
    // The two routes' sums of squares may round apart (a warp's tree against a block's): count
    // the codes that differ rather than require none.
    let differ = fused.0.iter().zip(&two.0).filter(|(a, b)| a != b).count();
    let ms = time_ms(s, || ops::rms_norm_fp8(s, &xb, &wb, None, &mut xq, &mut sx, &p).unwrap());
    let ms_two = time_ms(s, || {
        ops::rms_norm(s, &xb, &wb, &mut out, &p).unwrap();
        ops::quantize_act_fp8(s, &out, &mut xq, &mut sx, rows, dim).unwrap()
    });
    let bytes = (r * d * 2 + r * d + r * d / 128 * 4 + d * 2) as f64;
    let floor_ms = bytes / FLOOR_BYTES_PER_S * 1e3;
    println!(
        "norm-fp8 {rows:>6}x{dim:<5} fused median {ms:.4} ms  achieved/floor {:.3} | rms_norm + quantize_act_fp8 {ms_two:.4} ms ({:.3})  codes differing {differ} of {}",
        floor_ms / ms,
        floor_ms / ms_two,
        r * d
    );
    serde_json::json!({"op": "rms_norm_fp8", "rows": rows, "dim": dim, "bytes": bytes, "median_ms": ms, "floor_ms": floor_ms,
        "achieved_over_floor": floor_ms / ms, "unfused_ms": ms_two, "unfused_achieved_over_floor": floor_ms / ms_two,
        "codes_differing_from_unfused": differ})
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

/// How a decode GEMM case runs: as `gemm_lowp` chooses, with the FP8 weights in the packed decode
/// layout (`gemm_fp8_packed`), or FP4 with the experts' FP8 activation quantisation.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Plain,
    Packed,
    Fp4Quantized,
    /// FP8 weights and x already quantised to FP8 (`gemm_fp8_act`).
    Fp8Act,
}

/// Weight bytes / 4.3 TB/s: the floor issue #7 sets for decode GEMMs.
const GEMM_FLOOR_BYTES_PER_S: f64 = 4.3e12;
/// Enough copies of a weight that a timed cycle over them streams more than 4x the 60 MB L2.
const GEMM_STREAM_BYTES: usize = 256 << 20;

/// A decode GEMM with one knob of the Hopper decode kernel forced (`knob` = its setter, the JSON key
/// and the value; the setter goes back to 0, the plan's choice, afterwards), tagged with the value;
/// `None` where the shape does not run that kernel.
#[allow(clippy::too_many_arguments)]
fn dec_forced_case(
    s: &Stream,
    rng: &mut SplitMix,
    knob: (fn(u32), &str, u32),
    f: ops::WeightFormat,
    what: &str,
    m: u32,
    n: usize,
    k: usize,
) -> Option<serde_json::Value> {
    let (set, key, value) = knob;
    set(value);
    let r = ops::gemm_lowp_cuda_kernel(s, f, &GemmParams::new(m, n as u32, k as u32, true))
        .is_some_and(|kernel| kernel.starts_with("di_gemm_fp8_dec"))
        .then(|| {
            let mut r = gemm_case(s, rng, f, what, m, n, k, Mode::Plain);
            r[key] = value.into();
            r
        });
    set(0);
    r
}

/// One decode GEMM shape: our FP8 or FP4 kernel, then cuBLASLt bf16 on the same shape, each over
/// rotating copies of the weight (so every launch reads HBM).
#[allow(clippy::too_many_arguments)]
fn gemm_case(
    s: &Stream,
    rng: &mut SplitMix,
    f: ops::WeightFormat,
    what: &str,
    m: u32,
    n: usize,
    k: usize,
    mode: Mode,
) -> serde_json::Value {
    let packed = mode == Mode::Packed;
    let quantize = f == ops::WeightFormat::Fp8Block128 || mode == Mode::Fp4Quantized;
    let p = GemmParams::new(m, n as u32, k as u32, quantize);
    let kernel = if packed {
        format!("di_gemm_fp8q_packed_n{}", if m <= 8 { 8 } else { 16 })
    } else {
        let name = ops::gemm_lowp_cuda_kernel(s, f, &p).unwrap_or_default();
        let forced = ops::fp8_dec_stages();
        let name = if forced > 0 && name.starts_with("di_gemm_fp8_dec") { format!("{name}/s{forced}") } else { name };
        let pre = ops::fp8_dec_pre();
        let name = if pre > 0 && name.starts_with("di_gemm_fp8_dec") { format!("{name}/pre{pre}") } else { name };
        // k splits, and "c" where they add up in a cluster's shared memory.
        let cluster = if ops::fp8_dec_cluster_blocks(s, &p).is_some_and(|c| c > 1) { "c" } else { "" };
        match ops::wgmma_k_splits(s, &p) {
            Some(splits) if splits > 1 => format!("{name}/k{splits}{cluster}"),
            _ => name,
        }
    };
    let kernel = match mode {
        Mode::Fp8Act if ops::fp8_dec_act() || !kernel.starts_with("di_gemm_fp8_dec") => format!("{kernel}/fp8x"),
        Mode::Fp8Act => format!("{kernel}/fp8x/requant"),
        _ => kernel,
    };
    let (wb, sb) = f.bytes(n, k);
    let w: Vec<u8> = (0..wb).map(|_| deepinfer_kernels_ffi::quant::random_e4m3(rng.next_u64())).collect();
    let sc: Vec<u8> = (0..sb).map(|_| 120 + (rng.next_u64() % 6) as u8).collect();
    let x: Vec<bf16> = to(&rng.vec(m as usize * k));
    let copies = GEMM_STREAM_BYTES.div_ceil(wb).max(2);
    let wdev = if packed { ops::pack_fp8_decode(&w, n, k) } else { w.clone() };
    let ws: Vec<_> = (0..copies).map(|_| s.upload(&wdev).unwrap()).collect();
    let scb = s.upload(&sc).unwrap();
    let xb = s.upload(&x).unwrap();
    // FP8 activations (`Mode::Fp8Act`): x quantised once, outside the timing (as a producer that
    // fuses the quantisation writes it), then gemm_fp8_act.
    let xq = (mode == Mode::Fp8Act).then(|| {
        let mut xq = s.zeros::<u8>(m as usize * k).unwrap();
        let mut sx = s.zeros::<f32>(m as usize * k / 128).unwrap();
        ops::quantize_act_fp8(s, &xb, &mut xq, &mut sx, m, k as u32).unwrap();
        (xq, sx)
    });
    // The packed decode layout (FP8 only): the same weights rearranged, through gemm_fp8_packed.
    let run = |s: &Stream,
               x: &DeviceBuffer<bf16>,
               w: &DeviceBuffer<u8>,
               sc: &DeviceBuffer<u8>,
               y: &mut DeviceBuffer<bf16>| {
        if packed {
            ops::gemm_fp8_packed(s, x, w, sc, y, &p).unwrap()
        } else if let Some((xq, sx)) = &xq {
            ops::gemm_fp8_act(s, xq, sx, w, sc, y, &p).unwrap()
        } else {
            ops::gemm_lowp(s, f, x, w, sc, y, &p).unwrap()
        }
    };
    let mut y = s.upload(&to::<bf16>(&vec![f32::NAN; m as usize * n])).unwrap();
    run(s, &xb, &ws[0], &scb, &mut y);
    let got: Vec<f32> = s.download(&y).unwrap().iter().map(|v| v.to_f32()).collect();
    let mut want = vec![bf16::ZERO; m as usize * n];
    match f {
        ops::WeightFormat::Fp8Block128 => deepinfer_kernels_ffi::cpu::gemm_fp8(&x, &w, &sc, &mut want, &p),
        ops::WeightFormat::Fp4Row32 => deepinfer_kernels_ffi::cpu::gemm_fp4(&x, &w, &sc, &mut want, &p),
    }
    let want: Vec<f32> = want.iter().map(|v| v.to_f32()).collect();
    let (rel, _) = rel_err(&got, &want);
    assert!(rel < 4e-3, "gemm {f:?} {m}x{n}x{k}: rel_err {rel:e} against the CPU");
    let mut i = 0;
    let ms = time_batched_ms(s, None, || {
        i += 1;
        run(s, &xb, &ws[i % copies], &scb, &mut y)
    });
    let mut filler = filler(s);
    let ms_queued = time_batched_ms(s, Some(&mut filler), || {
        i += 1;
        run(s, &xb, &ws[i % copies], &scb, &mut y)
    });
    // The kernels launched with programmatic dependent launch, timed again without it.
    let ms_queued_serial = kernel.starts_with("di_gemm_fp8_dec").then(|| {
        ops::set_pdl(false);
        let t = time_batched_ms(s, Some(&mut filler), || {
            i += 1;
            run(s, &xb, &ws[i % copies], &scb, &mut y)
        });
        ops::set_pdl(true);
        t
    });
    drop(filler);
    y = s.upload(&to::<bf16>(&vec![f32::NAN; m as usize * n])).unwrap();
    let ms_graph = time_graph_ms(s, copies, |g, c| run(g, &xb, &ws[c], &scb, &mut y));
    // The graph's output must still be the product (the last call's copy holds the same weights).
    let got: Vec<f32> = s.download(&y).unwrap().iter().map(|v| v.to_f32()).collect();
    let (rel_graph, _) = rel_err(&got, &want);
    assert!(rel_graph < 4e-3, "gemm {f:?} {m}x{n}x{k} in a graph: rel_err {rel_graph:e} against the CPU");
    drop(ws);
    let floor_ms = (wb + sb) as f64 / GEMM_FLOOR_BYTES_PER_S * 1e3;
    // cuBLASLt bf16, same shape.
    let wbf: Vec<bf16> = to(&rng.vec(n * k));
    let bcopies = GEMM_STREAM_BYTES.div_ceil(2 * n * k).max(2);
    let wbs: Vec<_> = (0..bcopies).map(|_| s.upload(&wbf).unwrap()).collect();
    let pb = GemmParams::new(m, n as u32, k as u32, false);
    let mut j = 0;
    let ms_bf16 = time_batched_ms(s, None, || {
        j += 1;
        ops::gemm_bf16(s, &xb, &wbs[j % bcopies], &mut y, &pb).unwrap()
    });
    let floor_bf16 = (2 * n * k) as f64 / GEMM_FLOOR_BYTES_PER_S * 1e3;
    let serial = ms_queued_serial.map_or(String::new(), |t| format!(", without PDL {t:.4} ms, {:.3}", floor_ms / t));
    println!(
        "gemm {what:<22} {:<20} {f:?} m={m:<2} n={n:<5} k={k:<5} {:>7.2} MB  median {ms:>7.4} ms  floor {floor_ms:.4} ms  achieved/floor {:.3} (GPU-queued {ms_queued:.4} ms, {:.3}{serial}; graph {ms_graph:.4} ms, {:.3}) | cuBLASLt bf16 {ms_bf16:.4} ms (achieved/floor {:.3}) ours/cuBLASLt speed {:.2}x  rel_err {rel:.1e}",
        kernel,
        (wb + sb) as f64 / 1e6,
        floor_ms / ms,
        floor_ms / ms_queued,
        floor_ms / ms_graph,
        floor_bf16 / ms_bf16,
        ms_bf16 / ms
    );
    serde_json::json!({"op": "gemm_lowp", "weights": what, "format": format!("{f:?}"), "m": m, "n": n, "k": k,
        "kernel": kernel, "packed": packed, "fp8_activations": mode == Mode::Fp8Act,
        "quantize_x": p.quantize_x != 0, "weight_and_scale_bytes": wb + sb, "median_ms": ms, "floor_ms": floor_ms,
        "achieved_over_floor": floor_ms / ms, "gpu_queued_ms": ms_queued, "gpu_queued_achieved_over_floor": floor_ms / ms_queued,
        "cublaslt_bf16_ms": ms_bf16, "cublaslt_bf16_achieved_over_floor": floor_bf16 / ms_bf16,
        "speedup_over_cublaslt_bf16": ms_bf16 / ms, "rel_err_vs_cpu": rel,
        "graph_ms": ms_graph, "graph_achieved_over_floor": floor_ms / ms_graph,
        "gpu_queued_without_pdl_ms": ms_queued_serial,
        "gpu_queued_without_pdl_achieved_over_floor": ms_queued_serial.map(|t| floor_ms / t)})
}

/// What merely reading `bytes` costs: `ops::probe_read` over rotating buffers (HBM), in batches as
/// the decode GEMMs (GPU-queued), with and without programmatic dependent launch. The ceiling the
/// decode GEMMs of that many weight bytes can reach in this harness.
fn probe_case(s: &Stream, what: &str, bytes: usize) -> serde_json::Value {
    let bytes = bytes.next_multiple_of(16);
    let copies = GEMM_STREAM_BYTES.div_ceil(bytes).max(2);
    let bufs: Vec<_> = (0..copies).map(|_| s.zeros::<u8>(bytes).unwrap()).collect();
    let mut out = s.zeros::<i32>(1).unwrap();
    let mut filler = filler(s);
    let mut i = 0;
    let mut time = |pdl: bool| {
        ops::set_pdl(pdl);
        let t = time_batched_ms(s, Some(&mut filler), || {
            i += 1;
            ops::probe_read(s, &bufs[i % copies], &mut out).unwrap()
        });
        ops::set_pdl(true);
        t
    };
    let (ms, ms_serial) = (time(true), time(false));
    drop(filler);
    let ms_graph = time_graph_ms(s, copies, |g, c| ops::probe_read(g, &bufs[c], &mut out).unwrap());
    let floor_ms = bytes as f64 / GEMM_FLOOR_BYTES_PER_S * 1e3;
    println!(
        "probe_read {what:<22} {:>7.2} MB  GPU-queued {ms:.4} ms ({:.3} of the floor), without PDL {ms_serial:.4} ms ({:.3}), graph {ms_graph:.4} ms ({:.3})",
        bytes as f64 / 1e6,
        floor_ms / ms,
        floor_ms / ms_serial,
        floor_ms / ms_graph
    );
    serde_json::json!({"op": "probe_read", "weights": what, "bytes": bytes, "floor_ms": floor_ms,
        "gpu_queued_ms": ms, "gpu_queued_achieved_over_floor": floor_ms / ms,
        "gpu_queued_without_pdl_ms": ms_serial, "gpu_queued_without_pdl_achieved_over_floor": floor_ms / ms_serial,
        "graph_ms": ms_graph, "graph_achieved_over_floor": floor_ms / ms_graph})
}

/// FP8 matrix-unit rate used as the prefill floor: twice the 790 TFLOP/s bf16 rate measured on
/// this H200 kind (the datasheet's dense FP8 figure is 1979).
const FP8_FLOP_PER_S: f64 = 1580e12;
const BF16_FLOP_PER_S: f64 = 790e12;

/// A prefill-shaped FP8 GEMM (m in the thousands) through the tensor-core kernel's row jobs, and
/// cuBLASLt bf16 on the same shape. Checked against the CPU on the first 16 rows (the full
/// product is too large for the CPU reference; the parity test covers m > 16 in full).
fn prefill_case(s: &Stream, rng: &mut SplitMix, what: &str, m: u32, n: usize, k: usize) -> serde_json::Value {
    let f = ops::WeightFormat::Fp8Block128;
    let p = GemmParams::new(m, n as u32, k as u32, true);
    let (wb, sb) = f.bytes(n, k);
    let w: Vec<u8> = (0..wb).map(|_| deepinfer_kernels_ffi::quant::random_e4m3(rng.next_u64())).collect();
    let sc: Vec<u8> = (0..sb).map(|_| 120 + (rng.next_u64() % 6) as u8).collect();
    let x: Vec<bf16> = to(&rng.vec(m as usize * k));
    let (xb, wbuf, scb) = (s.upload(&x).unwrap(), s.upload(&w).unwrap(), s.upload(&sc).unwrap());
    let mut y = s.upload(&to::<bf16>(&vec![f32::NAN; m as usize * n])).unwrap();
    ops::gemm_lowp(s, f, &xb, &wbuf, &scb, &mut y, &p).unwrap();
    let got: Vec<f32> = s.download_range(&y, 0, 16 * n).unwrap().iter().map(|v| v.to_f32()).collect();
    let p16 = GemmParams::new(16, n as u32, k as u32, true);
    let mut want = vec![bf16::ZERO; 16 * n];
    deepinfer_kernels_ffi::cpu::gemm_fp8(&x[..16 * k], &w, &sc, &mut want, &p16);
    let want: Vec<f32> = want.iter().map(|v| v.to_f32()).collect();
    let (rel, _) = rel_err(&got, &want);
    assert!(rel < 4e-3, "prefill gemm {m}x{n}x{k}: rel_err {rel:e} against the CPU");
    let ms = time_ms(s, || ops::gemm_lowp(s, f, &xb, &wbuf, &scb, &mut y, &p).unwrap());
    let flops = 2.0 * m as f64 * n as f64 * k as f64;
    let floor_ms = flops / FP8_FLOP_PER_S * 1e3;
    let wbf: Vec<bf16> = to(&rng.vec(n * k));
    let wbfb = s.upload(&wbf).unwrap();
    let pb = GemmParams::new(m, n as u32, k as u32, false);
    let ms_bf16 = time_ms(s, || ops::gemm_bf16(s, &xb, &wbfb, &mut y, &pb).unwrap());
    // The FP8 x FP8 GEMM alone: x quantised once (quantize_act_fp8), then gemm_fp8_act, whose
    // output must be the same bits.
    let mut xq = s.zeros::<u8>(m as usize * k).unwrap();
    let mut sx = s.zeros::<f32>(m as usize * k / 128).unwrap();
    let ms_quant = time_ms(s, || ops::quantize_act_fp8(s, &xb, &mut xq, &mut sx, m, k as u32).unwrap());
    let mut y_act = s.upload(&to::<bf16>(&vec![f32::NAN; m as usize * n])).unwrap();
    ops::gemm_fp8_act(s, &xq, &sx, &wbuf, &scb, &mut y_act, &p).unwrap();
    assert!(
        s.download_range(&y_act, 0, 16 * n).unwrap().iter().map(|v| v.to_f32()).eq(got.iter().copied()),
        "prefill gemm {m}x{n}x{k}: gemm_fp8_act differs from gemm_lowp"
    );
    let ms_act = time_ms(s, || ops::gemm_fp8_act(s, &xq, &sx, &wbuf, &scb, &mut y_act, &p).unwrap());
    let mut fl = filler(s);
    let q_ms = time_queued_ms(s, &mut fl, || ops::gemm_lowp(s, f, &xb, &wbuf, &scb, &mut y, &p).unwrap());
    let q_act = time_queued_ms(s, &mut fl, || ops::gemm_fp8_act(s, &xq, &sx, &wbuf, &scb, &mut y_act, &p).unwrap());
    let q_bf16 = time_queued_ms(s, &mut fl, || ops::gemm_bf16(s, &xb, &wbfb, &mut y, &pb).unwrap());
    drop(fl);
    let kernel = ops::gemm_lowp_cuda_kernel(s, f, &p).unwrap_or_default();
    println!(
        "prefill gemm {what:<18} {kernel:<20} FP8 m={m} n={n} k={k}  median {ms:>8.4} ms  {:.0} TFLOP/s  FP8 floor {floor_ms:.4} ms  achieved/floor {:.3} | FP8 x given: {ms_act:.4} ms ({:.0} TFLOP/s, achieved/floor {:.3}; quantisation {ms_quant:.4} ms) | cuBLASLt bf16 {ms_bf16:.4} ms ({:.0} TFLOP/s, achieved/bf16 floor {:.3})  rel_err(16 rows) {rel:.1e}",
        flops / (ms * 1e-3) / 1e12,
        floor_ms / ms,
        flops / (ms_act * 1e-3) / 1e12,
        floor_ms / ms_act,
        flops / (ms_bf16 * 1e-3) / 1e12,
        flops / BF16_FLOP_PER_S * 1e3 / ms_bf16,
    );
    println!(
        "prefill gemm {what:<18} GPU-queued: op {q_ms:.4} ms (achieved/floor {:.3}) | FP8 x given {q_act:.4} ms (achieved/floor {:.3}) | cuBLASLt bf16 {q_bf16:.4} ms (achieved/bf16 floor {:.3})",
        floor_ms / q_ms,
        floor_ms / q_act,
        flops / BF16_FLOP_PER_S * 1e3 / q_bf16,
    );
    serde_json::json!({"op": "gemm_lowp_prefill", "weights": what, "format": "Fp8Block128", "m": m, "n": n, "k": k,
        "kernel": kernel, "quantize_x": true, "flops": flops,
        "median_ms": ms, "fp8_floor_ms": floor_ms, "achieved_over_floor": floor_ms / ms, "tflop_per_s": flops / (ms * 1e-3) / 1e12,
        "fp8_act_gemm_ms": ms_act, "fp8_act_achieved_over_floor": floor_ms / ms_act, "quantize_act_ms": ms_quant,
        "gpu_queued_ms": q_ms, "gpu_queued_achieved_over_floor": floor_ms / q_ms, "gpu_queued_fp8_act_ms": q_act,
        "gpu_queued_fp8_act_achieved_over_floor": floor_ms / q_act, "gpu_queued_cublaslt_bf16_ms": q_bf16,
        "cublaslt_bf16_ms": ms_bf16, "cublaslt_bf16_tflop_per_s": flops / (ms_bf16 * 1e-3) / 1e12, "rel_err_vs_cpu_first_16_rows": rel})
}

fn main() {
    let Some(dev) = cuda_device_or_skip("gpu_ops bench") else {
        return;
    };
    let s = dev.default_stream();
    let mut rng = SplitMix(0x5eed);
    // DEEPINFER_BENCH_ONLY (`testing::BenchOnly`) runs only the GEMM and probe cases whose label
    // ("gemm attn.wo_b m=1", "prefill attn.wq_b", "probe attn.wq_b") contains one of its texts.
    let only = BenchOnly::from_env();
    let wanted = |label: &str| only.wants(label);
    let results = if only.is_set() {
        Vec::new()
    } else {
        vec![
            // 32768 x 4096 bf16: 256 MiB in + 256 MiB out, ~9x the L2.
            rms_case::<bf16>(&s, &mut rng, 32768, 4096),
            rms_case::<bf16>(&s, &mut rng, 16384, 7168),
            rms_case::<f32>(&s, &mut rng, 16384, 4096),
            // Decode-sized rows: latency-bound, reported for reference, not against the floor target.
            rms_case::<bf16>(&s, &mut rng, 64, 4096),
            rope_case(&s, &mut rng, 8192),
        ]
    };
    let mut results = results;
    // The norms that feed FP8 GEMMs: q_norm (1024) and the sublayer norms (4096), decode and prefill.
    for (rows, dim) in [(1u32, 1024u32), (64, 1024), (64, 4096), (16384, 1024), (16384, 4096)] {
        if wanted(&format!("norm-fp8 {rows}x{dim}")) {
            results.push(rms_fp8_case(&s, &mut rng, rows, dim));
        }
    }
    // V4-Flash decode GEMMs: FP8 dense projections and FP4 routed experts (MODEL_V4.md §1). The
    // MoE layer runs w1 and w3 stacked as one GEMM (w13, [2 inter, dim]); w1 alone stays for
    // comparison with earlier results.
    use ops::WeightFormat::{Fp4Row32, Fp8Block128};
    let shapes = [
        (Fp8Block128, "attn.wq_a", 1024, 4096),
        // wq_a and wkv take the same x: stacked as one [1536, 4096] weight (their 128-row scale
        // blocks line up), one launch instead of two, as vLLM fuses DeepSeek's q_a and kv_a.
        (Fp8Block128, "attn.wq_a+wkv", 1536, 4096),
        (Fp8Block128, "attn.wq_b", 32768, 1024),
        (Fp8Block128, "attn.wo_b", 4096, 8192),
        (Fp8Block128, "shared_experts.w1", 2048, 4096),
        (Fp8Block128, "shared_experts.w13", 4096, 4096),
        (Fp4Row32, "experts.w1", 2048, 4096),
        (Fp4Row32, "experts.w13", 4096, 4096),
        (Fp4Row32, "experts.w2", 4096, 2048),
    ];
    // What one decode-shaped FP8 wgmma occupies an SM's tensor pipe (ops::probe_wgmma): the
    // question of an FP4 decode kernel that widens weights to e4m3 (one m64n8k32 a 1 KB of FP4,
    // against ~18.6 bytes a cycle an SM at 4.3 TB/s on 132 SMs at 1.755 GHz: ~55 cycles a wgmma).
    for n in [8u32, 16, 128] {
        for wg in [1u32, 2, 3] {
            if !wanted(&format!("probe-wgmma n={n} wg={wg}")) {
                continue;
            }
            // Long enough (~1 ms) that the launch is noise in the event-timed wall clock, which
            // converts the kernel's clock cycles to time (the SM clock it ran at).
            let iters = 8192;
            let mut cycles = s.zeros::<i32>(8).unwrap();
            let mut sums = s.zeros::<f32>(128).unwrap();
            ops::probe_wgmma(&s, n, wg, iters, &mut cycles, &mut sums).unwrap();
            let a = s.record_event().unwrap();
            ops::probe_wgmma(&s, n, wg, iters, &mut cycles, &mut sums).unwrap();
            let b = s.record_event().unwrap();
            let wall_ms = a.elapsed_ms(&b).unwrap() as f64;
            let sums = s.download(&sums).unwrap();
            let want: Vec<f32> = (0..128).map(|t| ops::probe_wgmma_sum(n, t)).collect();
            assert_eq!(sums, want, "probe_wgmma sums");
            let c: Vec<f32> = s.download(&cycles).unwrap().iter().map(|v| *v as f32).collect();
            let total = median(c);
            let wgmmas = 16.0 * iters as f64 * wg as f64;
            let per = total / wgmmas;
            let ghz = total / (wall_ms * 1e6);
            let ns = wall_ms * 1e6 / wgmmas;
            let tflops = 2.0 * 64.0 * n as f64 * 32.0 * wgmmas / (wall_ms * 1e-3) / 1e12;
            println!(
                "probe_wgmma m64n{n}k32 e4m3, {wg} warpgroup(s) an SM: {per:.1} cycles ({ns:.2} ns) a wgmma on the SM's tensor pipe; clock {ghz:.2} GHz; {tflops:.1} TFLOP/s an SM"
            );
            results.push(serde_json::json!({"op": "probe_wgmma", "n": n, "warpgroups": wg, "iters": iters,
                "cycles_per_wgmma_per_sm": per, "ns_per_wgmma_per_sm": ns, "wall_ms": wall_ms,
                "clock_ghz": ghz, "tflop_per_s_per_sm": tflops}));
        }
    }
    // What reading each weight's bytes alone costs in the same harness.
    for (f, what, n, k) in shapes {
        if wanted(&format!("probe {what}")) {
            let (wb, sb) = f.bytes(n, k);
            results.push(probe_case(&s, what, wb + sb));
        }
    }
    // DEEPINFER_GEMM_M (comma-separated, each 1..=16) replaces the decode rows' batch sizes 1, 4,
    // 16 (how a kernel's time grows with m).
    let decode_m: Vec<u32> = match std::env::var("DEEPINFER_GEMM_M") {
        Ok(v) => v
            .split(',')
            .map(|t| match t.trim().parse() {
                Ok(m @ 1..=16) => m,
                _ => panic!("DEEPINFER_GEMM_M: {t:?} is not a batch size 1..=16"),
            })
            .collect(),
        Err(_) => vec![1, 4, 16],
    };
    for &m in &decode_m {
        for (f, what, n, k) in shapes {
            if !wanted(&format!("gemm {what} m={m}")) {
                continue;
            }
            results.push(gemm_case(&s, &mut rng, f, what, m, n, k, Mode::Plain));
            if f == Fp8Block128 {
                // x already FP8 (quantised by the op before, as the engine's norms would write it):
                // the decode kernel copying the codes in ("/fp8x"), and dequantised for gemm_lowp
                // ("/fp8x/requant", the route before).
                let default_act = ops::fp8_dec_act();
                ops::set_fp8_dec_act(true);
                results.push(gemm_case(&s, &mut rng, f, what, m, n, k, Mode::Fp8Act));
                ops::set_fp8_dec_act(false);
                results.push(gemm_case(&s, &mut rng, f, what, m, n, k, Mode::Fp8Act));
                ops::set_fp8_dec_act(default_act);
                // On a Hopper the default above may be the wgmma decode kernel; then the mma.sync
                // kernel (when that was not the default), its packed layout, and the earlier
                // kernels (bf16 expansion of the weights).
                let p = GemmParams::new(m, n as u32, k as u32, true);
                let default_kernel = ops::gemm_lowp_cuda_kernel(&s, f, &p);
                ops::set_fp8_wgmma(false);
                if ops::gemm_lowp_cuda_kernel(&s, f, &p) != default_kernel {
                    results.push(gemm_case(&s, &mut rng, f, what, m, n, k, Mode::Plain));
                }
                results.push(gemm_case(&s, &mut rng, f, what, m, n, k, Mode::Packed));
                ops::set_fp8_mma_decode(false);
                results.push(gemm_case(&s, &mut rng, f, what, m, n, k, Mode::Plain));
                ops::set_fp8_mma_decode(true);
                ops::set_fp8_wgmma(true);
            } else {
                // FP4 with the experts' FP8 activations: the FP4 x FP8 kernel and the earlier one.
                results.push(gemm_case(&s, &mut rng, f, what, m, n, k, Mode::Fp4Quantized));
                ops::set_fp8_mma_decode(false);
                results.push(gemm_case(&s, &mut rng, f, what, m, n, k, Mode::Fp4Quantized));
                ops::set_fp8_mma_decode(true);
            }
        }
    }
    // The Hopper decode kernel's W tiles in flight per block (the plan's choice is four when the
    // blocks take two waves' worth of slots, eight in one wave): each forced value on the 32 MB
    // weights (fewer stages leave room for the next launch's blocks beside the running ones).
    for (f, what, n, k) in shapes.into_iter().filter(|s| s.2 * s.3 >= 32 << 20) {
        for m in [1u32, 16] {
            for stages in [2u32, 3, 4, 5, 6] {
                if wanted(&format!("gemm-stages {what} m={m} s={stages}")) {
                    let knob = (ops::set_fp8_dec_stages as fn(u32), "dec_stages", stages);
                    results.extend(dec_forced_case(&s, &mut rng, knob, f, what, m, n, k));
                }
            }
        }
    }
    // W tiles a block of the Hopper decode kernel issues before waiting for the grid before it (the
    // rest once its x loads are issued): each forced value (8: every tile of the wide and the
    // k-split W, as before the plan chose two).
    for (f, what, n, k) in shapes.into_iter().filter(|s| s.0 == Fp8Block128) {
        for m in [1u32, 4, 16] {
            for pre in [1u32, 2, 3, 4, 8] {
                if wanted(&format!("gemm-pre {what} m={m} pre={pre}")) {
                    let knob = (ops::set_fp8_dec_pre as fn(u32), "dec_pre", pre);
                    results.extend(dec_forced_case(&s, &mut rng, knob, f, what, m, n, k));
                }
            }
        }
    }
    // Where the k splits of the Hopper decode kernel add up: the cluster's shared memory (the
    // default where the clusters fit) against the stream's split scratch (the route before).
    for (f, what, n, k) in shapes.into_iter().filter(|s| s.0 == Fp8Block128) {
        for m in [1u32, 4] {
            let p = GemmParams::new(m, n as u32, k as u32, true);
            if wanted(&format!("gemm-cluster {what} m={m}"))
                && ops::fp8_dec_cluster_blocks(&s, &p).is_some_and(|c| c > 1)
            {
                ops::set_fp8_dec_cluster(false);
                let mut r = gemm_case(&s, &mut rng, f, what, m, n, k, Mode::Plain);
                ops::set_fp8_dec_cluster(true);
                r["dec_cluster"] = false.into();
                results.push(r);
            }
        }
    }
    // 128-wide k blocks per block of the Hopper decode kernel (the plan's choice: about two blocks
    // an SM for narrow W, all of k for wq_b): each forced value at m = 1 and 16, the plan's stages.
    for (f, what, n, k) in shapes.into_iter().filter(|s| s.0 == Fp8Block128) {
        for m in [1u32, 16] {
            for per in [1u32, 2, 4, 8, 16, 32] {
                if per <= k as u32 / 128 && wanted(&format!("gemm-per {what} m={m} per={per}")) {
                    let knob = (ops::set_fp8_dec_per as fn(u32), "dec_per", per);
                    results.extend(dec_forced_case(&s, &mut rng, knob, f, what, m, n, k));
                }
            }
        }
    }
    // Decode batches of 64 rows with FP8 weights (the dense projections at batch 64): the wgmma
    // kernel, which splits k where its 256 x 128 tiles are fewer than the SMs, and (where it
    // splits) the same shape with the split switched off.
    for (f, what, n, k) in shapes.into_iter().filter(|s| s.0 == Fp8Block128) {
        let m = 64;
        if !wanted(&format!("gemm {what} m={m}")) {
            continue;
        }
        results.push(gemm_case(&s, &mut rng, f, what, m, n, k, Mode::Plain));
        let p = GemmParams::new(m, n as u32, k as u32, true);
        if ops::wgmma_k_splits(&s, &p).is_some_and(|splits| splits > 1) {
            ops::set_wgmma_split_k(false);
            results.push(gemm_case(&s, &mut rng, f, what, m, n, k, Mode::Plain));
            ops::set_wgmma_split_k(true);
        }
    }
    // Prefill-shaped FP8 GEMMs (4096 and 16384 tokens): the default kernel (on an sm_90 GPU the
    // wgmma one: pipelined 128 x 128 tiles for k >= 2048), the 256 x 128 wgmma kernel where that
    // was not the default, then the earlier tiled kernel (DEEPINFER_BENCH_ONLY=wgmma-p /
    // =wgmma-256 / =tiled picks one).
    for (what, n, k) in [
        ("attn.wq_b", 32768, 1024),
        ("attn.wo_b", 4096, 8192),
        ("shared_experts.w1", 2048, 4096),
        ("shared_experts.w13", 4096, 4096),
    ] {
        for m in [4096u32, 16384] {
            let mut done = Vec::new();
            for (variant, wgmma, pipelined) in
                [("wgmma-p", true, true), ("wgmma-256", true, false), ("tiled", false, true)]
            {
                let label = format!("prefill {what} m={m} {variant}");
                ops::set_fp8_wgmma(wgmma);
                ops::set_fp8_wgmma_pipelined(pipelined);
                let kernel = ops::gemm_lowp_cuda_kernel(&s, Fp8Block128, &GemmParams::new(m, n as u32, k as u32, true));
                if wanted(&label) && (m <= 4096 || wgmma) && !done.contains(&kernel) {
                    results.push(prefill_case(&s, &mut rng, what, m, n, k));
                    done.push(kernel);
                }
                ops::set_fp8_wgmma(true);
                ops::set_fp8_wgmma_pipelined(true);
            }
        }
    }
    let report = deepinfer_kernels_ffi::report::SystemReport::gather();
    let gpu = report.gpus.first().map(|g| g.name.clone()).unwrap_or_default();
    let doc = serde_json::json!({
        "bench": "kernels-ffi gpu_ops",
        "device": gpu,
        "driver": report.driver_version.unwrap_or_else(|e| e),
        "floor_bytes_per_s": FLOOR_BYTES_PER_S,
        "method": "norms and rope: CUDA events around each launch, 5 warm-up + 50 timed, median; decode GEMMs: events around batches of 20 back-to-back launches over rotating weight copies (> 256 MiB, so HBM), median of 20 batches; gpu_queued: the same batches queued behind ~1 ms of filler work so the GPU never waits for the host; graph: CUDA graphs of 20 calls over the rotating copies, replayed round robin, events around each replay; prefill GEMMs: events around each launch, and (gpu_queued) around each launch queued behind ~1 ms of filler; outputs checked against the CPU backend",
        "results": results,
    });
    if let Some(path) = std::env::var_os("DEEPINFER_BENCH_JSON") {
        std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    }
}
