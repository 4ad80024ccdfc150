//! A `deepinfer serve` child process on a free port, for the HTTP tests: started with `--port 0`,
//! its address read from the `listening on http://ADDR` line, its stderr kept for failure reports,
//! killed on drop.

// Each test binary uses its own subset of these helpers.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub struct Server {
    child: Option<Child>,
    addr: String,
    log: Arc<Mutex<String>>,
}

impl Server {
    pub fn start(flags: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
            .args(["serve", "--port", "0"])
            .args(flags)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting deepinfer serve");
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or_default().to_string());
                }
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let addr = rx.recv_timeout(Duration::from_secs(120)).unwrap_or_else(|_| {
            panic!("the server did not start listening:\n{}", log.lock().unwrap());
        });
        Server { child: Some(child), addr, log }
    }

    /// host:port
    pub fn addr(&self) -> String {
        self.addr.clone()
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// SIGTERM, then wait (up to two minutes) for the exit.
    pub fn terminate(mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
        let t0 = Instant::now();
        loop {
            if let Some(s) = child.try_wait().expect("waiting for the server") {
                return s;
            }
            if t0.elapsed() > Duration::from_secs(120) {
                let _ = child.kill();
                panic!("no exit two minutes after SIGTERM:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One raw HTTP/1.1 request; the status code and body.
pub fn raw(addr: &str, req: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(req).unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, text)
}

pub fn post(addr: &str, path: &str, body: &str) -> (u16, String) {
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    raw(addr, req.as_bytes())
}

/// POST raw bytes; the status code, or an error naming a timeout (no complete response within
/// `timeout`) or a connection failure.
pub fn post_bytes(addr: &str, path: &str, body: &[u8], timeout: Duration) -> Result<u16, String> {
    let mut s = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    // A server may answer (413, 400) before reading all of a big body and close: that is fine.
    let _ = s.write_all(head.as_bytes()).and_then(|_| s.write_all(body));
    let mut buf = Vec::new();
    match s.read_to_end(&mut buf) {
        Ok(_) => {}
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
            return Err(format!("no complete response within {timeout:?}"));
        }
        Err(_) if !buf.is_empty() => {} // reset after a full early answer
        Err(e) => return Err(format!("read: {e}")),
    }
    let text = String::from_utf8_lossy(&buf);
    text.split(' ').nth(1).and_then(|c| c.parse().ok()).ok_or_else(|| format!("no status line in {text:?}"))
}
