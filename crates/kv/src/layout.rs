//! How much memory a DeepSeek-V4 sequence needs, from model metadata (MODEL_V4.md §11).
//!
//! Shareable, paged state (per block of `block_tokens` tokens): the compressed KV rows of every
//! CSA/HCA layer (block_tokens / ratio rows) and the indexer keys of CSA layers. Non-shareable
//! state (one slot per sequence): every layer's sliding-window ring (window − 1 raw rows) and the
//! compressors' partial buffers (the open window's values and gates, and CSA's previous-window
//! overlap). A block boundary must fall on a window boundary of every compressor, so that a cached
//! block holds whole rows.

use crate::error::KvError;

/// One layer's cache geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerGeometry {
    /// 0 (sliding only), 4 (CSA, overlapping, with indexer) or 128 (HCA) in V4-Flash.
    pub ratio: usize,
    /// Whether the compressor pools two windows (CSA and the indexer).
    pub overlap: bool,
    /// Bytes of one compressed row (head_dim x element size); 0 for sliding layers.
    pub row_bytes: usize,
    /// Bytes of one indexer key row; 0 without an indexer.
    pub indexer_row_bytes: usize,
    /// Bytes of one raw window row (head_dim x element size).
    pub window_row_bytes: usize,
    /// Bytes of one token's compressor input (values + gates, both series); 0 for sliding.
    pub partial_token_bytes: usize,
    /// Same for the indexer's compressor.
    pub indexer_partial_token_bytes: usize,
}

/// Cache geometry of a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayout {
    pub block_tokens: usize,
    pub window: usize,
    pub layers: Vec<LayerGeometry>,
}

impl KvLayout {
    pub fn new(block_tokens: usize, window: usize, layers: Vec<LayerGeometry>) -> Result<KvLayout, KvError> {
        if block_tokens == 0 {
            return Err(KvError::Invalid { field: "block_tokens", problem: "must be positive".into() });
        }
        for (i, l) in layers.iter().enumerate() {
            if l.ratio > 0 && !block_tokens.is_multiple_of(l.ratio) {
                return Err(KvError::Invalid {
                    field: "block_tokens",
                    problem: format!("{block_tokens} is not a multiple of layer {i}'s compress ratio {}", l.ratio),
                });
            }
        }
        Ok(KvLayout { block_tokens, window, layers })
    }

    /// Bytes of one paged block: compressed rows and indexer keys of every layer.
    pub fn block_bytes(&self) -> usize {
        self.layers
            .iter()
            .filter(|l| l.ratio > 0)
            .map(|l| self.block_tokens / l.ratio * (l.row_bytes + l.indexer_row_bytes))
            .sum()
    }

    /// Bytes of one sequence's state slot: window rings and compressor partial buffers.
    pub fn slot_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                let ring = (self.window.saturating_sub(1)) * l.window_row_bytes;
                // Open window (< ratio tokens) plus, when overlapping, the previous window's half.
                let open = l.ratio.saturating_sub(1) * (l.partial_token_bytes + l.indexer_partial_token_bytes);
                let prev =
                    if l.overlap { l.ratio * (l.partial_token_bytes + l.indexer_partial_token_bytes) / 2 } else { 0 };
                ring + open + prev
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// V4-Flash in bf16: 2 SWA + 21 CSA + 20 HCA layers, head 512, indexer 128.
    pub(crate) fn flash_bf16() -> KvLayout {
        let (hd, ihd, d2) = (512, 128, 2);
        let swa = LayerGeometry {
            ratio: 0,
            overlap: false,
            row_bytes: 0,
            indexer_row_bytes: 0,
            window_row_bytes: hd * d2,
            partial_token_bytes: 0,
            indexer_partial_token_bytes: 0,
        };
        let csa = LayerGeometry {
            ratio: 4,
            overlap: true,
            row_bytes: hd * d2,
            indexer_row_bytes: ihd * d2,
            window_row_bytes: hd * d2,
            partial_token_bytes: 4 * hd * 4,
            indexer_partial_token_bytes: 4 * ihd * 4,
        };
        let hca = LayerGeometry {
            ratio: 128,
            overlap: false,
            row_bytes: hd * d2,
            indexer_row_bytes: 0,
            window_row_bytes: hd * d2,
            partial_token_bytes: 2 * hd * 4,
            indexer_partial_token_bytes: 0,
        };
        let mut layers = vec![swa, swa];
        for i in 0..41 {
            layers.push(if i % 2 == 0 { csa } else { hca });
        }
        KvLayout::new(512, 128, layers).unwrap()
    }

    #[test]
    fn flash_block_matches_the_per_token_growth_of_model_v4() {
        // MODEL_V4.md §11: bf16 storage grows by 6720 + 160 = 6880 bytes per token.
        let l = flash_bf16();
        assert_eq!(l.block_bytes(), 512 * (21 * 320 + 20 * 8));
    }

    #[test]
    fn blocks_must_align_with_every_compressor() {
        let mut l = flash_bf16();
        l.block_tokens = 100;
        assert!(KvLayout::new(100, 128, l.layers).is_err());
    }
}
