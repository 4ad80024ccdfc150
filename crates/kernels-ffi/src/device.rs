//! Devices, streams, events and device buffers.
//!
//! A [`Stream`] is where work is ordered: buffers are allocated, filled, read back and operated on
//! through it. On the CPU a stream runs everything synchronously. A [`DeviceBuffer`] owns its memory
//! and frees it on drop (a CUDA allocation is freed stream-ordered by cudarc).

use std::fmt;
use std::time::Instant;

use crate::element::Element;
use crate::error::FfiError;
use crate::Result;

#[cfg(feature = "cuda")]
use crate::cuda::CudaBackend;
#[cfg(feature = "cuda")]
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

/// A compute device: the CPU reference backend or one CUDA GPU.
#[derive(Clone)]
pub enum Device {
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda(Arc<CudaBackend>),
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

impl Device {
    pub fn cpu() -> Device {
        Device::Cpu
    }

    /// The GPU with this ordinal. Errors when the binary has no CUDA backend, the driver library
    /// is missing, or there is no such GPU.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        #[cfg(feature = "cuda")]
        {
            Ok(Device::Cuda(CudaBackend::new(ordinal)?))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = ordinal;
            Err(FfiError::CudaNotBuilt)
        }
    }

    /// `cpu`, `cuda` (GPU 0) or `cuda:N`.
    pub fn parse(spec: &str) -> Result<Device> {
        match spec {
            "cpu" => Ok(Device::cpu()),
            "cuda" => Device::cuda(0),
            s => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Device::cuda(n),
                _ => Err(FfiError::UnknownDevice(s.to_string())),
            },
        }
    }

    pub fn kind(&self) -> DeviceKind {
        match self {
            Device::Cpu => DeviceKind::Cpu,
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => DeviceKind::Cuda,
        }
    }

    /// `cpu` or `cuda:N`.
    /// (free, total) bytes of the device's memory; `None` for the CPU (host memory is not
    /// budgeted here).
    pub fn memory_info(&self) -> Result<Option<(usize, usize)>> {
        match self {
            Device::Cpu => Ok(None),
            #[cfg(feature = "cuda")]
            Device::Cuda(b) => Ok(Some(b.memory_info()?)),
        }
    }

    pub fn label(&self) -> String {
        match self {
            Device::Cpu => "cpu".to_string(),
            #[cfg(feature = "cuda")]
            Device::Cuda(b) => format!("cuda:{}", b.ordinal()),
        }
    }

    /// The device's default stream.
    pub fn default_stream(&self) -> Stream {
        match self {
            Device::Cpu => Stream {
                device: self.clone(),
                #[cfg(feature = "cuda")]
                cuda: None,
            },
            #[cfg(feature = "cuda")]
            Device::Cuda(b) => Stream { device: self.clone(), cuda: Some(b.default_stream()) },
        }
    }

    /// A new stream, independent of the default one.
    pub fn new_stream(&self) -> Result<Stream> {
        match self {
            Device::Cpu => Ok(self.default_stream()),
            #[cfg(feature = "cuda")]
            Device::Cuda(b) => Ok(Stream { device: self.clone(), cuda: Some(b.new_stream()?) }),
        }
    }
}

/// An ordered queue of work on one device.
#[derive(Clone)]
pub struct Stream {
    device: Device,
    #[cfg(feature = "cuda")]
    cuda: Option<Arc<cudarc::driver::CudaStream>>,
}

pub(crate) enum Storage<T: Element> {
    Host(Vec<T>),
    #[cfg(feature = "cuda")]
    Cuda(cudarc::driver::CudaSlice<T>),
}

/// A buffer of `T` in one device's memory, freed on drop.
pub struct DeviceBuffer<T: Element> {
    pub(crate) storage: Storage<T>,
}

impl<T: Element> DeviceBuffer<T> {
    pub fn len(&self) -> usize {
        match &self.storage {
            Storage::Host(v) => v.len(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn kind(&self) -> DeviceKind {
        match &self.storage {
            Storage::Host(_) => DeviceKind::Cpu,
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => DeviceKind::Cuda,
        }
    }

    /// The host elements; callers dispatch here only after `check_on` placed the buffer on a CPU stream.
    pub(crate) fn host(&self) -> &[T] {
        match &self.storage {
            Storage::Host(v) => v,
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => unreachable!("check_on verified the buffer is on the CPU"),
        }
    }

    pub(crate) fn host_mut(&mut self) -> &mut [T] {
        match &mut self.storage {
            Storage::Host(v) => v,
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => unreachable!("check_on verified the buffer is on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn cuda(&self) -> &cudarc::driver::CudaSlice<T> {
        match &self.storage {
            Storage::Cuda(s) => s,
            Storage::Host(_) => unreachable!("check_on verified the buffer is on a CUDA device"),
        }
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_mut(&mut self) -> &mut cudarc::driver::CudaSlice<T> {
        match &mut self.storage {
            Storage::Cuda(s) => s,
            Storage::Host(_) => unreachable!("check_on verified the buffer is on a CUDA device"),
        }
    }

    pub(crate) fn location(&self) -> String {
        match &self.storage {
            Storage::Host(_) => "cpu".to_string(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => format!("cuda:{}", s.ordinal()),
        }
    }
}

impl Stream {
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// A new buffer holding a copy of `data`.
    pub fn upload<T: Element>(&self, data: &[T]) -> Result<DeviceBuffer<T>> {
        #[cfg(feature = "cuda")]
        if let Some(s) = &self.cuda {
            return Ok(DeviceBuffer { storage: Storage::Cuda(s.clone_htod(data)?) });
        }
        Ok(DeviceBuffer { storage: Storage::Host(data.to_vec()) })
    }

    /// A new zero-filled buffer of `len` elements.
    pub fn zeros<T: Element>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        #[cfg(feature = "cuda")]
        if let Some(s) = &self.cuda {
            return Ok(DeviceBuffer { storage: Storage::Cuda(s.alloc_zeros::<T>(len)?) });
        }
        Ok(DeviceBuffer { storage: Storage::Host(vec![T::zeroed(); len]) })
    }

    /// Overwrite `buf` with `data` (same length).
    pub fn write<T: Element>(&self, buf: &mut DeviceBuffer<T>, data: &[T]) -> Result<()> {
        if data.len() != buf.len() {
            return Err(FfiError::shape(
                "write",
                "data",
                format!("{} elements for a buffer of {}", data.len(), buf.len()),
            ));
        }
        match &mut buf.storage {
            Storage::Host(v) => v.copy_from_slice(data),
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => self.cuda_stream("write", "buf")?.memcpy_htod(data, d)?,
        }
        Ok(())
    }

    /// Set every element of `buf` to zero, stream-ordered (no host synchronisation).
    pub fn fill_zero<T: Element>(&self, buf: &mut DeviceBuffer<T>) -> Result<()> {
        match &mut buf.storage {
            Storage::Host(v) => v.iter_mut().for_each(|x| *x = T::from_f32(0.0)),
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => self.cuda_stream("fill_zero", "buf")?.memset_zeros(d)?,
        }
        Ok(())
    }

    /// Copy `len` elements of `buf` from offset `src` to offset `dst` (ranges must not overlap),
    /// stream-ordered. Copy-on-write of KV blocks uses it.
    pub fn copy_within<T: Element>(&self, buf: &mut DeviceBuffer<T>, src: usize, dst: usize, len: usize) -> Result<()> {
        let n = buf.len();
        if src.checked_add(len).is_none_or(|e| e > n) || dst.checked_add(len).is_none_or(|e| e > n) {
            return Err(FfiError::shape(
                "copy_within",
                "len",
                format!("{len} elements at {src} -> {dst} in a buffer of {n}"),
            ));
        }
        if src < dst + len && dst < src + len {
            return Err(FfiError::shape(
                "copy_within",
                "dst",
                format!("ranges {src}..+{len} and {dst}..+{len} overlap"),
            ));
        }
        match &mut buf.storage {
            Storage::Host(v) => v.copy_within(src..src + len, dst),
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => {
                let s = self.cuda_stream("copy_within", "buf")?;
                let (lo, hi) = if src < dst { (src, dst) } else { (dst, src) };
                let (a, mut b) = d.split_at_mut(hi);
                if src < dst {
                    s.memcpy_dtod(&a.slice(lo..lo + len), &mut b.slice_mut(0..len))?;
                } else {
                    let (mut a, b) = (a, b);
                    s.memcpy_dtod(&b.slice(0..len), &mut a.slice_mut(lo..lo + len))?;
                }
            }
        }
        Ok(())
    }

    /// Read `len` elements at `offset` back to the host (waits for the work before it).
    pub fn download_range<T: Element>(&self, buf: &DeviceBuffer<T>, offset: usize, len: usize) -> Result<Vec<T>> {
        if offset.checked_add(len).is_none_or(|e| e > buf.len()) {
            return Err(FfiError::shape("download_range", "len", format!("{len} at {offset} in {}", buf.len())));
        }
        match &buf.storage {
            Storage::Host(v) => Ok(v[offset..offset + len].to_vec()),
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => {
                Ok(self.cuda_stream("download_range", "buf")?.clone_dtoh(&d.slice(offset..offset + len))?)
            }
        }
    }

    /// Write `data` into `buf` at `offset`.
    pub fn write_range<T: Element>(&self, buf: &mut DeviceBuffer<T>, offset: usize, data: &[T]) -> Result<()> {
        if offset.checked_add(data.len()).is_none_or(|e| e > buf.len()) {
            return Err(FfiError::shape("write_range", "data", format!("{} at {offset} in {}", data.len(), buf.len())));
        }
        match &mut buf.storage {
            Storage::Host(v) => v[offset..offset + data.len()].copy_from_slice(data),
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => {
                let s = self.cuda_stream("write_range", "buf")?;
                s.memcpy_htod(data, &mut d.slice_mut(offset..offset + data.len()))?
            }
        }
        Ok(())
    }

    /// Copy `buf` back to the host, waiting for the work before it on this stream.
    pub fn download<T: Element>(&self, buf: &DeviceBuffer<T>) -> Result<Vec<T>> {
        match &buf.storage {
            Storage::Host(v) => Ok(v.clone()),
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => Ok(self.cuda_stream("download", "buf")?.clone_dtoh(d)?),
        }
    }

    /// Wait until all work queued on this stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(s) = &self.cuda {
            s.synchronize()?;
        }
        Ok(())
    }

    /// Make the work queued on this stream from now on wait until `ev` (recorded on another stream
    /// of the same device) has completed: how work is ordered across streams (buffers are not
    /// tracked per stream). A no-op on the CPU, whose streams run in order.
    pub fn wait_event(&self, ev: &Event) -> Result<()> {
        match &ev.inner {
            EventInner::Host(_) => Ok(()),
            #[cfg(feature = "cuda")]
            EventInner::Cuda(e) => {
                let s = self.cuda_stream("wait_event", "ev")?;
                s.wait(e)?;
                if let Device::Cuda(b) = &self.device {
                    b.note_event_wait(s);
                }
                Ok(())
            }
        }
    }

    /// An event marking the work queued so far, for timing (`Event::elapsed_ms`).
    pub fn record_event(&self) -> Result<Event> {
        #[cfg(feature = "cuda")]
        if let Some(s) = &self.cuda {
            let ev = s.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            return Ok(Event { inner: EventInner::Cuda(ev) });
        }
        Ok(Event { inner: EventInner::Host(Instant::now()) })
    }

    /// Check that `buf` lives on this stream's device.
    pub(crate) fn check_on<T: Element>(
        &self,
        op: &'static str,
        field: &'static str,
        buf: &DeviceBuffer<T>,
    ) -> Result<()> {
        let here = self.device.label();
        let there = buf.location();
        if here != there {
            return Err(FfiError::DeviceMismatch { op, field, expected: here, found: there });
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_stream(
        &self,
        op: &'static str,
        field: &'static str,
    ) -> Result<&Arc<cudarc::driver::CudaStream>> {
        self.cuda.as_ref().ok_or_else(|| FfiError::DeviceMismatch {
            op,
            field,
            expected: self.device.label(),
            found: "a CUDA device".to_string(),
        })
    }
}

/// A stream's work recorded once ([`Stream::capture`]) and replayed by one launch: a CUDA graph.
/// Replays read and write the buffers the recorded work named, so those must outlive the graph;
/// scratch the work allocated and freed is part of the graph.
pub struct Graph {
    #[cfg(feature = "cuda")]
    inner: cudarc::driver::CudaGraph,
}

impl Graph {
    /// Queue the recorded work again, on the stream it was recorded from.
    pub fn launch(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            self.inner.launch()?;
            Ok(())
        }
        #[cfg(not(feature = "cuda"))]
        unreachable!("graphs exist only with the CUDA backend")
    }
}

impl Stream {
    /// Record the work `f` queues on this stream, and on streams that join it through events
    /// ([`Stream::wait_event`]), into a [`Graph`] instead of running it: a decode step's dozen
    /// launches then cost one launch of host time. `f` must not wait for the device (downloads,
    /// synchronisation). CUDA only, and not the legacy default stream ([`Device::default_stream`]),
    /// which CUDA cannot capture: use [`Device::new_stream`]. If `f` fails, the capture is ended
    /// and its error returned.
    pub fn capture(&self, f: impl FnOnce(&Stream) -> Result<()>) -> Result<Graph> {
        #[cfg(feature = "cuda")]
        if let Some(s) = &self.cuda {
            if s.cu_stream().is_null() {
                return Err(FfiError::shape("capture", "stream", "the legacy default stream cannot be captured"));
            }
            use cudarc::driver::sys;
            s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            let recorded = f(self);
            let ended = s.end_capture(sys::CUgraphInstantiate_flags(0));
            recorded?;
            let inner = ended?.ok_or_else(|| FfiError::Driver("the capture recorded no graph".into()))?;
            inner.upload()?;
            return Ok(Graph { inner });
        }
        let _ = f;
        Err(FfiError::shape(
            "capture",
            "stream",
            format!("{} streams run at once; only CUDA streams record", self.device.label()),
        ))
    }
}

/// A point in a stream's work, for timing.
pub struct Event {
    inner: EventInner,
}

enum EventInner {
    Host(Instant),
    #[cfg(feature = "cuda")]
    Cuda(cudarc::driver::CudaEvent),
}

impl Event {
    /// Milliseconds from this event to `end` (waits for `end` to complete).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        match (&self.inner, &end.inner) {
            (EventInner::Host(a), EventInner::Host(b)) => Ok(b.duration_since(*a).as_secs_f32() * 1e3),
            #[cfg(feature = "cuda")]
            (EventInner::Cuda(a), EventInner::Cuda(b)) => {
                b.synchronize()?;
                Ok(a.elapsed_ms(b)?)
            }
            #[cfg(feature = "cuda")]
            _ => Err(FfiError::shape("elapsed_ms", "end", "events of different devices")),
        }
    }
}
