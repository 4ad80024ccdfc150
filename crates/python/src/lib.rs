//! `deepinfer._deepinfer`: the engine for Python. One class, `Engine`, over
//! [`deepinfer::offline::Offline`]: submit prompts or chat bodies, wait for outputs or read a
//! request's events one by one. The GIL is released while the engine works, and a wait checks
//! for signals every 50 ms (Ctrl-C cancels the requests it waits for). Outputs cross as JSON
//! text; the Python package (`python/deepinfer/__init__.py`) turns them into vLLM-shaped objects
//! and checks argument types, while value errors come from here, each naming its parameter.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, RecvTimeoutError};
use deepinfer::offline::{
    chat_message, output_json, token_json, ChatRequests, Converted, Offline, ParamError, Prompt, Sampling,
};
use deepinfer::setup::EngineArgs;
use deepinfer_engine::engine::Event;
use deepinfer_engine::sampler::SamplingParams;
use deepinfer_engine::GenerateRequest;
use parking_lot::Mutex;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use serde_json::{json, Value};

/// Sampling fields a chat body asked for that the model's policy overrode: (field, asked, used).
type Overrides = Vec<(String, f64, f64)>;

/// How often a wait wakes to check for Ctrl-C.
const SIGNAL_POLL: Duration = Duration::from_millis(50);

fn value_error(e: ParamError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// A submitted request not yet collected.
struct Flight {
    rx: Receiver<Event>,
    prompt: Vec<u32>,
    stop_ids: Vec<u32>,
    started: Instant,
    /// The conversion of a chat request (its output is parsed into a message).
    chat: Option<Arc<Converted>>,
}

/// A loaded model with its engine running (see the `deepinfer` package's `LLM`).
#[pyclass(module = "deepinfer._deepinfer", frozen)]
struct Engine {
    inner: Offline,
    flights: Mutex<HashMap<u64, Flight>>,
}

/// A field of the parameter dict the Python layer builds.
fn field<'py, T: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<T> {
    let v = d.get_item(key)?.ok_or_else(|| PyTypeError::new_err(format!("{key}: missing")))?;
    v.extract::<T>().map_err(|e| PyTypeError::new_err(format!("{key}: {}", Into::<PyErr>::into(e))))
}

fn sampling_of(d: &Bound<'_, PyDict>) -> PyResult<Sampling> {
    Ok(Sampling {
        n: field(d, "n")?,
        max_tokens: field(d, "max_tokens")?,
        params: SamplingParams {
            temperature: field(d, "temperature")?,
            top_p: field(d, "top_p")?,
            top_k: field(d, "top_k")?,
            min_p: field(d, "min_p")?,
            presence_penalty: field(d, "presence_penalty")?,
            frequency_penalty: field(d, "frequency_penalty")?,
            repetition_penalty: field(d, "repetition_penalty")?,
            seed: field(d, "seed")?,
            top_logprobs: field(d, "logprobs")?,
        },
        stop: field(d, "stop")?,
        stop_token_ids: field(d, "stop_token_ids")?,
        ignore_eos: field(d, "ignore_eos")?,
        json_schema: field(d, "json_schema")?,
        regex: field(d, "regex")?,
    })
}

/// A load error in Python's words: an error about a CLI flag (`--model DIR: ...`) becomes a
/// ValueError naming the parameter (`model: DIR: ...`).
fn load_error(e: anyhow::Error) -> PyErr {
    let m = format!("{e:#}");
    for (flag, param) in
        [("--model", "model"), ("--device", "device"), ("--gpu-memory-utilization", "gpu_memory_utilization")]
    {
        if let Some(rest) = m.strip_prefix(flag) {
            let rest = rest.trim_start_matches(':').trim_start();
            return PyValueError::new_err(format!("{param}: {rest}"));
        }
    }
    PyRuntimeError::new_err(m)
}

impl Engine {
    fn enqueue(&self, reqs: Vec<GenerateRequest>, chat: Option<Arc<Converted>>) -> Vec<u64> {
        let mut ids = Vec::with_capacity(reqs.len());
        for r in reqs {
            let (id, prompt, stop_ids) = (r.id, r.prompt.clone(), r.stop_token_ids.clone());
            let rx = self.inner.submit(r);
            let f = Flight { rx, prompt, stop_ids, started: Instant::now(), chat: chat.clone() };
            self.flights.lock().insert(id, f);
            ids.push(id);
        }
        ids
    }

    /// A finished request as the JSON the Python layer reads.
    fn finished(&self, f: &Flight, o: &deepinfer_engine::GenerateOutput) -> String {
        let mut v = output_json(o, &f.prompt, f.started);
        if let Some(conv) = &f.chat {
            match chat_message(conv, o, &f.stop_ids, self.inner.tokenizer()) {
                Ok(m) => v["chat"] = m,
                Err(e) => v["error"] = Value::from(format!("parsing the output: {e}")),
            }
        }
        v.to_string()
    }

    fn take(&self, ids: &[u64]) -> PyResult<Vec<(u64, Flight)>> {
        let mut map = self.flights.lock();
        if let Some(id) = ids.iter().find(|id| !map.contains_key(id)) {
            return Err(PyValueError::new_err(format!("request_ids: {id} is not a pending request")));
        }
        Ok(ids.iter().map(|id| (*id, map.remove(id).expect("checked"))).collect())
    }
}

/// The request's output if it finishes within `budget` (its other events are skipped); Err when
/// the engine dropped the stream.
fn done_within(rx: &Receiver<Event>, budget: Duration) -> Result<Option<deepinfer_engine::GenerateOutput>, ()> {
    let until = Instant::now() + budget;
    loop {
        match rx.recv_deadline(until) {
            Ok(Event::Done(o)) => return Ok(Some(o)),
            Ok(_) => {}
            Err(RecvTimeoutError::Timeout) => return Ok(None),
            Err(RecvTimeoutError::Disconnected) => return Err(()),
        }
    }
}

#[pymethods]
impl Engine {
    /// Load a model and start its engine. `model`: a checkpoint directory (None: the built-in
    /// tiny model); `device`: "cpu", "cuda" or "cuda:N".
    #[new]
    #[pyo3(signature = (model=None, device="cpu".to_string(), token_budget=512, max_running=64, max_context=65536,
                        kv_dir=None, speculative_tokens=None, gpu_memory_utilization=0.9))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model: Option<PathBuf>,
        device: String,
        token_budget: usize,
        max_running: usize,
        max_context: usize,
        kv_dir: Option<PathBuf>,
        speculative_tokens: Option<usize>,
        gpu_memory_utilization: f64,
    ) -> PyResult<Engine> {
        for (name, v) in [("token_budget", token_budget), ("max_running", max_running), ("max_context", max_context)] {
            if v == 0 {
                return Err(PyValueError::new_err(format!("{name}: must be at least 1")));
            }
        }
        let args = EngineArgs {
            model,
            device,
            gpu_memory_utilization,
            kv_dir,
            token_budget,
            max_running,
            max_context,
            speculative_tokens,
        };
        let inner = py.detach(|| Offline::load(&args)).map_err(load_error)?;
        Ok(Engine { inner, flights: Mutex::new(HashMap::new()) })
    }

    /// What was loaded, as JSON text (model, builtin, note, max_context, vocab_size, ...).
    fn info(&self) -> String {
        self.inner.info().to_string()
    }

    /// Token ids of `text` as plain text (no special tokens).
    fn encode(&self, text: &str) -> PyResult<Vec<u32>> {
        let enc = self.inner.tokenizer().encode_batch(&[text.to_string()]);
        enc.map(|mut v| v.remove(0)).map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// Text of token ids (special tokens spelled out).
    fn decode(&self, token_ids: Vec<u32>) -> PyResult<String> {
        self.inner.tokenizer().decode(&token_ids).map_err(|e| PyValueError::new_err(format!("token_ids: {e}")))
    }

    /// Queue a raw prompt (text or token ids) with sampling `params` (a dict of every
    /// `SamplingParams` field); returns the ids of its `n` requests.
    fn submit(&self, prompt: &Bound<'_, PyAny>, params: &Bound<'_, PyDict>) -> PyResult<Vec<u64>> {
        let prompt = if let Ok(t) = prompt.extract::<String>() {
            Prompt::Text(t)
        } else {
            Prompt::Tokens(prompt.extract::<Vec<u32>>().map_err(|_| {
                PyTypeError::new_err("prompts: a prompt is a str or a list of token ids (ints in [0, 2**32))")
            })?)
        };
        let reqs = self.inner.requests(&prompt, &sampling_of(params)?).map_err(value_error)?;
        Ok(self.enqueue(reqs, None))
    }

    /// Queue a Chat Completions body (JSON text) `n` times (output i with seed + i); returns the
    /// request ids and the sampling fields the model's policy overrode, (field, asked, used).
    fn submit_chat(&self, body: &str, n: usize) -> PyResult<(Vec<u64>, Overrides)> {
        let body: Value = serde_json::from_str(body).map_err(|e| PyValueError::new_err(format!("messages: {e}")))?;
        let ChatRequests { requests, conv, overridden } = self.inner.chat_requests(&body, n).map_err(value_error)?;
        let overridden = overridden.into_iter().map(|(f, a, u)| (f.to_string(), a, u)).collect();
        Ok((self.enqueue(requests, Some(Arc::new(conv))), overridden))
    }

    /// Wait for requests to finish; their outputs (JSON text) in the order of `request_ids`.
    /// Ctrl-C cancels them and raises KeyboardInterrupt.
    fn wait(&self, py: Python<'_>, request_ids: Vec<u64>) -> PyResult<Vec<String>> {
        let flights = self.take(&request_ids)?;
        let mut outs = Vec::with_capacity(flights.len());
        for (at, (_, f)) in flights.iter().enumerate() {
            loop {
                match py.detach(|| done_within(&f.rx, SIGNAL_POLL)) {
                    Ok(Some(o)) => {
                        outs.push(self.finished(f, &o));
                        break;
                    }
                    Ok(None) => {
                        if let Err(e) = py.check_signals() {
                            for (id, _) in &flights[at..] {
                                self.inner.cancel(*id);
                            }
                            return Err(e);
                        }
                    }
                    Err(()) => {
                        return Err(PyRuntimeError::new_err("the engine stopped before the request finished"));
                    }
                }
            }
        }
        Ok(outs)
    }

    /// The next event of one request (JSON text: {"kind": "token", ...} or {"kind": "done",
    /// "output": ...}), or None when none came within `timeout` seconds.
    #[pyo3(signature = (request_id, timeout=0.1))]
    fn next_event(&self, py: Python<'_>, request_id: u64, timeout: f64) -> PyResult<Option<String>> {
        let (rx, prompt) = match self.flights.lock().get(&request_id) {
            Some(f) => (f.rx.clone(), f.prompt.clone()),
            None => return Err(PyValueError::new_err(format!("request_id: {request_id} is not a pending request"))),
        };
        let wait = Duration::from_secs_f64(timeout.clamp(0.0, 3600.0));
        match py.detach(|| rx.recv_timeout(wait)) {
            Ok(Event::Token { token, logprob, top, text, .. }) => {
                let mut v = token_json(token, logprob, &top, &text);
                v["kind"] = Value::from("token");
                Ok(Some(v.to_string()))
            }
            Ok(Event::Admitted { cached_tokens, .. }) => Ok(Some(
                json!({"kind": "admitted", "prompt_token_ids": prompt, "cached_tokens": cached_tokens}).to_string(),
            )),
            Ok(Event::Done(o)) => {
                let f = self.take(&[request_id])?.remove(0).1;
                Ok(Some(format!(r#"{{"kind":"done","output":{}}}"#, self.finished(&f, &o))))
            }
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => {
                Err(PyRuntimeError::new_err("the engine stopped before the request finished"))
            }
        }
    }

    /// Stop requests and forget them (nothing more can be read of them).
    fn cancel(&self, request_ids: Vec<u64>) {
        let mut map = self.flights.lock();
        for id in request_ids {
            self.inner.cancel(id);
            map.remove(&id);
        }
    }

    /// Finish what was submitted and stop the engine; the engine's counters as JSON text (None
    /// when already closed). Later submissions fail with an error output.
    fn close(&self, py: Python<'_>) -> PyResult<Option<String>> {
        match py.detach(|| self.inner.shutdown()) {
            None => Ok(None),
            Some(Ok(s)) => Ok(Some(
                json!({"steps": s.steps, "prompt_tokens": s.prompt_tokens, "generated_tokens": s.generated_tokens,
                       "cached_tokens": s.cached_tokens, "prefix_hits": s.prefix_hits, "seconds": s.seconds,
                       "spec_steps": s.spec_steps, "accepted_drafts": s.accepted_drafts})
                .to_string(),
            )),
            Some(Err(e)) => Err(PyRuntimeError::new_err(format!("kv_dir: {e:#}"))),
        }
    }
}

#[pymodule]
fn _deepinfer(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Engine>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
