//! The DeepSeek-V4 model (configuration, weights, forward on the `kernels-ffi` op set), the
//! executor that runs varlen batches, the sampler, and the engine loop with its offline and
//! streaming APIs.
