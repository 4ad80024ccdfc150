//! Random interleavings of allocate / fork / free / publish / lookup / evict / spill / load over
//! the pool, the prefix cache and the tiers. After every step: reference counts balance (each
//! block's count equals the references held), no block is both free and used, free + used =
//! capacity, the cache's structure is consistent, and every cached block's content is the one its
//! hash names.

use std::collections::HashMap;
use std::sync::Arc;

use deepinfer_kernels_ffi::Device;
use deepinfer_kv::tier::{CacheClass, DiskTier, HostTier, Retention, TieredStore};
use deepinfer_kv::{BlockHash, BlockPool, BlockTable, EvictionPolicy, PrefixCache};
use proptest::prelude::*;

const BLOCK: usize = 32;

/// Content a block published under `h` must hold.
fn content(h: &BlockHash) -> Vec<u8> {
    (0..BLOCK).map(|i| h.0[i % 16].wrapping_add(i as u8)).collect()
}

#[derive(Debug, Clone)]
enum Op {
    NewSeq(usize),
    Grow(usize, usize),
    Fork(usize),
    Free(usize),
    CowWrite(usize),
    Publish(usize),
    Lookup(usize),
    Evict,
    Load(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1usize..5).prop_map(Op::NewSeq),
        (0usize..8, 1usize..40).prop_map(|(s, n)| Op::Grow(s, n)),
        (0usize..8).prop_map(Op::Fork),
        (0usize..8).prop_map(Op::Free),
        (0usize..8).prop_map(Op::CowWrite),
        (0usize..8).prop_map(Op::Publish),
        (0usize..8).prop_map(Op::Lookup),
        Just(Op::Evict),
        (0usize..64).prop_map(Op::Load),
    ]
}

struct World {
    pool: BlockPool,
    cache: PrefixCache,
    store: TieredStore,
    seqs: Vec<(BlockTable, u64)>, // table, chain seed (identity of its content)
    published: Vec<BlockHash>,
}

impl World {
    fn hash(seed: u64, i: usize) -> BlockHash {
        BlockHash::from_external(seed * 1000 + i as u64)
    }

    fn check(&self) {
        // Count the references we hold: tables plus cache entries.
        let mut held: HashMap<u32, u32> = HashMap::new();
        for (t, _) in &self.seqs {
            for b in t.blocks() {
                *held.entry(b.id()).or_default() += 1;
            }
        }
        for h in &self.published {
            if let Some(b) = self.cache.block(h) {
                *held.entry(b.id()).or_default() += 1;
                assert_eq!(self.pool.read(b).unwrap(), content(h), "cached block content matches its hash");
            }
        }
        let refs = self.pool.ref_counts();
        for (id, r) in refs.iter().enumerate() {
            assert_eq!(*r, held.get(&(id as u32)).copied().unwrap_or(0), "block {id}: count vs references");
            assert_eq!(*r == 0, self.pool.is_free(id as u32), "block {id}: free iff unreferenced");
        }
        assert_eq!(self.pool.free_blocks() + self.pool.used_blocks(), self.pool.capacity());
        self.cache.check_invariants().unwrap();
    }

    fn apply(&mut self, op: &Op, step: u64) {
        let n = self.seqs.len();
        match *op {
            Op::NewSeq(blocks) => {
                let mut t = BlockTable::new(16);
                if t.append(&self.pool, blocks * 16).is_ok() {
                    self.seqs.push((t, step));
                }
            }
            Op::Grow(s, k) if n > 0 => {
                let _ = self.seqs[s % n].0.append(&self.pool, k);
            }
            Op::Fork(s) if n > 0 => {
                let (t, seed) = &self.seqs[s % n];
                let f = (t.fork(), *seed);
                self.seqs.push(f);
            }
            Op::Free(s) if n > 0 => {
                self.seqs.remove(s % n);
            }
            Op::CowWrite(s) if n > 0 => {
                // Writing to a shared block must not change what others (or the cache) see.
                let t = &mut self.seqs[s % n].0;
                let last = t.blocks().len().saturating_sub(1);
                if !t.blocks().is_empty() && t.make_writable(&self.pool, last).is_ok() {
                    assert_eq!(t.blocks()[last].ref_count(), 1);
                    self.pool.write(&t.blocks()[last], 0, &[0xAB; BLOCK]).unwrap();
                }
            }
            Op::Publish(s) if n > 0 => {
                // Give the sequence's full blocks their content and publish them, chained.
                let (t, seed) = &mut self.seqs[s % n];
                let mut parent = None;
                for (i, b) in t.blocks().iter().enumerate() {
                    let h = World::hash(*seed, i);
                    let fresh = !self.cache.contains(&h);
                    if fresh {
                        if b.ref_count() > 1 {
                            break; // shared: would need copy-on-write first; stop the chain
                        }
                        self.pool.write(b, 0, &content(&h)).unwrap();
                    }
                    match self.cache.insert(parent, h, Some(b.clone())) {
                        Ok(ev) => {
                            for e in ev {
                                let data = self.pool.read(e.block.as_ref().unwrap()).unwrap();
                                self.store.spill_blocking(e.hash, CacheClass::Chat, Arc::new(data)).unwrap();
                            }
                            if fresh && !self.published.contains(&h) {
                                self.published.push(h);
                            }
                        }
                        Err(_) => break,
                    }
                    parent = Some(h);
                }
                // The table may not write into published blocks any more.
                *t = BlockTable::new(16);
            }
            Op::Lookup(s) if n > 0 => {
                let seed = self.seqs[s % n].1;
                let hs: Vec<BlockHash> = (0..4).map(|i| World::hash(seed, i)).collect();
                let k = self.cache.longest_prefix(&hs);
                for h in &hs[..k] {
                    let b = self.cache.block(h).unwrap();
                    assert_eq!(self.pool.read(b).unwrap(), content(h));
                }
            }
            Op::Evict => {
                if let Some(e) = self.cache.evict_one() {
                    let data = self.pool.read(e.block.as_ref().unwrap()).unwrap();
                    assert_eq!(data, content(&e.hash));
                    self.store.spill_blocking(e.hash, CacheClass::Agent, Arc::new(data)).unwrap();
                }
            }
            Op::Load(i) if !self.published.is_empty() => {
                let h = self.published[i % self.published.len()];
                if !self.cache.contains(&h) {
                    self.store.flush().unwrap();
                    let d = self.store.load(&h).expect("an evicted block is in a lower tier");
                    assert_eq!(*d, content(&h), "spilled content comes back intact");
                }
            }
            _ => {}
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn random_interleavings_keep_every_invariant(ops in prop::collection::vec(op(), 1..80), cap in 4usize..24, policy in any::<bool>()) {
        let dir = std::env::temp_dir().join(format!("deepinfer-kv-props-{}-{}", std::process::id(), rand_suffix()));
        let store = TieredStore::new(HostTier::new(4 * BLOCK as u64), DiskTier::open(&dir, u64::MAX, Retention::default()).unwrap(), 8);
        let policy = if policy { EvictionPolicy::TailFirst } else { EvictionPolicy::Lru };
        let mut w = World {
            pool: BlockPool::new(&Device::cpu().default_stream(), 32, BLOCK).unwrap(),
            cache: PrefixCache::new(cap, policy),
            store,
            seqs: Vec::new(),
            published: Vec::new(),
        };
        for (i, op) in ops.iter().enumerate() {
            w.apply(op, i as u64 + 1);
            w.check();
        }
        // Everything released: all blocks come back once tables and cache are gone.
        let pool = w.pool.clone();
        drop(w);
        prop_assert_eq!(pool.free_blocks(), pool.capacity());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

/// The eviction -> spill -> load path, deterministically: publish 6 blocks into a 3-block cache,
/// evict into a host tier of 4 blocks (so some go on to disk only), and load every one back.
#[test]
fn evicted_blocks_round_trip_through_host_and_disk() {
    let dir = std::env::temp_dir().join(format!("deepinfer-kv-roundtrip-{}", std::process::id()));
    let store = TieredStore::new(
        HostTier::new(4 * BLOCK as u64),
        DiskTier::open(&dir, u64::MAX, Retention::default()).unwrap(),
        8,
    );
    let mut w = World {
        pool: BlockPool::new(&Device::cpu().default_stream(), 32, BLOCK).unwrap(),
        cache: PrefixCache::new(3, EvictionPolicy::TailFirst),
        store,
        seqs: Vec::new(),
        published: Vec::new(),
    };
    for (i, op) in
        [Op::NewSeq(3), Op::Publish(0), Op::NewSeq(3), Op::Publish(1), Op::Evict, Op::Evict].iter().enumerate()
    {
        w.apply(op, i as u64 + 1);
        w.check();
    }
    assert_eq!(w.published.len(), 6);
    assert!(w.cache.len() <= 1);
    w.store.flush().unwrap();
    let evicted: Vec<BlockHash> = w.published.iter().filter(|h| !w.cache.contains(h)).copied().collect();
    assert!(evicted.len() >= 5);
    assert!(evicted.iter().any(|h| !w.store.host().contains(h)), "some evicted blocks live only on disk");
    for (i, _) in w.published.clone().iter().enumerate() {
        w.apply(&Op::Load(i), 100 + i as u64);
    }
    assert!(w.store.stats().disk_hits > 0, "{:?}", w.store.stats());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_shared_block_appends_to_a_table_only_on_a_block_boundary() {
    let pool = BlockPool::new(&Device::cpu().default_stream(), 4, 8).unwrap();
    let shared = pool.allocate().unwrap();
    let mut t = BlockTable::new(16);
    t.push_full(shared.clone()).unwrap();
    assert_eq!((t.tokens(), t.blocks().len(), shared.ref_count()), (16, 1, 2));
    t.append(&pool, 3).unwrap();
    assert!(t.push_full(shared.clone()).unwrap_err().to_string().contains("tokens"), "19 tokens end inside a block");
    assert_eq!(t.tokens(), 19);
}
