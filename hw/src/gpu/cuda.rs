//! The CUDA implementation through cudarc's driver API, loaded dynamically.
//!
//! cudarc panics when `libcuda` or one of its functions is missing, so [`probe_library`] checks
//! the library, every function this module calls and the driver version first; only then is any
//! other driver function called. Each call pushes the device's primary context on the calling
//! thread's context stack and pops it afterwards ([`Bound`]), so an engine thread's own current
//! context (another device, the engine's runtime) is left as it was; streams move between
//! threads with their engine instance.
//!
//! **Untested on hardware in this repository's CI** (no GPU there); `scripts/gpu-check.sh` runs
//! the GPU tests and bench on a machine with one.

use std::ffi::c_void;
use std::os::fd::{FromRawFd, OwnedFd};

use cudarc::driver::{result, sys};

use super::backend::{DeviceBackend, Direction, StreamBackend, SyncError};
use super::{DmaBufExport, GpuInfo, GpuUnavailable, MIN_DRIVER_VERSION};
use crate::{HwError, HwResult};

/// Every driver function this module calls (directly or through cudarc's `result` wrappers).
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxSynchronize",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemGetAddressRange_v2",
];

/// Called only when the device reports dma-buf support.
const DMABUF_SYMBOL: &str = "cuMemGetHandleForAddressRange";

fn has_symbol(name: &str) -> bool {
    // SAFETY: only called after `is_culib_present` returned true, so `culib()` loads the library
    // instead of panicking; looking a symbol up has no side effect.
    unsafe {
        sys::culib()
            .get::<unsafe extern "C" fn()>(name.as_bytes())
            .is_ok()
    }
}

fn gpu_err(op: &str, e: result::DriverError) -> HwError {
    HwError::Gpu(format!("{op}: {e}"))
}

/// Checks the library, its symbols and the driver version, then initialises the driver.
fn probe_library() -> Result<(), GpuUnavailable> {
    // SAFETY: only tries to dlopen the library names; no other side effect.
    if !unsafe { sys::is_culib_present() } {
        return Err(GpuUnavailable::NoDriverLibrary);
    }
    if let Some(missing) = REQUIRED_SYMBOLS.iter().find(|s| !has_symbol(s)) {
        return Err(GpuUnavailable::MissingSymbol { symbol: missing });
    }
    let mut version = 0i32;
    // SAFETY: the symbol exists (checked); the out-pointer is a live local.
    let rc = unsafe { sys::cuDriverGetVersion(&mut version) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(GpuUnavailable::InitFailed(format!(
            "cuDriverGetVersion: {rc:?}"
        )));
    }
    if version < MIN_DRIVER_VERSION {
        return Err(GpuUnavailable::DriverTooOld {
            have: super::driver_version_string(version),
            need: super::driver_version_string(MIN_DRIVER_VERSION),
        });
    }
    result::init().map_err(|e| {
        if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE {
            GpuUnavailable::NoDevice
        } else {
            GpuUnavailable::InitFailed(e.to_string())
        }
    })
}

fn device_info(ordinal: u32, dev: sys::CUdevice) -> HwResult<GpuInfo> {
    let name = result::device::get_name(dev).map_err(|e| gpu_err("cuDeviceGetName", e))?;
    // SAFETY: `dev` came from cuDeviceGet.
    let total =
        unsafe { result::device::total_mem(dev) }.map_err(|e| gpu_err("cuDeviceTotalMem", e))?;
    // SAFETY: as above.
    let dma_buf = unsafe {
        result::device::get_attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
        )
    }
    .map(|v| v != 0)
    .unwrap_or(false)
        && has_symbol(DMABUF_SYMBOL);
    let mut version = 0i32;
    // SAFETY: probed present; live out-pointer.
    unsafe { sys::cuDriverGetVersion(&mut version) };
    Ok(GpuInfo {
        ordinal,
        name,
        total_bytes: total as u64,
        driver_version: version,
        dma_buf,
        backend: "cuda",
    })
}

/// Every device's description, or why there is none.
pub(crate) fn probe_all() -> Result<Vec<GpuInfo>, GpuUnavailable> {
    probe_library()?;
    let count = result::device::get_count()
        .map_err(|e| GpuUnavailable::InitFailed(format!("cuDeviceGetCount: {e}")))?;
    if count <= 0 {
        return Err(GpuUnavailable::NoDevice);
    }
    (0..count as u32)
        .map(|i| {
            let dev = result::device::get(i as i32)
                .map_err(|e| GpuUnavailable::InitFailed(format!("cuDeviceGet({i}): {e}")))?;
            device_info(i, dev).map_err(|e| GpuUnavailable::InitFailed(e.to_string()))
        })
        .collect()
}

/// One CUDA device with its retained primary context.
///
/// Invariant: `ctx` is `dev`'s primary context, retained once by `open` and released once in
/// `Drop`; every driver call first makes it current on the calling thread.
pub(crate) struct CudaDevice {
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    info: GpuInfo,
}

// SAFETY: a primary context may be made current and used from any thread; the handle values
// are never mutated after `open`.
unsafe impl Send for CudaDevice {}
// SAFETY: as above; the driver API is thread-safe.
unsafe impl Sync for CudaDevice {}

impl CudaDevice {
    pub(crate) fn open(ordinal: u32) -> HwResult<CudaDevice> {
        probe_library().map_err(HwError::GpuUnavailable)?;
        let count = result::device::get_count().map_err(|e| gpu_err("cuDeviceGetCount", e))?;
        if ordinal >= count.max(0) as u32 {
            return Err(HwError::GpuUnavailable(GpuUnavailable::NoSuchDevice {
                ordinal,
                count: count.max(0) as u32,
            }));
        }
        let dev = result::device::get(ordinal as i32).map_err(|e| gpu_err("cuDeviceGet", e))?;
        let info = device_info(ordinal, dev)?;
        // SAFETY: `dev` came from cuDeviceGet; released once in Drop.
        let ctx = unsafe { result::primary_ctx::retain(dev) }
            .map_err(|e| gpu_err("cuDevicePrimaryCtxRetain", e))?;
        Ok(CudaDevice { dev, ctx, info })
    }

    fn bind(&self) -> HwResult<Bound> {
        Bound::push(self.ctx)
    }
}

/// The device's context pushed on the calling thread's context stack; popped on drop.
///
/// Invariant: lives within one call on one thread (not `Send`).
#[must_use = "the context is popped again when this is dropped: bind it to a variable"]
pub(crate) struct Bound(std::marker::PhantomData<*const ()>);

impl Bound {
    fn push(ctx: sys::CUcontext) -> HwResult<Bound> {
        // SAFETY: `ctx` is a retained primary context (held by the caller's device or stream).
        let rc = unsafe { sys::cuCtxPushCurrent_v2(ctx) };
        check(rc, "cuCtxPushCurrent")?;
        Ok(Bound(std::marker::PhantomData))
    }
}

impl Drop for Bound {
    fn drop(&mut self) {
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: pops exactly the context `push` pushed on this thread.
        let rc = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(?rc, "cuCtxPopCurrent failed");
        }
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // SAFETY: retained once in `open`; every stream and buffer of this device holds the
        // `Gpu` handle that owns this value, so none outlives the context.
        if let Err(e) = unsafe { result::primary_ctx::release(self.dev) } {
            tracing::warn!(error = %e, "releasing the CUDA primary context failed");
        }
    }
}

impl DeviceBackend for CudaDevice {
    fn info(&self) -> &GpuInfo {
        &self.info
    }

    fn new_stream(&self) -> HwResult<Box<dyn StreamBackend>> {
        let _ctx = self.bind()?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| gpu_err("cuStreamCreate", e))?;
        Ok(Box::new(CudaStreamBackend {
            ctx: self.ctx,
            stream,
        }))
    }

    fn alloc(&self, len: u64) -> HwResult<u64> {
        let _ctx = self.bind()?;
        // SAFETY: context bound; the pointer is owned by the returned DeviceBuffer.
        unsafe { result::malloc_sync(len as usize) }.map_err(|e| gpu_err("cuMemAlloc", e))
    }

    fn free(&self, ptr: u64) {
        let freed = self.bind().and_then(|_ctx| {
            // SAFETY: `ptr` came from `alloc` and is freed once (DeviceBuffer's Drop); no copy
            // runs on it (every stream call waits for its copies).
            unsafe { result::free_sync(ptr) }.map_err(|e| gpu_err("cuMemFree", e))
        });
        if let Err(e) = freed {
            tracing::warn!(error = %e, "freeing device memory failed");
        }
    }

    fn allocation_of(&self, ptr: u64, len: u64) -> HwResult<(u64, u64)> {
        let _ctx = self.bind()?;
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: live out-pointers; the driver validates `ptr`.
        let rc = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            return Err(HwError::Gpu(format!(
                "device address {ptr:#x} is not device memory of {}: {rc:?}",
                self.info.name
            )));
        }
        if ptr.checked_add(len).is_none_or(|e| e > base + size as u64) {
            return Err(HwError::Invalid(format!(
                "device range {ptr:#x}+{len} runs past its allocation [{base:#x}, +{size})"
            )));
        }
        Ok((base, size as u64))
    }

    unsafe fn register_host(&self, ptr: usize, len: usize) -> HwResult<()> {
        let _ctx = self.bind()?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller keeps the range mapped until unregister_host.
        let rc = unsafe { sys::cuMemHostRegister_v2(ptr as *mut c_void, len, flags) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            return Err(HwError::Gpu(format!(
                "cuMemHostRegister of {len} bytes at {ptr:#x}: {rc:?} (RLIMIT_MEMLOCK, or memory \
                 the driver cannot pin)"
            )));
        }
        Ok(())
    }

    fn unregister_host(&self, ptr: usize) -> HwResult<()> {
        let _ctx = self.bind()?;
        // SAFETY: `ptr` starts a range registered by `register_host`, unregistered once.
        let rc = unsafe { sys::cuMemHostUnregister(ptr as *mut c_void) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            return Err(HwError::Gpu(format!(
                "cuMemHostUnregister at {ptr:#x}: {rc:?}"
            )));
        }
        Ok(())
    }

    fn export_dmabuf(&self, ptr: u64, len: u64) -> HwResult<DmaBufExport> {
        if !self.info.dma_buf {
            return Err(HwError::Gpu(format!(
                "{} has no dma-buf support",
                self.info.name
            )));
        }
        let (base, alloc_len) = self.allocation_of(ptr, len)?;
        let page = crate::region::base_page_size() as u64;
        let (start, wlen) = super::dmabuf_window(ptr, len, base, alloc_len, page)
            .ok_or_else(|| HwError::Invalid(format!("no dma-buf window for {ptr:#x}+{len}")))?;
        let _ctx = self.bind()?;
        let mut fd: i32 = -1;
        // SAFETY: the symbol exists (info.dma_buf implies it was found); the out-pointer is a
        // live local; the window starts inside one allocation and ends less than a host page past its
        // nominal size (inside the driver's allocation granularity).
        let rc = unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut i32).cast(),
                start,
                wlen as usize,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        if rc != sys::CUresult::CUDA_SUCCESS || fd < 0 {
            return Err(HwError::Gpu(format!(
                "cuMemGetHandleForAddressRange of {wlen} bytes at {start:#x}: {rc:?}"
            )));
        }
        // SAFETY: the driver returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(DmaBufExport {
            fd,
            window_start: start,
            window_len: wlen,
            offset: ptr - start,
            len,
            iova: ptr,
        })
    }

    fn write_sync(&self, ptr: u64, src: &[u8]) -> HwResult<()> {
        let _ctx = self.bind()?;
        // SAFETY: `ptr` is inside a live allocation (checked by the caller's span); `src` is a
        // live slice, read before the call returns (pageable source: staged by the driver).
        let rc = unsafe { sys::cuMemcpyHtoD_v2(ptr, src.as_ptr().cast(), src.len()) };
        check(rc, "cuMemcpyHtoD")?;
        // From pageable memory the call may return before the DMA into device memory finished,
        // on the legacy stream, which kvnode's non-blocking streams do not wait for: wait here.
        // SAFETY: a context is current (pushed above).
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }

    fn read_sync(&self, ptr: u64, dst: &mut [u8]) -> HwResult<()> {
        let _ctx = self.bind()?;
        // Work on other streams that wrote `ptr` is finished first (as in write_sync).
        // SAFETY: a context is current.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")?;
        // SAFETY: as in write_sync; `dst` is an exclusive live slice, complete on return.
        let rc = unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), ptr, dst.len()) };
        check(rc, "cuMemcpyDtoH")
    }
}

fn check(rc: sys::CUresult, op: &str) -> HwResult<()> {
    if rc == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(HwError::Gpu(format!("{op}: {rc:?}")))
    }
}

/// A non-blocking stream of one device.
///
/// Invariant: `stream` belongs to `ctx`, which the owning `GpuStream`'s `Gpu` handle keeps
/// retained; destroyed once in `Drop` after waiting for its copies.
struct CudaStreamBackend {
    ctx: sys::CUcontext,
    stream: sys::CUstream,
}

// SAFETY: a stream may be used from any thread once its context is current there (bound
// before every call).
unsafe impl Send for CudaStreamBackend {}

impl CudaStreamBackend {
    fn bind(&self) -> HwResult<Bound> {
        Bound::push(self.ctx)
    }
}

impl StreamBackend for CudaStreamBackend {
    unsafe fn enqueue(
        &mut self,
        dir: Direction,
        host: *mut u8,
        dev: u64,
        len: u64,
    ) -> HwResult<()> {
        let _ctx = self.bind()?;
        let rc = match dir {
            // SAFETY: the caller keeps `[host, host + len)` mapped and untouched until the next
            // synchronize; `dev` lies in a live allocation.
            Direction::DeviceToHost => unsafe {
                sys::cuMemcpyDtoHAsync_v2(host.cast(), dev, len as usize, self.stream)
            },
            // SAFETY: as above; the host range is only read.
            Direction::HostToDevice => unsafe {
                sys::cuMemcpyHtoDAsync_v2(dev, host.cast_const().cast(), len as usize, self.stream)
            },
        };
        check(rc, "cuMemcpyAsync")
    }

    fn synchronize(&mut self) -> Result<(), SyncError> {
        let _ctx = self.bind().map_err(SyncError::NotWaited)?;
        // SAFETY: the stream is live. A driver error here ends the stream's work (a sticky
        // error stops the context): nothing is running when it returns.
        unsafe { result::stream::synchronize(self.stream) }
            .map_err(|e| SyncError::Failed(gpu_err("cuStreamSynchronize", e)))
    }
}

impl Drop for CudaStreamBackend {
    fn drop(&mut self) {
        let _ = self.synchronize();
        let _ctx = self.bind();
        // SAFETY: created in new_stream, destroyed once, no copy pending (just synchronised).
        if let Err(e) = unsafe { result::stream::destroy(self.stream) } {
            tracing::warn!(error = %e, "destroying a CUDA stream failed");
        }
    }
}
