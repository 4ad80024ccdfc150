//! `deepinfer serve`: the engine behind OpenAI- and Anthropic-compatible HTTP endpoints (tokio +
//! axum). Protocol work (prompt rendering, reasoning and tool-call parsing, stream events) is the
//! `recipe` crate's; this module is transport, admission, cancellation and metrics.
//!
//! Lifecycle: load the model, start the engine, bind, print `listening on http://ADDR` (tests read
//! it to find a `--port 0` server), serve; on SIGTERM or Ctrl-C stop accepting, let in-flight
//! requests finish, stop the engine, exit 0.

mod completions;
mod errors;
mod metrics;
mod protocol;
mod request;
mod routes;
mod state;

use std::process::ExitCode;

use anyhow::{bail, Context, Result};

use crate::api_request::Defaults;
use crate::setup::{self, EngineArgs};
use state::{AppState, Settings};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    engine: EngineArgs,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (printed on stderr).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Clients must send it (`Authorization: Bearer KEY` or `x-api-key: KEY`). Also
    /// DEEPINFER_API_KEY.
    #[arg(long)]
    api_key: Option<String>,
    /// Requests accepted but not yet running past which new ones get 429 (Anthropic: 529).
    #[arg(long, default_value_t = 256)]
    max_queued: usize,
    /// The model name clients send (default: the model directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Thinking mode for requests that do not say (on: DeepSeek's policy, which samples at
    /// temperature 1.0 whatever a request asks; the log warns when it overrides a field).
    #[arg(long, default_value = "on")]
    default_thinking: String,
    /// The checkpoint's prompt encoding: v4 or v4.1.
    #[arg(long, default_value = "v4")]
    encoding: String,
    /// Largest request body.
    #[arg(long, default_value_t = 16 << 20)]
    max_body_bytes: usize,
}

pub fn run(a: Args) -> Result<ExitCode> {
    let default_thinking = match a.default_thinking.as_str() {
        "on" => true,
        "off" => false,
        o => bail!("--default-thinking: `{o}` is not on or off"),
    };
    let encoding = match a.encoding.as_str() {
        "v4" => deepinfer_recipe::Encoding::V4,
        "v4.1" => deepinfer_recipe::Encoding::V41,
        o => bail!("--encoding: `{o}` is not v4 or v4.1"),
    };
    if a.max_queued == 0 {
        bail!("--max-queued must be positive");
    }
    let api_key = a.api_key.clone().or_else(|| std::env::var("DEEPINFER_API_KEY").ok().filter(|k| !k.is_empty()));
    let loaded = setup::load(&a.engine)?;
    let served = match &a.served_model_name {
        Some(n) => n.clone(),
        None => loaded.dir.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_else(|| "deepinfer".into()),
    };
    let settings = Settings {
        served: served.clone(),
        api_key,
        max_queued: a.max_queued,
        max_context: a.engine.max_context,
        max_body: a.max_body_bytes,
        default_thinking,
        encoding,
        defaults: Defaults { repetition_penalty: 1.0, ..Default::default() },
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the runtime")?;
    rt.block_on(async move {
        let state = AppState::start(loaded.engine, loaded.tok, settings);
        let addr = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr()?;
        eprintln!("listening on http://{local} (model `{served}`; OpenAI and Anthropic APIs under /v1)");
        axum::serve(listener, routes::router(state.clone()))
            .with_graceful_shutdown(shutdown_signal(state.clone()))
            .await
            .context("serving")?;
        eprintln!("stopped accepting; in-flight requests finished");
        tokio::task::spawn_blocking(move || state.shutdown()).await?;
        Ok(ExitCode::SUCCESS)
    })
}

async fn shutdown_signal(state: std::sync::Arc<AppState>) {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("shutting down: no new requests; finishing the ones in flight");
    state.ready.store(false, std::sync::atomic::Ordering::SeqCst);
}
