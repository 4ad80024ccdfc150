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
