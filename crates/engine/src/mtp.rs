//! The MTP drafter on the reference model, and a measurement of how many of its drafts greedy
//! verification keeps (issue #39).
//!
//! MTP row t combines the target's final streams at position t with the embedding of token t+1
//! and predicts token t+2 (MODEL_V4.md §9). For a sequence of L tokens the target has computed
//! positions up to L-2 (token L-1 was sampled from position L-2), so the first draft comes from
//! row L-2 with the true inputs; drafts 2..k apply the MTP layer autoregressively, each row taking
//! the previous row's output streams and drafted token, as DeepSeek drafts with it. Rows with true
//! inputs are kept in the MTP layer's cache; the autoregressive rows run on a copy that is
//! dropped, so a rejected draft leaves nothing behind.

use std::collections::HashMap;

use deepinfer_spec::{Draft, Drafter};

use crate::model::{Model, ModelError, Numerics, SequenceState};

struct MtpSeq {
    /// The MTP layer's cache over rows 0..state.len (true inputs only).
    state: SequenceState,
    /// Target streams [rows, hc, D] for positions state.len.. that the cache has not taken yet.
    pending: Vec<f32>,
}

/// Drafts with the checkpoint's first MTP layer on the CPU model. By default drafts are greedy
/// (each the MTP head's most likely token, for greedy verification) and `dists` hold the head's
/// softmax, so a draft's confidence is its probability under the head. With
/// [`MtpDrafter::sampling`] each draft is drawn from softmax(logits / temperature), which `dists`
/// then hold, as [`deepinfer_spec::verify_sampled`] requires.
pub struct MtpDrafter<'m> {
    model: &'m Model,
    numerics: Numerics,
    seqs: HashMap<u64, MtpSeq>,
    /// (temperature, seed) of sampled drafts; None: greedy.
    sampling: Option<(f32, u64)>,
}

fn argmax(row: &[f32]) -> u32 {
    crate::sampler::argmax(row) as u32
}

fn softmax(row: &[f32], temperature: f32) -> Vec<f32> {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let t = temperature as f64;
    let e: Vec<f64> = row.iter().map(|&x| ((x - m) as f64 / t).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| (x / s) as f32).collect()
}

impl<'m> MtpDrafter<'m> {
    pub fn new(model: &'m Model, numerics: Numerics) -> Result<MtpDrafter<'m>, ModelError> {
        if model.config().num_mtp_layers == 0 {
            return Err(ModelError::Input {
                field: "model",
                problem: "the checkpoint has no MTP layer to draft with".into(),
            });
        }
        Ok(MtpDrafter { model, numerics, seqs: HashMap::new(), sampling: None })
    }

    /// Draw drafts at `temperature` (> 0) on uniforms keyed by (`seed`, position), so the same
    /// seed drafts the same tokens in any batch.
    pub fn sampling(mut self, temperature: f32, seed: u64) -> Result<Self, ModelError> {
        if !(temperature.is_finite() && temperature > 0.0) {
            return Err(ModelError::Input { field: "temperature", problem: format!("{temperature} (must be > 0)") });
        }
        self.sampling = Some((temperature, seed));
        Ok(self)
    }

    fn row_width(&self) -> usize {
        self.model.config().hc_mult * self.model.config().hidden_size
    }

    /// The target computed the next positions of `seq` (its final streams [n, hc, D], in
    /// order, continuing what was observed before; the first call starts at position 0).
    pub fn observe(&mut self, seq: u64, streams: &[f32]) -> Result<(), ModelError> {
        if !streams.len().is_multiple_of(self.row_width()) {
            return Err(ModelError::Input {
                field: "streams",
                problem: format!("{} values is not a whole number of {}-wide rows", streams.len(), self.row_width()),
            });
        }
        let model = self.model;
        let s = self.seqs.entry(seq).or_insert_with(|| MtpSeq { state: model.new_mtp_state(), pending: Vec::new() });
        s.pending.extend_from_slice(streams);
        Ok(())
    }

    /// [`MtpDrafter::observe`] for rows starting at absolute position `at`: rows already held are
    /// skipped, and a sequence first seen (or seen after a gap) starts there with an empty MTP
    /// cache (a prefix-cache hit's cached positions were never computed here: the first drafts
    /// then attend to fewer rows, which costs acceptance, never correctness).
    pub fn observe_at(&mut self, seq: u64, at: usize, streams: &[f32]) -> Result<(), ModelError> {
        let w = self.row_width();
        if !streams.len().is_multiple_of(w) {
            return self.observe(seq, streams); // the same error
        }
        let rows = streams.len() / w;
        let held = self.seqs.get(&seq).map(|s| s.state.len + s.pending.len() / w);
        match held {
            Some(h) if at <= h => {
                let skip = (h - at).min(rows);
                self.observe(seq, &streams[skip * w..])
            }
            _ => {
                let mut state = self.model.new_mtp_state();
                state.len = at;
                self.seqs.insert(seq, MtpSeq { state, pending: streams.to_vec() });
                Ok(())
            }
        }
    }

    fn try_draft(&mut self, seq: u64, context: &[u32], k: usize) -> Result<Draft, ModelError> {
        let w = self.row_width();
        let (model, numerics) = (self.model, self.numerics);
        let Some(s) = self.seqs.get_mut(&seq) else { return Ok(Draft::default()) };
        if k == 0 || context.len() < 2 {
            return Ok(Draft::default());
        }
        // Rows state.len ..= L-2 have true inputs: target streams and the token after each.
        let last_row = context.len() - 2;
        let have = s.state.len + s.pending.len() / w;
        if s.state.len > last_row || have <= last_row {
            // The target has not computed position L-2 yet, or the cache is past it (the sequence
            // was cut back): nothing to draft from.
            return Ok(Draft::default());
        }
        let rows = last_row + 1 - s.state.len;
        let streams: Vec<f32> = s.pending.drain(..rows * w).collect();
        let next = &context[s.state.len + 1..=last_row + 1];
        let out = model.mtp_forward_out(&streams, next, &mut s.state, numerics)?;
        let v = model.config().vocab_size;
        let mut logits = out.logits[(rows - 1) * v..].to_vec();
        let mut h = out.streams[(rows - 1) * w..].to_vec();
        let mut chain = s.state.clone();
        let mut draft = Draft::default();
        loop {
            let (t, dist) = match self.sampling {
                None => (argmax(&logits), softmax(&logits, 1.0)),
                Some((temp, seed)) => {
                    let dist = softmax(&logits, temp);
                    let w: Vec<f64> = dist.iter().map(|&x| x as f64).collect();
                    let at = (context.len() + draft.tokens.len()) as u64;
                    let u = deepinfer_spec::rng::uniform(seed, at, deepinfer_spec::rng::LANE_DRAFT);
                    (deepinfer_spec::rng::draw(&w, u).unwrap_or(0) as u32, dist)
                }
            };
            draft.tokens.push(t);
            draft.dists.push(dist);
            if draft.tokens.len() == k {
                return Ok(draft);
            }
            let o = model.mtp_forward_out(&h, &[t], &mut chain, numerics)?;
            logits = o.logits;
            h = o.streams;
        }
    }
}

impl Drafter for MtpDrafter<'_> {
    type Error = ModelError;

    fn draft(&mut self, seq: u64, context: &[u32], k: usize) -> Result<Draft, ModelError> {
        self.try_draft(seq, context, k)
    }

    /// The MTP cache cannot shorten in place: a sequence cut back before rows it already took is
    /// forgotten, and drafts nothing until it is observed again from position 0.
    fn rollback(&mut self, seq: u64, len: usize) {
        if self.seqs.get(&seq).is_some_and(|s| s.state.len + 1 > len) {
            self.seqs.remove(&seq);
        }
    }
}

impl crate::forward::StreamDrafter for MtpDrafter<'_> {
    fn observe_at(&mut self, seq: u64, at: usize, streams: &[f32]) -> Result<(), ModelError> {
        MtpDrafter::observe_at(self, seq, at, streams)
    }
    fn forget(&mut self, seq: u64) {
        self.seqs.remove(&seq);
    }
}

/// Greedy speculation with `k` MTP drafts a step over one sequence whose greedy continuation is
/// known: how many steps (target forwards) it takes to emit the continuation.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Acceptance {
    pub k: usize,
    pub steps: usize,
    pub tokens: usize,
    /// Drafts proposed and drafts that stood.
    pub drafted: usize,
    pub accepted: usize,
}

impl Acceptance {
    /// Tokens a target forward emits: 1 without speculation.
    pub fn tokens_per_step(&self) -> f64 {
        self.tokens as f64 / self.steps.max(1) as f64
    }
}

/// The target's greedy continuation of `prompt` for `new_tokens` tokens, and its final streams at
/// every position but the last ([prompt + new_tokens - 1, hc, D]).
pub fn greedy_with_streams(
    model: &Model,
    prompt: &[u32],
    new_tokens: usize,
    numerics: Numerics,
) -> Result<(Vec<u32>, Vec<f32>), ModelError> {
    let mut st = model.new_state();
    let mut tokens = prompt.to_vec();
    let mut streams = Vec::new();
    let mut input = prompt.to_vec();
    let v = model.config().vocab_size;
    for _ in 0..new_tokens {
        let out = model.forward(&mut [(&input, &mut st)], numerics, false)?.0.remove(0);
        streams.extend_from_slice(&out.streams);
        let next = argmax(&out.logits[out.logits.len() - v..]);
        tokens.push(next);
        input = vec![next];
    }
    Ok((tokens, streams))
}

/// Simulate greedy speculation with `k` drafts a step over the continuation `tokens` (the prompt's
/// `prompt_len` tokens, then the target's greedy tokens; `streams` from [`greedy_with_streams`]).
/// Verification keeps the longest prefix of drafts equal to the target's tokens, as
/// [`deepinfer_spec::verify_greedy`] does, so the emitted text is the target's by construction and
/// only the step count varies.
pub fn greedy_acceptance(
    model: &Model,
    tokens: &[u32],
    streams: &[f32],
    prompt_len: usize,
    k: usize,
    numerics: Numerics,
) -> Result<Acceptance, ModelError> {
    Ok(greedy_acceptance_with(model, tokens, streams, prompt_len, k, numerics, &mut |d| d.tokens.len())?.0)
}

/// [`greedy_acceptance`] drafting up to `max_k` a step and verifying the first `choose(draft)` of
/// them (confidence scheduling); also returns the drafts verified at each step after the first.
pub fn greedy_acceptance_with(
    model: &Model,
    tokens: &[u32],
    streams: &[f32],
    prompt_len: usize,
    max_k: usize,
    numerics: Numerics,
    choose: &mut dyn FnMut(&Draft) -> usize,
) -> Result<(Acceptance, Vec<usize>), ModelError> {
    let mut d = MtpDrafter::new(model, numerics)?;
    d.observe(0, streams)?;
    // The first target forward (the prompt) emits token prompt_len; each later step verifies
    // drafts after the tokens so far.
    let mut len = prompt_len + 1;
    let mut acc = Acceptance { k: max_k, steps: 1, tokens: 1, drafted: 0, accepted: 0 };
    let mut lengths = Vec::new();
    while len < tokens.len() {
        let room = tokens.len() - len;
        let full = d.draft(0, &tokens[..len], max_k.min(room.saturating_sub(1)))?;
        let k = choose(&full).min(full.tokens.len());
        let draft = full.truncated(k);
        let argmax = &tokens[len..len + k + 1];
        let verdict = deepinfer_spec::verify_greedy(&draft.tokens, argmax)
            .map_err(|e| ModelError::Input { field: "drafts", problem: e.to_string() })?;
        acc.steps += 1;
        acc.drafted += k;
        acc.accepted += verdict.accepted;
        acc.tokens += verdict.accepted + 1;
        len += verdict.accepted + 1;
        lengths.push(k);
    }
    Ok((acc, lengths))
}
