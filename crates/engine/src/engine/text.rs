//! Incremental detokenization with stop strings: each new token yields the text that is safe to
//! stream (never half a UTF-8 character, never the start of a stop string that may still
//! complete), and a stop string ends generation with the text before it.

use deepinfer_recipe::DeepseekTokenizer;

#[derive(Debug, Default, Clone)]
pub struct TextState {
    /// Text of the first `read` tokens (every character complete).
    text: String,
    /// Tokens decoded into `text`, and where the last decoded window started: a step decodes only
    /// tokens from `prefix` on, not the whole output again.
    read: usize,
    prefix: usize,
    /// Bytes of `text` already streamed.
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
    /// Bring `text` up to `generated`. Tokens that end inside a character (it decodes as U+FFFD)
    /// wait for the next ones unless `finished`.
    fn advance(&mut self, tok: &DeepseekTokenizer, generated: &[u32], finished: bool) {
        if generated.len() < self.read {
            *self = TextState::default(); // never expected: the output only grows
        }
        if generated.len() == self.read {
            return;
        }
        let window = tok.decode(&generated[self.prefix..]).unwrap_or_default();
        if !finished && window.ends_with('\u{FFFD}') {
            return;
        }
        let before = tok.decode(&generated[self.prefix..self.read]).unwrap_or_default();
        match window.strip_prefix(before.as_str()) {
            Some(new) => self.text.push_str(new),
            None => self.text = tok.decode(generated).unwrap_or_default(),
        }
        self.prefix = self.read;
        self.read = generated.len();
    }

    /// After `generated` (all output tokens so far, the newest last) — `finished` flushes
    /// everything held back.
    pub fn step(&mut self, tok: &DeepseekTokenizer, generated: &[u32], stops: &[String], finished: bool) -> TextStep {
        self.advance(tok, generated, finished);
        let text = &self.text;
        // A match cannot start before the streamed text, which never ends inside a possible stop.
        let longest = stops.iter().map(String::len).max().unwrap_or(0);
        let mut from = self.emitted.saturating_sub(longest);
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = stops.iter().filter(|s| !s.is_empty()).filter_map(|s| text[from..].find(s.as_str())).min();
        if let Some(at) = hit.map(|i| from + i) {
            let delta = text.get(self.emitted.min(at)..at).unwrap_or("").to_string();
            self.emitted = at;
            self.stopped_text = Some(text[..at].to_string());
            return TextStep { delta, stopped: true };
        }
        let mut end = text.len();
        if !finished {
            // Hold back a suffix that a stop string starts with.
            let held = stops
                .iter()
                .flat_map(|s| (1..s.len()).filter(|k| s.is_char_boundary(*k)).map(move |k| &s[..k]))
                .filter(|p| text.ends_with(p))
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
