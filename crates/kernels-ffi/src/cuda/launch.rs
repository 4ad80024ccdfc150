//! Launch configurations and launches of the elementwise kernels (kernels/cuda/norm.cu, rope.cu).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use crate::device::{Device, Stream};
use crate::element::Element;
use crate::params::{RmsNormParams, RopeParams};
use crate::Result;

use super::CudaBackend;

/// Must equal MAXV in norm.cu: 16-byte vectors one thread keeps in registers.
const NORM_MAXV: u32 = 4;

fn backend(stream: &Stream) -> &CudaBackend {
    match stream.device() {
        Device::Cuda(b) => b,
        Device::Cpu => unreachable!("ops dispatch CUDA storage to CUDA streams only"),
    }
}

fn round_up(v: u32, m: u32) -> u32 {
    v.div_ceil(m) * m
}

pub(crate) fn rms_norm<T: Element>(
    stream: &Stream,
    x: &CudaSlice<T>,
    w: &CudaSlice<T>,
    out: &mut CudaSlice<T>,
    p: &RmsNormParams,
) -> Result<()> {
    if p.rows == 0 {
        return Ok(());
    }
    let per_vec = 16 / T::DTYPE.size_bytes() as u32;
    let nvec = p.dim / per_vec;
    // Allocations are 256-byte aligned, so 16-byte vectors only need dim and stride divisible.
    let vec_ok = p.dim.is_multiple_of(per_vec)
        && p.row_stride.is_multiple_of(per_vec)
        && nvec <= NORM_MAXV * 1024;
    let (kind, threads) = if vec_ok {
        // Two vectors per thread keeps two 16-byte loads in flight per thread at Flash's dim 4096.
        (
            "vec",
            round_up(nvec.div_ceil(2), 32)
                .clamp(32, 1024)
                .max(round_up(nvec.div_ceil(NORM_MAXV), 32)),
        )
    } else {
        ("scalar", round_up(p.dim.min(1024), 32))
    };
    let name = format!("di_rms_norm_{kind}_{}", T::DTYPE.kernel_suffix());
    let f = backend(stream).function("norm", &name)?;
    let cfg = LaunchConfig {
        grid_dim: (p.rows, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let s = stream.cuda_stream("rms_norm", "x")?;
    // SAFETY: argument order and types match the extern "C" signature in norm.cu; the op checked
    // that x/out hold (rows-1)*row_stride+dim elements and w holds dim, and the launch shape
    // satisfies the vector kernel's precondition (nvec <= MAXV * threads).
    unsafe {
        s.launch_builder(&f)
            .arg(x)
            .arg(w)
            .arg(out)
            .arg(p)
            .launch(cfg)
    }?;
    Ok(())
}

pub(crate) fn rope<T: Element>(
    stream: &Stream,
    x: &mut CudaSlice<T>,
    positions: &CudaSlice<i32>,
    inv_freq: &CudaSlice<f32>,
    p: &RopeParams,
) -> Result<()> {
    let total = p.tokens as u64 * p.heads as u64 * (p.rope_dim / 2) as u64;
    if total == 0 {
        return Ok(());
    }
    let threads = 256u32;
    let blocks = u32::try_from(total.div_ceil(threads as u64)).map_err(|_| {
        crate::FfiError::shape(
            "rope",
            "tokens",
            format!("{total} rotations exceed one launch"),
        )
    })?;
    let name = format!("di_rope_{}", T::DTYPE.kernel_suffix());
    let f = backend(stream).function("rope", &name)?;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let s = stream.cuda_stream("rope", "x")?;
    // SAFETY: matches di_rope_* in rope.cu; the op checked x, positions and inv_freq lengths, and
    // the kernel bounds-checks the flat index against tokens*heads*rope_dim/2.
    unsafe {
        s.launch_builder(&f)
            .arg(x)
            .arg(positions)
            .arg(inv_freq)
            .arg(p)
            .launch(cfg)
    }?;
    Ok(())
}
