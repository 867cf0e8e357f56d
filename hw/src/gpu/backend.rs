//! The two traits a GPU implementation provides (CUDA or the fake); everything else in
//! `gpu` (bounds, spans, planning, registration bookkeeping) is shared.

use super::{DmaBufExport, GpuInfo};
use crate::HwResult;

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Device memory into host memory (a store).
    DeviceToHost,
    /// Host memory into device memory (a retrieve).
    HostToDevice,
}

/// One device. Invariant: thread-safe; its context lives as long as the value.
pub(crate) trait DeviceBackend: Send + Sync {
    /// What it is.
    fn info(&self) -> &GpuInfo;
    /// A new stream.
    fn new_stream(&self) -> HwResult<Box<dyn StreamBackend>>;
    /// Allocates `len` bytes; returns the device address.
    fn alloc(&self, len: u64) -> HwResult<u64>;
    /// Frees an allocation made by `alloc`.
    fn free(&self, ptr: u64);
    /// `(base, len)` of the allocation holding `[ptr, ptr + len)`, or an error if the range is
    /// not inside one allocation of this device.
    fn allocation_of(&self, ptr: u64, len: u64) -> HwResult<(u64, u64)>;
    /// Page-locks `[ptr, ptr + len)` (portable, device-mapped).
    ///
    /// # Safety
    /// The range must stay mapped until `unregister_host(ptr)`.
    unsafe fn register_host(&self, ptr: usize, len: usize) -> HwResult<()>;
    /// Ends the registration starting at `ptr`.
    fn unregister_host(&self, ptr: usize) -> HwResult<()>;
    /// Exports `[ptr, ptr + len)` (inside one allocation) as a dma-buf.
    fn export_dmabuf(&self, ptr: u64, len: u64) -> HwResult<DmaBufExport>;
    /// Synchronous copy of host bytes into device memory (setup and verification only).
    fn write_sync(&self, ptr: u64, src: &[u8]) -> HwResult<()>;
    /// Synchronous copy of device memory into host bytes (setup and verification only).
    fn read_sync(&self, ptr: u64, dst: &mut [u8]) -> HwResult<()>;
}

/// One stream of one device. Invariant: copies run in enqueue order relative to each other only
/// as far as the driver promises; nothing is guaranteed done before `synchronize` returned.
pub(crate) trait StreamBackend: Send {
    /// Enqueues one copy of `len` bytes between host address `host` and device address `dev`.
    ///
    /// # Safety
    /// `[host, host + len)` must stay mapped (and, for `DeviceToHost`, unread and unwritten by
    /// anyone else) until the next `synchronize` returned; `[dev, dev + len)` must lie inside a
    /// live allocation of this stream's device.
    unsafe fn enqueue(&mut self, dir: Direction, host: *mut u8, dev: u64, len: u64)
        -> HwResult<()>;
    /// Waits for every enqueued copy.
    fn synchronize(&mut self) -> Result<(), SyncError>;
}

/// Why a stream's wait did not succeed.
#[derive(Debug)]
pub(crate) enum SyncError {
    /// The wait ran and failed: the driver ended the stream's work (nothing runs any more).
    Failed(crate::HwError),
    /// The wait could not even be issued: copies may still be running.
    NotWaited(crate::HwError),
}
