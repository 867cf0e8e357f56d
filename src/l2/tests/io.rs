//! Writes, loads and their faults: round trips, EIO/ENOSPC/bit flips, failed syncs, layouts,
//! pipelined batches, start-up with unreadable headers, and slot holds during write-behind.

use super::*;

#[test]
fn write_then_load_round_trip() {
    both(|engine| {
        let r = rig(&format!("rt-{engine}"), engine);
        let keys = r.keys(10);
        r.store(&keys);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 10);
        assert_eq!(
            r.tier.persist(&r.storage, &r.namespaces, &keys),
            0,
            "already on L2"
        );
        r.drop_l1();
        let leases = r.tier.load(&r.storage, &keys, 0, None);
        assert_eq!(r.unlock(&keys, &leases, 0), keys.len());
        assert!(keys.iter().all(|k| r.bytes_ok(k)));
        let s = r.tier.status();
        assert_eq!((s.writes, s.hits, s.errors, s.corrupt), (10, 10, 0, 0));
        r.check_clean();
    });
}

#[test]
fn failed_writes_are_counted_and_leave_l1_intact() {
    both(|engine| {
        let r = rig(&format!("wfail-{engine}"), engine);
        let keys = r.keys(8);
        r.store(&keys);
        r.fault
            .store(Fault::EveryOtherWrite as u32, Ordering::Relaxed);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 4);
        let s = r.tier.status();
        assert_eq!((s.writes, s.errors, s.objects), (4, 4, 4));
        r.fault.store(Fault::AllWrites as u32, Ordering::Relaxed);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 0);
        assert_eq!(r.tier.status().errors, 8);
        assert!(keys.iter().all(|k| r.bytes_ok(k)), "L1 keeps serving");
        r.check_clean();
        // Once the device recovers, the failed objects are written on the next attempt.
        r.fault.store(Fault::None as u32, Ordering::Relaxed);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 4);
        assert_eq!(r.tier.status().objects, 8);
        r.check_clean();
    });
}

#[test]
fn objects_are_not_written_into_an_extent_whose_header_is_not_durable() {
    let r = rig("syncfail", "pread");
    let keys = r.keys(4);
    r.store(&keys);
    // The first write assigns an extent; its header cannot be made durable: no slot of it
    // is written (recovery could not tell its epoch), and the failure is counted per object.
    r.fault.store(Fault::SyncEio as u32, Ordering::Relaxed);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 0);
    let s = r.tier.status();
    assert_eq!((s.writes, s.errors, s.objects), (0, 4, 0));
    assert!(keys.iter().all(|k| r.bytes_ok(k)), "L1 keeps serving");
    r.check_clean();
    r.fault.store(Fault::None as u32, Ordering::Relaxed);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 4);
    r.check_clean();
}

#[test]
fn read_errors_and_corruption_drop_objects_and_never_publish() {
    both(|engine| {
        let r = rig(&format!("rfail-{engine}"), engine);
        let keys = r.keys(6);
        r.store(&keys);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 6);
        r.drop_l1();
        r.fault.store(Fault::ReadEio as u32, Ordering::Relaxed);
        assert!(r
            .tier
            .load(&r.storage, &keys[..3], 0, None)
            .iter()
            .all(Option::is_none));
        r.fault.store(Fault::ReadFlip as u32, Ordering::Relaxed);
        assert!(r
            .tier
            .load(&r.storage, &keys[3..5], 0, None)
            .iter()
            .all(Option::is_none));
        let s = r.tier.status();
        assert_eq!((s.errors, s.corrupt, s.objects, s.hits), (3, 2, 1, 0));
        assert!(!r.storage.contains_ready(&keys[0]) && !r.storage.contains_ready(&keys[3]));
        r.check_clean();
        // The healthy one still loads.
        r.fault.store(Fault::None as u32, Ordering::Relaxed);
        let l = r.tier.load(&r.storage, &keys[5..], 2, None);
        let lease = l[0].expect("loads");
        r.storage.finish_read(&[(keys[5], lease)], 2);
        assert!(r.bytes_ok(&keys[5]));
        r.check_clean();
    });
}

#[test]
fn prefetch_bound_and_missing_keys() {
    let r = rig_with("bound", "pread", 3);
    let keys = r.keys(5);
    r.store(&keys[..4]);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys[..4]), 4);
    r.drop_l1();
    // Budget 3: only the first three keys are loaded; the rest are left for a later call.
    let l = r.tier.load(&r.storage, &keys, 0, None);
    assert_eq!(
        l.iter().map(Option::is_some).collect::<Vec<_>>(),
        [true, true, true, false, false]
    );
    r.unlock(&keys, &l, 0);
    // The budget is returned: the fourth loads now; the fifth was never on L2.
    let l = r.tier.load(&r.storage, &keys[3..], 0, None);
    assert!(l[0].is_some() && l[1].is_none());
    r.storage.finish_read(&[(keys[3], l[0].unwrap())], 0);
    assert_eq!(r.tier.status().hits, 4);
    r.check_clean();
}

#[test]
fn concurrent_loads_of_a_shared_prefix_all_hit() {
    let r = rig("shared", "uring");
    let keys = r.keys(16);
    r.store(&keys);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 16);
    r.drop_l1();
    // Four lookups of the same prefix at once: whoever loads a key first publishes it; the
    // others wait for it instead of reporting a miss.
    let results: Vec<Vec<Option<u64>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|_| s.spawn(|| r.tier.load(&r.storage, &keys, 0, None)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for leases in &results {
        assert_eq!(r.unlock(&keys, leases, 0), keys.len(), "{leases:?}");
    }
    assert_eq!(r.tier.status().hits, 16, "each object read from disk once");
    assert!(keys.iter().all(|k| r.bytes_ok(k)));
    r.check_clean();
}

#[test]
fn unreadable_headers_at_start_up_are_skipped_not_fatal() {
    let mut r = rig("hdr", "pread");
    let keys = r.keys(5);
    r.store(&keys);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 5);
    let owner = r.dir.take().expect("first rig owns the directory");
    let dir = owner.0.clone();
    drop(r);
    // Reopen with every slot-header read failing: the node starts, empty, and says why.
    let r2 = open_rig(dir.clone(), "pread", 1024, Fault::HeaderReadEio);
    let s = r2.tier.status();
    assert_eq!((s.recovered, s.objects), (0, 0));
    assert!(
        s.errors >= 5,
        "each unreadable header block is counted: {}",
        s.errors
    );
    r2.tier.check().unwrap();
    drop(r2);
    // A healthy reopen finds all five.
    let r3 = open_rig(dir, "pread", 1024, Fault::None);
    assert_eq!(r3.tier.status().recovered, 5, "{:?}", r3.tier.status());
    drop(owner);
}

#[test]
fn pipelined_batches_write_and_load_everything() {
    both(|engine| {
        let dir = std::env::temp_dir().join(format!(
            "kvnode-l2unit-{}-pipe-{engine}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        // Batches of 8: 60 objects are 8 write batches (pipelined on the I/O thread) and two
        // load sub-batches (32 + 28, the second read while the first is verified).
        let mut r = open_rig_batched(dir.clone(), engine, 1024, Fault::None, 8);
        r.dir = Some(tempdir::Dir(dir));
        let keys = r.keys(60);
        r.store(&keys);
        r.fault
            .store(Fault::EveryOtherWrite as u32, Ordering::Relaxed);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 30);
        r.check_clean();
        r.fault.store(Fault::None as u32, Ordering::Relaxed);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 30);
        r.check_clean();
        r.drop_l1();
        let leases = r.tier.load(&r.storage, &keys, 1, None);
        assert_eq!(r.unlock(&keys, &leases, 1), keys.len());
        assert!(keys.iter().all(|k| r.bytes_ok(k)));
        let s = r.tier.status();
        assert_eq!((s.writes, s.errors, s.hits, s.corrupt), (60, 30, 60, 0));
        r.check_clean();
    });
}

#[test]
fn objects_of_another_layout_are_not_loaded() {
    use crate::storage::{Dtype, Layout};
    let r = rig("layout", "pread");
    let keys = r.keys(3);
    // Committed under [2, 2, 16, 256] float32 (64 KiB): the L2 copy carries that layout.
    let f32_layout = Layout::new(vec![2, 2, 16, 256], Dtype::Float32).unwrap();
    r.store_as(&keys, f32_layout.fingerprint(), 0xa5);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 3);
    r.drop_l1();
    // Registered now with another size, or the same size in another dtype: not loaded.
    for other in [
        Layout::new(vec![2, 2, 16, 128], Dtype::Float32).unwrap(),
        Layout::new(vec![2, 2, 16, 512], Dtype::Bfloat16).unwrap(),
    ] {
        let l = r.tier.load(&r.storage, &keys, 0, Some(&other));
        assert!(l.iter().all(Option::is_none), "{other:?}");
    }
    let s = r.tier.status();
    assert_eq!(
        (s.hits, s.errors, s.corrupt, s.objects),
        (0, 0, 0, 3),
        "kept, not counted as faults"
    );
    r.check_clean();
    // Under the layout they were stored with, they load.
    let l = r.tier.load(&r.storage, &keys, 0, Some(&f32_layout));
    assert_eq!(r.unlock(&keys, &l, 0), 3);
    r.check_clean();
}

#[test]
fn an_uncompleted_write_batch_releases_everything_it_holds() {
    let r = rig("dropbatch", "pread");
    let keys = r.keys(5);
    r.store(&keys);
    // Planned (L1 locks, L2 slots, staging blocks taken) but never completed, as when the
    // thread meant to complete it is gone: dropping it gives everything back.
    let batch = r
        .tier
        .prepare_write(&r.storage, &r.namespaces, &keys)
        .expect("five objects to write");
    assert_eq!(r.storage.counts().read_locked, 5);
    drop(batch);
    r.check_clean();
    let s = r.tier.status();
    assert_eq!((s.objects, s.writes, s.errors), (0, 0, 5));
    // Nothing is stuck: the next attempt writes them all.
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 5);
    r.check_clean();
}

#[test]
fn write_batches_are_bounded_by_objects_and_bytes() {
    use crate::l2::tier::{byte_bounded_parts, WRITE_BATCH_BYTES};
    let keys: Vec<StorageKey> = (0..10u8)
        .map(|i| StorageKey {
            chunk_hash: [i; 32],
            kv_rank: 0,
            object_group: 0,
            namespace: crate::storage::NamespaceId(0),
        })
        .collect();
    let sizes = |parts: &[&[StorageKey]]| parts.iter().map(|p| p.len()).collect::<Vec<_>>();
    // Small objects: the object bound.
    let small = byte_bounded_parts(&keys, 4, &|_| 1 << 20);
    assert_eq!(sizes(&small), vec![4, 4, 2]);
    // 32 MiB objects: four reach the byte bound, whatever the object bound.
    let big = byte_bounded_parts(&keys, 64, &|_| WRITE_BATCH_BYTES / 4);
    assert_eq!(sizes(&big), vec![4, 4, 2]);
    // An object over the bound is a batch of its own; nothing is lost or reordered.
    let huge = byte_bounded_parts(&keys, 64, &|_| WRITE_BATCH_BYTES * 2);
    assert_eq!(sizes(&huge), vec![1; 10]);
    assert_eq!(huge.concat(), keys);
    assert!(byte_bounded_parts(&[], 4, &|_| 1).is_empty());
}

#[test]
fn an_object_stored_again_under_another_layout_replaces_its_l2_copy() {
    use crate::storage::{Dtype, Layout};
    let r = rig("relayout", "pread");
    let keys = r.keys(3);
    let f32_layout = Layout::new(vec![2, 2, 16, 256], Dtype::Float32).unwrap();
    let bf16_layout = Layout::new(vec![2, 2, 16, 512], Dtype::Bfloat16).unwrap();
    assert_eq!(f32_layout.object_bytes(), bf16_layout.object_bytes());
    r.store_as(&keys, f32_layout.fingerprint(), 0xa5);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 3);
    // The same object again under the same layout: nothing to write.
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 0);
    assert!(keys
        .iter()
        .all(|k| r.tier.holds_as(k, OBJ, f32_layout.fingerprint())));
    r.drop_l1();
    // The model comes back in bf16 and stores the same prefixes (other bytes).
    r.store_as(&keys, bf16_layout.fingerprint(), 0x3c);
    assert!(keys
        .iter()
        .all(|k| !r.tier.holds_as(k, OBJ, bf16_layout.fingerprint())));
    assert_eq!(
        r.tier.persist(&r.storage, &r.namespaces, &keys),
        3,
        "replaced"
    );
    r.drop_l1();
    let l = r.tier.load(&r.storage, &keys, 0, Some(&f32_layout));
    assert!(l.iter().all(Option::is_none), "the f32 copy is gone");
    let l = r.tier.load(&r.storage, &keys, 0, Some(&bf16_layout));
    assert_eq!(r.unlock(&keys, &l, 0), 3);
    // Loaded objects keep the layout they were written under (a later write-behind of them
    // would stamp it again).
    for k in &keys {
        assert_eq!(
            r.storage.ready_object(k),
            Some((OBJ, bf16_layout.fingerprint()))
        );
        assert!(r.pool_bytes_are(k, 0x3c));
    }
    let s = r.tier.status();
    assert_eq!((s.objects, s.writes, s.errors, s.corrupt), (3, 6, 0, 0));
    r.check_clean();
}

/// Issue 10, defect 2: an extent header unreadable at one start-up must not let that run reuse
/// the extent's epoch or restart sequence numbers below those already on disk; otherwise, at the
/// next start, the old slot headers of the extent look current again (objects come back from
/// an extent reassigned meanwhile) and an old copy of a replaced object outranks the new one.
#[test]
fn an_unreadable_extent_header_never_brings_back_stale_objects() {
    let mut r = rig("stale", "pread");
    let keys = r.keys(6);
    r.store(&keys);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 6);
    let owner = r.dir.take().expect("first rig owns the directory");
    let dir = owner.0.clone();
    drop(r);
    // Run 2: the extent header cannot be read at start-up (a transient EIO): the tier starts
    // empty and gives the extent out again. Key 5 is stored again with other bytes.
    let r2 = open_rig(dir.clone(), "pread", 1024, Fault::ExtentHeaderReadEio);
    assert_eq!(r2.tier.status().recovered, 0);
    r2.fault.store(Fault::None as u32, Ordering::Relaxed);
    let keys2 = r2.keys(6);
    r2.store_as(&keys2[5..], 0, 0x5a);
    assert_eq!(r2.tier.persist(&r2.storage, &r2.namespaces, &keys2[5..]), 1);
    drop(r2);
    // Run 3, healthy: only what run 2 wrote is current.
    let r3 = open_rig(dir, "pread", 1024, Fault::None);
    let keys3 = r3.keys(6);
    let back: Vec<usize> = (0..5).filter(|&i| r3.tier.contains(&keys3[i])).collect();
    assert!(
        back.is_empty(),
        "objects of the reassigned extent came back: keys {back:?}"
    );
    let l = r3.tier.load(&r3.storage, &keys3[5..], 0, None);
    assert!(l[0].is_some(), "key 5 is on L2");
    assert!(
        r3.pool_bytes_are(&keys3[5], 0x5a),
        "key 5 came back with the bytes it had before it was replaced"
    );
    r3.unlock(&keys3[5..], &l, 0);
    r3.check_clean();
    drop(owner);
}

/// Issue 10, defect 6: the write-behind reads an L1 slot with O_DIRECT; the hold it keeps on the
/// object must outlive the read TTL (a slow device), or the slot is freed and reused while the
/// device still reads it.
#[test]
fn a_write_behind_holds_its_slot_past_the_read_ttl() {
    let r = rig("iohold", "pread");
    let keys = r.keys(3);
    r.store(&keys);
    let batch = r
        .tier
        .prepare_write(&r.storage, &r.namespaces, &keys)
        .expect("three objects to write");
    let held: Vec<u64> = keys
        .iter()
        .map(|k| r.storage.ready_object(k).map(|_| 0).unwrap_or(1))
        .collect();
    assert_eq!(held, vec![0, 0, 0]);
    // Much later (every timed lock has expired), CLEAR: the objects must stay allocated.
    r.storage.expire_locks(u64::MAX / 2);
    r.storage.clear();
    let fresh: Vec<StorageKey> = (100..103u8)
        .map(|i| StorageKey {
            chunk_hash: [i; 32],
            ..keys[0]
        })
        .collect();
    let grants = r.storage.reserve_write(&fresh, OBJ, false);
    let in_flight: Vec<u64> = keys
        .iter()
        .filter_map(|k| {
            r.storage
                .snapshot()
                .into_iter()
                .find(|(x, _)| x == k)
                .map(|(_, e)| e.slot.offset)
        })
        .collect();
    assert_eq!(in_flight.len(), 3, "the objects being written were freed");
    for g in grants.iter().flatten() {
        assert!(
            !in_flight.contains(&g.slot.offset),
            "a slot being written to disk was handed out again"
        );
    }
    let items: Vec<_> = fresh
        .iter()
        .copied()
        .zip(grants)
        .filter_map(|(k, g)| g.ok().map(|g| (k, g)))
        .collect();
    r.storage.abort_write(&items);
    assert_eq!(r.tier.complete_write(&r.storage, batch), 3);
    // Written, and freed now that the device is done with them (they were cleared).
    assert_eq!(r.storage.counts().doomed, 0);
    r.check_clean();
}

/// Issue 10, defect 6: after a failed fdatasync, the objects written since the last good sync
/// are not known to be durable (a later sync may succeed without them): they leave the index,
/// counted, and the caller learns which to write again.
#[test]
fn a_failed_sync_drops_what_it_should_have_made_durable() {
    let r = rig("syncdrop", "pread");
    let keys = r.keys(6);
    r.store(&keys[..3]);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys[..3]), 3);
    r.tier.sync().unwrap();
    r.store(&keys[3..]);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys[3..]), 3);
    r.fault.store(Fault::SyncEio as u32, Ordering::Relaxed);
    let (_, mut dropped) = r.tier.sync().unwrap_err();
    dropped.sort();
    let mut want = keys[3..].to_vec();
    want.sort();
    assert_eq!(
        dropped, want,
        "exactly the objects written since the good sync"
    );
    assert!(
        keys[..3].iter().all(|k| r.tier.contains(k)),
        "synced ones stay"
    );
    assert!(keys[3..].iter().all(|k| !r.tier.contains(k)));
    assert_eq!(r.tier.status().errors, 3);
    // Written again, they count once the device syncs.
    r.fault.store(Fault::None as u32, Ordering::Relaxed);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys[3..]), 3);
    r.tier.sync().unwrap();
    assert!(keys.iter().all(|k| r.tier.contains(k)));
    r.check_clean();
}

/// Issue 10, defect 6: an object stored again while its older L2 entry is still busy (being
/// loaded, and dropped meanwhile) was neither written nor counted; it is now written once the
/// older entry is gone.
#[test]
fn a_store_that_meets_a_busy_older_entry_is_written_later() {
    use crate::storage::{Dtype, Layout};
    let r = rig("deferred", "pread");
    let keys = r.keys(1);
    let a = Layout::new(vec![2, 2, 16, 256], Dtype::Float32).unwrap();
    let b = Layout::new(vec![2, 2, 16, 512], Dtype::Bfloat16).unwrap();
    r.store_as(&keys, a.fingerprint(), 0xa5);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 1);
    r.drop_l1();
    // A load is in flight on the old copy (pinned) when the object comes back under layout b.
    let pinned = r.tier.pin_for_tests(&keys[0]).expect("on L2");
    r.store_as(&keys, b.fingerprint(), 0x3c);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 0);
    assert!(!r.tier.holds_as(&keys[0], OBJ, b.fingerprint()));
    // The load ends; the writer, idle, tries the deferred key again.
    r.tier.unpin_for_tests(&keys[0], pinned);
    assert_eq!(r.tier.requeue_deferred(), 1);
    assert_eq!(r.tier.queue.len(), 1);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 1);
    assert!(r.tier.holds_as(&keys[0], OBJ, b.fingerprint()));
    r.check_clean();
}

/// Issue 10, defect 6: a slot header may reach the device only after its payload was written
/// completely, so a crash never leaves a header whose payload is missing (recovered, then
/// reported corrupt).
#[test]
fn slot_headers_are_written_after_their_payloads() {
    let r = rig("order", "pread");
    let keys = r.keys(4);
    r.store(&keys);
    r.writes.lock().unwrap().clear();
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 4);
    let batches = r.writes.lock().unwrap().clone();
    let batch_of = |off: u64, len_is_header: bool| {
        batches
            .iter()
            .position(|b| {
                b.iter()
                    .any(|io| io.file_offset == off && (io.len == HEADER) == len_is_header)
            })
            .expect("written")
    };
    let mut payloads = 0;
    for io in batches.iter().flatten().filter(|io| io.len > HEADER) {
        payloads += 1;
        let header_at = io.file_offset - HEADER;
        assert!(
            batch_of(io.file_offset, false) < batch_of(header_at, true),
            "the header at {header_at} went to the device with or before its payload"
        );
    }
    assert_eq!(payloads, 4);
    r.check_clean();
}
