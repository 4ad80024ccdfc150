//! The `deepinfer` binary, run as a user would.

use std::process::Command;

fn deepinfer(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_deepinfer")).args(args).output().expect("run deepinfer")
}

#[test]
fn doctor_reports_build_and_driver() {
    let out = deepinfer(&["doctor"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("build accelerator: "), "{text}");
    assert!(text.contains("driver: "), "{text}");
    assert!(text.contains("embedded kernels: "), "{text}");
}

#[test]
fn unknown_subcommand_fails_with_usage() {
    let out = deepinfer(&["frobnicate"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("Usage"));
}
