//! `cargo xtask py-clients`: the official OpenAI and Anthropic Python clients, pinned, in an ignored
//! venv under target/ (reused when present). The server's client suite
//! (crates/server/tests/clients/test_clients.py) runs with this venv's python, which `cargo xtask
//! ci` passes to the tests as `$DEEPINFER_PYTHON`.

use std::path::PathBuf;

use anyhow::Result;

use crate::workspace;

const WHEELS: [&str; 3] = ["openai==3.63.0", "anthropic==2.17.0", "pytest==9.2.0"];

fn venv_dir() -> PathBuf {
    workspace::root().join("target/py-clients")
}

/// The venv's python, installing the pinned clients if they are not all there.
pub fn python() -> Result<PathBuf> {
    let venv = venv_dir();
    let py = venv.join("bin/python");
    let stamp = venv.join("wheels.txt");
    let want = WHEELS.join("\n");
    if py.is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == want) {
        return Ok(py);
    }
    workspace::pip_venv(&venv, &WHEELS, "the pinned Python API clients")?;
    std::fs::write(&stamp, want)?;
    Ok(py)
}
