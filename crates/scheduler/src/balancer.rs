//! Routing requests across data-parallel replicas.
//!
//! DeepInfer's design (docs/DEEPINFER.md): prefixes live in shared storage, so prefill routing need
//! not follow the cache; it goes to the replica with the least estimated work queued. Decode
//! routing balances active requests and KV length (the two things a decode step's time grows
//! with). Round-robin, least-loaded by queue length and cache affinity are here for comparison.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
    /// Co-located: prefill and decode on the same replica.
    Both,
}

impl Role {
    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }
    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    RoundRobin,
    /// Fewest queued requests (prefill), fewest active requests (decode).
    LeastLoaded,
    /// Same first block, same replica (as if each replica had its own cache); decode least loaded.
    CacheAffinity,
    /// Least estimated prefill backlog (seconds, from the cost model); decode by active requests
    /// and KV length.
    Ours,
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Policy, String> {
        match s {
            "round-robin" | "rr" => Ok(Policy::RoundRobin),
            "least-loaded" => Ok(Policy::LeastLoaded),
            "cache-affinity" => Ok(Policy::CacheAffinity),
            "ours" | "default" => Ok(Policy::Ours),
            other => Err(format!("unknown policy `{other}` (round-robin, least-loaded, cache-affinity, ours)")),
        }
    }
}

/// What the balancer sees of a replica. The prefill queue and backlog include requests routed to
/// it that have not reached its scheduler yet (still loading their cached prefix).
#[derive(Debug, Clone, Copy, Default)]
pub struct ReplicaLoad {
    pub prefill_queue: usize,
    /// Predicted seconds of prefill work queued.
    pub prefill_backlog_s: f64,
    pub active: usize,
    pub kv_tokens: usize,
    pub kv_capacity_tokens: usize,
    pub max_active: usize,
}

pub struct LoadBalancer {
    policy: Policy,
    next: usize,
}

impl LoadBalancer {
    pub fn new(policy: Policy) -> LoadBalancer {
        LoadBalancer { policy, next: 0 }
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    fn round_robin(&mut self, eligible: &[usize]) -> Option<usize> {
        let r = *eligible.get(self.next % eligible.len().max(1))?;
        self.next = self.next.wrapping_add(1);
        Some(r)
    }

    /// The eligible replica with the smallest key; ties go to fewer active requests, then rotate
    /// (so simultaneous arrivals at an idle cluster spread instead of piling on replica 0).
    fn argmin(&mut self, eligible: &[usize], loads: &[ReplicaLoad], key: impl Fn(usize) -> f64) -> Option<usize> {
        let n = eligible.len().max(1);
        let start = self.next % n;
        let pick = (0..eligible.len())
            .map(|k| eligible[(start + k) % n])
            .min_by(|a, b| key(*a).total_cmp(&key(*b)).then(loads[*a].active.cmp(&loads[*b].active)));
        self.next = self.next.wrapping_add(1);
        pick
    }

    /// Replica for a new request's prefill. `prefix_key` identifies its first block (0 if none).
    pub fn route_prefill(&mut self, roles: &[Role], loads: &[ReplicaLoad], prefix_key: u64) -> Option<usize> {
        let eligible: Vec<usize> = (0..roles.len()).filter(|i| roles[*i].prefills()).collect();
        match self.policy {
            Policy::RoundRobin => self.round_robin(&eligible),
            Policy::LeastLoaded => self.argmin(&eligible, loads, |i| loads[i].prefill_queue as f64),
            Policy::CacheAffinity => eligible.get((prefix_key % eligible.len().max(1) as u64) as usize).copied(),
            Policy::Ours => self.argmin(&eligible, loads, |i| loads[i].prefill_backlog_s),
        }
    }

    /// Replica for a request entering decode.
    pub fn route_decode(&mut self, roles: &[Role], loads: &[ReplicaLoad]) -> Option<usize> {
        let eligible: Vec<usize> = (0..roles.len()).filter(|i| roles[*i].decodes()).collect();
        match self.policy {
            Policy::RoundRobin => self.round_robin(&eligible),
            Policy::LeastLoaded | Policy::CacheAffinity => self.argmin(&eligible, loads, |i| loads[i].active as f64),
            Policy::Ours => self.argmin(&eligible, loads, |i| {
                let l = &loads[i];
                l.active as f64 / l.max_active.max(1) as f64 + l.kv_tokens as f64 / l.kv_capacity_tokens.max(1) as f64
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_limit_where_work_goes() {
        let roles = [Role::Prefill, Role::Decode, Role::Both];
        let loads = [ReplicaLoad::default(); 3];
        for p in [Policy::RoundRobin, Policy::LeastLoaded, Policy::CacheAffinity, Policy::Ours] {
            let mut b = LoadBalancer::new(p);
            for k in 0..10 {
                assert_ne!(b.route_prefill(&roles, &loads, k), Some(1), "{p:?}");
                assert_ne!(b.route_decode(&roles, &loads), Some(0), "{p:?}");
            }
        }
    }

    #[test]
    fn ours_prefers_less_backlog_and_lighter_decode() {
        let roles = [Role::Both, Role::Both];
        let mut loads = [ReplicaLoad { max_active: 100, kv_capacity_tokens: 1000, ..Default::default() }; 2];
        loads[0].prefill_backlog_s = 2.0;
        loads[1].prefill_backlog_s = 0.5;
        loads[0].prefill_queue = 1; // one huge prompt
        loads[1].prefill_queue = 5; // five small ones
        let mut ours = LoadBalancer::new(Policy::Ours);
        assert_eq!(ours.route_prefill(&roles, &loads, 0), Some(1));
        assert_eq!(LoadBalancer::new(Policy::LeastLoaded).route_prefill(&roles, &loads, 0), Some(0));
        loads[0].active = 10;
        loads[1].active = 10;
        loads[0].kv_tokens = 900;
        assert_eq!(ours.route_decode(&roles, &loads), Some(1));
    }
}
