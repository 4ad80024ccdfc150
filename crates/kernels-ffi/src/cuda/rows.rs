//! Launches of the row kernels (kernels/cuda/rows.cu); `crate::rows` validated every argument.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::bf16;

use crate::device::{DeviceBuffer, Stream};
use crate::shapes::rows::RowQatKind;
use crate::Result;

use super::launch::backend;

fn cfg(blocks: u32, threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

pub(crate) fn scatter_rows(
    stream: &Stream,
    src: &DeviceBuffer<bf16>,
    rows: &DeviceBuffer<i32>,
    dst: &mut DeviceBuffer<bf16>,
    status: &mut DeviceBuffer<i32>,
    n: u32,
    width: u32,
) -> Result<()> {
    let s = stream.cuda_stream("scatter_rows", "src")?;
    let f = backend(stream).function("rows", "di_scatter_rows")?;
    let total = (dst.len() / width as usize) as u32;
    // SAFETY: matches di_scatter_rows (src, rows, dst, status, width, total); src holds n rows of
    // width, rows n entries, dst total rows (the op checked them); a block per row.
    unsafe {
        s.launch_builder(&f)
            .arg(src.cuda())
            .arg(rows.cuda())
            .arg(dst.cuda_mut())
            .arg(status.cuda_mut())
            .arg(&width)
            .arg(&total)
            .launch(cfg(n, width.clamp(32, 256)))
    }?;
    Ok(())
}

pub(crate) fn qat_rows(
    stream: &Stream,
    buf: &mut DeviceBuffer<bf16>,
    rows: Option<&DeviceBuffer<i32>>,
    count: u32,
    dim: u32,
    kind: RowQatKind,
) -> Result<()> {
    let s = stream.cuda_stream("qat_rows", "buf")?;
    let f = backend(stream).function("rows", "di_qat_rows")?;
    let total = (buf.len() / dim as usize) as u32;
    let (k, rope) = match kind {
        RowQatKind::Fp8Nope { rope_dim } => (0u32, rope_dim),
        RowQatKind::HadamardFp4 => (1u32, 0u32),
    };
    let null: u64 = 0;
    let mut b = s.launch_builder(&f);
    b.arg(buf.cuda_mut());
    match rows {
        Some(r) => b.arg(r.cuda()),
        None => b.arg(&null),
    };
    b.arg(&dim).arg(&total).arg(&k).arg(&rope);
    // SAFETY: matches di_qat_rows (buf, rows or null, dim, total, kind, rope_dim); buf holds total
    // rows of dim <= 1024 (checked), rows `count` entries when given; a block of dim threads a row.
    unsafe { b.launch(cfg(count, dim)) }?;
    Ok(())
}

/// g = [src_stride, src_col, dst_stride, dst_col, rows, width].
pub(crate) fn copy_2d(
    stream: &Stream,
    src: &DeviceBuffer<bf16>,
    dst: &mut DeviceBuffer<bf16>,
    g: [u32; 6],
) -> Result<()> {
    let s = stream.cuda_stream("copy_2d", "src")?;
    let f = backend(stream).function("rows", "di_copy_2d")?;
    let [ss, sc, ds, dc, rows, width] = g;
    // SAFETY: matches di_copy_2d (src, dst, src_stride, src_col, dst_stride, dst_col, width); the op
    // checked both buffers hold `rows` strided rows reaching column + width; a block per row.
    unsafe {
        s.launch_builder(&f)
            .arg(src.cuda())
            .arg(dst.cuda_mut())
            .arg(&ss)
            .arg(&sc)
            .arg(&ds)
            .arg(&dc)
            .arg(&width)
            .launch(cfg(rows, width.clamp(32, 256)))
    }?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn offset_rows(
    stream: &Stream,
    topk: &DeviceBuffer<i32>,
    base: &DeviceBuffer<i32>,
    at: &DeviceBuffer<i32>,
    dst: &mut DeviceBuffer<i32>,
    n: u32,
    k: u32,
    stride: u32,
) -> Result<()> {
    let s = stream.cuda_stream("offset_rows", "topk")?;
    let f = backend(stream).function("rows", "di_offset_rows")?;
    // SAFETY: matches di_offset_rows (topk, base, at, dst, n, k, stride); topk holds n·k, base and
    // at n, dst n·stride entries (checked; the kernel skips an at[t] without room); a thread per entry.
    unsafe {
        s.launch_builder(&f)
            .arg(topk.cuda())
            .arg(base.cuda())
            .arg(at.cuda())
            .arg(dst.cuda_mut())
            .arg(&n)
            .arg(&k)
            .arg(&stride)
            .launch(cfg((n * k).div_ceil(256), 256))
    }?;
    Ok(())
}
