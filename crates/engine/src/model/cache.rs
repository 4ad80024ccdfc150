//! A sequence's shareable cache state cut into blocks (the prefix cache's payload) and a state
//! rebuilt from such blocks. A block of `block_tokens` tokens holds, for every CSA/HCA layer in
//! order, its `block_tokens / ratio` compressed rows, then (CSA) as many indexer keys, as
//! little-endian f32. The non-shareable state (window rings, open compressor windows, CSA overlap)
//! is never stored: the engine rebuilds it by replaying tokens before the first uncached one
//! (`deepinfer_kv::replay`).

use deepinfer_kv::{block_hashes, ExtraKeys, KvError, KvLayout};

use super::attention::AttentionState;
use super::compressor::CompressorState;
use super::{Model, ModelError, SequenceState};

const F32: usize = 4;

fn push_rows(out: &mut Vec<u8>, rows: &[f32]) {
    out.reserve(rows.len() * F32);
    for v in rows {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

fn read_rows(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes.chunks_exact(F32).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

impl Model {
    /// The cache geometry of this model with f32 rows (the CPU backend's element type).
    pub fn kv_layout(&self, block_tokens: usize) -> Result<KvLayout, KvError> {
        self.cfg.kv_layout(block_tokens, F32)
    }

    /// A stable identity of the configuration and weights (SHA-256 over the configuration and a
    /// sample of every block's weights): the prefix cache's keys include it, so blocks of another
    /// model (or another random seed) are never served.
    pub fn fingerprint(&self) -> String {
        let mut bits: Vec<u32> = Vec::new();
        let mut sample = |w: &[f32]| bits.extend(w.iter().step_by(w.len() / 64 + 1).map(|v| v.to_bits()));
        sample(&self.embed);
        sample(&self.head.w);
        for b in &self.blocks {
            sample(&b.attn.wq_a.w);
            sample(&b.attn.wkv.w);
            sample(&b.moe.gate.w);
        }
        let keys = ExtraKeys { model: format!("{:?}", self.cfg), encoding: "weights".into(), cache_salt: None };
        block_hashes(&bits, bits.len().max(1), &keys).last().map(|h| h.to_hex()).unwrap_or_default()
    }

    /// The smallest block size that is a multiple of every compress ratio and at least `min`.
    pub fn block_tokens_at_least(&self, min: usize) -> usize {
        self.cfg.block_tokens_at_least(min)
    }

    /// Tokens a replay must recompute after a block-aligned restore (`ModelConfig::exact_replay_tokens`).
    pub fn exact_replay_tokens(&self) -> usize {
        self.cfg.exact_replay_tokens()
    }

    /// The payload of block `block` (tokens block·bt .. (block+1)·bt) of a state that has computed
    /// at least those tokens.
    pub fn block_payload(&self, st: &SequenceState, block: usize, block_tokens: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for (blk, ls) in self.blocks.iter().zip(&st.layers) {
            let Some(c) = &blk.attn.compressor else { continue };
            let per = block_tokens / c.ratio;
            let hd = c.width;
            push_rows(&mut out, &ls.compressor.rows[block * per * hd..(block + 1) * per * hd]);
            if let Some(ix) = &blk.attn.indexer {
                let w = ix.head_dim;
                push_rows(&mut out, &ls.indexer.rows[block * per * w..(block + 1) * per * w]);
            }
        }
        out
    }

    /// A state holding the compressed rows of `blocks` (consecutive blocks from the sequence's
    /// start) whose next token is `replay_from`: the caller replays tokens replay_from.. to
    /// rebuild the window rings and open compressor windows. `replay_from` must be a multiple of
    /// every compress ratio.
    pub fn restore_state(
        &self,
        blocks: &[&[u8]],
        block_tokens: usize,
        replay_from: usize,
    ) -> Result<SequenceState, ModelError> {
        let bad = |problem: String| ModelError::Input { field: "cached blocks", problem };
        let expect = self.kv_layout(block_tokens).map_err(|e| bad(e.to_string()))?.block_bytes();
        if let Some((i, b)) = blocks.iter().enumerate().find(|(_, b)| b.len() != expect) {
            return Err(bad(format!("block {i} has {} bytes, the layout needs {expect}", b.len())));
        }
        if replay_from > blocks.len() * block_tokens {
            return Err(bad(format!(
                "replay from {replay_from} is past the {} cached tokens",
                blocks.len() * block_tokens
            )));
        }
        let mut layers = vec![AttentionState::default(); self.blocks.len()];
        let mut offset = 0;
        for (blk, ls) in self.blocks.iter().zip(layers.iter_mut()) {
            let Some(c) = &blk.attn.compressor else { continue };
            if !replay_from.is_multiple_of(c.ratio) {
                return Err(bad(format!("replay start {replay_from} is not a multiple of ratio {}", c.ratio)));
            }
            let per = block_tokens / c.ratio;
            let (rb, ib) = (per * c.width * F32, blk.attn.indexer.as_ref().map_or(0, |ix| per * ix.head_dim * F32));
            let mut rows = Vec::with_capacity(blocks.len() * rb / F32);
            let mut keys = Vec::with_capacity(blocks.len() * ib / F32);
            for b in blocks {
                rows.extend(read_rows(&b[offset..offset + rb]));
                keys.extend(read_rows(&b[offset + rb..offset + rb + ib]));
            }
            offset += rb + ib;
            let count = blocks.len() * per;
            ls.compressor = CompressorState::restored(rows, count, replay_from / c.ratio);
            if blk.attn.indexer.is_some() {
                ls.indexer = CompressorState::restored(keys, count, replay_from / c.ratio);
            }
        }
        Ok(SequenceState { len: replay_from, layers })
    }
}
