//! Launch of the sampling kernel (kernels/cuda/sampling.cu); `crate::sampling` validated the rows,
//! the logits' length and uploaded the packed parameters.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::device::{DeviceBuffer, Stream};
use crate::shapes::sampling::SamplerWorkspace;
use crate::Result;

use super::launch::backend;

pub(crate) fn sample(stream: &Stream, logits: &DeviceBuffer<f32>, rows: u32, ws: &mut SamplerWorkspace) -> Result<()> {
    let s = stream.cuda_stream("sample", "logits")?;
    let f = backend(stream).function("sampling", "di_sample")?;
    let (vocab, top_stride) = (ws.vocab as u32, ws.top_stride as u32);
    let cfg = LaunchConfig { grid_dim: (rows, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: matches di_sample (logits, vocab, fparams, iparams, mass, token, logprob, top_ids,
    // top_lp, top_stride, status); the workspace holds at least `rows` rows of each ([rows, 4],
    // [rows, 6], 2 x [rows, vocab] i32 read as u64, [rows], [rows], [rows, top_stride] twice) and
    // the op checked logits [rows, vocab]; one block of 1024 threads per row.
    unsafe {
        s.launch_builder(&f)
            .arg(logits.cuda())
            .arg(&vocab)
            .arg(ws.fparams.cuda())
            .arg(ws.iparams.cuda())
            .arg(ws.mass.cuda_mut())
            .arg(ws.token.cuda_mut())
            .arg(ws.logprob.cuda_mut())
            .arg(ws.top_ids.cuda_mut())
            .arg(ws.top_lp.cuda_mut())
            .arg(&top_stride)
            .arg(ws.status.cuda_mut())
            .launch(cfg)
    }?;
    Ok(())
}
