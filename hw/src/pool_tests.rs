use super::*;
use crate::segment_mount::{HugeFs, PrivateHugeFile};
use crate::{hugepage_test_lock, PoolMapping};
use std::os::unix::fs::{MetadataExt, PermissionsExt};

const MIB: u64 = 1 << 20;

fn opts(bytes: u64, prefer: PagePreference) -> PoolOptions {
    PoolOptions {
        bytes,
        prefer,
        prefault: true,
        name: "kvnode-hw-test".into(),
        posix_shm_name: None,
        segment_bind_mount: false,
        cancel: None,
    }
}

fn unique_shm_name(tag: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "kvnode-hw-test-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// What `create` must report (`Err(list)` = any of these is acceptable).
fn expected(prefer: PagePreference, bytes: u64) -> Result<PoolBacking, Vec<PoolBacking>> {
    let thp = if sys::memfd_thp_active() {
        PoolBacking::Thp
    } else {
        PoolBacking::Pages4K
    };
    let hugetlb = |b: PoolBacking, dir: &str| -> Option<Result<PoolBacking, ()>> {
        let need = round_up(bytes, b.page_bytes()).unwrap() / b.page_bytes();
        let avail = sys::hugepages_available(dir).unwrap_or(0);
        let overcommit = sys::read_u64(&format!(
            "/proc/sys/vm/nr_overcommit_hugepages{}",
            if b == PoolBacking::Hugetlb1G {
                "-none"
            } else {
                ""
            }
        ))
        .unwrap_or(0);
        if avail >= need {
            Some(Ok(b))
        } else if overcommit == 0 {
            None
        } else {
            Some(Err(()))
        }
    };
    match prefer {
        PagePreference::Pages4K => Ok(PoolBacking::Pages4K),
        PagePreference::Thp => Ok(thp),
        PagePreference::Huge2M => match hugetlb(PoolBacking::Hugetlb2M, sys::HUGE_2M_DIR) {
            Some(Ok(b)) => Ok(b),
            None => Ok(thp),
            Some(Err(())) => Err(vec![PoolBacking::Hugetlb2M, thp]),
        },
        PagePreference::Huge1G => match hugetlb(PoolBacking::Hugetlb1G, sys::HUGE_1G_DIR) {
            Some(Ok(b)) => Ok(b),
            // 1G pages are never overcommitted in practice; fall through.
            _ => match expected(PagePreference::Huge2M, bytes) {
                Ok(b) => Ok(b),
                Err(mut v) => {
                    v.push(PoolBacking::Hugetlb1G);
                    Err(v)
                }
            },
        },
    }
}

/// Checks the SharedPool invariants and a data round trip.
fn check_pool(pool: &SharedPool, requested: u64) {
    let b = pool.backing();
    let gran = if b == PoolBacking::Hugetlb1G {
        GIB
    } else {
        2 * MIB
    };
    assert_eq!(pool.len(), round_up(requested, gran).unwrap());
    assert_eq!(pool.len() % (2 * MIB), 0);
    assert!(!pool.is_empty());
    let base = pool.region().as_ptr() as usize as u64;
    assert_eq!(
        base % b.page_bytes().max(2 * MIB),
        0,
        "base {base:#x} for {b}"
    );
    let fd_len = File::from(pool.fd().try_clone_to_owned().unwrap())
        .metadata()
        .unwrap()
        .len();
    assert_eq!(fd_len, pool.len());

    let r = pool.region();
    assert_eq!(r.len(), pool.len());
    let msg = b"kv-cache block payload";
    r.write_at(0, msg).unwrap();
    r.write_at(r.len() - msg.len() as u64, msg).unwrap();
    let mut got = vec![0u8; msg.len()];
    r.read_at(0, &mut got).unwrap();
    assert_eq!(&got, msg);
    r.read_at(r.len() - msg.len() as u64, &mut got).unwrap();
    assert_eq!(&got, msg);
    r.fill_at(100, 50, 0xAB).unwrap();
    let mut f = [0u8; 52];
    r.read_at(99, &mut f).unwrap();
    assert_eq!(f[0], 0);
    assert!(f[1..51].iter().all(|&x| x == 0xAB));
    assert_eq!(f[51], 0);
}

#[test]
fn each_preference_16mib() {
    let _g = hugepage_test_lock();
    for prefer in [
        PagePreference::Huge1G,
        PagePreference::Huge2M,
        PagePreference::Thp,
        PagePreference::Pages4K,
    ] {
        let want = expected(prefer, 16 * MIB);
        let pool = SharedPool::create(&opts(16 * MIB, prefer)).unwrap();
        match &want {
            Ok(b) => assert_eq!(pool.backing(), *b, "prefer {prefer:?}"),
            Err(any) => assert!(any.contains(&pool.backing()), "prefer {prefer:?}"),
        }
        eprintln!("prefer {prefer:?} -> {}", pool.backing());
        check_pool(&pool, 16 * MIB);
    }
}

#[test]
fn rounding_and_no_prefault() {
    for (req, want) in [(1, 2 * MIB), (2 * MIB, 2 * MIB), (2 * MIB + 1, 4 * MIB)] {
        for prefault in [false, true] {
            let mut o = opts(req, PagePreference::Pages4K);
            o.prefault = prefault;
            let pool = SharedPool::create(&o).unwrap();
            assert_eq!(pool.len(), want);
            assert_eq!(pool.backing(), PoolBacking::Pages4K);
            check_pool(&pool, req);
        }
    }
}

#[test]
fn invalid_options() {
    let err = |o: PoolOptions| SharedPool::create(&o).unwrap_err();
    assert!(matches!(
        err(opts(0, PagePreference::Huge2M)),
        HwError::Invalid(_)
    ));
    assert!(matches!(
        err(opts(u64::MAX, PagePreference::Huge1G)),
        HwError::Invalid(_)
    ));
    assert!(matches!(
        err(opts(u64::MAX - 5, PagePreference::Pages4K)),
        HwError::Invalid(_)
    ));
    let mut o = opts(MIB, PagePreference::Pages4K);
    o.name = "a\0b".into();
    assert!(matches!(err(o.clone()), HwError::Invalid(_)));
    o.name = "x".repeat(300);
    assert!(matches!(err(o.clone()), HwError::Invalid(_)));
    for bad in ["", "a/b", "..", "x\0y"] {
        o.name = "ok".into();
        o.posix_shm_name = Some(bad.into());
        assert!(matches!(err(o.clone()), HwError::Invalid(_)), "{bad:?}");
    }
}

#[test]
fn out_of_bounds_never_panics() {
    let pool = SharedPool::create(&opts(MIB, PagePreference::Pages4K)).unwrap();
    let r = pool.region();
    let len = r.len();
    let oob = |e: HwError, o: u64, l: u64| match e {
        HwError::OutOfBounds {
            offset,
            len: el,
            pool_len,
        } => {
            assert_eq!((offset, el, pool_len), (o, l, len));
        }
        other => panic!("expected OutOfBounds, got {other}"),
    };
    r.write_at(len, &[]).unwrap();
    r.read_at(len, &mut []).unwrap();
    r.fill_at(len, 0, 1).unwrap();
    oob(r.write_at(len, &[1]).unwrap_err(), len, 1);
    oob(r.write_at(len - 1, &[1, 2]).unwrap_err(), len - 1, 2);
    oob(r.write_at(len + 1, &[]).unwrap_err(), len + 1, 0);
    oob(r.write_at(u64::MAX, &[1]).unwrap_err(), u64::MAX, 1);
    oob(
        r.write_at(u64::MAX - 1, &[1, 2, 3]).unwrap_err(),
        u64::MAX - 1,
        3,
    );
    let mut buf = [7u8; 4];
    oob(
        r.read_at(u64::MAX - 2, &mut buf).unwrap_err(),
        u64::MAX - 2,
        4,
    );
    oob(r.read_at(len - 3, &mut buf).unwrap_err(), len - 3, 4);
    assert_eq!(buf, [7; 4], "dst untouched on error");
    oob(r.fill_at(0, u64::MAX, 1).unwrap_err(), 0, u64::MAX);
    oob(
        r.fill_at(u64::MAX, u64::MAX, 1).unwrap_err(),
        u64::MAX,
        u64::MAX,
    );
    oob(r.fill_at(1, len, 1).unwrap_err(), 1, len);
    // Nothing was written by the failed calls.
    let mut tail = [9u8; 8];
    r.read_at(len - 8, &mut tail).unwrap();
    assert_eq!(tail, [0; 8]);
    assert!(HwError::OutOfBounds {
        offset: 1,
        len: 2,
        pool_len: 3
    }
    .to_string()
    .contains("offset 1 + len 2 > pool 3"));
}

#[test]
fn send_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<SharedPool>();
    assert_send_sync::<PoolRegion>();
    assert_send_sync::<PoolMapping>();
}

#[test]
fn backing_names() {
    use PoolBacking::*;
    let all = [Hugetlb1G, Hugetlb2M, Thp, Pages4K];
    let names: Vec<_> = all.iter().map(|b| b.as_str()).collect();
    assert_eq!(names, ["hugetlb-1g", "hugetlb-2m", "thp", "4k"]);
    let sizes: Vec<_> = all.iter().map(|b| b.page_bytes()).collect();
    assert_eq!(sizes, [1 << 30, 2 << 20, 2 << 20, 4096]);
    assert_eq!(PagePreference::default(), PagePreference::Huge2M);
    let d = PoolOptions::default();
    assert_eq!(
        (
            d.bytes,
            d.prefer,
            d.prefault,
            d.name.as_str(),
            d.posix_shm_name
        ),
        (GIB, PagePreference::Huge2M, true, "kvnode-pool", None)
    );
}

#[test]
fn second_mapping_shares_memory() {
    let pool = SharedPool::create(&opts(4 * MIB, PagePreference::Thp)).unwrap();
    let fd = pool.fd().try_clone_to_owned().unwrap();
    let m = PoolMapping::from_fd(fd, pool.len()).unwrap();
    assert_eq!(m.region().len(), pool.len());
    assert_ne!(m.region().as_ptr(), pool.region().as_ptr());
    m.region().write_at(4096 * 3 + 7, b"from client").unwrap();
    let mut got = [0u8; 11];
    pool.region().read_at(4096 * 3 + 7, &mut got).unwrap();
    assert_eq!(&got, b"from client");
    pool.region().write_at(0, b"node").unwrap();
    let mut got = [0u8; 4];
    m.region().read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"node");
    // A partial view (length not page aligned) is bounds-checked to its len.
    let part = PoolMapping::from_fd(pool.fd().try_clone_to_owned().unwrap(), 5000).unwrap();
    assert_eq!(part.region().len(), 5000);
    assert!(part.region().write_at(4999, &[1, 2]).is_err());
    // Too long / zero length.
    let fd = pool.fd().try_clone_to_owned().unwrap();
    assert!(matches!(
        PoolMapping::from_fd(fd, pool.len() + 1),
        Err(HwError::Invalid(_))
    ));
    let fd = pool.fd().try_clone_to_owned().unwrap();
    assert!(matches!(
        PoolMapping::from_fd(fd, 0),
        Err(HwError::Invalid(_))
    ));
}

#[test]
fn posix_shm_pool() {
    let _g = hugepage_test_lock();
    let name = unique_shm_name("shm");
    let path = format!("/dev/shm/{name}");
    // A stale segment of the same name is replaced.
    std::fs::write(&path, b"stale").unwrap();
    let mut o = opts(3 * MIB, PagePreference::Huge2M);
    o.posix_shm_name = Some(name.clone());
    let pool = SharedPool::create(&o).unwrap();
    assert!(
        backing_as_expected(&pool, PagePreference::Huge2M, 3 * MIB, false),
        "{:?}: {}",
        pool.backing(),
        pool.backing_detail()
    );
    assert_eq!(pool.posix_shm_name(), Some(name.as_str()));
    check_pool(&pool, 3 * MIB);
    let md = std::fs::metadata(&path).unwrap();
    assert_eq!(md.permissions().mode() & 0o7777, 0o600);
    assert_eq!(md.len(), 4 * MIB);
    let pool_md = File::from(pool.fd().try_clone_to_owned().unwrap())
        .metadata()
        .unwrap();
    assert_eq!((md.dev(), md.ino()), (pool_md.dev(), pool_md.ino()));

    // A second node asking for the same name is refused while this one holds it, and the
    // segment is left alone (it used to be unlinked under the running node).
    let e = SharedPool::create(&o).unwrap_err().to_string();
    assert!(
        e.contains("in use by a running node") && e.contains(&path),
        "{e}"
    );
    let md2 = std::fs::metadata(&path).unwrap();
    assert_eq!((md2.dev(), md2.ino()), (md.dev(), md.ino()));

    let client = PoolMapping::open_posix_shm(&name, pool.len()).unwrap();
    client.region().write_at(MIB, b"via shm name").unwrap();
    let mut got = [0u8; 12];
    pool.region().read_at(MIB, &mut got).unwrap();
    assert_eq!(&got, b"via shm name");

    drop(client);
    drop(pool);
    assert!(
        !std::path::Path::new(&path).exists(),
        "segment unlinked on drop"
    );
    match PoolMapping::open_posix_shm(&name, MIB) {
        Err(e @ HwError::OsPath { .. }) => {
            assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
            assert!(
                e.to_string().contains(&path),
                "the error names the path: {e}"
            );
        }
        other => panic!("opening a removed segment: {other:?}"),
    }
    assert!(matches!(
        PoolMapping::open_posix_shm("no/slash", MIB),
        Err(HwError::Invalid(_))
    ));
}

#[test]
fn posix_shm_drop_keeps_foreign_segment() {
    let name = unique_shm_name("foreign");
    let path = format!("/dev/shm/{name}");
    let mut o = opts(2 * MIB, PagePreference::Pages4K);
    o.posix_shm_name = Some(name.clone());
    o.prefault = false;
    let first = SharedPool::create(&o).unwrap();
    // Someone else replaces the name by hand (an operator, another program).
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, b"someone else's").unwrap();
    drop(first);
    assert_eq!(
        std::fs::read(&path).unwrap(),
        b"someone else's",
        "a segment the pool did not create is kept"
    );
    // Nobody holds its lock: a new pool treats it as stale and replaces it.
    let second = SharedPool::create(&o).unwrap();
    drop(second);
    assert!(!std::path::Path::new(&path).exists());
}

/// Restores a sysfs knob on drop (also when the test panics); not for `nr_hugepages`, which
/// other processes change concurrently (see [`more_hugepages`]).
struct Restore {
    path: &'static str,
    old: String,
}

impl Drop for Restore {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(self.path, &self.old) {
            eprintln!("failed to restore {}: {e}", self.path);
        }
    }
}

#[test]
fn hugetlb_2m_with_reserved_pages() {
    let _g = hugepage_test_lock();
    let Some(_reservation) = more_hugepages(16) else {
        return;
    };
    let avail = sys::hugepages_available(sys::HUGE_2M_DIR).unwrap_or(0);
    if avail < 8 {
        eprintln!("skip: kernel gave only {avail} free 2M pages");
        return;
    }
    let pool = SharedPool::create(&opts(16 * MIB, PagePreference::Huge2M)).unwrap();
    assert_eq!(pool.backing(), PoolBacking::Hugetlb2M);
    assert_eq!(pool.region().as_ptr() as usize % (2 << 20), 0);
    assert_eq!(pool.len(), 16 * MIB);
    check_pool(&pool, 16 * MIB);
    // Prefaulted: all 8 pages are in use, none merely reserved.
    assert!(sys::hugepages_available(sys::HUGE_2M_DIR).unwrap() + 8 <= avail);

    // Client mapping of a hugetlb fd with a non-hugepage-multiple length.
    let m = PoolMapping::from_fd(pool.fd().try_clone_to_owned().unwrap(), 3 * MIB + 5).unwrap();
    assert_eq!(m.region().len(), 3 * MIB + 5);
    m.region().write_at(3 * MIB - 9, b"hugetlb shared").unwrap();
    let mut got = [0u8; 14];
    pool.region().read_at(3 * MIB - 9, &mut got).unwrap();
    assert_eq!(&got, b"hugetlb shared");
    assert!(m.region().write_at(3 * MIB, &[0; 6]).is_err());
    drop(m);

    // Huge1G falls back to 2M (unless 1G pages happen to be reserved).
    if sys::hugepages_available(sys::HUGE_1G_DIR).unwrap_or(0) == 0 {
        drop(pool);
        let p = SharedPool::create(&opts(4 * MIB, PagePreference::Huge1G)).unwrap();
        assert_eq!(p.backing(), PoolBacking::Hugetlb2M);
        assert_eq!(p.len(), 4 * MIB);
    }
}

/// Size in kB of PMD-mapped shmem in the smaps entry starting at `addr`.
fn shmem_pmd_kb(addr: usize) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let head = format!("{addr:x}-");
    let mut in_entry = false;
    for line in smaps.lines() {
        if line.starts_with(|c: char| c.is_ascii_hexdigit()) && line.contains('-') {
            in_entry = line.starts_with(&head);
        } else if in_entry {
            if let Some(v) = line.strip_prefix("ShmemPmdMapped:") {
                return v.trim().trim_end_matches("kB").trim().parse().ok();
            }
        }
    }
    None
}

#[test]
fn thp_when_shmem_thp_enabled() {
    const KNOB: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
    let _g = hugepage_test_lock();
    let Some(old) = std::fs::read_to_string(KNOB)
        .ok()
        .and_then(|t| sys::selected_value(&t).map(str::to_owned))
    else {
        eprintln!("skip: no {KNOB}");
        return;
    };
    if !sys::memfd_thp_active() {
        if let Err(e) = std::fs::write(KNOB, "advise") {
            eprintln!("skip: cannot enable shmem THP (not root?): {e}");
            return;
        }
    }
    let _restore = Restore { path: KNOB, old };
    if !sys::memfd_thp_active() {
        eprintln!("skip: per-size THP setting keeps shmem THP off");
        return;
    }
    let pool = SharedPool::create(&opts(8 * MIB, PagePreference::Thp)).unwrap();
    assert_eq!(pool.backing(), PoolBacking::Thp);
    check_pool(&pool, 8 * MIB);
    let pmd = shmem_pmd_kb(pool.region().as_ptr() as usize);
    eprintln!("THP pool: ShmemPmdMapped = {pmd:?} kB");
    // 4K preference opts out even with shmem THP on.
    let p4 = SharedPool::create(&opts(4 * MIB, PagePreference::Pages4K)).unwrap();
    assert_eq!(p4.backing(), PoolBacking::Pages4K);
    assert_eq!(shmem_pmd_kb(p4.region().as_ptr() as usize).unwrap_or(0), 0);
}

/// The backings a POSIX shm pool may get here: with the bind-mount opt-in, hugetlb when root
/// with enough free pages (the count may change under other processes, so 2M is only
/// "possible") or THP from a private huge tmpfs when root; THP from /dev/shm when it is
/// mounted huge=; else 4k.
fn expected_shm(prefer: PagePreference, bytes: u64, bind_mount: bool) -> Vec<PoolBacking> {
    let root = bind_mount && crate::peer::effective_uid() == 0;
    let mut v = vec![];
    if root && prefer == PagePreference::Huge2M {
        let need = round_up(bytes, 2 * MIB).unwrap() / (2 * MIB);
        if sys::hugepages_available(sys::HUGE_2M_DIR).unwrap_or(0) >= need {
            v.push(PoolBacking::Hugetlb2M);
        }
    }
    if prefer != PagePreference::Pages4K
        && (sys::dev_shm_thp_active() || (root && !sys::shmem_thp_denied()))
    {
        v.push(PoolBacking::Thp);
    }
    if v.is_empty() {
        v.push(PoolBacking::Pages4K);
    }
    v
}

/// Whether `pool`'s backing is one [`expected_shm`] allows (or 4k because the kernel had no
/// huge pages to give, which the detail then says).
fn backing_as_expected(
    pool: &SharedPool,
    prefer: PagePreference,
    bytes: u64,
    bind_mount: bool,
) -> bool {
    expected_shm(prefer, bytes, bind_mount).contains(&pool.backing())
        || (pool.backing() == PoolBacking::Pages4K
            && pool.backing_detail().contains("THP asked for but only"))
}

/// Removes, on drop, every mount at a test segment's path and the path itself (also when the
/// test fails), so that no test leaves a mount behind.
struct MountGuard(String);

impl Drop for MountGuard {
    fn drop(&mut self) {
        for _ in 0..8 {
            if sys::mounts_at(&self.0).map_or(true, |m| m.is_empty()) {
                break;
            }
            let _ = std::process::Command::new("umount")
                .args(["-l", &self.0])
                .status();
        }
        let _ = std::fs::remove_file(&self.0);
        let _ = std::fs::remove_file(format!("{}.lock", self.0));
    }
}

/// The file every kvnode test process locks (exclusive `flock`) around each read-modify-write
/// of `nr_hugepages` (tests/lmcache_segment.rs uses the same files): with every change relative
/// (add N, later take exactly the N added off), concurrent test processes never drift the
/// host's value. The first one that can be opened is used (`/tmp` when `/run` is not writable).
const HUGEPAGES_LOCK_FILES: [&str; 2] = [
    "/run/kvnode-test-hugepages.lock",
    "/tmp/kvnode-test-hugepages.lock",
];
const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

/// Runs `f` holding the cross-process hugepage lock (without it when no lock file can be
/// opened: then nr_hugepages is not writable either).
fn with_hugepages_lock<R>(f: impl FnOnce() -> R) -> R {
    let file = HUGEPAGES_LOCK_FILES.iter().find_map(|p| {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(p)
            .ok()
    });
    if let Some(file) = &file {
        // Bounded: another test process holds it only around one read-modify-write.
        if let Err(e) = crate::lock_exclusive(file, std::time::Duration::from_secs(600)) {
            eprintln!("cannot lock the hugepage lock file: {e}");
        }
    }
    f()
}

/// `nr_hugepages` raised by `added` pages (what the kernel really added) for the test's
/// duration; on drop exactly those are taken off again, relative to the value then.
struct HugepageReservation {
    added: u64,
}

impl Drop for HugepageReservation {
    fn drop(&mut self) {
        with_hugepages_lock(|| {
            let Some(now) = sys::read_u64(NR_HUGEPAGES) else {
                return;
            };
            let back = now.saturating_sub(self.added);
            if let Err(e) = std::fs::write(NR_HUGEPAGES, back.to_string()) {
                eprintln!("failed to lower {NR_HUGEPAGES} back to {back}: {e}");
            }
        });
    }
}

/// Raises `nr_hugepages` by `more` for the test's duration; `None` (skip) when not root.
fn more_hugepages(more: u64) -> Option<HugepageReservation> {
    with_hugepages_lock(|| {
        let old = sys::read_u64(NR_HUGEPAGES)?;
        if let Err(e) = std::fs::write(NR_HUGEPAGES, (old + more).to_string()) {
            eprintln!("skip: cannot raise nr_hugepages (not root?): {e}");
            return None;
        }
        let now = sys::read_u64(NR_HUGEPAGES).unwrap_or(old);
        Some(HugepageReservation {
            added: now.saturating_sub(old),
        })
    })
}

/// Options for the named segment `name`, with the bind-mount opt-in.
fn shm_opts(name: &str, bytes: u64, prefer: PagePreference) -> PoolOptions {
    let mut o = opts(bytes, prefer);
    o.posix_shm_name = Some(name.to_owned());
    o.segment_bind_mount = true;
    o
}

/// Without the bind-mount opt-in even a root node (with hugetlb pages free) makes no mount:
/// the segment is /dev/shm's own file (THP when /dev/shm is mounted huge=), and on 4 KiB pages
/// its detail names both ways to huge pages.
#[test]
fn without_the_opt_in_a_named_segment_is_never_a_bind_mount() {
    let _g = hugepage_test_lock();
    let _reservation = more_hugepages(8);
    let name = unique_shm_name("no-opt-in");
    let path = format!("/dev/shm/{name}");
    let _guard = MountGuard(path.clone());
    let mut o = shm_opts(&name, 8 * MIB, PagePreference::Huge2M);
    o.segment_bind_mount = false;
    let pool = SharedPool::create(&o).unwrap();
    let detail = pool.backing_detail().to_owned();
    assert!(
        sys::mounts_at(&path).unwrap().is_empty(),
        "no mount: {detail}"
    );
    assert!(
        backing_as_expected(&pool, PagePreference::Huge2M, 8 * MIB, false),
        "{:?}: {detail}",
        pool.backing()
    );
    if pool.backing() == PoolBacking::Pages4K {
        assert!(
            detail.contains("--shm-huge") && detail.contains("--segment-bind-mount"),
            "{detail}"
        );
    }
    let md = std::fs::metadata(&path).unwrap();
    assert_eq!(md.permissions().mode() & 0o7777, 0o600);
    drop(pool);
    assert!(std::fs::symlink_metadata(&path).is_err());
}

/// As root with free hugetlb pages, the named segment is a hugetlbfs file bind-mounted at
/// `/dev/shm/<name>`: a client opening the name by `shm_open` gets 2 MiB pages. Dropping the
/// pool (a client still mapping it) removes the mount, the placeholder and the lock file; the
/// client's mapping stays valid.
#[test]
fn posix_shm_on_hugetlb_pages_is_a_bind_mount_removed_on_drop() {
    let _g = hugepage_test_lock();
    if crate::peer::effective_uid() != 0 {
        eprintln!("skip: not root, so no mounts");
        return;
    }
    let Some(_reservation) = more_hugepages(8) else {
        return;
    };
    if sys::hugepages_available(sys::HUGE_2M_DIR).unwrap_or(0) < 4 {
        eprintln!("skip: the kernel gave no free 2M pages");
        return;
    }
    let name = unique_shm_name("hugetlb");
    let path = format!("/dev/shm/{name}");
    let _guard = MountGuard(path.clone());
    let pool = SharedPool::create(&shm_opts(&name, 8 * MIB, PagePreference::Huge2M)).unwrap();
    assert_eq!(
        pool.backing(),
        PoolBacking::Hugetlb2M,
        "{}",
        pool.backing_detail()
    );
    assert!(
        pool.backing_detail().contains("hugetlbfs pagesize=2M")
            && pool.backing_detail().contains(&path)
            && pool.backing_detail().contains("4 hugetlb pages"),
        "{}",
        pool.backing_detail()
    );
    let mounts = sys::mounts_at(&path).unwrap();
    assert_eq!(mounts.len(), 1, "{mounts:?}");
    assert_eq!(mounts[0].fstype, "hugetlbfs");
    assert!(
        mounts[0].source.starts_with("kvnode-segment-"),
        "{mounts:?}"
    );
    let record = std::fs::read_to_string(format!("{path}.lock")).unwrap();
    assert_eq!(
        record.trim(),
        format!(
            "kvnode-segment-mount {}",
            &mounts[0].source["kvnode-segment-".len()..]
        )
    );

    let client = PoolMapping::open_posix_shm(&name, pool.len()).unwrap();
    let pages = sys::mapping_pages(client.region().as_ptr() as usize).unwrap();
    assert_eq!(
        pages.kernel_page_bytes,
        2 * MIB,
        "the client maps 2 MiB pages"
    );
    client
        .region()
        .write_at(5 * MIB, b"hugetlb by name")
        .unwrap();
    let mut got = [0u8; 15];
    pool.region().read_at(5 * MIB, &mut got).unwrap();
    assert_eq!(&got, b"hugetlb by name");

    drop(pool);
    assert!(sys::mounts_at(&path).unwrap().is_empty(), "unmounted");
    assert!(
        std::fs::symlink_metadata(&path).is_err(),
        "placeholder removed"
    );
    assert!(
        std::fs::symlink_metadata(format!("{path}.lock")).is_err(),
        "lock file removed"
    );
    client.region().read_at(5 * MIB, &mut got).unwrap();
    assert_eq!(
        &got, b"hugetlb by name",
        "the client's mapping outlives the name"
    );
}

/// A node that died leaves its bind mount (and the lock file's record of it); the next pool of
/// that name removes exactly that mount and serves a fresh segment, and leaves nothing behind.
#[test]
fn a_dead_nodes_bind_mount_is_removed_by_the_next_pool_of_its_name() {
    let _g = hugepage_test_lock();
    if crate::peer::effective_uid() != 0 {
        eprintln!("skip: not root, so no mounts");
        return;
    }
    let name = unique_shm_name("stale-mount");
    let path = format!("/dev/shm/{name}");
    let _guard = MountGuard(path.clone());
    // THP from a private tmpfs needs no reservation; hugetlb is the same code path.
    let o = shm_opts(&name, 4 * MIB, PagePreference::Thp);
    let first = SharedPool::create(&o).unwrap();
    if sys::mounts_at(&path).unwrap().is_empty() {
        eprintln!("skip: no mount made ({})", first.backing_detail());
        return;
    }
    let old_source = sys::mounts_at(&path).unwrap()[0].source.clone();
    first.abandon_name();
    assert_eq!(
        sys::mounts_at(&path).unwrap().len(),
        1,
        "the dead node's mount stays"
    );

    let second = SharedPool::create(&o).unwrap();
    let mounts = sys::mounts_at(&path).unwrap();
    assert_eq!(mounts.len(), 1, "{mounts:?}");
    assert_ne!(
        mounts[0].source, old_source,
        "the old mount is gone, a new one serves"
    );
    let client = PoolMapping::open_posix_shm(&name, second.len()).unwrap();
    client.region().write_at(0, b"fresh").unwrap();
    let mut got = [0u8; 5];
    second.region().read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"fresh");
    drop(client);
    drop(second);
    assert!(sys::mounts_at(&path).unwrap().is_empty());
    assert!(std::fs::symlink_metadata(&path).is_err());
}

/// A mount at the segment's path that the name's lock file does not record (someone else's
/// bind mount, or a kvnode-looking one with another token) is refused naming the path, and is
/// left exactly as it was.
#[test]
fn a_mount_kvnode_did_not_make_is_left_alone() {
    let _g = hugepage_test_lock();
    if crate::peer::effective_uid() != 0 {
        eprintln!("skip: not root, so no mounts");
        return;
    }
    let name = unique_shm_name("foreign-mount");
    let path = format!("/dev/shm/{name}");
    let _guard = MountGuard(path.clone());
    let theirs = format!("/dev/shm/{name}-theirs");
    let _theirs_guard = MountGuard(theirs.clone());
    std::fs::write(&theirs, b"someone else's").unwrap();
    std::fs::write(&path, b"").unwrap();
    let ok = std::process::Command::new("mount")
        .args(["--bind", &theirs, &path])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skip: cannot bind-mount");
        return;
    }
    let e = SharedPool::create(&shm_opts(&name, 2 * MIB, PagePreference::Pages4K))
        .unwrap_err()
        .to_string();
    assert!(e.contains(&path) && e.contains("mount point"), "{e}");
    assert_eq!(sys::mounts_at(&path).unwrap().len(), 1, "left alone");
    assert_eq!(std::fs::read(&path).unwrap(), b"someone else's");

    // A kvnode-looking mount whose token the lock file does not hold: the same.
    let _ = std::process::Command::new("umount").arg(&path).status();
    let huge = PrivateHugeFile::create(HugeFs::HugeTmpfs, 2 * MIB).unwrap();
    huge.expose(&path).unwrap();
    std::fs::write(
        format!("{path}.lock"),
        b"kvnode-segment-mount not-this-one\n",
    )
    .unwrap();
    let e = SharedPool::create(&shm_opts(&name, 2 * MIB, PagePreference::Pages4K))
        .unwrap_err()
        .to_string();
    assert!(e.contains(&path) && e.contains("mount point"), "{e}");
    let m = sys::mounts_at(&path).unwrap();
    assert_eq!(m.len(), 1);
    assert_eq!(m[0].source, format!("kvnode-segment-{}", huge.token()));
}

/// Without hugetlb pages, a root node gets THP from a private huge tmpfs bind-mounted at the
/// name when /dev/shm itself has no huge=; the client's mapping of the name is PMD-mapped.
/// `Pages4K` asks for no mount at all.
#[test]
fn posix_shm_thp_from_a_private_tmpfs_and_4k_without_mounts() {
    let _g = hugepage_test_lock();
    let name = unique_shm_name("thp");
    let path = format!("/dev/shm/{name}");
    let _guard = MountGuard(path.clone());
    let pool = SharedPool::create(&shm_opts(&name, 8 * MIB, PagePreference::Thp)).unwrap();
    assert!(
        backing_as_expected(&pool, PagePreference::Thp, 8 * MIB, true),
        "{:?} {}",
        pool.backing(),
        pool.backing_detail()
    );
    let client = PoolMapping::open_posix_shm(&name, pool.len()).unwrap();
    client.region().fill_at(0, pool.len(), 7).unwrap();
    let pages = sys::mapping_pages(client.region().as_ptr() as usize).unwrap();
    eprintln!(
        "{:?} {} client {pages:?}",
        pool.backing(),
        pool.backing_detail()
    );
    match pool.backing() {
        PoolBacking::Thp => assert!(pages.huge_bytes > 0, "client got THP"),
        b => {
            assert_eq!(b, PoolBacking::Pages4K);
            assert_eq!(pages.huge_bytes, 0, "status says 4k, the client agrees");
        }
    }
    if !sys::dev_shm_thp_active() && pool.backing() == PoolBacking::Thp {
        assert!(pool.backing_detail().contains("tmpfs huge=within_size"));
        assert_eq!(sys::mounts_at(&path).unwrap().len(), 1);
    }
    drop(client);
    drop(pool);
    assert!(sys::mounts_at(&path).unwrap().is_empty());

    let p4 = SharedPool::create(&shm_opts(&name, 2 * MIB, PagePreference::Pages4K)).unwrap();
    assert_eq!(p4.backing(), PoolBacking::Pages4K);
    assert!(sys::mounts_at(&path).unwrap().is_empty(), "4k: no mount");
    assert!(
        p4.backing_detail().contains("4 KiB pages"),
        "{}",
        p4.backing_detail()
    );
}
