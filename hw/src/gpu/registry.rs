//! Host-memory registration bookkeeping: each host range is registered with the driver once
//! per process however many handles pin it, and unregistered when the last one lets go.
//!
//! The driver refuses a second registration of a registered range and a registration
//! overlapping one; several clients in one process may share one pool mapping, so registration
//! is counted here. Overlapping-but-different ranges are refused with both ranges named.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use super::backend::DeviceBackend;
use crate::{HwError, HwResult};

struct Entry {
    len: usize,
    refs: u64,
    /// The device that registered the range: kept (its context retained) until the range is
    /// unregistered, through which it is unregistered, whichever handle lets go last.
    owner: Arc<dyn DeviceBackend>,
}

/// Registered host ranges by start address.
///
/// Invariant: the ranges are pairwise disjoint; each entry's range is registered with the
/// driver exactly once and has `refs >= 1` live [`super::Pinned`] values naming it.
#[derive(Default)]
pub(crate) struct HostRegistry {
    entries: Mutex<BTreeMap<usize, Entry>>,
}

impl HostRegistry {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Number of registered ranges.
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Takes a reference on `[ptr, ptr + len)`, registering it with `backend` if it is new.
    /// The caller guarantees the range stays mapped until the matching `release`.
    pub(crate) fn acquire(
        &self,
        backend: &Arc<dyn DeviceBackend>,
        ptr: usize,
        len: usize,
    ) -> HwResult<()> {
        if len == 0 {
            return Err(HwError::Invalid(
                "cannot register an empty host range".into(),
            ));
        }
        let end = ptr
            .checked_add(len)
            .ok_or_else(|| HwError::Invalid(format!("host range at {ptr:#x} + {len} wraps")))?;
        let mut entries = self.lock();
        if let Some(e) = entries.get_mut(&ptr) {
            if e.len == len {
                e.refs += 1;
                return Ok(());
            }
        }
        // The entry starting at or before `ptr`, and the first one after it.
        let before = entries.range(..=ptr).next_back().map(|(&s, e)| (s, e.len));
        let after = entries.range(ptr..).next().map(|(&s, e)| (s, e.len));
        for (s, l) in before.into_iter().chain(after) {
            if s < end && ptr < s + l {
                return Err(HwError::Invalid(format!(
                    "host range [{ptr:#x}, {end:#x}) overlaps the registered range [{s:#x}, {:#x}) \
                     without being it: register whole mappings only",
                    s + l
                )));
            }
        }
        // SAFETY: the caller keeps the range mapped until the matching release, which is the
        // only place that unregisters it.
        unsafe { backend.register_host(ptr, len)? };
        entries.insert(
            ptr,
            Entry {
                len,
                refs: 1,
                owner: backend.clone(),
            },
        );
        Ok(())
    }

    /// Drops a reference taken by `acquire(ptr, ..)`; the last one unregisters the range
    /// through the device that registered it.
    pub(crate) fn release(&self, ptr: usize) {
        let mut entries = self.lock();
        let Some(e) = entries.get_mut(&ptr) else {
            debug_assert!(false, "release of an unregistered host range {ptr:#x}");
            tracing::error!(ptr, "release of a host range that is not registered");
            return;
        };
        assert!(e.refs >= 1);
        e.refs -= 1;
        if e.refs == 0 {
            let entry = entries.remove(&ptr).expect("present");
            if let Err(e) = entry.owner.unregister_host(ptr) {
                tracing::warn!(ptr, error = %e, "unregistering host memory failed");
            }
        }
    }
}
