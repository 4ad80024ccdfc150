//! `cargo xtask kernels [--check]`: kernels/cuda/*.cu -> target/kernels/<module>.fatbin.
//!
//! SASS only, for sm_90a (H100/H200) and sm_100a (B200), with the `-gencode` form (the `-arch`
//! shorthand adds a plain sm_90 pass that rejects wgmma/setmaxnreg). Each module's input hash
//! covers the nvcc release, the flags, every shared header and its own source; unchanged modules
//! are skipped (target/kernels/manifest.json keeps input and fatbin hashes).
//!
//! `kernels/kernels.lock` records the input hash per module, and `--check` compiles every module
//! and fails when the lock is stale. The lock does not record fatbin hashes: `-lineinfo` embeds
//! the compilation directory, so the same sources give different bytes in another checkout (seen
//! here: 30,689 of 70,368 bytes differed between two directories).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use xshell::cmd;

use crate::{cuda_toolchain, workspace};

const ARCHS: &str = "sm_90a sm_100a";
const FLAGS: [&str; 8] = [
    "-fatbin",
    "-O3",
    "-std=c++17",
    "--threads",
    "2",
    "-lineinfo",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_100a,code=sm_100a",
];

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn sha256(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

/// Files in `dir` ending with `ext`, sorted, as paths relative to the workspace root.
fn files(dir: &str, ext: &str) -> Result<Vec<PathBuf>> {
    let abs = workspace::root().join(dir);
    let mut out = Vec::new();
    if let Ok(rd) = fs::read_dir(&abs) {
        for e in rd {
            let name = e?.file_name().to_string_lossy().to_string();
            if name.ends_with(ext) {
                out.push(Path::new(dir).join(name));
            }
        }
    }
    out.sort();
    Ok(out)
}

pub fn run(check: bool) -> Result<()> {
    let root = workspace::root();
    let nvcc = cuda_toolchain::nvcc()?;
    let version = cuda_toolchain::version(&nvcc).unwrap_or_default();
    let release = version.lines().find(|l| l.contains(cuda_toolchain::RELEASE)).unwrap_or("").trim().to_string();

    let mut common = Sha256::new();
    common.update(release.as_bytes());
    common.update(FLAGS.join(" ").as_bytes());
    for h in files("kernels/include", ".h")?.into_iter().chain(files("kernels/cuda", ".cuh")?) {
        common.update(h.to_string_lossy().as_bytes());
        common.update(fs::read(root.join(&h))?);
    }

    let out_dir = workspace::kernels_out();
    fs::create_dir_all(&out_dir)?;
    let manifest_path = out_dir.join("manifest.json");
    let previous: BTreeMap<String, (String, String)> = fs::read_to_string(&manifest_path)
        .ok()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
        .and_then(|v| v.get("modules").cloned())
        .and_then(|m| serde_json::from_value(m).ok())
        .unwrap_or_default();

    let sh = workspace::shell()?;
    let mut modules = BTreeMap::new();
    for src in files("kernels/cuda", ".cu")? {
        let name = src.file_stem().and_then(|s| s.to_str()).context("kernel file name")?.to_string();
        let mut h = common.clone();
        h.update(src.to_string_lossy().as_bytes());
        h.update(fs::read(root.join(&src))?);
        let input = hex(&h.finalize());
        let fatbin = out_dir.join(format!("{name}.fatbin"));
        let current = fs::read(&fatbin).ok().map(|b| sha256(&b));
        let up_to_date =
            previous.get(&name).is_some_and(|(i, f)| *i == input && current.as_deref() == Some(f.as_str()));
        if up_to_date {
            println!("kernels: {name} up to date");
        } else {
            let t = Instant::now();
            let tmp = out_dir.join(format!("{name}.fatbin.tmp"));
            cmd!(sh, "{nvcc} {FLAGS...} -o {tmp} {src}")
                .run()
                .with_context(|| format!("nvcc failed on {}", src.display()))?;
            fs::rename(&tmp, &fatbin)?;
            println!("kernels: compiled {name} in {:.1}s", t.elapsed().as_secs_f32());
        }
        let fat_hash = sha256(&fs::read(&fatbin)?);
        modules.insert(name, (input, fat_hash));
    }
    // Fatbins of deleted sources would otherwise stay embedded.
    for e in fs::read_dir(&out_dir)? {
        let p = e?.path();
        let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_string();
        if p.extension().is_some_and(|x| x == "fatbin") && !modules.contains_key(&stem) {
            fs::remove_file(&p)?;
        }
    }
    let manifest = serde_json::json!({ "toolchain": release, "archs": ARCHS, "flags": FLAGS, "modules": modules });
    fs::write(&manifest_path, serde_json::to_string_pretty(&manifest)?)?;
    fs::write(out_dir.join("ARCHS"), ARCHS)?;

    let mut lock = String::from(
        "# Written by `cargo xtask kernels`: module and input hash (nvcc release, flags, headers, source).\n",
    );
    lock.push_str(&format!("# toolchain: {release}\n"));
    for (name, (input, _)) in &modules {
        lock.push_str(&format!("{name} {input}\n"));
    }
    let lock_path = root.join("kernels/kernels.lock");
    if check {
        let committed = fs::read_to_string(&lock_path).unwrap_or_default();
        if committed != lock {
            bail!("kernels/kernels.lock is stale: a kernel, header or the toolchain changed. Run `cargo xtask kernels` and commit the lock.\n--- committed\n{committed}--- built\n{lock}");
        }
        println!("kernels: {} modules match kernels/kernels.lock", modules.len());
    } else {
        fs::write(&lock_path, lock)?;
    }
    Ok(())
}
