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

fn deepinfer_stdin(args: &[&str], input: &str) -> std::process::Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn recipe_render_prints_prompt_ids_and_encoding() {
    let out = deepinfer_stdin(
        &["recipe", "render"],
        r#"{"model":"DeepSeek-V4-Pro","messages":[{"role":"user","content":"Hi"}]}"#,
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["encoding"], "v4");
    assert!(v["prompt"].as_str().unwrap().ends_with("<｜User｜>Hi<｜Assistant｜><think>"));
    assert!(v["token_ids"].as_array().is_some_and(|a| !a.is_empty()));
    // V4.1 needs <｜System｜>, which the vendored V4 tokenizer lacks: ids null, the reason given.
    let out = deepinfer_stdin(
        &["recipe", "render"],
        r#"{"model":"DeepSeek-V4.1-Flash","messages":[{"role":"user","content":"Hi"}]}"#,
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((v["encoding"].as_str(), v["token_ids"].is_null()), (Some("v4.1"), true));
    assert!(v["encode_error"].as_str().unwrap().contains("<｜System｜>"));
    // A conversion error prints the error body and exits 1.
    let out = deepinfer_stdin(&["recipe", "render"], r#"{"model":"nope","messages":[{"role":"user","content":"Hi"}]}"#);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("nope"));
}

#[test]
fn recipe_parse_prints_events_and_response() {
    let doc = r#"{"request":{"model":"DeepSeek-V4-Pro","messages":[{"role":"user","content":"Hi"}]},"model_output":["Thinking.</th","ink>Hello!"]}"#;
    let out = deepinfer_stdin(&["recipe", "parse", "--protocol", "chat"], doc);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let msg = &v["response"]["choices"][0]["message"];
    assert_eq!(msg["content"], "Hello!");
    assert_eq!(msg["reasoning_content"], "Thinking.");
    assert!(v["events"].as_array().unwrap().len() >= 3);
}

#[test]
fn generate_runs_the_builtin_model_and_names_bad_input() {
    let out = deepinfer(&["generate", "--prompt", "Hello", "--max-tokens", "5", "--output", "json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["tokens"].as_array().unwrap().len(), 5);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("the text is noise") && err.contains("generated tokens 5"), "{err}");
    let bad = deepinfer(&["generate", "--prompt", "Hello", "--temperature", "5", "--output", "json"]);
    assert!(!bad.status.success());
    let v: serde_json::Value = serde_json::from_slice(&bad.stdout).unwrap();
    assert!(v["error"].as_str().unwrap().contains("temperature"), "{v}");
    let missing = deepinfer(&["generate", "--prompt", "x", "--model", "/nonexistent/m"]);
    assert!(!missing.status.success() && String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/m"));
}
