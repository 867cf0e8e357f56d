//! A simulated GPU for logic tests: device memory in host memory at fake device addresses,
//! copies that happen only at the stream's synchronisation (as with a real asynchronous copy,
//! host memory read before the wait holds stale bytes), a host registration that refuses
//! overlaps like the driver, and faults injected through [`FakeGpuControl`].

use std::collections::BTreeMap;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::backend::{DeviceBackend, Direction, StreamBackend, SyncError};
use super::{DmaBufExport, GpuInfo};
use crate::{HwError, HwResult};

/// First fake device address (far from any host address of this process).
const FAKE_BASE: u64 = 0x7e00_0000_0000_0000;

#[derive(Default)]
struct Shared {
    registrations: AtomicU64,
    unregistrations: AtomicU64,
    streams: AtomicU64,
    enqueued: AtomicU64,
    synchronizations: AtomicU64,
    registered_copies: AtomicU64,
    pageable_copies: AtomicU64,
    exports: AtomicU64,
    /// The enqueue with this sequence number fails (0: none).
    fail_enqueue_at: AtomicU64,
    fail_next_sync: AtomicBool,
    fail_next_wait_issue: AtomicBool,
    fail_register: AtomicBool,
    memory: Mutex<Memory>,
}

#[derive(Default)]
struct Memory {
    allocs: BTreeMap<u64, Vec<u8>>,
    used: u64,
    next: u64,
    registered: BTreeMap<usize, usize>,
}

impl Shared {
    fn mem(&self) -> std::sync::MutexGuard<'_, Memory> {
        self.memory.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Memory {
    /// The allocation holding `[ptr, ptr + len)`: (base, offset).
    fn find(&self, ptr: u64, len: u64) -> HwResult<(u64, usize)> {
        let (&base, buf) = self
            .allocs
            .range(..=ptr)
            .next_back()
            .ok_or_else(|| unmapped(ptr, len))?;
        let off = ptr - base;
        if off.checked_add(len).is_none_or(|e| e > buf.len() as u64) {
            return Err(unmapped(ptr, len));
        }
        Ok((base, off as usize))
    }

    fn is_registered(&self, ptr: usize, len: usize) -> bool {
        self.registered
            .range(..=ptr)
            .next_back()
            .is_some_and(|(&s, &l)| ptr + len <= s + l)
    }
}

fn unmapped(ptr: u64, len: u64) -> HwError {
    HwError::Gpu(format!(
        "CUDA_ERROR_INVALID_VALUE: device range {ptr:#x}+{len} is not inside one allocation"
    ))
}

/// Counters of a fake GPU (a snapshot).
///
/// Invariant: monotonic over the device's life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FakeGpuCounters {
    /// Host ranges registered with the (fake) driver.
    pub registrations: u64,
    /// Host ranges unregistered.
    pub unregistrations: u64,
    /// Streams created.
    pub streams: u64,
    /// Copies enqueued.
    pub enqueued: u64,
    /// Stream synchronisations.
    pub synchronizations: u64,
    /// Copies whose host side was registered memory.
    pub registered_copies: u64,
    /// Copies whose host side was pageable memory.
    pub pageable_copies: u64,
    /// dma-buf exports.
    pub exports: u64,
}

/// Fault injection and counters of a fake GPU made by [`super::Gpu::fake`].
///
/// Invariant: shares the device's state; faults apply to every stream of that device.
#[derive(Clone)]
pub struct FakeGpuControl(Arc<Shared>);

impl FakeGpuControl {
    /// The counters now.
    pub fn counters(&self) -> FakeGpuCounters {
        let s = &self.0;
        let l = |a: &AtomicU64| a.load(Ordering::SeqCst);
        FakeGpuCounters {
            registrations: l(&s.registrations),
            unregistrations: l(&s.unregistrations),
            streams: l(&s.streams),
            enqueued: l(&s.enqueued),
            synchronizations: l(&s.synchronizations),
            registered_copies: l(&s.registered_copies),
            pageable_copies: l(&s.pageable_copies),
            exports: l(&s.exports),
        }
    }

    /// The `n`-th enqueue from now (1 = the next) fails; copies enqueued before it still run.
    pub fn fail_enqueue_after(&self, n: u64) {
        let now = self.0.enqueued.load(Ordering::SeqCst);
        self.0
            .fail_enqueue_at
            .store(now + n.max(1), Ordering::SeqCst);
    }

    /// The next synchronisation fails after running its copies (a sticky launch error).
    pub fn fail_next_sync(&self) {
        self.0.fail_next_sync.store(true, Ordering::SeqCst);
    }

    /// The next wait cannot even be issued (its copies stay pending: as far as the caller can
    /// tell, still running).
    pub fn fail_next_wait_issue(&self) {
        self.0.fail_next_wait_issue.store(true, Ordering::SeqCst);
    }

    /// Host registration fails while set (e.g. RLIMIT_MEMLOCK).
    pub fn fail_register(&self, fail: bool) {
        self.0.fail_register.store(fail, Ordering::SeqCst);
    }

    /// Device bytes allocated now.
    pub fn device_bytes_in_use(&self) -> u64 {
        self.0.mem().used
    }

    /// Host ranges registered with the fake driver now.
    pub fn registered_ranges(&self) -> usize {
        self.0.mem().registered.len()
    }
}

pub(crate) struct FakeDevice {
    info: GpuInfo,
    shared: Arc<Shared>,
}

impl FakeDevice {
    pub(crate) fn new(total_bytes: u64, dma_buf: bool) -> (FakeDevice, FakeGpuControl) {
        let shared = Arc::new(Shared::default());
        shared.mem().next = FAKE_BASE;
        let info = GpuInfo {
            ordinal: 0,
            name: "fake GPU (host memory)".into(),
            total_bytes,
            driver_version: super::MIN_DRIVER_VERSION,
            dma_buf,
            backend: "fake",
        };
        let control = FakeGpuControl(shared.clone());
        (FakeDevice { info, shared }, control)
    }
}

impl DeviceBackend for FakeDevice {
    fn info(&self) -> &GpuInfo {
        &self.info
    }

    fn new_stream(&self) -> HwResult<Box<dyn StreamBackend>> {
        self.shared.streams.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(FakeStream {
            shared: self.shared.clone(),
            pending: Vec::new(),
        }))
    }

    fn alloc(&self, len: u64) -> HwResult<u64> {
        let mut m = self.shared.mem();
        if m.used
            .checked_add(len)
            .is_none_or(|u| u > self.info.total_bytes)
        {
            return Err(HwError::Gpu(format!(
                "CUDA_ERROR_OUT_OF_MEMORY: {len} bytes asked, {} of {} in use",
                m.used, self.info.total_bytes
            )));
        }
        let ptr = m.next;
        // Allocations start on 2 MiB boundaries with a gap, like the driver's.
        m.next += (len + (4 << 20)) & !((2 << 20) - 1);
        m.used += len;
        m.allocs.insert(ptr, vec![0xa5; len as usize]);
        Ok(ptr)
    }

    fn free(&self, ptr: u64) {
        let mut m = self.shared.mem();
        if let Some(b) = m.allocs.remove(&ptr) {
            m.used -= b.len() as u64;
        }
    }

    fn allocation_of(&self, ptr: u64, len: u64) -> HwResult<(u64, u64)> {
        let m = self.shared.mem();
        let (base, _) = m.find(ptr, len)?;
        Ok((base, m.allocs[&base].len() as u64))
    }

    unsafe fn register_host(&self, ptr: usize, len: usize) -> HwResult<()> {
        if self.shared.fail_register.load(Ordering::SeqCst) {
            return Err(HwError::Gpu(
                "cuMemHostRegister: CUDA_ERROR_OUT_OF_MEMORY (injected)".into(),
            ));
        }
        let mut m = self.shared.mem();
        let clash = m
            .registered
            .iter()
            .any(|(&s, &l)| s < ptr + len && ptr < s + l);
        if clash {
            return Err(HwError::Gpu(format!(
                "cuMemHostRegister: CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED at {ptr:#x}"
            )));
        }
        m.registered.insert(ptr, len);
        self.shared.registrations.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn unregister_host(&self, ptr: usize) -> HwResult<()> {
        let mut m = self.shared.mem();
        if m.registered.remove(&ptr).is_none() {
            return Err(HwError::Gpu(format!(
                "cuMemHostUnregister: CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED at {ptr:#x}"
            )));
        }
        self.shared.unregistrations.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn export_dmabuf(&self, ptr: u64, len: u64) -> HwResult<DmaBufExport> {
        let (base, alloc_len) = self.allocation_of(ptr, len)?;
        let page = crate::region::base_page_size() as u64;
        let (start, wlen) = super::dmabuf_window(ptr, len, base, alloc_len, page)
            .ok_or_else(|| unmapped(ptr, len))?;
        // SAFETY: memfd_create with a valid NUL-terminated name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"kvnode-fake-dmabuf".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(HwError::last_os("memfd_create"));
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        self.shared.exports.fetch_add(1, Ordering::SeqCst);
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
        let mut m = self.shared.mem();
        let (base, off) = m.find(ptr, src.len() as u64)?;
        let buf = m.allocs.get_mut(&base).expect("found");
        buf[off..off + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn read_sync(&self, ptr: u64, dst: &mut [u8]) -> HwResult<()> {
        let m = self.shared.mem();
        let (base, off) = m.find(ptr, dst.len() as u64)?;
        dst.copy_from_slice(&m.allocs[&base][off..off + dst.len()]);
        Ok(())
    }
}

struct Pending {
    dir: Direction,
    host: *mut u8,
    dev: u64,
    len: u64,
}

struct FakeStream {
    shared: Arc<Shared>,
    pending: Vec<Pending>,
}

// SAFETY: the host pointers in `pending` are only dereferenced in `synchronize`, under the
// contract of `enqueue` (mapped until then), from whichever thread owns the stream.
unsafe impl Send for FakeStream {}

impl StreamBackend for FakeStream {
    unsafe fn enqueue(
        &mut self,
        dir: Direction,
        host: *mut u8,
        dev: u64,
        len: u64,
    ) -> HwResult<()> {
        let seq = self.shared.enqueued.fetch_add(1, Ordering::SeqCst) + 1;
        if self.shared.fail_enqueue_at.load(Ordering::SeqCst) == seq {
            return Err(HwError::Gpu(format!(
                "cuMemcpyAsync: CUDA_ERROR_LAUNCH_FAILED (injected at copy {seq})"
            )));
        }
        let m = self.shared.mem();
        m.find(dev, len)?;
        let counter = if m.is_registered(host as usize, len as usize) {
            &self.shared.registered_copies
        } else {
            &self.shared.pageable_copies
        };
        counter.fetch_add(1, Ordering::SeqCst);
        self.pending.push(Pending {
            dir,
            host,
            dev,
            len,
        });
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), SyncError> {
        if self
            .shared
            .fail_next_wait_issue
            .swap(false, Ordering::SeqCst)
        {
            return Err(SyncError::NotWaited(HwError::Gpu(
                "cuCtxPushCurrent: CUDA_ERROR_INVALID_CONTEXT (injected)".into(),
            )));
        }
        self.shared.synchronizations.fetch_add(1, Ordering::SeqCst);
        let mut m = self.shared.mem();
        for p in self.pending.drain(..) {
            let (base, off) = m
                .find(p.dev, p.len)
                .expect("checked at enqueue; freed only after");
            let dev = &mut m.allocs.get_mut(&base).expect("found")[off..off + p.len as usize];
            match p.dir {
                // SAFETY: `enqueue`'s contract: the host range is mapped and not touched by
                // anyone else until this synchronisation returns.
                Direction::DeviceToHost => unsafe {
                    std::ptr::copy_nonoverlapping(dev.as_ptr(), p.host, dev.len())
                },
                // SAFETY: as above; the host range is only read.
                Direction::HostToDevice => unsafe {
                    std::ptr::copy_nonoverlapping(p.host.cast_const(), dev.as_mut_ptr(), dev.len())
                },
            }
        }
        if self.shared.fail_next_sync.swap(false, Ordering::SeqCst) {
            return Err(SyncError::Failed(HwError::Gpu(
                "cuStreamSynchronize: CUDA_ERROR_LAUNCH_FAILED (injected)".into(),
            )));
        }
        Ok(())
    }
}

impl Drop for FakeStream {
    fn drop(&mut self) {
        // Copies are pending only after a wait that could not be issued (injected): the caller
        // was told they may still run; the fake drops them rather than touch memory that may
        // be gone by now.
        self.pending.clear();
    }
}
