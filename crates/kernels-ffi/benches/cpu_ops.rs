//! Criterion benchmarks of the CPU reference ops at decode-like V4-Flash shapes.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use deepinfer_kernels_ffi::testing::SplitMix;
use deepinfer_kernels_ffi::{cpu, RmsNormParams, RopeConfig, RopeParams};

fn bench(c: &mut Criterion) {
    let mut rng = SplitMix(7);
    let (rows, dim) = (64usize, 4096usize);
    let x = rng.vec(rows * dim);
    let w = rng.vec(dim);
    let mut out = vec![0f32; rows * dim];
    let mut g = c.benchmark_group("cpu");
    g.throughput(Throughput::Bytes((2 * rows * dim * 4) as u64));
    g.bench_function("rms_norm_f32_64x4096", |b| {
        b.iter(|| cpu::rms_norm(&x, &w, &mut out, &RmsNormParams::packed(rows as u32, dim as u32, 1e-6)))
    });
    let freq = RopeConfig { theta: 10000.0, rope_dim: 64, yarn: None }.inv_freq();
    let mut q = rng.vec(rows * 64 * 512);
    let pos: Vec<i32> = (0..rows as i32).collect();
    g.throughput(Throughput::Elements((rows * 64 * 32) as u64));
    g.bench_function("rope_f32_64tok_64x512", |b| {
        b.iter(|| cpu::rope(&mut q, &pos, &freq, &RopeParams::new(rows as u32, 64, 512, 64, false)))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
