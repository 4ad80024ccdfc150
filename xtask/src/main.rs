//! `cargo xtask`: the build system of DeepInfer-rs, one module per subcommand.

mod bench;
mod bindgen_cmd;
mod build;
mod ci;
mod cuda_toolchain;
mod gpu_bundle;
mod kernels;
mod py_clients;
mod python_pkg;
mod workspace;

use anyhow::{bail, Result};

const USAGE: &str = "\
usage: cargo xtask <command> [options]

commands:
  cuda-toolchain               install the pinned CUDA 13.0 compiler wheels into target/cuda-toolchain
  py-clients                   install the pinned openai/anthropic/pytest wheels into target/py-clients
                               (the server's client suite runs with them)
  kernels [--check]            compile kernels/cuda/*.cu to fatbins in target/kernels (--check: fail if
                               kernels/kernels.lock is stale)
  build [--accelerator nvidia|ascend|cpu] [--release]
                               build the workspace for one accelerator (default: $DEEPINFER_ACCELERATOR or cpu)
  bindgen [--check]            regenerate kernels-ffi's parameter structs from kernels/include (--check: fail if stale)
  python [--cuda]              build the Python wheel (crates/python) and run its pytest suite in a fresh venv
                               (--cuda: with the CUDA backend compiled in; needs `kernels` first)
  ci                           everything CI runs: fmt, bindgen --check, kernels --check, clippy, tests, python
  bench [--crate NAME]         run the criterion benchmarks (of one crate: kv, moe, scheduler, ...)
  gpu-bundle [--only A,B]      kernels, release binary, GPU tests and benchmarks, and run.sh in target/gpu-bundle
                               (--only: just the gpu_* targets whose names contain A or B, no binary)
";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((cmd, rest)) = args.split_first() else {
        print!("{USAGE}");
        bail!("no command given");
    };
    let flags = Flags::parse(rest)?;
    match cmd.as_str() {
        "cuda-toolchain" => {
            flags.only(&[])?;
            let nvcc = cuda_toolchain::nvcc()?;
            println!("nvcc: {}", nvcc.display());
            Ok(())
        }
        "py-clients" => {
            flags.only(&[])?;
            println!("python: {}", py_clients::python()?.display());
            Ok(())
        }
        "kernels" => {
            flags.only(&["--check"])?;
            kernels::run(flags.has("--check"))
        }
        "build" => {
            flags.only(&["--accelerator", "--release"])?;
            build::run(flags.value("--accelerator"), flags.has("--release"))
        }
        "bindgen" => {
            flags.only(&["--check"])?;
            bindgen_cmd::run(flags.has("--check"))
        }
        "python" => {
            flags.only(&["--cuda"])?;
            python_pkg::run(flags.has("--cuda"), false)
        }
        "ci" => {
            flags.only(&[])?;
            ci::run()
        }
        "bench" => {
            flags.only(&["--crate"])?;
            bench::run(flags.value("--crate"))
        }
        "gpu-bundle" => {
            flags.only(&["--only"])?;
            gpu_bundle::run(flags.value("--only").as_deref())
        }
        "help" | "--help" | "-h" => {
            print!("{USAGE}");
            Ok(())
        }
        other => {
            print!("{USAGE}");
            bail!("unknown command `{other}`")
        }
    }
}

/// `--flag` and `--key value` / `--key=value` options.
struct Flags(Vec<(String, Option<String>)>);

impl Flags {
    fn parse(args: &[String]) -> Result<Flags> {
        let mut out = Vec::new();
        let mut it = args.iter().peekable();
        while let Some(a) = it.next() {
            if !a.starts_with("--") {
                bail!("unexpected argument `{a}`");
            }
            if let Some((k, v)) = a.split_once('=') {
                out.push((k.to_string(), Some(v.to_string())));
            } else if it.peek().is_some_and(|n| !n.starts_with("--")) {
                out.push((a.clone(), it.next().cloned()));
            } else {
                out.push((a.clone(), None));
            }
        }
        Ok(Flags(out))
    }

    fn only(&self, allowed: &[&str]) -> Result<()> {
        for (k, _) in &self.0 {
            if !allowed.contains(&k.as_str()) {
                bail!(
                    "unknown option `{k}` (accepted: {})",
                    if allowed.is_empty() { "none".to_string() } else { allowed.join(", ") }
                );
            }
        }
        Ok(())
    }

    fn has(&self, k: &str) -> bool {
        self.0.iter().any(|(n, _)| n == k)
    }

    fn value(&self, k: &str) -> Option<String> {
        self.0.iter().find(|(n, _)| n == k).and_then(|(_, v)| v.clone())
    }
}
