//! Imports run one way: an op's front module (`src/attention.rs`, `src/moe.rs`, ...) calls its
//! backends (`src/cpu/`, `src/cuda/`), and both take the shapes, switches and dispatch decisions
//! they agree on from `src/shapes/`. No backend or shapes file names a front module in code (a
//! comment may mention one), so neither side forms a circle with the other.

use std::path::Path;

/// The front modules: every `src/*.rs` that is an op (or its helpers) rather than the foundation
/// (device, element, error, params, quant, ...) that all layers share.
const FRONTS: &[&str] =
    &["attention", "compressor", "hc", "indexer", "kv_fp8", "moe", "ops", "rope", "rows", "sampling", "report"];

fn code(line: &str) -> &str {
    let t = line.trim_start();
    if t.starts_with("//") {
        return "";
    }
    line.split("//").next().unwrap_or("")
}

#[test]
fn backends_and_shapes_never_name_a_front_module() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut bad = Vec::new();
    let mut files = 0;
    for dir in ["cpu", "cuda", "shapes"] {
        for e in std::fs::read_dir(src.join(dir)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            files += 1;
            let text = std::fs::read_to_string(&p).unwrap();
            for (i, line) in text.lines().enumerate() {
                let c = code(line);
                for f in FRONTS {
                    for pat in [format!("crate::{f}::"), format!("crate::{f};"), format!("crate::{{{f}")] {
                        if c.contains(&pat) {
                            bad.push(format!("{}:{}: {}", p.display(), i + 1, line.trim()));
                        }
                    }
                }
                if dir != "shapes"
                    && c.contains("use crate::{")
                    && FRONTS.iter().any(|f| c.contains(&format!(" {f},")) || c.contains(&format!("{{{f},")))
                {
                    bad.push(format!("{}:{}: {}", p.display(), i + 1, line.trim()));
                }
            }
        }
    }
    assert!(files >= 20, "read only {files} files under {}", src.display());
    assert!(bad.is_empty(), "backend or shapes code naming a front module:\n{}", bad.join("\n"));
}
