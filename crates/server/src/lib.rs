//! The `deepinfer` library: what the binary's commands and the Python bindings
//! (`crates/python`) share — loading a model with its engine (`setup`), API bodies as engine
//! requests (`api_request`), progress output, and the offline API (`offline`: submit prompts or
//! chat conversations, read their events and outputs).

pub mod api_request;
pub mod offline;
pub mod progress;
pub mod setup;
