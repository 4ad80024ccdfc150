//! The brain between requests and the model: request lifecycle, per-step token planning under a
//! token budget and KV capacity (chunked prefill by time budget, speculative lookahead,
//! preemption), the step cost model, load balancing over data-parallel prefill/decode replicas,
//! and a discrete-event simulator replaying serving traces. No CUDA types.
