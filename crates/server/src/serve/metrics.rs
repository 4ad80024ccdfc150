//! `/metrics` in the Prometheus text format, under vLLM's metric names (`vllm:` prefix, a
//! `model_name` label) so that existing vLLM dashboards read this server unchanged.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

/// A histogram with fixed upper bounds (seconds).
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<(Vec<u64>, f64, u64)>,
}

const LATENCY_S: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const ITL_S: &[f64] =
    &[0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5];

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram { bounds, inner: Mutex::new((vec![0; bounds.len()], 0.0, 0)) }
    }

    pub fn observe(&self, v: f64) {
        let mut g = self.inner.lock();
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            g.0[i] += 1;
        }
        g.1 += v;
        g.2 += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str, label: &str) {
        let g = self.inner.lock();
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, n) in self.bounds.iter().zip(&g.0) {
            cum += n;
            let _ = writeln!(out, "{name}_bucket{{{label},le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{{label},le=\"+Inf\"}} {}", g.2);
        let _ = writeln!(out, "{name}_sum{{{label}}} {}", g.1);
        let _ = writeln!(out, "{name}_count{{{label}}} {}", g.2);
    }
}

pub struct Metrics {
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub queue: Histogram,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// Finished requests by reason: stop, length, error, cancelled.
    pub finished: [AtomicU64; 4],
    /// Answers refused past `--max-queued`.
    pub rejected: AtomicU64,
}

pub const FINISH_REASONS: [&str; 4] = ["stop", "length", "error", "abort"];

/// Gauges read at scrape time.
pub struct Gauges {
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    pub kv_used_blocks: usize,
    pub kv_cached_blocks: usize,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            ttft: Histogram::new(LATENCY_S),
            itl: Histogram::new(ITL_S),
            e2e: Histogram::new(LATENCY_S),
            queue: Histogram::new(LATENCY_S),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            finished: Default::default(),
            rejected: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    pub fn render(&self, model: &str, g: &Gauges) -> String {
        let label = format!("model_name=\"{}\"", model.replace('\\', "\\\\").replace('"', "\\\""));
        let mut o = String::new();
        let gauge = |o: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{label}}} {v}");
        };
        let counter = |o: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{label}}} {v}");
        };
        gauge(&mut o, "vllm:num_requests_running", "Requests running in the engine.", g.running as f64);
        gauge(&mut o, "vllm:num_requests_waiting", "Requests accepted and not yet running.", g.waiting as f64);
        gauge(&mut o, "vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", g.kv_usage);
        gauge(&mut o, "deepinfer:kv_cache_used_blocks", "KV blocks in use.", g.kv_used_blocks as f64);
        gauge(
            &mut o,
            "deepinfer:kv_cache_cached_blocks",
            "KV blocks the prefix cache holds (in use with nothing running).",
            g.kv_cached_blocks as f64,
        );
        counter(&mut o, "vllm:prefix_cache_queries_total", "Prefix-cache lookups.", g.prefix_queries);
        counter(&mut o, "vllm:prefix_cache_hits_total", "Prefix-cache lookups that hit.", g.prefix_hits);
        counter(
            &mut o,
            "vllm:prompt_tokens_total",
            "Prompt tokens of finished requests.",
            self.prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut o,
            "vllm:generation_tokens_total",
            "Generated tokens.",
            self.generation_tokens.load(Ordering::Relaxed),
        );
        let _ = writeln!(
            o,
            "# HELP vllm:request_success_total Finished requests by reason.\n# TYPE vllm:request_success_total counter"
        );
        for (r, n) in FINISH_REASONS.iter().zip(&self.finished) {
            let _ = writeln!(
                o,
                "vllm:request_success_total{{{label},finished_reason=\"{r}\"}} {}",
                n.load(Ordering::Relaxed)
            );
        }
        counter(
            &mut o,
            "deepinfer:requests_rejected_total",
            "Requests answered 429/529 past --max-queued.",
            self.rejected.load(Ordering::Relaxed),
        );
        self.ttft.render(&mut o, "vllm:time_to_first_token_seconds", "Time to first token.", &label);
        self.itl.render(&mut o, "vllm:inter_token_latency_seconds", "Time between consecutive tokens.", &label);
        self.e2e.render(&mut o, "vllm:e2e_request_latency_seconds", "Arrival to last token.", &label);
        self.queue.render(&mut o, "vllm:request_queue_time_seconds", "Arrival to start of running.", &label);
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_names_are_vllms() {
        let m = Metrics::default();
        for v in [0.0005, 0.003, 0.003, 100.0] {
            m.ttft.observe(v);
        }
        let g = Gauges {
            running: 2,
            waiting: 1,
            kv_usage: 0.25,
            kv_used_blocks: 5,
            kv_cached_blocks: 4,
            prefix_queries: 4,
            prefix_hits: 3,
        };
        let t = m.render("tiny", &g);
        assert!(t.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"tiny\",le=\"0.001\"} 1"), "{t}");
        assert!(t.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"tiny\",le=\"0.005\"} 3"));
        assert!(t.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"tiny\",le=\"+Inf\"} 4"));
        assert!(t.contains("vllm:time_to_first_token_seconds_count{model_name=\"tiny\"} 4"));
        assert!(t.contains("vllm:num_requests_running{model_name=\"tiny\"} 2"));
        assert!(t.contains("vllm:prefix_cache_hits_total{model_name=\"tiny\"} 3"));
        assert!(t.contains("deepinfer:kv_cache_cached_blocks{model_name=\"tiny\"} 4"));
    }
}
