//! Paged KV memory for DeepSeek-V4 sequences: fixed-size blocks for the shareable state (compressed
//! KV rows, indexer keys), per-sequence slots for the non-shareable state (window ring, compressor
//! partial buffers), block tables with RAII handles and copy-on-write forks; the prefix cache
//! (chained block hashes, tail-first eviction, bounded replay); and the tiered, durable KV store
//! (device -> host -> a local or shared directory). No CUDA types: device memory arrives through
//! `kernels-ffi` buffers.
