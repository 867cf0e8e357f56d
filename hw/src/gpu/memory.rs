//! Device buffers and spans, the host memory a copy may touch, and pinned (registered) host
//! memory.

use std::marker::PhantomData;
use std::sync::Arc;

use super::Gpu;
use crate::fabric::EngineBuffer;
use crate::{HwError, HwResult, PoolMapping, PoolRegion};

/// Device memory: an allocation this handle owns (freed on drop) or, from
/// [`DeviceBuffer::from_raw`], a range of an engine's own allocation (never freed here).
///
/// Invariant: `[ptr, ptr + len)` lies inside one live allocation of `gpu`'s device for the
/// value's whole life; `0 < len <= MAX_DEVICE_BUFFER_BYTES`.
pub struct DeviceBuffer {
    gpu: Gpu,
    ptr: u64,
    len: u64,
    owned: bool,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("owned", &self.owned)
            .finish()
    }
}

impl DeviceBuffer {
    pub(crate) fn owned(gpu: Gpu, ptr: u64, len: u64) -> DeviceBuffer {
        DeviceBuffer {
            gpu,
            ptr,
            len,
            owned: true,
        }
    }

    /// Wraps `[ptr, ptr + len)` of device memory the engine allocated (a KV cache tensor),
    /// after checking with the driver that it lies inside one allocation of `gpu`'s device.
    /// Never freed by kvnode.
    ///
    /// # Safety
    /// The allocation must stay live while the returned value (and every span of it) is used,
    /// and the engine accepts that kvnode's copies write the range during retrieves.
    pub unsafe fn from_raw(gpu: &Gpu, ptr: u64, len: u64) -> HwResult<DeviceBuffer> {
        if len == 0 || len > super::MAX_DEVICE_BUFFER_BYTES {
            return Err(HwError::Invalid(format!(
                "a device range of {len} bytes: must be in 1..={}",
                super::MAX_DEVICE_BUFFER_BYTES
            )));
        }
        gpu.backend().allocation_of(ptr, len)?;
        Ok(DeviceBuffer {
            gpu: gpu.clone(),
            ptr,
            len,
            owned: false,
        })
    }

    /// Device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes (never 0).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The GPU it belongs to.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    pub(crate) fn gpu_id(&self) -> u64 {
        self.gpu.id()
    }

    /// `len` bytes at `offset`, or `OutOfBounds`.
    pub fn span(&self, offset: u64, len: u64) -> HwResult<DeviceSpan<'_>> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len && len > 0 => Ok(DeviceSpan {
                ptr: self.ptr + offset,
                len,
                gpu_id: self.gpu.id(),
                _buf: PhantomData,
            }),
            _ => Err(HwError::OutOfBounds {
                offset,
                len,
                pool_len: self.len,
            }),
        }
    }

    /// The first `count` consecutive spans of `chunk` bytes each (a batch of KV chunks).
    pub fn chunks(&self, chunk: u64, count: usize) -> HwResult<Vec<DeviceSpan<'_>>> {
        (0..count as u64)
            .map(|i| {
                let off = i.checked_mul(chunk).ok_or(HwError::OutOfBounds {
                    offset: u64::MAX,
                    len: chunk,
                    pool_len: self.len,
                })?;
                self.span(off, chunk)
            })
            .collect()
    }

    /// Writes `src` at `offset`, synchronously (test data, benchmark setup).
    pub fn write(&self, offset: u64, src: &[u8]) -> HwResult<()> {
        let s = self.span(offset, src.len() as u64)?;
        self.gpu.backend().write_sync(s.ptr, src)
    }

    /// Reads `dst.len()` bytes at `offset`, synchronously (verification).
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> HwResult<()> {
        let s = self.span(offset, dst.len() as u64)?;
        self.gpu.backend().read_sync(s.ptr, dst)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.owned {
            self.gpu.backend().free(self.ptr);
        }
    }
}

/// `len` bytes of device memory inside a [`DeviceBuffer`] it borrows.
///
/// Invariant: inside a live allocation of the GPU handle `gpu_id` while `'a` lasts; `len > 0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSpan<'a> {
    ptr: u64,
    len: u64,
    gpu_id: u64,
    _buf: PhantomData<&'a DeviceBuffer>,
}

impl DeviceSpan<'_> {
    /// Device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes (never 0).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn gpu_id(&self) -> u64 {
        self.gpu_id
    }
}

/// One copy between a device span and host memory at `host_offset` (`device.len()` bytes).
///
/// Invariant: plain data; checked against the host memory and the stream's GPU by the stream.
#[derive(Debug, Clone, Copy)]
pub struct CopyItem<'a> {
    /// Offset in the host memory (a pool slot's offset, a staging buffer's offset).
    pub host_offset: u64,
    /// The device side.
    pub device: DeviceSpan<'a>,
}

mod sealed {
    pub trait Sealed {}
}

/// Host memory a GPU copy may touch: the crate's mapped types, whose memory stays at a fixed
/// address while the value lives. Writes by a device-to-host copy go through `&mut` of the
/// value (or, for the pool, through its shared-memory region, which is never a Rust reference).
pub trait HostMemory: sealed::Sealed + Send + Sync {
    /// Base address and length.
    ///
    /// Invariant: the same for the value's whole life; mapped while it lives.
    fn host_range(&self) -> (*mut u8, usize);
}

impl sealed::Sealed for &PoolRegion {}
impl HostMemory for &PoolRegion {
    fn host_range(&self) -> (*mut u8, usize) {
        (self.as_ptr(), self.len() as usize)
    }
}

impl sealed::Sealed for Arc<PoolMapping> {}
impl HostMemory for Arc<PoolMapping> {
    fn host_range(&self) -> (*mut u8, usize) {
        (self.region().as_ptr(), self.region().len() as usize)
    }
}

impl sealed::Sealed for EngineBuffer {}
impl HostMemory for EngineBuffer {
    fn host_range(&self) -> (*mut u8, usize) {
        (self.base_ptr(), self.len())
    }
}

#[cfg(feature = "rdma")]
impl sealed::Sealed for crate::fabric::RegisteredBuffer {}
#[cfg(feature = "rdma")]
impl HostMemory for crate::fabric::RegisteredBuffer {
    fn host_range(&self) -> (*mut u8, usize) {
        (self.addr() as *mut u8, self.len() as usize)
    }
}

impl<H: HostMemory> sealed::Sealed for Pinned<H> {}
impl<H: HostMemory> HostMemory for Pinned<H> {
    fn host_range(&self) -> (*mut u8, usize) {
        self.inner().host_range()
    }
}

/// Host memory registered with the GPU driver (page-locked: copies run at full DMA speed).
///
/// Invariant: the registration (counted in the handle's registry) ends in `Drop`, before the
/// memory it owns is dropped, so the driver never holds a registration of unmapped memory.
pub struct Pinned<H: HostMemory> {
    host: Option<H>,
    gpu: Gpu,
    ptr: usize,
}

impl<H: HostMemory> std::fmt::Debug for Pinned<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pinned")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.inner().host_range().1)
            .finish()
    }
}

impl<H: HostMemory> Pinned<H> {
    pub(crate) fn new(host: H, gpu: Gpu, ptr: usize) -> Pinned<H> {
        Pinned {
            host: Some(host),
            gpu,
            ptr,
        }
    }

    /// The memory.
    pub fn inner(&self) -> &H {
        self.host.as_ref().expect("present until drop")
    }

    /// The memory, mutably (to fill a staging buffer).
    pub fn inner_mut(&mut self) -> &mut H {
        self.host.as_mut().expect("present until drop")
    }

    /// The GPU handle that registered it.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Unregisters (if this was the last reference) and gives the memory back.
    pub fn into_inner(mut self) -> H {
        let h = self.host.take().expect("present until drop");
        self.gpu.registry().release(self.ptr);
        h
    }
}

impl<H: HostMemory> Drop for Pinned<H> {
    fn drop(&mut self) {
        if self.host.is_some() {
            self.gpu.registry().release(self.ptr);
        }
    }
}
