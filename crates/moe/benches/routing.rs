//! Routing one token at V4-Flash shape (256 experts, top-6): the per-token cost the engine pays
//! in every MoE layer on the CPU path.

use criterion::{criterion_group, criterion_main, Criterion};
use deepinfer_moe::{Router, RoutingPolicy};

fn bench(c: &mut Criterion) {
    let router = Router::new(256, 6, 1.5).unwrap();
    let logits: Vec<f32> = (0..256).map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0).collect();
    let bias: Vec<f32> = (0..256).map(|i| ((i * 104729) % 100) as f32 / 1000.0).collect();
    c.bench_function("route_score_256x6", |b| {
        b.iter(|| router.route(std::hint::black_box(&logits), RoutingPolicy::Score { bias: &bias }).unwrap())
    });
    let table = [3i64, 17, 42, 99, 128, 200];
    c.bench_function("route_hash_256x6", |b| {
        b.iter(|| router.route(std::hint::black_box(&logits), RoutingPolicy::Hash { experts: &table }).unwrap())
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
