//! Decode attention on the CUDA backend against the CPU reference, on fresh random inputs every
//! run (the seed is printed; `DEEPINFER_TEST_SEED` reproduces a run). Skipped, with a message,
//! where there is no GPU; run on the H200 from the GPU bundle.
//!
//! Tolerance 1e-2 (relative, ‖gpu − cpu‖ / ‖cpu‖): the kernel multiplies bf16 probabilities
//! (unnormalised, rounded once: 2^-9 relative each) with bf16 keys on the matrix units and sums in
//! fp32; the CPU keeps f32 probabilities. Errors of 2^-9 per term average down over many keys; the
//! output is rounded to bf16 on both sides.

use deepinfer_kernels_ffi::attention::{attention_decode, decode_splits, DecodeAttnShape};
use deepinfer_kernels_ffi::testing::{cuda_device_or_skip, fresh_seed, rel_err, SplitMix};
use deepinfer_kernels_ffi::{Device, Stream};
use half::bf16;

const TOL: f64 = 1e-2;

struct Case {
    shape: DecodeAttnShape,
    q: Vec<bf16>,
    kv: Vec<bf16>,
    rows: Vec<i32>,
    counts: Vec<i32>,
    sink: Vec<f32>,
}

fn run(s: &Stream, c: &Case) -> (Vec<f32>, bool) {
    let up = |v: &[bf16]| s.upload(v).unwrap();
    let (q, kv) = (up(&c.q), up(&c.kv));
    let (rows, counts, sink) = (s.upload(&c.rows).unwrap(), s.upload(&c.counts).unwrap(), s.upload(&c.sink).unwrap());
    let mut out = up(&vec![bf16::from_f32(f32::NAN); c.q.len()]);
    let mut status = s.zeros::<i32>(1).unwrap();
    attention_decode(s, &q, &kv, &rows, &counts, &sink, &mut out, &mut status, c.shape, 1.0 / (512f32).sqrt()).unwrap();
    let o = s.download(&out).unwrap().iter().map(|v| v.to_f32()).collect();
    (o, s.download(&status).unwrap()[0] != 0)
}

fn case(rng: &mut SplitMix, batch: u32, heads: u32, max_keys: u32, full: bool, q_scale: f32) -> Case {
    let shape = DecodeAttnShape { batch, heads, head_dim: 512, max_keys };
    let pool = (batch * max_keys).max(1) as usize * 2;
    let b = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
    Case {
        shape,
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
    ];
    for (batch, heads, max_keys, full, qs) in shapes {
        let mut c = case(&mut rng, batch, heads, max_keys, full, qs);
        let (want, skipped_cpu) = run(&cpu, &c);
        let (got, skipped_gpu) = run(&gpu, &c);
        assert!(!skipped_cpu && !skipped_gpu);
        assert!(got.iter().all(|v| v.is_finite()), "unwritten or non-finite output");
        let (rel, max) = rel_err(&got, &want);
        let (splits, per) = decode_splits(c.shape);
        println!(
            "parity attention_decode batch={batch} heads={heads} keys<={max_keys} q_scale={qs} splits={splits}x{per} tiles: rel_err={rel:.3e} max_abs={max:.3e} (tol {TOL:.0e})"
        );
        assert!(rel < TOL, "batch={batch} heads={heads} keys={max_keys}: rel_err {rel:e}");
        let (again, _) = run(&gpu, &c);
        assert_eq!(
            again.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "two GPU runs differ"
        );
        // A row outside the pool: skipped and reported on both sides, the rest unchanged in meaning.
        if max_keys > 1 {
            c.rows[0] = (c.kv.len() / 512) as i32 + 5;
            c.counts[0] = c.counts[0].max(2);
            let (want, sc) = run(&cpu, &c);
            let (got, sg) = run(&gpu, &c);
            assert!(sc && sg, "out-of-pool row not reported (cpu {sc}, gpu {sg})");
            let (rel, _) = rel_err(&got, &want);
            assert!(rel < TOL, "with a skipped row: rel_err {rel:e}");
        }
    }
}
