//! The prefix cache: which blocks of KV, identified by chained hashes, are kept for reuse.
//!
//! Entries form a forest (a block's parent is the block before it). Lookup walks a request's
//! hashes and stops at the first miss. Eviction takes the least recently used *leaf*: a block is
//! never evicted before the blocks that extend it, so the cache never holds a tail whose prefix
//! is gone (such a tail can never be hit: hits are counted from the first block). `Lru` ignores
//! the tree, as a naive block-LRU cache does, for comparison.

use std::collections::{BTreeSet, HashMap};

use crate::hash::BlockHash;
use crate::pool::BlockRef;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// Least recently used among blocks no cached block extends (the default).
    TailFirst,
    /// Least recently used block, whatever extends it.
    Lru,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub lookups: u64,
    pub hit_blocks: u64,
    pub miss_blocks: u64,
    pub inserted: u64,
    pub evicted: u64,
}

struct Entry {
    parent: Option<BlockHash>,
    children: u32,
    pins: u32,
    last_use: u64,
    block: Option<BlockRef>,
}

/// A block evicted from the cache, handed back so it can be spilled to a lower tier.
pub struct Evicted {
    pub hash: BlockHash,
    pub block: Option<BlockRef>,
}

pub struct PrefixCache {
    entries: HashMap<BlockHash, Entry>,
    /// Candidates for eviction, oldest first: (last use, hash).
    order: BTreeSet<(u64, BlockHash)>,
    capacity: usize,
    policy: EvictionPolicy,
    tick: u64,
    stats: CacheStats,
}

impl PrefixCache {
    /// A cache of at most `capacity` blocks (`usize::MAX`: unlimited).
    pub fn new(capacity: usize, policy: EvictionPolicy) -> PrefixCache {
        PrefixCache {
            entries: HashMap::new(),
            order: BTreeSet::new(),
            capacity,
            policy,
            tick: 0,
            stats: CacheStats::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries that hold a pool block (the rest are known hashes whose block lives in a lower tier).
    pub fn resident_blocks(&self) -> usize {
        self.entries.values().filter(|e| e.block.is_some()).count()
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    pub fn contains(&self, h: &BlockHash) -> bool {
        self.entries.contains_key(h)
    }

    /// The block cached under `h`, if any.
    pub fn block(&self, h: &BlockHash) -> Option<&BlockRef> {
        self.entries.get(h).and_then(|e| e.block.as_ref())
    }

    fn candidate(&self, e: &Entry) -> bool {
        e.pins == 0 && (self.policy == EvictionPolicy::Lru || e.children == 0)
    }

    fn set_use(&mut self, h: BlockHash, tick: u64) {
        let Some(e) = self.entries.get_mut(&h) else { return };
        self.order.remove(&(e.last_use, h));
        e.last_use = tick;
        let e = &self.entries[&h];
        if self.candidate(e) {
            self.order.insert((tick, h));
        }
    }

    /// Number of leading `hashes` cached; those are marked used (most recent last).
    pub fn longest_prefix(&mut self, hashes: &[BlockHash]) -> usize {
        self.stats.lookups += 1;
        let n = hashes.iter().take_while(|h| self.entries.contains_key(h)).count();
        for h in &hashes[..n] {
            self.tick += 1;
            self.set_use(*h, self.tick);
        }
        self.stats.hit_blocks += n as u64;
        self.stats.miss_blocks += (hashes.len() - n) as u64;
        n
    }

    /// Protect `h` from eviction while a request uses it (nestable).
    pub fn pin(&mut self, h: &BlockHash) {
        if let Some(e) = self.entries.get_mut(h) {
            e.pins += 1;
            let key = (e.last_use, *h);
            self.order.remove(&key);
        }
    }

    pub fn unpin(&mut self, h: &BlockHash) {
        if let Some(e) = self.entries.get_mut(h) {
            e.pins = e.pins.saturating_sub(1);
            let key = (e.last_use, *h);
            if self.candidate(&self.entries[h]) {
                self.order.insert(key);
            }
        }
    }

    /// Cache `hash` (child of `parent`, which must be cached unless None), holding `block`.
    /// Evicts as needed and returns what it evicted; `Err(block)` when the cache is full of
    /// pinned or in-use blocks (the block stays uncached).
    pub fn insert(
        &mut self,
        parent: Option<BlockHash>,
        hash: BlockHash,
        block: Option<BlockRef>,
    ) -> Result<Vec<Evicted>, Option<BlockRef>> {
        if self.entries.contains_key(&hash) {
            self.tick += 1;
            self.set_use(hash, self.tick);
            return Ok(Vec::new());
        }
        if parent.is_some_and(|p| !self.entries.contains_key(&p)) {
            return Err(block); // a tail without its prefix could never be hit
        }
        if let Some(p) = parent {
            self.pin(&p); // the parent must survive making room for its child
        }
        let mut evicted = Vec::new();
        while self.entries.len() >= self.capacity {
            match self.evict_one() {
                Some(e) => evicted.push(e),
                None => {
                    if let Some(p) = parent {
                        self.unpin(&p);
                    }
                    return Err(block);
                }
            }
        }
        if let Some(p) = parent {
            self.unpin(&p);
            if let Some(pe) = self.entries.get_mut(&p) {
                pe.children += 1;
                let key = (pe.last_use, p);
                if self.policy == EvictionPolicy::TailFirst {
                    self.order.remove(&key);
                }
            }
        }
        self.tick += 1;
        self.entries.insert(hash, Entry { parent, children: 0, pins: 0, last_use: self.tick, block });
        self.order.insert((self.tick, hash));
        self.stats.inserted += 1;
        Ok(evicted)
    }

    /// Evict the least recently used candidate whose block no running sequence holds.
    pub fn evict_one(&mut self) -> Option<Evicted> {
        let victim = self
            .order
            .iter()
            .find(|(_, h)| self.entries[h].block.as_ref().is_none_or(|b| b.ref_count() == 1))
            .copied()?;
        self.order.remove(&victim);
        let h = victim.1;
        let e = self.entries.remove(&h)?;
        if let Some(p) = e.parent {
            if let Some(pe) = self.entries.get_mut(&p) {
                pe.children -= 1;
                let key = (pe.last_use, p);
                if pe.children == 0 && pe.pins == 0 {
                    self.order.insert(key);
                }
            }
        }
        // Under LRU a parent can go first: its children become roots (still cached, never hit).
        if e.children > 0 {
            for c in self.entries.values_mut().filter(|c| c.parent == Some(h)) {
                c.parent = None;
            }
        }
        self.stats.evicted += 1;
        Some(Evicted { hash: h, block: e.block })
    }

    /// Check the structure (tests): child counts match parents, the candidate set is exact.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut kids: HashMap<BlockHash, u32> = HashMap::new();
        for e in self.entries.values() {
            if let Some(p) = e.parent {
                if !self.entries.contains_key(&p) {
                    return Err("an entry's parent is not cached".into());
                }
                *kids.entry(p).or_default() += 1;
            }
        }
        for (h, e) in &self.entries {
            if e.children != kids.get(h).copied().unwrap_or(0) {
                return Err(format!(
                    "child count of {} is {}, expected {}",
                    h.to_hex(),
                    e.children,
                    kids.get(h).copied().unwrap_or(0)
                ));
            }
            if self.candidate(e) != self.order.contains(&(e.last_use, *h)) {
                return Err(format!("eviction set disagrees for {}", h.to_hex()));
            }
        }
        if self.order.len() > self.entries.len() || self.entries.len() > self.capacity {
            return Err("sizes".into());
        }
        Ok(())
    }
}
