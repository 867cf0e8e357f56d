//! Clean stops and what a restart finds: extent tables after a checkpoint, slot headers after
//! a crash, and checksum failures counted as torn (left by an unclean stop) or corrupt.

use std::os::unix::fs::FileExt;

use super::*;
use crate::l2::format::{extent_count, slots_per_extent, stride_for, table_blocks, table_offset};
use crate::l2::tier::DATA_FILE;

/// File offset of `key`'s slot header.
fn slot_of(r: &Rig, key: &StorageKey) -> u64 {
    let s = r.tier.pin_for_tests(key).expect("key is on L2");
    r.tier.unpin_for_tests(key, s);
    s.file_offset
}

/// Overwrites `len` bytes at `offset` of the data file in `dir` (the tier is closed).
fn damage(dir: &std::path::Path, offset: u64, len: usize) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join(DATA_FILE))
        .unwrap();
    f.write_all_at(&vec![0x3c; len], offset).unwrap();
    f.sync_all().unwrap();
}

/// Closes the rig (no checkpoint unless the caller took one) and keeps its directory.
fn close(mut r: Rig) -> tempdir::Dir {
    let owner = r.dir.take().expect("first rig owns the directory");
    drop(r);
    owner
}

/// Loads `keys` from L2 alone; returns which loaded with the bytes they were stored with.
fn load_all(r: &Rig, keys: &[StorageKey]) -> Vec<bool> {
    let l = r.tier.load(&r.storage, keys, 0, None);
    let ok = keys
        .iter()
        .zip(&l)
        .map(|(k, l)| l.is_some() && r.bytes_ok(k))
        .collect();
    r.unlock(keys, &l, 0);
    ok
}

#[test]
fn a_clean_stop_makes_the_next_start_read_tables_not_every_slot_header() {
    both(|engine| {
        let r = rig(&format!("ckpt-{engine}"), engine);
        let keys = r.keys(40);
        r.store(&keys);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 40);
        let s = r.tier.status();
        let slots = slots_per_extent(s.extent_bytes, stride_for(OBJ));
        let extents = u64::from(extent_count(s.bytes, s.extent_bytes));
        // A crash first: the start reads every slot header of the assigned extent.
        let owner = close(r);
        let r = open_rig(owner.0.clone(), engine, 1024, Fault::None);
        let keys = r.keys(keys.len() as u8);
        let crash = r.tier.status();
        assert!(!crash.clean_start);
        assert_eq!(crash.recovered, 40);
        assert_eq!(crash.startup_blocks_read, extents + u64::from(slots));
        let hidden = slot_of(&r, &keys[30]);
        let stats = r.tier.checkpoint(&r.namespaces).unwrap();
        assert_eq!((stats.extents, stats.objects), (1, 40));
        drop(r);
        // Key 30's slot header is gone: only the table knows the object now.
        damage(&owner.0, hidden, 4096);
        let mut r = open_rig(owner.0.clone(), engine, 1024, Fault::None);
        let keys = r.keys(keys.len() as u8);
        let clean = r.tier.status();
        assert!(clean.clean_start);
        assert_eq!(clean.recovered, 40);
        // Extent headers, the table, and one slot header for the namespace's strings.
        assert_eq!(
            clean.startup_blocks_read,
            extents + table_blocks(slots) + 1,
            "{clean:?}"
        );
        r.drop_l1();
        assert!(load_all(&r, &keys).iter().all(|&ok| ok));
        assert_eq!((r.tier.status().corrupt, r.tier.status().torn), (0, 0));
        r.check_clean();
        r.dir = Some(owner);
    });
}

/// Issue 10, defect 6: a checksum failure that an unclean stop explains (a torn write, a slot
/// reused for another object whose header never landed) was counted as corruption.
#[test]
fn a_checksum_failure_left_by_an_unclean_stop_is_torn_not_corrupt() {
    both(|engine| {
        let r = rig(&format!("torn-{engine}"), engine);
        let keys = r.keys(3);
        r.store(&keys[..2]);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys[..2]), 2);
        r.tier.sync().unwrap();
        let reused = slot_of(&r, &keys[0]);
        // The process dies while the slot is being given to another object: its payload is
        // half rewritten, its header still the old object's.
        let owner = close(r);
        damage(&owner.0, reused + 4096, 8192);
        let r = open_rig(owner.0.clone(), engine, 1024, Fault::None);
        let keys = r.keys(keys.len() as u8);
        assert_eq!(r.tier.status().recovered, 2);
        assert_eq!(load_all(&r, &keys[..2]), [false, true]);
        let s = r.tier.status();
        assert_eq!((s.torn, s.corrupt), (1, 0), "{s:?}");
        // An object written after the unclean stop and stopped cleanly since: the same damage
        // is the medium's doing.
        r.store(&keys[2..]);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys[2..]), 1);
        let later = slot_of(&r, &keys[2]);
        r.tier.checkpoint(&r.namespaces).unwrap();
        drop(r);
        damage(&owner.0, later + 4096, 8192);
        let mut r = open_rig(owner.0.clone(), engine, 1024, Fault::None);
        let keys = r.keys(keys.len() as u8);
        // The object dropped before the clean stop is not found again (nor counted again).
        assert!(!r.tier.contains(&keys[0]));
        assert_eq!(r.tier.status().recovered, 2);
        assert_eq!(load_all(&r, &keys[1..]), [true, false]);
        let s = r.tier.status();
        assert_eq!((s.torn, s.corrupt), (0, 1), "{s:?}");
        r.check_clean();
        r.dir = Some(owner);
    });
}

#[test]
fn a_damaged_table_block_costs_only_its_own_slots() {
    let r = rig("ckpt-damaged", "pread");
    let s = r.tier.status();
    let slots = slots_per_extent(s.extent_bytes, stride_for(OBJ));
    assert!(slots > 45 && table_blocks(slots) >= 2, "{slots} slots");
    let keys = r.keys(60);
    r.store(&keys);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 60);
    r.tier.checkpoint(&r.namespaces).unwrap();
    let owner = close(r);
    let extents = u64::from(extent_count(s.bytes, s.extent_bytes));
    // The second table block of extent 0 (slots 45..) is torn.
    damage(&owner.0, table_offset(s.extent_bytes, 0) + 4096 + 100, 16);
    let mut r = open_rig(owner.0.clone(), "pread", 1024, Fault::None);
    let keys = r.keys(keys.len() as u8);
    let st = r.tier.status();
    assert!(st.clean_start);
    assert_eq!(st.recovered, 60);
    let second = u64::from(slots) - 45;
    assert_eq!(
        st.startup_blocks_read,
        extents + table_blocks(slots) + 1 + second
    );
    r.drop_l1();
    assert!(load_all(&r, &keys).iter().all(|&ok| ok));
    r.check_clean();
    r.dir = Some(owner);
}

#[test]
fn after_a_checkpoint_the_tier_writes_nothing_and_a_crash_start_agrees_with_it() {
    let r = rig("ckpt-sealed", "pread");
    let keys = r.keys(6);
    r.store(&keys[..4]);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys[..4]), 4);
    r.tier.checkpoint(&r.namespaces).unwrap();
    assert!(r.tier.sealed());
    r.store(&keys[4..]);
    let skipped = r.tier.status().skipped;
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys[4..]), 0);
    assert_eq!(r.tier.status().skipped, skipped + 2);
    // A second checkpoint of the same state is fine (nothing changed).
    r.tier.checkpoint(&r.namespaces).unwrap();
    let owner = close(r);
    let r = open_rig(owner.0.clone(), "pread", 1024, Fault::None);
    let keys = r.keys(keys.len() as u8);
    assert!(r.tier.status().clean_start);
    let held: Vec<bool> = keys.iter().map(|k| r.tier.contains(k)).collect();
    assert_eq!(held, [true, true, true, true, false, false]);
    // This run crashes: the next start reads the slot headers and finds the same objects.
    drop(r);
    let mut r = open_rig(owner.0.clone(), "pread", 1024, Fault::None);
    let keys = r.keys(keys.len() as u8);
    assert!(!r.tier.status().clean_start);
    let again: Vec<bool> = keys.iter().map(|k| r.tier.contains(k)).collect();
    assert_eq!(again, held);
    r.check_clean();
    r.dir = Some(owner);
}

#[test]
fn a_checkpoint_is_refused_when_its_sync_fails_and_the_next_start_reads_headers() {
    let r = rig("ckpt-eio", "pread");
    let keys = r.keys(4);
    r.store(&keys);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 4);
    r.fault.store(Fault::SyncEio as u32, Ordering::Relaxed);
    let err = r.tier.checkpoint(&r.namespaces).unwrap_err();
    assert!(err.to_string().contains("checkpoint"), "{err}");
    let owner = close(r);
    let mut r = open_rig(owner.0.clone(), "pread", 1024, Fault::None);
    assert!(!r.tier.status().clean_start);
    r.check_clean();
    r.dir = Some(owner);
}

/// Found by the tier simulator: an extent free in memory at the checkpoint (emptied at
/// start-up, here because its slot headers could not be read) kept a valid header on disk, had
/// no table, and the next start read its slot headers: objects the stopped run did not hold came
/// back after a clean stop.
#[test]
fn an_extent_free_at_the_checkpoint_brings_nothing_back() {
    let r = rig("ckpt-free", "pread");
    let keys = r.keys(4);
    r.store(&keys);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 4);
    r.tier.sync().unwrap();
    let owner = close(r);
    // Run 2 cannot read the slot headers: it holds nothing, and stops cleanly.
    let r = open_rig(owner.0.clone(), "pread", 1024, Fault::HeaderReadEio);
    assert_eq!(r.tier.status().recovered, 0);
    r.fault.store(Fault::None as u32, Ordering::Relaxed);
    r.tier.checkpoint(&r.namespaces).unwrap();
    drop(r);
    let mut r = open_rig(owner.0.clone(), "pread", 1024, Fault::None);
    let keys = r.keys(4);
    let s = r.tier.status();
    assert!(s.clean_start);
    assert_eq!(
        s.recovered, 0,
        "objects the stopped run did not hold came back"
    );
    assert!(keys.iter().all(|k| !r.tier.contains(k)));
    r.check_clean();
    r.dir = Some(owner);
}

/// Found in review: the checkpoint only stopped new `persist` calls, so a write-behind batch
/// already prepared (the writer thread prepares and completes batches itself) could reuse a
/// slot after its table was written: the table would name the evicted object over the new one's
/// bytes. Now the checkpoint seals the tier alone in the CLEAR gate, waits for the batches in
/// flight, and a batch prepared after it writes nothing.
#[test]
fn a_checkpoint_waits_for_the_batches_in_flight_and_later_ones_write_nothing() {
    let r = rig("ckpt-inflight", "pread");
    let keys = r.keys(6);
    r.store(&keys);
    let batch = r
        .tier
        .prepare_write(&r.storage, &r.namespaces, &keys[..3])
        .expect("a batch to write");
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let ckpt = s.spawn(|| {
            let out = r.tier.checkpoint(&r.namespaces);
            done.store(true, Ordering::SeqCst);
            out
        });
        eventually("the checkpoint sealed the tier", || r.tier.sealed());
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            !done.load(Ordering::SeqCst),
            "the checkpoint did not wait for the batch in flight"
        );
        // A batch prepared now writes nothing.
        assert!(r
            .tier
            .prepare_write(&r.storage, &r.namespaces, &keys[3..])
            .is_none());
        assert_eq!(r.tier.complete_write(&r.storage, batch), 3);
        let stats = ckpt.join().unwrap().expect("checkpoint after the batch");
        assert_eq!(stats.objects, 3, "the batch in flight is in the tables");
    });
    let owner = close(r);
    let mut r = open_rig(owner.0.clone(), "pread", 1024, Fault::None);
    let keys = r.keys(6);
    assert!(r.tier.status().clean_start);
    let held: Vec<bool> = keys.iter().map(|k| r.tier.contains(k)).collect();
    assert_eq!(held, [true, true, true, false, false, false]);
    r.drop_l1();
    assert!(load_all(&r, &keys[..3]).iter().all(|&ok| ok));
    r.check_clean();
    r.dir = Some(owner);
}

/// Found by the tier simulator: an extent whose header could not be read at start-up (an EIO,
/// a bit flipped on the way) was free in memory but not zeroed by the checkpoint; the next
/// clean start read its valid header, found no table, and brought its objects back.
#[test]
fn an_extent_whose_header_was_unreadable_at_start_up_brings_nothing_back() {
    let r = rig("ckpt-eio-ext", "pread");
    let keys = r.keys(4);
    r.store(&keys);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 4);
    r.tier.sync().unwrap();
    let owner = close(r);
    let r = open_rig(owner.0.clone(), "pread", 1024, Fault::ExtentHeaderReadEio);
    assert_eq!(r.tier.status().recovered, 0);
    r.fault.store(Fault::None as u32, Ordering::Relaxed);
    r.tier.checkpoint(&r.namespaces).unwrap();
    drop(r);
    let mut r = open_rig(owner.0.clone(), "pread", 1024, Fault::None);
    let s = r.tier.status();
    assert!(s.clean_start);
    assert_eq!(
        s.recovered, 0,
        "objects the stopped run did not hold came back"
    );
    r.check_clean();
    r.dir = Some(owner);
}
