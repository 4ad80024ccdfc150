//! The op set: one entry point per op, dispatching on the stream's device.
//!
//! Each op validates its arguments (lengths, devices) and names the offending field, then runs the
//! CPU reference or launches the CUDA kernel. Ops are stream-ordered: on CUDA they return once
//! queued.

use crate::device::{DeviceBuffer, Storage, Stream};
use crate::element::Element;
use crate::error::FfiError;
use crate::params::{RmsNormParams, RopeParams};
use crate::{cpu, Result};

/// Elements a buffer of `rows` rows of `dim`, `stride` apart, must hold.
fn strided_len(rows: u32, dim: u32, stride: u32) -> usize {
    if rows == 0 {
        0
    } else {
        (rows as usize - 1) * stride as usize + dim as usize
    }
}

fn check_len<T: Element>(op: &'static str, field: &'static str, buf: &DeviceBuffer<T>, need: usize) -> Result<()> {
    if buf.len() < need {
        return Err(FfiError::shape(op, field, format!("holds {} elements, needs {need}", buf.len())));
    }
    Ok(())
}

/// RMSNorm of `p.rows` rows of `p.dim` elements into `out` (same layout as `x`).
pub fn rms_norm<T: Element>(
    stream: &Stream,
    x: &DeviceBuffer<T>,
    w: &DeviceBuffer<T>,
    out: &mut DeviceBuffer<T>,
    p: &RmsNormParams,
) -> Result<()> {
    const OP: &str = "rms_norm";
    if p.dim == 0 {
        return Err(FfiError::shape(OP, "dim", "must be positive"));
    }
    if p.row_stride < p.dim {
        return Err(FfiError::shape(OP, "row_stride", format!("{} is less than dim {}", p.row_stride, p.dim)));
    }
    if !(p.eps >= 0.0 && p.eps.is_finite()) {
        return Err(FfiError::shape(OP, "eps", format!("{} is not a finite non-negative number", p.eps)));
    }
    let need = strided_len(p.rows, p.dim, p.row_stride);
    check_len(OP, "x", x, need)?;
    check_len(OP, "out", out, need)?;
    check_len(OP, "w", w, p.dim as usize)?;
    stream.check_on(OP, "x", x)?;
    stream.check_on(OP, "w", w)?;
    stream.check_on(OP, "out", out)?;
    match (&x.storage, &w.storage, &mut out.storage) {
        (Storage::Host(x), Storage::Host(w), Storage::Host(o)) => {
            cpu::rms_norm(x, w, o, p);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        (Storage::Cuda(x), Storage::Cuda(w), Storage::Cuda(o)) => crate::cuda::launch::rms_norm(stream, x, w, o, p),
        #[cfg(feature = "cuda")]
        _ => unreachable!("check_on verified every buffer is on the stream's device"),
    }
}

/// The CUDA entry point `rms_norm` launches for this element type and shape (for benchmarks and
/// diagnostics); `None` on a build without the CUDA backend.
pub fn rms_norm_cuda_kernel<T: Element>(p: &RmsNormParams) -> Option<String> {
    #[cfg(feature = "cuda")]
    {
        Some(crate::cuda::launch::rms_norm_launch(T::DTYPE, p).0)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = p;
        None
    }
}

/// Partial interleaved RoPE in place on x[tokens, heads, head_dim], one position per token,
/// `inv_freq` from [`crate::RopeConfig::inv_freq`].
pub fn rope<T: Element>(
    stream: &Stream,
    x: &mut DeviceBuffer<T>,
    positions: &DeviceBuffer<i32>,
    inv_freq: &DeviceBuffer<f32>,
    p: &RopeParams,
) -> Result<()> {
    const OP: &str = "rope";
    if p.rope_dim == 0 || !p.rope_dim.is_multiple_of(2) {
        return Err(FfiError::shape(OP, "rope_dim", format!("{} must be even and positive", p.rope_dim)));
    }
    if p.rope_dim > p.head_dim {
        return Err(FfiError::shape(OP, "rope_dim", format!("{} exceeds head_dim {}", p.rope_dim, p.head_dim)));
    }
    let need = p.tokens as usize * p.heads as usize * p.head_dim as usize;
    check_len(OP, "x", x, need)?;
    check_len(OP, "positions", positions, p.tokens as usize)?;
    check_len(OP, "inv_freq", inv_freq, p.rope_dim as usize / 2)?;
    stream.check_on(OP, "x", x)?;
    stream.check_on(OP, "positions", positions)?;
    stream.check_on(OP, "inv_freq", inv_freq)?;
    match (&mut x.storage, &positions.storage, &inv_freq.storage) {
        (Storage::Host(x), Storage::Host(pos), Storage::Host(f)) => {
            cpu::rope(x, pos, f, p);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        (Storage::Cuda(x), Storage::Cuda(pos), Storage::Cuda(f)) => crate::cuda::launch::rope(stream, x, pos, f, p),
        #[cfg(feature = "cuda")]
        _ => unreachable!("check_on verified every buffer is on the stream's device"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;

    #[test]
    fn rms_norm_names_bad_fields() {
        let s = Device::cpu().default_stream();
        let x = s.upload(&[1.0f32; 6]).unwrap();
        let w = s.upload(&[1.0f32; 2]).unwrap();
        let mut out = s.zeros::<f32>(6).unwrap();
        let err = rms_norm(&s, &x, &w, &mut out, &RmsNormParams::packed(2, 3, 1e-6)).unwrap_err();
        assert!(err.to_string().contains("`w`"), "{err}");
        let err = rms_norm(&s, &x, &w, &mut out, &RmsNormParams::packed(4, 2, 1e-6)).unwrap_err();
        assert!(err.to_string().contains("`x`"), "{err}");
        let p = RmsNormParams { rows: 2, dim: 2, row_stride: 1, eps: 1e-6 };
        let err = rms_norm(&s, &x, &w, &mut out, &p).unwrap_err();
        assert!(err.to_string().contains("`row_stride`"), "{err}");
    }

    #[test]
    fn rope_rejects_odd_rope_dim() {
        let s = Device::cpu().default_stream();
        let mut x = s.upload(&[0.0f32; 8]).unwrap();
        let pos = s.upload(&[0i32]).unwrap();
        let f = s.upload(&[1.0f32; 2]).unwrap();
        let err = rope(&s, &mut x, &pos, &f, &RopeParams::new(1, 1, 8, 3, false)).unwrap_err();
        assert!(err.to_string().contains("`rope_dim`"), "{err}");
    }
}
