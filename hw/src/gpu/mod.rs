//! GPU memory for engines: device buffers, one copy stream per engine instance, host memory
//! registered with the driver once per process, and dma-buf export for GPUDirect RDMA.
//!
//! Two implementations behind one handle ([`Gpu`]):
//! * CUDA through cudarc's driver API with dynamic loading (feature `gpu`): [`probe`] checks
//!   for `libcuda`, every symbol kvnode calls, the driver version and a device before any
//!   driver call (cudarc panics on a missing library or symbol; kvnode never lets it).
//! * [`Gpu::fake`]: device memory simulated in host memory, copies deferred until the stream's
//!   synchronisation (so code that reads early sees stale bytes, as on a GPU), registration
//!   refusing overlaps like the driver, and injectable faults. The client's GPU paths are
//!   tested through it here; the CUDA implementation is verified only on a machine with a GPU
//!   (`scripts/gpu-check.sh`).
//!
//! Safety model: device memory is never a Rust reference. A [`DeviceSpan`] borrows the
//! [`DeviceBuffer`] it lies in (or comes from the `unsafe` [`DeviceBuffer::from_raw`], whose
//! caller vouches for an engine's own allocation); host memory is one of the crate's
//! [`HostMemory`] types, which stay mapped while borrowed. A stream's copies are enqueued and
//! waited for within one call, so nothing a copy touches can be dropped while it runs.

mod backend;
#[cfg(feature = "gpu")]
mod cuda;
mod dmabuf;
mod fake;
mod memory;
mod plan;
mod registry;
mod stream;

#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub use dmabuf::{dmabuf_window, DmaBufExport, GPU_PAGE_BYTES};
pub use fake::{FakeGpuControl, FakeGpuCounters};
pub use memory::{CopyItem, DeviceBuffer, DeviceSpan, HostMemory, Pinned};
pub use stream::{CopyReport, GpuStream};

use crate::{HwError, HwResult};
use backend::DeviceBackend;
use registry::HostRegistry;

/// Oldest CUDA driver kvnode uses (`cuDriverGetVersion` encoding: 1000 x major + 10 x minor).
pub const MIN_DRIVER_VERSION: i32 = 12_000;

/// Largest device buffer kvnode allocates or accepts as one span: 1 TiB.
pub const MAX_DEVICE_BUFFER_BYTES: u64 = 1 << 40;

/// Most copy items in one stream call (a request's chunks; the protocol's own limit is lower).
pub const MAX_COPY_ITEMS: usize = 1 << 16;

/// What one GPU is, as the driver reports it.
///
/// Invariant: plain data, read once when the device was opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Device ordinal.
    pub ordinal: u32,
    /// Device name (e.g. "NVIDIA H200").
    pub name: String,
    /// Device memory in bytes.
    pub total_bytes: u64,
    /// Driver version (`cuDriverGetVersion`: 12080 is CUDA 12.8).
    pub driver_version: i32,
    /// Whether the device can export memory as dma-buf (GPUDirect RDMA without nvidia-peermem).
    pub dma_buf: bool,
    /// `"cuda"` or `"fake"`.
    pub backend: &'static str,
}

/// Why no GPU can be used. Every variant says what to do about it.
///
/// Invariant: produced only before any device state was created (nothing to release).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuUnavailable {
    /// This build has no CUDA support.
    #[error("this kvnode was built without the `gpu` feature (build with `--features gpu`)")]
    NotBuilt,
    /// `libcuda.so` is not installed or not on the library path.
    #[error(
        "the CUDA driver library (libcuda.so.1) was not found: install the NVIDIA driver or put \
         its directory on LD_LIBRARY_PATH"
    )]
    NoDriverLibrary,
    /// The driver lacks a function kvnode calls.
    #[error("the CUDA driver library has no {symbol}: the driver is too old (kvnode needs CUDA 12.0 or newer)")]
    MissingSymbol {
        /// The missing function.
        symbol: &'static str,
    },
    /// The driver is older than [`MIN_DRIVER_VERSION`].
    #[error("the CUDA driver supports CUDA {have}; kvnode needs {need} or newer (update the NVIDIA driver)")]
    DriverTooOld {
        /// What the driver supports, as "major.minor".
        have: String,
        /// What kvnode needs.
        need: String,
    },
    /// `cuInit` failed (no device, driver/kernel module mismatch, ...).
    #[error("the CUDA driver did not initialise: {0}")]
    InitFailed(String),
    /// The driver works but sees no device.
    #[error("the CUDA driver sees no GPU")]
    NoDevice,
    /// The asked-for ordinal does not exist.
    #[error("GPU {ordinal} does not exist: the driver sees {count} device(s)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: u32,
        /// How many there are.
        count: u32,
    },
}

/// `major.minor` of a `cuDriverGetVersion` value.
pub fn driver_version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// Every GPU this process can use, or why none: never panics, whatever the host has.
pub fn probe() -> Result<Vec<GpuInfo>, GpuUnavailable> {
    #[cfg(feature = "gpu")]
    return cuda::probe_all();
    #[cfg(not(feature = "gpu"))]
    return Err(GpuUnavailable::NotBuilt);
}

/// Process-wide registry for CUDA: a host range registered by one device handle is registered
/// for every context (`CU_MEMHOSTREGISTER_PORTABLE`), and registering it twice fails; each entry
/// keeps the registering device (its context) until the range is unregistered.
#[cfg(feature = "gpu")]
fn cuda_registry() -> Arc<HostRegistry> {
    static REG: std::sync::OnceLock<Arc<HostRegistry>> = std::sync::OnceLock::new();
    REG.get_or_init(|| Arc::new(HostRegistry::default()))
        .clone()
}

/// A handle on one GPU (cheap to clone). Invariant: the device's context lives while any clone,
/// stream, buffer or registration made from it lives.
#[derive(Clone)]
pub struct Gpu {
    backend: Arc<dyn DeviceBackend>,
    registry: Arc<HostRegistry>,
    /// Distinguishes handles: a span of one handle's buffer is refused by another's streams.
    id: u64,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("info", self.info())
            .finish_non_exhaustive()
    }
}

fn next_gpu_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Gpu {
    /// Opens CUDA device `ordinal` after [`probe`]'s checks; `HwError::GpuUnavailable` says why
    /// not (never a panic).
    pub fn open(ordinal: u32) -> HwResult<Gpu> {
        #[cfg(feature = "gpu")]
        {
            let dev = cuda::CudaDevice::open(ordinal)?;
            Ok(Gpu {
                backend: Arc::new(dev),
                registry: cuda_registry(),
                id: next_gpu_id(),
            })
        }
        #[cfg(not(feature = "gpu"))]
        {
            let _ = ordinal;
            Err(HwError::GpuUnavailable(GpuUnavailable::NotBuilt))
        }
    }

    /// A simulated GPU with `total_bytes` of device memory (its own registry: a fake is its own
    /// process as far as registration goes), and the control to inject faults and read counters.
    pub fn fake(total_bytes: u64, dma_buf: bool) -> (Gpu, FakeGpuControl) {
        let (backend, control) = fake::FakeDevice::new(total_bytes, dma_buf);
        let gpu = Gpu {
            backend: Arc::new(backend),
            registry: Arc::new(HostRegistry::default()),
            id: next_gpu_id(),
        };
        (gpu, control)
    }

    /// What the device is.
    pub fn info(&self) -> &GpuInfo {
        self.backend.info()
    }

    /// A new copy stream (one per engine instance: streams run concurrently).
    pub fn stream(&self) -> HwResult<GpuStream> {
        let backend = self.backend.new_stream()?;
        Ok(GpuStream::new(self.clone(), backend))
    }

    /// Allocates `len` bytes of device memory (contents unspecified). Errors: `len` of 0 or above
    /// [`MAX_DEVICE_BUFFER_BYTES`] (`Invalid`), out of device memory (`Gpu`).
    pub fn alloc(&self, len: u64) -> HwResult<DeviceBuffer> {
        if len == 0 || len > MAX_DEVICE_BUFFER_BYTES {
            return Err(HwError::Invalid(format!(
                "a device buffer of {len} bytes: must be in 1..={MAX_DEVICE_BUFFER_BYTES}"
            )));
        }
        let ptr = self.backend.alloc(len)?;
        Ok(DeviceBuffer::owned(self.clone(), ptr, len))
    }

    /// Registers `host`'s memory with the driver (page-locked, portable, device-mapped) and
    /// returns it with the registration; the same range registered again in this process (a
    /// second client of one pool mapping) shares the first registration, which ends when the
    /// last [`Pinned`] drops. A range overlapping a registered one without being it is refused
    /// (`Invalid`, naming both).
    pub fn pin<H: HostMemory>(&self, host: H) -> HwResult<Pinned<H>> {
        let (ptr, len) = host.host_range();
        self.registry.acquire(&self.backend, ptr as usize, len)?;
        Ok(Pinned::new(host, self.clone(), ptr as usize))
    }

    /// Exports `buf` for GPUDirect RDMA as a dma-buf (`cuMemGetHandleForAddressRange`); `Gpu`
    /// or `Unsupported`-like errors when the device or driver cannot (use host staging then).
    pub fn export_dmabuf(&self, buf: &DeviceBuffer) -> HwResult<DmaBufExport> {
        self.check_same(buf.gpu_id(), "export")?;
        if !self.info().dma_buf {
            return Err(HwError::Gpu(format!(
                "{} cannot export memory as dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0)",
                self.info().name
            )));
        }
        self.backend.export_dmabuf(buf.ptr(), buf.len())
    }

    /// Whether `other` is this handle (or a clone of it): device memory of one handle is
    /// refused by another's streams.
    pub fn same_handle(&self, other: &Gpu) -> bool {
        self.id == other.id
    }

    /// How many host ranges this handle's registry holds registered (for status and tests).
    pub fn registered_host_ranges(&self) -> usize {
        self.registry.len()
    }

    pub(crate) fn backend(&self) -> &dyn DeviceBackend {
        self.backend.as_ref()
    }

    #[cfg(test)]
    pub(crate) fn backend_arc(&self) -> Arc<dyn DeviceBackend> {
        self.backend.clone()
    }

    pub(crate) fn registry(&self) -> &HostRegistry {
        &self.registry
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn check_same(&self, other: u64, what: &str) -> HwResult<()> {
        if other != self.id {
            return Err(HwError::Invalid(format!(
                "cannot {what}: the device memory belongs to another GPU handle than {}",
                self.info().name
            )));
        }
        Ok(())
    }
}
