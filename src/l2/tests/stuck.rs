//! A device that stops answering: CLEAR and loads never wait for it; a failing device is
//! left out at start-up.

use super::*;

/// Runs `f` on a thread and waits at most 20 s for it; if it has not returned by then, lifts
/// `fault` (so the stuck I/O ends and every thread can finish) and fails with `what`.
fn within<T: Send>(fault: &AtomicU32, what: &str, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        s.spawn(move || {
            let _ = tx.send(f());
        });
        match rx.recv_timeout(std::time::Duration::from_secs(20)) {
            Ok(v) => v,
            Err(_) => {
                fault.store(Fault::None as u32, Ordering::Relaxed);
                panic!("{what}");
            }
        }
    })
}

/// Issue 10, defect 3: a write-behind batch stuck in the device must not hold a CLEAR, and a
/// CLEAR must not bar loads: both return while the write is still stuck; the stuck batch,
/// begun before the CLEAR, is never committed after it.
#[test]
fn a_clear_and_loads_never_wait_for_a_stuck_write() {
    both(|engine| {
        let r = rig(&format!("stuckw-{engine}"), engine);
        let keys = r.keys(6);
        r.store(&keys[..3]);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys[..3]), 3);
        r.drop_l1();
        r.store(&keys[3..]);
        r.fault
            .store(Fault::StuckPayloadWrites as u32, Ordering::Relaxed);
        std::thread::scope(|s| {
            let writer = s.spawn(|| r.tier.persist(&r.storage, &r.namespaces, &keys[3..]));
            eventually("the write reaches the device", || {
                !r.tier.stuck_for().is_zero()
            });
            let l = within(&r.fault, "a load waited for a stuck write", || {
                r.tier.load(&r.storage, &keys[..3], 0, None)
            });
            assert_eq!(
                r.unlock(&keys[..3], &l, 0),
                3,
                "loads from the healthy reads"
            );
            within(&r.fault, "CLEAR waited for a stuck write", || {
                r.tier.clear_with(|| r.storage.clear()).unwrap()
            });
            let l = within(&r.fault, "a load after CLEAR waited", || {
                r.tier.load(&r.storage, &keys[..3], 0, None)
            });
            assert!(l.iter().all(Option::is_none), "cleared");
            // The device answers: the batch ends, and commits nothing (it began before CLEAR).
            r.fault.store(Fault::None as u32, Ordering::Relaxed);
            assert_eq!(writer.join().unwrap(), 0);
        });
        assert_eq!(r.tier.status().objects, 0);
        r.check_clean();
    });
}

/// Issue 10, defect 3: a load whose device does not answer costs its request misses after
/// `l2.io_timeout_ms`, not its thread; the worker stuck in the device releases the locks the
/// load took once the device answers; meanwhile later loads miss at once.
#[test]
fn a_load_on_a_stuck_device_misses_in_time_and_releases_its_locks_later() {
    let dir = std::env::temp_dir().join(format!("kvnode-l2unit-{}-stuckr", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let _owner = tempdir::Dir(dir.clone());
    let r = try_open_rig(dir, Fault::None, |c| {
        c.engine = "pread".into();
        c.io_timeout_ms = 200;
    })
    .unwrap();
    let keys = r.keys(3);
    r.store(&keys);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 3);
    r.drop_l1();
    let Rig {
        tier,
        storage,
        fault,
        ..
    } = r;
    let set = crate::l2::L2Set::from_tiers(vec![tier]);
    set.workers().start();
    let stop = std::sync::atomic::AtomicBool::new(false);
    fault.store(Fault::StuckPayloadReads as u32, Ordering::Relaxed);
    std::thread::scope(|s| {
        s.spawn(|| crate::l2::loader::serve(&set, &storage, &stop));
        let l = within(&fault, "a load waited for a stuck device", || {
            set.load(&storage, &keys, 0, None)
        });
        assert!(l.iter().all(Option::is_none));
        assert_eq!(set.status().total.stalled, 3);
        eventually("the tier is marked stuck", || set.tiers()[0].stuck());
        assert!(set.status().total.stuck);
        let l = within(&fault, "a load on a stuck device waited", || {
            set.load(&storage, &keys, 0, None)
        });
        assert!(l.iter().all(Option::is_none));
        assert_eq!(set.status().total.stalled, 6, "missed at once, counted");
        // The device answers: the abandoned load completes and gives its locks back.
        fault.store(Fault::None as u32, Ordering::Relaxed);
        eventually("the abandoned load releases everything", || {
            !set.tiers()[0].stuck()
                && storage.counts().read_locked == 0
                && storage.counts().write_reserved == 0
        });
        let l = set.load(&storage, &keys, 0, None);
        assert!(l.iter().all(Option::is_some), "healthy again");
        let held: Vec<(StorageKey, u64)> =
            keys.iter().zip(&l).map(|(k, l)| (*k, l.unwrap())).collect();
        storage.finish_read(&held, 0);
        stop.store(true, Ordering::Release);
    });
    assert!(storage.memcheck().ok);
    set.check().unwrap();
}

/// Issue 10, defect 6: a device that fails at start-up (its superblock cannot be written) is
/// left out and the node runs on the others, or without L2 when it was the only one; a device
/// holding another program's data still stops the start-up.
#[test]
fn a_failing_device_is_left_out_at_start_up_not_fatal() {
    let (base, _owner) = scratch_dir("failed");
    let (good, bad) = (base.join("good"), base.join("bad"));
    let pool = unit_pool();
    let staging = pool.len() - 2 * STAGING_BYTES;
    let namespaces = Arc::new(Namespaces::default());
    // Engines are made two per device, in device order: the second device's always fail.
    let made = AtomicU32::new(0);
    let p = pool.clone();
    let wrap = move |inner: Box<dyn BlockEngine>| -> Box<dyn BlockEngine> {
        let n = made.fetch_add(1, Ordering::Relaxed);
        let fault = if n >= 2 {
            Fault::EveryWriteEio
        } else {
            Fault::None
        };
        Box::new(FaultyEngine::with_fault(
            inner,
            p.clone(),
            Arc::new(AtomicU32::new(fault as u32)),
        ))
    };
    let cfg = L2Config {
        paths: vec![good.clone(), bad.clone()],
        bytes: 32 << 20,
        engine: "pread".into(),
        ..L2Config::default()
    };
    let set =
        crate::l2::L2Set::open_wrapped(&cfg, pool.clone(), staging, &namespaces, Arc::new(wrap))
            .expect("a failed device does not stop the start-up")
            .expect("one device works");
    assert_eq!(set.tiers().len(), 1);
    let s = set.status();
    assert_eq!(s.failed_devices.len(), 1);
    assert_eq!(s.failed_devices[0].path, bad.display().to_string());
    assert!(
        s.failed_devices[0].error.contains("formatting the L2 tier"),
        "{:?}",
        s.failed_devices
    );
    drop(set);
    // Only the failing device: the node runs without L2.
    let made = AtomicU32::new(0);
    let p = pool.clone();
    let all_fail = move |inner: Box<dyn BlockEngine>| -> Box<dyn BlockEngine> {
        made.fetch_add(1, Ordering::Relaxed);
        Box::new(FaultyEngine::with_fault(
            inner,
            p.clone(),
            Arc::new(AtomicU32::new(Fault::EveryWriteEio as u32)),
        ))
    };
    let only_bad = L2Config {
        paths: vec![bad.clone()],
        ..cfg.clone()
    };
    assert!(crate::l2::L2Set::open_wrapped(
        &only_bad,
        pool.clone(),
        staging,
        &namespaces,
        Arc::new(all_fail)
    )
    .unwrap()
    .is_none());
    // Another program's data is a refusal, whatever the other devices do.
    let foreign = base.join("foreign.img");
    std::fs::write(&foreign, vec![9u8; 4 << 20]).unwrap();
    let refused = L2Config {
        paths: vec![good, foreign],
        ..cfg
    };
    let e = crate::l2::L2Set::open(&refused, pool, staging, &namespaces)
        .err()
        .expect("refused");
    assert!(e.to_string().contains("not a kvnode L2 tier"), "{e}");
}

/// Issue 10, defect 3 ("never hang"), at start-up: a device whose calls stop answering while the
/// node opens it (here its reads, during recovery) is left out after `l2.io_timeout_ms`, and the
/// start-up goes on with the other devices; the opening thread finishes once the device answers.
#[test]
fn a_device_that_stops_answering_at_start_up_is_left_out_in_time() {
    let (base, _owner) = scratch_dir("hung");
    let (good, hung) = (base.join("good"), base.join("hung"));
    let pool = unit_pool();
    let staging = pool.len() - 2 * STAGING_BYTES;
    let namespaces = Arc::new(Namespaces::default());
    let cfg = L2Config {
        paths: vec![good.clone(), hung.clone()],
        bytes: 32 << 20,
        engine: "pread".into(),
        io_timeout_ms: 300,
        ..L2Config::default()
    };
    // First run: the second device gets objects (so that recovering it reads slot headers after
    // its extent headers).
    {
        let r = open_rig(hung.clone(), "pread", 1024, Fault::None);
        let keys = r.keys(8);
        r.store(&keys);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 8);
        r.tier.sync().unwrap();
    }
    // Second run: the second device's engines (made third and fourth) stop answering reads.
    let made = Arc::new(AtomicU32::new(0));
    let stuck = Arc::new(AtomicU32::new(Fault::StuckAllReads as u32));
    let hung_reads = Arc::new(AtomicU32::new(0));
    let (p, m, f, r) = (
        pool.clone(),
        made.clone(),
        stuck.clone(),
        hung_reads.clone(),
    );
    let wrap: crate::l2::set::Wrap = Arc::new(move |inner| -> Box<dyn BlockEngine> {
        let n = m.fetch_add(1, Ordering::Relaxed);
        let (fault, reads) = if n >= 2 {
            (f.clone(), r.clone())
        } else {
            (
                Arc::new(AtomicU32::new(Fault::None as u32)),
                Default::default(),
            )
        };
        Box::new(FaultyEngine {
            reads,
            ..FaultyEngine::with_fault(inner, p.clone(), fault)
        })
    });
    let set = within(&stuck, "a start-up past a stuck device", || {
        crate::l2::L2Set::open_wrapped(&cfg, pool.clone(), staging, &namespaces, wrap)
    })
    .expect("a stuck device does not stop the start-up")
    .expect("the other device works");
    assert_eq!(set.tiers().len(), 1);
    let s = set.status();
    assert_eq!(s.failed_devices.len(), 1, "{:?}", s.failed_devices);
    assert_eq!(s.failed_devices[0].path, hung.display().to_string());
    assert!(
        s.failed_devices[0].error.contains("did not answer"),
        "{:?}",
        s.failed_devices
    );
    // The device answers again: the thread that opened it finishes and lets the file go,
    // without another read or write (its staging blocks may serve clients by now).
    let reads_when_left_out = hung_reads.load(Ordering::Relaxed);
    stuck.store(Fault::None as u32, Ordering::Relaxed);
    drop(set);
    eventually("the stuck opening released the device", || {
        let only = L2Config {
            paths: vec![hung.clone()],
            ..cfg.clone()
        };
        crate::l2::L2Set::open(&only, pool.clone(), staging, &namespaces).is_ok_and(|s| s.is_some())
    });
    assert_eq!(
        hung_reads.load(Ordering::Relaxed),
        reads_when_left_out,
        "the abandoned opening kept reading"
    );
}
