//! The CUDA libraries this backend opens at run time, checked before use and reported by
//! `deepinfer doctor` with the file each was loaded from.

use crate::error::FfiError;
use crate::Result;

/// The driver library must be present before any driver call (cudarc would panic otherwise).
pub fn require_driver() -> Result<()> {
    // SAFETY: only tries to dlopen the library by its candidate names and closes it again.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(FfiError::LibraryMissing { library: "libcuda.so", hint: "no NVIDIA driver found on the library path" })
    }
}

/// cuBLASLt, needed by the dense GEMMs.
#[allow(dead_code)]
pub fn require_cublaslt() -> Result<()> {
    // SAFETY: as above.
    if unsafe { cudarc::cublaslt::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(FfiError::LibraryMissing {
            library: "libcublasLt.so",
            hint: "put the CUDA 13 library directory (e.g. /usr/local/cuda-13.0/targets/x86_64-linux/lib) on LD_LIBRARY_PATH",
        })
    }
}

/// Whether each optional library can be opened; those that can are loaded (kept open) so that
/// [`loaded_files`] can say where they came from.
pub fn probe_optional() -> Vec<(&'static str, bool)> {
    // SAFETY: is_culib_present only dlopens by name; culib() is called only after it succeeded,
    // so it cannot take cudarc's panic path.
    unsafe {
        let lt = cudarc::cublaslt::sys::is_culib_present();
        if lt {
            let _ = cudarc::cublaslt::sys::culib();
        }
        let blas = cudarc::cublas::sys::is_culib_present();
        if blas {
            let _ = cudarc::cublas::sys::culib();
        }
        let nccl = cudarc::nccl::sys::is_culib_present();
        if nccl {
            let _ = cudarc::nccl::sys::culib();
        }
        vec![("cublasLt", lt), ("cublas", blas), ("nccl", nccl)]
    }
}

/// Paths of the CUDA/NVIDIA shared objects mapped into this process.
pub fn loaded_files() -> Vec<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut files: Vec<String> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|p| ["libcuda", "libcublas", "libnccl", "libnvrtc", "libnvidia"].iter().any(|n| p.contains(n)))
        .map(str::to_string)
        .collect();
    files.sort();
    files.dedup();
    files
}
