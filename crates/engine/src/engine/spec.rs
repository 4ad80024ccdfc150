//! Speculative decoding in the executor: the model's drafter and its speculative forward, when
//! the configuration asks for drafts and the model can make them. Verification itself lives in
//! the executor's step: every row of a verification is sampled exactly as plain decoding samples
//! that position (same history, seed-keyed position, grammar mask), and drafts stand while they
//! equal the target's token, so the output is the one plain decoding gives, token for token, for
//! greedy and seeded sampling alike.

use super::Engine;
use crate::forward::{SpecModel, StreamDrafter};

pub(super) struct Spec<'a> {
    pub model: &'a dyn SpecModel,
    pub drafter: Box<dyn StreamDrafter + 'a>,
}

impl<'a> Spec<'a> {
    /// None when speculation is off or the model has no drafter (said once on stderr).
    pub fn new(eng: &'a Engine) -> Option<Spec<'a>> {
        if eng.cfg.speculative_tokens == 0 {
            return None;
        }
        let Some(model) = eng.model.speculation() else {
            eprintln!("speculative decoding: {} has no drafter; decoding without it", eng.model.device_label());
            return None;
        };
        match model.drafter() {
            Ok(drafter) => Some(Spec { model, drafter }),
            Err(e) => {
                eprintln!("speculative decoding: {e}; decoding without it");
                None
            }
        }
    }
}
