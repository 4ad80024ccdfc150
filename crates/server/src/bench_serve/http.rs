//! The benchmark's HTTP/1.1 client: one connection per request (`Connection: close`), bodies with
//! `Content-Length` or chunked transfer coding, server-sent events split into their `data:` lines.
//! Just what measuring `deepinfer serve` (or any OpenAI-compatible server) needs, on tokio.

use std::ops::ControlFlow;

use anyhow::{bail, Context, Result};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// `http://host:port[/prefix]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub addr: String,
    pub prefix: String,
}

impl Endpoint {
    pub fn parse(url: &str) -> Result<Endpoint> {
        let Some(rest) = url.strip_prefix("http://") else {
            bail!("--url {url}: only http:// URLs are supported");
        };
        let (host, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if host.is_empty() {
            bail!("--url {url}: no host");
        }
        let addr = if host.contains(':') { host.to_string() } else { format!("{host}:80") };
        Ok(Endpoint { addr, prefix: prefix.to_string() })
    }
}

/// One request: method, path (under the endpoint's prefix), extra headers, body.
pub struct Request<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub headers: &'a [(String, String)],
    pub body: &'a [u8],
}

/// Send `req`; `on_body` gets the body as it arrives, piece by piece, and may stop reading (the
/// connection is then dropped, as a client that goes away mid-stream does). Returns the status.
pub async fn send(ep: &Endpoint, req: &Request<'_>, mut on_body: impl FnMut(&[u8]) -> ControlFlow<()>) -> Result<u16> {
    let stream = TcpStream::connect(&ep.addr).await.with_context(|| format!("connecting to {}", ep.addr))?;
    stream.set_nodelay(true)?;
    let mut s = BufReader::new(stream);
    let mut head = format!(
        "{} {}{} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: {}\r\n",
        req.method,
        ep.prefix,
        req.path,
        ep.addr,
        req.body.len()
    );
    if !req.body.is_empty() {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in req.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.get_mut().write_all(head.as_bytes()).await?;
    s.get_mut().write_all(req.body).await?;

    let mut line = String::new();
    s.read_line(&mut line).await?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("not an HTTP status line: {:?}", line.trim_end()))?;
    let (mut length, mut chunked) = (None, false);
    loop {
        line.clear();
        if s.read_line(&mut line).await? == 0 {
            bail!("the connection closed inside the response headers");
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
            if k == "content-length" {
                length = v.parse::<usize>().ok();
            } else if k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked") {
                chunked = true;
            }
        }
    }
    if chunked {
        loop {
            line.clear();
            s.read_line(&mut line).await?;
            let size = usize::from_str_radix(line.trim_end().split(';').next().unwrap_or(""), 16)
                .with_context(|| format!("bad chunk size line {:?}", line.trim_end()))?;
            if size == 0 {
                break;
            }
            let mut data = vec![0u8; size];
            s.read_exact(&mut data).await?;
            let mut crlf = [0u8; 2];
            s.read_exact(&mut crlf).await?;
            if on_body(&data).is_break() {
                return Ok(status);
            }
        }
    } else if let Some(n) = length {
        let mut data = vec![0u8; n];
        s.read_exact(&mut data).await?;
        let _ = on_body(&data);
    } else {
        let mut data = Vec::new();
        s.read_to_end(&mut data).await?;
        let _ = on_body(&data);
    }
    Ok(status)
}

/// A whole response: (status, body).
pub async fn fetch(ep: &Endpoint, req: &Request<'_>) -> Result<(u16, Vec<u8>)> {
    let mut body = Vec::new();
    let status = send(ep, req, |b| {
        body.extend_from_slice(b);
        ControlFlow::Continue(())
    })
    .await?;
    Ok((status, body))
}

/// Splits a byte stream of server-sent events into the payloads of their `data:` lines.
#[derive(Default)]
pub struct SseLines {
    buf: Vec<u8>,
}

impl SseLines {
    /// Feed bytes; `each` gets every complete `data:` payload, in order, and may stop.
    pub fn feed(&mut self, bytes: &[u8], mut each: impl FnMut(&str) -> ControlFlow<()>) -> ControlFlow<()> {
        self.buf.extend_from_slice(bytes);
        let mut start = 0;
        while let Some(nl) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let line = &self.buf[start..start + nl];
            start += nl + 1;
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if let Some(data) = line.strip_prefix(b"data:") {
                let data = String::from_utf8_lossy(data);
                if each(data.trim_start()).is_break() {
                    self.buf.drain(..start);
                    return ControlFlow::Break(());
                }
            }
        }
        self.buf.drain(..start);
        ControlFlow::Continue(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn urls_parse_with_and_without_port_and_prefix() {
        let e = Endpoint::parse("http://127.0.0.1:8000").unwrap();
        assert_eq!((e.addr.as_str(), e.prefix.as_str()), ("127.0.0.1:8000", ""));
        let e = Endpoint::parse("http://example/api/").unwrap();
        assert_eq!((e.addr.as_str(), e.prefix.as_str()), ("example:80", "/api"));
        assert!(Endpoint::parse("https://x").unwrap_err().to_string().contains("http://"));
    }

    proptest! {
        /// However the stream is cut into pieces, the same payloads come out in order.
        #[test]
        fn sse_payloads_do_not_depend_on_how_the_bytes_arrive(
            payloads in proptest::collection::vec("[a-z{}\":0-9 ]{0,20}", 0..8),
            cuts in proptest::collection::vec(0usize..200, 0..10),
        ) {
            let text: String = payloads.iter().map(|p| format!("event: x\ndata: {p}\n\n")).collect();
            let bytes = text.as_bytes();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
            cuts.push(0);
            cuts.push(bytes.len());
            cuts.sort();
            let mut sse = SseLines::default();
            let mut got = Vec::new();
            for w in cuts.windows(2) {
                let _ = sse.feed(&bytes[w[0]..w[1]], |d| {
                    got.push(d.to_string());
                    ControlFlow::Continue(())
                });
            }
            let want: Vec<String> = payloads.iter().map(|p| p.trim_start().to_string()).collect();
            prop_assert_eq!(got, want);
        }
    }
}
