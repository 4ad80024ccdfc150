//! Host <-> disk tier throughput next to a plain sequential file copy of the same bytes, measured
//! in the same run on the same file system (the floor of what the disk gives us). Prints a table;
//! writes JSON to $DEEPINFER_BENCH_JSON when set. Size: $KV_BENCH_MB (default 512) MB in 4 MiB blocks.

use std::sync::Arc;
use std::time::Instant;

use deepinfer_kv::tier::{CacheClass, DiskTier, HostTier, Retention, TieredStore};
use deepinfer_kv::BlockHash;

fn main() {
    let mb: usize = std::env::var("KV_BENCH_MB").ok().and_then(|s| s.parse().ok()).unwrap_or(512);
    let block = 4 << 20;
    let n = (mb << 20) / block;
    let root = std::env::temp_dir().join(format!("deepinfer-kv-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let blocks: Vec<Arc<Vec<u8>>> =
        (0..n).map(|i| Arc::new((0..block).map(|j| ((i * 31 + j * 7) % 251) as u8).collect())).collect();
    let total = (n * block) as f64;

    // Plain sequential copy: write one file of the same size, fsync, copy it, fsync.
    let src = root.join("plain.bin");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&src).unwrap();
        for b in &blocks {
            f.write_all(b).unwrap();
        }
        f.sync_all().unwrap();
    }
    let t = Instant::now();
    std::fs::copy(&src, root.join("plain.copy")).unwrap();
    std::fs::File::open(root.join("plain.copy")).unwrap().sync_all().unwrap();
    let copy_s = t.elapsed().as_secs_f64();

    let disk = DiskTier::open(&root.join("tier"), u64::MAX, Retention::default()).unwrap();
    let store = TieredStore::new(HostTier::new(u64::MAX), disk, 64);
    let hashes: Vec<BlockHash> = (0..n as u64).map(BlockHash::from_external).collect();
    let t = Instant::now();
    for (h, b) in hashes.iter().zip(&blocks) {
        store.spill_blocking(*h, CacheClass::Chat, b.clone()).unwrap();
    }
    store.flush().unwrap();
    let write_s = t.elapsed().as_secs_f64();
    // Read back from disk (a fresh store: empty host tier), verifying every checksum.
    drop(store);
    let disk = DiskTier::open(&root.join("tier"), u64::MAX, Retention::default()).unwrap();
    let t = Instant::now();
    let mut read = 0usize;
    for h in &hashes {
        read += disk.get(h).map_or(0, |d| d.len());
    }
    let read_s = t.elapsed().as_secs_f64();
    assert_eq!(read, n * block, "every block read back");
    let gbps = |s: f64| total / s / 1e9;
    println!("tier throughput, {mb} MB in {n} blocks of 4 MiB, dir {}", root.display());
    println!("  plain sequential copy (read+write, fsync): {:.2} GB/s", gbps(copy_s));
    println!(
        "  host -> disk write-back (checksum, fsync, rename): {:.2} GB/s ({:.2} of the copy)",
        gbps(write_s),
        copy_s / write_s
    );
    println!("  disk -> host read (verify checksum): {:.2} GB/s", gbps(read_s));
    if let Some(p) = std::env::var_os("DEEPINFER_BENCH_JSON") {
        let doc = serde_json::json!({"bytes": total, "block_bytes": block, "plain_copy_gb_s": gbps(copy_s),
            "write_back_gb_s": gbps(write_s), "read_gb_s": gbps(read_s), "write_back_over_copy": copy_s / write_s});
        std::fs::write(p, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    }
    let _ = std::fs::remove_dir_all(&root);
}
