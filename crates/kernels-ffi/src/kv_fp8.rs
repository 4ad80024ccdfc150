//! FP8 KV rows (issue #8): the stored form of a K=V row whose non-rope dims went through the
//! official KV QAT (MODEL_V4.md §10.1: an e4m3 round trip in blocks of 64 with power-of-two
//! scales, amax floored at 1e-4; the rope dims stay bf16). Storing the e4m3 bytes and the scales
//! instead of the rounded values is lossless: a V4 row (512 = 448 + 64) takes 592 bytes instead of
//! 1024, and unpacks to exactly the values the model computes with (`quant::fp8_round_trip`).
//!
//! Row layout (16-byte aligned pieces, so device kernels can load them with 16-byte vectors):
//!
//! | bytes | content |
//! |---|---|
//! | `[0, nope)` | e4m3 codes of the non-rope dims |
//! | `[nope, nope + scale_bytes)` | one ue8m0 scale per 64 dims, zero padding to 16 bytes |
//! | `[.., row_bytes)` | the rope dims as bf16 (little-endian) |
//!
//! This module is the specification (CPU); the attention kernels reading it are the next step.

use half::bf16;

use crate::error::FfiError;
use crate::quant;
use crate::Result;

/// Dims per scale block of the KV QAT.
pub const QAT_BLOCK: usize = 64;
/// The KV QAT's amax floor.
pub const QAT_AMAX_FLOOR: f32 = 1e-4;

/// Geometry of an FP8 KV row: `dim` values of which the last `rope_dim` stay bf16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvFp8Layout {
    pub dim: usize,
    pub rope_dim: usize,
}

impl KvFp8Layout {
    /// V4's K=V head: 512 values, the last 64 rope (MODEL_V4.md §5).
    pub const V4: KvFp8Layout = KvFp8Layout { dim: 512, rope_dim: 64 };

    /// The layout, if the non-rope dims are whole 64-blocks and the rope dims whole 16-byte pieces.
    pub fn new(dim: usize, rope_dim: usize) -> Result<KvFp8Layout> {
        const OP: &str = "kv_fp8";
        if rope_dim > dim {
            return Err(FfiError::shape(OP, "rope_dim", format!("{rope_dim} exceeds dim {dim}")));
        }
        if !(dim - rope_dim).is_multiple_of(QAT_BLOCK) || dim == rope_dim {
            return Err(FfiError::shape(
                OP,
                "dim",
                format!("the non-rope dims ({}) must be a positive multiple of {QAT_BLOCK}", dim - rope_dim),
            ));
        }
        if !rope_dim.is_multiple_of(8) {
            return Err(FfiError::shape(OP, "rope_dim", format!("{rope_dim} is not a multiple of 8")));
        }
        Ok(KvFp8Layout { dim, rope_dim })
    }

    /// Non-rope dims (stored as e4m3).
    pub fn nope(&self) -> usize {
        self.dim - self.rope_dim
    }

    /// Bytes of the scale piece: one ue8m0 byte per 64 dims, padded to 16.
    pub fn scale_bytes(&self) -> usize {
        (self.nope() / QAT_BLOCK).div_ceil(16) * 16
    }

    /// Bytes of one stored row (592 for V4).
    pub fn row_bytes(&self) -> usize {
        self.nope() + self.scale_bytes() + 2 * self.rope_dim
    }
}

/// The ue8m0 byte of a power-of-two scale.
fn e8m0_code(s: f32) -> u8 {
    (s.log2().round() as i32 + 127).clamp(0, 254) as u8
}

/// Pack rows (`rows.len()` a multiple of `layout.dim`, f32 before any rounding) into FP8 KV rows:
/// the non-rope dims rounded by the KV QAT and stored as codes and scales, the rope dims as bf16.
pub fn pack_rows(rows: &[f32], layout: KvFp8Layout) -> Result<Vec<u8>> {
    if !rows.len().is_multiple_of(layout.dim) {
        return Err(FfiError::shape(
            "kv_fp8::pack_rows",
            "rows",
            format!("{} values are not whole rows of {}", rows.len(), layout.dim),
        ));
    }
    let (nope, rb) = (layout.nope(), layout.row_bytes());
    let mut out = vec![0u8; rows.len() / layout.dim * rb];
    for (row, dst) in rows.chunks(layout.dim).zip(out.chunks_mut(rb)) {
        for (b, block) in row[..nope].chunks(QAT_BLOCK).enumerate() {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs())).max(QAT_AMAX_FLOOR);
            let s = 2f32.powf((amax / 448.0).log2().ceil());
            dst[nope + b] = e8m0_code(s);
            for (i, v) in block.iter().enumerate() {
                dst[b * QAT_BLOCK + i] = quant::e4m3_code(quant::round_e4m3(v / s));
            }
        }
        for (i, v) in row[nope..].iter().enumerate() {
            let at = nope + layout.scale_bytes() + 2 * i;
            dst[at..at + 2].copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
        }
    }
    Ok(out)
}

/// Unpack FP8 KV rows to bf16 (exact: an e4m3 value times a power of two fits bf16).
pub fn unpack_rows(bytes: &[u8], layout: KvFp8Layout) -> Result<Vec<bf16>> {
    let (nope, rb) = (layout.nope(), layout.row_bytes());
    if !bytes.len().is_multiple_of(rb) {
        return Err(FfiError::shape(
            "kv_fp8::unpack_rows",
            "bytes",
            format!("{} bytes are not whole rows of {rb}", bytes.len()),
        ));
    }
    let mut out = Vec::with_capacity(bytes.len() / rb * layout.dim);
    for src in bytes.chunks(rb) {
        for i in 0..nope {
            let s = quant::e8m0_to_f32(src[nope + i / QAT_BLOCK]);
            out.push(bf16::from_f32(quant::e4m3_to_f32(src[i]) * s));
        }
        let rope = &src[nope + layout.scale_bytes()..];
        out.extend(rope.chunks(2).map(|p| bf16::from_le_bytes([p[0], p[1]])));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn v4_rows_take_592_bytes() {
        assert_eq!(KvFp8Layout::V4.row_bytes(), 592);
        assert_eq!(KvFp8Layout::new(512, 64).unwrap(), KvFp8Layout::V4);
        assert_eq!(KvFp8Layout::new(128, 0).unwrap().row_bytes(), 128 + 16);
        assert!(KvFp8Layout::new(512, 60).is_err());
        assert!(KvFp8Layout::new(500, 64).is_err());
        assert!(KvFp8Layout::new(64, 128).is_err());
        assert!(KvFp8Layout::new(64, 64).is_err());
    }

    #[test]
    fn bad_lengths_name_the_field() {
        let e = pack_rows(&[0.0; 100], KvFp8Layout::V4).unwrap_err().to_string();
        assert!(e.contains("rows"), "{e}");
        let e = unpack_rows(&[0; 100], KvFp8Layout::V4).unwrap_err().to_string();
        assert!(e.contains("bytes"), "{e}");
    }

    fn rows_strategy() -> impl Strategy<Value = (Vec<f32>, usize)> {
        // Rows of blocks at very different magnitudes (down to the amax floor, up to saturation
        // territory), with exact zeros.
        (1usize..4).prop_flat_map(|n| {
            (prop::collection::vec((-30i32..12, -1.0f32..1.0, 0u8..8), n * 512), Just(n)).prop_map(|(v, n)| {
                (v.into_iter().map(|(e, m, z)| if z == 0 { 0.0 } else { m * 2f32.powi(e) }).collect(), n)
            })
        })
    }

    proptest! {
        /// Unpacking gives exactly the KV QAT's values on the non-rope dims and bf16 on the rope
        /// dims, so storing FP8 rows changes nothing the model computes.
        #[test]
        fn unpack_of_pack_is_the_kv_qat((rows, n) in rows_strategy()) {
            let l = KvFp8Layout::V4;
            let packed = pack_rows(&rows, l).unwrap();
            prop_assert_eq!(packed.len(), n * l.row_bytes());
            let got = unpack_rows(&packed, l).unwrap();
            for (r, out) in rows.chunks(512).zip(got.chunks(512)) {
                let mut want = r.to_vec();
                quant::fp8_round_trip(&mut want[..448], QAT_BLOCK, QAT_AMAX_FLOOR);
                for (i, (g, w)) in out.iter().zip(&want).enumerate() {
                    prop_assert_eq!(g.to_f32(), bf16::from_f32(*w).to_f32(), "dim {}", i);
                }
                for i in 0..448 {
                    prop_assert_eq!(out[i].to_f32(), want[i], "QAT value exact in bf16 at {}", i);
                }
            }
            // Packing the unpacked rows again gives the same values (the QAT is idempotent; the
            // bytes may differ: a block whose maximum rounds down to 224·s repacks at scale s/2).
            let again: Vec<f32> = got.iter().map(|v| v.to_f32()).collect();
            prop_assert_eq!(unpack_rows(&pack_rows(&again, l).unwrap(), l).unwrap(), got);
        }
    }
}
