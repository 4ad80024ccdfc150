//! The step planner. Each step it decides which requests run and how many tokens each computes,
//! under a token budget, a step-time budget (prefill chunks are cut so the step stays within it,
//! protecting decode latency) and the KV capacity in blocks.
//!
//! Order within a step: running decodes first (one token plus `lookahead` speculative slots),
//! then prefill chunks of admitted requests, then new admissions by effective priority (priority
//! plus aging per second waited, so nothing starves). A decode that finds no free KV preempts the
//! lowest-priority, most recently arrived running request (recompute: its KV is dropped and its
//! prompt and generated tokens are recomputed on readmission; swap: its KV moves to the host tier
//! and comes back on readmission).
//!
//! Overlap: step N+1 may be planned while step N runs. Planning counts N's tokens as computed and
//! expects each sampling request to produce one token (optimistic accounting); N's results then
//! correct it. With speculation (`lookahead` > 0) a decode is not planned while its previous step
//! is in flight, since the tokens that step accepts decide the next one's context (rejected speculative tokens give their KV back, finished requests drop out, and
//! any work N+1 planned for them is ignored).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use serde::Serialize;

use crate::cost::{CostModel, StepItem, StepLoad};
use crate::request::{Phase, Request, RequestId};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PreemptionMode {
    Recompute,
    Swap,
}

#[derive(Debug, Clone, Serialize)]
pub struct SchedulerConfig {
    /// Tokens (including speculative slots) one step may compute.
    pub token_budget: usize,
    /// Requests admitted at once.
    pub max_running: usize,
    pub block_tokens: usize,
    /// Device KV capacity, blocks.
    pub kv_blocks: usize,
    /// Speculative tokens verified per decode step.
    pub lookahead: usize,
    /// Steps that prefill stay within this many seconds (None: token budget only).
    pub step_time_budget: Option<f64>,
    pub preemption: PreemptionMode,
    /// Priority gained per second of waiting.
    pub aging_per_s: f64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            token_budget: 8192,
            max_running: 256,
            block_tokens: 512,
            kv_blocks: 20_000,
            lookahead: 0,
            // Below the 50 ms TPOT target with room for the step overhead: a step that carries a
            // prefill chunk must not stall the decodes riding in it.
            step_time_budget: Some(0.04),
            preemption: PreemptionMode::Recompute,
            aging_per_s: 1.0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ItemKind {
    Prefill,
    Decode,
}

/// One request's work in a step.
#[derive(Debug, Clone, Serialize)]
pub struct Scheduled {
    pub id: RequestId,
    pub kind: ItemKind,
    /// Tokens whose KV this step computes (excluding speculative slots).
    pub tokens: usize,
    /// Speculative draft tokens verified on top.
    pub spec: usize,
    /// Tokens already in KV before this step.
    pub context: usize,
    /// Whether the step samples a new token for this request.
    pub samples: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct StepPlan {
    pub step: u64,
    pub items: Vec<Scheduled>,
    pub preempted: Vec<RequestId>,
    pub predicted_s: f64,
}

impl StepPlan {
    pub fn tokens(&self) -> usize {
        self.items.iter().map(|i| i.tokens + i.spec).sum()
    }
    pub fn cost_items(&self) -> Vec<StepItem> {
        self.items.iter().map(|i| StepItem { tokens: i.tokens + i.spec, context: i.context }).collect()
    }
}

/// A token sampled for a request by a completed step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Sampled {
    pub id: RequestId,
    /// Tokens generated so far, including this step's.
    pub generated: usize,
    /// The request finished (stop, or max tokens) and left the scheduler.
    pub finished: bool,
}

/// The result of a step for one request.
#[derive(Debug, Clone, Copy)]
pub struct Outcome {
    pub id: RequestId,
    /// New tokens sampled (accepted drafts + 1); 0 for a prefill chunk that did not sample.
    pub accepted: usize,
    /// The request hit a stop condition (EOS, stop string) at this step.
    pub stop: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SchedulerError {
    TooLong { id: RequestId, blocks: usize, capacity: usize },
    Duplicate(RequestId),
    StepInFlight,
    UnknownStep(u64),
}

impl std::fmt::Display for SchedulerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SchedulerError::TooLong { id, blocks, capacity } => {
                write!(f, "request {id} needs {blocks} KV blocks, more than the {capacity} that exist")
            }
            SchedulerError::Duplicate(id) => write!(f, "request {id} was already added"),
            SchedulerError::StepInFlight => write!(f, "two steps are already in flight; report a result first"),
            SchedulerError::UnknownStep(s) => write!(f, "no step {s} is in flight"),
        }
    }
}

impl std::error::Error for SchedulerError {}

/// Request ids are small integers chosen by the caller; a multiplicative hash spreads them at a
/// fraction of SipHash's cost (planning does several lookups per running request per step).
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ *b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (v ^ 0x9E37_79B9_7F4A_7C15).wrapping_mul(0xBF58_476D_1CE4_E5B9).rotate_left(31);
    }
}

type IdMap<V> = HashMap<RequestId, V, BuildHasherDefault<IdHasher>>;

#[derive(Debug, Clone)]
struct Entry {
    req: Request,
    /// Steps in flight expected to sample a token for this request.
    pending_samples: usize,
    /// KV blocks held on the device.
    blocks: usize,
    /// KV held on the host after a swap preemption (tokens).
    swapped: usize,
    /// In `running` (else in `waiting`).
    running: bool,
}

impl Entry {
    fn known(&self) -> usize {
        self.req.prompt_tokens + self.req.generated + self.pending_samples
    }
    fn pending(&self) -> usize {
        self.known().saturating_sub(self.req.computed)
    }
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    cost: CostModel,
    entries: IdMap<Entry>,
    waiting: Vec<RequestId>,
    running: Vec<RequestId>,
    blocks_used: usize,
    step: u64,
    in_flight: Vec<StepPlan>,
    preemptions: u64,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, cost: CostModel) -> Scheduler {
        Scheduler {
            cfg,
            cost,
            entries: IdMap::default(),
            waiting: Vec::new(),
            running: Vec::new(),
            blocks_used: 0,
            step: 0,
            in_flight: Vec::new(),
            preemptions: 0,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn cost(&self) -> &CostModel {
        &self.cost
    }

    pub fn cost_mut(&mut self) -> &mut CostModel {
        &mut self.cost
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.cfg.block_tokens)
    }

    /// Queue a request. `req.cached_tokens` of its prompt are already in KV (a prefix hit).
    pub fn add(&mut self, mut req: Request) -> Result<(), SchedulerError> {
        if self.entries.contains_key(&req.id) {
            return Err(SchedulerError::Duplicate(req.id));
        }
        let need = self.blocks_for(req.prompt_tokens + req.max_new_tokens + self.cfg.lookahead);
        if need > self.cfg.kv_blocks {
            return Err(SchedulerError::TooLong { id: req.id, blocks: need, capacity: self.cfg.kv_blocks });
        }
        req.phase = Phase::Waiting;
        req.computed = 0;
        let id = req.id;
        self.entries.insert(id, Entry { req, pending_samples: 0, blocks: 0, swapped: 0, running: false });
        self.waiting.push(id);
        Ok(())
    }

    /// Queue a request whose prompt KV arrives already computed (disaggregated decode: the
    /// prefill replica produced it and its first token).
    pub fn add_prefilled(&mut self, mut req: Request) -> Result<(), SchedulerError> {
        req.generated = req.generated.max(1);
        let id = req.id;
        self.add(req)?;
        if let Some(e) = self.entries.get_mut(&id) {
            e.swapped = e.req.prompt_tokens; // arrives like a swapped-out request: KV to load
            e.req.phase = Phase::Preempted;
        }
        Ok(())
    }

    /// Drop a request now, wherever it is; its KV is freed at once.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        let Some(e) = self.entries.remove(&id) else { return false };
        self.blocks_used -= e.blocks;
        self.waiting.retain(|x| *x != id);
        self.running.retain(|x| *x != id);
        true
    }

    /// Requests not finished or aborted.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn blocks_used(&self) -> usize {
        self.blocks_used
    }

    /// KV tokens held by running requests.
    pub fn kv_tokens(&self) -> usize {
        self.running.iter().filter_map(|id| self.entries.get(id)).map(|e| e.req.computed).sum()
    }

    /// Predicted seconds of prefill work queued (waiting and unfinished prompts).
    pub fn prefill_backlog_s(&self) -> f64 {
        let items: Vec<StepItem> = self
            .entries
            .values()
            .filter(|e| e.pending() > 1)
            .map(|e| StepItem { tokens: e.pending(), context: e.req.computed })
            .collect();
        items.iter().map(|i| self.cost.predict(std::slice::from_ref(i))).sum()
    }

    /// Every queued request (waiting or running), in no particular order.
    pub fn request_ids(&self) -> Vec<RequestId> {
        self.entries.keys().copied().collect()
    }

    pub fn request(&self, id: RequestId) -> Option<&Request> {
        self.entries.get(&id).map(|e| &e.req)
    }

    fn effective_priority(&self, id: RequestId, now: f64) -> f64 {
        let r = &self.entries[&id].req;
        r.priority as f64 + self.cfg.aging_per_s * (now - r.arrival).max(0.0)
    }

    /// Order: highest effective priority first, then earliest arrival, then id.
    fn sort_by_priority(&self, ids: &mut [RequestId], now: f64) {
        let mut keyed: Vec<(f64, f64, RequestId)> =
            ids.iter().map(|id| (self.effective_priority(*id, now), self.entries[id].req.arrival, *id)).collect();
        keyed.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2)));
        for (slot, k) in ids.iter_mut().zip(keyed) {
            *slot = k.2;
        }
    }

    fn is_running(&self, id: RequestId) -> bool {
        self.entries.get(&id).is_some_and(|e| e.running)
    }

    fn set_running(&mut self, id: RequestId, on: bool) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.running = on;
        }
        if on {
            self.waiting.retain(|x| *x != id);
            self.running.push(id);
        } else {
            self.running.retain(|x| *x != id);
            self.waiting.push(id);
        }
    }

    /// Grow `id`'s allocation to cover `tokens` KV tokens; false when the blocks are not free.
    fn reserve(&mut self, id: RequestId, tokens: usize) -> bool {
        let need = self.blocks_for(tokens);
        let have = self.entries[&id].blocks;
        if need <= have {
            return true;
        }
        if self.blocks_used + (need - have) > self.cfg.kv_blocks {
            return false;
        }
        self.blocks_used += need - have;
        if let Some(e) = self.entries.get_mut(&id) {
            e.blocks = need;
        }
        true
    }

    fn release_to(&mut self, id: RequestId, tokens: usize) {
        let need = self.blocks_for(tokens);
        if let Some(e) = self.entries.get_mut(&id) {
            if e.blocks > need {
                self.blocks_used -= e.blocks - need;
                e.blocks = need;
            }
        }
    }

    fn in_plans(&self, id: RequestId) -> bool {
        self.in_flight.iter().any(|p| p.items.iter().any(|i| i.id == id))
    }

    /// Preempt the lowest-priority, latest-arrived running request ranked below `keep` (and not
    /// in a step in flight, whose KV the device is using, nor in `planned`, the step being planned:
    /// the executor drops a preempted request's state before it runs the step's items). Returns it.
    fn preempt_one(&mut self, keep: RequestId, now: f64, planned: &[Scheduled]) -> Option<RequestId> {
        let mut order: Vec<RequestId> = self.running.clone();
        self.sort_by_priority(&mut order, now);
        let rank = order.iter().position(|x| *x == keep).unwrap_or(order.len());
        let victim = order[rank.min(order.len())..]
            .iter()
            .copied()
            .rev()
            .find(|id| *id != keep && !self.in_plans(*id) && !planned.iter().any(|i| i.id == *id))?;
        self.set_running(victim, false);
        let mode = self.cfg.preemption;
        let e = self.entries.get_mut(&victim)?;
        self.blocks_used -= e.blocks;
        e.blocks = 0;
        e.req.preemptions += 1;
        self.preemptions += 1;
        e.req.phase = Phase::Preempted;
        match mode {
            PreemptionMode::Recompute => e.req.computed = 0,
            PreemptionMode::Swap => e.swapped = e.req.computed,
        }
        Some(victim)
    }

    /// Tokens of a chunk of up to `want` that `id` can get blocks for (preempting lower-ranked
    /// requests when `may_preempt`), reserving them.
    #[allow(clippy::too_many_arguments)] // the planner state it reads is all in self; the rest is this call's
    fn reserve_chunk(
        &mut self,
        id: RequestId,
        computed: usize,
        want: usize,
        may_preempt: bool,
        now: f64,
        planned: &[Scheduled],
        preempted: &mut Vec<RequestId>,
    ) -> usize {
        let mut n = want;
        loop {
            if n == 0 || self.reserve(id, computed + n) {
                return n;
            }
            if may_preempt {
                if let Some(v) = self.preempt_one(id, now, planned) {
                    preempted.push(v);
                    continue;
                }
            }
            // Whatever fits in the blocks it holds plus the free ones.
            let free = self.cfg.kv_blocks - self.blocks_used + self.entries[&id].blocks;
            n = (free * self.cfg.block_tokens).saturating_sub(computed).min(n - 1);
        }
    }

    /// Plan the next step at time `now`. At most two steps may be in flight (the running one and
    /// the one planned during it).
    pub fn plan(&mut self, now: f64) -> Result<StepPlan, SchedulerError> {
        if self.in_flight.len() >= 2 {
            return Err(SchedulerError::StepInFlight);
        }
        self.step += 1;
        let mut items: Vec<Scheduled> = Vec::new();
        let mut preempted = Vec::new();
        let mut budget = self.cfg.token_budget;

        // 1. Decodes. With speculation a decode waits for its previous step: how many tokens that
        // step accepts decides where the next one starts.
        let serial = self.cfg.lookahead > 0;
        let mut decoding: Vec<RequestId> = self
            .running
            .iter()
            .copied()
            .filter(|id| {
                let e = &self.entries[id];
                e.pending() == 1 && !(serial && e.pending_samples > 0)
            })
            .collect();
        // Priority order only matters when someone may be preempted: skip the sort when the free
        // blocks cover every decode's growth.
        let spec = self.cfg.lookahead;
        let growth: usize = decoding
            .iter()
            .map(|id| {
                let e = &self.entries[id];
                self.blocks_for(e.req.computed + 1 + spec).saturating_sub(e.blocks)
            })
            .sum();
        if growth > self.cfg.kv_blocks - self.blocks_used || decoding.len() * (1 + spec) > budget {
            self.sort_by_priority(&mut decoding, now);
        }
        for id in decoding {
            if !self.is_running(id) {
                continue; // preempted below for a higher-priority decode
            }
            let spec = self.cfg.lookahead.min(budget.saturating_sub(1));
            if budget == 0 {
                break;
            }
            let computed = self.entries[&id].req.computed;
            while !self.reserve(id, computed + 1 + spec) {
                match self.preempt_one(id, now, &items) {
                    Some(v) => preempted.push(v),
                    None => break,
                }
            }
            if self.blocks_for(computed + 1 + spec) > self.entries[&id].blocks {
                continue; // nothing left to preempt: this request waits a step
            }
            budget -= 1 + spec;
            items.push(Scheduled { id, kind: ItemKind::Decode, tokens: 1, spec, context: computed, samples: true });
        }
        let mut step_load = items.iter().fold(StepLoad::default(), |a, i| {
            a.plus(self.cost.item_load(StepItem { tokens: 1 + i.spec, context: i.context }))
        });

        // 2. Prefill chunks of admitted requests, then 3. admissions.
        let mut prefilling: Vec<RequestId> =
            self.running.iter().copied().filter(|id| self.entries[id].pending() > 1).collect();
        self.sort_by_priority(&mut prefilling, now);
        let mut admit = self.waiting.clone();
        self.sort_by_priority(&mut admit, now);
        for (id, new) in prefilling.into_iter().map(|i| (i, false)).chain(admit.into_iter().map(|i| (i, true))) {
            if budget == 0 {
                break;
            }
            if new && self.running.len() >= self.cfg.max_running {
                break;
            }
            if !new && !self.is_running(id) || new && preempted.contains(&id) {
                continue; // preempted earlier in this step by a higher-ranked request
            }
            // Readmission starts from a prefix hit or swapped-out KV.
            let computed = if new {
                let e = &self.entries[&id];
                e.swapped.max(e.req.cached_tokens.min(e.known().saturating_sub(1)))
            } else {
                self.entries[&id].req.computed
            };
            let pending = self.entries[&id].known().saturating_sub(computed);
            if new && pending <= 1 {
                // Its KV is all there (swapped back, or prefilled by another replica): it decodes
                // in this very step. (Admitting it without work would leave an empty step.)
                let spec = self.cfg.lookahead.min(budget.saturating_sub(1));
                if !self.reserve(id, computed + 1 + spec) {
                    break;
                }
                let e = self.entries.get_mut(&id).expect("waiting ids are entries");
                e.req.computed = computed;
                e.swapped = 0;
                e.req.phase = Phase::Decoding;
                self.set_running(id, true);
                budget -= 1 + spec;
                step_load = step_load.plus(self.cost.item_load(StepItem { tokens: 1 + spec, context: computed }));
                items.push(Scheduled { id, kind: ItemKind::Decode, tokens: 1, spec, context: computed, samples: true });
                continue;
            }
            let mut n = pending.min(budget);
            if let Some(t) = self.cfg.step_time_budget {
                n = self.cost.chunk_for_budget_load(step_load, computed, n, t);
            }
            // Running prefills may preempt lower-ranked requests; admissions only take free blocks.
            let n = self.reserve_chunk(id, computed, n, !new, now, &items, &mut preempted);
            if new {
                if n == 0 && pending > 1 {
                    self.release_to(id, 0);
                    break; // FCFS: a later, smaller request does not overtake for memory
                }
                let e = self.entries.get_mut(&id).expect("waiting ids are entries");
                e.req.computed = computed;
                e.swapped = 0;
                e.req.phase = Phase::Prefilling;
                self.set_running(id, true);
            }
            if n == 0 || !self.is_running(id) {
                continue;
            }
            budget -= n;
            step_load = step_load.plus(self.cost.item_load(StepItem { tokens: n, context: computed }));
            items.push(Scheduled {
                id,
                kind: ItemKind::Prefill,
                tokens: n,
                spec: 0,
                context: computed,
                samples: n == pending,
            });
        }

        // Optimistic accounting: the planned tokens are computed, sampling items will sample.
        for it in &items {
            if let Some(e) = self.entries.get_mut(&it.id) {
                e.req.computed += it.tokens;
                if it.samples {
                    e.pending_samples += 1;
                    if e.req.phase == Phase::Prefilling {
                        e.req.phase = Phase::Decoding;
                    }
                }
            }
        }
        let plan = StepPlan { step: self.step, predicted_s: self.cost.predict_load(step_load), items, preempted };
        self.in_flight.push(plan.clone());
        Ok(plan)
    }

    /// Apply step `step`'s results (requests without an outcome accept one token); returns the
    /// tokens sampled, and which requests finished (stop, or max tokens).
    pub fn complete(&mut self, step: u64, outcomes: &[Outcome]) -> Result<Vec<Sampled>, SchedulerError> {
        let pos = self.in_flight.iter().position(|p| p.step == step).ok_or(SchedulerError::UnknownStep(step))?;
        let plan = self.in_flight.remove(pos);
        let by_id: IdMap<Outcome> = outcomes.iter().map(|o| (o.id, *o)).collect();
        let mut finished = Vec::new();
        let mut sampled = Vec::new();
        for it in &plan.items {
            let Some(e) = self.entries.get_mut(&it.id) else { continue }; // cancelled or finished since
            if !it.samples {
                continue;
            }
            e.pending_samples = e.pending_samples.saturating_sub(1);
            let o = by_id.get(&it.id).copied().unwrap_or(Outcome { id: it.id, accepted: 1, stop: false });
            let accepted = o.accepted.clamp(1, 1 + it.spec);
            // Accepted drafts' KV was computed by the verify step; rejected drafts' is dropped.
            e.req.computed += accepted - 1;
            e.req.generated += accepted;
            let done = o.stop || e.req.generated >= e.req.max_new_tokens;
            sampled.push(Sampled { id: it.id, generated: e.req.generated, finished: done });
            if done {
                finished.push(it.id);
            } else {
                let c = e.req.computed;
                self.release_to(it.id, c);
            }
        }
        if !finished.is_empty() {
            for id in &finished {
                if let Some(e) = self.entries.remove(id) {
                    self.blocks_used -= e.blocks;
                }
            }
            let gone: std::collections::HashSet<RequestId> = finished.into_iter().collect();
            self.running.retain(|x| !gone.contains(x));
            self.waiting.retain(|x| !gone.contains(x));
        }
        Ok(sampled)
    }

    /// Preemptions so far.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Check the scheduler's bookkeeping (tests).
    pub fn check_invariants(&self) -> Result<(), String> {
        let held: usize = self.entries.values().map(|e| e.blocks).sum();
        if held != self.blocks_used {
            return Err(format!("blocks: held {held} != used {}", self.blocks_used));
        }
        if self.blocks_used > self.cfg.kv_blocks {
            return Err(format!("blocks used {} > capacity {}", self.blocks_used, self.cfg.kv_blocks));
        }
        for (id, e) in &self.entries {
            let (w, r) = (self.waiting.contains(id), self.running.contains(id));
            if w == r || r != e.running {
                return Err(format!("request {id} waiting={w} running={r} flag={}", e.running));
            }
        }
        if self.waiting.len() + self.running.len() != self.entries.len() {
            return Err("a queued id has no entry (or is listed twice)".into());
        }
        for id in &self.waiting {
            if self.entries[id].blocks != 0 {
                return Err(format!("waiting request {id} holds blocks"));
            }
        }
        Ok(())
    }
}
