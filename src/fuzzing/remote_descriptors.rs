//! Remote descriptors: regions a remote engine registers and the per-slot buffers of its data
//! ops, as the node checks them (`remote::descriptors::RegionTable`), from arbitrary bytes.
//!
//! Input layout: `data[0]` = number of regions (mod 9), then per region `id u8, addr u64,
//! len u32, rkey u8` (little-endian, missing bytes read as 0); then `data` continues with the
//! slots and buffers: per buffer `region u8, offset u64, len u16` (each buffer's slot has the
//! same length as the buffer, unless the next byte is odd, which shortens the slot by one).

use crate::protocol::{RemoteBuf, RemoteRegion};
use crate::remote::descriptors::RegionTable;
use kvnode_hw::fabric::RemoteSeg;

/// Regions a connection may hold in the harness (as the node's default limit is small too).
const MAX_REGIONS: usize = 8;

struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let n = N.min(self.0.len());
        out[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        out
    }
}

/// Builds harness input: regions `(id, addr, len, rkey)` and buffers `(region, offset, len,
/// shorter_slot)`.
pub fn remote_descriptors_input(
    regions: &[(u8, u64, u32, u8)],
    bufs: &[(u8, u64, u16, bool)],
) -> Vec<u8> {
    let mut v = vec![regions.len() as u8];
    for &(id, addr, len, rkey) in regions {
        v.push(id);
        v.extend_from_slice(&addr.to_le_bytes());
        v.extend_from_slice(&len.to_le_bytes());
        v.push(rkey);
    }
    for &(region, offset, len, short) in bufs {
        v.push(region);
        v.extend_from_slice(&offset.to_le_bytes());
        v.extend_from_slice(&len.to_le_bytes());
        v.push(u8::from(short));
    }
    v
}

/// The harness. Invariants: never panics; a registration is all or nothing and never holds an
/// empty or wrapping region; every accepted work item lies inside the region its buffer named
/// (checked arithmetic), has its slot's length, carries that region's key, and no two accepted
/// buffers overlap; a refusal leaves the table as it was.
pub fn remote_descriptors(data: &[u8]) {
    let mut b = Bytes(data);
    let [n] = b.take::<1>();
    let mut table = RegionTable::new(MAX_REGIONS);
    let mut registered: Vec<RemoteRegion> = Vec::new();
    for _ in 0..(n % 9) {
        let [id] = b.take::<1>();
        let addr = u64::from_le_bytes(b.take::<8>());
        let len = u64::from(u32::from_le_bytes(b.take::<4>()));
        let [rkey] = b.take::<1>();
        let r = RemoteRegion {
            id: u32::from(id),
            addr,
            len,
            rkey: u32::from(rkey),
        };
        let before = table.len();
        match table.register(&[r]) {
            Ok(count) => {
                assert_eq!(count as usize, before + 1, "one region added");
                assert!(r.len > 0 && r.addr.checked_add(r.len).is_some());
                assert!(!registered.iter().any(|x| x.id == r.id), "duplicate id");
                registered.push(r);
            }
            Err(_) => assert_eq!(table.len(), before, "a refusal changes nothing"),
        }
    }
    let mut bufs = Vec::new();
    let mut slots = Vec::new();
    while !b.0.is_empty() && bufs.len() < 64 {
        let [region] = b.take::<1>();
        let offset = u64::from_le_bytes(b.take::<8>());
        let len = u64::from(u16::from_le_bytes(b.take::<2>()));
        let [short] = b.take::<1>();
        bufs.push(RemoteBuf {
            region: u32::from(region),
            offset,
            len,
        });
        let slot_len = if short & 1 == 1 {
            len.saturating_sub(1)
        } else {
            len
        };
        slots.push((bufs.len() as u64 * (1 << 20), slot_len));
    }
    let Ok(items) = table.work_items(&bufs, &slots) else {
        return;
    };
    assert_eq!(items.len(), bufs.len());
    let mut spans = Vec::new();
    for ((item, buf), slot) in items.iter().zip(&bufs).zip(&slots) {
        let region = registered
            .iter()
            .find(|r| r.id == buf.region)
            .expect("an accepted buffer names a registered region");
        let RemoteSeg::Rdma { addr, rkey } = item.remote else {
            panic!("descriptors become RDMA segments");
        };
        assert_eq!(rkey, region.rkey);
        assert_eq!((item.local.offset, item.local.len), *slot);
        assert_eq!(item.local.len, buf.len);
        let end = addr.checked_add(item.local.len).expect("no wrap");
        assert!(
            addr >= region.addr && end <= region.addr + region.len,
            "inside its region"
        );
        spans.push((addr, end));
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        assert!(w[1].0 >= w[0].1, "accepted buffers overlap");
    }
}
