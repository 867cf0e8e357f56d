//! A copy stream: checks a request's copy items, merges neighbours, enqueues them all and
//! waits once.

use super::backend::{Direction, StreamBackend, SyncError};
use super::plan::{coalesce, first_overlap, PlannedCopy, MAX_MERGED_COPY_BYTES};
use super::{CopyItem, Gpu, HostMemory, MAX_COPY_ITEMS};
use crate::{HwError, HwResult};

/// What one stream call did.
///
/// Invariant: `copies <= items`; `bytes` is the sum of the items' lengths.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyReport {
    /// Items asked for.
    pub items: u32,
    /// Driver copies after merging neighbours.
    pub copies: u32,
    /// Bytes moved.
    pub bytes: u64,
}

/// One stream of one GPU, used by one engine instance at a time (`&mut self`).
///
/// Invariant: when a call returns `Ok`, or `Err` with [`GpuStream::is_poisoned`] false, no copy
/// it enqueued is still running: every call ends with one synchronisation, also after a failed
/// enqueue. If the wait could not even be issued, the stream is poisoned: its copies may still
/// run, every later call is refused, and the caller must not hand the memory they touch to
/// anyone (the client keeps the reservation and sends neither commit nor abort). The stream is
/// destroyed before the device handle it holds (field order).
pub struct GpuStream {
    backend: Box<dyn StreamBackend>,
    gpu: Gpu,
    synchronizations: u64,
    poisoned: Option<String>,
}

impl std::fmt::Debug for GpuStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuStream")
            .field("gpu", &self.gpu.info().name)
            .field("synchronizations", &self.synchronizations)
            .finish()
    }
}

impl GpuStream {
    pub(crate) fn new(gpu: Gpu, backend: Box<dyn StreamBackend>) -> GpuStream {
        GpuStream {
            backend,
            gpu,
            synchronizations: 0,
            poisoned: None,
        }
    }

    /// The GPU it runs on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Whether a wait could not be issued: copies of that call may still be running.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.is_some()
    }

    /// How many times this stream waited (one per successful or failed call that enqueued).
    pub fn synchronizations(&self) -> u64 {
        self.synchronizations
    }

    /// Copies every item's device span into `host` at its offset; one wait for all. Errors
    /// (nothing enqueued): an item outside `host` (`OutOfBounds`), a span of another GPU handle,
    /// two items writing overlapping host bytes, more than [`MAX_COPY_ITEMS`] (`Invalid`).
    pub fn device_to_host(
        &mut self,
        host: &mut dyn HostMemory,
        items: &[CopyItem<'_>],
    ) -> HwResult<CopyReport> {
        let (base, len) = host.host_range();
        let plan = self.check(len, items, Direction::DeviceToHost)?;
        // SAFETY: every planned copy lies inside `host` (checked), which `&mut` keeps mapped and
        // unaliased by this process until `run` returned, and `run` waits for every copy.
        unsafe { self.run(Direction::DeviceToHost, base, &plan) }?;
        Ok(report(items, &plan))
    }

    /// Copies `host` at each item's offset into its device span; one wait for all. Errors as
    /// for [`GpuStream::device_to_host`] (overlap: two items writing the same device bytes).
    pub fn host_to_device(
        &mut self,
        host: &dyn HostMemory,
        items: &[CopyItem<'_>],
    ) -> HwResult<CopyReport> {
        let (base, len) = host.host_range();
        let plan = self.check(len, items, Direction::HostToDevice)?;
        // SAFETY: every planned copy lies inside `host` (checked), which the borrow keeps
        // mapped until `run` returned, and `run` waits for every copy.
        unsafe { self.run(Direction::HostToDevice, base, &plan) }?;
        Ok(report(items, &plan))
    }

    fn check(
        &self,
        host_len: usize,
        items: &[CopyItem<'_>],
        dir: Direction,
    ) -> HwResult<Vec<PlannedCopy>> {
        if let Some(why) = &self.poisoned {
            return Err(HwError::Gpu(format!(
                "this GPU stream is unusable: an earlier wait could not be issued ({why})"
            )));
        }
        if items.len() > MAX_COPY_ITEMS {
            return Err(HwError::Invalid(format!(
                "{} copy items in one call: at most {MAX_COPY_ITEMS}",
                items.len()
            )));
        }
        let mut written: Vec<(u64, u64)> = Vec::with_capacity(items.len());
        for it in items {
            self.gpu.check_same(it.device.gpu_id(), "copy")?;
            let len = it.device.len();
            if it
                .host_offset
                .checked_add(len)
                .is_none_or(|e| e > host_len as u64)
            {
                return Err(HwError::OutOfBounds {
                    offset: it.host_offset,
                    len,
                    pool_len: host_len as u64,
                });
            }
            written.push(match dir {
                Direction::DeviceToHost => (it.host_offset, len),
                Direction::HostToDevice => (it.device.ptr(), len),
            });
        }
        if let Some((a, b)) = first_overlap(&mut written) {
            let side = match dir {
                Direction::DeviceToHost => "host offsets",
                Direction::HostToDevice => "device addresses",
            };
            return Err(HwError::Invalid(format!(
                "two copies would write the same bytes: {side} {:#x}+{} and {:#x}+{}",
                a.0, a.1, b.0, b.1
            )));
        }
        Ok(coalesce(
            items.iter().map(|it| PlannedCopy {
                host_offset: it.host_offset,
                device_ptr: it.device.ptr(),
                len: it.device.len(),
            }),
            MAX_MERGED_COPY_BYTES,
        ))
    }

    /// Enqueues `plan` and waits once, also after a failed enqueue.
    ///
    /// # Safety
    /// Every copy's host range lies inside memory starting at `base` that stays mapped (and,
    /// device-to-host, untouched by this process) until this returns; device spans were checked
    /// to belong to this stream's GPU handle and are kept live by their borrows.
    unsafe fn run(&mut self, dir: Direction, base: *mut u8, plan: &[PlannedCopy]) -> HwResult<()> {
        if plan.is_empty() {
            return Ok(());
        }
        let mut failed = None;
        for p in plan {
            // SAFETY: host_offset + len <= the host memory's length (checked), so the pointer
            // stays inside its mapping.
            let host = unsafe { base.add(p.host_offset as usize) };
            // SAFETY: forwarded: mapped until we synchronise below; the device span is live.
            if let Err(e) = unsafe { self.backend.enqueue(dir, host, p.device_ptr, p.len) } {
                failed = Some(e);
                break;
            }
        }
        self.synchronizations += 1;
        match (failed, self.backend.synchronize()) {
            (_, Err(SyncError::NotWaited(e))) => {
                let why = e.to_string();
                self.poisoned = Some(why.clone());
                Err(HwError::Gpu(format!(
                    "the copies could not be waited for ({why}): they may still be running"
                )))
            }
            (Some(e), _) => Err(e),
            (None, Err(SyncError::Failed(e))) => Err(e),
            (None, Ok(())) => Ok(()),
        }
    }
}

fn report(items: &[CopyItem<'_>], plan: &[PlannedCopy]) -> CopyReport {
    CopyReport {
        items: items.len() as u32,
        copies: plan.len() as u32,
        bytes: items.iter().map(|i| i.device.len()).sum(),
    }
}
