//! Prefix-cache replay of the Mooncake FAST'25 conversation trace (tests/fixtures, Apache-2.0,
//! copied verbatim, committed gzip-compressed; sha256 of the uncompressed file b8cbb061...). Reference figures from `tools/trace_stats.py`:
//! unlimited prefix hit rate 0.374, naive block LRU at 20,000 blocks 0.293.

use std::io::BufReader;

use deepinfer_kv::trace::{load_trace_file, read_trace, replay};
use deepinfer_kv::EvictionPolicy;

fn trace() -> Vec<deepinfer_kv::trace::TraceRequest> {
    let p = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/conversation_trace.jsonl.gz");
    load_trace_file(std::path::Path::new(p)).unwrap()
}

#[test]
fn unlimited_capacity_gives_the_exact_prefix_hit_rate() {
    let r = replay(&trace(), None, 512, EvictionPolicy::TailFirst);
    assert_eq!(r.requests, 12031);
    assert_eq!(r.input_tokens, 144_793_823);
    assert_eq!((r.hit_rate * 1000.0).round() / 1000.0, 0.374, "{r:?}");
    assert_eq!(r.evicted_blocks, 0);
}

#[test]
fn tail_first_eviction_is_at_least_naive_lru() {
    let t = trace();
    for cap in [1000, 5000, 20000] {
        let tail = replay(&t, Some(cap), 512, EvictionPolicy::TailFirst);
        let lru = replay(&t, Some(cap), 512, EvictionPolicy::Lru);
        println!("capacity {cap}: tail-first {:.5} lru {:.5}", tail.hit_rate, lru.hit_rate);
        assert!(tail.hit_rate >= lru.hit_rate, "capacity {cap}: {tail:?} vs {lru:?}");
    }
    // The naive figure reproduces trace_stats.py's.
    assert_eq!((replay(&t, Some(20000), 512, EvictionPolicy::Lru).hit_rate * 1000.0).round() / 1000.0, 0.293);
}

#[test]
fn a_bad_line_is_reported_by_number() {
    let e = read_trace(BufReader::new(
        &b"{\"timestamp\":0,\"input_length\":1,\"output_length\":1,\"hash_ids\":[1]}\n{\"timestamp\":\"x\"}\n"[..],
    ))
    .unwrap_err();
    assert!(e.to_string().contains("line 2"), "{e}");
}
