//! The simulator end to end on small synthetic traces.

use deepinfer_scheduler::sim::{simulate, SimConfig, SimRequest};
use deepinfer_scheduler::Policy;

fn trace(n: usize, gap: f64) -> Vec<SimRequest> {
    (0..n)
        .map(|i| SimRequest {
            arrival: i as f64 * gap,
            input: 2000 + (i * 997) % 6000,
            output: 50 + i % 100,
            hash_ids: vec![1, 2 + (i % 3) as u64, 100 + i as u64],
        })
        .collect()
}

#[test]
fn every_request_completes_disaggregated_and_colocated() {
    let t = trace(200, 0.05);
    for colocated in [false, true] {
        for policy in [Policy::Ours, Policy::LeastLoaded, Policy::RoundRobin, Policy::CacheAffinity] {
            let cfg = SimConfig { prefill: 2, decode: 2, colocated, policy, ..SimConfig::default() };
            let r = simulate(&t, &cfg);
            assert_eq!((r.completed, r.rejected, r.unfinished), (200, 0, 0), "{policy:?} colocated={colocated}");
            assert!(r.ttft_s.p50 > 0.0 && r.tpot_s.p50 > 0.0);
            assert!(r.prefix_hit_rate > 0.0, "shared first blocks hit the cache");
            assert!(r.utilisation > 0.0 && r.utilisation <= 1.0 + 1e-9);
        }
    }
}

#[test]
fn more_load_never_improves_ttft() {
    let t = trace(300, 0.05);
    let p99 = |scale: f64| simulate(&t, &SimConfig { rate_scale: scale, ..SimConfig::default() }).ttft_s.p99;
    assert!(p99(20.0) >= p99(1.0));
}

#[test]
fn a_prefix_cache_cuts_prefill_work() {
    let t = trace(300, 0.01);
    let with = simulate(&t, &SimConfig::default());
    let without = simulate(&t, &SimConfig { prefix_cache_blocks: Some(0), ..SimConfig::default() });
    assert_eq!(without.prefix_hit_rate, 0.0);
    assert!(with.prefix_hit_rate > 0.0);
    assert!(with.ttft_s.mean <= without.ttft_s.mean);
}
