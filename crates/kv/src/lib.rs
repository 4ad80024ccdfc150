//! Paged KV memory for DeepSeek-V4 sequences and the system that keeps it: fixed-size blocks for
//! the shareable state (compressed KV rows, indexer keys), per-sequence slots for the
//! non-shareable state (window ring, compressor partial buffers), block tables with RAII handles
//! and copy-on-write forks; the prefix cache (chained block hashes, tail-first eviction, bounded
//! replay); and the tiered, durable KV store (device -> host -> a local or shared directory).
//! No CUDA types: device memory arrives through `kernels-ffi` buffers.
//!
//! ```
//! use deepinfer_kernels_ffi::Device;
//! use deepinfer_kv::{block_hashes, BlockPool, BlockTable, EvictionPolicy, ExtraKeys, PrefixCache};
//!
//! let pool = BlockPool::new(&Device::cpu().default_stream(), 8, 64)?;
//! let keys = ExtraKeys { model: "tiny".into(), encoding: "v4".into(), cache_salt: None };
//! let prompt: Vec<u32> = (0..40).collect();
//! let hashes = block_hashes(&prompt, 16, &keys); // two full blocks of 16 tokens
//!
//! // First request: compute, then publish its full blocks.
//! let mut table = BlockTable::new(16);
//! table.append(&pool, prompt.len())?;
//! let mut cache = PrefixCache::new(8, EvictionPolicy::TailFirst);
//! let mut parent = None;
//! for (h, b) in hashes.iter().zip(table.blocks()) {
//!     cache.insert(parent, *h, Some(b.clone())).ok();
//!     parent = Some(*h);
//! }
//! drop(table); // the cache still holds the two blocks
//! assert_eq!(pool.used_blocks(), 2);
//!
//! // A second request with the same prefix reuses them.
//! assert_eq!(cache.longest_prefix(&hashes), 2);
//! # Ok::<(), deepinfer_kv::KvError>(())
//! ```

mod error;
mod hash;
mod layout;
mod pool;
mod prefix;
pub mod replay;
mod table;
pub mod tier;
pub mod trace;

pub use error::KvError;
pub use hash::{block_hashes, extend_block_hashes, BlockHash, ExtraKeys};
pub use layout::{KvLayout, LayerGeometry};
pub use pool::{BlockId, BlockPool, BlockRef};
pub use prefix::{CacheStats, Evicted, EvictionPolicy, PrefixCache};
pub use table::BlockTable;
