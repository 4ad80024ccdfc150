//! `cargo xtask gpu-bundle`: everything one GPU visit needs, in target/gpu-bundle (with the working
//! tree, under the 64 MiB a device call carries; executables are xz-compressed).
//!
//! The GPU machine has no Rust and no network: we ship the release `deepinfer` binary (kernels
//! embedded), every GPU test executable (`crates/*/tests/gpu_*.rs`) and GPU benchmark
//! (`crates/*/benches/gpu_*.rs`), built here, plus `run.sh OUTDIR`, which sets the CUDA library
//! path, runs them all and writes the results into OUTDIR. Both take `bundle.sh` (sourced): the
//! GPU machine's environment and `unpack_bundle SRC DST`, which a visit script of its own (a
//! `benches/pending/*.sh` copied into the bundle) sources too. When the executables and the tree
//! pass the carry limit together, the bundle is split into `target/gpu-bundle/part-N` folders, each
//! with its own run.sh and bundle.sh, one device call each.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use xshell::cmd;

use crate::{kernels, workspace};

const LIMIT_BYTES: u64 = 64 << 20;

/// (package, target name) of every `gpu_*` target of `kind` ("tests" or "benches").
fn gpu_targets(kind: &str) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for e in fs::read_dir(workspace::root().join("crates"))? {
        let dir = e?.path();
        let Ok(manifest) = fs::read_to_string(dir.join("Cargo.toml")) else {
            continue;
        };
        let pkg = manifest
            .lines()
            .find_map(|l| l.strip_prefix("name = \""))
            .and_then(|l| l.strip_suffix('"'))
            .with_context(|| format!("package name in {}", dir.display()))?
            .to_string();
        let Ok(rd) = fs::read_dir(dir.join(kind)) else {
            continue;
        };
        for f in rd {
            let name = f?.file_name().to_string_lossy().to_string();
            if let Some(stem) = name.strip_prefix("gpu_").and_then(|s| s.strip_suffix(".rs")) {
                out.push((pkg.clone(), format!("gpu_{stem}")));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Executable paths cargo reports in its JSON messages.
fn executables(json: &str) -> Vec<PathBuf> {
    json.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get("executable").and_then(|e| e.as_str()).map(PathBuf::from))
        .collect()
}

/// Copy an executable into the bundle xz-compressed (run.sh unpacks it on the GPU machine): the
/// carry limit counts the bundle together with the whole working tree.
fn copy_exe(from: &Path, dir: &Path, name: &str) -> Result<u64> {
    fs::create_dir_all(dir)?;
    let to = dir.join(name);
    fs::copy(from, &to).with_context(|| format!("copying {}", from.display()))?;
    let sh = workspace::shell()?;
    cmd!(sh, "xz -6 -T0 -f {to}").run().context("compressing with xz (apt-get install xz-utils)")?;
    Ok(carried(fs::metadata(dir.join(format!("{name}.xz")))?.len()))
}

/// What a file of `len` bytes counts towards the carry limit: its size in whole 4 KiB blocks, as
/// the device call measures the tree (by byte length a bundle of 63.4 MiB with the tree was still
/// refused as over 64 MiB; by blocks it was 65.4).
fn carried(len: u64) -> u64 {
    len.div_ceil(4096) * 4096
}

/// Bytes of the files a device call carries besides the bundle: tracked files and untracked ones
/// that git does not ignore.
fn tree_bytes(sh: &xshell::Shell) -> Result<u64> {
    let files = cmd!(sh, "git ls-files -z --cached --others --exclude-standard").read()?;
    Ok(files
        .split('\0')
        .filter(|f| !f.is_empty())
        .filter_map(|f| fs::metadata(workspace::root().join(f)).ok())
        .map(|m| carried(m.len()))
        .sum())
}

/// `only`: comma-separated parts of target names (`gpu_sampling,gpu_hc`); when given, just those
/// tests and benchmarks go (and no `deepinfer` binary): a bundle for one targeted visit when the
/// whole set would pass the carry limit.
pub fn run(only: Option<&str>) -> Result<()> {
    let picks: Vec<String> = only
        .map(|o| o.split(',').map(|p| p.trim().to_string()).filter(|p| !p.is_empty()).collect())
        .unwrap_or_default();
    let picked = |target: &str| picks.is_empty() || picks.iter().any(|p| target.contains(p.as_str()));
    kernels::run(false)?;
    let sh = workspace::shell()?;
    let root = workspace::root();
    let bundle = root.join("target/gpu-bundle");
    if bundle.exists() {
        fs::remove_dir_all(&bundle)?;
    }
    let mut total = 0u64;

    let mut binary = 0;
    if picks.is_empty() {
        workspace::step("release binary");
        cmd!(sh, "cargo build --release --locked -p deepinfer --features cuda").run()?;
        binary = copy_exe(&root.join("target/release/deepinfer"), &bundle.join("bin"), "deepinfer")?;
        total += binary;
    }

    // `cargo bench` builds with the bench profile (release settings) and rejects --release.
    for (kind, flag, sub, profile) in
        [("tests", "--test", "test", Some("--release")), ("benches", "--bench", "bench", None)]
    {
        for (pkg, target) in gpu_targets(kind)?.into_iter().filter(|(_, t)| picked(t)) {
            workspace::step(&format!("{kind}: {pkg} {target}"));
            let json = cmd!(sh, "cargo {sub} {profile...} --locked --no-run -p {pkg} {flag} {target} --features deepinfer-kernels-ffi/cuda --message-format=json")
                .read()?;
            let exe =
                executables(&json).into_iter().next().with_context(|| format!("no executable for {pkg} {target}"))?;
            total += copy_exe(&exe, &bundle.join(kind), &format!("{pkg}-{target}"))?;
        }
    }

    let script = bundle.join("run.sh");
    write_scripts(&bundle)?;
    cmd!(sh, "chmod +x {script}").run()?;
    let tree = tree_bytes(&sh)?;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    // The kernel tests and benchmarks need only their own executables; the `deepinfer` binary
    // (run.sh's `doctor`) goes when the carry limit is tight.
    if binary > 0 && total + tree > LIMIT_BYTES && total - binary + tree <= LIMIT_BYTES {
        fs::remove_dir_all(bundle.join("bin"))?;
        total -= binary;
        println!(
            "gpu bundle: left out the deepinfer binary ({:.1} MiB) to stay under the 64 MiB carry limit; run.sh skips `doctor`",
            mib(binary)
        );
    }
    if total + tree > LIMIT_BYTES {
        // Too much for one device call: parts that each fit with the tree, one call each.
        let parts = split_into_parts(&bundle, LIMIT_BYTES.saturating_sub(tree + PART_SLACK_BYTES))?;
        println!(
            "gpu bundle: {:.1} MiB of executables and the {:.1} MiB tree pass the 64 MiB a device call carries; split into {} parts, one device call each:",
            mib(total),
            mib(tree),
            parts.len()
        );
        for (i, (dir, bytes)) in parts.iter().enumerate() {
            let rel = dir.strip_prefix(&root).unwrap_or(dir).display().to_string();
            println!("  part {}: {:.1} MiB: carry [\"{rel}\"], run `bash {rel}/run.sh \"$OUT\"`", i + 1, mib(*bytes));
        }
        return Ok(());
    }
    println!(
        "gpu bundle: target/gpu-bundle ({:.1} MiB, with the tree {:.1} MiB); on the GPU machine: target/gpu-bundle/run.sh \"$OUT\"",
        mib(total),
        mib(total + tree)
    );
    Ok(())
}

/// Room left in each part for run.sh and rounding.
const PART_SLACK_BYTES: u64 = 64 << 10;

/// Indices of `sizes` grouped into parts of at most `capacity` bytes (first fit, largest first,
/// each part's indices ascending), or `None` when one item alone is larger than `capacity`.
fn plan_parts(sizes: &[u64], capacity: u64) -> Option<Vec<Vec<usize>>> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|i| std::cmp::Reverse(sizes[*i]));
    let mut parts: Vec<(u64, Vec<usize>)> = Vec::new();
    for i in order {
        if sizes[i] > capacity {
            return None;
        }
        match parts.iter_mut().find(|(used, _)| used + sizes[i] <= capacity) {
            Some((used, items)) => {
                *used += sizes[i];
                items.push(i);
            }
            None => parts.push((sizes[i], vec![i])),
        }
    }
    Some(
        parts
            .into_iter()
            .map(|(_, mut items)| {
                items.sort_unstable();
                items
            })
            .collect(),
    )
}

/// Move the bundle's executables (bin/, tests/, benches/) into `part-N` folders of at most
/// `capacity` bytes, each with its own run.sh; returns each part's folder and size.
fn split_into_parts(bundle: &Path, capacity: u64) -> Result<Vec<(PathBuf, u64)>> {
    let mut files = Vec::new();
    for kind in ["bin", "tests", "benches"] {
        let Ok(rd) = fs::read_dir(bundle.join(kind)) else {
            continue;
        };
        for f in rd {
            let f = f?;
            files.push((kind, f.file_name(), carried(f.metadata()?.len())));
        }
    }
    files.sort();
    let sizes: Vec<u64> = files.iter().map(|f| f.2).collect();
    let Some(plan) = plan_parts(&sizes, capacity) else {
        bail!(
            "one executable alone is over the room the working tree leaves in a 64 MiB device call ({:.1} MiB)",
            capacity as f64 / (1u64 << 20) as f64
        );
    };
    let mut parts = Vec::new();
    for (p, items) in plan.iter().enumerate() {
        let dir = bundle.join(format!("part-{}", p + 1));
        let mut bytes = 0;
        for &i in items {
            let (kind, name, size) = &files[i];
            fs::create_dir_all(dir.join(kind))?;
            fs::rename(bundle.join(kind).join(name), dir.join(kind).join(name))?;
            bytes += size;
        }
        write_scripts(&dir)?;
        let sh = workspace::shell()?;
        let script = dir.join("run.sh");
        cmd!(sh, "chmod +x {script}").run()?;
        parts.push((dir, bytes));
    }
    for kind in ["bin", "tests", "benches"] {
        let _ = fs::remove_dir(bundle.join(kind));
    }
    fs::remove_file(bundle.join("run.sh"))?;
    fs::remove_file(bundle.join("bundle.sh"))?;
    Ok(parts)
}

/// run.sh and the bundle.sh it sources, into a bundle (or part) folder.
fn write_scripts(dir: &Path) -> Result<()> {
    fs::write(dir.join("run.sh"), RUN_SH)?;
    fs::write(dir.join("bundle.sh"), BUNDLE_SH)?;
    Ok(())
}

const BUNDLE_SH: &str = r####"# Sourced by run.sh and by visit scripts copied into the bundle (made by `cargo xtask gpu-bundle`):
# the GPU machine's environment, and unpack_bundle SRC DST, which unpacks the bundle's xz-compressed
# executables (bin/, tests/, benches/ of SRC) into the same folders of DST with python3's lzma (the
# machine may lack xz). GPU tests fail there (instead of skipping) when no GPU is seen.
unpack_bundle() {
python3 - "$1" "$2" <<'PY'
import lzma, os, sys
src, dst = sys.argv[1], sys.argv[2]
for d in ("bin", "tests", "benches"):
    os.makedirs(os.path.join(dst, d), exist_ok=True)
    if not os.path.isdir(os.path.join(src, d)):
        continue
    for f in os.listdir(os.path.join(src, d)):
        if f.endswith(".xz"):
            o = os.path.join(dst, d, f[:-3])
            with lzma.open(os.path.join(src, d, f)) as i, open(o, "wb") as w:
                w.write(i.read())
            os.chmod(o, 0o755)
PY
}
# cuBLASLt and friends are opened by name at run time (GPU.md).
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
export DEEPINFER_REQUIRE_GPU=1
"####;

const RUN_SH: &str = r####"#!/usr/bin/env bash
# Runs every GPU test and benchmark of this bundle; results go to the folder given as $1.
# Made by `cargo xtask gpu-bundle`.
set -u
out=${1:?usage: run.sh OUTDIR}
packed=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
. "$packed/bundle.sh"
here=$(mktemp -d)
unpack_bundle "$packed" "$here"
status=0
if [ -x "$here/bin/deepinfer" ]; then
  { echo "# deepinfer doctor, $(date -u +%FT%TZ)"; "$here/bin/deepinfer" doctor; } 2>&1 | tee "$out/doctor.txt" || status=1
else
  echo "# no deepinfer binary in this bundle (left out for the carry limit), $(date -u +%FT%TZ)" > "$out/doctor.txt"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >> "$out/doctor.txt" 2>&1
for t in "$here"/tests/*; do
  [ -x "$t" ] || continue
  echo "### $(basename "$t")" | tee -a "$out/tests.log"
  "$t" --test-threads 1 --nocapture 2>&1 | tee -a "$out/tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
for b in "$here"/benches/*; do
  [ -x "$b" ] || continue
  name=$(basename "$b")
  echo "### $name" | tee -a "$out/bench.log"
  DEEPINFER_BENCH_JSON="$out/$name.json" "$b" --bench 2>&1 | tee -a "$out/bench.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
echo "run.sh: exit $status"
exit $status
"####;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_respect_the_capacity_and_keep_every_item_once() {
        let sizes = [2_000u64, 1_900, 2_100, 1_800, 2_000, 1_950, 2_200, 500];
        let plan = plan_parts(&sizes, 5_000).unwrap();
        let mut seen: Vec<usize> = plan.iter().flatten().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..sizes.len()).collect::<Vec<_>>());
        for part in &plan {
            assert!(part.iter().map(|i| sizes[*i]).sum::<u64>() <= 5_000, "{part:?}");
        }
        assert_eq!(plan.len(), 4);
        assert_eq!(plan_parts(&sizes, 10_000_000).unwrap().len(), 1);
        assert_eq!(plan_parts(&sizes, 2_150), None);
        assert_eq!(plan_parts(&[], 1).unwrap().len(), 0);
    }

    #[test]
    fn carried_sizes_are_whole_blocks() {
        assert_eq!(carried(0), 0);
        assert_eq!(carried(1), 4096);
        assert_eq!(carried(4096), 4096);
        assert_eq!(carried(4097), 8192);
    }
}
