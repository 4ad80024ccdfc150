//! The row kernels (`rows.rs`: scatter_rows, qat_rows, copy_2d, offset_rows) on CUDA against the
//! CPU backend: every op moves or rounds values without arithmetic of its own beyond the QAT, whose
//! e4m3/e2m1 rounding and power-of-two scales are exact, so the results must be equal bit for bit
//! (the Hadamard sums run in the same order). Skipped without a GPU.

use deepinfer_kernels_ffi::rows::{copy_2d, offset_rows, qat_rows, scatter_rows, RowQatKind};
use deepinfer_kernels_ffi::testing::{cuda_device_or_skip, SplitMix};
use deepinfer_kernels_ffi::{Device, Stream};
use half::bf16;

fn both() -> Option<(Stream, Stream)> {
    let g = cuda_device_or_skip("gpu_rows")?;
    Some((Device::cpu().default_stream(), g.default_stream()))
}

fn values(n: usize, seed: u64) -> Vec<bf16> {
    SplitMix(seed).vec(n).into_iter().map(|v| bf16::from_f32(v * 3.0)).collect()
}

#[test]
fn gpu_row_ops_match_the_cpu_backend() {
    let Some((c, g)) = both() else { return };
    // scatter_rows: 40 rows of 512 into a 100-row pool, some skipped, one past the pool.
    let src = values(40 * 512, 1);
    let rows: Vec<i32> = (0..40)
        .map(|i| {
            if i % 7 == 3 {
                -1
            } else if i == 39 {
                100
            } else {
                i * 37 % 97
            }
        })
        .collect();
    let run_scatter = |s: &Stream| {
        let mut dst = s.upload(&values(100 * 512, 2)).unwrap();
        let mut st = s.zeros::<i32>(1).unwrap();
        scatter_rows(s, &s.upload(&src).unwrap(), &s.upload(&rows).unwrap(), &mut dst, &mut st, 40, 512).unwrap();
        (s.download(&dst).unwrap(), s.download(&st).unwrap())
    };
    assert_eq!(run_scatter(&c), run_scatter(&g), "scatter_rows");
    // qat_rows: the KV QAT on 512-wide rows (rope 64) and the indexer QAT on 128-wide rows, listed and all.
    for (dim, kind) in [
        (512usize, RowQatKind::Fp8Nope { rope_dim: 64 }),
        (128, RowQatKind::HadamardFp4),
        (64, RowQatKind::Fp8Nope { rope_dim: 16 }),
    ] {
        let list: Vec<i32> = vec![5, -1, 0, 17, 3, 31];
        for listed in [false, true] {
            let run = |s: &Stream| {
                let mut b = s.upload(&values(32 * dim, dim as u64)).unwrap();
                let l = s.upload(&list).unwrap();
                let (rows, count) = if listed { (Some(&l), list.len()) } else { (None, 32) };
                qat_rows(s, &mut b, rows, count, dim, kind).unwrap();
                s.download(&b).unwrap()
            };
            assert_eq!(run(&c), run(&g), "qat_rows {kind:?} listed {listed}");
        }
    }
    // copy_2d: group 3 of 8 out of [50, 8·96] and into [50, 4·96] at column 2·96.
    let run_copy = |s: &Stream| {
        let src = s.upload(&values(50 * 8 * 96, 9)).unwrap();
        let mut tmp = s.zeros::<bf16>(50 * 96).unwrap();
        copy_2d(s, &src, 8 * 96, 3 * 96, &mut tmp, 96, 0, 50, 96).unwrap();
        let mut dst = s.upload(&values(50 * 4 * 96, 10)).unwrap();
        copy_2d(s, &tmp, 96, 0, &mut dst, 4 * 96, 2 * 96, 50, 96).unwrap();
        s.download(&dst).unwrap()
    };
    assert_eq!(run_copy(&c), run_copy(&g), "copy_2d");
    // offset_rows: 300 queries, k = 16, -1 selections kept, one query without room.
    let topk: Vec<i32> = (0..300 * 16).map(|i| if i % 13 == 0 { -1 } else { i * 7 % 500 }).collect();
    let base: Vec<i32> = (0..300).map(|t| 1000 + t * 3).collect();
    let at: Vec<i32> = (0..300).map(|t| if t == 5 { 150 } else { t % 128 }).collect();
    let run_off = |s: &Stream| {
        let mut dst = s.upload(&vec![7i32; 300 * 160]).unwrap();
        offset_rows(
            s,
            &s.upload(&topk).unwrap(),
            &s.upload(&base).unwrap(),
            &s.upload(&at).unwrap(),
            &mut dst,
            300,
            16,
            160,
        )
        .unwrap();
        s.download(&dst).unwrap()
    };
    assert_eq!(run_off(&c), run_off(&g), "offset_rows");
}
