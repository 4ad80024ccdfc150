//! `cargo xtask ci`: everything CI runs, in order of cost, each step timed.

use std::time::Instant;

use anyhow::Result;
use xshell::cmd;

use crate::{bindgen_cmd, kernels, py_clients, python_pkg, workspace};

pub fn run() -> Result<()> {
    let sh = workspace::shell()?;
    // A clean clone gains nothing from incremental caches (1.8 GB of the target dir); CI disks are tight.
    sh.set_var("CARGO_INCREMENTAL", "0");
    // Free disk before the builds, so a full disk shows up as such in the log.
    let _ = cmd!(sh, "df -h .").run();
    let start = Instant::now();
    let mut times = Vec::new();
    let mut timed = |name: &'static str, f: &mut dyn FnMut() -> Result<()>| -> Result<()> {
        workspace::step(name);
        let t = Instant::now();
        f()?;
        times.push((name, t.elapsed().as_secs_f32()));
        Ok(())
    };
    timed("fmt", &mut || Ok(cmd!(sh, "cargo fmt --all -- --check").run()?))?;
    timed("bindgen --check", &mut || bindgen_cmd::run(true))?;
    // Before any build: the CUDA-enabled builds below embed these fatbins.
    timed("kernels --check", &mut || kernels::run(true))?;
    timed("clippy (cpu)", &mut || {
        Ok(cmd!(sh, "cargo clippy --workspace --all-targets --locked -- -D warnings").run()?)
    })?;
    timed("clippy (cuda)", &mut || {
        Ok(cmd!(sh, "cargo clippy --workspace --all-targets --locked --features deepinfer/cuda -- -D warnings")
            .run()?)
    })?;
    // Tests run with the CUDA backend compiled in: without a GPU they exercise its error paths and
    // the GPU tests print that they were skipped.
    // The server's suite drives it with the official Python clients, pinned in a venv.
    let python = py_clients::python()?;
    timed("tests", &mut || {
        Ok(cmd!(sh, "cargo test --workspace --locked --features deepinfer/cuda")
            .env("DEEPINFER_PYTHON", &python)
            .run()?)
    })?;
    // The Python package: its wheel built as `pip install` builds it (dev profile, the tests' features)
    // and its pytest suite in a fresh venv (the tests step built the CLI it compares with).
    timed("python", &mut || python_pkg::run(true, true))?;
    let _ = cmd!(sh, "du -sh target").run();
    println!("\nci: all steps passed in {:.0}s", start.elapsed().as_secs_f32());
    for (name, secs) in times {
        println!("  {name:<16} {secs:>7.1}s");
    }
    Ok(())
}
