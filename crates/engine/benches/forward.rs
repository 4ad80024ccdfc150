//! CPU model throughput on a fixture: prefill of the whole sequence, and one decode step.

use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion};
use deepinfer_engine::{Model, Numerics};

fn bench(c: &mut Criterion) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_v4/real");
    let model = Model::load(&dir).expect("fixture loads");
    let ids: Vec<u32> = (0..256u32).map(|i| (i * 37 + 11) % 500 + 2).collect();
    c.bench_function("prefill_256_real_fixture", |b| {
        b.iter(|| {
            let mut st = model.new_state();
            model.forward(&mut [(&ids[..], &mut st)], Numerics::Reference, false).unwrap()
        })
    });
    let mut st = model.new_state();
    model.forward(&mut [(&ids[..], &mut st)], Numerics::Reference, false).unwrap();
    c.bench_function("decode_1_after_256_real_fixture", |b| {
        b.iter(|| {
            let mut s2 = st.clone();
            model.forward(&mut [(&ids[..1], &mut s2)], Numerics::Reference, false).unwrap()
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
