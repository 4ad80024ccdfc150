//! One GPU: its primary context, default stream and the kernel functions loaded so far.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig};
use cudarc::nvrtc::Ptx;

use super::libraries;
use crate::embedded;
use crate::error::FfiError;
use crate::Result;

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    /// Dynamic shared-memory limits raised so far, per function (`function_with_smem`).
    smem_limits: Mutex<HashMap<String, u32>>,
    /// How many clusters of each shape this GPU holds at once (`max_active_clusters`).
    cluster_room: Mutex<HashMap<ClusterShape, u32>>,
    /// cuBLASLt handles (each with its 32 MiB workspace) per stream, made on first use.
    blas_lt: Mutex<Vec<(Arc<CudaStream>, Arc<cudarc::cublaslt::CudaBlasLT>)>>,
    /// Compute capability (major, minor): kernels built for sm_90a only (wgmma) run on (9, 0).
    capability: (i32, i32),
    /// Streaming multiprocessors: the grid of persistent kernels.
    sm_count: u32,
    /// The split decode GEMM's scratch per stream, made on first use and grown on demand.
    split_scratch: Mutex<Vec<(Arc<CudaStream>, SplitScratch)>>,
    /// The router GEMM's k-split partials per stream (`take_router_scratch`), kept between calls
    /// for the reason `SplitScratch` gives.
    router_scratch: Mutex<Vec<(Arc<CudaStream>, CudaSlice<f32>)>>,
    /// Streams (their CUstream handles) whose last queued operation may be a wait for an event
    /// of another stream: the next kernel launched there goes without programmatic dependent
    /// launch, which lets a kernel start under the kernel before it in its stream and so pass
    /// such a wait by. On the H200 a combine launched that way after the MoE layer's join read the
    /// shared expert's output before the other stream had written it (an experiment, not kept);
    /// the shared expert's first GEMM after the fork is the case the layer has.
    waited: Mutex<std::collections::HashSet<usize>>,
}

/// A kernel's clusters as the driver sizes them: (the function's driver handle, dynamic shared
/// memory, block threads, blocks of the cluster along y).
type ClusterShape = (usize, u32, u32, u32);

/// Scratch of a GEMM whose k splits add up inside the launch through global memory
/// (`di_gemm_fp8_dec_*` with several splits and no cluster): fp32 partial sums, and a counter per
/// row block that the last block of the row block leaves at zero for the next launch. Kept per
/// stream (launches on one stream are ordered) and not allocated per call, so no allocation sits
/// between two launches that overlap (programmatic dependent launch).
pub(crate) struct SplitScratch {
    pub partial: CudaSlice<f32>,
    pub counters: CudaSlice<u32>,
}

/// Ops allocate their scratch (quantised activations, split-k partials) with stream-ordered
/// `cuMemAllocAsync` from the device's memory pool. By default the pool hands freed memory back to
/// the driver at every synchronisation, so the next step's allocations map fresh pages: on the H200
/// the 4096 x 2048 x 4096 FP8 GEMM op took 146 us around an 81 us kernel, with a sync every call (as
/// an engine has every decode step). Keeping freed memory in the pool (release threshold:
/// unlimited) makes those allocations reuse it.
fn keep_freed_memory_pooled(ctx: &CudaContext) -> Result<()> {
    // SAFETY: the device handle comes from a live context; the attribute takes a u64.
    unsafe {
        let pool = cudarc::driver::result::device::get_mem_pool(ctx.cu_device())?;
        let mut threshold = u64::MAX;
        cudarc::driver::result::mem_pool::set_attribute(
            pool,
            cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )?;
    }
    Ok(())
}

impl CudaBackend {
    pub fn new(ordinal: usize) -> Result<Arc<Self>> {
        libraries::require_driver()?;
        let count = CudaContext::device_count()? as usize;
        if ordinal >= count {
            return Err(FfiError::NoSuchDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: called before any buffer exists. With event tracking on, cudarc would record and
        // wait on events for every buffer of every launch as soon as a second stream exists; this
        // crate orders work across its streams itself (Stream::wait_event), and every buffer is
        // freed on the stream that last used it or after such a wait.
        unsafe { ctx.disable_event_tracking() };
        if ctx.has_async_alloc() {
            keep_freed_memory_pooled(&ctx)?;
        }
        let stream = ctx.default_stream();
        let capability = ctx.compute_capability()?;
        let sm_count =
            ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        Ok(Arc::new(CudaBackend {
            ctx,
            stream,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            smem_limits: Mutex::new(HashMap::new()),
            cluster_room: Mutex::new(HashMap::new()),
            blas_lt: Mutex::new(Vec::new()),
            capability,
            sm_count: sm_count.max(1) as u32,
            split_scratch: Mutex::new(Vec::new()),
            router_scratch: Mutex::new(Vec::new()),
            waited: Mutex::new(std::collections::HashSet::new()),
        }))
    }

    /// (free, total) bytes of device memory.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        Ok(self.ctx.mem_get_info()?)
    }

    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Whether this is a Hopper (compute capability 9.0): the sm_90a-only kernels (wgmma, TMA) apply.
    pub fn is_sm90(&self) -> bool {
        self.capability == (9, 0)
    }

    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// The SM count on a Hopper (sm_90), where the wgmma kernels apply; `None` elsewhere.
    pub fn hopper_sms(&self) -> Option<u32> {
        self.is_sm90().then_some(self.sm_count)
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn default_stream(&self) -> Arc<CudaStream> {
        self.stream.clone()
    }

    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        Ok(self.ctx.new_stream()?)
    }

    /// The cuBLASLt handle bound to `stream`.
    pub fn blas_lt(&self, stream: &Arc<CudaStream>) -> Result<Arc<cudarc::cublaslt::CudaBlasLT>> {
        let mut all = lock(&self.blas_lt);
        if let Some((_, h)) = all.iter().find(|(s, _)| Arc::ptr_eq(s, stream)) {
            return Ok(h.clone());
        }
        let h = Arc::new(cudarc::cublaslt::CudaBlasLT::new(stream.clone())?);
        all.push((stream.clone(), h.clone()));
        Ok(h)
    }

    /// The entry point `name` of kernel module `module` (the `.cu` file stem), loaded on first use.
    pub fn function(&self, module: &'static str, name: &str) -> Result<CudaFunction> {
        let key = format!("{module}::{name}");
        if let Some(f) = lock(&self.functions).get(&key) {
            return Ok(f.clone());
        }
        let m = {
            let mut modules = lock(&self.modules);
            match modules.get(module) {
                Some(m) => m.clone(),
                None => {
                    let image = embedded::module(module)
                        .ok_or_else(|| FfiError::KernelsNotEmbedded { module: module.to_string() })?;
                    let m = self.ctx.load_module(Ptx::from_binary(image.to_vec()))?;
                    modules.insert(module, m.clone());
                    m
                }
            }
        };
        let f = m.load_function(name)?;
        lock(&self.functions).insert(key, f.clone());
        Ok(f)
    }
}

/// Whether `stream` is recording a CUDA graph: memory made then would belong to the graph (see
/// [`FfiError::CaptureNeedsWarmup`]).
fn capturing(stream: &CudaStream) -> Result<bool> {
    use cudarc::driver::sys::CUstreamCaptureStatus as S;
    Ok(stream.capture_status()? != S::CU_STREAM_CAPTURE_STATUS_NONE)
}

impl CudaBackend {
    /// Runs `f` with `stream`'s split scratch holding at least `floats` partials and `counters`
    /// zeroed counters (made or grown here, zeroed when made; kernels leave counters at zero).
    pub(crate) fn with_split_scratch<R>(
        &self,
        stream: &Arc<CudaStream>,
        floats: usize,
        counters: usize,
        f: impl FnOnce(&mut SplitScratch) -> Result<R>,
    ) -> Result<R> {
        let mut all = lock(&self.split_scratch);
        let found = all.iter().position(|(s, _)| Arc::ptr_eq(s, stream));
        let fits = found.is_some_and(|i| all[i].1.partial.len() >= floats && all[i].1.counters.len() >= counters);
        if !fits && capturing(stream)? {
            return Err(FfiError::CaptureNeedsWarmup { what: "the stream's split-k scratch" });
        }
        let i = match found {
            Some(i) => i,
            None => {
                let scratch = SplitScratch {
                    partial: stream.alloc_zeros(floats.max(1))?,
                    counters: stream.alloc_zeros(counters.max(1))?,
                };
                all.push((stream.clone(), scratch));
                all.len() - 1
            }
        };
        let scratch = &mut all[i].1;
        if scratch.partial.len() < floats {
            scratch.partial = stream.alloc_zeros(floats)?;
        }
        if scratch.counters.len() < counters {
            scratch.counters = stream.alloc_zeros(counters)?;
        }
        f(scratch)
    }

    /// `stream`'s router scratch of at least `floats` floats, taken out until
    /// [`CudaBackend::keep_router_scratch`] puts it back: kept from the call before when large
    /// enough, else made here (a smaller one is freed here, before the router GEMM is queued,
    /// never between two kernels of the step).
    pub(crate) fn take_router_scratch(&self, stream: &Arc<CudaStream>, floats: usize) -> Result<CudaSlice<f32>> {
        let kept = {
            let mut all = lock(&self.router_scratch);
            let found = all.iter().position(|(s, _)| Arc::ptr_eq(s, stream));
            // A kept buffer too small stays kept while capturing (freeing it there would free
            // memory the graph does not own).
            if found.is_none_or(|i| all[i].1.len() < floats) && capturing(stream)? {
                return Err(FfiError::CaptureNeedsWarmup { what: "the stream's router scratch" });
            }
            found.map(|i| all.swap_remove(i).1)
        };
        match kept {
            Some(buf) if buf.len() >= floats => Ok(buf),
            _ => {
                // SAFETY: uninitialised; the router GEMM writes every slice before the fold reads it.
                Ok(unsafe { stream.alloc::<f32>(floats) }?)
            }
        }
    }

    /// Puts `stream`'s router scratch back (after the launches that use it are queued).
    pub(crate) fn keep_router_scratch(&self, stream: &Arc<CudaStream>, buf: CudaSlice<f32>) {
        lock(&self.router_scratch).push((stream.clone(), buf));
    }

    /// Whether a kernel launched now on `stream` goes with programmatic dependent launch when its
    /// caller `want`s it: not the first one after a wait for another stream's event (which the
    /// attribute could let it pass by). The kernels that trigger early take the answer as their
    /// `pdl` argument (`pdl_trigger`, sm90.cuh): a kernel launched without the attribute that
    /// triggered anyway would not be waited for by a next kernel that has it.
    pub(crate) fn pdl_for(&self, stream: &CudaStream, want: bool) -> bool {
        want && !lock(&self.waited).remove(&(stream.cu_stream() as usize))
    }

    /// Launches `f` on `stream` with its arguments as pointers to their values (what `cuLaunchKernelEx`
    /// takes), with programmatic dependent launch when `pdl` (decided by [`CudaBackend::pdl_for`]):
    /// the grid may then start while the grid before it in the stream still runs, so the kernel
    /// must call `pdl_wait` (sm90.cuh) before it touches anything that grid may write or read.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number, order and types, and point at live
    /// values; the buffers they reference must stay alive until the kernel has run.
    pub(crate) unsafe fn launch_ex(
        &self,
        stream: &CudaStream,
        f: &CudaFunction,
        cfg: LaunchConfig,
        pdl: bool,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        // SAFETY: the caller's guarantees are this one's.
        unsafe { self.launch_ex_clusters(stream, f, cfg, pdl, 1, args) }
    }

    /// [`CudaBackend::launch_ex`] with the grid in clusters of `cluster_y` blocks along y (1: no
    /// clusters), whose blocks are co-scheduled and share their shared memory (`mapa`, sm90.cuh).
    /// Sizes above 8 need [`CudaBackend::max_active_clusters`] asked first (it allows them on `f`).
    ///
    /// # Safety
    /// As [`CudaBackend::launch_ex`]; the grid's y must be a multiple of `cluster_y`.
    pub(crate) unsafe fn launch_ex_clusters(
        &self,
        stream: &CudaStream,
        f: &CudaFunction,
        cfg: LaunchConfig,
        pdl: bool,
        cluster_y: u32,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        use cudarc::driver::sys;
        self.ctx.bind_to_thread()?;
        let mut attrs = launch_attrs(pdl, cluster_y);
        let config = launch_config(cfg, stream.cu_stream(), &mut attrs);
        // SAFETY: the caller guarantees the arguments; config and attrs outlive the call.
        unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()) }.result()?;
        Ok(())
    }

    /// How many clusters of `cluster_y` blocks (along y) of `f` (`cfg`'s block and shared memory)
    /// this GPU holds at once (`cuOccupancyMaxActiveClusters`; 0 where the driver refuses the size),
    /// asked once per function, shared memory, block and cluster. Allows sizes above 8
    /// (non-portable) on `f`.
    pub(crate) fn max_active_clusters(&self, f: &CudaFunction, cfg: LaunchConfig, cluster_y: u32) -> Result<u32> {
        use cudarc::driver::sys;
        let key = (f.cu_function() as usize, cfg.shared_mem_bytes, cfg.block_dim.0, cluster_y);
        if let Some(n) = lock(&self.cluster_room).get(&key) {
            return Ok(*n);
        }
        self.ctx.bind_to_thread()?;
        if cluster_y > 8 {
            f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)?;
        }
        let mut attrs = launch_attrs(false, cluster_y);
        // The grid must be a multiple of the cluster; its size does not enter the answer.
        let one = LaunchConfig { grid_dim: (1, cluster_y, 1), ..cfg };
        let config = launch_config(one, std::ptr::null_mut(), &mut attrs);
        let mut n: std::ffi::c_int = 0;
        // SAFETY: config and attrs outlive the call; `n` is written by it.
        let r = unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f.cu_function(), &config) };
        let n = if r == sys::CUresult::CUDA_SUCCESS { n.max(0) as u32 } else { 0 };
        lock(&self.cluster_room).insert(key, n);
        Ok(n)
    }

    /// Note that `stream` now waits for an event of another stream ([`crate::Stream::wait_event`]):
    /// its next [`CudaBackend::pdl_for`] answers no.
    pub(crate) fn note_event_wait(&self, stream: &CudaStream) {
        lock(&self.waited).insert(stream.cu_stream() as usize);
    }

    /// [`CudaBackend::function`] with the function's dynamic shared-memory limit raised to `bytes`
    /// (past the 48 KiB default); the driver call happens once per function, not per launch.
    pub fn function_with_smem(&self, module: &'static str, name: &str, bytes: u32) -> Result<CudaFunction> {
        let f = self.function(module, name)?;
        if bytes == 0 {
            return Ok(f);
        }
        let key = format!("{module}::{name}");
        let mut limits = lock(&self.smem_limits);
        if limits.get(&key).is_none_or(|b| *b < bytes) {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )?;
            limits.insert(key, bytes);
        }
        Ok(f)
    }
}

/// The launch attributes of [`CudaBackend::launch_ex_clusters`]: programmatic dependent launch when
/// `pdl`, clusters of `cluster_y` blocks along y when that is above 1. Only the first `n` of the
/// pair are set (the count travels with them).
fn launch_attrs(pdl: bool, cluster_y: u32) -> ([cudarc::driver::sys::CUlaunchAttribute; 2], u32) {
    use cudarc::driver::sys;
    // SAFETY: zeroed attributes are valid; each id set below is paired with its documented value.
    let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
    let mut n = 0;
    if pdl {
        attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attrs[n].value.programmaticStreamSerializationAllowed = 1;
        n += 1;
    }
    if cluster_y > 1 {
        attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attrs[n].value.clusterDim.x = 1;
        attrs[n].value.clusterDim.y = cluster_y;
        attrs[n].value.clusterDim.z = 1;
        n += 1;
    }
    (attrs, n as u32)
}

/// `cfg` on `stream` with the attributes of [`launch_attrs`] (which must outlive the result).
fn launch_config(
    cfg: LaunchConfig,
    stream: cudarc::driver::sys::CUstream,
    attrs: &mut ([cudarc::driver::sys::CUlaunchAttribute; 2], u32),
) -> cudarc::driver::sys::CUlaunchConfig {
    cudarc::driver::sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream,
        attrs: attrs.0.as_mut_ptr(),
        numAttrs: attrs.1,
    }
}

/// A poisoned lock only means another thread panicked while inserting into a cache; the map is
/// still consistent, so keep using it.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUlaunchAttributeID as Id;

    #[test]
    fn launch_attributes_carry_only_what_is_asked() {
        let (_, n) = launch_attrs(false, 1);
        assert_eq!(n, 0);
        let (a, n) = launch_attrs(true, 1);
        assert_eq!((n, a[0].id), (1, Id::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION));
        // SAFETY: reading the union member the id names.
        assert_eq!(unsafe { a[0].value.programmaticStreamSerializationAllowed }, 1);
        for pdl in [false, true] {
            let (a, n) = launch_attrs(pdl, 8);
            let c = &a[n as usize - 1];
            assert_eq!((n, c.id), (1 + u32::from(pdl), Id::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION));
            // SAFETY: as above.
            let d = unsafe { c.value.clusterDim };
            assert_eq!((d.x, d.y, d.z), (1, 8, 1));
        }
        let mut attrs = launch_attrs(true, 4);
        let cfg = LaunchConfig { grid_dim: (6, 8, 1), block_dim: (256, 1, 1), shared_mem_bytes: 1024 };
        let c = launch_config(cfg, std::ptr::null_mut(), &mut attrs);
        assert_eq!((c.gridDimX, c.gridDimY, c.blockDimX, c.sharedMemBytes, c.numAttrs), (6, 8, 256, 1024, 2));
        assert_eq!(c.attrs, attrs.0.as_mut_ptr());
    }
}
