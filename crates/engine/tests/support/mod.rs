//! Test support: the library's random checkpoints (`deepinfer_engine::tiny`) plus temp dirs.

#![allow(dead_code, unused_imports)]

use std::path::PathBuf;

pub use deepinfer_engine::tiny::*;
use serde_json::Value;

/// A unique empty directory under the system temp dir.
pub fn temp_dir(tag: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let d = std::env::temp_dir().join(format!("deepinfer-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A random model directory for `c`.
pub fn random_model_dir(tag: &str, c: &Value, seed: u64, shards: usize) -> PathBuf {
    let dir = temp_dir(tag);
    write_model(&dir, c, seed, shards).unwrap();
    dir
}
