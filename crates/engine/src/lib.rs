//! The DeepSeek-V4 model (configuration, weights, forward on the `kernels-ffi` op set), the
//! executor that runs varlen batches, the sampler, and the engine loop with its offline and
//! streaming APIs.
//!
//! Today: the configuration, the checkpoint loader and the CPU model with incremental decoding,
//! plus the parity check against the reference implementation's fixtures.

pub mod checkpoint;
pub mod config;
pub mod engine;
pub mod model;
pub mod parity;
pub mod quant;
pub mod sampler;
pub mod tiny;

pub use config::{AttentionKind, ConfigError, ModelConfig};
pub use engine::{Engine, EngineConfig, EngineStats, FinishReason, GenerateOutput, GenerateRequest};
pub use model::{Model, ModelError, Numerics, SeqOutput, SequenceState, Trace};
