//! `cargo xtask bench [--crate NAME]`: the criterion benchmarks, of one crate or all.

use anyhow::{bail, Result};
use xshell::cmd;

use crate::workspace;

const CRATES: [&str; 8] = ["kernels-ffi", "kv", "moe", "scheduler", "spec", "recipe", "engine", "server"];

pub fn run(krate: Option<String>) -> Result<()> {
    let sh = workspace::shell()?;
    match krate {
        None => cmd!(sh, "cargo bench --workspace --exclude xtask").run()?,
        Some(name) => {
            let short = name.strip_prefix("deepinfer-").unwrap_or(&name);
            if !CRATES.contains(&short) {
                bail!("unknown crate `{name}` (one of: {})", CRATES.join(", "));
            }
            let pkg = if short == "server" { "deepinfer".to_string() } else { format!("deepinfer-{short}") };
            cmd!(sh, "cargo bench -p {pkg}").run()?
        }
    }
    Ok(())
}
