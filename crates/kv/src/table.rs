//! A sequence's block table: the blocks holding its paged KV state, in token order.

use crate::error::KvError;
use crate::pool::{BlockPool, BlockRef};

#[derive(Debug)]
pub struct BlockTable {
    blocks: Vec<BlockRef>,
    tokens: usize,
    block_tokens: usize,
}

impl BlockTable {
    pub fn new(block_tokens: usize) -> BlockTable {
        BlockTable { blocks: Vec::new(), tokens: 0, block_tokens }
    }

    /// A table starting with shared blocks (e.g. a prefix-cache hit) covering `tokens` tokens.
    pub fn from_blocks(blocks: Vec<BlockRef>, tokens: usize, block_tokens: usize) -> Result<BlockTable, KvError> {
        if block_tokens == 0 || blocks.len() != tokens.div_ceil(block_tokens) {
            return Err(KvError::Invalid {
                field: "tokens",
                problem: format!("{tokens} tokens do not fill {} blocks", blocks.len()),
            });
        }
        Ok(BlockTable { blocks, tokens, block_tokens })
    }

    pub fn tokens(&self) -> usize {
        self.tokens
    }

    pub fn blocks(&self) -> &[BlockRef] {
        &self.blocks
    }

    /// Blocks that `n` more tokens need beyond those allocated.
    pub fn blocks_needed(&self, n: usize) -> usize {
        (self.tokens + n).div_ceil(self.block_tokens).saturating_sub(self.blocks.len())
    }

    /// Grow by `n` tokens, allocating blocks from `pool`. On failure nothing changes.
    pub fn append(&mut self, pool: &BlockPool, n: usize) -> Result<(), KvError> {
        let need = self.blocks_needed(n);
        let mut fresh = Vec::with_capacity(need);
        for _ in 0..need {
            fresh.push(pool.allocate()?); // dropped (freed) again if a later one fails
        }
        self.blocks.extend(fresh);
        self.tokens += n;
        Ok(())
    }

    /// Append one whole block that already holds its tokens (a published or shared block). The
    /// table must end on a block boundary.
    pub fn push_full(&mut self, block: BlockRef) -> Result<(), KvError> {
        if self.tokens != self.blocks.len() * self.block_tokens {
            return Err(KvError::Invalid {
                field: "tokens",
                problem: format!("{} tokens end inside a block of {}", self.tokens, self.block_tokens),
            });
        }
        self.blocks.push(block);
        self.tokens += self.block_tokens;
        Ok(())
    }

    /// Another table sharing every block (n > 1 sampling, speculative branches).
    pub fn fork(&self) -> BlockTable {
        BlockTable { blocks: self.blocks.clone(), tokens: self.tokens, block_tokens: self.block_tokens }
    }

    /// Make block `i` private before writing to it: when shared, copy it into a fresh block.
    /// Returns whether a copy was made.
    pub fn make_writable(&mut self, pool: &BlockPool, i: usize) -> Result<bool, KvError> {
        let b = self.blocks.get(i).ok_or_else(|| KvError::Invalid {
            field: "block index",
            problem: format!("{i} of {}", self.blocks.len()),
        })?;
        if b.ref_count() == 1 {
            return Ok(false);
        }
        let fresh = pool.allocate()?;
        pool.copy(b, &fresh)?;
        self.blocks[i] = fresh;
        Ok(true)
    }

    /// Shrink to `tokens` tokens (rejected speculative tokens), releasing whole blocks past them.
    pub fn truncate(&mut self, tokens: usize) {
        if tokens < self.tokens {
            self.tokens = tokens;
            self.blocks.truncate(tokens.div_ceil(self.block_tokens));
        }
    }
}
