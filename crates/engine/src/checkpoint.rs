//! Safetensors checkpoints by memory map: one `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`, under the official tensor names (MODEL_V4.md §10). A file
//! named `*.safetensors.gz` (how the repository ships its small models) is inflated into memory
//! instead; `model.safetensors.gz` stands in for a missing `model.safetensors`.
//!
//! Tensors are decoded to f32 on request (BF16, F32, F8_E4M3 with its `.scale`, packed FP4 with its
//! `.scale`) or read as I64 (`tid2eid`). Truncated or corrupt files, missing tensors, wrong shapes
//! or dtypes are errors that name the tensor and the file.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use thiserror::Error;

use crate::quant;

#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error("{path}: {problem}")]
    File { path: String, problem: String },
    #[error("tensor `{name}` not found in {location}")]
    Missing { name: String, location: String },
    #[error("tensor `{name}` in {file}: {problem}")]
    Tensor { name: String, file: String, problem: String },
}

/// A shard's bytes: mapped from the file, or inflated from a gzip file.
enum Bytes {
    Mapped(Mmap),
    Inflated(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Inflated(v) => v,
        }
    }
}

fn read_bytes(path: &Path) -> Result<Bytes, CheckpointError> {
    let file = File::open(path).map_err(|e| file_err(path, e.to_string()))?;
    if path.extension().is_some_and(|e| e == "gz") {
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(std::io::BufReader::new(file)), &mut out)
            .map_err(|e| file_err(path, format!("does not inflate (truncated or corrupt gzip?): {e}")))?;
        return Ok(Bytes::Inflated(out));
    }
    // SAFETY: the map is read-only; a checkpoint modified while mapped could change the bytes we
    // read (never memory safety of Rust objects: we only copy bytes out).
    let map = unsafe { Mmap::map(&file) }.map_err(|e| file_err(path, format!("cannot map: {e}")))?;
    Ok(Bytes::Mapped(map))
}

/// `dir/name`, or `dir/name.gz` when only that exists.
pub fn file_or_gz(dir: &Path, name: &str) -> PathBuf {
    let plain = dir.join(name);
    let gz = dir.join(format!("{name}.gz"));
    if !plain.is_file() && gz.is_file() {
        gz
    } else {
        plain
    }
}

struct Shard {
    path: PathBuf,
    map: Bytes,
    header_len: usize,
    meta: Metadata,
}

/// A checkpoint's tensors, by name, across its files.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// Tensor name -> shard index.
    index: HashMap<String, usize>,
}

fn file_err(path: &Path, problem: impl Into<String>) -> CheckpointError {
    CheckpointError::File { path: path.display().to_string(), problem: problem.into() }
}

impl Checkpoint {
    /// Open `dir/model.safetensors.index.json` (sharded) or `dir/model.safetensors` (or `.gz`).
    pub fn open_dir(dir: &Path) -> Result<Checkpoint, CheckpointError> {
        let index_path = dir.join("model.safetensors.index.json");
        if index_path.is_file() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| file_err(&index_path, e.to_string()))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| file_err(&index_path, format!("invalid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| file_err(&index_path, "no `weight_map` object"))?;
            let mut files: Vec<String> = Vec::new();
            let mut wanted: Vec<(String, String)> = Vec::new();
            for (name, f) in map {
                let f = f
                    .as_str()
                    .ok_or_else(|| file_err(&index_path, format!("weight_map[{name}] is not a file name")))?;
                if f.contains('/') || f.contains("..") {
                    return Err(file_err(&index_path, format!("weight_map[{name}] = {f} leaves the directory")));
                }
                if !files.iter().any(|x| x == f) {
                    files.push(f.to_string());
                }
                wanted.push((name.clone(), f.to_string()));
            }
            files.sort();
            let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
            let ckpt = Checkpoint::open_files(dir, &paths)?;
            for (name, f) in wanted {
                match ckpt.index.get(&name) {
                    Some(&i) if ckpt.shards[i].path.file_name().is_some_and(|n| n.to_string_lossy() == f) => {}
                    _ => return Err(CheckpointError::Missing { name, location: dir.join(f).display().to_string() }),
                }
            }
            Ok(ckpt)
        } else {
            let single = file_or_gz(dir, "model.safetensors");
            if !single.is_file() {
                return Err(file_err(dir, "neither model.safetensors nor model.safetensors.index.json is here"));
            }
            Checkpoint::open_files(dir, &[single])
        }
    }

    /// Open one or more safetensors files as one namespace (a tensor may appear only once).
    pub fn open_files(dir: &Path, paths: &[PathBuf]) -> Result<Checkpoint, CheckpointError> {
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        for path in paths {
            let map = read_bytes(path)?;
            let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map)
                .map_err(|e| file_err(path, format!("not a valid safetensors file (truncated or corrupt?): {e}")))?;
            for name in meta.tensors().keys() {
                if let Some(prev) = index.insert(name.clone(), shards.len()) {
                    let prev: &Shard = &shards[prev];
                    return Err(file_err(path, format!("tensor `{name}` also in {}", prev.path.display())));
                }
            }
            shards.push(Shard { path: path.clone(), map, header_len, meta });
        }
        Ok(Checkpoint { dir: dir.to_path_buf(), shards, index })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Names of all tensors.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    fn locate(&self, name: &str) -> Result<(&Shard, &TensorInfo), CheckpointError> {
        let i = *self.index.get(name).ok_or_else(|| CheckpointError::Missing {
            name: name.to_string(),
            location: self.dir.display().to_string(),
        })?;
        let shard = &self.shards[i];
        let info = shard.meta.info(name).ok_or_else(|| CheckpointError::Missing {
            name: name.to_string(),
            location: shard.path.display().to_string(),
        })?;
        Ok((shard, info))
    }

    fn err(&self, name: &str, problem: impl Into<String>) -> CheckpointError {
        let file = self.index.get(name).map(|&i| self.shards[i].path.display().to_string()).unwrap_or_default();
        CheckpointError::Tensor { name: name.to_string(), file, problem: problem.into() }
    }

    /// dtype, shape and raw bytes of a tensor.
    pub fn raw(&self, name: &str) -> Result<(Dtype, &[usize], &[u8]), CheckpointError> {
        let (shard, info) = self.locate(name)?;
        let start = 8 + shard.header_len + info.data_offsets.0;
        let end = 8 + shard.header_len + info.data_offsets.1;
        let bytes =
            shard.map.get(start..end).ok_or_else(|| self.err(name, "data offsets beyond the end of the file"))?;
        Ok((info.dtype, &info.shape, bytes))
    }

    /// Shape of a tensor.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>, CheckpointError> {
        Ok(self.raw(name)?.1.to_vec())
    }

    /// A floating-point tensor of the given logical shape, decoded to f32. FP8 weights are
    /// dequantised with `<name without .weight>.scale` over `block`; packed FP4 (I8) weights with
    /// their 1x32 scales.
    pub fn f32(&self, name: &str, shape: &[usize], block: [usize; 2]) -> Result<Vec<f32>, CheckpointError> {
        let (dtype, stored, bytes) = self.raw(name)?;
        let numel: usize = shape.iter().product();
        let check_shape = |want: &[usize]| -> Result<(), CheckpointError> {
            if stored != want {
                return Err(self.err(name, format!("shape {stored:?}, expected {want:?}")));
            }
            Ok(())
        };
        match dtype {
            Dtype::F32 => {
                check_shape(shape)?;
                Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
            }
            Dtype::BF16 => {
                check_shape(shape)?;
                Ok(bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect())
            }
            Dtype::F16 => {
                check_shape(shape)?;
                Ok(bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect())
            }
            Dtype::F8_E4M3 => {
                check_shape(shape)?;
                let [n, k] = two_d(self, name, shape)?;
                let sname = scale_name(name);
                let want = [n.div_ceil(block[0]), k.div_ceil(block[1])];
                let scale = self.scale_bytes(&sname, &want)?;
                Ok(quant::dequant_fp8_blocks(bytes, scale, n, k, block))
            }
            Dtype::I8 | Dtype::U8 => {
                // Packed FP4: two e2m1 values per byte, logical shape [n, k], stored [n, k/2].
                let [n, k] = two_d(self, name, shape)?;
                if k % 32 != 0 {
                    return Err(self.err(name, format!("FP4 needs the inner dimension {k} to be a multiple of 32")));
                }
                check_shape(&[n, k / 2])?;
                let scale = self.scale_bytes(&scale_name(name), &[n, k / 32])?;
                Ok(quant::dequant_fp4_rows(bytes, scale, n, k))
            }
            other => {
                Err(self.err(name, format!("dtype {other:?} where a float tensor of {numel} values was expected")))
            }
        }
    }

    fn scale_bytes(&self, sname: &str, want: &[usize]) -> Result<&[u8], CheckpointError> {
        let (dtype, shape, bytes) = self.raw(sname)?;
        if dtype != Dtype::F8_E8M0 && dtype != Dtype::U8 {
            return Err(self.err(sname, format!("scale dtype {dtype:?}, expected F8_E8M0")));
        }
        if shape != want {
            return Err(self.err(sname, format!("scale shape {shape:?}, expected {want:?}")));
        }
        Ok(bytes)
    }

    /// An integer tensor of the given shape as i64 (I64 or I32 storage).
    pub fn i64(&self, name: &str, shape: &[usize]) -> Result<Vec<i64>, CheckpointError> {
        let (dtype, stored, bytes) = self.raw(name)?;
        if stored != shape {
            return Err(self.err(name, format!("shape {stored:?}, expected {shape:?}")));
        }
        match dtype {
            Dtype::I64 => {
                Ok(bytes.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect())
            }
            Dtype::I32 => {
                Ok(bytes.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64).collect())
            }
            other => Err(self.err(name, format!("dtype {other:?}, expected I64"))),
        }
    }
}

fn two_d(c: &Checkpoint, name: &str, shape: &[usize]) -> Result<[usize; 2], CheckpointError> {
    match shape {
        [n, k] => Ok([*n, *k]),
        _ => Err(c.err(name, format!("a quantised tensor must be 2-D, expected shape {shape:?}"))),
    }
}

/// `a.b.weight` -> `a.b.scale` (the official name of a quantised weight's scale).
fn scale_name(name: &str) -> String {
    format!("{}.scale", name.strip_suffix(".weight").unwrap_or(name))
}
