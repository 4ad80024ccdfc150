//! Row moves and row rounding of the device model (issue #37): writing new K=V rows into the paged
//! pool ([`scatter_rows`]), the official QAT of K=V rows and indexer rows in place ([`qat_rows`]),
//! the head-group column copies around the grouped output LoRA ([`copy_2d`]), and turning the
//! indexer's top-k (positions in a sequence's list of compressed rows) into pool rows of the
//! attention's key lists ([`offset_rows`]). The CPU definitions are below; the CUDA kernels are
//! `kernels/cuda/rows.cu`.

use half::bf16;

use crate::device::{DeviceBuffer, Stream};
use crate::error::FfiError;
use crate::ops::check_len;
use crate::{quant, DeviceKind, Result};

pub use crate::shapes::rows::*;

/// The most channels a row of [`qat_rows`] may have (one CUDA block of threads a row).
pub const MAX_QAT_DIM: usize = 1024;

/// `dst[rows[i]] = src[i]` for the first `n` rows of `width` elements of `src`; a negative row is
/// skipped. A row at or past the end of `dst` is skipped and sets `status[0]` to 1 (reset here
/// first).
pub fn scatter_rows(
    stream: &Stream,
    src: &DeviceBuffer<bf16>,
    rows: &DeviceBuffer<i32>,
    dst: &mut DeviceBuffer<bf16>,
    status: &mut DeviceBuffer<i32>,
    n: usize,
    width: usize,
) -> Result<()> {
    const OP: &str = "scatter_rows";
    if width == 0 || !dst.len().is_multiple_of(width) {
        return Err(FfiError::shape(OP, "width", format!("{width}: dst's {} elements are not whole rows", dst.len())));
    }
    check_len(OP, "src", src, n * width)?;
    check_len(OP, "rows", rows, n)?;
    check_len(OP, "status", status, 1)?;
    stream.check_on(OP, "src", src)?;
    stream.check_on(OP, "rows", rows)?;
    stream.check_on(OP, "dst", dst)?;
    stream.check_on(OP, "status", status)?;
    stream.fill_zero(status)?;
    if n == 0 {
        return Ok(());
    }
    if stream.device().kind() == DeviceKind::Cpu {
        let total = dst.len() / width;
        let (s, r, d) = (src.host(), rows.host(), dst.host_mut());
        for (i, &row) in r[..n].iter().enumerate() {
            if row < 0 {
                continue;
            }
            if row as usize >= total {
                status.host_mut()[0] = 1;
                continue;
            }
            let at = row as usize * width;
            d[at..at + width].copy_from_slice(&s[i * width..(i + 1) * width]);
        }
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        crate::cuda::rows::scatter_rows(stream, src, rows, dst, status, n as u32, width as u32)
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

/// The rounding of one row (f32 in, f32 out): the definition the CUDA kernel reproduces.
pub fn qat_row(row: &mut [f32], kind: RowQatKind) {
    match kind {
        RowQatKind::Fp8Nope { rope_dim } => {
            let nope = row.len() - rope_dim as usize;
            quant::fp8_round_trip(&mut row[..nope], 64, 1e-4);
        }
        RowQatKind::HadamardFp4 => {
            quant::hadamard(row);
            quant::fp4_round_trip(row);
        }
    }
}

/// Round rows of `dim` channels of `buf` in place as `kind` says (bf16 in, the rounded values back
/// in bf16, which hold them exactly): the rows `rows[..count]` lists (negative entries skipped),
/// or rows 0..count when `rows` is `None`.
pub fn qat_rows(
    stream: &Stream,
    buf: &mut DeviceBuffer<bf16>,
    rows: Option<&DeviceBuffer<i32>>,
    count: usize,
    dim: usize,
    kind: RowQatKind,
) -> Result<()> {
    const OP: &str = "qat_rows";
    if dim == 0 || dim > MAX_QAT_DIM || !buf.len().is_multiple_of(dim) {
        return Err(FfiError::shape(
            OP,
            "dim",
            format!("{dim} must be in 1..={MAX_QAT_DIM} and divide buf's {} elements", buf.len()),
        ));
    }
    match kind {
        RowQatKind::Fp8Nope { rope_dim } if rope_dim as usize >= dim => {
            return Err(FfiError::shape(OP, "rope_dim", format!("{rope_dim} leaves no channel of {dim} to round")));
        }
        RowQatKind::HadamardFp4 if !dim.is_power_of_two() => {
            return Err(FfiError::shape(OP, "dim", format!("{dim}: the Hadamard transform needs a power of two")));
        }
        _ => {}
    }
    let total = buf.len() / dim;
    match rows {
        Some(r) => {
            check_len(OP, "rows", r, count)?;
            stream.check_on(OP, "rows", r)?;
        }
        None if count > total => {
            return Err(FfiError::shape(OP, "count", format!("{count} rows, buf holds {total}")));
        }
        None => {}
    }
    stream.check_on(OP, "buf", buf)?;
    if count == 0 {
        return Ok(());
    }
    if stream.device().kind() == DeviceKind::Cpu {
        let list: Vec<i32> = match rows {
            Some(r) => r.host()[..count].to_vec(),
            None => (0..count as i32).collect(),
        };
        let b = buf.host_mut();
        for row in list.into_iter().filter(|r| *r >= 0 && (*r as usize) < total) {
            let at = row as usize * dim;
            let mut v: Vec<f32> = b[at..at + dim].iter().map(|x| x.to_f32()).collect();
            qat_row(&mut v, kind);
            for (o, x) in b[at..at + dim].iter_mut().zip(v) {
                *o = bf16::from_f32(x);
            }
        }
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        crate::cuda::rows::qat_rows(stream, buf, rows, count as u32, dim as u32, kind)
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

/// A strided block copy: for r < rows, `dst[r·dst_stride + dst_col ..][..width] =
/// src[r·src_stride + src_col ..][..width]` (bf16): one head group's columns of every token out of
/// [tokens, groups·width] into [tokens, width], and back.
#[allow(clippy::too_many_arguments)]
pub fn copy_2d(
    stream: &Stream,
    src: &DeviceBuffer<bf16>,
    src_stride: usize,
    src_col: usize,
    dst: &mut DeviceBuffer<bf16>,
    dst_stride: usize,
    dst_col: usize,
    rows: usize,
    width: usize,
) -> Result<()> {
    const OP: &str = "copy_2d";
    if src_col + width > src_stride {
        return Err(FfiError::shape(OP, "src_stride", format!("{src_stride} < column {src_col} + width {width}")));
    }
    if dst_col + width > dst_stride {
        return Err(FfiError::shape(OP, "dst_stride", format!("{dst_stride} < column {dst_col} + width {width}")));
    }
    if rows * width == 0 {
        return Ok(());
    }
    check_len(OP, "src", src, (rows - 1) * src_stride + src_col + width)?;
    check_len(OP, "dst", dst, (rows - 1) * dst_stride + dst_col + width)?;
    stream.check_on(OP, "src", src)?;
    stream.check_on(OP, "dst", dst)?;
    if stream.device().kind() == DeviceKind::Cpu {
        let (s, d) = (src.host(), dst.host_mut());
        for r in 0..rows {
            let (a, b) = (r * src_stride + src_col, r * dst_stride + dst_col);
            d[b..b + width].copy_from_slice(&s[a..a + width]);
        }
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        let g = [src_stride, src_col, dst_stride, dst_col, rows, width].map(|v| v as u32);
        crate::cuda::rows::copy_2d(stream, src, dst, g)
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

/// For each of `n` queries: `dst[t·dst_stride + at[t] + j] = base[t] + topk[t·k + j]` for j < k, or
/// -1 where topk holds -1: the indexer's selected positions as pool rows of the attention's key list,
/// after the query's `at[t]` window rows (a sequence's compressed rows are consecutive pool rows
/// from `base[t]`). An `at[t]` past `dst_stride - k` leaves the query's row untouched.
#[allow(clippy::too_many_arguments)]
pub fn offset_rows(
    stream: &Stream,
    topk: &DeviceBuffer<i32>,
    base: &DeviceBuffer<i32>,
    at: &DeviceBuffer<i32>,
    dst: &mut DeviceBuffer<i32>,
    n: usize,
    k: usize,
    dst_stride: usize,
) -> Result<()> {
    const OP: &str = "offset_rows";
    if k > dst_stride {
        return Err(FfiError::shape(OP, "dst_stride", format!("{dst_stride} is less than k {k}")));
    }
    check_len(OP, "topk", topk, n * k)?;
    check_len(OP, "base", base, n)?;
    check_len(OP, "at", at, n)?;
    check_len(OP, "dst", dst, n * dst_stride)?;
    stream.check_on(OP, "topk", topk)?;
    stream.check_on(OP, "base", base)?;
    stream.check_on(OP, "at", at)?;
    stream.check_on(OP, "dst", dst)?;
    if n * k == 0 {
        return Ok(());
    }
    if stream.device().kind() == DeviceKind::Cpu {
        let (tk, bs, col, d) = (topk.host(), base.host(), at.host(), dst.host_mut());
        for t in (0..n).filter(|t| col[*t] >= 0 && col[*t] as usize + k <= dst_stride) {
            for j in 0..k {
                let v = tk[t * k + j];
                d[t * dst_stride + col[t] as usize + j] = if v < 0 { -1 } else { bs[t] + v };
            }
        }
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        crate::cuda::rows::offset_rows(stream, topk, base, at, dst, n as u32, k as u32, dst_stride as u32)
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;

    fn bf(v: &[f32]) -> Vec<bf16> {
        v.iter().map(|x| bf16::from_f32(*x)).collect()
    }

    #[test]
    fn scatter_skips_negative_rows_and_flags_rows_past_the_pool() {
        let s = Device::cpu().default_stream();
        let src = s.upload(&bf(&[1., 2., 3., 4., 5., 6.])).unwrap();
        let mut dst = s.zeros::<bf16>(8).unwrap();
        let mut st = s.zeros::<i32>(1).unwrap();
        scatter_rows(&s, &src, &s.upload(&[3, -1, 0]).unwrap(), &mut dst, &mut st, 3, 2).unwrap();
        let d: Vec<f32> = s.download(&dst).unwrap().iter().map(|v| v.to_f32()).collect();
        assert_eq!(d, vec![5., 6., 0., 0., 0., 0., 1., 2.]);
        assert_eq!(s.download(&st).unwrap(), vec![0]);
        scatter_rows(&s, &src, &s.upload(&[4, 0, 0]).unwrap(), &mut dst, &mut st, 1, 2).unwrap();
        assert_eq!(s.download(&st).unwrap(), vec![1]);
        let e = scatter_rows(&s, &src, &s.upload(&[0]).unwrap(), &mut dst, &mut st, 1, 3).unwrap_err();
        assert!(e.to_string().contains("`width`"), "{e}");
    }

    #[test]
    fn copy_2d_moves_a_column_block_and_back() {
        let s = Device::cpu().default_stream();
        let v: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let src = s.upload(&bf(&v)).unwrap();
        let (mut g, mut back) = (s.zeros::<bf16>(6).unwrap(), s.zeros::<bf16>(24).unwrap());
        // 3 tokens of 2 groups of 4: group 1 of each token.
        copy_2d(&s, &src, 8, 4, &mut g, 2, 0, 3, 2).unwrap();
        let gv: Vec<f32> = s.download(&g).unwrap().iter().map(|v| v.to_f32()).collect();
        assert_eq!(gv, vec![4., 5., 12., 13., 20., 21.]);
        copy_2d(&s, &g, 2, 0, &mut back, 8, 4, 3, 2).unwrap();
        let bv: Vec<f32> = s.download(&back).unwrap().iter().map(|v| v.to_f32()).collect();
        assert_eq!(&bv[8..16], &[0., 0., 0., 0., 12., 13., 0., 0.]);
        let e = copy_2d(&s, &src, 8, 7, &mut g, 2, 0, 3, 2).unwrap_err();
        assert!(e.to_string().contains("`src_stride`"), "{e}");
    }

    #[test]
    fn offset_rows_keeps_missing_selections_missing() {
        let s = Device::cpu().default_stream();
        let mut dst = s.upload(&[7i32; 8]).unwrap();
        let (tk, base, at) =
            (s.upload(&[0, 2, 1, -1]).unwrap(), s.upload(&[10, 20]).unwrap(), s.upload(&[1, 2]).unwrap());
        offset_rows(&s, &tk, &base, &at, &mut dst, 2, 2, 4).unwrap();
        assert_eq!(s.download(&dst).unwrap(), vec![7, 10, 12, 7, 7, 7, 21, -1]);
        let e = offset_rows(&s, &tk, &base, &at, &mut dst, 2, 2, 1).unwrap_err();
        assert!(e.to_string().contains("`dst_stride`"), "{e}");
    }

    #[test]
    fn qat_rows_round_like_the_model() {
        let s = Device::cpu().default_stream();
        let v: Vec<f32> = (0..64).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.37).collect();
        let mut buf = s.upload(&bf(&v)).unwrap();
        qat_rows(&s, &mut buf, None, 2, 32, RowQatKind::HadamardFp4).unwrap();
        let got: Vec<f32> = s.download(&buf).unwrap().iter().map(|v| v.to_f32()).collect();
        for r in 0..2 {
            let mut want: Vec<f32> = bf(&v[r * 32..(r + 1) * 32]).iter().map(|x| x.to_f32()).collect();
            qat_row(&mut want, RowQatKind::HadamardFp4);
            assert_eq!(&got[r * 32..(r + 1) * 32], &want[..], "row {r}");
        }
        let e = qat_rows(&s, &mut buf, None, 1, 48, RowQatKind::HadamardFp4).unwrap_err();
        assert!(e.to_string().contains("`dim`"), "{e}");
        let e = qat_rows(&s, &mut buf, None, 1, 32, RowQatKind::Fp8Nope { rope_dim: 32 }).unwrap_err();
        assert!(e.to_string().contains("`rope_dim`"), "{e}");
    }

    proptest::proptest! {
        // Rounding is idempotent: the rounded values are fixed points (what storing them as bf16 relies on).
        #[test]
        fn fp8_nope_rounding_is_idempotent(seed in proptest::num::u64::ANY) {
            let mut rng = crate::testing::SplitMix(seed);
            let mut v: Vec<f32> = rng.vec(80).into_iter().map(|x| x * 3.0).collect();
            qat_row(&mut v, RowQatKind::Fp8Nope { rope_dim: 16 });
            let once = v.clone();
            qat_row(&mut v, RowQatKind::Fp8Nope { rope_dim: 16 });
            proptest::prop_assert_eq!(once.clone(), v);
            proptest::prop_assert!(once[..64].iter().all(|x| bf16::from_f32(*x).to_f32() == *x));
        }
    }
}
