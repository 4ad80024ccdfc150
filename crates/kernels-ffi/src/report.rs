//! What this build and this machine offer: the report behind `deepinfer doctor`.

use std::fmt;

use crate::embedded;

/// One GPU as the driver sees it.
#[derive(Debug, Clone)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_mem_bytes: usize,
    pub free_mem_bytes: usize,
}

/// Build accelerator, embedded kernels, driver, GPUs and loaded CUDA libraries.
#[derive(Debug, Clone)]
pub struct SystemReport {
    pub accelerator: &'static str,
    pub kernel_archs: String,
    pub kernel_modules: Vec<(&'static str, usize)>,
    /// `Err` says why no driver could be queried (CPU-only build, no driver, ...).
    pub driver_version: Result<String, String>,
    pub gpus: Vec<GpuInfo>,
    pub optional_libraries: Vec<(&'static str, bool)>,
    pub loaded_files: Vec<String>,
}

impl SystemReport {
    pub fn gather() -> SystemReport {
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut r = SystemReport {
            accelerator: if cfg!(feature = "cuda") { "nvidia" } else { "cpu" },
            kernel_archs: embedded::archs().to_string(),
            kernel_modules: embedded::modules(),
            driver_version: Err("built without the CUDA backend".to_string()),
            gpus: Vec::new(),
            optional_libraries: Vec::new(),
            loaded_files: Vec::new(),
        };
        #[cfg(feature = "cuda")]
        r.gather_cuda();
        r
    }

    #[cfg(feature = "cuda")]
    fn gather_cuda(&mut self) {
        use crate::cuda::libraries;
        use cudarc::driver::CudaContext;
        if let Err(e) = libraries::require_driver() {
            self.driver_version = Err(e.to_string());
            return;
        }
        let mut v: std::ffi::c_int = 0;
        // SAFETY: the driver library is present (checked above); cuDriverGetVersion only writes v.
        let rc = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
        self.driver_version = if rc == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            Ok(format!("CUDA {}.{} (driver API {v})", v / 1000, (v % 1000) / 10))
        } else {
            Err(format!("cuDriverGetVersion failed: {rc:?}"))
        };
        match CudaContext::device_count() {
            Ok(n) => {
                for i in 0..n as usize {
                    match gpu_info(i) {
                        Ok(g) => self.gpus.push(g),
                        Err(e) => self.driver_version = Err(format!("GPU {i}: {e:?}")),
                    }
                }
            }
            Err(e) => self.driver_version = Err(format!("cuDeviceGetCount failed: {e:?}")),
        }
        self.optional_libraries = libraries::probe_optional();
        self.loaded_files = libraries::loaded_files();
    }
}

#[cfg(feature = "cuda")]
fn gpu_info(i: usize) -> Result<GpuInfo, cudarc::driver::DriverError> {
    let ctx = cudarc::driver::CudaContext::new(i)?;
    let (free, total) = ctx.mem_get_info()?;
    Ok(GpuInfo {
        ordinal: i,
        name: ctx.name()?,
        compute_capability: ctx.compute_capability()?,
        total_mem_bytes: total,
        free_mem_bytes: free,
    })
}

impl fmt::Display for SystemReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const GIB: f64 = (1u64 << 30) as f64;
        writeln!(f, "build accelerator: {}", self.accelerator)?;
        if self.kernel_modules.is_empty() {
            writeln!(f, "embedded kernels: none")?;
        } else {
            writeln!(f, "embedded kernels: {} (archs: {})", self.kernel_modules.len(), self.kernel_archs)?;
            for (name, bytes) in &self.kernel_modules {
                writeln!(f, "  {name}: {bytes} bytes")?;
            }
        }
        match &self.driver_version {
            Ok(v) => writeln!(f, "driver: {v}")?,
            Err(e) => writeln!(f, "driver: unavailable ({e})")?,
        }
        for g in &self.gpus {
            writeln!(
                f,
                "gpu {}: {}, compute capability {}.{}, {:.1} GiB total, {:.1} GiB free",
                g.ordinal,
                g.name,
                g.compute_capability.0,
                g.compute_capability.1,
                g.total_mem_bytes as f64 / GIB,
                g.free_mem_bytes as f64 / GIB
            )?;
        }
        for (lib, ok) in &self.optional_libraries {
            writeln!(f, "library {lib}: {}", if *ok { "found" } else { "NOT found on the library path" })?;
        }
        for file in &self.loaded_files {
            writeln!(f, "loaded: {file}")?;
        }
        Ok(())
    }
}
