//! The engine loop driving the device model (cpu backend) through `ForwardModel`: a second turn
//! served from the prefix cache (device rows out as block payloads, back in on a restore, the
//! window rings and compressor windows rebuilt by the exact replay) gives the cold run's tokens
//! and log-probabilities bit for bit, and a batch of requests gives each request's tokens alone.

use std::path::PathBuf;
use std::sync::Arc;

use deepinfer_engine::device_model::{DeviceKvConfig, DeviceModel};
use deepinfer_engine::sampler::SamplingParams;
use deepinfer_engine::{Engine, EngineConfig, GenerateRequest, Numerics};
use deepinfer_kernels_ffi::Device;

fn engine(cfg: EngineConfig) -> Engine {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_v4/small_q");
    let kv = DeviceKvConfig { slots: cfg.max_running + 1, max_len: cfg.max_context, max_chunk: cfg.token_budget };
    let m = DeviceModel::load(&dir, &Device::cpu(), kv, Numerics::Official, &mut |_, _| {}).unwrap();
    Engine::with_model(Arc::new(m), cfg).unwrap()
}

fn cfg() -> EngineConfig {
    EngineConfig { max_running: 4, max_context: 512, token_budget: 128, ..Default::default() }
}

fn greedy() -> SamplingParams {
    SamplingParams { temperature: 0.0, top_logprobs: 0, ..Default::default() }
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|j| (j * 37 + salt * 11 + j * j % 7) % 500 + 3).collect()
}

#[test]
fn a_prefix_hit_on_the_device_model_equals_the_cold_run() {
    let warm = engine(cfg());
    let first = tokens(200, 1);
    let (o1, _) = warm.generate(vec![GenerateRequest::new(1, first.clone(), 10, greedy())]);
    let mut second = first;
    second.extend_from_slice(&o1[0].tokens);
    second.extend(tokens(40, 2));
    let (hot, stats) = warm.generate(vec![GenerateRequest::new(2, second.clone(), 10, greedy())]);
    let cold = engine(EngineConfig { prefix_cache_blocks: 0, ..cfg() });
    let (c, _) = cold.generate(vec![GenerateRequest::new(2, second.clone(), 10, greedy())]);
    assert!(hot[0].error.is_none() && c[0].error.is_none(), "{:?} {:?}", hot[0].error, c[0].error);
    assert_eq!(stats.prefix_hits, 1);
    assert!(hot[0].cached_tokens >= 128, "cached {}", hot[0].cached_tokens);
    assert_eq!(hot[0].tokens, c[0].tokens, "cached and cold greedy outputs");
    assert_eq!(hot[0].logprobs, c[0].logprobs, "the exact replay rebuilds the device state bit for bit");
}

#[test]
fn batched_requests_get_their_tokens_alone() {
    let e = engine(cfg());
    let reqs: Vec<GenerateRequest> =
        (0..4).map(|i| GenerateRequest::new(i, tokens(30 + 17 * i as usize, i as u32 + 5), 12, greedy())).collect();
    let (together, _) = e.generate(reqs.clone());
    for r in reqs {
        let alone = engine(EngineConfig { prefix_cache_blocks: 0, ..cfg() });
        let (a, _) = alone.generate(vec![r.clone()]);
        let t = together.iter().find(|o| o.id == r.id).unwrap();
        assert_eq!(t.tokens, a[0].tokens, "request {}", r.id);
        assert_eq!(t.tokens.len(), 12);
    }
}
