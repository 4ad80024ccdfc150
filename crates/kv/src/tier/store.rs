//! Host and disk tiers together, with background write-back and prefetch.
//!
//! `spill` keeps a block in host memory and queues its write to disk; the queue is bounded, and a
//! full queue answers [`KvError::Busy`] (back-pressure: the caller decides to wait or drop),
//! while `spill_blocking` waits for room. `prefetch` queues loads from disk into host memory ahead
//! of a request; `load` reads host first, then disk (promoting the block to host).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread::JoinHandle;

use crossbeam::channel::{bounded, Receiver, Sender, TrySendError};

use super::{CacheClass, DiskTier, HostTier};
use crate::error::KvError;
use crate::hash::BlockHash;

enum Job {
    Write(BlockHash, CacheClass, Arc<Vec<u8>>),
    Prefetch(BlockHash),
    /// Every worker takes exactly one (it waits at the barrier), after finishing earlier jobs.
    Flush(Arc<Barrier>),
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct StoreStats {
    pub spilled: u64,
    pub written_back: u64,
    pub write_back_failed: u64,
    pub prefetched: u64,
    pub host_hits: u64,
    pub disk_hits: u64,
    pub misses: u64,
}

#[derive(Default)]
struct Counters {
    spilled: AtomicU64,
    written_back: AtomicU64,
    write_back_failed: AtomicU64,
    prefetched: AtomicU64,
    host_hits: AtomicU64,
    disk_hits: AtomicU64,
    misses: AtomicU64,
}

pub struct TieredStore {
    host: Arc<HostTier>,
    disk: Arc<DiskTier>,
    jobs: Option<Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
    counters: Arc<Counters>,
}

/// Write-back workers: a block's write ends in fsync, whose latency (not bandwidth) bounds one
/// worker, so several keep the disk busy.
const WORKERS: usize = 4;

fn work(rx: Receiver<Job>, host: Arc<HostTier>, disk: Arc<DiskTier>, c: Arc<Counters>) {
    for job in rx {
        match job {
            Job::Write(h, class, data) => match disk.put(&h, class, &data) {
                Ok(()) => c.written_back.fetch_add(1, Ordering::Relaxed),
                Err(_) => c.write_back_failed.fetch_add(1, Ordering::Relaxed),
            },
            Job::Prefetch(h) => {
                if !host.contains(&h) {
                    if let Some(d) = disk.get(&h) {
                        host.put(h, Arc::new(d));
                        c.prefetched.fetch_add(1, Ordering::Relaxed);
                    }
                }
                0
            }
            Job::Flush(barrier) => {
                barrier.wait();
                0
            }
        };
    }
}

impl TieredStore {
    /// A store over `host` and `disk` with a write-back/prefetch queue of `queue` jobs.
    pub fn new(host: HostTier, disk: DiskTier, queue: usize) -> TieredStore {
        let (host, disk) = (Arc::new(host), Arc::new(disk));
        let counters = Arc::new(Counters::default());
        let (tx, rx) = bounded(queue.max(1));
        let workers = (0..WORKERS)
            .filter_map(|i| {
                let (rx, h, d, c) = (rx.clone(), host.clone(), disk.clone(), counters.clone());
                std::thread::Builder::new().name(format!("kv-write-back-{i}")).spawn(move || work(rx, h, d, c)).ok()
            })
            .collect();
        TieredStore { host, disk, jobs: Some(tx), workers, counters }
    }

    pub fn host(&self) -> &HostTier {
        &self.host
    }

    pub fn disk(&self) -> &DiskTier {
        &self.disk
    }

    fn sender(&self) -> Result<&Sender<Job>, KvError> {
        self.jobs.as_ref().filter(|_| self.workers.iter().any(|w| !w.is_finished())).ok_or(KvError::WorkerGone)
    }

    /// Keep a block in host memory and queue its write to disk; `Busy` when the queue is full.
    pub fn spill(&self, h: BlockHash, class: CacheClass, data: Arc<Vec<u8>>) -> Result<(), KvError> {
        self.host.put(h, data.clone());
        match self.sender()?.try_send(Job::Write(h, class, data)) {
            Ok(()) => {
                self.counters.spilled.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(TrySendError::Full(_)) => Err(KvError::Busy),
            Err(TrySendError::Disconnected(_)) => Err(KvError::WorkerGone),
        }
    }

    /// As `spill`, waiting for room in the queue.
    pub fn spill_blocking(&self, h: BlockHash, class: CacheClass, data: Arc<Vec<u8>>) -> Result<(), KvError> {
        self.host.put(h, data.clone());
        self.sender()?.send(Job::Write(h, class, data)).map_err(|_| KvError::WorkerGone)?;
        self.counters.spilled.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Queue loads of `hashes` from disk into host memory; returns how many were queued.
    pub fn prefetch(&self, hashes: &[BlockHash]) -> usize {
        let Ok(tx) = self.sender() else { return 0 };
        hashes.iter().filter(|h| !self.host.contains(h)).take_while(|h| tx.try_send(Job::Prefetch(**h)).is_ok()).count()
    }

    /// The block, from host memory or disk.
    pub fn load(&self, h: &BlockHash) -> Option<Arc<Vec<u8>>> {
        if let Some(d) = self.host.get(h) {
            self.counters.host_hits.fetch_add(1, Ordering::Relaxed);
            return Some(d);
        }
        match self.disk.get(h) {
            Some(d) => {
                let d = Arc::new(d);
                self.host.put(*h, d.clone());
                self.counters.disk_hits.fetch_add(1, Ordering::Relaxed);
                Some(d)
            }
            None => {
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Wait until every job queued before this call is done.
    pub fn flush(&self) -> Result<(), KvError> {
        let tx = self.sender()?;
        let live = self.workers.iter().filter(|w| !w.is_finished()).count();
        let barrier = Arc::new(Barrier::new(live + 1));
        for _ in 0..live {
            tx.send(Job::Flush(barrier.clone())).map_err(|_| KvError::WorkerGone)?;
        }
        barrier.wait();
        Ok(())
    }

    pub fn stats(&self) -> StoreStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StoreStats {
            spilled: l(&c.spilled),
            written_back: l(&c.written_back),
            write_back_failed: l(&c.write_back_failed),
            prefetched: l(&c.prefetched),
            host_hits: l(&c.host_hits),
            disk_hits: l(&c.disk_hits),
            misses: l(&c.misses),
        }
    }
}

impl Drop for TieredStore {
    fn drop(&mut self) {
        // Closing the queue ends the worker after it drained what was queued: nothing lost.
        self.jobs.take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
