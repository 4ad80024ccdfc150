//! Token choice on the device (issue #7): temperature, top-k, top-p, min-p, the counter-based draw
//! keyed by (seed, position), and log-probabilities, for a batch of logit rows. The definition is
//! `crate::cpu::sampling::choose` (the CPU backend runs it); the CUDA kernel is
//! `kernels/cuda/sampling.cu`. Each row's result depends on that row alone, never on its batch
//! neighbours or on how the rows are scheduled.
//!
//! ```
//! use deepinfer_kernels_ffi::sampling::{sample, SampleRow, SamplerWorkspace, Truncation};
//! use deepinfer_kernels_ffi::Device;
//! let s = Device::cpu().default_stream();
//! let logits = s.upload(&[0.0f32, 3.0, 1.0, f32::NEG_INFINITY])?;
//! let mut ws = SamplerWorkspace::new(&s, 1, 4, 2)?;
//! let greedy = Truncation { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 0, top_logprobs: 2 };
//! sample(&s, &logits, &[SampleRow { truncation: greedy, position: 0 }], &mut ws)?;
//! let c = &ws.choices(&s, 1)?[0];
//! assert_eq!(c.token, 1);
//! assert_eq!(c.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
//! # Ok::<(), deepinfer_kernels_ffi::FfiError>(())
//! ```

use crate::device::{DeviceBuffer, Stream};
use crate::error::FfiError;
use crate::ops::check_len;
pub use crate::shapes::sampling::*;
use crate::{DeviceKind, Result};

/// One row of a batch: its truncation parameters and the position the token is drawn for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleRow {
    pub truncation: Truncation,
    pub position: u64,
}

/// Checks one row's parameters the way the request validator does, naming the field.
fn check_row(r: usize, row: &SampleRow, top_stride: usize) -> Result<()> {
    const OP: &str = "sample";
    let t = &row.truncation;
    if !(t.temperature.is_finite() && (0.0..=2.0).contains(&t.temperature)) {
        return Err(FfiError::shape(OP, "temperature", format!("row {r}: {} is not in [0, 2]", t.temperature)));
    }
    if !(t.top_p > 0.0 && t.top_p <= 1.0) {
        return Err(FfiError::shape(OP, "top_p", format!("row {r}: {} is not in (0, 1]", t.top_p)));
    }
    if !(0.0..=1.0).contains(&t.min_p) {
        return Err(FfiError::shape(OP, "min_p", format!("row {r}: {} is not in [0, 1]", t.min_p)));
    }
    if t.top_logprobs > top_stride {
        return Err(FfiError::shape(
            OP,
            "top_logprobs",
            format!("row {r}: {} is more than the workspace's {top_stride}", t.top_logprobs),
        ));
    }
    if t.top_k > i32::MAX as usize {
        return Err(FfiError::shape(OP, "top_k", format!("row {r}: {} is too large", t.top_k)));
    }
    Ok(())
}

/// Choose one token for each row of `logits` ([rows.len(), vocab] f32, -inf for masked entries);
/// the results wait in `ws` ([`SamplerWorkspace::choices`]).
pub fn sample(
    stream: &Stream,
    logits: &DeviceBuffer<f32>,
    rows: &[SampleRow],
    ws: &mut SamplerWorkspace,
) -> Result<()> {
    const OP: &str = "sample";
    if rows.len() > ws.batch {
        return Err(FfiError::shape(OP, "rows", format!("{} rows, the workspace holds {}", rows.len(), ws.batch)));
    }
    for (r, row) in rows.iter().enumerate() {
        check_row(r, row, ws.top_stride)?;
    }
    check_len(OP, "logits", logits, rows.len() * ws.vocab)?;
    stream.check_on(OP, "logits", logits)?;
    stream.check_on(OP, "workspace", &ws.mass)?;
    if rows.is_empty() {
        return Ok(());
    }
    let v = ws.vocab;
    if stream.device().kind() == DeviceKind::Cpu {
        let all = logits.host();
        let mut bad = 0;
        for (r, row) in rows.iter().enumerate() {
            let l: Vec<f64> = all[r * v..(r + 1) * v]
                .iter()
                .map(|x| if x.is_nan() { f64::NEG_INFINITY } else { *x as f64 })
                .collect();
            let s = r * ws.top_stride;
            if l.iter().all(|x| *x == f64::NEG_INFINITY) {
                bad = 1;
                ws.token.host_mut()[r] = -1;
                ws.logprob.host_mut()[r] = f32::NAN;
                ws.top_ids.host_mut()[s..s + ws.top_stride].fill(-1);
                continue;
            }
            let c = crate::cpu::sampling::choose(&l, &row.truncation, row.position);
            ws.token.host_mut()[r] = c.token as i32;
            ws.logprob.host_mut()[r] = c.logprob;
            for j in 0..ws.top_stride {
                let (id, lp) = c.top.get(j).map_or((-1, f32::NAN), |(i, p)| (*i as i32, *p));
                ws.top_ids.host_mut()[s + j] = id;
                ws.top_lp.host_mut()[s + j] = lp;
            }
        }
        ws.status.host_mut()[0] = bad;
        return Ok(());
    }
    let mut f = Vec::with_capacity(rows.len() * 4);
    let mut i = Vec::with_capacity(rows.len() * 6);
    for row in rows {
        let t = &row.truncation;
        f.extend_from_slice(&[t.temperature, t.top_p, t.min_p, 0.0]);
        let (seed, pos) = (t.seed, row.position);
        i.extend_from_slice(&[
            t.top_k as i32,
            t.top_logprobs as i32,
            seed as u32 as i32,
            (seed >> 32) as u32 as i32,
            pos as u32 as i32,
            (pos >> 32) as u32 as i32,
        ]);
    }
    stream.write_range(&mut ws.fparams, 0, &f)?;
    stream.write_range(&mut ws.iparams, 0, &i)?;
    stream.fill_zero(&mut ws.status)?;
    #[cfg(feature = "cuda")]
    {
        crate::cuda::sampling::sample(stream, logits, rows.len() as u32, ws)
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;

    fn row(temperature: f32, top_k: usize, top_p: f32, min_p: f32, top_logprobs: usize) -> SampleRow {
        SampleRow { truncation: Truncation { temperature, top_k, top_p, min_p, seed: 5, top_logprobs }, position: 3 }
    }

    #[test]
    fn bad_parameters_name_their_field() {
        let s = Device::cpu().default_stream();
        let logits = s.upload(&[0.0f32; 8]).unwrap();
        let mut ws = SamplerWorkspace::new(&s, 2, 4, 2).unwrap();
        for (r, field) in [
            (row(2.5, 0, 1.0, 0.0, 0), "temperature"),
            (row(1.0, 0, 0.0, 0.0, 0), "top_p"),
            (row(1.0, 0, 1.0, 1.5, 0), "min_p"),
            (row(1.0, 0, 1.0, 0.0, 3), "top_logprobs"),
        ] {
            let e = sample(&s, &logits, &[row(1.0, 0, 1.0, 0.0, 0), r], &mut ws).unwrap_err();
            assert!(matches!(e, FfiError::Shape { field: f, .. } if f == field), "{e}");
            assert!(e.to_string().contains("row 1"), "{e}");
        }
        let e = sample(&s, &logits, &[row(1.0, 0, 1.0, 0.0, 0); 3], &mut ws).unwrap_err();
        assert!(e.to_string().contains("workspace holds 2"), "{e}");
        assert!(SamplerWorkspace::new(&s, 1, 0, 1).is_err());
        assert!(SamplerWorkspace::new(&s, 1, 4, 21).is_err());
    }

    #[test]
    fn a_fully_masked_row_is_an_error_naming_it() {
        let s = Device::cpu().default_stream();
        let logits = s.upload(&[0.0f32, 1.0, f32::NEG_INFINITY, f32::NAN]).unwrap();
        let mut ws = SamplerWorkspace::new(&s, 2, 2, 1).unwrap();
        sample(&s, &logits, &[row(1.0, 0, 0.9, 0.0, 1); 2], &mut ws).unwrap();
        let e = ws.choices(&s, 2).unwrap_err();
        assert!(e.to_string().contains("row 1 has no usable logit"), "{e}");
        assert_eq!(ws.choices(&s, 1).unwrap()[0].top.len(), 1);
    }
}
