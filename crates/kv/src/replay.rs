//! Bounded replay (DESIGN.md, MODEL_V4.md §11, §13): the non-shareable state of a sequence
//! (sliding-window rings, compressor partial buffers and CSA overlap) is never stored. After a
//! prefix hit of `hit` tokens the engine recomputes the last few cached tokens to rebuild it; this
//! says which.

use crate::layout::KvLayout;

/// Which cached tokens to recompute after a prefix hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayPlan {
    /// Tokens whose shareable state (compressed rows, indexer keys) is reused from the cache.
    pub reused_tokens: usize,
    /// First token to recompute; tokens replay_from..reused_tokens rebuild the per-sequence state.
    pub replay_from: usize,
}

impl ReplayPlan {
    pub fn replay_tokens(&self) -> usize {
        self.reused_tokens - self.replay_from
    }
}

/// Plan for a hit of `hit` tokens (a multiple of the block size) on a prompt of `prompt` tokens.
/// The last prompt token is always computed (its logits start decoding), so a full hit gives back
/// its last block. `keep` overrides the replay length (DeepInfer's
/// `DEEPINFER_YOCO_PREFILL_TRUNCATION_KEEP_TOKENS`), never below what the state needs.
pub fn plan(layout: &KvLayout, hit: usize, prompt: usize, keep: Option<usize>) -> ReplayPlan {
    let bt = layout.block_tokens;
    let mut reused = hit.min(prompt) / bt * bt;
    if reused >= prompt && reused > 0 {
        reused -= bt;
    }
    // The window ring holds the last window − 1 raw rows; each compressor its open window
    // (reused mod ratio tokens) and, when overlapping, the previous full window.
    let mut need = layout.window.saturating_sub(1);
    for l in layout.layers.iter().filter(|l| l.ratio > 0) {
        let open = reused % l.ratio;
        let prev = if l.overlap && reused - open >= l.ratio { l.ratio } else { 0 };
        need = need.max(open + prev);
    }
    let need = keep.map_or(need, |k| k.max(need)).min(reused);
    // Compressors count windows from the replay's first token: start it on a window boundary of
    // every layer (block sizes are multiples of every ratio, so this stays within the hit).
    let align = layout.layers.iter().filter(|l| l.ratio > 0).fold(1, |a, l| lcm(a, l.ratio));
    ReplayPlan { reused_tokens: reused, replay_from: (reused - need) / align * align }
}

fn lcm(a: usize, b: usize) -> usize {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a / x * b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::LayerGeometry;

    fn layout(block: usize, window: usize) -> KvLayout {
        let csa = LayerGeometry {
            ratio: 4,
            overlap: true,
            row_bytes: 8,
            indexer_row_bytes: 4,
            window_row_bytes: 8,
            partial_token_bytes: 8,
            indexer_partial_token_bytes: 4,
        };
        let hca = LayerGeometry { ratio: 128, overlap: false, row_bytes: 8, ..csa };
        KvLayout::new(block, window, vec![csa, hca]).unwrap()
    }

    #[test]
    fn flash_replays_the_window_after_a_block_aligned_hit() {
        // 127 tokens of window, started on the HCA window boundary below: 128 tokens.
        let p = plan(&layout(512, 128), 4096, 10_000, None);
        assert_eq!(p, ReplayPlan { reused_tokens: 4096, replay_from: 4096 - 128 });
    }

    #[test]
    fn a_full_hit_keeps_the_last_block_for_computing() {
        let p = plan(&layout(512, 128), 1024, 1024, None);
        assert_eq!(p.reused_tokens, 512);
        assert_eq!(plan(&layout(512, 128), 512, 512, None).reused_tokens, 0);
    }

    #[test]
    fn replay_covers_compressor_state_when_it_exceeds_the_window() {
        // Window 2 (ring of 1 row); block 128 aligned on HCA; CSA overlap needs 4 tokens.
        let p = plan(&layout(128, 2), 256, 1000, None);
        assert_eq!(p.replay_tokens(), 128, "4 tokens, aligned down to the HCA window of 128");
        assert_eq!(plan(&layout(128, 2), 256, 1000, Some(200)).replay_tokens(), 256);
        assert_eq!(plan(&layout(128, 2), 1024, 2000, Some(200)).replay_tokens(), 256);
    }
}
