//! `deepinfer serve` as users run it: the real binary on a free port, driven by the official
//! `openai` and `anthropic` Python clients (tests/clients/test_clients.py, pytest; `cargo xtask
//! py-clients` installs them and `cargo xtask ci` runs with them) and by raw HTTP for what clients
//! cannot send (garbage bodies, disconnects, SIGTERM). Set DEEPINFER_SKIP_PY_CLIENTS=1 to skip the
//! Python part on a machine without them.

mod server_proc;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use server_proc::{post, raw, Server};

const CLIENT_FLAGS: &[&str] = &[
    "--api-key",
    "test-key",
    "--max-queued",
    "2",
    "--max-running",
    "2",
    "--max-body-bytes",
    "1000000",
    "--default-thinking",
    "off",
];

#[test]
fn official_python_clients_pass_their_suite() {
    if std::env::var("DEEPINFER_SKIP_PY_CLIENTS").is_ok_and(|v| v == "1") {
        println!("skipped: DEEPINFER_SKIP_PY_CLIENTS=1");
        return;
    }
    let srv = Server::start(CLIENT_FLAGS);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/test_clients.py");
    // `cargo xtask ci` passes the venv of `cargo xtask py-clients`; by hand, any python3 with them.
    let python = std::env::var("DEEPINFER_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = std::process::Command::new(&python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", script])
        .env("DEEPINFER_URL", srv.url())
        .output()
        .unwrap_or_else(|e| panic!("{python}: {e} (`cargo xtask py-clients` installs pytest, openai and anthropic)"));
    let text = format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    assert!(out.status.success(), "the client suite failed:\n{text}\nserver log:\n{}", srv.log());
}

#[test]
fn malformed_bodies_get_400_in_each_protocols_error_shape() {
    let srv = Server::start(&["--default-thinking", "off"]);
    let a = srv.addr();
    let model = "\"model\":\"deepinfer-tiny-v4\"";
    for (path, body, want) in [
        ("/v1/chat/completions", "{not json".to_string(), 400),
        ("/v1/chat/completions", "[1,2]".to_string(), 400),
        ("/v1/chat/completions", format!("{{{model},\"messages\":\"hi\"}}"), 400),
        (
            "/v1/chat/completions",
            format!("{{{model},\"messages\":[{{\"role\":\"user\",\"content\":\"x\"}}],\"max_tokens\":-5}}"),
            400,
        ),
        ("/v1/chat/completions", "{\"model\":\"other\",\"messages\":[]}".to_string(), 404),
        ("/v1/messages", format!("{{{model},\"max_tokens\":\"lots\",\"messages\":[]}}"), 400),
        ("/v1/completions", format!("{{{model},\"prompt\":[999999999]}}"), 400),
        ("/v1/completions", format!("{{{model},\"prompt\":\"x\",\"temperature\":1e400}}"), 400),
        (
            "/v1/chat/completions",
            format!("{{{model},\"messages\":[{{\"role\":\"user\",\"content\":\"\\ud800\"}}]}}"),
            400,
        ),
        ("/v1/nothing", "{}".to_string(), 404),
    ] {
        let (code, text) = post(&a, path, &body);
        assert_eq!(code, want, "{path} {body}: {text}");
        if path.starts_with("/v1/messages") {
            assert!(text.contains("\"type\":\"error\""), "Anthropic error shape: {text}");
        } else {
            assert!(text.contains("\"error\":{"), "OpenAI error shape: {text}");
        }
    }
    let deep = format!("{{{model},\"messages\":{}{}}}", "[".repeat(5000), "]".repeat(5000));
    assert_eq!(post(&a, "/v1/chat/completions", &deep).0, 400);
    // Still serving.
    let ok = format!("{{{model},\"messages\":[{{\"role\":\"user\",\"content\":\"Hi\"}}],\"max_tokens\":2}}");
    assert_eq!(post(&a, "/v1/chat/completions", &ok).0, 200);
}

#[test]
fn a_client_that_disconnects_mid_stream_is_cancelled_and_sigterm_drains() {
    let srv = Server::start(&["--default-thinking", "off"]);
    let a = srv.addr();
    // A prompt of several KV blocks, so the cancelled requests publish some; `ignore_eos`, so
    // none can finish by itself before its client leaves.
    let prompt = "Tell me everything. ".repeat(80);
    let body = format!(
        "{{\"model\":\"deepinfer-tiny-v4\",\"stream\":true,\"max_tokens\":4000,\"ignore_eos\":true,\
         \"prompt\":\"{prompt}\"}}"
    );
    for _ in 0..3 {
        let mut s = TcpStream::connect(&a).unwrap();
        let req = format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}", body.len());
        s.write_all(req.as_bytes()).unwrap();
        let mut first = [0u8; 512];
        let n = s.read(&mut first).unwrap();
        assert!(String::from_utf8_lossy(&first[..n]).contains("200 OK"));
        drop(s); // mid-stream
    }
    // Every dropped request ends as cancelled, long before its 4000 tokens.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (_, m) = raw(&a, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let cancelled = m
            .lines()
            .find(|l| l.starts_with("vllm:request_success_total") && l.contains("finished_reason=\"abort\""))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0);
        let gauge = |name: &str| {
            m.lines().find(|l| l.starts_with(name)).and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        };
        if cancelled == 3 && gauge("vllm:num_requests_running") == Some(0.0) {
            // KV back at its baseline: what is in use is what the prefix cache keeps.
            let used = gauge("deepinfer:kv_cache_used_blocks").unwrap();
            assert!(used > 0.0, "the prompts' blocks were published: {m}");
            assert_eq!(Some(used), gauge("deepinfer:kv_cache_cached_blocks"), "{m}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "not cancelled: {m}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // SIGTERM: an in-flight request still completes, then the process exits 0.
    let a2 = a.clone();
    let inflight = std::thread::spawn(move || {
        post(
            &a2,
            "/v1/chat/completions",
            "{\"model\":\"deepinfer-tiny-v4\",\"max_tokens\":40,\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}]}",
        )
    });
    std::thread::sleep(Duration::from_millis(300));
    let status = srv.terminate();
    let (code, text) = inflight.join().unwrap();
    assert_eq!(code, 200, "{text}");
    assert!(status.success(), "exit status {status:?}");
}

fn trace(name: &str) -> String {
    format!("{}/tests/fixtures/traces/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// `deepinfer bench-serve` against the real server; its JSON report.
fn bench_serve(srv: &Server, args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args(["bench-serve", "--url", &srv.url()])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stderr), srv.log());
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn bench_serve_replays_both_trace_formats_and_accounts_for_every_request() {
    let srv = Server::start(&["--default-thinking", "off", "--max-queued", "2", "--max-running", "2"]);
    // Mooncake (512-token prefix blocks scaled to 64), two in flight, then again one at a time.
    let mooncake = trace("mooncake_conversation_64.jsonl");
    let pass = |concurrency: &str| {
        let args = ["--trace", &mooncake, "--num-requests", "6", "--token-scale", "0.125", "--max-output-len", "4"];
        bench_serve(&srv, &[&args[..], &["--max-concurrency", concurrency]].concat())
    };
    let (r, r2) = (pass("2"), pass("1"));
    for r in [&r, &r2] {
        assert_eq!(r["completed"], 6, "{r}");
        assert_eq!((r["lost"].as_u64(), r["failed"].as_u64()), (Some(0), Some(0)), "{r}");
        assert_eq!(r["token_count_mismatches"], 0, "{r}");
        assert!(r["ttft_ms"]["p50"].as_f64().unwrap() > 0.0, "{r}");
    }
    // The second pass sends the first's prompts again: its hits cover at least the shared blocks.
    assert!(r2["prefix_hit_rate"].as_f64().unwrap() > 0.5, "{r2}");
    // Azure, 12 at once against --max-queued 2: every request either completes or gets 429.
    let azure = trace("azure_conv_64.csv");
    let r = bench_serve(
        &srv,
        &["--trace", &azure, "--num-requests", "12", "--token-scale", "0.25", "--max-output-len", "3"],
    );
    let (done, refused) = (r["completed"].as_u64().unwrap(), r["rejected_429"].as_u64().unwrap());
    assert_eq!(done + refused, 12, "{r}");
    assert!(done >= 2 && refused >= 1, "{r}");
    assert_eq!((r["lost"].as_u64(), r["failed"].as_u64(), r["duplicate_ids"].as_u64()), (Some(0), Some(0), Some(0)));
    assert_eq!(r["running_after"], 0.0, "{r}");
}
