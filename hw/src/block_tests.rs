//! Tests for the block engines; every scenario runs against both engines.

use std::path::PathBuf;
use std::sync::Arc;

use crate::uring::UringEngine;
use crate::{
    open_direct, open_engine, BlockEngine, BlockIo, EngineKind, HwError, PagePreference,
    PoolOptions, PreadEngine, SharedPool,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn pool(bytes: u64) -> Arc<SharedPool> {
    Arc::new(
        SharedPool::create(&PoolOptions {
            bytes,
            prefer: PagePreference::Pages4K,
            prefault: true,
            name: "kvnode-hw-block-test".into(),
            posix_shm_name: None,
            segment_bind_mount: false,
            cancel: None,
        })
        .expect("pool"),
    )
}

struct TempDir(PathBuf);
impl TempDir {
    fn new(parent: &std::path::Path, tag: &str) -> TempDir {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let p = parent.join(format!(
            "kvnode-hw-block-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Builds one engine of `kind` on a fresh data file; `None` (with a message)
/// if O_DIRECT is not possible in `parent`.
fn engine(
    kind: EngineKind,
    parent: &std::path::Path,
    pool: &Arc<SharedPool>,
    size: u64,
) -> Option<(TempDir, Box<dyn BlockEngine>)> {
    let dir = TempDir::new(parent, kind.as_str());
    let file = match open_direct(&dir.0.join("data"), size) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("skipping: O_DIRECT data file in {parent:?} failed: {e}");
            return None;
        }
    };
    let e: Box<dyn BlockEngine> = match kind {
        EngineKind::Uring => Box::new(UringEngine::new(pool.clone(), file, 32, false).unwrap()),
        EngineKind::Pread => Box::new(PreadEngine::new(pool.clone(), file, 4).unwrap()),
    };
    assert_eq!(e.kind(), kind);
    Some((dir, e))
}

fn pattern(seed: u64, len: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(0x9e37_79b9) ^ (i >> 12)) as u8)
        .collect()
}

fn all_ok(res: &[crate::HwResult<u64>], ios: &[BlockIo]) {
    assert_eq!(res.len(), ios.len());
    for (r, io) in res.iter().zip(ios) {
        match r {
            Ok(n) => assert_eq!(*n, io.len),
            Err(e) => panic!("{io:?}: {e}"),
        }
    }
}

/// Writes patterns from the pool to the file, clears the pool, reads them
/// back (to different pool offsets), compares.
fn roundtrip(e: &dyn BlockEngine, p: &SharedPool, ios: &[BlockIo], read_shift: u64) {
    let r = p.region();
    for (i, io) in ios.iter().enumerate() {
        r.write_at(io.pool_offset, &pattern(i as u64, io.len))
            .unwrap();
    }
    all_ok(&e.write_batch(ios), ios);
    e.sync().unwrap();
    for io in ios {
        r.fill_at(io.pool_offset, io.len, 0).unwrap();
    }
    let back: Vec<BlockIo> = ios
        .iter()
        .map(|io| BlockIo {
            pool_offset: (io.pool_offset + read_shift) % p.len(),
            ..*io
        })
        .collect();
    all_ok(&e.read_batch(&back), &back);
    for (i, io) in back.iter().enumerate() {
        let mut got = vec![0u8; io.len as usize];
        r.read_at(io.pool_offset, &mut got).unwrap();
        assert!(
            got == pattern(i as u64, io.len),
            "mismatch in I/O {i} {io:?}"
        );
    }
}

fn both(f: impl Fn(EngineKind)) {
    for k in [EngineKind::Uring, EngineKind::Pread] {
        eprintln!("engine {k}");
        f(k);
    }
}

#[test]
fn large_and_small_roundtrip() {
    both(|k| {
        let p = pool(32 * MIB);
        let Some((_d, e)) = engine(k, &std::env::temp_dir(), &p, 64 * MIB) else {
            return;
        };
        let ios = [
            BlockIo {
                pool_offset: 0,
                file_offset: 8 * MIB,
                len: 4 * MIB,
            },
            BlockIo {
                pool_offset: 4 * MIB,
                file_offset: 0,
                len: 4 * KIB,
            },
            BlockIo {
                pool_offset: 5 * MIB,
                file_offset: 60 * MIB,
                len: 4 * MIB,
            },
            BlockIo {
                pool_offset: 10 * MIB + 4 * KIB,
                file_offset: 33 * MIB + 4 * KIB,
                len: 12 * KIB,
            },
        ];
        roundtrip(&*e, &p, &ios, 16 * MIB);
    });
}

#[test]
fn batch_of_64() {
    both(|k| {
        let p = pool(16 * MIB);
        let Some((_d, e)) = engine(k, &std::env::temp_dir(), &p, 32 * MIB) else {
            return;
        };
        // Mixed sizes, file offsets in reverse order of pool offsets.
        let ios: Vec<BlockIo> = (0..64u64)
            .map(|i| BlockIo {
                pool_offset: i * 64 * KIB,
                file_offset: (63 - i) * 128 * KIB,
                len: if i % 2 == 0 { 4 * KIB } else { 64 * KIB },
            })
            .collect();
        roundtrip(&*e, &p, &ios, 8 * MIB);
    });
}

#[test]
fn uring_io_spanning_registered_pieces() {
    let p = pool(16 * MIB);
    let dir = TempDir::new(&std::env::temp_dir(), "pieces");
    let Ok(file) = open_direct(&dir.0.join("data"), 16 * MIB) else {
        eprintln!("skipping: no O_DIRECT in temp dir");
        return;
    };
    // 1 MiB pieces: the 4 MiB I/O at 0.5 MiB spans five of them; qd 2
    // forces the engine to queue.
    let e = UringEngine::with_piece(p.clone(), file, 2, false, MIB).unwrap();
    let ios = [
        BlockIo {
            pool_offset: MIB / 2,
            file_offset: 0,
            len: 4 * MIB,
        },
        BlockIo {
            pool_offset: 6 * MIB - 4 * KIB,
            file_offset: 4 * MIB,
            len: 8 * KIB,
        },
    ];
    roundtrip(&e, &p, &ios, 8 * MIB);
}

#[test]
fn invalid_ios_are_rejected_without_io() {
    both(|k| {
        let p = pool(4 * MIB);
        let Some((_d, e)) = engine(k, &std::env::temp_dir(), &p, 4 * MIB) else {
            return;
        };
        let bad = [
            BlockIo {
                pool_offset: 1,
                file_offset: 0,
                len: 4 * KIB,
            },
            BlockIo {
                pool_offset: 0,
                file_offset: 512,
                len: 4 * KIB,
            },
            BlockIo {
                pool_offset: 0,
                file_offset: 0,
                len: 100,
            },
            BlockIo {
                pool_offset: 0,
                file_offset: 0,
                len: 0,
            },
            BlockIo {
                pool_offset: 4 * MIB,
                file_offset: 0,
                len: 4 * KIB,
            },
            BlockIo {
                pool_offset: 4 * MIB - 4 * KIB,
                file_offset: 0,
                len: 8 * KIB,
            },
            BlockIo {
                pool_offset: u64::MAX - 4095,
                file_offset: 0,
                len: 4 * KIB,
            },
            BlockIo {
                pool_offset: 0,
                file_offset: u64::MAX - 4095,
                len: 4 * KIB,
            },
        ];
        // Marker bytes in the file must stay untouched by the rejected writes.
        p.region().write_at(0, &[7u8; 4096]).unwrap();
        all_ok(&e.write_batch(&bad[..0]), &[]);
        let ok = BlockIo {
            pool_offset: 0,
            file_offset: 0,
            len: 4 * KIB,
        };
        all_ok(&e.write_batch(&[ok]), &[ok]);
        p.region().fill_at(0, 8 * KIB, 9).unwrap();
        for res in [e.write_batch(&bad), e.read_batch(&bad)] {
            assert_eq!(res.len(), bad.len());
            for (i, r) in res.iter().enumerate() {
                match (i, r) {
                    (0..=3 | 7, Err(HwError::Invalid(_))) => {}
                    (4..=6, Err(HwError::OutOfBounds { .. })) => {}
                    _ => panic!("I/O {i} {:?}: unexpected {r:?}", bad[i]),
                }
            }
        }
        // Nothing reached the pool or the file.
        let mut buf = vec![0u8; 8192];
        p.region().read_at(0, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 9));
        // A mixed batch: the valid I/O still runs.
        let mixed = [bad[0], ok];
        let res = e.read_batch(&mixed);
        assert!(matches!(res[0], Err(HwError::Invalid(_))));
        assert_eq!(res[1].as_ref().unwrap(), &(4 * KIB));
        p.region().read_at(0, &mut buf[..4096]).unwrap();
        assert!(buf[..4096].iter().all(|&b| b == 7));
    });
}

#[test]
fn read_past_eof_is_unexpected_eof_error() {
    both(|k| {
        let p = pool(4 * MIB);
        let Some((_d, e)) = engine(k, &std::env::temp_dir(), &p, MIB) else {
            return;
        };
        let ios = [
            // Entirely past EOF.
            BlockIo {
                pool_offset: 0,
                file_offset: 2 * MIB,
                len: 4 * KIB,
            },
            // Straddles EOF: short read, then 0 on the remainder.
            BlockIo {
                pool_offset: MIB,
                file_offset: MIB - 4 * KIB,
                len: 8 * KIB,
            },
            // Inside the file: fine.
            BlockIo {
                pool_offset: 2 * MIB,
                file_offset: 0,
                len: 4 * KIB,
            },
        ];
        let res = e.read_batch(&ios);
        for r in &res[..2] {
            match r {
                Err(HwError::Os { source, .. }) => {
                    assert_eq!(source.kind(), std::io::ErrorKind::UnexpectedEof)
                }
                other => panic!("expected EOF error, got {other:?}"),
            }
        }
        assert_eq!(res[2].as_ref().unwrap(), &(4 * KIB));
    });
}

#[test]
fn os_errors_are_per_io() {
    // Writing at 1 PiB exceeds ext4's maximum file size (EFBIG) (tmpfs
    // would accept it sparsely, so this runs in the ext4 temp dir).
    both(|k| {
        let p = pool(4 * MIB);
        let Some((_d, e)) = engine(k, &std::env::temp_dir(), &p, MIB) else {
            return;
        };
        let ios = [
            BlockIo {
                pool_offset: 0,
                file_offset: 1 << 50,
                len: 4 * KIB,
            },
            BlockIo {
                pool_offset: 4 * KIB,
                file_offset: 0,
                len: 4 * KIB,
            },
        ];
        let res = e.write_batch(&ios);
        match &res[0] {
            Err(err @ HwError::Os { .. }) => {
                eprintln!("{k}: write at 1 PiB -> {err}");
                assert!(err.raw_os_error().is_some());
            }
            other => panic!("expected an OS error, got {other:?}"),
        }
        assert_eq!(res[1].as_ref().unwrap(), &(4 * KIB));
    });
}

#[test]
fn dev_shm_roundtrip_and_enospc() {
    let shm = std::path::Path::new("/dev/shm");
    both(|k| {
        let p = pool(8 * MIB);
        let Some((d, e)) = engine(k, shm, &p, 8 * MIB) else {
            return;
        };
        let ios = [BlockIo {
            pool_offset: 0,
            file_offset: 4 * MIB,
            len: 4 * MIB,
        }];
        roundtrip(&*e, &p, &ios, 4 * MIB);
        // ENOSPC: reserving far more than tmpfs can hold fails cleanly.
        match open_direct(&d.0.join("huge"), 1 << 50) {
            Err(err) => {
                eprintln!("{k}: huge fallocate on /dev/shm -> {err}");
                assert!(matches!(
                    err.raw_os_error(),
                    Some(libc::ENOSPC) | Some(libc::EFBIG)
                ));
            }
            Ok(_) => panic!("1 PiB fallocate on /dev/shm succeeded"),
        }
    });
}

#[test]
fn open_direct_sizes_and_open_engine() {
    let dir = TempDir::new(&std::env::temp_dir(), "open");
    let path = dir.0.join("data");
    assert!(matches!(open_direct(&path, 100), Err(HwError::Invalid(_))));
    let Ok(f) = open_direct(&path, 2 * MIB) else {
        eprintln!("skipping: no O_DIRECT in temp dir");
        return;
    };
    assert_eq!(f.metadata().unwrap().len(), 2 * MIB);
    drop(f);
    // A smaller size than the existing file is refused, never truncated.
    assert!(matches!(open_direct(&path, MIB), Err(HwError::Invalid(_))));
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 2 * MIB);
    let p = pool(2 * MIB);
    for (kind, want) in [
        (None, EngineKind::Uring),
        (Some(EngineKind::Uring), EngineKind::Uring),
        (Some(EngineKind::Pread), EngineKind::Pread),
    ] {
        let f = open_direct(&path, 2 * MIB).unwrap();
        let e = open_engine(kind, p.clone(), f, 8).unwrap();
        assert_eq!(e.kind(), want);
    }
    assert_eq!(EngineKind::Uring.as_str(), "uring");
    assert_eq!(EngineKind::Pread.to_string(), "pread");
    assert!(matches!(
        UringEngine::new(p.clone(), open_direct(&path, 2 * MIB).unwrap(), 0, false),
        Err(HwError::Invalid(_))
    ));
}

#[test]
fn uring_sqpoll_roundtrip() {
    let p = pool(8 * MIB);
    let dir = TempDir::new(&std::env::temp_dir(), "sqpoll");
    let Ok(file) = open_direct(&dir.0.join("data"), 8 * MIB) else {
        eprintln!("skipping: no O_DIRECT in temp dir");
        return;
    };
    let e = match UringEngine::new(p.clone(), file, 8, true) {
        Ok(e) => e,
        Err(err) => {
            eprintln!("skipping: SQPOLL unavailable: {err}");
            return;
        }
    };
    let ios: Vec<BlockIo> = (0..16u64)
        .map(|i| BlockIo {
            pool_offset: i * 256 * KIB,
            file_offset: (15 - i) * 256 * KIB,
            len: 256 * KIB,
        })
        .collect();
    roundtrip(&e, &p, &ios, 4 * MIB);
}

#[test]
fn concurrent_batches_from_threads() {
    both(|k| {
        let p = pool(16 * MIB);
        let Some((_d, e)) = engine(k, &std::env::temp_dir(), &p, 16 * MIB) else {
            return;
        };
        let e: Arc<dyn BlockEngine> = Arc::from(e);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let e = e.clone();
                let p = p.clone();
                s.spawn(move || {
                    let ios: Vec<BlockIo> = (0..8u64)
                        .map(|i| BlockIo {
                            pool_offset: t * 2 * MIB + i * 128 * KIB,
                            file_offset: t * 4 * MIB + i * 128 * KIB,
                            len: 128 * KIB,
                        })
                        .collect();
                    roundtrip(&*e, &p, &ios, 0);
                });
            }
        });
    });
}

#[test]
fn read_batch_then_calls_back_once_per_completed_io_with_the_data_in_place() {
    both(|k| {
        let p = pool(16 * MIB);
        let Some((_d, e)) = engine(k, &std::env::temp_dir(), &p, 16 * MIB) else {
            return;
        };
        let ios: Vec<BlockIo> = (0..12u64)
            .map(|i| BlockIo {
                pool_offset: i * 256 * KIB,
                file_offset: i * 256 * KIB,
                len: 256 * KIB,
            })
            .collect();
        let r = p.region();
        for (i, io) in ios.iter().enumerate() {
            r.write_at(io.pool_offset, &pattern(i as u64, io.len))
                .unwrap();
        }
        all_ok(&e.write_batch(&ios), &ios);
        for io in &ios {
            r.fill_at(io.pool_offset, io.len, 0).unwrap();
        }
        // One I/O reads past the end of the file: it fails and gets no callback.
        let mut back = ios.clone();
        back.push(BlockIo {
            pool_offset: 12 * 256 * KIB,
            file_offset: 16 * MIB - 4096,
            len: 8192,
        });
        let seen: Vec<std::sync::atomic::AtomicU32> =
            (0..back.len()).map(|_| Default::default()).collect();
        let intact: Vec<std::sync::atomic::AtomicBool> =
            (0..back.len()).map(|_| Default::default()).collect();
        let res = e.read_batch_then(&back, &|i| {
            seen[i].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let io = back[i];
            let mut got = vec![0u8; io.len as usize];
            r.read_at(io.pool_offset, &mut got).unwrap();
            intact[i].store(
                got == pattern(i as u64, io.len),
                std::sync::atomic::Ordering::Relaxed,
            );
        });
        for i in 0..12 {
            assert!(res[i].is_ok());
            assert_eq!(
                seen[i].load(std::sync::atomic::Ordering::Relaxed),
                1,
                "I/O {i}"
            );
            assert!(
                intact[i].load(std::sync::atomic::Ordering::Relaxed),
                "I/O {i} data in place"
            );
        }
        assert!(res[12].is_err());
        assert_eq!(seen[12].load(std::sync::atomic::Ordering::Relaxed), 0);
    });
}

#[test]
fn uring_with_several_rings_runs_batches_from_threads_side_by_side() {
    let p = pool(16 * MIB);
    let dir = TempDir::new(&std::env::temp_dir(), "rings");
    let Ok(file) = open_direct(&dir.0.join("data"), 16 * MIB) else {
        eprintln!("skipping: no O_DIRECT in the temp dir");
        return;
    };
    let e = UringEngine::with_rings(p.clone(), file, 8, false, 3).unwrap();
    assert_eq!(e.ring_count(), 3);
    // Four threads, each with its own 4 MiB of pool and file: every byte comes back.
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (e, p) = (&e, &p);
            s.spawn(move || {
                let ios: Vec<BlockIo> = (0..8u64)
                    .map(|i| BlockIo {
                        pool_offset: t * 4 * MIB + i * 512 * KIB,
                        file_offset: t * 4 * MIB + i * 512 * KIB,
                        len: 512 * KIB,
                    })
                    .collect();
                roundtrip(e, p, &ios, 0);
            });
        }
    });
}

#[test]
fn lock_exclusive_refuses_a_held_lock_and_waits_for_its_release() {
    let dir = TempDir::new(&std::env::temp_dir(), "lock");
    let path = dir.0.join("data");
    let open = || {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .unwrap()
    };
    // Two open file descriptions conflict even within one process.
    let holder = open();
    crate::lock_exclusive(&holder, std::time::Duration::ZERO).unwrap();
    let second = open();
    let err = crate::lock_exclusive(&second, std::time::Duration::ZERO).unwrap_err();
    match err {
        HwError::Os { op, source } => {
            assert_eq!(op, "flock");
            assert_eq!(source.raw_os_error(), Some(libc::EWOULDBLOCK));
        }
        other => panic!("unexpected {other:?}"),
    }
    // Released while the second waits (the way a crashed node's files close once
    // its in-flight I/O has finished): the waiter gets the lock.
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        drop(holder);
    });
    crate::lock_exclusive(&second, std::time::Duration::from_secs(60)).unwrap();
    releaser.join().unwrap();
    let third = open();
    assert!(crate::lock_exclusive(&third, std::time::Duration::ZERO).is_err());
}
