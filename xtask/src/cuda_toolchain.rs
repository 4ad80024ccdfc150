//! `cargo xtask cuda-toolchain`: the pinned CUDA 13.0 compiler.
//!
//! nvcc comes from five PyPI wheels pinned together (GPU.md: nvcc alone pulls mismatched newer
//! parts, and without cccl the CUDA 13 headers do not compile), installed into an ignored venv
//! under target/ and reused when present. An explicit `$NVCC`, or an `nvcc` on PATH, of the same
//! release wins. The toolkit is pinned to the oldest driver we target (580 <-> 13.0): PTX from a
//! newer nvcc fails there with CUDA_ERROR_UNSUPPORTED_PTX_VERSION.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use xshell::cmd;

use crate::workspace;

/// The release line `nvcc --version` must print.
pub const RELEASE: &str = "release 13.0,";

const WHEELS: [&str; 5] = [
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-cccl==13.0.85",
];

fn venv_dir() -> PathBuf {
    workspace::root().join("target/cuda-toolchain")
}

/// `nvcc --version` of `nvcc`, or None when it cannot run.
pub fn version(nvcc: &Path) -> Option<String> {
    let out = std::process::Command::new(nvcc).arg("--version").output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).to_string())
}

fn matches(nvcc: &Path) -> bool {
    version(nvcc).is_some_and(|v| v.contains(RELEASE))
}

fn venv_nvcc() -> Option<PathBuf> {
    let lib = venv_dir().join("lib");
    let py = std::fs::read_dir(&lib)
        .ok()?
        .filter_map(|e| e.ok())
        .find(|e| e.file_name().to_string_lossy().starts_with("python3"))?;
    let nvcc = py.path().join("site-packages/nvidia/cu13/bin/nvcc");
    nvcc.is_file().then_some(nvcc)
}

/// The nvcc to use, installing the pinned wheels if no matching one exists.
pub fn nvcc() -> Result<PathBuf> {
    if let Some(explicit) = std::env::var_os("NVCC") {
        let p = PathBuf::from(explicit);
        if !matches(&p) {
            bail!(
                "$NVCC={} is not CUDA 13.0 (`{}`); unset it to use the pinned toolchain",
                p.display(),
                version(&p).unwrap_or_else(|| "does not run".into()).trim()
            );
        }
        return Ok(p);
    }
    if let Ok(sh) = workspace::shell() {
        if let Ok(path) = cmd!(sh, "sh -c 'command -v nvcc'").quiet().ignore_stderr().read() {
            let p = PathBuf::from(path.trim());
            if !path.trim().is_empty() && matches(&p) {
                return Ok(p);
            }
        }
    }
    if let Some(p) = venv_nvcc().filter(|p| matches(p)) {
        return Ok(p);
    }
    install()?;
    venv_nvcc().filter(|p| matches(p)).context("the CUDA wheels installed, but their nvcc does not report release 13.0")
}

fn install() -> Result<()> {
    workspace::pip_venv(&venv_dir(), &WHEELS, "the pinned CUDA 13.0 compiler wheels")
}
