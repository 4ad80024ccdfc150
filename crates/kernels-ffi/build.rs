//! Embeds the kernel fatbins that `cargo xtask kernels` compiled, when the `cuda` feature is on.
//!
//! The fatbins live in `target/kernels` (or `$DEEPINFER_KERNELS_DIR`). Only modules that exist are
//! embedded: a CPU-only machine still builds, and the CUDA backend then answers with a typed
//! "kernels not embedded" error naming the module. Plain `cargo build` never runs nvcc.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=DEEPINFER_KERNELS_DIR");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let mut table = String::from("pub(crate) static MODULES: &[(&str, &[u8])] = &[\n");
    let mut archs = String::new();

    if env::var_os("CARGO_FEATURE_CUDA").is_some() {
        let dir = match env::var_os("DEEPINFER_KERNELS_DIR") {
            Some(d) => PathBuf::from(d),
            None => {
                let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
                manifest.join("../../target/kernels")
            }
        };
        // Watching a directory that does not exist would rerun this script on every build;
        // creating it (empty) keeps incremental builds quiet until kernels appear in it.
        let _ = fs::create_dir_all(&dir);
        println!("cargo:rerun-if-changed={}", dir.display());
        let mut modules: Vec<PathBuf> =
            fs::read_dir(&dir).map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect()).unwrap_or_default();
        modules.retain(|p| p.extension().is_some_and(|e| e == "fatbin"));
        modules.sort();
        for path in modules {
            let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_string();
            let abs = fs::canonicalize(&path).unwrap_or(path);
            let _ = writeln!(table, "    ({name:?}, include_bytes!({:?})),", abs.display().to_string());
        }
        archs = fs::read_to_string(dir.join("ARCHS")).unwrap_or_default();
    }
    table.push_str("];\n");
    let _ = writeln!(table, "pub(crate) static ARCHS: &str = {:?};", archs.trim());
    fs::write(out.join("embedded_kernels.rs"), table).expect("write embedded_kernels.rs");
}
