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
use crate::sampler::{sample_batch, SampleJob, SamplingParams};

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
    text: super::TextState,
    out: GenerateOutput,
    t0: Instant,
}

pub(super) struct Executor<'a> {
    eng: &'a Engine,
    live: HashMap<u64, Live>,
    stats: EngineStats,
}

impl<'a> Executor<'a> {
    pub fn new(eng: &'a Engine) -> Executor<'a> {
        Executor { eng, live: HashMap::new(), stats: EngineStats::default() }
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
                text: Default::default(),
                out,
                t0: a.t0,
                req: r,
            },
        );
    }

    fn finish(&mut self, mut l: Live, finish: FinishReason, error: Option<String>) {
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
            if st.len() == context {
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
            }
        }
        // Inputs: each item's tokens after what its state holds.
        struct Work {
            id: u64,
            chunk: Vec<u32>,
            samples: bool,
            state: SeqState,
        }
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
            self.stats.computed_tokens += end - st.len();
            work.push(Work { id: it.id, chunk: l.tokens[st.len()..end].to_vec(), samples: it.samples, state: st });
            self.live.insert(it.id, l);
        }
        if work.is_empty() {
            return done;
        }
        // Grammar masks of the sampling items, computed while the model runs.
        let mut matchers: Vec<(u64, Matcher)> = Vec::new();
        for w in work.iter().filter(|w| w.samples) {
            let l = self.live.get_mut(&w.id).expect("live");
            if l.constrained {
                if let Some(m) = l.matcher.take() {
                    matchers.push((w.id, m));
                }
            }
        }
        let model = &*self.eng.model;
        let (result, masked) = std::thread::scope(|s| {
            let masks = s.spawn(move || {
                matchers
                    .into_iter()
                    .map(|(id, mut m)| {
                        let mask = m.compute_mask().map_err(|e| e.to_string());
                        (id, m, mask)
                    })
                    .collect::<Vec<_>>()
            });
            let mut batch: Vec<(&[u32], &mut SeqState)> =
                work.iter_mut().map(|w| (w.chunk.as_slice(), &mut w.state)).collect();
            let r = model.forward_last(&mut batch);
            (r, masks.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
        });
        let v = model.config().vocab_size;
        let mut masks: HashMap<u64, Result<Vec<bool>, String>> = HashMap::new();
        for (id, m, mask) in masked {
            if let Some(l) = self.live.get_mut(&id) {
                l.matcher = Some(m);
            }
            masks.insert(id, mask.map(|mk| (0..v).map(|t| t < mk.len() && mk.is_allowed(t as u32)).collect()));
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
        // Every sampling item's token, chosen in parallel (the grammar and stop handling below stay
        // in batch order).
        let mut picked = {
            let jobs: Vec<(usize, SampleJob<'_>)> = work
                .iter()
                .zip(&outs)
                .enumerate()
                .filter(|(_, (w, _))| w.samples)
                .filter_map(|(i, (w, o))| {
                    let l = self.live.get(&w.id)?;
                    let allowed = match masks.get(&w.id) {
                        Some(Ok(m)) => Some(m.as_slice()),
                        Some(Err(_)) => return None,
                        None => None,
                    };
                    let history = &l.tokens[l.req.prompt.len()..];
                    Some((
                        i,
                        SampleJob { logits: o, history, params: &l.params, position: l.tokens.len() as u64, allowed },
                    ))
                })
                .collect();
            let (at, jobs): (Vec<usize>, Vec<SampleJob<'_>>) = jobs.into_iter().unzip();
            let mut picked: Vec<Option<Option<crate::sampler::Sample>>> = vec![None; work.len()];
            for (i, s) in at.into_iter().zip(sample_batch(&jobs)) {
                picked[i] = Some(s);
            }
            picked
        };
        for (i, (w, _)) in work.into_iter().zip(outs).enumerate() {
            let Some(mut l) = self.live.remove(&w.id) else { continue };
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
            let Some(s) = picked[i].take().flatten() else {
                done.failed.push(w.id);
                self.finish(l, FinishReason::Error, Some("`constraint`: no token can continue the output".into()));
                continue;
            };
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
                    if let Err(e) = m.consume_token(s.token) {
                        done.failed.push(w.id);
                        self.finish(l, FinishReason::Error, Some(format!("`constraint`: {e}")));
                        continue;
                    }
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
            let _ = l.events.send(Event::Token { id: w.id, token: s.token, logprob: s.logprob, top: s.top, text });
            done.outcomes.push(Outcome { id: w.id, accepted: 1, stop: finished });
            if finished {
                let reason = if length && !stop_token && !grammar_done && l.text.stopped_text.is_none() {
                    FinishReason::Length
                } else {
                    FinishReason::Stop
                };
                self.finish(l, reason, None);
            } else {
                self.live.insert(w.id, l);
            }
        }
        done
    }
}
