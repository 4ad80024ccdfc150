//! `cargo xtask python`: build the Python package's wheel (crates/python, maturin) and run its
//! pytest suite against it in a fresh venv, as a user who `pip install`s it would. The wheel is
//! built in the dev profile (the model's crates are optimised there too: see Cargo.toml), so it
//! shares target/debug with the test build; with `cuda`, the CUDA backend is compiled in (as CI's
//! tests have it), and the suite runs on the CPU.

use std::path::PathBuf;

use anyhow::{Context, Result};
use xshell::cmd;

use crate::workspace;

const MATURIN: &str = "maturin==1.16.0";
const PYTEST: &str = "pytest==9.2.0";

/// The venv with the pinned maturin (reused when present).
fn maturin() -> Result<PathBuf> {
    let venv = workspace::root().join("target/py-build");
    let bin = venv.join("bin/maturin");
    let stamp = venv.join("wheels.txt");
    if bin.is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == MATURIN) {
        return Ok(bin);
    }
    workspace::pip_venv(&venv, &[MATURIN], "maturin")?;
    std::fs::write(&stamp, MATURIN)?;
    Ok(bin)
}

/// `fresh_cli`: the CLI binary target/debug/deepinfer is already built from this tree (CI's tests
/// step built it); otherwise it is built here.
pub fn run(cuda: bool, fresh_cli: bool) -> Result<()> {
    let sh = workspace::shell()?;
    let root = workspace::root();
    let maturin = maturin()?;
    let wheels = root.join("target/wheels");
    let _ = std::fs::remove_dir_all(&wheels);
    let features: &[&str] = if cuda { &["--features", "cuda"] } else { &[] };
    cmd!(sh, "{maturin} build -m crates/python/Cargo.toml --profile dev --locked -i python3 -o {wheels} {features...}")
        .run()
        .context("building the wheel")?;
    let wheel = std::fs::read_dir(&wheels)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .context("maturin wrote no wheel")?;
    // A fresh venv each run: the suite sees only what the wheel installs.
    let venv = root.join("target/py-wheel-test");
    let _ = std::fs::remove_dir_all(&venv);
    let wheel_arg = wheel.display().to_string();
    workspace::pip_venv(&venv, &[&wheel_arg, PYTEST], "the deepinfer wheel and pytest")?;
    // The CLI of the same checkout, for the greedy-equality test (built by the tests step, or here).
    if !fresh_cli {
        cmd!(sh, "cargo build -p deepinfer --locked {features...}").run()?;
    }
    let py = venv.join("bin/python");
    let tmp = sh.create_temp_dir()?;
    let _dir = sh.push_dir(tmp.path()); // not the checkout: `import deepinfer` must find the installed wheel
    cmd!(sh, "{py} -m pytest -q -p no:cacheprovider {root}/crates/python/tests")
        .env("DEEPINFER_BIN", root.join("target/debug/deepinfer"))
        .run()
        .context("the Python package's tests failed")?;
    Ok(())
}
