//! Mixture-of-experts logic of DeepSeek-V4: score routing (sqrt-softplus, bias-corrected top-k,
//! normalisation and scaling), hash routing by `tid2eid`, expert placement and replication (EPLB),
//! and token dispatch/combine plans for expert parallelism. Logic over indices and weights only;
//! the CPU model and the CUDA kernels both use these definitions as their reference.
