//! Fixed-size memory blocks with reference counts, in one `kernels-ffi` device buffer.
//!
//! [`BlockPool`] hands out [`BlockRef`]s: a clone shares the block (reference count + 1), a drop
//! releases it, and the last drop returns the block to the free list. Used for the paged, shareable
//! KV state (fork and prefix sharing) and, with sharing unused, for per-sequence state slots.

use std::sync::Arc;

use deepinfer_kernels_ffi::{DeviceBuffer, Stream};
use parking_lot::Mutex;

use crate::error::KvError;

pub type BlockId = u32;

struct Counts {
    refs: Vec<u32>,
    free: Vec<BlockId>,
}

struct Shared {
    counts: Mutex<Counts>,
    storage: Mutex<DeviceBuffer<u8>>,
    stream: Stream,
    block_bytes: usize,
    capacity: usize,
}

/// A pool of `capacity` blocks of `block_bytes` bytes on one device.
#[derive(Clone)]
pub struct BlockPool {
    shared: Arc<Shared>,
}

/// A counted reference to one block; the block is freed when the last reference drops.
pub struct BlockRef {
    shared: Arc<Shared>,
    id: BlockId,
}

impl std::fmt::Debug for BlockRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockRef({})", self.id)
    }
}

impl BlockPool {
    /// Allocate the pool's memory on `stream`'s device.
    pub fn new(stream: &Stream, capacity: usize, block_bytes: usize) -> Result<BlockPool, KvError> {
        if capacity == 0 || block_bytes == 0 || capacity > u32::MAX as usize {
            return Err(KvError::Invalid {
                field: "capacity",
                problem: format!("{capacity} blocks of {block_bytes} bytes"),
            });
        }
        let storage = stream.zeros::<u8>(capacity * block_bytes)?;
        Ok(BlockPool {
            shared: Arc::new(Shared {
                // Lowest ids first out: reversed free list.
                counts: Mutex::new(Counts { refs: vec![0; capacity], free: (0..capacity as BlockId).rev().collect() }),
                storage: Mutex::new(storage),
                stream: stream.clone(),
                block_bytes,
                capacity,
            }),
        })
    }

    pub fn capacity(&self) -> usize {
        self.shared.capacity
    }

    pub fn block_bytes(&self) -> usize {
        self.shared.block_bytes
    }

    pub fn free_blocks(&self) -> usize {
        self.shared.counts.lock().free.len()
    }

    pub fn used_blocks(&self) -> usize {
        self.capacity() - self.free_blocks()
    }

    /// A fresh block (reference count 1).
    pub fn allocate(&self) -> Result<BlockRef, KvError> {
        let mut c = self.shared.counts.lock();
        let id = c.free.pop().ok_or(KvError::OutOfBlocks { capacity: self.shared.capacity })?;
        c.refs[id as usize] = 1;
        Ok(BlockRef { shared: self.shared.clone(), id })
    }

    /// Reference count of every block (0 = free), for invariant checks.
    pub fn ref_counts(&self) -> Vec<u32> {
        self.shared.counts.lock().refs.clone()
    }

    /// Whether `id` is on the free list.
    pub fn is_free(&self, id: BlockId) -> bool {
        self.shared.counts.lock().free.contains(&id)
    }

    fn check(&self, b: &BlockRef) -> Result<(), KvError> {
        if !Arc::ptr_eq(&self.shared, &b.shared) {
            return Err(KvError::Invalid { field: "block", problem: "belongs to another pool".into() });
        }
        Ok(())
    }

    /// Write `data` into block `b` at byte `offset`.
    pub fn write(&self, b: &BlockRef, offset: usize, data: &[u8]) -> Result<(), KvError> {
        self.check(b)?;
        if offset + data.len() > self.shared.block_bytes {
            return Err(KvError::Invalid {
                field: "data",
                problem: format!("{} bytes at {offset} overflow the block", data.len()),
            });
        }
        let start = b.id as usize * self.shared.block_bytes + offset;
        Ok(self.shared.stream.write_range(&mut self.shared.storage.lock(), start, data)?)
    }

    /// The bytes of block `b`.
    pub fn read(&self, b: &BlockRef) -> Result<Vec<u8>, KvError> {
        self.check(b)?;
        let bb = self.shared.block_bytes;
        Ok(self.shared.stream.download_range(&self.shared.storage.lock(), b.id as usize * bb, bb)?)
    }

    /// Copy the content of `src` into `dst` (device-side).
    pub fn copy(&self, src: &BlockRef, dst: &BlockRef) -> Result<(), KvError> {
        self.check(src)?;
        self.check(dst)?;
        if src.id == dst.id {
            return Ok(());
        }
        let bb = self.shared.block_bytes;
        Ok(self.shared.stream.copy_within(
            &mut self.shared.storage.lock(),
            src.id as usize * bb,
            dst.id as usize * bb,
            bb,
        )?)
    }
}

impl BlockRef {
    pub fn id(&self) -> BlockId {
        self.id
    }

    /// Current reference count (>= 1 while this reference lives).
    pub fn ref_count(&self) -> u32 {
        self.shared.counts.lock().refs[self.id as usize]
    }
}

impl Clone for BlockRef {
    fn clone(&self) -> Self {
        self.shared.counts.lock().refs[self.id as usize] += 1;
        BlockRef { shared: self.shared.clone(), id: self.id }
    }
}

impl Drop for BlockRef {
    fn drop(&mut self) {
        let mut c = self.shared.counts.lock();
        let r = &mut c.refs[self.id as usize];
        *r -= 1;
        if *r == 0 {
            c.free.push(self.id);
        }
    }
}
