//! The engine loop (offline API): requests in, the scheduler plans each step, the model runs the
//! step's varlen batch with each sequence's cache state, the sampler picks tokens, results flow
//! back to the scheduler until every request finishes.
//!
//! Deterministic by construction: the CPU model computes each token's row independently of its
//! batch neighbours (fixed-order reductions), and the sampler draws from a random number keyed by
//! (seed, position), so a seeded request gives the same tokens at any batch size.

use std::collections::HashMap;
use std::time::Instant;

use deepinfer_scheduler::{
    CostModel, DeviceRates, ModelShape, Outcome, PreemptionMode, Request, Scheduler, SchedulerConfig,
};
use serde::Serialize;

use crate::model::{Model, Numerics, SequenceState};
use crate::sampler::{sample, SamplingParams};

/// One generation request (token ids in, token ids out).
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops after any of these tokens (e.g. end of sentence).
    pub stop_token_ids: Vec<u32>,
    pub priority: i32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    Stop,
    Length,
    Error,
}

#[derive(Debug, Clone, Serialize)]
pub struct GenerateOutput {
    pub id: u64,
    pub prompt_tokens: usize,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub finish: FinishReason,
    /// Why the request failed (only that request), when `finish` is `error`.
    pub error: Option<String>,
    pub ttft_s: f64,
}

/// Engine limits.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub token_budget: usize,
    pub max_running: usize,
    pub kv_blocks: usize,
    pub block_tokens: usize,
    /// Longest prompt + output a request may ask for.
    pub max_context: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { token_budget: 512, max_running: 64, kv_blocks: 4096, block_tokens: 64, max_context: 1 << 16 }
    }
}

/// Counters of a `generate` call.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EngineStats {
    pub steps: u64,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub preemptions: u64,
    pub seconds: f64,
}

pub struct Engine {
    model: Model,
    cfg: EngineConfig,
}

struct Live {
    req: GenerateRequest,
    tokens: Vec<u32>,
    state: SequenceState,
    out: GenerateOutput,
}

impl Engine {
    pub fn new(model: Model, cfg: EngineConfig) -> Engine {
        Engine { model, cfg }
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    fn check(&self, r: &GenerateRequest) -> Result<(), String> {
        let v = self.model.config().vocab_size;
        if r.prompt.is_empty() {
            return Err("`prompt`: empty".into());
        }
        if let Some(t) = r.prompt.iter().find(|t| **t as usize >= v) {
            return Err(format!("`prompt`: token id {t} is outside the vocabulary of {v}"));
        }
        if r.max_tokens == 0 {
            return Err("`max_tokens`: must be at least 1".into());
        }
        if r.prompt.len() + r.max_tokens > self.cfg.max_context {
            return Err(format!(
                "`max_tokens`: the prompt ({}) plus max_tokens ({}) exceeds the context of {} tokens",
                r.prompt.len(),
                r.max_tokens,
                self.cfg.max_context
            ));
        }
        r.sampling.validate().map_err(|e| e.to_string())
    }

    /// Run `requests` to completion. A bad request fails alone (finish `error`); the rest run.
    pub fn generate(&self, requests: Vec<GenerateRequest>) -> (Vec<GenerateOutput>, EngineStats) {
        let start = Instant::now();
        let sched_cfg = SchedulerConfig {
            token_budget: self.cfg.token_budget,
            max_running: self.cfg.max_running,
            block_tokens: self.cfg.block_tokens,
            kv_blocks: self.cfg.kv_blocks,
            lookahead: 0,
            step_time_budget: None,
            preemption: PreemptionMode::Recompute,
            aging_per_s: 1.0,
        };
        let mut sched = Scheduler::new(sched_cfg, CostModel::new(ModelShape::v4_flash(), DeviceRates::h200()));
        let mut live: HashMap<u64, Live> = HashMap::new();
        let mut done: Vec<GenerateOutput> = Vec::new();
        let mut stats = EngineStats::default();
        let order: Vec<u64> = requests.iter().map(|r| r.id).collect();
        for r in requests {
            let out = GenerateOutput {
                id: r.id,
                prompt_tokens: r.prompt.len(),
                tokens: Vec::new(),
                logprobs: Vec::new(),
                finish: FinishReason::Length,
                error: None,
                ttft_s: 0.0,
            };
            let err = self.check(&r).err().or_else(|| {
                let mut q = Request::new(r.id, r.prompt.len(), r.max_tokens, 0.0);
                q.priority = r.priority;
                sched.add(q).err().map(|e| e.to_string())
            });
            match err {
                Some(e) => done.push(GenerateOutput { finish: FinishReason::Error, error: Some(e), ..out }),
                None => {
                    stats.prompt_tokens += r.prompt.len();
                    let tokens = r.prompt.clone();
                    live.insert(r.id, Live { req: r, tokens, state: self.model.new_state(), out });
                }
            }
        }
        while !sched.is_empty() {
            let plan = match sched.plan(start.elapsed().as_secs_f64()) {
                Ok(p) => p,
                Err(e) => {
                    for (_, l) in live.drain() {
                        done.push(GenerateOutput { finish: FinishReason::Error, error: Some(e.to_string()), ..l.out });
                    }
                    break;
                }
            };
            stats.steps += 1;
            for id in &plan.preempted {
                // Recompute preemption: the scheduler dropped its KV; so do we.
                if let Some(l) = live.get_mut(id) {
                    l.state = self.model.new_state();
                }
            }
            if plan.items.is_empty() {
                break;
            }
            // The step's batch: each item's tokens after what its state holds.
            let mut states: Vec<(u64, SequenceState)> = Vec::new();
            let mut chunks: Vec<Vec<u32>> = Vec::new();
            for it in &plan.items {
                let l = live.get_mut(&it.id).expect("scheduled requests are live");
                if l.state.len != it.context {
                    l.state = self.model.new_state(); // never expected: recompute from scratch
                }
                chunks.push(l.tokens[l.state.len..it.context + it.tokens].to_vec());
                states.push((it.id, std::mem::take(&mut l.state)));
            }
            let mut batch: Vec<(&[u32], &mut SequenceState)> =
                chunks.iter().map(|c| c.as_slice()).zip(states.iter_mut().map(|(_, s)| s)).collect();
            let result = self.model.forward(&mut batch, Numerics::Reference, false);
            drop(batch);
            let outs = match result {
                Ok((o, _)) => o,
                Err(e) => {
                    for (_, l) in live.drain() {
                        done.push(GenerateOutput { finish: FinishReason::Error, error: Some(e.to_string()), ..l.out });
                    }
                    break;
                }
            };
            let v = self.model.config().vocab_size;
            let mut outcomes = Vec::new();
            for ((it, (id, st)), o) in plan.items.iter().zip(states).zip(outs) {
                let l = live.get_mut(&id).expect("live");
                l.state = st;
                if !it.samples {
                    continue;
                }
                let last = &o.logits[o.logits.len() - v..];
                let generated = &l.tokens[l.req.prompt.len()..];
                let pos = l.tokens.len() as u64;
                match sample(last, generated, &l.req.sampling, pos, None) {
                    Some(s) => {
                        if l.out.tokens.is_empty() {
                            l.out.ttft_s = start.elapsed().as_secs_f64();
                        }
                        l.tokens.push(s.token);
                        l.out.tokens.push(s.token);
                        l.out.logprobs.push(s.logprob);
                        stats.generated_tokens += 1;
                        outcomes.push(Outcome { id, accepted: 1, stop: l.req.stop_token_ids.contains(&s.token) });
                    }
                    None => outcomes.push(Outcome { id, accepted: 1, stop: true }),
                }
            }
            match sched.complete(plan.step, &outcomes) {
                Ok(sampled) => {
                    for s in sampled.into_iter().filter(|s| s.finished) {
                        if let Some(l) = live.remove(&s.id) {
                            let stop = l.out.tokens.last().is_some_and(|t| l.req.stop_token_ids.contains(t));
                            done.push(GenerateOutput {
                                finish: if stop { FinishReason::Stop } else { FinishReason::Length },
                                ..l.out
                            });
                        }
                    }
                }
                Err(e) => {
                    for (_, l) in live.drain() {
                        done.push(GenerateOutput { finish: FinishReason::Error, error: Some(e.to_string()), ..l.out });
                    }
                    break;
                }
            }
        }
        stats.preemptions = sched.preemptions();
        stats.seconds = start.elapsed().as_secs_f64();
        // In request order.
        let pos: HashMap<u64, usize> = order.iter().enumerate().map(|(i, id)| (*id, i)).collect();
        done.sort_by_key(|o| pos.get(&o.id).copied().unwrap_or(usize::MAX));
        (done, stats)
    }
}
