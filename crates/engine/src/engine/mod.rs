//! The engine loop: requests come in through a channel; a planner (the scheduler) plans each step
//! while the executor thread runs the previous one on the model (at most two steps in flight,
//! with optimistic token accounting); sampled tokens flow back as a per-request event stream.
//!
//! - Offline: [`Engine::generate`] runs a set of requests to completion.
//! - Streaming: [`Engine::start`] returns an [`EngineHandle`]; `submit` gives a receiver of
//!   [`Event`]s (tokens with streamed text, then the final output); `cancel` stops one request.
//!
//! Prefix reuse: at admission the prompt's longest cached prefix (chained block hashes; device
//! pool, then the durable tier) restores the compressed rows, and only the replay window before
//! the first uncached token plus the new tokens are computed (see [`ReplayMode`]).
//!
//! Deterministic by construction: the CPU model computes each token's row independently of its
//! batch neighbours (fixed-order reductions), and the sampler draws from a random number keyed by
//! (seed, position), so a seeded request gives the same tokens at any batch size. With
//! `batch_invariant` (`DEEPINFER_BATCH_INVARIANT=1`) an unseeded request gets seed 0 rather than a
//! random one, so identical requests give identical outputs.

mod exec;
mod kvcache;
mod spec;
mod text;

use std::sync::Arc;
use std::time::Instant;

use crossbeam::channel::{self, Receiver, Sender};
use deepinfer_kv::tier::CacheClass;
use deepinfer_recipe::{Constraint, DeepseekTokenizer, GrammarEnv};
use deepinfer_scheduler::{CostModel, DeviceRates, ModelShape, PreemptionMode, Request, Scheduler, SchedulerConfig};
use parking_lot::Mutex;
use serde::Serialize;

use crate::forward::ForwardModel;
use crate::model::Model;
use crate::sampler::SamplingParams;
use exec::{Admission, ExecMsg, Executor, StepDone};
pub use kvcache::{KvCache, KvDirConfig, KvStats, KvUsage, ReplayMode, Restore};
pub use text::{TextState, TextStep};

/// One generation request (token ids in, token ids and text out).
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops after any of these tokens (e.g. end of sentence).
    pub stop_token_ids: Vec<u32>,
    /// Generation stops when the text contains one of these; the text ends before it. Needs the
    /// engine's tokenizer.
    pub stop_strings: Vec<String>,
    /// A grammar the output must follow (token masks). Needs the engine's tokenizer.
    pub constraint: Option<Constraint>,
    /// The constraint starts after this token is generated (thinking mode: `</think>`); None:
    /// from the first output token.
    pub constraint_after: Option<u32>,
    pub priority: i32,
    /// Retention class of the prompt's blocks in the durable tier.
    pub cache_class: CacheClass,
    /// Separates prefix-cache namespaces (a tenant's blocks are never served to another).
    pub cache_salt: Option<String>,
}

impl GenerateRequest {
    pub fn new(id: u64, prompt: Vec<u32>, max_tokens: usize, sampling: SamplingParams) -> GenerateRequest {
        GenerateRequest {
            id,
            prompt,
            max_tokens,
            sampling,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            constraint: None,
            constraint_after: None,
            priority: 0,
            cache_class: CacheClass::Chat,
            cache_salt: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    Stop,
    Length,
    Error,
    Cancelled,
}

#[derive(Debug, Clone, Serialize)]
pub struct GenerateOutput {
    pub id: u64,
    pub prompt_tokens: usize,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    /// Per token, the most likely alternatives (token, logprob) when asked.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// The output text (without a matched stop string) when the engine has a tokenizer.
    pub text: Option<String>,
    pub finish: FinishReason,
    /// Why the request failed (only that request), when `finish` is `error`.
    pub error: Option<String>,
    /// Seconds from the engine call (or submission) to the first token.
    pub ttft_s: f64,
    /// Prompt tokens whose compressed rows came from the prefix cache.
    pub cached_tokens: usize,
    /// Cached tokens recomputed to rebuild the window state.
    pub replayed_tokens: usize,
    /// The seed the sampler used (the request's, or the one the engine chose).
    pub seed: u64,
}

impl GenerateOutput {
    /// The output of a request that failed before it produced anything (finish `error`).
    pub fn failed(r: &GenerateRequest, error: impl Into<String>) -> GenerateOutput {
        exec::failed_output(r, error.into())
    }
}

/// A request's stream: `Admitted` once, when the request starts running (its prefix-cache hit is
/// known then), `Token`s, and `Done` last. A request that fails before it runs gets only `Done`.
#[derive(Debug, Clone)]
pub enum Event {
    Admitted {
        id: u64,
        prompt_tokens: usize,
        /// Prompt tokens whose compressed rows came from the prefix cache.
        cached_tokens: usize,
    },
    Token {
        id: u64,
        token: u32,
        logprob: f32,
        top: Vec<(u32, f32)>,
        /// Newly decodable text (empty without a tokenizer, or while held back).
        text: String,
    },
    Done(GenerateOutput),
}

/// Engine limits and modes.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub token_budget: usize,
    pub max_running: usize,
    pub kv_blocks: usize,
    /// Minimum tokens per KV block (rounded up to a multiple of every compress ratio).
    pub block_tokens: usize,
    /// Longest prompt + output a request may ask for.
    pub max_context: usize,
    /// Blocks the prefix cache's pool holds (0: no prefix reuse).
    pub prefix_cache_blocks: usize,
    pub replay: ReplayMode,
    /// Durable tier for published blocks (shared between processes).
    pub kv_dir: Option<KvDirConfig>,
    /// Deterministic mode: unseeded requests get seed 0 (the CPU model is batch-invariant always).
    pub batch_invariant: bool,
    /// Drafts verified per decode step (speculative decoding with the model's MTP layer; 0: off).
    pub speculative_tokens: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            token_budget: 512,
            max_running: 64,
            kv_blocks: 4096,
            block_tokens: 64,
            max_context: 1 << 16,
            prefix_cache_blocks: 4096,
            replay: ReplayMode::Exact,
            kv_dir: None,
            batch_invariant: false,
            speculative_tokens: 0,
        }
    }
}

/// A configuration value that cannot be used, named.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("`{field}`: {problem}")]
pub struct EngineConfigError {
    pub field: String,
    pub problem: String,
}

impl EngineConfig {
    /// Apply DeepInfer's environment switches: `DEEPINFER_BATCH_INVARIANT`,
    /// `DEEPINFER_USE_NEXTN_DECODE` (drafts per step, 0: off),
    /// `DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE` (off | mask | compact) and
    /// `DEEPINFER_YOCO_PREFILL_KEEP_TOKENS` (required, and at least the window, when not off).
    pub fn with_env(self, window: usize) -> Result<EngineConfig, EngineConfigError> {
        self.with_vars(window, |k| std::env::var(k).ok())
    }

    pub fn with_vars(
        mut self,
        window: usize,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<EngineConfig, EngineConfigError> {
        let bad = |field: &str, problem: String| EngineConfigError { field: field.into(), problem };
        if let Some(v) = var("DEEPINFER_BATCH_INVARIANT") {
            self.batch_invariant = match v.trim() {
                "1" | "true" => true,
                "0" | "false" | "" => false,
                o => return Err(bad("DEEPINFER_BATCH_INVARIANT", format!("`{o}` is not 0 or 1"))),
            };
        }
        if let Some(v) = var("DEEPINFER_USE_NEXTN_DECODE") {
            self.speculative_tokens = v.trim().parse().map_err(|_| {
                bad("DEEPINFER_USE_NEXTN_DECODE", format!("`{v}` is not a draft count (0 turns speculation off)"))
            })?;
        }
        let mode = var("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE").unwrap_or_default();
        match mode.trim() {
            "" | "off" => {}
            "mask" | "compact" => {
                let keep = var("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS").ok_or_else(|| {
                    bad("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", format!("must be set when the mode is {mode}"))
                })?;
                let keep: usize = keep
                    .trim()
                    .parse()
                    .map_err(|_| bad("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", format!("`{keep}` is not a count")))?;
                if keep < window {
                    return Err(bad(
                        "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS",
                        format!("{keep} is less than the sliding window of {window}"),
                    ));
                }
                self.replay = ReplayMode::Bounded { keep };
            }
            o => {
                return Err(bad("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", format!("`{o}` is not off, mask or compact")))
            }
        }
        Ok(self)
    }
}

/// Counters of a `generate` call or an engine's lifetime.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EngineStats {
    pub steps: u64,
    /// Steps planned while the previous one was still executing.
    pub overlapped_steps: u64,
    pub prompt_tokens: usize,
    /// Tokens run through the model (prompt chunks, replays, recomputation, decodes).
    pub computed_tokens: usize,
    /// Prompt tokens served by the prefix cache, and how many of them were replayed.
    pub cached_tokens: usize,
    pub replayed_tokens: usize,
    pub prefix_hits: usize,
    pub generated_tokens: usize,
    /// Speculation: request-steps that verified drafts, drafts verified and drafts accepted.
    pub spec_steps: usize,
    pub drafted_tokens: usize,
    pub accepted_drafts: usize,
    pub preemptions: u64,
    pub seconds: f64,
    /// Seconds the planner spent planning (overlapped with execution).
    pub planning_s: f64,
    pub kv: KvStats,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("KV cache: {0}")]
    Kv(#[from] deepinfer_kv::KvError),
    #[error("tokenizer: {0}")]
    Recipe(#[from] deepinfer_recipe::RecipeError),
}

/// The tokenizer-dependent parts: text, stop strings, grammars.
pub(crate) struct TextTools {
    pub tok: DeepseekTokenizer,
    pub grammar: GrammarEnv,
}

pub struct Engine {
    model: Arc<dyn ForwardModel>,
    cfg: EngineConfig,
    kv: Option<KvCache>,
    text: Option<TextTools>,
    /// Seeds for unseeded requests (outside deterministic mode).
    seeds: Mutex<u64>,
}

enum Command {
    Submit(Box<GenerateRequest>, Sender<Event>, Instant),
    Cancel(u64),
}

impl Engine {
    /// An engine over the reference CPU model.
    pub fn new(model: Model, cfg: EngineConfig) -> Result<Engine, EngineError> {
        Engine::with_model(Arc::new(model), cfg)
    }

    /// An engine over any model ([`ForwardModel`]: the reference model, or the device model on the
    /// cpu backend or a GPU).
    pub fn with_model(model: Arc<dyn ForwardModel>, cfg: EngineConfig) -> Result<Engine, EngineError> {
        let block_tokens = model.block_tokens_at_least(cfg.block_tokens);
        let kv = KvCache::new(&*model, block_tokens, cfg.prefix_cache_blocks, cfg.replay, cfg.kv_dir.as_ref())?;
        let cfg = EngineConfig { block_tokens, ..cfg };
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        Ok(Engine { model, cfg, kv, text: None, seeds: Mutex::new(t ^ std::process::id() as u64) })
    }

    /// Decode text, honour stop strings and grammars with this tokenizer.
    pub fn with_tokenizer(mut self, tok: DeepseekTokenizer) -> Result<Engine, EngineError> {
        let grammar = GrammarEnv::new(&tok)?;
        self.text = Some(TextTools { tok, grammar });
        Ok(self)
    }

    pub fn model(&self) -> &dyn ForwardModel {
        &*self.model
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn kv_stats(&self) -> KvStats {
        self.kv.as_ref().map(|k| k.stats()).unwrap_or_default()
    }

    /// The prefix-cache pool's occupancy (all 0 without a prefix cache).
    pub fn kv_usage(&self) -> KvUsage {
        self.kv.as_ref().map(|k| k.usage()).unwrap_or_default()
    }

    /// Wait for the durable tier's write-back.
    pub fn flush(&self) -> Result<(), deepinfer_kv::KvError> {
        self.kv.as_ref().map_or(Ok(()), |k| k.flush())
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
        if self.text.is_none() && (!r.stop_strings.is_empty() || r.constraint.is_some()) {
            return Err("`stop`/`constraint`: this engine has no tokenizer (stop strings and grammars need one)".into());
        }
        r.sampling.validate().map_err(|e| e.to_string())
    }

    fn next_seed(&self) -> u64 {
        let mut s = self.seeds.lock();
        *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        crate::sampler::uniform(*s, 0).to_bits()
    }

    /// Run `requests` to completion. A bad request fails alone (finish `error`); the rest run.
    /// Outputs are in request order.
    pub fn generate(&self, requests: Vec<GenerateRequest>) -> (Vec<GenerateOutput>, EngineStats) {
        let (tx, rx) = channel::unbounded();
        let now = Instant::now();
        let streams: Vec<Receiver<Event>> = requests
            .into_iter()
            .map(|r| {
                let (etx, erx) = channel::unbounded();
                let _ = tx.send(Command::Submit(Box::new(r), etx, now));
                erx
            })
            .collect();
        drop(tx); // the loop drains what was submitted, then returns
        let stats = self.run(rx);
        let outs = streams
            .into_iter()
            .map(|rx| {
                rx.iter()
                    .find_map(|e| match e {
                        Event::Done(o) => Some(o),
                        Event::Token { .. } | Event::Admitted { .. } => None,
                    })
                    .expect("every submitted request ends with Done")
            })
            .collect();
        (outs, stats)
    }

    /// Start the loop on its own threads; submit requests and read their streams through the
    /// handle. Dropping the handle finishes the submitted requests, then stops.
    pub fn start(self: Arc<Self>) -> EngineHandle {
        let (tx, rx) = channel::unbounded();
        let thread = std::thread::Builder::new()
            .name("deepinfer-planner".into())
            .spawn(move || self.run(rx))
            .expect("spawning the engine thread");
        EngineHandle { tx: Some(tx), thread: Some(thread) }
    }

    /// The planner loop (this thread) with the executor on a scoped thread.
    fn run(&self, commands: Receiver<Command>) -> EngineStats {
        let start = Instant::now();
        let sched_cfg = SchedulerConfig {
            token_budget: self.cfg.token_budget,
            max_running: self.cfg.max_running,
            block_tokens: self.cfg.block_tokens,
            kv_blocks: self.cfg.kv_blocks,
            lookahead: if self.model.speculation().is_some() { self.cfg.speculative_tokens } else { 0 },
            step_time_budget: None,
            preemption: PreemptionMode::Recompute,
            aging_per_s: 1.0,
        };
        let sched = Scheduler::new(sched_cfg, CostModel::new(ModelShape::v4_flash(), DeviceRates::h200()));
        let (exec_tx, exec_rx) = channel::unbounded::<ExecMsg>();
        let (done_tx, done_rx) = channel::unbounded::<StepDone>();
        let mut stats = std::thread::scope(|s| {
            let executor = std::thread::Builder::new()
                .name("deepinfer-executor".into())
                .spawn_scoped(s, || Executor::new(self).run(exec_rx, done_tx))
                .expect("spawning the executor");
            let mut p = Planner { eng: self, sched, exec: exec_tx, in_flight: 0, stats: EngineStats::default(), start };
            p.run(&commands, &done_rx);
            drop(p.exec);
            let exec_stats = executor.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
            EngineStats {
                steps: p.stats.steps,
                overlapped_steps: p.stats.overlapped_steps,
                planning_s: p.stats.planning_s,
                preemptions: p.sched.preemptions(),
                ..exec_stats
            }
        });
        stats.seconds = start.elapsed().as_secs_f64();
        stats.kv = self.kv_stats();
        stats
    }
}

/// The scheduler's side of the loop.
struct Planner<'a> {
    eng: &'a Engine,
    sched: Scheduler,
    exec: Sender<ExecMsg>,
    in_flight: usize,
    stats: EngineStats,
    start: Instant,
}

impl Planner<'_> {
    fn run(&mut self, commands: &Receiver<Command>, done: &Receiver<StepDone>) {
        let mut open = true; // more commands may come
        loop {
            while open {
                match commands.try_recv() {
                    Ok(c) => self.command(c),
                    Err(channel::TryRecvError::Empty) => break,
                    Err(channel::TryRecvError::Disconnected) => open = false,
                }
            }
            if self.in_flight < 2 && self.sched.has_work() && self.plan_step() {
                continue;
            }
            if self.in_flight == 0 && !self.sched.has_work() {
                if !open {
                    return;
                }
                match commands.recv() {
                    Ok(c) => self.command(c),
                    Err(_) => open = false,
                }
                continue;
            }
            if self.in_flight == 0 {
                // Work that cannot be planned with nothing running: it never will be.
                self.fail_all("the scheduler cannot place the remaining requests (KV or batch limits)");
                continue;
            }
            if open {
                channel::select! {
                    recv(done) -> d => self.completed(d.expect("the executor outlives the planner")),
                    recv(commands) -> c => match c {
                        Ok(c) => self.command(c),
                        Err(_) => open = false,
                    },
                }
            } else {
                self.completed(done.recv().expect("the executor outlives the planner"));
            }
        }
    }

    /// Plan and send one step; false when the plan is empty.
    fn plan_step(&mut self) -> bool {
        let t = Instant::now();
        let plan = match self.sched.plan(self.start.elapsed().as_secs_f64()) {
            Ok(p) => p,
            Err(_) => return false, // two in flight: wait for one
        };
        self.stats.planning_s += t.elapsed().as_secs_f64();
        if plan.items.is_empty() && plan.preempted.is_empty() {
            let _ = self.sched.complete(plan.step, &[]);
            return false;
        }
        self.stats.steps += 1;
        if self.in_flight > 0 {
            self.stats.overlapped_steps += 1;
        }
        self.in_flight += 1;
        let _ = self.exec.send(ExecMsg::Step(plan));
        true
    }

    fn completed(&mut self, d: StepDone) {
        self.in_flight -= 1;
        let _ = self.sched.complete(d.step, &d.outcomes);
        for id in d.failed {
            self.sched.cancel(id);
        }
    }

    fn command(&mut self, c: Command) {
        match c {
            Command::Submit(r, events, t0) => {
                let fail = |e: String| {
                    let _ = events.send(Event::Done(exec::failed_output(&r, e)));
                };
                if let Err(e) = self.eng.check(&r) {
                    return fail(e);
                }
                let matcher = match (&r.constraint, &self.eng.text) {
                    (Some(c), Some(t)) => match t.grammar.matcher(c) {
                        Ok(m) => Some(m),
                        Err(e) => return fail(format!("`constraint`: {e}")),
                    },
                    _ => None,
                };
                let restore = self.eng.kv.as_ref().and_then(|kv| kv.lookup(&r.prompt, r.cache_salt.as_deref()));
                let mut q = Request::new(r.id, r.prompt.len(), r.max_tokens, self.start.elapsed().as_secs_f64());
                q.priority = r.priority;
                q.cached_tokens = restore.as_ref().map_or(0, |x| x.plan.replay_from);
                if let Err(e) = self.sched.add(q) {
                    return fail(e.to_string());
                }
                let seed =
                    r.sampling
                        .seed
                        .unwrap_or_else(|| if self.eng.cfg.batch_invariant { 0 } else { self.eng.next_seed() });
                let _ =
                    self.exec.send(ExecMsg::Admit(Box::new(Admission { req: *r, events, restore, matcher, seed, t0 })));
            }
            Command::Cancel(id) => {
                self.sched.cancel(id);
                let _ = self.exec.send(ExecMsg::Cancel(id));
            }
        }
    }

    fn fail_all(&mut self, why: &str) {
        let _ = self.exec.send(ExecMsg::FailAll(why.to_string()));
        for id in self.sched.request_ids() {
            self.sched.cancel(id);
        }
    }
}

/// A running engine (see [`Engine::start`]).
pub struct EngineHandle {
    tx: Option<Sender<Command>>,
    thread: Option<std::thread::JoinHandle<EngineStats>>,
}

impl EngineHandle {
    /// Queue a request; its events arrive on the returned receiver, ending with `Done`.
    pub fn submit(&self, req: GenerateRequest) -> Receiver<Event> {
        let (etx, erx) = channel::unbounded();
        if let Some(tx) = &self.tx {
            let _ = tx.send(Command::Submit(Box::new(req), etx, Instant::now()));
        }
        erx
    }

    /// Queue a request whose events go to `events` (several requests may share one channel:
    /// every event names its request).
    pub fn submit_to(&self, req: GenerateRequest, events: Sender<Event>) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Command::Submit(Box::new(req), events, Instant::now()));
        }
    }

    /// Stop a request; its stream ends with `Done` (finish `cancelled`).
    pub fn cancel(&self, id: u64) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Command::Cancel(id));
        }
    }

    /// Finish every submitted request, stop, and return the counters.
    pub fn shutdown(mut self) -> EngineStats {
        self.tx.take();
        self.thread.take().map(|t| t.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).unwrap_or_default()
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: std::collections::HashMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn deepinfer_environment_switches_map_onto_the_config() {
        let c = EngineConfig::default().with_vars(128, vars(&[])).unwrap();
        assert_eq!((c.replay, c.batch_invariant), (ReplayMode::Exact, false));
        let c = EngineConfig::default()
            .with_vars(
                128,
                vars(&[
                    ("DEEPINFER_BATCH_INVARIANT", "1"),
                    ("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact"),
                    ("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "140"),
                ]),
            )
            .unwrap();
        assert_eq!((c.replay, c.batch_invariant), (ReplayMode::Bounded { keep: 140 }, true));
        let field = |p: &[(&str, &str)]| EngineConfig::default().with_vars(128, vars(p)).unwrap_err().field;
        assert_eq!(field(&[("DEEPINFER_BATCH_INVARIANT", "yes")]), "DEEPINFER_BATCH_INVARIANT");
        assert_eq!(field(&[("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "x")]), "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE");
        assert_eq!(field(&[("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "mask")]), "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS");
        let short = [("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "mask"), ("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "100")];
        assert_eq!(field(&short), "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "below the 128-token window");
    }
}
