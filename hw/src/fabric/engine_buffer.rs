//! An engine's memory for RDMA, safe to hand to the NIC: [`EngineBuffer`] owns page-aligned
//! anonymous memory; registered with an engine-side `RdmaFabric` it becomes a
//! `RegisteredBuffer`, which owns both the memory and its registration (the memory outlives
//! the registration by construction), so the caller needs no `unsafe`.
//!
//! **Untested on hardware** (registration needs an RDMA device); the buffer itself is tested.

use crate::{HwError, HwResult};

/// Largest engine buffer (one registration): 1 TiB, far above any host's KV cache, below what
/// the verbs length fields and `isize` hold.
pub const MAX_ENGINE_BUFFER_BYTES: usize = 1 << 40;

/// Page-aligned anonymous memory owned by an engine (zero-filled at creation).
///
/// Invariant: `len()` bytes, `0 < len <= MAX_ENGINE_BUFFER_BYTES`, mapped at a fixed,
/// page-aligned address for the value's whole life (moving the value does not move the memory).
pub struct EngineBuffer {
    map: memmap2::MmapMut,
}

impl std::fmt::Debug for EngineBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineBuffer")
            .field("len", &self.map.len())
            .finish_non_exhaustive()
    }
}

impl EngineBuffer {
    /// Maps `len` zeroed bytes. Errors: `len` of 0 or above [`MAX_ENGINE_BUFFER_BYTES`]
    /// (`Invalid`, naming it), or the mapping failed.
    pub fn new(len: usize) -> HwResult<EngineBuffer> {
        if len == 0 || len > MAX_ENGINE_BUFFER_BYTES {
            return Err(HwError::Invalid(format!(
                "an engine buffer of {len} bytes: must be in 1..={MAX_ENGINE_BUFFER_BYTES}"
            )));
        }
        let map =
            memmap2::MmapMut::map_anon(len).map_err(|e| HwError::os("mmap engine buffer", e))?;
        Ok(EngineBuffer { map })
    }

    /// Its length in bytes (never 0).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Always false (empty buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.map
    }

    /// The bytes, to fill.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map
    }

    #[cfg(feature = "rdma")]
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// The mapping's base address, not derived from a Rust reference to its bytes (for DMA).
    pub(crate) fn base_ptr(&self) -> *mut u8 {
        self.map.as_ptr().cast_mut()
    }
}

/// An [`EngineBuffer`] registered for the node's RDMA READ and WRITE (engine side).
///
/// Invariant: the registration is dropped before the memory (field order), so the NIC can
/// never reach memory that is unmapped; while this value lives, the node's queue pair may read
/// and write the buffer when the engine asks it to (a store reads it, a retrieve writes it);
/// the engine holds no slice of it across such a request (the slice accessors borrow `self`).
#[cfg(feature = "rdma")]
pub struct RegisteredBuffer {
    mr: super::rdma::EngineMr,
    buf: EngineBuffer,
}

#[cfg(feature = "rdma")]
impl std::fmt::Debug for RegisteredBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuffer")
            .field("len", &self.buf.len())
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "rdma")]
impl RegisteredBuffer {
    /// Registers `buf` with `fabric` (`LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE`).
    pub fn register(
        fabric: &super::rdma::RdmaFabric,
        mut buf: EngineBuffer,
    ) -> HwResult<RegisteredBuffer> {
        let (ptr, len) = (buf.as_mut_ptr(), buf.len());
        // SAFETY: the mapping is owned by `buf`, which the returned value owns and drops after
        // the registration (field order), so it stays mapped while registered; the engine
        // accepts that the node's NIC writes into it during the requests that ask for it.
        let mr = unsafe { fabric.register_engine_buffer(ptr, len)? };
        Ok(RegisteredBuffer { mr, buf })
    }

    /// The buffer's virtual address (what the node's work requests name).
    pub fn addr(&self) -> u64 {
        self.mr.addr()
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.mr.len()
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.mr.is_empty()
    }

    /// The remote key the node's work requests carry.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.buf.as_slice()
    }

    /// The bytes, to fill.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.buf.as_mut_slice()
    }

    /// Deregisters and gives the memory back.
    pub fn into_buffer(self) -> EngineBuffer {
        let RegisteredBuffer { mr, buf } = self;
        drop(mr);
        buf
    }
}

/// Device memory registered for the node's RDMA READ and WRITE through dma-buf (GPUDirect
/// RDMA, engine side): the node's work requests address it by its device address.
///
/// Invariant: field order drops the registration, then the dma-buf descriptor, then the device
/// memory, so the NIC never reaches freed GPU memory. **Untested on hardware.**
#[cfg(feature = "rdma")]
pub struct RegisteredDeviceBuffer {
    mr: super::rdma::EngineMr,
    export: crate::gpu::DmaBufExport,
    buf: crate::gpu::DeviceBuffer,
}

#[cfg(feature = "rdma")]
impl std::fmt::Debug for RegisteredDeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredDeviceBuffer")
            .field("len", &self.buf.len())
            .field("window_len", &self.export.window_len)
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "rdma")]
impl RegisteredDeviceBuffer {
    /// Exports `buf` as a dma-buf and registers it with `fabric`; on failure gives `buf` back
    /// with the reason (the caller falls back to host staging).
    pub fn register(
        fabric: &super::rdma::RdmaFabric,
        buf: crate::gpu::DeviceBuffer,
    ) -> Result<RegisteredDeviceBuffer, (crate::gpu::DeviceBuffer, HwError)> {
        use std::os::fd::AsFd;
        let export = match buf.gpu().export_dmabuf(&buf) {
            Ok(x) => x,
            Err(e) => return Err((buf, e)),
        };
        let len = match usize::try_from(export.len) {
            Ok(l) => l,
            Err(_) => return Err((buf, HwError::Invalid("device buffer too large".into()))),
        };
        // SAFETY: `buf` is owned by the returned value and dropped after the registration
        // (field order); the engine accepts that the node's NIC reads and writes it during the
        // requests that name it.
        let mr = unsafe {
            fabric.register_engine_dmabuf(export.fd.as_fd(), export.offset, len, export.iova)
        };
        match mr {
            Ok(mr) => Ok(RegisteredDeviceBuffer { mr, export, buf }),
            Err(e) => Err((buf, e)),
        }
    }

    /// The device address the node's work requests name.
    pub fn addr(&self) -> u64 {
        self.mr.addr()
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.mr.len()
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.mr.is_empty()
    }

    /// The remote key the node's work requests carry.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// The device memory.
    pub fn device(&self) -> &crate::gpu::DeviceBuffer {
        &self.buf
    }

    /// Deregisters and gives the device memory back.
    pub fn into_device(self) -> crate::gpu::DeviceBuffer {
        let RegisteredDeviceBuffer { mr, export, buf } = self;
        drop(mr);
        drop(export);
        buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_page_aligned_zeroed_and_bounded() {
        let mut b = EngineBuffer::new(10_000).unwrap();
        assert_eq!(b.len(), 10_000);
        assert_eq!(b.as_slice().as_ptr() as usize % 4096, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[9_999] = 7;
        assert_eq!(b.as_slice()[9_999], 7);
        for bad in [0, MAX_ENGINE_BUFFER_BYTES + 1] {
            let e = EngineBuffer::new(bad).unwrap_err().to_string();
            assert!(e.contains("must be in 1..="), "{e}");
        }
    }
}
