//! The brain between requests and the model: request lifecycle, per-step token planning under a
//! token budget and KV capacity (chunked prefill by time budget, speculative lookahead,
//! preemption), the step cost model, load balancing over data-parallel prefill/decode replicas,
//! and a discrete-event simulator replaying serving traces. No CUDA types.
//!
//! ```
//! use deepinfer_scheduler::{CostModel, DeviceRates, ModelShape, Request, Scheduler, SchedulerConfig};
//! let mut s = Scheduler::new(SchedulerConfig::default(), CostModel::new(ModelShape::v4_flash(), DeviceRates::h200()));
//! s.add(Request::new(1, 3000, 2, 0.0)).unwrap();
//! let step = s.plan(0.0).unwrap();            // prefill (in chunks under the step-time budget)
//! assert!(step.tokens() > 0 && step.tokens() <= 3000);
//! let done = s.complete(step.step, &[]).unwrap();
//! # let _ = done;
//! ```

pub mod balancer;
pub mod cost;
pub mod planner;
pub mod request;
pub mod sim;

pub use balancer::{LoadBalancer, Policy, ReplicaLoad, Role};
pub use cost::{CostModel, DeviceRates, ModelShape, StepItem};
pub use planner::{
    ItemKind, Outcome, PreemptionMode, Sampled, Scheduled, Scheduler, SchedulerConfig, SchedulerError, StepPlan,
};
pub use request::{Phase, Request, RequestId};
