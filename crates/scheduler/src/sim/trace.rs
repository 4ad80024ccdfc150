//! Serving traces for the simulator: Mooncake (JSONL with chained 512-token block hashes) and
//! Azure LLM inference 2023 (CSV: TIMESTAMP, ContextTokens, GeneratedTokens; no prefix data).

use std::io::BufRead;
use std::path::Path;

use deepinfer_kv::trace::read_trace;
use deepinfer_kv::KvError;

/// A request of a trace: arrival (seconds from the first), prompt and output lengths, and the
/// prompt's chained block ids when the trace has them.
#[derive(Debug, Clone)]
pub struct SimRequest {
    pub arrival: f64,
    pub input: usize,
    pub output: usize,
    pub hash_ids: Vec<u64>,
}

pub fn load_mooncake(r: impl BufRead) -> Result<Vec<SimRequest>, KvError> {
    let reqs = read_trace(r)?;
    let t0 = reqs.iter().map(|r| r.timestamp).min().unwrap_or(0);
    Ok(reqs
        .into_iter()
        .map(|r| SimRequest {
            arrival: (r.timestamp - t0) as f64 / 1000.0,
            input: r.input_length,
            output: r.output_length,
            hash_ids: r.hash_ids,
        })
        .collect())
}

/// Seconds since 1970 of "YYYY-MM-DD HH:MM:SS[.fraction]".
fn parse_time(s: &str) -> Option<f64> {
    let (date, time) = s.trim().split_once(' ')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let mut t = time.split(':');
    let (hh, mm) = (t.next()?.parse::<f64>().ok()?, t.next()?.parse::<f64>().ok()?);
    let ss: f64 = t.next()?.parse().ok()?;
    // Days from civil (proleptic Gregorian).
    let (y2, m2) = if m <= 2 { (y - 1, m + 9) } else { (y, m - 3) };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let doy = (153 * m2 + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days as f64 * 86_400.0 + hh * 3600.0 + mm * 60.0 + ss)
}

pub fn load_azure_csv(r: impl BufRead) -> Result<Vec<SimRequest>, KvError> {
    let mut out = Vec::new();
    let mut t0 = None;
    for (i, line) in r.lines().enumerate() {
        let line = line.map_err(|e| KvError::Trace { line: i + 1, problem: e.to_string() })?;
        let line = line.trim_start_matches('\u{feff}');
        if i == 0 || line.trim().is_empty() {
            continue; // header
        }
        let f: Vec<&str> = line.split(',').collect();
        let bad = |p: &str| KvError::Trace { line: i + 1, problem: p.to_string() };
        if f.len() < 3 {
            return Err(bad("expected TIMESTAMP,ContextTokens,GeneratedTokens"));
        }
        let t = parse_time(f[0]).ok_or_else(|| bad("bad TIMESTAMP"))?;
        let t0 = *t0.get_or_insert(t);
        out.push(SimRequest {
            arrival: t - t0,
            input: f[1].trim().parse().map_err(|_| bad("bad ContextTokens"))?,
            output: f[2].trim().parse().map_err(|_| bad("bad GeneratedTokens"))?,
            hash_ids: Vec::new(),
        });
    }
    out.sort_by(|a, b| a.arrival.total_cmp(&b.arrival));
    Ok(out)
}

/// A trace file by extension (after an optional `.gz`): `.jsonl` Mooncake, `.csv` Azure.
pub fn load_trace(path: &Path) -> Result<Vec<SimRequest>, KvError> {
    let r = deepinfer_kv::trace::open_trace_file(path)?;
    let name = path.to_string_lossy();
    let name = name.strip_suffix(".gz").unwrap_or(&name);
    match Path::new(name).extension().and_then(|e| e.to_str()) {
        Some("csv") => load_azure_csv(r),
        _ => load_mooncake(r),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn azure_timestamps_parse_to_seconds() {
        let a = parse_time("2023-11-16 18:15:46.6805900").unwrap();
        let b = parse_time("2023-11-16 18:16:46.6805900").unwrap();
        assert!((b - a - 60.0).abs() < 1e-6);
        assert_eq!(parse_time("1970-01-02 00:00:00"), Some(86_400.0));
        let csv =
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47.68,100,5\n";
        let r = load_azure_csv(csv.as_bytes()).unwrap();
        assert_eq!((r[1].arrival.round(), r[1].input, r[1].output), (1.0, 100, 5));
    }
}
