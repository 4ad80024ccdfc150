//! Paths of the workspace and a shell rooted at it.

use std::path::PathBuf;

use anyhow::{Context, Result};
use xshell::Shell;

/// The workspace root (xtask lives one level below it).
pub fn root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

/// A shell whose current directory is the workspace root.
pub fn shell() -> Result<Shell> {
    let sh = Shell::new()?;
    sh.change_dir(root());
    Ok(sh)
}

/// Where compiled kernels go (`build.rs` of kernels-ffi reads the same place).
pub fn kernels_out() -> PathBuf {
    root().join("target/kernels")
}

/// Print a step header, so long CI logs show where time goes.
pub fn step(name: &str) {
    println!("\n==> {name}");
}

/// Create the venv `dir` (reusing one there) and pip-install `wheels` into it; `what` names them
/// in the progress line and the error.
pub fn pip_venv(dir: &std::path::Path, wheels: &[&str], what: &str) -> Result<()> {
    let sh = shell()?;
    println!("installing {what} into {} ...", dir.display());
    xshell::cmd!(sh, "python3 -m venv {dir}").run().context("python3 -m venv failed (install python3-venv)")?;
    let pip = dir.join("bin/pip");
    xshell::cmd!(sh, "{pip} install --disable-pip-version-check --progress-bar off {wheels...}")
        .run()
        .with_context(|| format!("pip could not install {what}"))?;
    Ok(())
}
