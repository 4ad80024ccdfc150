//! A discrete-event simulator of a serving deployment: requests from a trace arrive, are routed to
//! prefill replicas, prefilled (reusing prefix-cache hits loaded from shared storage), handed to
//! decode replicas (their KV transferred) or decoded in place when co-located, each replica
//! stepping its own [`Scheduler`] with times from the [`CostModel`].

mod trace;

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use deepinfer_kv::{BlockHash, EvictionPolicy, PrefixCache};
use serde::Serialize;

use crate::balancer::{LoadBalancer, Policy, ReplicaLoad, Role};
use crate::cost::{CostModel, DeviceRates, ModelShape};
use crate::planner::{Scheduler, SchedulerConfig};
use crate::request::Request;
pub use trace::{load_azure_csv, load_mooncake, load_trace, SimRequest};

#[derive(Debug, Clone, Serialize)]
pub struct SimConfig {
    pub prefill: usize,
    pub decode: usize,
    /// Every replica prefills and decodes (prefill + decode replicas in total).
    pub colocated: bool,
    pub policy: Policy,
    /// Shared prefix cache capacity in blocks (None: unlimited; Some(0): no cache).
    pub prefix_cache_blocks: Option<usize>,
    pub block_tokens: usize,
    /// Bandwidth of loading cached KV from shared storage, per replica (bytes/s; 3FS-class).
    pub storage_bytes_per_s: f64,
    /// Bandwidth of moving a prompt's KV from a prefill to a decode replica (bytes/s).
    pub link_bytes_per_s: f64,
    pub scheduler: SchedulerConfig,
    pub shape: ModelShape,
    pub rates: DeviceRates,
    /// Arrival times are divided by this (2.0 = twice the trace's request rate).
    pub rate_scale: f64,
    pub ttft_slo_s: f64,
    pub tpot_slo_s: f64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            prefill: 1,
            decode: 1,
            colocated: false,
            policy: Policy::Ours,
            prefix_cache_blocks: None,
            block_tokens: 512,
            storage_bytes_per_s: 20e9,
            link_bytes_per_s: 50e9,
            scheduler: SchedulerConfig::default(),
            shape: ModelShape::v4_flash(),
            // A replica is a node of 8 H200s (V4-Flash's FP4 experts alone are ~150 GB).
            rates: DeviceRates::h200_node(8),
            rate_scale: 1.0,
            ttft_slo_s: 1.0,
            tpot_slo_s: 0.05,
        }
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles and the mean of `v` (all zero when empty).
    pub fn of(mut v: Vec<f64>) -> Percentiles {
        if v.is_empty() {
            return Percentiles { p50: 0.0, p90: 0.0, p99: 0.0, mean: 0.0 };
        }
        v.sort_by(f64::total_cmp);
        let p = |q: f64| v[((q * (v.len() - 1) as f64).round() as usize).min(v.len() - 1)];
        Percentiles { p50: p(0.5), p90: p(0.9), p99: p(0.99), mean: v.iter().sum::<f64>() / v.len() as f64 }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct SimReport {
    pub requests: usize,
    pub completed: usize,
    pub rejected: usize,
    /// Requests still in a scheduler when events ran out (a stall: should be 0).
    pub unfinished: usize,
    pub ttft_s: Percentiles,
    pub tpot_s: Percentiles,
    /// Share of all requests that completed with TTFT <= ttft_slo and TPOT <= tpot_slo.
    pub goodput: f64,
    pub prefix_hit_rate: f64,
    pub utilisation: f64,
    pub utilisation_per_replica: Vec<f64>,
    pub makespan_s: f64,
    pub preemptions: u64,
    pub config: SimConfig,
}

#[derive(Debug, Clone, Copy)]
enum Ev {
    Arrive(usize),
    Ready(usize, usize),
    StepDone(usize),
    KvArrive(usize, usize),
}

struct Timed {
    t: f64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Timed {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Timed {
    // Min-heap on (time, sequence).
    fn cmp(&self, o: &Self) -> Ordering {
        o.t.total_cmp(&self.t).then(o.seq.cmp(&self.seq))
    }
}

struct Replica {
    role: Role,
    sched: Scheduler,
    step: Option<(u64, f64)>,
    busy_s: f64,
}

#[derive(Default, Clone)]
struct Track {
    hit_tokens: usize,
    first_token: Option<f64>,
    finish: Option<f64>,
    rejected: bool,
    assigned_s: f64,
}

struct Sim<'a> {
    reqs: &'a [SimRequest],
    cfg: &'a SimConfig,
    now: f64,
    seq: u64,
    events: BinaryHeap<Timed>,
    replicas: Vec<Replica>,
    roles: Vec<Role>,
    balancer: LoadBalancer,
    cache: Option<PrefixCache>,
    track: Vec<Track>,
    /// Per replica: requests routed but not yet in its scheduler, and their predicted prefill s.
    assigned: Vec<(usize, f64)>,
}

impl Sim<'_> {
    fn push(&mut self, t: f64, ev: Ev) {
        self.seq += 1;
        self.events.push(Timed { t, seq: self.seq, ev });
    }

    fn loads(&self) -> Vec<ReplicaLoad> {
        self.replicas
            .iter()
            .zip(&self.assigned)
            .map(|(r, a)| ReplicaLoad {
                prefill_queue: r.sched.waiting() + r.sched.running() + a.0,
                prefill_backlog_s: r.sched.prefill_backlog_s() + a.1,
                active: r.sched.len(),
                kv_tokens: r.sched.kv_tokens(),
                kv_capacity_tokens: self.cfg.scheduler.kv_blocks * self.cfg.scheduler.block_tokens,
                max_active: self.cfg.scheduler.max_running,
            })
            .collect()
    }

    fn kick(&mut self, r: usize) {
        let rep = &mut self.replicas[r];
        if rep.step.is_some() || !rep.sched.has_work() {
            return;
        }
        let Ok(plan) = rep.sched.plan(self.now) else { return };
        if plan.items.is_empty() {
            // Nothing schedulable (memory); drop the empty step and wait for a completion.
            let _ = rep.sched.complete(plan.step, &[]);
            return;
        }
        let dt = plan.predicted_s.max(1e-6);
        rep.step = Some((plan.step, self.now));
        rep.busy_s += dt;
        self.push(self.now + dt, Ev::StepDone(r));
    }

    fn publish(&mut self, i: usize) {
        if let Some(c) = self.cache.as_mut() {
            let mut parent = None;
            for id in &self.reqs[i].hash_ids {
                let h = BlockHash::from_external(*id);
                if c.insert(parent, h, None).is_err() {
                    break;
                }
                parent = Some(h);
            }
        }
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Arrive(i) => {
                let req = &self.reqs[i];
                let hit = match self.cache.as_mut() {
                    Some(c) => {
                        let hs: Vec<BlockHash> = req.hash_ids.iter().map(|h| BlockHash::from_external(*h)).collect();
                        (c.longest_prefix(&hs) * self.cfg.block_tokens).min(req.input.saturating_sub(1))
                    }
                    None => 0,
                };
                self.track[i].hit_tokens = hit;
                let key = req.hash_ids.first().copied().unwrap_or(i as u64);
                let loads = self.loads();
                let Some(r) = self.balancer.route_prefill(&self.roles, &loads, key) else { return };
                let load_s = hit as f64 * self.cfg.shape.kv_bytes_per_token / self.cfg.storage_bytes_per_s;
                let work = self.replicas[r]
                    .sched
                    .cost()
                    .predict(&[crate::cost::StepItem { tokens: req.input - hit, context: hit }]);
                self.assigned[r].0 += 1;
                self.assigned[r].1 += work;
                self.track[i].assigned_s = work;
                self.push(self.now + load_s, Ev::Ready(i, r));
            }
            Ev::Ready(i, r) => {
                self.assigned[r].0 -= 1;
                self.assigned[r].1 = (self.assigned[r].1 - self.track[i].assigned_s).max(0.0);
                let req = &self.reqs[i];
                let out = if self.replicas[r].role == Role::Prefill { 1 } else { req.output.max(1) };
                let mut q = Request::new(i as u64, req.input.max(1), out, req.arrival);
                q.cached_tokens = self.track[i].hit_tokens;
                if self.replicas[r].sched.add(q).is_err() {
                    self.track[i].rejected = true;
                }
                self.kick(r);
            }
            Ev::KvArrive(i, d) => {
                let req = &self.reqs[i];
                let q = Request::new(i as u64, req.input.max(1), req.output.max(1), req.arrival);
                if self.replicas[d].sched.add_prefilled(q).is_err() {
                    self.track[i].rejected = true;
                }
                self.kick(d);
            }
            Ev::StepDone(r) => {
                let Some((step, _)) = self.replicas[r].step.take() else { return };
                let role = self.replicas[r].role;
                let sampled = self.replicas[r].sched.complete(step, &[]).unwrap_or_default();
                let now = self.now;
                for s in sampled {
                    let i = s.id as usize;
                    if self.track[i].first_token.is_none() {
                        // The prompt is computed: its blocks go to the shared prefix cache.
                        self.track[i].first_token = Some(now);
                        self.publish(i);
                    }
                    if !s.finished {
                        continue;
                    }
                    if role == Role::Prefill && self.reqs[i].output > 1 {
                        let loads = self.loads();
                        if let Some(d) = self.balancer.route_decode(&self.roles, &loads) {
                            let t = self.reqs[i].input as f64 * self.cfg.shape.kv_bytes_per_token
                                / self.cfg.link_bytes_per_s;
                            self.push(now + t, Ev::KvArrive(i, d));
                        }
                    } else {
                        self.track[i].finish = Some(now);
                    }
                }
                self.kick(r);
            }
        }
    }
}

/// Run the simulation of `reqs` under `cfg`.
pub fn simulate(reqs: &[SimRequest], cfg: &SimConfig) -> SimReport {
    let n = cfg.prefill + cfg.decode;
    let roles: Vec<Role> = (0..n)
        .map(|i| {
            if cfg.colocated {
                Role::Both
            } else if i < cfg.prefill {
                Role::Prefill
            } else {
                Role::Decode
            }
        })
        .collect();
    let replicas = roles
        .iter()
        .map(|role| Replica {
            role: *role,
            sched: Scheduler::new(cfg.scheduler.clone(), CostModel::new(cfg.shape, cfg.rates)),
            step: None,
            busy_s: 0.0,
        })
        .collect();
    let cache = match cfg.prefix_cache_blocks {
        Some(0) => None,
        Some(c) => Some(PrefixCache::new(c, EvictionPolicy::TailFirst)),
        None => Some(PrefixCache::new(usize::MAX, EvictionPolicy::TailFirst)),
    };
    let mut sim = Sim {
        reqs,
        cfg,
        now: 0.0,
        seq: 0,
        events: BinaryHeap::new(),
        replicas,
        roles,
        balancer: LoadBalancer::new(cfg.policy),
        cache,
        track: vec![Track::default(); reqs.len()],
        assigned: vec![(0, 0.0); n],
    };
    for (i, r) in reqs.iter().enumerate() {
        sim.push(r.arrival / cfg.rate_scale.max(1e-9), Ev::Arrive(i));
    }
    while let Some(Timed { t, ev, .. }) = sim.events.pop() {
        sim.now = t;
        sim.handle(ev);
    }
    let makespan = sim.now.max(1e-9);
    let (mut ttft, mut tpot, mut good) = (Vec::new(), Vec::new(), 0usize);
    let (mut input, mut hit) = (0f64, 0f64);
    for (i, tr) in sim.track.iter().enumerate() {
        input += reqs[i].input as f64;
        hit += tr.hit_tokens as f64;
        let arrival = reqs[i].arrival / cfg.rate_scale.max(1e-9);
        if let (Some(f), Some(e)) = (tr.first_token, tr.finish) {
            let t1 = f - arrival;
            let t2 = if reqs[i].output > 1 { (e - f) / (reqs[i].output - 1) as f64 } else { 0.0 };
            ttft.push(t1);
            tpot.push(t2);
            if t1 <= cfg.ttft_slo_s && t2 <= cfg.tpot_slo_s {
                good += 1;
            }
        }
    }
    let util: Vec<f64> = sim.replicas.iter().map(|r| r.busy_s / makespan).collect();
    SimReport {
        requests: reqs.len(),
        completed: ttft.len(),
        rejected: sim.track.iter().filter(|t| t.rejected).count(),
        unfinished: sim.replicas.iter().map(|r| r.sched.len()).sum(),
        goodput: good as f64 / reqs.len().max(1) as f64,
        ttft_s: Percentiles::of(ttft),
        tpot_s: Percentiles::of(tpot),
        prefix_hit_rate: if input > 0.0 { hit / input } else { 0.0 },
        utilisation: util.iter().sum::<f64>() / util.len().max(1) as f64,
        utilisation_per_replica: util,
        makespan_s: makespan,
        preemptions: sim.replicas.iter().map(|r| r.sched.preemptions()).sum(),
        config: cfg.clone(),
    }
}
