//! Hot paths of the KV system: prefix lookup for a 128k-token prompt (hashing its 256 blocks of
//! 512 tokens, then walking the cache) and block allocate/free.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use deepinfer_kernels_ffi::Device;
use deepinfer_kv::{block_hashes, BlockPool, EvictionPolicy, ExtraKeys, PrefixCache};

fn bench(c: &mut Criterion) {
    let keys = ExtraKeys { model: "DeepSeek-V4-Flash".into(), encoding: "v4".into(), cache_salt: None };
    let prompt: Vec<u32> = (0..131_072u32).map(|i| i.wrapping_mul(2_654_435_761) % 129_280).collect();
    let hashes = block_hashes(&prompt, 512, &keys);
    let mut cache = PrefixCache::new(100_000, EvictionPolicy::TailFirst);
    let mut parent = None;
    for h in &hashes {
        cache.insert(parent, *h, None).ok();
        parent = Some(*h);
    }
    let mut g = c.benchmark_group("prefix");
    g.throughput(Throughput::Elements(prompt.len() as u64));
    g.bench_function("hash_128k_tokens", |b| b.iter(|| block_hashes(std::hint::black_box(&prompt), 512, &keys)));
    g.bench_function("lookup_128k_tokens_hashed", |b| b.iter(|| cache.longest_prefix(std::hint::black_box(&hashes))));
    g.bench_function("hash_and_lookup_128k_tokens", |b| {
        b.iter(|| {
            let hs = block_hashes(std::hint::black_box(&prompt), 512, &keys);
            cache.longest_prefix(&hs)
        })
    });
    g.finish();

    let pool = BlockPool::new(&Device::cpu().default_stream(), 4096, 64).unwrap();
    c.bench_function("block_allocate_free", |b| b.iter(|| drop(pool.allocate().unwrap())));
    c.bench_function("block_allocate_64_free", |b| {
        b.iter(|| {
            let v: Vec<_> = (0..64).map(|_| pool.allocate().unwrap()).collect();
            drop(v)
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
