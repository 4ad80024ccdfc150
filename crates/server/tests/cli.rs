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

fn fixture(name: &str) -> String {
    format!("{}/../engine/tests/fixtures/tiny_v4/{name}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn check_parity_passes_on_a_fixture_and_prints_json() {
    let out = deepinfer(&["check-parity", "--model", &fixture("small")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(v["passed"], true);
    for k in ["logits_max_abs_err", "decode_max_abs_err", "layer_out_max_abs_err", "mtp_max_abs_err"] {
        assert!(v[k].as_f64().is_some_and(|e| e < 1e-4), "{k}: {}", v[k]);
    }
    for k in ["router_topk_mismatches", "indexer_topk_mismatches", "greedy_token_mismatches"] {
        assert_eq!(v[k], 0, "{k}");
    }
}

#[test]
fn check_parity_on_a_missing_directory_fails_with_its_path() {
    let out = deepinfer(&["check-parity", "--model", "/nonexistent/model-dir"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/model-dir"));
}

const TRACE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../kv/tests/fixtures/conversation_trace.jsonl");

#[test]
fn kv_replay_prints_the_hit_rate() {
    let out = deepinfer(&["kv", "replay", "--trace", TRACE, "--capacity-blocks", "20000"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["requests"], 12031);
    assert!(v["hit_rate"].as_f64().unwrap() >= 0.293);
    let bad = deepinfer(&["kv", "replay", "--trace", TRACE, "--eviction", "random"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("--eviction"));
}

#[test]
fn simulate_prints_latency_percentiles_and_goodput() {
    let out = deepinfer(&[
        "simulate",
        "--trace",
        TRACE,
        "--prefill",
        "2",
        "--decode",
        "2",
        "--max-requests",
        "500",
        "--rate-scale",
        "8",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["completed"], 500);
    for k in ["ttft_s", "tpot_s"] {
        for p in ["p50", "p90", "p99"] {
            assert!(v[k][p].as_f64().is_some(), "{k}.{p}");
        }
    }
    assert!(
        v["goodput"].as_f64().is_some()
            && v["utilisation"].as_f64().is_some()
            && v["prefix_hit_rate"].as_f64().is_some()
    );
    let bad = deepinfer(&["simulate", "--trace", TRACE, "--policy", "fastest"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("--policy"));
}
