//! A request's lifecycle in the scheduler, in vLLM v1's single formulation: every request has
//! tokens it *wants* computed (prompt, then generated ones) and tokens *computed*; a step assigns
//! some of the difference. Chunked prefill, prefix-cache hits (computed from the start) and
//! speculative tokens are not special cases.

use serde::Serialize;

pub type RequestId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Not admitted yet (or preempted back to waiting).
    Waiting,
    /// Admitted, prompt not fully computed.
    Prefilling,
    /// Prompt computed; generating.
    Decoding,
    /// Evicted from device memory under pressure; will be readmitted.
    Preempted,
    Finished,
    Aborted,
}

/// What the scheduler knows of a request.
#[derive(Debug, Clone)]
pub struct Request {
    pub id: RequestId,
    pub prompt_tokens: usize,
    pub max_new_tokens: usize,
    /// Higher runs first; ties by arrival.
    pub priority: i32,
    /// Arrival time, seconds.
    pub arrival: f64,
    /// Prompt tokens whose KV a prefix-cache hit provides (computed at admission).
    pub cached_tokens: usize,
    pub phase: Phase,
    /// Tokens whose KV is computed (prompt + generated).
    pub computed: usize,
    /// Tokens generated so far (confirmed by step results).
    pub generated: usize,
    /// Times this request was preempted.
    pub preemptions: u32,
}

impl Request {
    pub fn new(id: RequestId, prompt_tokens: usize, max_new_tokens: usize, arrival: f64) -> Request {
        Request {
            id,
            prompt_tokens,
            max_new_tokens,
            priority: 0,
            arrival,
            cached_tokens: 0,
            phase: Phase::Waiting,
            computed: 0,
            generated: 0,
            preemptions: 0,
        }
    }

    /// Tokens whose KV should exist now: the prompt plus every generated token but the last
    /// (the newest token's KV is computed by the step that consumes it).
    pub fn wanted(&self) -> usize {
        self.prompt_tokens + self.generated.saturating_sub(1)
    }

    /// Tokens still to compute before the next sample.
    pub fn remaining(&self) -> usize {
        if self.generated == 0 {
            self.prompt_tokens - self.computed.min(self.prompt_tokens)
        } else {
            (self.prompt_tokens + self.generated).saturating_sub(self.computed).max(1)
        }
    }

    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Finished | Phase::Aborted)
    }
}
