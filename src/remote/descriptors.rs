//! A remote connection's registered buffers and the checks of the descriptors that name them.
//!
//! Everything here is untrusted input from the network: every region and every buffer is
//! bounds-checked with checked arithmetic before it becomes a fabric work item, and a request
//! whose descriptors do not match its transfer's slots exactly is refused whole.

use std::collections::BTreeMap;

use kvnode_hw::fabric::{LocalRange, RemoteSeg, WorkItem};

use crate::error::{Error, ErrorKind, Result};
use crate::protocol::{RemoteBuf, RemoteRegion};

/// The regions one remote connection registered. Invariant: at most `max` regions; every
/// region has `len > 0` and `addr + len` within `u64`.
#[derive(Debug, Clone)]
pub struct RegionTable {
    regions: BTreeMap<u32, RemoteRegion>,
    max: usize,
}

impl RegionTable {
    /// An empty table holding at most `max` regions.
    pub fn new(max: usize) -> RegionTable {
        RegionTable {
            regions: BTreeMap::new(),
            max,
        }
    }

    /// Regions registered.
    pub fn len(&self) -> usize {
        self.regions.len()
    }

    /// Whether none is registered.
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// Registers `regions` (all or none): each must be non-empty, not wrap around the address
    /// space, and have an id not registered yet (also within the request). Returns how many
    /// regions the connection holds now.
    pub fn register(&mut self, regions: &[RemoteRegion]) -> Result<u32> {
        let total = self.regions.len().saturating_add(regions.len());
        if total > self.max {
            return Err(Error::limit(format!(
                "{total} registered regions would exceed the connection's limit of {} \
                 (remote.max_registered_regions)",
                self.max
            )));
        }
        let mut seen = std::collections::BTreeSet::new();
        for r in regions {
            if r.len == 0 {
                return Err(invalid(format!("region {} is empty", r.id)));
            }
            if r.addr.checked_add(r.len).is_none() {
                return Err(invalid(format!(
                    "region {} ({} bytes at {:#x}) wraps around the address space",
                    r.id, r.len, r.addr
                )));
            }
            if self.regions.contains_key(&r.id) || !seen.insert(r.id) {
                return Err(invalid(format!(
                    "region id {} is registered already (unregister it first)",
                    r.id
                )));
            }
        }
        for r in regions {
            self.regions.insert(r.id, *r);
        }
        Ok(self.regions.len() as u32)
    }

    /// Forgets the regions `ids` (all or none: an unknown id refuses the whole request).
    /// Returns how many were forgotten.
    pub fn unregister(&mut self, ids: &[u32]) -> Result<u32> {
        if let Some(id) = ids.iter().find(|id| !self.regions.contains_key(id)) {
            return Err(invalid(format!("region id {id} is not registered")));
        }
        Ok(ids
            .iter()
            .filter(|id| self.regions.remove(id).is_some())
            .count() as u32)
    }

    /// Turns a request's descriptors into work items against the transfer's `slots` (pool
    /// offset and length of each slot, in the transfer's order): one buffer per slot, each
    /// exactly its slot's length, inside its registered region, no two buffers overlapping.
    pub fn work_items(&self, bufs: &[RemoteBuf], slots: &[(u64, u64)]) -> Result<Vec<WorkItem>> {
        if bufs.len() != slots.len() {
            return Err(invalid(format!(
                "{} buffers for a transfer of {} slots (one buffer per slot)",
                bufs.len(),
                slots.len()
            )));
        }
        let mut items = Vec::with_capacity(bufs.len());
        let mut spans: Vec<(u64, u64, usize)> = Vec::with_capacity(bufs.len());
        for (i, (b, &(offset, len))) in bufs.iter().zip(slots).enumerate() {
            let region = self.regions.get(&b.region).ok_or_else(|| {
                invalid(format!(
                    "buffer {i} names region {} which is not registered",
                    b.region
                ))
            })?;
            if b.len != len {
                return Err(invalid(format!(
                    "buffer {i} holds {} bytes but its slot holds {len}",
                    b.len
                )));
            }
            let end = b.offset.checked_add(b.len).filter(|&e| e <= region.len);
            let Some(_) = end else {
                return Err(invalid(format!(
                    "buffer {i} ({} bytes at offset {}) runs past region {} ({} bytes)",
                    b.len, b.offset, region.id, region.len
                )));
            };
            // Inside the region, and the region does not wrap: no overflow possible.
            let addr = region.addr + b.offset;
            spans.push((addr, addr + b.len, i));
            items.push(WorkItem {
                local: LocalRange { offset, len },
                remote: RemoteSeg::Rdma {
                    addr,
                    rkey: region.rkey,
                },
            });
        }
        spans.sort_unstable();
        if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
            return Err(invalid(format!(
                "buffers {} and {} overlap in the engine's memory",
                w[0].2, w[1].2
            )));
        }
        Ok(items)
    }
}

/// Work items moving the transfer's `slots` over the connection's stream, in order.
pub fn stream_items(slots: &[(u64, u64)]) -> Vec<WorkItem> {
    slots
        .iter()
        .map(|&(offset, len)| WorkItem {
            local: LocalRange { offset, len },
            remote: RemoteSeg::Stream,
        })
        .collect()
}

fn invalid(msg: String) -> Error {
    Error::new(ErrorKind::InvalidRequest, msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(id: u32, addr: u64, len: u64) -> RemoteRegion {
        RemoteRegion {
            id,
            addr,
            len,
            rkey: 7,
        }
    }

    fn buf(region: u32, offset: u64, len: u64) -> RemoteBuf {
        RemoteBuf {
            region,
            offset,
            len,
        }
    }

    #[test]
    fn registration_is_checked_and_bounded() {
        let mut t = RegionTable::new(2);
        assert!(t.register(&[region(1, 0, 0)]).is_err());
        assert!(t.register(&[region(1, u64::MAX - 1, 2)]).is_err());
        assert!(t.register(&[region(1, 0, 8), region(1, 64, 8)]).is_err());
        assert_eq!(t.len(), 0, "all or none");
        assert_eq!(t.register(&[region(1, 0x1000, 4096)]).unwrap(), 1);
        assert!(t.register(&[region(1, 0, 8)]).is_err(), "id taken");
        let e = t.register(&[region(2, 0, 8), region(3, 0, 8)]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::LimitExceeded);
        assert!(t.unregister(&[1, 9]).is_err());
        assert_eq!(t.len(), 1);
        assert_eq!(t.unregister(&[1]).unwrap(), 1);
        assert!(t.is_empty());
    }

    #[test]
    fn descriptors_must_match_their_slots_and_regions() {
        let mut t = RegionTable::new(8);
        t.register(&[region(1, 0x10000, 8192), region(2, u64::MAX - 4096, 4096)])
            .unwrap();
        let slots = [(0u64, 4096u64), (4096, 4096)];
        let items = t
            .work_items(&[buf(1, 0, 4096), buf(1, 4096, 4096)], &slots)
            .unwrap();
        assert_eq!(
            items[1].remote,
            RemoteSeg::Rdma {
                addr: 0x11000,
                rkey: 7
            }
        );
        for (bufs, why) in [
            (vec![buf(1, 0, 4096)], "count"),
            (vec![buf(1, 0, 4096), buf(3, 0, 4096)], "unknown region"),
            (vec![buf(1, 0, 4096), buf(1, 4096, 4095)], "length"),
            (vec![buf(1, 0, 4096), buf(1, 4097, 4096)], "past the region"),
            (vec![buf(1, 0, 4096), buf(1, u64::MAX, 4096)], "overflow"),
            (vec![buf(1, 0, 4096), buf(1, 2048, 4096)], "overlap"),
            (vec![buf(2, 0, 4096), buf(2, 1, 4096)], "past a high region"),
        ] {
            assert!(t.work_items(&bufs, &slots).is_err(), "{why}");
        }
    }

    proptest::proptest! {
        /// Whatever the descriptors, every accepted item lies inside a registered region and
        /// matches its slot's length.
        #[test]
        fn accepted_items_are_in_bounds(
            regions in proptest::collection::vec((0u32..4, proptest::num::u64::ANY, 1u64..1 << 20), 1..4),
            bufs in proptest::collection::vec((0u32..5, proptest::num::u64::ANY, 1u64..1 << 16), 1..4),
        ) {
            let mut t = RegionTable::new(8);
            for (id, addr, len) in regions {
                let _ = t.register(&[region(id, addr, len)]);
            }
            let slots: Vec<(u64, u64)> = bufs.iter().enumerate().map(|(i, b)| (i as u64 * (1 << 16), b.2)).collect();
            let bufs: Vec<RemoteBuf> = bufs.iter().map(|&(r, o, l)| buf(r, o % (1 << 21), l)).collect();
            if let Ok(items) = t.work_items(&bufs, &slots) {
                for (it, b) in items.iter().zip(&bufs) {
                    let r = t.regions[&b.region];
                    let RemoteSeg::Rdma { addr, .. } = it.remote else { panic!("rdma item") };
                    proptest::prop_assert!(addr >= r.addr && addr + it.local.len <= r.addr + r.len);
                    proptest::prop_assert_eq!(it.local.len, b.len);
                }
            }
        }
    }
}
