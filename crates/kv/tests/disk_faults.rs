//! The durable tier under faults, with real processes and files: a writer killed with SIGKILL
//! mid-write, a full tier, corrupted and truncated files, expiry, several processes on one
//! directory, and back-pressure of the write-back queue.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use deepinfer_kv::tier::{CacheClass, DiskTier, HostTier, Retention, TieredStore};
use deepinfer_kv::{BlockHash, KvError};

fn dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("deepinfer-kv-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Deterministic payload of block `i` (so any reader can check what it got).
fn payload(i: u64, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i.wrapping_mul(131).wrapping_add(j as u64 * 7) % 251) as u8).collect()
}

const CHILD_ENV: &str = "DEEPINFER_KV_WRITER_DIR";

/// Child half of `sigkill_mid_write_never_serves_a_corrupt_block`: when started by it (the env
/// var names a directory), write 2 MiB blocks forever; otherwise do nothing.
#[test]
fn writer_child() {
    let Some(d) = std::env::var_os(CHILD_ENV) else { return };
    let tier = DiskTier::open(Path::new(&d), u64::MAX, Retention::default()).unwrap();
    for i in 0.. {
        tier.put(&BlockHash::from_external(i), CacheClass::Chat, &payload(i, 2 << 20)).unwrap();
    }
}

#[test]
fn sigkill_mid_write_never_serves_a_corrupt_block() {
    let d = dir("sigkill");
    for round in 0..3u64 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "writer_child", "--nocapture", "--test-threads", "1"])
            .env(CHILD_ENV, &d)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(150 + 70 * round));
        child.kill().unwrap(); // SIGKILL on Unix
        child.wait().unwrap();
        // Restart: the index is rebuilt from the directory; the dead writer's temp file goes.
        let tier = DiskTier::open(&d, u64::MAX, Retention::default()).unwrap();
        let leftovers = walk(&d).into_iter().filter(|p| p.to_string_lossy().ends_with(".tmp")).count();
        assert_eq!(leftovers, 0, "temp files of the killed writer are removed at start-up");
        let n = tier.len();
        assert!(n > 0, "round {round}: the writer stored something before it was killed");
        for i in 0..(n as u64 + 64) {
            if let Some(got) = tier.get(&BlockHash::from_external(i)) {
                assert_eq!(got, payload(i, 2 << 20), "block {i} is intact");
            }
        }
        assert_eq!(tier.stats().corrupt_dropped, 0);
    }
    let _ = std::fs::remove_dir_all(&d);
}

fn walk(d: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
        if e.path().is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path());
        }
    }
    out
}

#[test]
fn full_tier_refuses_writes_and_keeps_serving_reads() {
    let d = dir("full");
    let tier = DiskTier::open(&d, 3 * 4096 + 3 * 64, Retention::default()).unwrap();
    for i in 0..3 {
        tier.put(&BlockHash::from_external(i), CacheClass::Chat, &payload(i, 4096)).unwrap();
    }
    let e = tier.put(&BlockHash::from_external(9), CacheClass::Chat, &payload(9, 4096)).unwrap_err();
    assert!(matches!(e, KvError::TierFull { tier: "disk", .. }), "{e}");
    assert_eq!(tier.stats().refused_full, 1);
    assert!(walk(&d).iter().all(|p| !p.to_string_lossy().ends_with(".tmp")), "no partial file left");
    for i in 0..3 {
        assert_eq!(tier.get(&BlockHash::from_external(i)), Some(payload(i, 4096)));
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn corrupted_and_truncated_files_are_detected_dropped_and_counted() {
    let d = dir("corrupt");
    let tier = DiskTier::open(&d, u64::MAX, Retention::default()).unwrap();
    for i in 0..4 {
        tier.put(&BlockHash::from_external(i), CacheClass::Agent, &payload(i, 1000)).unwrap();
    }
    let file = |i: u64| {
        let hex = BlockHash::from_external(i).to_hex();
        d.join(&hex[..2]).join(format!("{hex}.kvb"))
    };
    // Flip a payload byte of block 0; truncate block 1; garbage header on block 2.
    let mut b = std::fs::read(file(0)).unwrap();
    let last = b.len() - 1;
    b[last] ^= 0xff;
    std::fs::write(file(0), b).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(file(1)).unwrap();
    f.set_len(500).unwrap();
    std::fs::write(file(2), b"not a block").unwrap();
    assert_eq!(tier.get(&BlockHash::from_external(0)), None);
    assert_eq!(tier.get(&BlockHash::from_external(1)), None);
    assert_eq!(tier.stats().corrupt_dropped, 2);
    assert!(!file(0).exists() && !file(1).exists(), "corrupt files are removed");
    // A restart finds block 2's garbage by scanning.
    let tier = DiskTier::open(&d, u64::MAX, Retention::default()).unwrap();
    assert_eq!(tier.stats().corrupt_dropped, 1);
    assert_eq!(tier.get(&BlockHash::from_external(3)), Some(payload(3, 1000)));
    assert_eq!(tier.len(), 1);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn retention_classes_expire_on_time() {
    let d = dir("ttl");
    let now = Arc::new(AtomicU64::new(1_000_000));
    let clock = {
        let n = now.clone();
        Arc::new(move || n.load(Ordering::SeqCst))
    };
    let tier = DiskTier::open_with_clock(&d, u64::MAX, Retention::default(), clock).unwrap();
    let (agent, chat) = (BlockHash::from_external(1), BlockHash::from_external(2));
    tier.put(&agent, CacheClass::Agent, &payload(1, 100)).unwrap();
    tier.put(&chat, CacheClass::Chat, &payload(2, 100)).unwrap();
    now.fetch_add(3 * 86_400 - 1, Ordering::SeqCst);
    assert!(tier.get(&agent).is_some(), "agent blocks live 3 days");
    now.fetch_add(2, Ordering::SeqCst);
    assert!(tier.get(&agent).is_none(), "and no longer");
    assert!(tier.get(&chat).is_some(), "chat blocks live 7 days");
    now.fetch_add(4 * 86_400, Ordering::SeqCst);
    assert_eq!(tier.sweep_expired(), 1);
    assert!(tier.is_empty());
    assert_eq!(tier.stats().expired_dropped, 2);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn processes_sharing_a_directory_see_each_others_blocks() {
    let d = dir("shared");
    let a = DiskTier::open(&d, u64::MAX, Retention::default()).unwrap();
    let b = DiskTier::open(&d, u64::MAX, Retention::default()).unwrap();
    let h = BlockHash::from_external(42);
    a.put(&h, CacheClass::Chat, &payload(42, 3000)).unwrap();
    assert!(b.contains(&h), "found on the file system after b's own scan");
    assert_eq!(b.get(&h), Some(payload(42, 3000)));
    b.put(&h, CacheClass::Chat, &payload(42, 3000)).unwrap(); // content-addressed: idempotent
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn write_back_applies_back_pressure_and_loses_nothing() {
    let d = dir("backpressure");
    let store =
        TieredStore::new(HostTier::new(1 << 30), DiskTier::open(&d, u64::MAX, Retention::default()).unwrap(), 1);
    let (mut busy, mut queued) = (0, Vec::new());
    let t = Instant::now();
    for i in 0..200u64 {
        let h = BlockHash::from_external(i);
        match store.spill(h, CacheClass::Chat, Arc::new(payload(i, 256 << 10))) {
            Ok(()) => queued.push(i),
            Err(KvError::Busy) => busy += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(busy > 0, "a one-job queue behind fsync'd writes must push back ({:?})", t.elapsed());
    store.flush().unwrap();
    assert_eq!(store.stats().written_back as usize, queued.len());
    drop(store);
    let disk = DiskTier::open(&d, u64::MAX, Retention::default()).unwrap();
    for i in queued {
        assert_eq!(disk.get(&BlockHash::from_external(i)), Some(payload(i, 256 << 10)));
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn prefetch_brings_blocks_to_host_memory() {
    let d = dir("prefetch");
    {
        let disk = DiskTier::open(&d, u64::MAX, Retention::default()).unwrap();
        for i in 0..5 {
            disk.put(&BlockHash::from_external(i), CacheClass::Chat, &payload(i, 512)).unwrap();
        }
    }
    let store =
        TieredStore::new(HostTier::new(1 << 20), DiskTier::open(&d, u64::MAX, Retention::default()).unwrap(), 16);
    let hs: Vec<BlockHash> = (0..5).map(BlockHash::from_external).collect();
    assert_eq!(store.prefetch(&hs), 5);
    store.flush().unwrap();
    assert_eq!(store.host().len(), 5);
    assert_eq!(store.load(&hs[3]).as_deref(), Some(&payload(3, 512)));
    assert_eq!(store.stats().host_hits, 1);
    let _ = std::fs::remove_dir_all(&d);
}
