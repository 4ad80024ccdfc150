//! The engine's binding to `kv`: a block pool holding published blocks of compressed rows (the
//! model's `block_payload`), the prefix cache over chained block hashes, an optional durable tier
//! (host memory, then a directory) written through at publish time, and the replay plan of a hit.

use std::path::PathBuf;
use std::sync::Arc;

use deepinfer_kernels_ffi::Device;
use deepinfer_kv::replay::{self, ReplayPlan};
use deepinfer_kv::tier::{CacheClass, DiskTier, HostTier, Retention, TieredStore};
use deepinfer_kv::{
    block_hashes, extend_block_hashes, BlockHash, BlockPool, BlockRef, BlockTable, EvictionPolicy, ExtraKeys, KvLayout,
};
use deepinfer_kv::{KvError, PrefixCache};
use parking_lot::Mutex;
use serde::Serialize;

use crate::forward::{ForwardModel, SeqState};

/// How the state a prefix hit does not store (window rings, open compressor windows) is rebuilt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase", tag = "mode")]
pub enum ReplayMode {
    /// Replay the whole receptive field of the window state (layers × (window − 1) tokens plus a
    /// compressor window): the rebuilt state equals a cold run's, so outputs are identical.
    Exact,
    /// DeepSeek's bounded replay (`DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=mask|compact` with
    /// `DEEPINFER_YOCO_PREFILL_KEEP_TOKENS`): replay `keep` tokens, at least the window. Cheaper,
    /// and a deliberate approximation: outputs may differ slightly from a cold run.
    Bounded { keep: usize },
}

/// Where the engine keeps published blocks beyond device memory.
#[derive(Debug, Clone)]
pub struct KvDirConfig {
    pub dir: PathBuf,
    pub capacity_bytes: u64,
    pub host_bytes: u64,
}

/// A prefix hit: the cached blocks (held, so they are not evicted while the request runs) and
/// which tokens to replay.
#[derive(Debug, Clone)]
pub struct Restore {
    pub blocks: Vec<BlockRef>,
    pub plan: ReplayPlan,
    /// Blocks of the hit that came from the durable tier.
    pub from_store: usize,
}

#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct KvStats {
    pub lookups: u64,
    pub hits: u64,
    pub hit_blocks: u64,
    pub store_hit_blocks: u64,
    pub published_blocks: u64,
    /// Blocks not published because the pool was full of blocks in use.
    pub publish_skipped: u64,
}

/// The block pool's occupancy. `used - cached` are blocks only running requests hold: with
/// nothing running it is 0, whatever requests finished, failed or were cancelled before.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct KvUsage {
    pub used: usize,
    pub cached: usize,
    pub capacity: usize,
}

pub struct KvCache {
    pub block_tokens: usize,
    layout: KvLayout,
    pool: BlockPool,
    cache: Mutex<PrefixCache>,
    store: Option<TieredStore>,
    model_key: String,
    replay: ReplayMode,
    exact_keep: usize,
    stats: Mutex<KvStats>,
}

impl KvCache {
    /// None when the model keeps no compressed rows (nothing to share) or `capacity` is 0.
    pub fn new(
        model: &dyn ForwardModel,
        block_tokens: usize,
        capacity: usize,
        replay: ReplayMode,
        dir: Option<&KvDirConfig>,
    ) -> Result<Option<KvCache>, KvError> {
        let layout = model.kv_layout(block_tokens)?;
        if capacity == 0 || layout.block_bytes() == 0 {
            return Ok(None);
        }
        let pool = BlockPool::new(&Device::cpu().default_stream(), capacity, layout.block_bytes())?;
        let store = match dir {
            Some(d) => Some(TieredStore::new(
                HostTier::new(d.host_bytes),
                DiskTier::open(&d.dir, d.capacity_bytes, Retention::default())?,
                64,
            )),
            None => None,
        };
        Ok(Some(KvCache {
            block_tokens,
            layout,
            pool,
            cache: Mutex::new(PrefixCache::new(capacity, EvictionPolicy::TailFirst)),
            store,
            model_key: model.fingerprint(),
            replay,
            exact_keep: model.exact_replay_tokens(),
            stats: Mutex::new(KvStats::default()),
        }))
    }

    pub fn stats(&self) -> KvStats {
        *self.stats.lock()
    }

    /// Blocks of the pool in use, those the prefix cache holds, and the pool's capacity.
    pub fn usage(&self) -> KvUsage {
        // The cache's lock first: a block the cache holds is then counted in both or neither.
        let cache = self.cache.lock();
        KvUsage { used: self.pool.used_blocks(), cached: cache.resident_blocks(), capacity: self.pool.capacity() }
    }

    fn keys(&self, salt: Option<&str>) -> ExtraKeys {
        ExtraKeys { model: self.model_key.clone(), encoding: "tokens".into(), cache_salt: salt.map(Into::into) }
    }

    pub fn hashes(&self, tokens: &[u32], salt: Option<&str>) -> Vec<BlockHash> {
        block_hashes(tokens, self.block_tokens, &self.keys(salt))
    }

    /// Extend a sequence's block hashes to cover its full blocks in `tokens`.
    pub fn extend_hashes(&self, hashes: &mut Vec<BlockHash>, tokens: &[u32], salt: Option<&str>) {
        extend_block_hashes(hashes, tokens, self.block_tokens, &self.keys(salt));
    }

    /// A pool block, evicting cached blocks nobody holds when the pool is full.
    fn allocate(&self, cache: &mut PrefixCache) -> Option<BlockRef> {
        loop {
            if let Ok(b) = self.pool.allocate() {
                return Some(b);
            }
            cache.evict_one()?;
        }
    }

    /// The longest cached prefix of `prompt` (device pool, then the durable tier) and its replay.
    pub fn lookup(&self, prompt: &[u32], salt: Option<&str>) -> Option<Restore> {
        let hashes = self.hashes(prompt, salt);
        let mut cache = self.cache.lock();
        let n = cache.longest_prefix(&hashes);
        let mut blocks: Vec<BlockRef> = hashes[..n].iter().filter_map(|h| cache.block(h).cloned()).collect();
        let mut from_store = 0;
        if let (Some(store), true) = (&self.store, blocks.len() == n) {
            for (i, h) in hashes.iter().enumerate().skip(n) {
                let Some(bytes) = store.load(h) else { break };
                if bytes.len() != self.pool.block_bytes() {
                    break;
                }
                let Some(b) = self.allocate(&mut cache) else { break };
                if self.pool.write(&b, 0, &bytes).is_err() {
                    break;
                }
                let parent = (i > 0).then(|| hashes[i - 1]);
                if cache.insert(parent, *h, Some(b.clone())).is_err() {
                    break;
                }
                blocks.push(b);
                from_store += 1;
            }
        }
        drop(cache);
        let keep = match self.replay {
            ReplayMode::Exact => self.exact_keep,
            ReplayMode::Bounded { keep } => keep,
        };
        let plan = replay::plan(&self.layout, blocks.len() * self.block_tokens, prompt.len(), Some(keep));
        let mut st = self.stats.lock();
        st.lookups += 1;
        if plan.reused_tokens == 0 {
            return None;
        }
        blocks.truncate(plan.reused_tokens / self.block_tokens);
        st.hits += 1;
        st.hit_blocks += blocks.len() as u64;
        st.store_hit_blocks += from_store as u64;
        Some(Restore { blocks, plan, from_store })
    }

    /// Payloads of a hit's blocks.
    pub fn read(&self, blocks: &[BlockRef]) -> Result<Vec<Vec<u8>>, KvError> {
        blocks.iter().map(|b| self.pool.read(b)).collect()
    }

    /// Publish every block of `state` that is complete and not yet in `table`: write its rows to a
    /// pool block, add it to the prefix cache under its chained hash, and write it through to the
    /// durable tier. `hashes` are the sequence's block hashes (at least as many as complete blocks).
    pub fn publish(
        &self,
        model: &dyn ForwardModel,
        state: &SeqState,
        table: &mut BlockTable,
        hashes: &[BlockHash],
        class: CacheClass,
    ) {
        let bt = self.block_tokens;
        while (table.blocks().len() + 1) * bt <= state.len() && table.blocks().len() < hashes.len() {
            let b = table.blocks().len();
            let Ok(payload) = model.block_payload(state, b, bt) else {
                self.stats.lock().publish_skipped += 1;
                return;
            };
            let mut cache = self.cache.lock();
            let parent = (b > 0).then(|| hashes[b - 1]);
            let block = match cache.block(&hashes[b]).cloned() {
                Some(existing) => existing, // another request published the same block
                None => {
                    let Some(fresh) = self.allocate(&mut cache) else {
                        self.stats.lock().publish_skipped += 1;
                        return;
                    };
                    if self.pool.write(&fresh, 0, &payload).is_err()
                        || cache.insert(parent, hashes[b], Some(fresh.clone())).is_err()
                    {
                        self.stats.lock().publish_skipped += 1;
                        return;
                    }
                    self.stats.lock().published_blocks += 1;
                    if let Some(store) = &self.store {
                        // Write-back is best effort: a full queue drops the durable copy only.
                        let _ = store.spill(hashes[b], class, Arc::new(payload));
                    }
                    fresh
                }
            };
            drop(cache);
            table.push_full(block).expect("the table covers whole published blocks");
        }
    }

    /// Wait until the durable tier has written everything queued.
    pub fn flush(&self) -> Result<(), KvError> {
        self.store.as_ref().map_or(Ok(()), |s| s.flush())
    }
}
