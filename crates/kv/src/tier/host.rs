//! Host-memory tier: blocks by hash, least recently used out first, within a byte capacity.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::hash::BlockHash;

struct Inner {
    map: HashMap<BlockHash, (Arc<Vec<u8>>, u64)>,
    order: BTreeMap<u64, BlockHash>,
    bytes: u64,
    tick: u64,
}

/// Blocks in host memory.
pub struct HostTier {
    inner: Mutex<Inner>,
    capacity: u64,
}

impl HostTier {
    pub fn new(capacity_bytes: u64) -> HostTier {
        HostTier {
            inner: Mutex::new(Inner { map: HashMap::new(), order: BTreeMap::new(), bytes: 0, tick: 0 }),
            capacity: capacity_bytes,
        }
    }

    /// Keep `data` under `h`, evicting the least recently used blocks to fit. Returns the
    /// evicted hashes; a block larger than the whole tier is not kept.
    pub fn put(&self, h: BlockHash, data: Arc<Vec<u8>>) -> Vec<BlockHash> {
        let mut g = self.inner.lock();
        let size = data.len() as u64;
        if size > self.capacity {
            return Vec::new();
        }
        if let Some((old, t)) = g.map.remove(&h) {
            g.bytes -= old.len() as u64;
            g.order.remove(&t);
        }
        let mut evicted = Vec::new();
        while g.bytes + size > self.capacity {
            let Some((&t, &v)) = g.order.iter().next() else { break };
            g.order.remove(&t);
            if let Some((d, _)) = g.map.remove(&v) {
                g.bytes -= d.len() as u64;
            }
            evicted.push(v);
        }
        g.tick += 1;
        let t = g.tick;
        g.bytes += size;
        g.order.insert(t, h);
        g.map.insert(h, (data, t));
        evicted
    }

    pub fn get(&self, h: &BlockHash) -> Option<Arc<Vec<u8>>> {
        let mut g = self.inner.lock();
        let (d, t) = g.map.get(h).cloned()?;
        g.order.remove(&t);
        g.tick += 1;
        let nt = g.tick;
        g.order.insert(nt, *h);
        if let Some(e) = g.map.get_mut(h) {
            e.1 = nt;
        }
        Some(d)
    }

    pub fn contains(&self, h: &BlockHash) -> bool {
        self.inner.lock().map.contains_key(h)
    }

    pub fn bytes(&self) -> u64 {
        self.inner.lock().bytes
    }

    pub fn len(&self) -> usize {
        self.inner.lock().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
