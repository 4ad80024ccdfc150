//! Planning one step with 1,024 running decodes (plus waiting prefills): the CPU time the loop
//! spends per step, to compare with a 10 ms decode step (the target is well under 1%, 100 us).

use criterion::{criterion_group, criterion_main, Criterion};
use deepinfer_scheduler::{CostModel, DeviceRates, ModelShape, Request, Scheduler, SchedulerConfig};

fn bench(c: &mut Criterion) {
    let cfg =
        SchedulerConfig { max_running: 2048, kv_blocks: 1 << 20, token_budget: 16384, ..SchedulerConfig::default() };
    let mut s = Scheduler::new(cfg, CostModel::new(ModelShape::v4_flash(), DeviceRates::h200()));
    for i in 0..1024u64 {
        s.add(Request::new(i, 1000 + (i as usize * 37) % 3000, 1 << 20, 0.0)).unwrap();
    }
    // Prefill everything until all 1,024 decode.
    let mut t = 0.0;
    while s.running() < 1024 || s.waiting() > 0 {
        let p = s.plan(t).unwrap();
        s.complete(p.step, &[]).unwrap();
        t += 0.01;
    }
    for i in 0..16u64 {
        s.add(Request::new(10_000 + i, 4000, 100, t)).unwrap();
    }
    c.bench_function("plan_and_complete_step_1024_decodes", |b| {
        b.iter(|| {
            let p = s.plan(t).unwrap();
            s.complete(p.step, &[]).unwrap()
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
