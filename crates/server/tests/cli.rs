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

const TRACE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../kv/tests/fixtures/conversation_trace.jsonl.gz");

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
    let n = v["tokens"].as_array().unwrap().len();
    assert!((1..=5).contains(&n), "{v}");
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("generated tokens {n}")));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("deepinfer-tiny-v4"), "the shipped trained model is the default: {err}");
    let bad = deepinfer(&["generate", "--prompt", "Hello", "--temperature", "5", "--output", "json"]);
    assert!(!bad.status.success());
    let v: serde_json::Value = serde_json::from_slice(&bad.stdout).unwrap();
    assert!(v["error"].as_str().unwrap().contains("temperature"), "{v}");
    let missing = deepinfer(&["generate", "--prompt", "x", "--model", "/nonexistent/m"]);
    assert!(!missing.status.success() && String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/m"));
}

fn json_lines(out: &std::process::Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn generate_follows_a_json_schema_a_regex_and_stop_strings() {
    let dir = std::env::temp_dir().join(format!("deepinfer-cli-schema-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let schema = dir.join("schema.json");
    std::fs::write(
        &schema,
        r#"{"type":"object","properties":{"name":{"type":"string","maxLength":6},"ok":{"type":"boolean"}},"required":["name","ok"],"additionalProperties":false}"#,
    )
    .unwrap();
    let args = ["generate", "--prompt", "Describe", "--max-tokens", "200", "--temperature", "1", "--seed", "3"];
    let out = deepinfer(&[&args[..], &["--json-schema", schema.to_str().unwrap(), "--output", "json"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v = &json_lines(&out)[0];
    let parsed: serde_json::Value = serde_json::from_str(v["text"].as_str().unwrap()).expect("the text is JSON");
    assert!(parsed["ok"].is_boolean() && parsed["name"].as_str().unwrap().chars().count() <= 6, "{parsed}");
    assert_eq!(v["finish"], "stop");
    let out = deepinfer(&[&args[..], &["--regex", "[0-9]{3}-[a-z]{2}", "--output", "json"]].concat());
    let text = json_lines(&out)[0]["text"].as_str().unwrap().to_string();
    assert!(text.len() == 6 && text.as_bytes()[3] == b'-', "{text}");
    // A stop string taken from the free output cuts it there (a seed whose answer is long enough).
    let sampled = |seed: &str, extra: &[&str]| {
        let args = ["generate", "--prompt", "Tell me a story.", "--max-tokens", "24", "--temperature", "1"];
        deepinfer(&[&args[..], &["--seed", seed, "--output", "json"], extra].concat())
    };
    let (seed, full) = (1..20)
        .map(|s| (s.to_string(), json_lines(&sampled(&s.to_string(), &[]))[0]["text"].as_str().unwrap().to_string()))
        .find(|(_, t)| t.chars().count() >= 12)
        .expect("some seed gives 12 characters");
    let stop: String = full.chars().skip(6).take(2).collect();
    let cut = sampled(&seed, &["--stop", &stop]);
    let v = &json_lines(&cut)[0];
    assert_eq!(v["text"].as_str().unwrap(), &full[..full.find(&stop).unwrap()]);
    assert_eq!(v["finish"], "stop");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_kv_dir_serves_the_next_run_and_bad_settings_are_named() {
    let dir = std::env::temp_dir().join(format!("deepinfer-cli-kv-{}", std::process::id()));
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(40);
    let run = || {
        let out = deepinfer(&[
            "generate",
            "--prompt",
            &long,
            "--max-tokens",
            "4",
            "--kv-dir",
            dir.to_str().unwrap(),
            "--output",
            "json",
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        json_lines(&out).remove(0)
    };
    let (cold, warm) = (run(), run());
    assert_eq!(cold["cached_tokens"], 0);
    assert!(warm["cached_tokens"].as_u64().unwrap() >= 256, "{warm}");
    assert_eq!(cold["tokens"], warm["tokens"], "a second process reuses the blocks and answers the same");
    let _ = std::fs::remove_dir_all(&dir);

    let env = |k: &str, v: &str| {
        Command::new(env!("CARGO_BIN_EXE_deepinfer"))
            .args(["generate", "--prompt", "x", "--max-tokens", "2"])
            .env(k, v)
            .output()
            .unwrap()
    };
    let bad = env("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "sometimes");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"));
    let bad = env("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"));
    let cuda = deepinfer(&["generate", "--prompt", "x", "--device", "cuda"]);
    assert!(!cuda.status.success() && String::from_utf8_lossy(&cuda.stderr).contains("--device cuda"));
}

#[test]
fn bench_prints_prefill_cached_and_decode_figures() {
    let out = deepinfer(&[
        "bench",
        "--prefill",
        "64,128",
        "--decode-batch",
        "1,4",
        "--decode-context",
        "32",
        "--decode-tokens",
        "8",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["prefill"].as_array().unwrap().len(), 2);
    assert_eq!(v["prefill_cached"].as_array().unwrap().len(), 4, "exact and bounded per length");
    assert!(v["prefill_cached"][2]["hit_blocks"].as_u64().unwrap() >= 2, "{}", v["prefill_cached"][2]);
    for d in v["decode"].as_array().unwrap() {
        assert!(
            d["tokens_per_s"].as_f64().unwrap() > 0.0
                && d["window_steps"].as_u64().unwrap() >= 2
                && d["itl_p99_ms"].as_f64().unwrap() >= d["itl_p50_ms"].as_f64().unwrap()
        );
    }
}

#[test]
fn bench_keeps_the_other_figures_when_a_decode_batch_cannot_be_measured() {
    // One token a request: no step has the whole batch decoding, so batch 2 cannot be measured.
    let out = deepinfer(&[
        "bench",
        "--prefill",
        "32",
        "--decode-batch",
        "2",
        "--decode-context",
        "16",
        "--decode-tokens",
        "1",
    ]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--decode-tokens"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["prefill"].as_array().unwrap().len(), 1, "the prefill figure is kept");
    assert!(v["decode"][0]["error"].as_str().unwrap().contains("--decode-tokens"), "{}", v["decode"]);
}

#[test]
fn random_model_names_bad_flags() {
    for (args, field) in [
        (vec!["random-model", "--out", "/tmp/deepinfer-rm-none", "--layers", "0"], "--layers"),
        (vec!["random-model", "--out", "/tmp/deepinfer-rm-none", "--shape", "v5"], "--shape"),
        (vec!["random-model", "--out", "/tmp/deepinfer-rm-none", "--experts", "2"], "--experts"),
    ] {
        let o = deepinfer(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(field), "{args:?}: {err}");
    }
}

#[test]
fn bench_spec_reports_draft_acceptance_and_names_bad_flags() {
    let dir = std::env::temp_dir().join(format!("bench-spec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prompts = dir.join("prompts.txt");
    std::fs::write(&prompts, "The SQLite database engine stores\n\ndef add(a, b):\\n    \n").unwrap();
    let out = deepinfer(&["bench-spec", "--k", "1,3", "--new-tokens", "12", "--prompts", prompts.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["prompts"], 2);
    let rows = v["fixed_k"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for r in rows {
        assert_eq!(r["tokens"], 24, "{r}");
        let tps = r["tokens_per_step"].as_f64().unwrap();
        assert!((1.0..=1.0 + r["k"].as_f64().unwrap()).contains(&tps), "{r}");
        let rate = r["draft_acceptance_rate"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&rate), "{r}");
    }
    let c = &v["confidence_scheduled"];
    assert_eq!(c["tokens"], 24, "{c}");
    assert!(c["est_tokens_per_s"].as_f64().unwrap() > 0.0, "{c}");
    assert_eq!(v["step_cost_s"].as_array().unwrap().len(), 4, "1..=k+1 tokens for k up to 3");
    let bad = deepinfer(&["bench-spec", "--new-tokens", "1"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--new-tokens"));
    std::fs::remove_dir_all(dir).unwrap();
}
