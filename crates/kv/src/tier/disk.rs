//! The durable tier: one file per block in a directory that several processes (and machines, on a
//! shared file system) may use at once.
//!
//! * Content-addressed: `<dir>/<first byte hex>/<hash hex>.kvb`. Two writers of one block write
//!   the same bytes, so whichever rename lands last is as good as the first.
//! * Atomic: written to a temporary file named after the writer's pid, fsynced, then renamed. A
//!   writer killed mid-write leaves only a temporary file, removed by the next start-up once its
//!   pid is gone.
//! * Checked: a header (magic, class, expiry, length, CRC-32 of the payload, the hash) is verified
//!   on every read; a corrupt or truncated file is dropped, counted and never served.
//! * Indexed by scanning the directory at start-up; a miss also checks the file system, so blocks
//!   other processes wrote since are found.
//! * Bounded: a byte capacity; writes beyond it first drop expired blocks, then are refused (reads
//!   go on). Retention classes give each block an expiry (agent 3 days, chat 7 days by default).

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use super::CacheClass;
use crate::error::KvError;
use crate::hash::BlockHash;

const MAGIC: &[u8; 8] = b"DIKVBLK1";
/// magic 8, class 1, pad 7, created 8, expires 8, length 8, crc 4, pad 4, hash 16.
const HEADER: usize = 64;

/// How long blocks of each class are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    pub agent: Duration,
    pub chat: Duration,
}

impl Default for Retention {
    fn default() -> Self {
        Retention { agent: Duration::from_secs(3 * 86_400), chat: Duration::from_secs(7 * 86_400) }
    }
}

impl Retention {
    fn ttl(&self, c: CacheClass) -> Duration {
        match c {
            CacheClass::Agent => self.agent,
            CacheClass::Chat => self.chat,
        }
    }
}

/// Counters of what the tier did, including what it refused or dropped.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct DiskStats {
    pub written: u64,
    pub read_hits: u64,
    pub read_misses: u64,
    pub corrupt_dropped: u64,
    pub expired_dropped: u64,
    pub refused_full: u64,
    pub stale_temp_removed: u64,
}

#[derive(Default)]
struct Counters {
    written: AtomicU64,
    read_hits: AtomicU64,
    read_misses: AtomicU64,
    corrupt_dropped: AtomicU64,
    expired_dropped: AtomicU64,
    refused_full: AtomicU64,
    stale_temp_removed: AtomicU64,
}

#[derive(Debug, Clone, Copy)]
struct FileInfo {
    bytes: u64,
    expires: u64,
}

/// Seconds since the epoch; tests inject their own clock.
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

pub struct DiskTier {
    dir: PathBuf,
    capacity: u64,
    retention: Retention,
    clock: Clock,
    index: Mutex<HashMap<BlockHash, FileInfo>>,
    used: AtomicU64,
    counters: Counters,
    nonce: AtomicU64,
}

fn system_clock() -> Clock {
    Arc::new(|| SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0))
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

struct Header {
    class: u8,
    expires: u64,
    len: u64,
    crc: u32,
    hash: [u8; 16],
}

fn encode_header(h: &BlockHash, class: CacheClass, created: u64, expires: u64, payload: &[u8]) -> [u8; HEADER] {
    let mut b = [0u8; HEADER];
    b[..8].copy_from_slice(MAGIC);
    b[8] = class.code();
    b[16..24].copy_from_slice(&created.to_le_bytes());
    b[24..32].copy_from_slice(&expires.to_le_bytes());
    b[32..40].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    b[40..44].copy_from_slice(&crc32fast::hash(payload).to_le_bytes());
    b[48..64].copy_from_slice(&h.0);
    b
}

fn decode_header(b: &[u8]) -> Option<Header> {
    if b.len() < HEADER || &b[..8] != MAGIC {
        return None;
    }
    let u = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().unwrap_or([0; 8]));
    let mut hash = [0u8; 16];
    hash.copy_from_slice(&b[48..64]);
    Some(Header {
        class: b[8],
        expires: u(24..32),
        len: u(32..40),
        crc: u32::from_le_bytes(b[40..44].try_into().ok()?),
        hash,
    })
}

impl DiskTier {
    /// Open (creating) `dir`, rebuild the index by scanning it, remove temporary files of writers
    /// that no longer run.
    pub fn open(dir: &Path, capacity_bytes: u64, retention: Retention) -> Result<DiskTier, KvError> {
        DiskTier::open_with_clock(dir, capacity_bytes, retention, system_clock())
    }

    pub fn open_with_clock(
        dir: &Path,
        capacity_bytes: u64,
        retention: Retention,
        clock: Clock,
    ) -> Result<DiskTier, KvError> {
        fs::create_dir_all(dir).map_err(|e| KvError::io(dir, e))?;
        let tier = DiskTier {
            dir: dir.to_path_buf(),
            capacity: capacity_bytes,
            retention,
            clock,
            index: Mutex::new(HashMap::new()),
            used: AtomicU64::new(0),
            counters: Counters::default(),
            nonce: AtomicU64::new(0),
        };
        tier.scan()?;
        Ok(tier)
    }

    fn path(&self, h: &BlockHash) -> PathBuf {
        let hex = h.to_hex();
        self.dir.join(&hex[..2]).join(format!("{hex}.kvb"))
    }

    fn scan(&self) -> Result<(), KvError> {
        let mut index = HashMap::new();
        let mut used = 0;
        for sub in fs::read_dir(&self.dir).map_err(|e| KvError::io(&self.dir, e))?.flatten() {
            if !sub.path().is_dir() {
                continue;
            }
            for f in fs::read_dir(sub.path()).map_err(|e| KvError::io(&sub.path(), e))?.flatten() {
                let p = f.path();
                let name = f.file_name().to_string_lossy().to_string();
                if let Some(rest) = name.strip_suffix(".tmp") {
                    // .<hash>.<pid>.<nonce>.tmp: remove when its writer is gone.
                    let pid = rest.split('.').nth(2).and_then(|s| s.parse::<u32>().ok());
                    if pid.is_none_or(|p| !pid_alive(p)) && fs::remove_file(&p).is_ok() {
                        self.counters.stale_temp_removed.fetch_add(1, Ordering::Relaxed);
                    }
                    continue;
                }
                let Some(h) = name.strip_suffix(".kvb").and_then(BlockHash::from_hex) else { continue };
                let mut head = [0u8; HEADER];
                let ok = File::open(&p).and_then(|mut fh| fh.read_exact(&mut head)).is_ok();
                let size = f.metadata().map(|m| m.len()).unwrap_or(0);
                match decode_header(&head).filter(|hd| ok && hd.hash == h.0 && hd.len + HEADER as u64 == size) {
                    Some(hd) => {
                        used += size;
                        index.insert(h, FileInfo { bytes: size, expires: hd.expires });
                    }
                    None => self.drop_corrupt(&p),
                }
            }
        }
        *self.index.lock() = index;
        self.used.store(used, Ordering::Relaxed);
        Ok(())
    }

    fn drop_corrupt(&self, p: &Path) {
        let _ = fs::remove_file(p);
        self.counters.corrupt_dropped.fetch_add(1, Ordering::Relaxed);
    }

    pub fn stats(&self) -> DiskStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DiskStats {
            written: l(&c.written),
            read_hits: l(&c.read_hits),
            read_misses: l(&c.read_misses),
            corrupt_dropped: l(&c.corrupt_dropped),
            expired_dropped: l(&c.expired_dropped),
            refused_full: l(&c.refused_full),
            stale_temp_removed: l(&c.stale_temp_removed),
        }
    }

    pub fn used_bytes(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    pub fn len(&self) -> usize {
        self.index.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `h` is stored (this process's index, or a file another process wrote).
    pub fn contains(&self, h: &BlockHash) -> bool {
        self.index.lock().contains_key(h) || self.path(h).is_file()
    }

    /// Store `payload` under `h` for `class`'s retention. Content-addressed: an existing block
    /// is kept. Refused with [`KvError::TierFull`] beyond the capacity (after dropping expired
    /// blocks), leaving no partial file.
    pub fn put(&self, h: &BlockHash, class: CacheClass, payload: &[u8]) -> Result<(), KvError> {
        if self.index.lock().contains_key(h) {
            return Ok(());
        }
        let size = (HEADER + payload.len()) as u64;
        if self.used_bytes() + size > self.capacity {
            self.sweep_expired();
            if self.used_bytes() + size > self.capacity {
                self.counters.refused_full.fetch_add(1, Ordering::Relaxed);
                return Err(KvError::TierFull { tier: "disk", needed: size, capacity: self.capacity });
            }
        }
        let now = (self.clock)();
        let expires = now + self.retention.ttl(class).as_secs();
        let path = self.path(h);
        let parent = path.parent().unwrap_or(&self.dir).to_path_buf();
        fs::create_dir_all(&parent).map_err(|e| KvError::io(&parent, e))?;
        let tmp = parent.join(format!(
            ".{}.{}.{}.tmp",
            h.to_hex(),
            std::process::id(),
            self.nonce.fetch_add(1, Ordering::Relaxed)
        ));
        let write = || -> std::io::Result<()> {
            let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
            f.write_all(&encode_header(h, class, now, expires, payload))?;
            f.write_all(payload)?;
            f.sync_all()?;
            fs::rename(&tmp, &path)?;
            // Make the rename itself durable.
            File::open(&parent)?.sync_all()
        };
        if let Err(e) = write() {
            let _ = fs::remove_file(&tmp);
            if e.raw_os_error() == Some(28) {
                // ENOSPC: the file system is full, whatever our own cap says.
                self.counters.refused_full.fetch_add(1, Ordering::Relaxed);
                return Err(KvError::TierFull { tier: "disk", needed: size, capacity: self.capacity });
            }
            return Err(KvError::io(&path, e));
        }
        self.index.lock().insert(*h, FileInfo { bytes: size, expires });
        self.used.fetch_add(size, Ordering::Relaxed);
        self.counters.written.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The payload under `h`, verified; `None` when absent, expired or corrupt (dropped).
    pub fn get(&self, h: &BlockHash) -> Option<Vec<u8>> {
        let path = self.path(h);
        let Ok(mut f) = File::open(&path) else {
            self.forget(h);
            self.counters.read_misses.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        // Header first, then the payload straight into its own buffer (one copy).
        let size = f.metadata().map(|m| m.len()).unwrap_or(0);
        let mut head = [0u8; HEADER];
        let read = |f: &mut File, head: &mut [u8; HEADER]| -> Option<(Header, Vec<u8>)> {
            f.read_exact(head).ok()?;
            let hd = decode_header(head)?;
            if hd.hash != h.0 || hd.len + HEADER as u64 != size || CacheClass::from_code(hd.class).is_none() {
                return None;
            }
            let mut payload = vec![0u8; hd.len as usize];
            f.read_exact(&mut payload).ok()?;
            (crc32fast::hash(&payload) == hd.crc).then_some((hd, payload))
        };
        let Some((hd, payload)) = read(&mut f, &mut head) else {
            self.forget(h);
            self.drop_corrupt(&path);
            return None;
        };
        if hd.expires <= (self.clock)() {
            self.forget(h);
            if fs::remove_file(&path).is_ok() {
                self.counters.expired_dropped.fetch_add(1, Ordering::Relaxed);
            }
            return None;
        }
        if !self.index.lock().contains_key(h) {
            // Written by another process since our scan.
            self.index.lock().insert(*h, FileInfo { bytes: size, expires: hd.expires });
            self.used.fetch_add(size, Ordering::Relaxed);
        }
        self.counters.read_hits.fetch_add(1, Ordering::Relaxed);
        Some(payload)
    }

    fn forget(&self, h: &BlockHash) {
        if let Some(info) = self.index.lock().remove(h) {
            self.used.fetch_sub(info.bytes, Ordering::Relaxed);
        }
    }

    /// Remove every expired block; returns how many.
    pub fn sweep_expired(&self) -> usize {
        let now = (self.clock)();
        let expired: Vec<BlockHash> =
            self.index.lock().iter().filter(|(_, i)| i.expires <= now).map(|(h, _)| *h).collect();
        for h in &expired {
            self.forget(h);
            if fs::remove_file(self.path(h)).is_ok() {
                self.counters.expired_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
        expired.len()
    }
}
