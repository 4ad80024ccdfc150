//! Decode attention on the CUDA backend against the CPU reference, on fresh random inputs every
//! run (the seed is printed; `DEEPINFER_TEST_SEED` reproduces a run). Skipped, with a message,
//! where there is no GPU; run on the H200 from the GPU bundle.
//!
//! Tolerance 1e-2 (relative, ‖gpu − cpu‖ / ‖cpu‖): the kernel multiplies bf16 probabilities
//! (unnormalised, rounded once: 2^-9 relative each) with bf16 keys on the matrix units and sums in
//! fp32; the CPU keeps f32 probabilities. Errors of 2^-9 per term average down over many keys; the
//! output is rounded to bf16 on both sides.
//!
//! The Hopper cluster kernels' two merges (the partial as scaled f16, the default, or as fp32) agree
//! within `MERGE_TOL` = 1e-3: f16 keeps 11 significant bits (2^-12 relative rounding, 1/8 of
//! bf16's), so the outputs differ where that moves a bf16 rounding (~1 in 10 values by one bf16 ulp,
//! ‖·‖ ~ 5e-4); a bf16 partial measured ~1.8e-3 (`benches/results/2026-12-01-attention-merge-ab`).

use deepinfer_kernels_ffi::attention::{
    attention_decode, cuda_kernel, decode_splits, head_halves_max_tiles, merge_f32, s_half_first,
    set_head_halves_max_tiles, set_head_halves_sp, set_merge_f32, set_s_half_first, set_s_warpgroup, set_tma_runs,
    set_wgmma, DecodeAttnShape,
};
use deepinfer_kernels_ffi::testing::{
    cuda_device_or_skip, fresh_seed, paged_key_rows, rel_err, switch_kernels, SplitMix,
};
use deepinfer_kernels_ffi::{Device, Stream};
use half::bf16;

const TOL: f64 = 1e-2;
const MERGE_TOL: f64 = 1e-3;

#[derive(Clone)]
struct Case {
    shape: DecodeAttnShape,
    q_scale: f32,
    q: Vec<bf16>,
    kv: Vec<bf16>,
    rows: Vec<i32>,
    counts: Vec<i32>,
    sink: Vec<f32>,
}

/// Whether `kernel` (as `cuda_kernel` names it) runs each sequence's heads as two blocks.
fn is_halves(kernel: &str) -> bool {
    kernel == "di_attn_decode_hs" || kernel.ends_with("+halves")
}

fn run(s: &Stream, c: &Case) -> (Vec<f32>, bool) {
    run_chained(s, c, 1)
}

/// `calls` decode calls queued back to back, each one's queries the previous one's output (which
/// starts as NaN): the last output and whether a row was reported outside the pool.
fn run_chained(s: &Stream, c: &Case, calls: usize) -> (Vec<f32>, bool) {
    let up = |v: &[bf16]| s.upload(v).unwrap();
    let (mut q, kv) = (up(&c.q), up(&c.kv));
    let (rows, counts, sink) = (s.upload(&c.rows).unwrap(), s.upload(&c.counts).unwrap(), s.upload(&c.sink).unwrap());
    let mut status = s.zeros::<i32>(1).unwrap();
    let mut used = Vec::new(); // each call's queries, alive until the download below
    for _ in 0..calls {
        let mut out = up(&vec![bf16::from_f32(f32::NAN); c.q.len()]);
        attention_decode(s, &q, &kv, &rows, &counts, &sink, &mut out, &mut status, c.shape, 1.0 / (512f32).sqrt())
            .unwrap();
        used.push(std::mem::replace(&mut q, out));
    }
    let o = s.download(&q).unwrap().iter().map(|v| v.to_f32()).collect();
    (o, s.download(&status).unwrap()[0] != 0)
}

fn case(rng: &mut SplitMix, batch: u32, heads: u32, max_keys: u32, full: bool, q_scale: f32) -> Case {
    let shape = DecodeAttnShape { batch, heads, head_dim: 512, max_keys };
    let pool = (batch * max_keys).max(1) as usize * 2;
    let b = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
    Case {
        shape,
        q_scale,
        q: b(rng.vec((batch * heads * 512) as usize).into_iter().map(|v| v * q_scale).collect()),
        kv: b(rng.vec(pool * 512)),
        rows: (0..batch * max_keys).map(|_| (rng.next_u64() % pool as u64) as i32).collect(),
        counts: (0..batch)
            .map(|_| if full { max_keys as i32 } else { (rng.next_u64() % (max_keys as u64 + 1)) as i32 })
            .collect(),
        sink: rng.vec(heads as usize).into_iter().map(|v| 2.0 * v).collect(),
    }
}

#[test]
fn gpu_attention_decode_matches_cpu() {
    let Some(dev) = cuda_device_or_skip("gpu_attention_decode_matches_cpu") else { return };
    let gpu = dev.default_stream();
    let cpu = Device::cpu().default_stream();
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = SplitMix(seed);
    // (batch, heads, max_keys, every sequence full, query scale)
    let shapes = [
        (1u32, 64u32, 1u32, true, 4.0f32),
        (3, 64, 100, false, 8.0),
        (5, 16, 700, false, 4.0),
        (2, 64, 1152, true, 16.0),
        (64, 64, 640, true, 8.0),
        (7, 40, 33, false, 1.0),
        // Two splits (the cluster kernels on sm_90) with fewer heads and ragged lengths: three
        // tiles a split (the turn-taking kernel) and four (the S-warpgroup one, and the other).
        (50, 40, 300, false, 2.0),
        (50, 40, 500, false, 2.0),
        // One split, a block per sequence (the S-warpgroup kernel on sm_90), ragged over five tiles.
        (100, 48, 300, false, 4.0),
        // More sequences than SMs with one split: the persistent wgmma kernel's blocks loop over
        // sequences (ragged, many with no keys at all when there are at most 3).
        (200, 64, 130, false, 4.0),
        (400, 64, 3, false, 2.0),
    ];
    // Every kernel this GPU runs for the shape: on sm_90 the warpgroup-MMA kernel (the default) and
    // the mma.sync one; elsewhere only the latter.
    for (batch, heads, max_keys, full, qs) in shapes {
        let c0 = case(&mut rng, batch, heads, max_keys, full, qs);
        for (wgmma, kernel) in switch_kernels(set_wgmma, || cuda_kernel(&gpu, c0.shape)) {
            set_wgmma(wgmma);
            check_decode(&gpu, &cpu, kernel, &c0);
            // On sm_90 with one or two splits: the turn-taking kernel too.
            if kernel.starts_with("di_attn_decode_sp") {
                // S on a tile's first half of dims before the second lands, switched from the
                // default: the same MMAs in the same order, so the same bits.
                let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let base = run(&gpu, &c0).0;
                set_s_half_first(!s_half_first());
                let flipped = run(&gpu, &c0).0;
                set_s_half_first(!s_half_first());
                assert_eq!(bits(base), bits(flipped), "{kernel}: S half first changed the bits");
                set_s_warpgroup(false);
                check_decode(&gpu, &cpu, cuda_kernel(&gpu, c0.shape).unwrap_or_default(), &c0);
                set_s_warpgroup(true);
            }
            // Each sequence's heads as two blocks over all of its keys, whatever its length, where
            // the GPU and the shape allow it (sm_90, an even head count, twice the batch in a wave).
            // Both kernels that run them: the transposed one and the S-warpgroup one.
            let default_halves = head_halves_max_tiles();
            set_head_halves_max_tiles(u32::MAX);
            for sp in [false, true] {
                set_head_halves_sp(sp);
                let halves = cuda_kernel(&gpu, c0.shape).unwrap_or_default();
                if is_halves(halves) {
                    check_decode(&gpu, &cpu, halves, &c0);
                }
            }
            set_head_halves_sp(false);
            set_head_halves_max_tiles(default_halves);
        }
        set_wgmma(true);
    }
}

/// A paged cache's key lists (`testing::paged_key_rows`): per sequence a 128-row window starting
/// inside a 64-row page (so its tiles straddle pages), then whole pages of compressed rows
/// (consecutive runs of 64, one of them the pool's last page), with ragged counts so some last
/// tiles are partial. On Hopper the
/// consecutive tiles load by TMA; the results equal, bit for bit, the same lists gathered row by row,
/// and the CPU's within the tolerance.
#[test]
fn gpu_attention_decode_paged_runs_match_gathered_rows() {
    let Some(dev) = cuda_device_or_skip("gpu_attention_decode_paged_runs_match_gathered_rows") else { return };
    let gpu = dev.default_stream();
    let cpu = Device::cpu().default_stream();
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = SplitMix(seed);
    for (batch, heads, pages, full) in [(64u32, 64u32, 16u32, true), (9, 48, 5, false), (150, 64, 2, false)] {
        let max_keys = 128 + 64 * pages;
        let mut c = case(&mut rng, batch, heads, max_keys, full, 8.0);
        c.rows = paged_key_rows(&mut rng, batch, max_keys, c.kv.len() / 512);
        let (want, _) = run(&cpu, &c);
        // Where sm_90 takes an S-warpgroup kernel (the default), the turn-taking one too, and each
        // sequence's heads as two blocks (forced; where the batch allows it).
        let default_halves = head_halves_max_tiles();
        // (S warpgroup, head halves, their S-warpgroup kernel)
        for (s_wg, halves, sp) in [(true, true, false), (true, true, true), (true, false, false), (false, false, false)]
        {
            set_s_warpgroup(s_wg);
            set_head_halves_max_tiles(if halves { u32::MAX } else { 0 });
            set_head_halves_sp(sp);
            let kernel = cuda_kernel(&gpu, c.shape).unwrap_or_default();
            if halves && !is_halves(kernel) {
                continue;
            }
            set_tma_runs(false);
            let (gathered, _) = run(&gpu, &c);
            set_tma_runs(true);
            let (paged, bad) = run(&gpu, &c);
            assert!(!bad, "a row was reported outside the pool");
            let (rel, max) = rel_err(&paged, &want);
            println!("parity attention_decode {kernel} paged batch={batch} heads={heads} keys<={max_keys}: rel_err={rel:.3e} max_abs={max:.3e} (tol {TOL:.0e})");
            assert!(rel < TOL, "paged batch={batch}: rel_err {rel:e}");
            assert_eq!(
                paged.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                gathered.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "pages by TMA differ from the same rows gathered"
            );
            if !kernel.starts_with("di_attn_decode_sp") {
                break; // the turn-taking kernel (or the mma.sync one) is the default: nothing to compare
            }
        }
        set_s_warpgroup(true);
        set_head_halves_sp(false);
        set_head_halves_max_tiles(default_halves);
    }
}

/// Two decode calls back to back on one stream, the second's queries the first's output (what the
/// kernel before attention is in a forward: it writes Q), with programmatic dependent launch (the
/// default) and without: the same bits either way (a second call that read its Q before waiting
/// for the first would see the NaNs the output buffer starts with, or other values), and the CPU's
/// chain within the tolerance. Every Hopper kernel: the S-warpgroup ones with one and two splits,
/// the turn-taking cluster one and the persistent one.
#[test]
fn gpu_attention_decode_chained_calls_wait_for_their_queries() {
    let Some(dev) = cuda_device_or_skip("gpu_attention_decode_chained_calls_wait_for_their_queries") else { return };
    let gpu = dev.default_stream();
    let cpu = Device::cpu().default_stream();
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = SplitMix(seed);
    let chain = |s: &Stream, c: &Case| run_chained(s, c, 2).0;
    // (batch, heads, max_keys, head halves forced): two splits of five tiles (sp_c2), of two
    // (wg_c2), one split with a block per sequence (sp), more sequences than SMs (the persistent
    // wg), each sequence's heads as two blocks (hs).
    let default_halves = head_halves_max_tiles();
    for (batch, heads, max_keys, halves) in [
        (64u32, 64u32, 640u32, false),
        (64, 64, 192, false),
        (100, 48, 300, false),
        (200, 64, 130, false),
        (64, 64, 640, true),
    ] {
        set_head_halves_max_tiles(if halves { u32::MAX } else { default_halves });
        // Full counts: every output row is written (a sequence with no keys writes zeros anyway).
        let mut c = case(&mut rng, batch, heads, max_keys, true, 8.0);
        // The second call's queries are the first's outputs, weighted averages of key rows and so
        // smaller than the keys: keys four times larger keep its scores spread (the CPU gets the
        // same data).
        c.kv.iter_mut().for_each(|v| *v = bf16::from_f32(v.to_f32() * 4.0));
        let want = chain(&cpu, &c);
        let kernel = cuda_kernel(&gpu, c.shape).unwrap_or_default();
        let with = chain(&gpu, &c);
        deepinfer_kernels_ffi::ops::set_pdl(false);
        let without = chain(&gpu, &c);
        deepinfer_kernels_ffi::ops::set_pdl(true);
        let (rel, max) = rel_err(&with, &want);
        println!(
            "parity attention_decode {kernel} chained batch={batch} heads={heads} keys={max_keys}: rel_err={rel:.3e} max_abs={max:.3e} (tol {TOL:.0e})"
        );
        assert!(with.iter().all(|v| v.is_finite()), "{kernel}: the second call read unwritten queries");
        assert!(rel < TOL, "{kernel} chained: rel_err {rel:e}");
        assert_eq!(
            with.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            without.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{kernel}: chained calls differ with and without programmatic dependent launch"
        );
    }
    set_head_halves_max_tiles(default_halves);
}

/// One decode case on one kernel: parity, two runs bit-identical, an out-of-pool row reported.
fn check_decode(gpu: &Stream, cpu: &Stream, kernel: &str, c0: &Case) {
    let mut c = c0.clone();
    let DecodeAttnShape { batch, heads, max_keys, .. } = c.shape;
    let qs = c.q_scale;
    let (want, skipped_cpu) = run(cpu, &c);
    let (got, skipped_gpu) = run(gpu, &c);
    assert!(!skipped_cpu && !skipped_gpu);
    assert!(got.iter().all(|v| v.is_finite()), "unwritten or non-finite output");
    let (rel, max) = rel_err(&got, &want);
    let (splits, per) = decode_splits(c.shape);
    println!(
        "parity attention_decode {kernel} batch={batch} heads={heads} keys<={max_keys} q_scale={qs} splits={splits}x{per} tiles: rel_err={rel:.3e} max_abs={max:.3e} (tol {TOL:.0e})"
    );
    assert!(rel < TOL, "batch={batch} heads={heads} keys={max_keys}: rel_err {rel:e}");
    let (again, _) = run(gpu, &c);
    assert_eq!(
        again.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "two GPU runs differ"
    );
    if kernel.ends_with("_c2") {
        // The cluster merge's other exchange (fp32, or scaled f16): within the tolerance of the CPU,
        // and within MERGE_TOL of the default's output.
        set_merge_f32(!merge_f32());
        let (other, _) = run(gpu, &c);
        set_merge_f32(!merge_f32());
        let (rel_cpu, _) = rel_err(&other, &want);
        let (rel, max) = rel_err(&got, &other);
        println!(
            "parity attention_decode {kernel} merge_f32={}: rel_err={rel_cpu:.3e}; against merge_f32={}: rel={rel:.3e} max_abs={max:.3e} (tol {MERGE_TOL:.0e})",
            !merge_f32(),
            merge_f32()
        );
        assert!(rel_cpu < TOL, "batch={batch} heads={heads} keys={max_keys}, other merge: rel_err {rel_cpu:e}");
        assert!(rel < MERGE_TOL, "batch={batch} heads={heads} keys={max_keys}: the two merges differ by {rel:e}");
    }
    // A row outside the pool: skipped and reported on both sides, the rest unchanged in meaning.
    if max_keys > 1 {
        c.rows[0] = (c.kv.len() / 512) as i32 + 5;
        c.counts[0] = c.counts[0].max(2);
        let (want, sc) = run(cpu, &c);
        let (got, sg) = run(gpu, &c);
        assert!(sc && sg, "out-of-pool row not reported (cpu {sc}, gpu {sg})");
        let (rel, _) = rel_err(&got, &want);
        assert!(rel < TOL, "with a skipped row: rel_err {rel:e}");
    }
}

/// The lightning indexer (scores and top-k) against the CPU: scores within 1e-4 (bf16 products
/// summed in fp32 in another order), and the GPU's top-k exactly equal to the CPU's selection rule
/// applied to the GPU's scores (ties to the lower position, ascending, -1 padding); against the CPU's
/// own scores the sets match wherever the k-th and (k+1)-th scores are not within 1e-3.
/// Prefill chunks: 300 queries at position 300 (a cached prefix before them, so windows straddle the
/// chunk boundary; more queries than SMs, so the persistent kernel's blocks take several), window
/// 128, against HCA rows (every closed window of 8) and against per-query selections (CSA-like);
/// keys live in a shuffled pool. Same tolerance as decode.
#[test]
fn gpu_attention_prefill_matches_cpu() {
    use deepinfer_kernels_ffi::attention::{attention_prefill, CompressedRows, PrefillAttnShape, PrefillRows};
    let Some(dev) = cuda_device_or_skip("gpu_attention_prefill_matches_cpu") else { return };
    let gpu = dev.default_stream();
    let cpu = Device::cpu().default_stream();
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = SplitMix(seed);
    let (pos0, tokens, window, heads) = (300usize, 300usize, 128usize, 64u32);
    let positions = pos0 + tokens;
    let comp = positions / 8;
    let pool = positions + comp + 17;
    // A shuffled pool: position p's key at perm[p], compressed window w at perm[positions + w].
    let mut perm: Vec<i32> = (0..pool as i32).collect();
    for i in (1..pool).rev() {
        perm.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let b = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
    let kv = b(rng.vec(pool * 512));
    let q = b(rng.vec(tokens * heads as usize * 512).into_iter().map(|v| v * 8.0).collect());
    let sink: Vec<f32> = rng.vec(heads as usize).into_iter().map(|v| 2.0 * v).collect();
    let row_of = |w: usize| perm[positions + w];
    let selected: Vec<Vec<i32>> = (0..tokens)
        .map(|t| {
            let closed = (pos0 + t + 1) / 8;
            (0..closed.min(24)).map(|_| perm[positions + (rng.next_u64() % closed as u64) as usize]).collect()
        })
        .collect();
    for (what, compressed) in [
        ("HCA", CompressedRows::All { ratio: 8, row_of: &row_of }),
        ("selected", CompressedRows::Selected(&selected)),
        ("sliding", CompressedRows::None),
    ] {
        let r = PrefillRows::build(pos0, tokens, window, &|p| perm[p], &compressed);
        let shape = PrefillAttnShape { tokens: tokens as u32, heads, head_dim: 512, max_keys: r.max_keys };
        let run = |s: &Stream| {
            let mut out = s.upload(&vec![bf16::from_f32(f32::NAN); q.len()]).unwrap();
            let mut st = s.zeros::<i32>(1).unwrap();
            let (qb, kb, rb, cb, sb) = (
                s.upload(&q).unwrap(),
                s.upload(&kv).unwrap(),
                s.upload(&r.rows).unwrap(),
                s.upload(&r.counts).unwrap(),
                s.upload(&sink).unwrap(),
            );
            attention_prefill(s, &qb, &kb, &rb, &cb, &sb, &mut out, &mut st, shape, 1.0 / (512f32).sqrt()).unwrap();
            assert_eq!(s.download(&st).unwrap()[0], 0, "{what}: no row outside the pool");
            s.download(&out).unwrap().iter().map(|v| v.to_f32()).collect::<Vec<_>>()
        };
        let (want, got) = (run(&cpu), run(&gpu));
        let (rel, max) = rel_err(&got, &want);
        println!(
            "prefill {what}: {tokens} queries, up to {} keys: rel_err {rel:.2e} max_abs {max:.2e} (tol {TOL:e})",
            r.max_keys
        );
        assert!(rel < TOL, "prefill {what}: rel_err {rel:e}");
    }
}

#[test]
fn gpu_indexer_decode_matches_cpu() {
    use deepinfer_kernels_ffi::indexer::{indexer_decode, IndexerShape};
    let Some(dev) = cuda_device_or_skip("gpu_indexer_decode_matches_cpu") else { return };
    let gpu = dev.default_stream();
    let cpu = Device::cpu().default_stream();
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = SplitMix(seed);
    // (batch, max_rows, k, ragged counts, weights all non-negative: many exact-zero ties)
    for (batch, max_rows, k, ragged, ties) in [
        (1u32, 1u32, 512u32, false, false),
        (3, 700, 512, true, false),
        (2, 5000, 512, false, false),
        (4, 300, 64, true, true),
        (64, 2048, 512, false, false),
    ] {
        let shape = IndexerShape { batch, heads: 64, dim: 128, max_rows, k };
        let pool = (batch * max_rows) as usize + 7;
        let b = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
        let q = b(rng.vec(batch as usize * 64 * 128));
        let w: Vec<f32> =
            rng.vec(batch as usize * 64).into_iter().map(|v| if ties { v.abs() * 0.01 } else { v }).collect();
        let keys = b(rng.vec(pool * 128).into_iter().map(|v| if ties { v - 0.9 } else { v }).collect());
        let rows: Vec<i32> = (0..batch * max_rows).map(|_| (rng.next_u64() % pool as u64) as i32).collect();
        let counts: Vec<i32> = (0..batch)
            .map(|_| if ragged { (rng.next_u64() % (max_rows as u64 + 1)) as i32 } else { max_rows as i32 })
            .collect();
        let run = |s: &Stream| {
            let mut sc = s.zeros::<f32>((batch * max_rows) as usize).unwrap();
            let mut tk = s.zeros::<i32>((batch * k) as usize).unwrap();
            let mut st = s.zeros::<i32>(1).unwrap();
            let (qb, wb, kb) = (s.upload(&q).unwrap(), s.upload(&w).unwrap(), s.upload(&keys).unwrap());
            let (rb, cb) = (s.upload(&rows).unwrap(), s.upload(&counts).unwrap());
            indexer_decode(s, &qb, &wb, &kb, &rb, &cb, &mut sc, &mut tk, &mut st, shape, 1.0 / (64f32 * 128.0).sqrt())
                .unwrap();
            (s.download(&sc).unwrap(), s.download(&tk).unwrap(), s.download(&st).unwrap()[0])
        };
        let (sc_c, tk_c, st_c) = run(&cpu);
        let (sc_g, tk_g, st_g) = run(&gpu);
        assert_eq!((st_c, st_g), (0, 0));
        check_indexer(
            &format!("indexer batch={batch} rows<={max_rows} k={k} ties={ties}"),
            shape,
            (&sc_c, &tk_c),
            (&sc_g, &tk_g),
        );
    }
}

/// Indexer parity of one call: the -inf positions equal, scores within 1e-4 relative, the GPU top-k
/// equal to the selection rule applied to the GPU scores, and equal to the CPU's top-k for every
/// query whose k-th and (k+1)-th CPU scores are not within 1e-3.
fn check_indexer(
    label: &str,
    shape: deepinfer_kernels_ffi::indexer::IndexerShape,
    cpu: (&[f32], &[i32]),
    gpu: (&[f32], &[i32]),
) {
    use deepinfer_kernels_ffi::cpu::indexer::indexer_topk;
    let ((sc_c, tk_c), (sc_g, tk_g)) = (cpu, gpu);
    let (max_rows, k) = (shape.max_rows as usize, shape.k as usize);
    let fin = |v: &[f32]| v.iter().map(|x| if x.is_finite() { *x } else { 0.0 }).collect::<Vec<_>>();
    assert_eq!(
        sc_c.iter().map(|x| x.is_finite()).collect::<Vec<_>>(),
        sc_g.iter().map(|x| x.is_finite()).collect::<Vec<_>>(),
        "{label}: -inf positions differ"
    );
    let (rel, max) = rel_err(&fin(sc_g), &fin(sc_c));
    let mut rule = vec![0i32; tk_g.len()];
    indexer_topk(sc_g, &mut rule, shape);
    assert_eq!(tk_g, &rule[..], "{label}: GPU top-k differs from the selection rule on its own scores");
    let mut close = 0;
    for bi in 0..shape.batch as usize {
        let mut s: Vec<f32> =
            sc_c[bi * max_rows..(bi + 1) * max_rows].iter().copied().filter(|x| x.is_finite()).collect();
        s.sort_by(|a, b| b.total_cmp(a));
        let tight = s.len() > k && (s[k - 1] - s[k]).abs() <= 1e-3 * s[k - 1].abs().max(1e-6);
        if tight {
            close += 1;
            continue;
        }
        assert_eq!(tk_g[bi * k..(bi + 1) * k], tk_c[bi * k..(bi + 1) * k], "{label}: query {bi}: top-k differs");
    }
    println!(
        "parity {label}: scores rel_err={rel:.3e} max_abs={max:.3e} (tol 1e-4); top-k equal ({close} queries with a near-tie at the k-th score compared by rule only)"
    );
    assert!(rel < 1e-4, "{label}: scores rel_err {rel:e}");
}

/// The indexer for prefill chunks: the chunk's tokens share their sequence's list of compressed
/// indexer rows (ratio 4, shuffled in the pool) and token t at position p sees the (p + 1) / 4
/// windows closed by then. A chunk deep into a sequence (1000+ rows, k = 512), the first tokens of a
/// sequence (fewer rows than k: -1 padding) and a list naming a row outside the pool (reported on
/// both sides).
#[test]
fn gpu_indexer_prefill_matches_cpu() {
    use deepinfer_kernels_ffi::indexer::{indexer_prefill, prefill_cuda_kernel, set_wgmma, IndexerShape};
    let Some(dev) = cuda_device_or_skip("gpu_indexer_prefill_matches_cpu") else { return };
    let gpu = dev.default_stream();
    let cpu = Device::cpu().default_stream();
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = SplitMix(seed);
    // (position of the chunk's first token, tokens, k, a bad row in the list)
    for (pos0, tokens, k, bad) in
        [(4000usize, 70usize, 512u32, false), (3, 9, 512, false), (700, 33, 64, true), (2047, 129, 256, false)]
    {
        let max_rows = (pos0 + tokens) / 4;
        let shape = IndexerShape { batch: tokens as u32, heads: 64, dim: 128, max_rows: max_rows as u32, k };
        let pool = max_rows + 11;
        let mut perm: Vec<i32> = (0..pool as i32).collect();
        for i in (1..pool).rev() {
            perm.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let mut list: Vec<i32> = perm[..max_rows].to_vec();
        if bad {
            list[0] = pool as i32 + 4;
        }
        let counts: Vec<i32> = (0..tokens).map(|t| ((pos0 + t + 1) / 4) as i32).collect();
        let b = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
        let q = b(rng.vec(tokens * 64 * 128));
        let w = rng.vec(tokens * 64);
        let keys = b(rng.vec(pool * 128));
        let run = |s: &Stream| {
            let mut sc = s.zeros::<f32>(tokens * max_rows).unwrap();
            let mut tk = s.zeros::<i32>(tokens * k as usize).unwrap();
            let mut st = s.zeros::<i32>(1).unwrap();
            let (qb, wb, kb) = (s.upload(&q).unwrap(), s.upload(&w).unwrap(), s.upload(&keys).unwrap());
            let (rb, cb) = (s.upload(&list).unwrap(), s.upload(&counts).unwrap());
            indexer_prefill(s, &qb, &wb, &kb, &rb, &cb, &mut sc, &mut tk, &mut st, shape, 1.0 / (64f32 * 128.0).sqrt())
                .unwrap();
            (s.download(&sc).unwrap(), s.download(&tk).unwrap(), s.download(&st).unwrap()[0])
        };
        let (sc_c, tk_c, st_c) = run(&cpu);
        // Every scores kernel this GPU runs (on sm_90 the wgmma one and the decode one).
        for (wgmma, kernel) in switch_kernels(set_wgmma, || prefill_cuda_kernel(&gpu)) {
            set_wgmma(wgmma);
            let (sc_g, tk_g, st_g) = run(&gpu);
            assert_eq!((st_c, st_g), (bad as i32, bad as i32), "{kernel}: out-of-pool row reported");
            check_indexer(
                &format!("indexer prefill {kernel} pos0={pos0} tokens={tokens} rows<={max_rows} k={k} bad_row={bad}"),
                shape,
                (&sc_c, &tk_c),
                (&sc_g, &tk_g),
            );
        }
        set_wgmma(true);
    }
}
