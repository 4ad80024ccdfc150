//! The executor: owns every running request's tokens, cache state, grammar matcher and stream;
//! runs each planned step on the model; samples; publishes complete blocks to the prefix cache.

use std::collections::HashMap;
use std::time::Instant;

use crossbeam::channel::{Receiver, Sender};
use deepinfer_kv::{BlockHash, BlockTable};
use deepinfer_recipe::Matcher;
use deepinfer_scheduler::{Outcome, StepPlan};

use super::{Engine, EngineStats, Event, FinishReason, GenerateOutput, GenerateRequest, Restore};
use crate::forward::SeqState;
use crate::sampler::{sample_batch, Sample, SampleJob, SamplingParams};

pub(super) enum ExecMsg {
    Admit(Box<Admission>),
    Step(StepPlan),
    Cancel(u64),
    FailAll(String),
}

pub(super) struct Admission {
    pub req: GenerateRequest,
    pub events: Sender<Event>,
    pub restore: Option<Restore>,
    pub matcher: Option<Matcher>,
    pub seed: u64,
    pub t0: Instant,
}

pub(super) struct StepDone {
    pub step: u64,
    pub outcomes: Vec<Outcome>,
    /// Requests that failed during the step (the scheduler drops them).
    pub failed: Vec<u64>,
}

/// A request's output before any token: finish `length` until something else ends it.
fn empty_output(r: &GenerateRequest) -> GenerateOutput {
    GenerateOutput {
        id: r.id,
        prompt_tokens: r.prompt.len(),
        tokens: Vec::new(),
        logprobs: Vec::new(),
        top_logprobs: Vec::new(),
        text: None,
        finish: FinishReason::Length,
        error: None,
        ttft_s: 0.0,
        cached_tokens: 0,
        replayed_tokens: 0,
        seed: r.sampling.seed.unwrap_or(0),
    }
}

pub(super) fn failed_output(r: &GenerateRequest, error: String) -> GenerateOutput {
    GenerateOutput { finish: FinishReason::Error, error: Some(error), ..empty_output(r) }
}

struct Live {
    req: GenerateRequest,
    params: SamplingParams,
    events: Sender<Event>,
    /// Prompt and generated tokens.
    tokens: Vec<u32>,
    state: Option<SeqState>,
    restore: Option<Restore>,
    table: BlockTable,
    hashes: Vec<BlockHash>,
    matcher: Option<Matcher>,
    /// The matcher constrains sampling (after `constraint_after`, if any).
    constrained: bool,
    /// The state is behind the scheduler's count: a verification's drafts were rejected and the
    /// state from before it kept; the next step replays the accepted tokens.
    lagging: bool,
    text: super::TextState,
    out: GenerateOutput,
    t0: Instant,
}

pub(super) struct Executor<'a> {
    eng: &'a Engine,
    live: HashMap<u64, Live>,
    stats: EngineStats,
    /// Speculative decoding, when configured and the model can draft.
    spec: Option<super::spec::Spec<'a>>,
}

impl<'a> Executor<'a> {
    pub fn new(eng: &'a Engine) -> Executor<'a> {
        let spec = super::spec::Spec::new(eng);
        Executor { eng, live: HashMap::new(), stats: EngineStats::default(), spec }
    }

    pub fn run(mut self, msgs: Receiver<ExecMsg>, done: Sender<StepDone>) -> EngineStats {
        for m in msgs.iter() {
            match m {
                ExecMsg::Admit(a) => self.admit(*a),
                ExecMsg::Step(plan) => {
                    let d = self.step(plan);
                    if done.send(d).is_err() {
                        break;
                    }
                }
                ExecMsg::Cancel(id) => {
                    if let Some(l) = self.live.remove(&id) {
                        self.finish(l, FinishReason::Cancelled, None);
                    }
                }
                ExecMsg::FailAll(why) => {
                    for (_, l) in std::mem::take(&mut self.live) {
                        self.finish(l, FinishReason::Error, Some(why.clone()));
                    }
                }
            }
        }
        for (_, l) in std::mem::take(&mut self.live) {
            self.finish(l, FinishReason::Error, Some("the engine stopped before this request finished".into()));
        }
        self.stats
    }

    fn fresh_table(&self, restore: Option<&Restore>) -> BlockTable {
        let bt = self.eng.cfg.block_tokens;
        match restore {
            Some(r) => BlockTable::from_blocks(r.blocks.clone(), r.blocks.len() * bt, bt).expect("whole blocks"),
            None => BlockTable::new(bt),
        }
    }

    fn admit(&mut self, a: Admission) {
        let r = a.req;
        self.stats.prompt_tokens += r.prompt.len();
        let (cached, replayed) = a.restore.as_ref().map_or((0, 0), |x| (x.plan.reused_tokens, x.plan.replay_tokens()));
        if a.restore.is_some() {
            self.stats.prefix_hits += 1;
            self.stats.cached_tokens += cached;
        }
        let out = GenerateOutput { cached_tokens: cached, replayed_tokens: replayed, seed: a.seed, ..empty_output(&r) };
        let params = SamplingParams { seed: Some(a.seed), ..r.sampling.clone() };
        let table = self.fresh_table(a.restore.as_ref());
        let constrained = a.matcher.is_some() && r.constraint_after.is_none();
        let _ = a.events.send(Event::Admitted { id: r.id, prompt_tokens: r.prompt.len(), cached_tokens: cached });
        self.live.insert(
            r.id,
            Live {
                tokens: r.prompt.clone(),
                params,
                events: a.events,
                state: None,
                restore: a.restore,
                table,
                hashes: Vec::new(),
                matcher: a.matcher,
                constrained,
                lagging: false,
                text: Default::default(),
                out,
                t0: a.t0,
                req: r,
            },
        );
    }

    fn finish(&mut self, mut l: Live, finish: FinishReason, error: Option<String>) {
        if let Some(sp) = self.spec.as_mut() {
            sp.drafter.forget(l.req.id);
        }
        l.out.finish = finish;
        l.out.error = error;
        if let Some(t) = &self.eng.text {
            let mut toks = &l.out.tokens[..];
            if let (Some(last), FinishReason::Stop) = (toks.last(), finish) {
                if l.req.stop_token_ids.contains(last) {
                    toks = &toks[..toks.len() - 1];
                }
            }
            l.out.text = Some(l.text.stopped_text.clone().unwrap_or_else(|| t.tok.decode(toks).unwrap_or_default()));
        }
        let _ = l.events.send(Event::Done(l.out));
    }

    /// The state a step item continues from: the live one, a restore from the prefix cache, or a
    /// fresh one (after a recompute preemption).
    fn state_for(&self, l: &mut Live, context: usize) -> Result<SeqState, String> {
        if let Some(st) = l.state.take() {
            if st.len() == context || (l.lagging && st.len() < context) {
                return Ok(st);
            }
        }
        if context == 0 {
            l.table = self.fresh_table(None);
            return self.eng.model.new_state().map_err(|e| e.to_string());
        }
        match (&l.restore, &self.eng.kv) {
            (Some(r), Some(kv)) if r.plan.replay_from == context => {
                let payloads = kv.read(&r.blocks).map_err(|e| format!("reading cached blocks: {e}"))?;
                let refs: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
                l.table = self.fresh_table(Some(r));
                self.eng.model.restore_state(&refs, kv.block_tokens, context).map_err(|e| e.to_string())
            }
            _ => Err(format!("internal: no cache state for a step at context {context}")),
        }
    }

    fn step(&mut self, plan: StepPlan) -> StepDone {
        let mut done = StepDone { step: plan.step, outcomes: Vec::new(), failed: Vec::new() };
        for id in &plan.preempted {
            if let Some(l) = self.live.get_mut(id) {
                l.state = None; // recompute preemption: the scheduler freed its KV
                l.lagging = false;
            }
        }
        // Inputs: each item's tokens after what its state holds, then any drafts to verify.
        let mut work: Vec<Work> = Vec::new();
        for it in &plan.items {
            let Some(mut l) = self.live.remove(&it.id) else { continue }; // finished or cancelled
            let end = it.context + it.tokens;
            let st = match self.state_for(&mut l, it.context) {
                Ok(st) => st,
                Err(e) => {
                    done.failed.push(it.id);
                    self.finish(l, FinishReason::Error, Some(e));
                    continue;
                }
            };
            if end > l.tokens.len() {
                done.failed.push(it.id);
                let e = format!("internal: a step asks for {end} of {} tokens", l.tokens.len());
                self.finish(l, FinishReason::Error, Some(e));
                continue;
            }
            if let Some(r) = &l.restore {
                let replay = r.plan.reused_tokens.min(end).saturating_sub(st.len());
                self.stats.replayed_tokens += replay;
            }
            let drafts = if it.samples && it.spec > 0 && end == l.tokens.len() {
                match self.draft(&l, it.spec) {
                    Ok(d) => d,
                    Err(e) => {
                        done.failed.push(it.id);
                        self.finish(l, FinishReason::Error, Some(format!("drafting failed: {e}")));
                        continue;
                    }
                }
            } else {
                Vec::new()
            };
            let mut chunk = l.tokens[st.len()..end].to_vec();
            chunk.extend_from_slice(&drafts);
            self.stats.computed_tokens += chunk.len();
            // A verification runs on a copy: the original is the rollback point.
            let (state, rollback) = if drafts.is_empty() {
                (st, None)
            } else {
                match self.spec.as_ref().map(|sp| sp.model.snapshot(&st)) {
                    Some(Ok(copy)) => (copy, Some(st)),
                    Some(Err(e)) => {
                        done.failed.push(it.id);
                        self.finish(l, FinishReason::Error, Some(format!("speculation: {e}")));
                        continue;
                    }
                    None => (st, None),
                }
            };
            let start = state.len();
            work.push(Work { id: it.id, chunk, samples: it.samples, drafts, start, state, rollback });
            l.lagging = false;
            self.live.insert(it.id, l);
        }
        if work.is_empty() {
            return done;
        }
        // Grammar masks of the sampling items (one per row to verify), computed while the model runs.
        let mut matchers: Vec<(u64, Matcher, Vec<u32>)> = Vec::new();
        for w in work.iter().filter(|w| w.samples) {
            let l = self.live.get_mut(&w.id).expect("live");
            if l.constrained {
                if let Some(m) = l.matcher.take() {
                    matchers.push((w.id, m, w.drafts.clone()));
                }
            }
        }
        let model = &*self.eng.model;
        let spec_model = self.spec.as_ref().map(|sp| sp.model);
        let tails: Vec<usize> = work.iter().map(|w| if w.samples { 1 + w.drafts.len() } else { 0 }).collect();
        let v = model.config().vocab_size;
        let (result, masked) = std::thread::scope(|s| {
            let masks = s.spawn(move || {
                matchers
                    .into_iter()
                    .map(|(id, mut m, drafts)| {
                        let masks = draft_masks(&mut m, &drafts, v);
                        (id, m, masks)
                    })
                    .collect::<Vec<_>>()
            });
            let mut batch: Vec<(&[u32], &mut SeqState)> =
                work.iter_mut().map(|w| (w.chunk.as_slice(), &mut w.state)).collect();
            let r = match spec_model {
                Some(sm) => sm.forward_tails(&mut batch, &tails),
                None => model.forward_last(&mut batch).map(|o| o.into_iter().map(|l| (l, Vec::new())).collect()),
            };
            (r, masks.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
        });
        let mut masks: HashMap<u64, Result<Vec<Vec<bool>>, String>> = HashMap::new();
        for (id, m, mask) in masked {
            if let Some(l) = self.live.get_mut(&id) {
                l.matcher = Some(m);
            }
            masks.insert(id, mask);
        }
        let outs = match result {
            Ok(o) => o,
            Err(e) => {
                for w in work {
                    if let Some(l) = self.live.remove(&w.id) {
                        done.failed.push(w.id);
                        self.finish(l, FinishReason::Error, Some(format!("model step failed: {e}")));
                    }
                }
                return done;
            }
        };
        // Every row's token, sampled in parallel exactly as plain decoding would sample it there:
        // row i of a verification sees the drafts before it in its history, position and mask.
        let mut rows = self.sample_rows(&work, &outs, &masks);
        for (i, (mut w, (_, streams))) in work.into_iter().zip(outs).enumerate() {
            let Some(mut l) = self.live.remove(&w.id) else { continue };
            // Drafts stand while they equal the target's own token at their row.
            let samples = std::mem::take(&mut rows[i]);
            let accepted =
                w.drafts.iter().zip(&samples).take_while(|(d, s)| s.as_ref().is_some_and(|s| s.token == **d)).count();
            if !w.drafts.is_empty() {
                self.stats.spec_steps += 1;
                self.stats.drafted_tokens += w.drafts.len();
                self.stats.accepted_drafts += accepted;
            }
            if let (Some(sp), false) = (self.spec.as_mut(), streams.is_empty()) {
                let width = sp.model.stream_width();
                let valid = w.chunk.len() - (w.drafts.len() - accepted);
                if let Err(e) = sp.drafter.observe_at(w.id, w.start, &streams[..valid * width]) {
                    done.failed.push(w.id);
                    self.finish(l, FinishReason::Error, Some(format!("drafter: {e}")));
                    continue;
                }
            }
            if accepted < w.drafts.len() {
                // Rejected drafts: keep the state from before the step; the next step replays
                // the accepted tokens (its context is where the scheduler now counts them).
                if let Some(orig) = w.rollback.take() {
                    w.state = orig;
                    l.lagging = true;
                }
            }
            if let Some(kv) = &self.eng.kv {
                let full = w.state.len() / kv.block_tokens * kv.block_tokens;
                kv.extend_hashes(&mut l.hashes, &l.tokens[..full], l.req.cache_salt.as_deref());
                kv.publish(model, &w.state, &mut l.table, &l.hashes, l.req.cache_class);
            }
            l.state = Some(w.state);
            if !w.samples {
                self.live.insert(w.id, l);
                continue;
            }
            if let Some(Err(e)) = masks.remove(&w.id) {
                done.failed.push(w.id);
                self.finish(l, FinishReason::Error, Some(format!("`constraint`: {e}")));
                continue;
            }
            let mut emitted = 0;
            let mut end = None;
            for s in samples.into_iter().take(accepted + 1) {
                let Some(s) = s else {
                    end = Some(Err("`constraint`: no token can continue the output".to_string()));
                    break;
                };
                emitted += 1;
                match self.push_token(&mut l, s) {
                    Ok(None) => {}
                    Ok(Some(reason)) => {
                        end = Some(Ok(reason));
                        break;
                    }
                    Err(e) => {
                        end = Some(Err(e));
                        break;
                    }
                }
            }
            match end {
                None => {
                    done.outcomes.push(Outcome { id: w.id, accepted: emitted, stop: false });
                    self.live.insert(w.id, l);
                }
                Some(Ok(reason)) => {
                    done.outcomes.push(Outcome { id: w.id, accepted: emitted, stop: true });
                    self.finish(l, reason, None);
                }
                Some(Err(e)) => {
                    done.failed.push(w.id);
                    self.finish(l, FinishReason::Error, Some(e));
                }
            }
        }
        done
    }

    /// Drafts for a decode of `l` (at most `k`, none past what `max_tokens` leaves room for, none
    /// from the token that switches a grammar on).
    fn draft(&mut self, l: &Live, k: usize) -> Result<Vec<u32>, String> {
        let Some(sp) = self.spec.as_mut() else { return Ok(Vec::new()) };
        let room = l.req.max_tokens.saturating_sub(l.out.tokens.len() + 1);
        let k = k.min(room);
        if k == 0 {
            return Ok(Vec::new());
        }
        let d = sp.drafter.draft(l.req.id, &l.tokens, k).map_err(|e| e.to_string())?;
        let mut t = d.tokens;
        if !l.constrained && l.matcher.is_some() {
            if let Some(trigger) = l.req.constraint_after {
                if let Some(at) = t.iter().position(|&x| x == trigger) {
                    t.truncate(at);
                }
            }
        }
        Ok(t)
    }

    /// Sample every row of every sampling item (see `step`).
    fn sample_rows(
        &self,
        work: &[Work],
        outs: &[(Vec<f32>, Vec<f32>)],
        masks: &HashMap<u64, Result<Vec<Vec<bool>>, String>>,
    ) -> Vec<Vec<Option<Sample>>> {
        let v = self.eng.model.config().vocab_size;
        let mut histories: Vec<(usize, usize, Vec<u32>)> = Vec::new(); // (item, row, history)
        for (i, w) in work.iter().enumerate().filter(|(_, w)| w.samples) {
            let Some(l) = self.live.get(&w.id) else { continue };
            if let Some(Err(_)) = masks.get(&w.id) {
                continue;
            }
            let rows = match masks.get(&w.id) {
                Some(Ok(m)) => m.len().min(1 + w.drafts.len()),
                _ => 1 + w.drafts.len(),
            };
            for r in 0..rows {
                let mut h = l.tokens[l.req.prompt.len()..].to_vec();
                h.extend_from_slice(&w.drafts[..r]);
                histories.push((i, r, h));
            }
        }
        let jobs: Vec<SampleJob<'_>> = histories
            .iter()
            .map(|(i, r, h)| {
                let w = &work[*i];
                let l = &self.live[&w.id];
                let allowed = match masks.get(&w.id) {
                    Some(Ok(m)) => Some(m[*r].as_slice()),
                    _ => None,
                };
                SampleJob {
                    logits: &outs[*i].0[r * v..(r + 1) * v],
                    history: h,
                    params: &l.params,
                    position: (l.tokens.len() + r) as u64,
                    allowed,
                }
            })
            .collect();
        let mut rows: Vec<Vec<Option<Sample>>> = vec![Vec::new(); work.len()];
        for ((i, _, _), s) in histories.iter().zip(sample_batch(&jobs)) {
            rows[*i].push(s);
        }
        rows
    }

    /// Append one sampled token to `l`'s output and stream it; Some(reason) when it ends the request.
    fn push_token(&mut self, l: &mut Live, s: Sample) -> Result<Option<FinishReason>, String> {
        if l.out.tokens.is_empty() {
            l.out.ttft_s = l.t0.elapsed().as_secs_f64();
        }
        l.tokens.push(s.token);
        l.out.tokens.push(s.token);
        l.out.logprobs.push(s.logprob);
        if l.params.top_logprobs > 0 {
            l.out.top_logprobs.push(s.top.clone());
        }
        self.stats.generated_tokens += 1;
        // Grammar: advance (or start after the trigger token).
        let mut grammar_done = false;
        if l.constrained {
            if let Some(m) = l.matcher.as_mut() {
                m.consume_token(s.token).map_err(|e| format!("`constraint`: {e}"))?;
                grammar_done = m.is_stopped();
            }
        } else if l.matcher.is_some() && l.req.constraint_after == Some(s.token) {
            l.constrained = true;
        }
        let stop_token = l.req.stop_token_ids.contains(&s.token);
        let length = l.out.tokens.len() >= l.req.max_tokens;
        let mut finished = stop_token || length || grammar_done;
        let mut text = String::new();
        if let Some(t) = &self.eng.text {
            let shown = if stop_token { &l.out.tokens[..l.out.tokens.len() - 1] } else { &l.out.tokens[..] };
            let st = l.text.step(&t.tok, shown, &l.req.stop_strings, finished);
            text = st.delta;
            finished |= st.stopped;
        }
        let _ = l.events.send(Event::Token { id: l.req.id, token: s.token, logprob: s.logprob, top: s.top, text });
        Ok(finished.then(|| {
            if length && !stop_token && !grammar_done && l.text.stopped_text.is_none() {
                FinishReason::Length
            } else {
                FinishReason::Stop
            }
        }))
    }
}

/// One item of a step in the executor.
struct Work {
    id: u64,
    /// Tokens to run: what the state lacks up to the planned end, then the drafts.
    chunk: Vec<u32>,
    samples: bool,
    drafts: Vec<u32>,
    /// The state's length before the step (the chunk's first position).
    start: usize,
    state: SeqState,
    /// The state before a verification (kept when drafts are rejected).
    rollback: Option<SeqState>,
}

/// The grammar masks of rows 0..=drafts.len() of a verification: row 0 from the matcher as it is,
/// row i after it consumed drafts ..i. Stops after the first draft its row does not allow (that
/// draft is rejected whatever the target says, so later rows are never sampled). The matcher is
/// left as it was.
fn draft_masks(m: &mut Matcher, drafts: &[u32], vocab: usize) -> Result<Vec<Vec<bool>>, String> {
    let dense = |m: &mut Matcher| -> Result<Vec<bool>, String> {
        let mk = m.compute_mask().map_err(|e| e.to_string())?;
        Ok((0..vocab).map(|t| t < mk.len() && mk.is_allowed(t as u32)).collect())
    };
    let mut out = vec![dense(m)?];
    if drafts.is_empty() {
        return Ok(out);
    }
    let mut c = m.deep_clone();
    for &d in drafts {
        if !out.last().is_some_and(|row| row.get(d as usize).copied().unwrap_or(false)) {
            break;
        }
        c.consume_token(d).map_err(|e| e.to_string())?;
        if c.is_stopped() {
            break;
        }
        out.push(dense(&mut c)?);
    }
    Ok(out)
}
