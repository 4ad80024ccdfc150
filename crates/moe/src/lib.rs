//! Mixture-of-experts logic of DeepSeek-V4: score routing (sqrt-softplus, bias-corrected top-k,
//! normalisation and scaling), hash routing by `tid2eid`, expert placement and replication (EPLB),
//! and token dispatch/combine plans for expert parallelism: logic over indices and weights, the
//! reference of the CPU model and the CUDA kernels. [`layer`] composes one MoE sublayer from
//! `deepinfer-kernels-ffi`'s ops (routing, dispatch, grouped expert GEMMs, SwiGLU, combine), so it
//! runs on the CPU backend and on CUDA alike.
//!
//! ```
//! use deepinfer_moe::{Router, RoutingPolicy};
//! // 4 experts, top-2, scores rescaled to sum to 1.5 (V4-Flash's routed_scaling_factor).
//! let router = Router::new(4, 2, 1.5)?;
//! let logits = [0.1f32, 2.0, -1.0, 1.0];
//! let bias = [0.0f32, 0.0, 5.0, 0.0]; // selection only: expert 2 wins despite its low score
//! let r = router.route(&logits, RoutingPolicy::Score { bias: &bias })?;
//! assert_eq!(r.experts, vec![2, 1]);
//! assert!((r.weights.iter().sum::<f32>() - 1.5).abs() < 1e-6);
//! # Ok::<(), deepinfer_moe::RoutingError>(())
//! ```

pub mod layer;
mod routing;

pub use routing::{sqrt_softplus, Router, Routing, RoutingError, RoutingPolicy};
