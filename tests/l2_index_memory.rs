//! The L2 index's memory charge (`L2Index::index_bytes`, the basis of `l2.max_index_bytes`)
//! bounds the heap it really holds, as glibc's allocator counts it (`mallinfo2`, overhead
//! included): the index is driven through a fill at the smallest stride on every extent, mixed
//! strides past its entry cap with pins and touches, a recovery and a CLEAR. One test only:
//! the count is process-wide.

use kvnode::l2::space::{L2Index, Recovered, INDEX_BITS_PER_SLOT, INDEX_BYTES_PER_OBJECT};
use kvnode::storage::{NamespaceId, StorageKey};

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

fn key(i: u32) -> StorageKey {
    let mut chunk_hash = [0u8; 32];
    chunk_hash[..4].copy_from_slice(&i.to_le_bytes());
    StorageKey {
        chunk_hash,
        kv_rank: i % 3,
        object_group: 0,
        namespace: NamespaceId(1),
    }
}

/// Heap bytes in use now (0 where the allocator cannot tell: the bounds then hold trivially).
fn heap() -> u64 {
    kvnode_hw::heap_in_use().unwrap_or(0)
}

#[test]
fn index_heap_stays_within_its_charge_and_limit() {
    assert_eq!(
        INDEX_BYTES_PER_OBJECT, 991,
        "update the arithmetic in space/budget.rs"
    );
    assert_eq!(INDEX_BITS_PER_SLOT, 1);
    // 24 extents of 4 MiB: 511 slots each at the smallest stride.
    let (extents, eb) = (24u32, 4 * MIB);
    let fixed = L2Index::<StorageKey>::fixed_bytes(extents, eb);
    let limit = fixed + 3000 * INDEX_BYTES_PER_OBJECT;
    let keys: Vec<StorageKey> = (0..20_000).map(key).collect();
    let lens = [1, 4 * KIB, 12 * KIB, 28 * KIB];
    let found = |seq: u64| Recovered {
        object_len: 1,
        checksum: 7,
        seq,
        layout: 0,
    };

    // Every extent assigned at the smallest stride with one entry (as recovery can leave
    // them): a per-slot structure would show here.
    let base = heap();
    let mut rx = L2Index::<StorageKey>::with_limit(extents, eb, limit).unwrap();
    for e in 0..extents {
        rx.recover_extent(e, u64::from(e) + 1, 8 * KIB).unwrap();
        rx.recover_entry(keys[e as usize], 100, e, found(u64::from(e)));
    }
    rx.finish_recovery();
    rx.check().unwrap();
    assert_eq!(rx.stats().free_extents, 0);
    let h = heap().saturating_sub(base);
    assert!(
        h <= rx.index_bytes(),
        "sparse extents: {h} > {}",
        rx.index_bytes()
    );
    drop(rx);

    let base = heap();
    let mut ix = L2Index::with_limit(extents, eb, limit).unwrap();
    assert_eq!(ix.max_entries(), 3000);
    let mut peak_entries = 0u64;
    // Heap held must stay within the charge for the largest number of entries so far (the
    // entry table keeps its size), which is within the limit.
    let mut within = |ix: &L2Index<StorageKey>, at: &str| {
        peak_entries = peak_entries.max(ix.stats().entries);
        let charge = fixed + peak_entries * INDEX_BYTES_PER_OBJECT;
        let h = heap().saturating_sub(base);
        assert!(h <= charge, "{at}: {h} bytes held, charged {charge}");
        assert!(charge <= limit && ix.index_bytes() <= limit, "{at}");
        ix.check().unwrap();
    };
    // Mixed strides past the cap, with pins, touches and removals: the entries stay at the
    // cap (the oldest go), the entry table sees tombstones.
    for (i, k) in keys.iter().enumerate() {
        let len = lens[i % lens.len()];
        if let Ok(r) = ix.reserve(*k, len, i as u64) {
            ix.commit(*k, r.slot, 7, 0).unwrap();
        }
        if i % 7 == 0 {
            ix.pin(&keys[i / 2]);
        }
        if i % 11 == 0 {
            ix.touch(&keys[i / 3]);
        }
        if i % 13 == 0 {
            ix.remove(&keys[i / 4]);
        }
        if i % 997 == 0 {
            within(&ix, "mixed fill");
        }
    }
    assert_eq!(ix.stats().entries, 3000, "at the cap");
    within(&ix, "after the mixed fill");
    if kvnode_hw::heap_in_use().is_some() {
        // The measure sees the index at all: 3000 entries of 48 + 88 bytes at least.
        let h = heap().saturating_sub(base);
        assert!(h >= 3000 * 136, "only {h} bytes measured");
    }

    // A restart: a second index rebuilt from what the first holds.
    let base2 = heap();
    let mut rx = L2Index::<StorageKey>::with_limit(extents, eb, limit).unwrap();
    for k in &keys {
        if let Some(l) = ix.get(k) {
            let s = l.slot;
            let _ = rx.recover_extent(s.extent, s.epoch, s.stride); // refused when done already
            rx.recover_entry(k.to_owned(), s.index, s.extent, found(l.seq));
        }
    }
    rx.finish_recovery();
    rx.check().unwrap();
    let h = heap().saturating_sub(base2);
    assert!(
        h <= rx.index_bytes(),
        "recovered: {h} > {}",
        rx.index_bytes()
    );
    drop(rx);

    ix.clear();
    within(&ix, "after clear");
}
