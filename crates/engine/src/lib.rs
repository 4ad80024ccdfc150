//! The DeepSeek-V4 model (configuration, weights, forward on the `kernels-ffi` op set), the
//! executor that runs varlen batches, the sampler, and the engine loop with its offline and
//! streaming APIs.
//!
//! Today: the configuration, the checkpoint loader, the CPU model with incremental decoding and
//! its parity check against the reference implementation's fixtures, the sampler, and the engine
//! loop (`engine`: planner and executor threads, prefix reuse with replay, structured output,
//! streaming).

pub mod checkpoint;
pub mod config;
pub mod device_model;
pub mod engine;
pub mod forward;
pub mod model;
pub mod mtp;
pub mod parity;
pub mod quant;
pub mod sampler;
pub mod tiny;

pub use config::{AttentionKind, ConfigError, ModelConfig};
pub use engine::{
    Engine, EngineConfig, EngineHandle, EngineStats, Event, FinishReason, GenerateOutput, GenerateRequest, ReplayMode,
};
pub use forward::{ForwardModel, SeqState};
pub use model::{LogitRows, Model, ModelError, Numerics, SeqOutput, SequenceState, Trace};
