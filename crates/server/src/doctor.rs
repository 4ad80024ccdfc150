//! `deepinfer doctor`: what this binary was built with and what this machine offers.

use std::process::ExitCode;

use anyhow::Result;
use deepinfer_kernels_ffi::report::SystemReport;

pub fn run() -> Result<ExitCode> {
    let report = SystemReport::gather();
    print!("{report}");
    // A CUDA build that sees no driver is still a working CPU engine: report, do not fail.
    Ok(ExitCode::SUCCESS)
}
