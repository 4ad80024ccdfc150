//! The API protocol layer: Chat Completions, Responses and Anthropic Messages bodies to validated
//! conversations, DeepSeek V4/V4.1 prompt encodings and token ids, sampling policy and output
//! constraints (an engine request); and engine tokens back to each protocol's stream events
//! (incremental detokenization, reasoning / content / DSML tool-call parsing). Knows nothing of
//! devices.
