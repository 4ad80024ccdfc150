//! Chained block hashes: the identity of a block of tokens *and everything before it*.
//!
//! h_0 = H(keys), h_i = H(h_{i−1} ‖ tokens of block i), where `keys` covers the model, the prompt
//! encoding and an optional cache salt, so different models or tenants never share a block. H is
//! SHA-256 truncated to 128 bits: blocks live for days in a shared, content-addressed store that
//! any worker may read, where a collision would serve one request another's KV.

use sha2::{Digest, Sha256};

/// A 128-bit chained block hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 16]);

impl BlockHash {
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(s: &str) -> Option<BlockHash> {
        if s.len() != 32 {
            return None;
        }
        let mut out = [0u8; 16];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(BlockHash(out))
    }

    /// An externally supplied block id (e.g. a trace's `hash_ids`), as a hash.
    pub fn from_external(id: u64) -> BlockHash {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&id.to_le_bytes());
        out[8..].copy_from_slice(b"external");
        BlockHash(out)
    }
}

/// What besides the tokens decides whether KV can be shared.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExtraKeys {
    pub model: String,
    pub encoding: String,
    pub cache_salt: Option<String>,
}

fn digest(parts: &[&[u8]]) -> BlockHash {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    let d = h.finalize();
    let mut out = [0u8; 16];
    out.copy_from_slice(&d[..16]);
    BlockHash(out)
}

/// The chained hashes of the full blocks of `tokens` (a trailing partial block has none).
/// Extend `hashes` (the chained hashes of the first `hashes.len()` full blocks of `tokens`) with
/// the hashes of every further full block of `tokens`: a growing sequence hashes each block once.
pub fn extend_block_hashes(hashes: &mut Vec<BlockHash>, tokens: &[u32], block_tokens: usize, keys: &ExtraKeys) {
    let bt = block_tokens.max(1);
    let done = hashes.len();
    if tokens.len() / bt <= done {
        return;
    }
    let salt = keys.cache_salt.as_deref().unwrap_or("");
    let mut prev = match hashes.last() {
        Some(h) => *h,
        None => digest(&[b"deepinfer-kv-v1", keys.model.as_bytes(), keys.encoding.as_bytes(), salt.as_bytes()]),
    };
    let mut bytes = Vec::with_capacity(bt * 4);
    for block in tokens[done * bt..].chunks_exact(bt) {
        bytes.clear();
        block.iter().for_each(|t| bytes.extend_from_slice(&t.to_le_bytes()));
        prev = digest(&[&prev.0, &bytes]);
        hashes.push(prev);
    }
}

pub fn block_hashes(tokens: &[u32], block_tokens: usize, keys: &ExtraKeys) -> Vec<BlockHash> {
    let salt = keys.cache_salt.as_deref().unwrap_or("");
    let mut prev = digest(&[b"deepinfer-kv-v1", keys.model.as_bytes(), keys.encoding.as_bytes(), salt.as_bytes()]);
    let mut bytes = Vec::with_capacity(block_tokens * 4);
    tokens
        .chunks_exact(block_tokens.max(1))
        .map(|block| {
            bytes.clear();
            block.iter().for_each(|t| bytes.extend_from_slice(&t.to_le_bytes()));
            prev = digest(&[&prev.0, &bytes]);
            prev
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extending_equals_hashing_at_once() {
        let keys = ExtraKeys { model: "m".into(), encoding: "e".into(), cache_salt: Some("s".into()) };
        let tokens: Vec<u32> = (0..1000).map(|i| i * 7 % 311).collect();
        let mut h = Vec::new();
        for end in [0, 5, 64, 65, 300, 1000] {
            extend_block_hashes(&mut h, &tokens[..end], 16, &keys);
            assert_eq!(h, block_hashes(&tokens[..end], 16, &keys));
        }
    }

    #[test]
    fn a_hash_covers_the_whole_prefix_and_the_keys() {
        let k = ExtraKeys { model: "m".into(), encoding: "v4".into(), cache_salt: None };
        let a = block_hashes(&[1, 2, 3, 4, 5, 6], 2, &k);
        let b = block_hashes(&[9, 2, 3, 4, 5, 6], 2, &k);
        assert_eq!(a.len(), 3);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y), "a change in block 0 changes every later hash");
        assert_eq!(block_hashes(&[1, 2, 3, 4, 5], 2, &k), a[..2], "the partial block has no hash");
        let salted = ExtraKeys { cache_salt: Some("tenant".into()), ..k.clone() };
        assert_ne!(block_hashes(&[1, 2], 2, &salted), a[..1]);
        assert_eq!(BlockHash::from_hex(&a[0].to_hex()), Some(a[0]));
    }
}
