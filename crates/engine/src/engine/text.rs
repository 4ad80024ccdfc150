//! Incremental detokenization with stop strings: each new token yields the text that is safe to
//! stream (never half a UTF-8 character, never the start of a stop string that may still
//! complete), and a stop string ends generation with the text before it.

use deepinfer_recipe::DeepseekTokenizer;

#[derive(Debug, Default, Clone)]
pub struct TextState {
    /// Bytes of the decoded text already streamed.
    emitted: usize,
    /// The final text once a stop string matched.
    pub stopped_text: Option<String>,
}

/// What one token adds.
#[derive(Debug, PartialEq)]
pub struct TextStep {
    pub delta: String,
    pub stopped: bool,
}

impl TextState {
    /// After `generated` (all output tokens so far, the newest last) — `finished` flushes
    /// everything held back.
    pub fn step(&mut self, tok: &DeepseekTokenizer, generated: &[u32], stops: &[String], finished: bool) -> TextStep {
        let text = tok.decode(generated).unwrap_or_default();
        if let Some(at) = stops.iter().filter(|s| !s.is_empty()).filter_map(|s| text.find(s.as_str())).min() {
            let delta = text.get(self.emitted.min(at)..at).unwrap_or("").to_string();
            self.emitted = at;
            self.stopped_text = Some(text[..at].to_string());
            return TextStep { delta, stopped: true };
        }
        let mut end = text.len();
        if !finished {
            // An incomplete character decodes as U+FFFD at the end: hold it back.
            end = text.trim_end_matches('\u{FFFD}').len();
            // Hold back a suffix that a stop string starts with.
            let held = stops
                .iter()
                .flat_map(|s| (1..s.len()).filter(|k| s.is_char_boundary(*k)).map(move |k| &s[..k]))
                .filter(|p| text[..end].ends_with(p))
                .map(str::len)
                .max()
                .unwrap_or(0);
            end -= held;
        }
        let delta = if end > self.emitted { text[self.emitted..end].to_string() } else { String::new() };
        self.emitted = self.emitted.max(end);
        TextStep { delta, stopped: false }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(tok: &DeepseekTokenizer, s: &str) -> Vec<u32> {
        tok.encode_batch(&[s.to_string()]).unwrap().remove(0)
    }

    #[test]
    fn streamed_deltas_concatenate_to_the_text_and_stop_strings_cut_it() {
        let tok = DeepseekTokenizer::builtin().unwrap();
        let all = ids(&tok, "Hello world, naïve café. END and more");
        let stops = vec!["END".to_string()];
        let mut st = TextState::default();
        let mut out = String::new();
        let mut stopped = false;
        for k in 1..=all.len() {
            let s = st.step(&tok, &all[..k], &stops, false);
            out.push_str(&s.delta);
            if s.stopped {
                stopped = true;
                break;
            }
            assert!(!out.contains("EN") || out.contains("END"), "a possible stop prefix is held back: {out:?}");
        }
        assert!(stopped);
        assert_eq!(out, "Hello world, naïve café. ");
        assert_eq!(st.stopped_text.as_deref(), Some("Hello world, naïve café. "));
    }

    #[test]
    fn without_stops_the_flush_emits_everything() {
        let tok = DeepseekTokenizer::builtin().unwrap();
        let all = ids(&tok, "日本語のテキスト 🎉 done");
        let mut st = TextState::default();
        let mut out = String::new();
        for k in 1..=all.len() {
            let s = st.step(&tok, &all[..k], &[], k == all.len());
            assert!(!s.delta.contains('\u{FFFD}'), "never half a character");
            out.push_str(&s.delta);
        }
        assert_eq!(out, "日本語のテキスト 🎉 done");
    }
}
