//! Sampling's per-row parameters and results, its limits, and the workspace of parameters,
//! scratch and results a call fills: what [`crate::sampling`] and both backends agree on.

use crate::device::{DeviceBuffer, Stream};
use crate::error::FfiError;
use crate::Result;

/// Per-row sampling parameters (validated by the caller: temperature in [0, 2], top_p in (0, 1],
/// min_p in [0, 1]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Truncation {
    /// Below 1e-5: greedy.
    pub temperature: f32,
    /// 0: off.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
    /// Alternatives to report (most likely first).
    pub top_logprobs: usize,
}

/// The chosen token, its log-probability, and the `top_logprobs` most likely (token, logprob).
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// The most alternatives a row may ask for (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The largest vocabulary: masses are integers in units of 2^-40, and the kernel's histograms sum
/// them in four 10-bit parts in 32-bit counters.
pub const MAX_VOCAB: usize = 1 << 21;

/// Parameters, scratch and results of [`crate::sampling::sample`] for up to `batch` rows of `vocab` logits.
pub struct SamplerWorkspace {
    pub(crate) batch: usize,
    pub(crate) vocab: usize,
    pub(crate) top_stride: usize,
    pub(crate) fparams: DeviceBuffer<f32>,
    pub(crate) iparams: DeviceBuffer<i32>,
    /// Per-entry masses, u64 on the device (two i32 each).
    pub(crate) mass: DeviceBuffer<i32>,
    pub(crate) token: DeviceBuffer<i32>,
    pub(crate) logprob: DeviceBuffer<f32>,
    pub(crate) top_ids: DeviceBuffer<i32>,
    pub(crate) top_lp: DeviceBuffer<f32>,
    pub(crate) status: DeviceBuffer<i32>,
}

impl SamplerWorkspace {
    /// Room for `batch` rows of `vocab` logits, each reporting up to `top_stride` alternatives.
    pub fn new(stream: &Stream, batch: usize, vocab: usize, top_stride: usize) -> Result<Self> {
        const OP: &str = "SamplerWorkspace::new";
        if vocab == 0 || vocab > MAX_VOCAB {
            return Err(FfiError::shape(OP, "vocab", format!("{vocab} is not in 1..={MAX_VOCAB}")));
        }
        if top_stride > MAX_TOP_LOGPROBS {
            return Err(FfiError::shape(OP, "top_stride", format!("{top_stride} is more than {MAX_TOP_LOGPROBS}")));
        }
        let rows = batch.max(1);
        Ok(SamplerWorkspace {
            batch,
            vocab,
            top_stride,
            fparams: stream.zeros(rows * 4)?,
            iparams: stream.zeros(rows * 6)?,
            mass: stream.zeros(rows * vocab * 2)?,
            token: stream.zeros(rows)?,
            logprob: stream.zeros(rows)?,
            top_ids: stream.zeros(rows * top_stride.max(1))?,
            top_lp: stream.zeros(rows * top_stride.max(1))?,
            status: stream.zeros(1)?,
        })
    }

    /// The choices of the first `rows` rows of the last [`crate::sampling::sample`] (waits for the stream). A row
    /// without a usable logit (all masked or NaN) is an error naming the row.
    pub fn choices(&self, stream: &Stream, rows: usize) -> Result<Vec<Choice>> {
        if rows > self.batch {
            return Err(FfiError::shape("SamplerWorkspace::choices", "rows", format!("{rows} > batch {}", self.batch)));
        }
        let token = stream.download_range(&self.token, 0, rows)?;
        let logprob = stream.download_range(&self.logprob, 0, rows)?;
        let n = rows * self.top_stride;
        let (ids, lps) = (stream.download_range(&self.top_ids, 0, n)?, stream.download_range(&self.top_lp, 0, n)?);
        (0..rows)
            .map(|r| {
                if token[r] < 0 {
                    return Err(FfiError::shape(
                        "sample",
                        "logits",
                        format!("row {r} has no usable logit (every entry is -inf or NaN)"),
                    ));
                }
                let s = r * self.top_stride;
                let top =
                    (s..s + self.top_stride).take_while(|j| ids[*j] >= 0).map(|j| (ids[j] as u32, lps[j])).collect();
                Ok(Choice { token: token[r] as u32, logprob: logprob[r], top })
            })
            .collect()
    }
}
