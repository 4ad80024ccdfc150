//! The server's shared state: the engine handle, one event pump that routes the engine's events to
//! the request tasks, admission against `--max-queued`, and [`Flight`], one engine request in flight
//! (dropping it, as a disconnected client's stream does, cancels the request and frees its KV).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use deepinfer_engine::engine::{EngineHandle, Event};
use deepinfer_engine::{Engine, FinishReason, GenerateRequest};
use deepinfer_recipe::DeepseekTokenizer;
use parking_lot::Mutex;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::errors::{ApiError, Dialect, Kind};
use super::metrics::{Gauges, Metrics};
use crate::api_request::Defaults;

type Routes = Arc<Mutex<HashMap<u64, UnboundedSender<Event>>>>;

pub struct AppState {
    handle: Mutex<Option<EngineHandle>>,
    pub engine: Arc<Engine>,
    pub tok: DeepseekTokenizer,
    /// What `deepinfer serve`'s flags set.
    pub cfg: Settings,
    pub metrics: Metrics,
    pub ready: AtomicBool,
    next_id: AtomicU64,
    waiting: AtomicUsize,
    running: AtomicUsize,
    routes: Routes,
    events: crossbeam::channel::Sender<Event>,
}

pub struct Settings {
    pub served: String,
    pub api_key: Option<String>,
    pub max_queued: usize,
    pub max_context: usize,
    pub max_body: usize,
    pub default_thinking: bool,
    pub encoding: deepinfer_recipe::Encoding,
    pub defaults: Defaults,
}

impl AppState {
    pub fn start(engine: Engine, tok: DeepseekTokenizer, s: Settings) -> Arc<AppState> {
        let engine = Arc::new(engine);
        let handle = engine.clone().start();
        let routes: Routes = Default::default();
        let (events, rx) = crossbeam::channel::unbounded::<Event>();
        let pump = routes.clone();
        // One thread moves the engine's events to the request tasks; it ends with the last sender.
        std::thread::Builder::new()
            .name("event-pump".into())
            .spawn(move || {
                for e in rx.iter() {
                    let (id, done) = match &e {
                        Event::Admitted { id, .. } | Event::Token { id, .. } => (*id, false),
                        Event::Done(o) => (o.id, true),
                    };
                    let mut r = pump.lock();
                    if let Some(tx) = r.get(&id) {
                        let _ = tx.send(e);
                    }
                    if done {
                        r.remove(&id);
                    }
                }
            })
            .expect("spawning the event pump");
        Arc::new(AppState {
            handle: Mutex::new(Some(handle)),
            engine,
            tok,
            cfg: s,
            metrics: Metrics::default(),
            ready: AtomicBool::new(true),
            next_id: AtomicU64::new(1),
            waiting: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            routes,
            events,
        })
    }

    /// A fresh engine request id.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Submit `reqs` together (the `n` choices of one body), or refuse them all when the waiting
    /// requests already reach `--max-queued`.
    pub fn submit(self: &Arc<Self>, reqs: Vec<GenerateRequest>, dialect: Dialect) -> Result<Vec<Flight>, ApiError> {
        let n = reqs.len();
        let before = self.waiting.fetch_add(n, Ordering::SeqCst);
        if before >= self.cfg.max_queued {
            self.waiting.fetch_sub(n, Ordering::SeqCst);
            self.metrics.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(ApiError::new(
                dialect,
                Kind::Overloaded,
                format!("{before} requests are waiting (--max-queued {}); retry later", self.cfg.max_queued),
            ));
        }
        let guard = self.handle.lock();
        let Some(h) = guard.as_ref() else {
            self.waiting.fetch_sub(n, Ordering::SeqCst);
            return Err(ApiError::new(dialect, Kind::Overloaded, "the server is shutting down"));
        };
        let mut flights = Vec::with_capacity(n);
        for r in reqs {
            let (tx, rx) = unbounded_channel();
            self.routes.lock().insert(r.id, tx);
            self.metrics.prompt_tokens.fetch_add(r.prompt.len() as u64, Ordering::Relaxed);
            let stop_ids = r.stop_token_ids.clone();
            let (id, prompt_len) = (r.id, r.prompt.len());
            h.submit_to(r, self.events.clone());
            flights.push(Flight {
                id,
                state: self.clone(),
                rx,
                admitted: false,
                done: false,
                arrival: Instant::now(),
                last: None,
                stop_ids,
                prompt_len,
            });
        }
        Ok(flights)
    }

    /// Stop taking requests and finish the engine (after the HTTP server has drained).
    pub fn shutdown(&self) {
        self.ready.store(false, Ordering::SeqCst);
        if let Some(h) = self.handle.lock().take() {
            let stats = h.shutdown();
            eprintln!(
                "engine stopped: {} steps, {} prompt tokens, {} generated tokens",
                stats.steps, stats.prompt_tokens, stats.generated_tokens
            );
        }
        if let Err(e) = self.engine.flush() {
            eprintln!("warning: writing KV blocks to --kv-dir failed: {e}");
        }
    }

    pub fn gauges(&self) -> Gauges {
        let kv = self.engine.kv_stats();
        let u = self.engine.kv_usage();
        Gauges {
            running: self.running.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
            kv_usage: if u.capacity == 0 { 0.0 } else { u.used as f64 / u.capacity as f64 },
            kv_used_blocks: u.used,
            kv_cached_blocks: u.cached,
            prefix_queries: kv.lookups,
            prefix_hits: kv.hits,
        }
    }

    fn cancel(&self, id: u64) {
        if let Some(h) = self.handle.lock().as_ref() {
            h.cancel(id);
        }
    }
}

/// One engine request in flight. Its events arrive through [`Flight::next`], which also keeps the
/// gauges and latency histograms. Dropped before `Done`, it cancels the request.
pub struct Flight {
    pub id: u64,
    state: Arc<AppState>,
    rx: UnboundedReceiver<Event>,
    admitted: bool,
    done: bool,
    arrival: Instant,
    last: Option<Instant>,
    /// End-of-sequence tokens: the protocol output never shows them.
    pub stop_ids: Vec<u32>,
    pub prompt_len: usize,
}

impl Flight {
    /// The next event, None after `Done`.
    pub async fn next(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        let Some(e) = self.rx.recv().await else {
            // The engine went away without finishing this request.
            self.finish(FinishReason::Error);
            return None;
        };
        let now = Instant::now();
        let m = &self.state.metrics;
        match &e {
            Event::Admitted { .. } => {
                if !self.admitted {
                    self.admitted = true;
                    self.state.waiting.fetch_sub(1, Ordering::SeqCst);
                    self.state.running.fetch_add(1, Ordering::SeqCst);
                    m.queue.observe((now - self.arrival).as_secs_f64());
                }
            }
            Event::Token { .. } => {
                m.generation_tokens.fetch_add(1, Ordering::Relaxed);
                match self.last {
                    None => m.ttft.observe((now - self.arrival).as_secs_f64()),
                    Some(t) => m.itl.observe((now - t).as_secs_f64()),
                }
                self.last = Some(now);
            }
            Event::Done(o) => {
                m.e2e.observe((now - self.arrival).as_secs_f64());
                self.finish(o.finish);
            }
        }
        Some(e)
    }

    fn finish(&mut self, reason: FinishReason) {
        if self.done {
            return;
        }
        self.done = true;
        if self.admitted {
            self.state.running.fetch_sub(1, Ordering::SeqCst);
        } else {
            self.state.waiting.fetch_sub(1, Ordering::SeqCst);
        }
        let i = match reason {
            FinishReason::Stop => 0,
            FinishReason::Length => 1,
            FinishReason::Error => 2,
            FinishReason::Cancelled => 3,
        };
        self.state.metrics.finished[i].fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        if !self.done {
            self.state.cancel(self.id);
            self.state.routes.lock().remove(&self.id);
            self.finish(FinishReason::Cancelled);
        }
    }
}
