//! Progress bars on stderr: redrawn in place on a terminal (at most 10 times a second), a line
//! every few seconds otherwise (logs stay readable).

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

pub struct Progress {
    label: String,
    total: usize,
    tty: bool,
    start: Instant,
    last: Option<Instant>,
}

impl Progress {
    pub fn new(label: &str, total: usize) -> Progress {
        Progress { label: label.into(), total, tty: std::io::stderr().is_terminal(), start: Instant::now(), last: None }
    }

    pub fn set_total(&mut self, total: usize) {
        self.total = total;
    }

    /// Show `done` of the total with a free-form note (rate, counts).
    pub fn set(&mut self, done: usize, note: &str) {
        let now = Instant::now();
        let every = if self.tty { Duration::from_millis(100) } else { Duration::from_secs(5) };
        let finished = done >= self.total;
        if !finished && self.last.is_some_and(|t| now - t < every) {
            return;
        }
        self.last = Some(now);
        let width = 30;
        let filled = (done * width).checked_div(self.total).unwrap_or(width).min(width);
        let bar: String = "#".repeat(filled) + &".".repeat(width - filled);
        let line =
            format!("{} [{bar}] {done}/{} {:.1}s {note}", self.label, self.total, self.start.elapsed().as_secs_f64());
        let mut err = std::io::stderr().lock();
        if self.tty {
            let _ = write!(err, "\r\x1b[2K{line}");
            if finished {
                let _ = writeln!(err);
            }
        } else {
            let _ = writeln!(err, "{line}");
        }
        let _ = err.flush();
    }
}
