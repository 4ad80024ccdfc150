//! `cargo xtask build --accelerator nvidia|ascend|cpu [--release]`.
//!
//! cpu: a plain build. nvidia: kernels, then the workspace with the CUDA backend (the binary still
//! links no CUDA library: cudarc opens the driver at run time). ascend: finds the CANN toolkit,
//! compiles kernels/ascend with its AscendC compiler, then builds; without CANN it fails at once,
//! naming the places it looked.

use std::path::PathBuf;

use anyhow::{bail, Result};
use xshell::cmd;

use crate::{kernels, workspace};

const CANN_VARS: [&str; 2] = ["ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"];
const CANN_DEFAULT: &str = "/usr/local/Ascend/ascend-toolkit/latest";

pub fn run(accelerator: Option<String>, release: bool) -> Result<()> {
    let accel = accelerator
        .or_else(|| std::env::var("DEEPINFER_ACCELERATOR").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "cpu".to_string());
    let sh = workspace::shell()?;
    let profile: &[&str] = if release { &["--release"] } else { &[] };
    match accel.as_str() {
        "cpu" => {
            cmd!(sh, "cargo build --workspace {profile...}").run()?;
        }
        "nvidia" => {
            kernels::run(false)?;
            cmd!(sh, "cargo build --workspace --features deepinfer/cuda {profile...}").run()?;
        }
        "ascend" => {
            let toolkit = find_cann()?;
            compile_ascend(&toolkit)?;
            cmd!(sh, "cargo build --workspace {profile...}").run()?;
        }
        other => bail!("unknown accelerator `{other}` (expected nvidia, ascend or cpu; from --accelerator or $DEEPINFER_ACCELERATOR)"),
    }
    let dir = if release { "release" } else { "debug" };
    println!("built for {accel}: target/{dir}/deepinfer");
    Ok(())
}

/// The CANN toolkit root: $ASCEND_TOOLKIT_HOME, $ASCEND_HOME_PATH, then the default install path.
fn find_cann() -> Result<PathBuf> {
    let mut looked = Vec::new();
    for var in CANN_VARS {
        match std::env::var_os(var) {
            Some(v) if PathBuf::from(&v).is_dir() => return Ok(PathBuf::from(v)),
            Some(v) => looked.push(format!("${var}={} (not a directory)", PathBuf::from(v).display())),
            None => looked.push(format!("${var} (unset)")),
        }
    }
    if PathBuf::from(CANN_DEFAULT).is_dir() {
        return Ok(PathBuf::from(CANN_DEFAULT));
    }
    looked.push(format!("{CANN_DEFAULT} (absent)"));
    bail!(
        "the Ascend CANN toolkit was not found; looked at: {}. Install CANN or set ASCEND_TOOLKIT_HOME.",
        looked.join(", ")
    )
}

/// Compile kernels/ascend/*.cpp with CANN's AscendC compiler (ccec) into target/kernels-ascend.
fn compile_ascend(toolkit: &std::path::Path) -> Result<()> {
    let ccec = toolkit.join("compiler/ccec_compiler/bin/ccec");
    if !ccec.is_file() {
        bail!("CANN found at {}, but its AscendC compiler {} is missing", toolkit.display(), ccec.display());
    }
    let root = workspace::root();
    let out = root.join("target/kernels-ascend");
    std::fs::create_dir_all(&out)?;
    let sh = workspace::shell()?;
    let mut n = 0;
    for e in std::fs::read_dir(root.join("kernels/ascend"))? {
        let src = e?.path();
        if src.extension().is_some_and(|x| x == "cpp") {
            let obj = out.join(src.file_stem().unwrap_or_default()).with_extension("o");
            cmd!(sh, "{ccec} -xcce -O2 -std=c++17 --cce-aicore-arch=dav-c220 -c {src} -o {obj}").run()?;
            n += 1;
        }
    }
    println!("ascend: compiled {n} AscendC kernel files with {}", ccec.display());
    Ok(())
}
