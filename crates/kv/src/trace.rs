//! Replaying a Mooncake-format trace (`{"timestamp", "input_length", "output_length",
//! "hash_ids"}` per line, one id per block of the prompt, chained) through the prefix cache.
//!
//! In order: a request hits its leading cached blocks (the last capped at `input_length`), then
//! all its blocks are in the cache.

use std::io::{BufRead, BufReader};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::KvError;
use crate::hash::BlockHash;
use crate::prefix::{EvictionPolicy, PrefixCache};

#[derive(Debug, Clone, Deserialize)]
pub struct TraceRequest {
    pub timestamp: u64,
    pub input_length: usize,
    pub output_length: usize,
    pub hash_ids: Vec<u64>,
}

/// Open a trace file for reading, inflating it when it is gzip-compressed (by its magic bytes, so
/// `trace.jsonl.gz` and a compressed file under any name both work; public traces ship compressed).
pub fn open_trace_file(path: &Path) -> Result<Box<dyn BufRead>, KvError> {
    let io = |e| KvError::Io { path: path.display().to_string(), source: e };
    let mut f = BufReader::new(std::fs::File::open(path).map_err(io)?);
    let gz = f.fill_buf().map_err(io)?.starts_with(&[0x1f, 0x8b]);
    Ok(if gz { Box::new(BufReader::new(flate2::bufread::GzDecoder::new(f))) } else { Box::new(f) })
}

/// Read a JSONL trace file (plain or gzip); errors name the line.
pub fn load_trace_file(path: &Path) -> Result<Vec<TraceRequest>, KvError> {
    read_trace(open_trace_file(path)?)
}

/// Read a JSONL trace; errors name the line.
pub fn read_trace(r: impl BufRead) -> Result<Vec<TraceRequest>, KvError> {
    let mut out = Vec::new();
    for (i, line) in r.lines().enumerate() {
        let line = line.map_err(|e| KvError::Trace { line: i + 1, problem: e.to_string() })?;
        if line.trim().is_empty() {
            continue;
        }
        let req: TraceRequest =
            serde_json::from_str(&line).map_err(|e| KvError::Trace { line: i + 1, problem: e.to_string() })?;
        out.push(req);
    }
    Ok(out)
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ReplayReport {
    pub requests: usize,
    pub input_tokens: u64,
    pub hit_tokens: u64,
    pub hit_rate: f64,
    pub capacity_blocks: Option<usize>,
    pub block_tokens: usize,
    pub eviction: String,
    pub evicted_blocks: u64,
}

/// Replay `reqs` through a cache of `capacity` blocks (None: unlimited).
pub fn replay(
    reqs: &[TraceRequest],
    capacity: Option<usize>,
    block_tokens: usize,
    policy: EvictionPolicy,
) -> ReplayReport {
    let mut cache = PrefixCache::new(capacity.unwrap_or(usize::MAX), policy);
    let (mut input, mut hit) = (0u64, 0u64);
    for r in reqs {
        let hashes: Vec<BlockHash> = r.hash_ids.iter().map(|id| BlockHash::from_external(*id)).collect();
        let n = cache.longest_prefix(&hashes);
        input += r.input_length as u64;
        hit += (n * block_tokens).min(r.input_length) as u64;
        // Pin the chain while its tail goes in, so making room never evicts the prefix itself.
        for h in &hashes[..n] {
            cache.pin(h);
        }
        let mut parent = n.checked_sub(1).map(|i| hashes[i]);
        let mut inserted = Vec::new();
        for h in &hashes[n..] {
            if cache.insert(parent, *h, None).is_err() {
                break; // cache full of pinned blocks: the rest of this request stays uncached
            }
            cache.pin(h);
            inserted.push(*h);
            parent = Some(*h);
        }
        for h in hashes[..n].iter().chain(&inserted) {
            cache.unpin(h);
        }
    }
    ReplayReport {
        requests: reqs.len(),
        input_tokens: input,
        hit_tokens: hit,
        hit_rate: if input == 0 { 0.0 } else { hit as f64 / input as f64 },
        capacity_blocks: capacity,
        block_tokens,
        eviction: match policy {
            EvictionPolicy::TailFirst => "tail-first",
            EvictionPolicy::Lru => "lru",
        }
        .into(),
        evicted_blocks: cache.stats().evicted,
    }
}
