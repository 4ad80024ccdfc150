//! Prompt rendering and encoding with the official DeepSeek V4 / V4.1 encodings.

use deepseek_recipe::request::{ConversationRequest, ModelVersion};
use deepseek_recipe_encoding::dsv4::DeepseekV4Encoding;
use deepseek_recipe_encoding::dsv41::DeepseekV41Encoding;
use deepseek_recipe_encoding::{PromptEncoding, RenderedPrompt};
use serde::Serialize;

use crate::tokenizer::DeepseekTokenizer;

/// The two prompt encodings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Encoding {
    #[serde(rename = "v4")]
    V4,
    #[serde(rename = "v4.1")]
    V41,
}

impl Encoding {
    /// The encoding of a model version: V4-Pro renders V4, V4.1-Flash renders V4.1.
    pub fn of(v: ModelVersion) -> Encoding {
        match v {
            ModelVersion::DeepseekV4Pro => Encoding::V4,
            _ => Encoding::V41,
        }
    }

    fn encoder(self, tok: Option<&DeepseekTokenizer>) -> Box<dyn PromptEncoding> {
        match (self, tok) {
            (Encoding::V4, Some(t)) => Box::new(DeepseekV4Encoding::new().with_tokenizer(t.prompt_tokenizer())),
            (Encoding::V4, None) => Box::new(DeepseekV4Encoding::new()),
            (Encoding::V41, Some(t)) => Box::new(DeepseekV41Encoding::new().with_tokenizer(t.prompt_tokenizer())),
            (Encoding::V41, None) => Box::new(DeepseekV41Encoding::new()),
        }
    }
}

/// A rendered prompt and, when the tokenizer has every control token it needs, its token ids.
#[derive(Debug, Clone, Serialize)]
pub struct Rendered {
    pub prompt: String,
    pub token_ids: Option<Vec<u32>>,
    pub encoding: Encoding,
    /// Why `token_ids` is null (e.g. a control token missing from the tokenizer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encode_error: Option<String>,
    /// Byte ranges of `prompt` that are control tokens.
    #[serde(skip)]
    pub special_ranges: Vec<std::ops::Range<usize>>,
}

/// Render (and with a tokenizer, encode) a converted request in `encoding`.
pub fn render(request: &ConversationRequest, encoding: Encoding, tok: Option<&DeepseekTokenizer>) -> Rendered {
    let enc = encoding.encoder(tok);
    let RenderedPrompt { prompt, special_ranges, .. } = enc.render_conversation(&request.conversation);
    let (token_ids, encode_error) = match tok {
        None => (None, Some("no tokenizer".to_string())),
        Some(_) => match enc.encode(&request.conversation) {
            Ok(ids) => (Some(ids), None),
            Err(e) => (None, Some(e.to_string())),
        },
    };
    Rendered { prompt, token_ids, encoding, encode_error, special_ranges }
}
