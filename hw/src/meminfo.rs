//! How much memory a new pool could get, read before the pool is created so that a pool larger
//! than the machine is refused at once instead of being pre-faulted toward the OOM killer.
//!
//! The pool is backed entirely by hugetlb pages of one size or entirely by ordinary memory
//! (THP or 4 KiB pages, see [`crate::SharedPool::create`]), so the memory it can get is the
//! **larger** of the two, never their sum:
//!
//! * hugetlb pages of size S: `free_hugepages - resv_hugepages` (pages that other mappings have
//!   reserved but not yet faulted are free but not available), when the page preference tries S;
//! * ordinary memory: `MemAvailable` from `/proc/meminfo`, further bounded by the cgroup v2
//!   `memory.max - memory.current` (less reclaimable `inactive_file` cache) of this process's
//!   cgroup and its ancestors; a POSIX shm pool is also bounded by the free space of `/dev/shm`. Reserved hugepages
//!   are already excluded from `MemAvailable`, and a pool that falls back to ordinary pages
//!   cannot use them.
//!
//! Nothing here changes system state or needs `unsafe`.

use std::fs;

use crate::pool::{PagePreference, PoolBacking};
use crate::sys;

/// A snapshot of the memory a new pool could use. Invariant: every field is `None` exactly
/// when its source could not be read (then it neither allows nor forbids anything); the values
/// may be stale immediately.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryAvailable {
    /// `MemAvailable` of `/proc/meminfo`, in bytes.
    pub mem_available: Option<u64>,
    /// The tightest cgroup v2 memory headroom (`memory.max - memory.current`) over this
    /// process's cgroup and its ancestors, in bytes; `None` when no cgroup sets a limit.
    pub cgroup_headroom: Option<u64>,
    /// Free, unreserved 2 MiB hugetlb pages.
    pub huge_2m_pages: Option<u64>,
    /// Free, unreserved 1 GiB hugetlb pages.
    pub huge_1g_pages: Option<u64>,
    /// Bytes free in the `/dev/shm` file system (where a POSIX shm pool lives; a container's
    /// `--shm-size` bounds it).
    pub dev_shm_free: Option<u64>,
}

impl MemoryAvailable {
    /// Reads the current values from procfs, sysfs and cgroupfs.
    pub fn read() -> MemoryAvailable {
        MemoryAvailable {
            mem_available: fs::read_to_string("/proc/meminfo")
                .ok()
                .and_then(|t| meminfo_bytes(&t, "MemAvailable")),
            cgroup_headroom: cgroup_headroom(),
            huge_2m_pages: sys::hugepages_available(sys::HUGE_2M_DIR),
            huge_1g_pages: sys::hugepages_available(sys::HUGE_1G_DIR),
            dev_shm_free: crate::sys::free_bytes(crate::sys::DEV_SHM),
        }
    }

    /// This snapshot with the memory a stale POSIX shm segment named `shm_name` occupies counted
    /// as free: creating the pool under that name removes it first (see
    /// [`crate::SharedPool::create`]), and until then its pages (all of them, when the node that
    /// left it had pre-faulted its pool) fill `/dev/shm` and are missing from `MemAvailable` and
    /// from the cgroup headroom. A segment a running node holds, or one the pool's creation
    /// would refuse to remove, counts as nothing.
    pub fn counting_stale_shm_segment(self, shm_name: &str) -> MemoryAvailable {
        self.counting_freed(crate::shm::stale_segment_bytes(shm_name))
    }

    /// This snapshot with `bytes` more free memory in `/dev/shm`, `MemAvailable` and the
    /// cgroup headroom (each where known).
    fn counting_freed(self, bytes: u64) -> MemoryAvailable {
        let add = |v: Option<u64>| v.map(|v| v.saturating_add(bytes));
        MemoryAvailable {
            mem_available: add(self.mem_available),
            cgroup_headroom: add(self.cgroup_headroom),
            dev_shm_free: add(self.dev_shm_free),
            ..self
        }
    }

    /// Ordinary memory (THP or 4 KiB pages) a pool could get: `MemAvailable`, bounded by the
    /// cgroup headroom. `None` when `MemAvailable` is unknown.
    pub fn ordinary_bytes(&self) -> Option<u64> {
        let avail = self.mem_available?;
        Some(match self.cgroup_headroom {
            Some(h) => avail.min(h),
            None => avail,
        })
    }

    /// Bytes of free, unreserved hugetlb pages of `backing`'s size (`None`: unknown or not a
    /// hugetlb backing).
    pub fn hugetlb_bytes(&self, backing: PoolBacking) -> Option<u64> {
        let pages = match backing {
            PoolBacking::Hugetlb2M => self.huge_2m_pages?,
            PoolBacking::Hugetlb1G => self.huge_1g_pages?,
            _ => return None,
        };
        Some(pages.saturating_mul(backing.page_bytes()))
    }

    /// Checks that a pool of `bytes` with page preference `prefer` (a memfd pool, or a POSIX shm
    /// one when `posix_shm`, which gets hugetlb pages only when this process is root: see
    /// [`crate::SharedPool::create`]) fits in some backing of its fallback chain. `Err` holds a
    /// sentence naming the pool size and the memory available.
    ///
    /// Invariant: refuses only on positive evidence: when `MemAvailable` cannot be read, every
    /// size is allowed (the pool creation then reports what really happens).
    pub fn check_pool(
        &self,
        bytes: u64,
        prefer: PagePreference,
        posix_shm: bool,
    ) -> Result<(), String> {
        // A POSIX shm pool on hugetlb pages is a hugetlbfs file bind-mounted at its name, which
        // needs root; it takes nothing from /dev/shm.
        let shm_hugetlb = !posix_shm || crate::peer::effective_uid() == 0;
        let hugetlb: &[PoolBacking] = match (shm_hugetlb, prefer) {
            (false, _) => &[],
            (true, PagePreference::Huge1G) => &[PoolBacking::Hugetlb1G, PoolBacking::Hugetlb2M],
            (true, PagePreference::Huge2M) => &[PoolBacking::Hugetlb2M],
            (true, _) => &[],
        };
        for &b in hugetlb {
            if let Some(free) = self.hugetlb_bytes(b) {
                if round_up(bytes, b.page_bytes()) <= free {
                    return Ok(());
                }
            }
        }
        if posix_shm {
            if let Some(free) = self.dev_shm_free {
                if round_up(bytes, 2 << 20) > free {
                    return Err(format!(
                        "the pool ({}) does not fit in /dev/shm, where LMCache clients open it: \
                         {} free there (in a container, raise --shm-size); {}",
                        human_bytes(bytes),
                        human_bytes(free),
                        SMALLER_POOL
                    ));
                }
            }
        }
        let Some(ordinary) = self.ordinary_bytes() else {
            return Ok(());
        };
        if round_up(bytes, 2 << 20) <= ordinary {
            return Ok(());
        }
        let mut why = format!("{} of memory available", human_bytes(ordinary));
        match self.cgroup_headroom {
            Some(h) if h < self.mem_available.unwrap_or(0) => why.push_str(&format!(
                " (this process's cgroup memory limit; the machine has {} available)",
                human_bytes(self.mem_available.unwrap_or(0))
            )),
            _ => why.push_str(" (MemAvailable)"),
        }
        for &b in hugetlb {
            let size = match b {
                PoolBacking::Hugetlb1G => "1 GiB",
                _ => "2 MiB",
            };
            match self.hugetlb_bytes(b).unwrap_or(0) {
                0 => why.push_str(&format!(", no free {size} hugepages")),
                free => why.push_str(&format!(", {} in free {size} hugepages", human_bytes(free))),
            }
        }
        Err(format!(
            "the pool ({}) does not fit in the memory available on this machine: {why}; \
             {SMALLER_POOL}",
            human_bytes(bytes)
        ))
    }
}

/// How to ask for less, for both commands that build a pool.
const SMALLER_POOL: &str =
    "choose a smaller pool (--pool-size, or --l1-size-gb for lmcache-server)";

/// `bytes` rounded up to a multiple of `align` (a power of two), saturating.
fn round_up(bytes: u64, align: u64) -> u64 {
    bytes
        .checked_add(align - 1)
        .map_or(u64::MAX, |b| b & !(align - 1))
}

/// A byte count for people: `64 TiB`, `1.5 GiB`, `512 KiB`, `100 bytes`. Invariant: exact
/// multiples print without decimals; others with one decimal (rounded).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (name, unit) in UNITS {
        if bytes >= unit {
            return if bytes.is_multiple_of(unit) {
                format!("{} {name}", bytes / unit)
            } else {
                format!("{:.1} {name}", bytes as f64 / unit as f64)
            };
        }
    }
    format!("{bytes} bytes")
}

/// A `Key:  N kB` line of a `/proc/meminfo` text, in bytes.
fn meminfo_bytes(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?.strip_prefix(':')?;
        let mut words = rest.split_whitespace();
        let n: u64 = words.next()?.parse().ok()?;
        match words.next() {
            Some("kB") => n.checked_mul(1024),
            None => Some(n),
            Some(_) => None,
        }
    })
}

/// The tightest `memory.max - memory.current` over this process's cgroup v2 and its ancestors.
fn cgroup_headroom() -> Option<u64> {
    let own = fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = cgroup_v2_path(&own)?;
    let mut dir = std::path::PathBuf::from("/sys/fs/cgroup").join(rel.trim_start_matches('/'));
    let mut best: Option<u64> = None;
    loop {
        let max = fs::read_to_string(dir.join("memory.max")).ok();
        let cur = sys::read_u64(&dir.join("memory.current").to_string_lossy());
        if let (Some(max), Some(cur)) = (max.as_deref().and_then(parse_limit), cur) {
            // Inactive page cache counts in memory.current but the kernel reclaims it for a
            // new pool (a container that loaded model weights holds gigabytes of it).
            let reclaimable = fs::read_to_string(dir.join("memory.stat"))
                .ok()
                .and_then(|t| stat_value(&t, "inactive_file"))
                .unwrap_or(0);
            let h = max.saturating_sub(cur.saturating_sub(reclaimable));
            best = Some(best.map_or(h, |b: u64| b.min(h)));
        }
        if !dir.pop() || !dir.starts_with("/sys/fs/cgroup") || dir.as_os_str() == "/sys/fs/cgroup" {
            break;
        }
    }
    best
}

/// A `key value` line of a cgroup `memory.stat` text.
fn stat_value(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next()? == key).then(|| w.next()?.parse().ok())?
    })
}

/// The path of the unified (v2) hierarchy in a `/proc/self/cgroup` text (`0::/path`).
fn cgroup_v2_path(text: &str) -> Option<&str> {
    text.lines().find_map(|l| l.strip_prefix("0::"))
}

/// A `memory.max` value: a byte count, or `None` for `max` (no limit).
fn parse_limit(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn mem(avail_gib: u64, huge_2m: u64, huge_1g: u64) -> MemoryAvailable {
        MemoryAvailable {
            mem_available: Some(avail_gib * GIB),
            cgroup_headroom: None,
            huge_2m_pages: Some(huge_2m),
            huge_1g_pages: Some(huge_1g),
            dev_shm_free: None,
        }
    }

    #[test]
    fn a_posix_shm_pool_must_fit_in_dev_shm_and_cache_is_headroom() {
        let m = MemoryAvailable {
            dev_shm_free: Some(64 << 20),
            ..mem(20, 0, 0)
        };
        let e = m.check_pool(GIB, PagePreference::Thp, true).unwrap_err();
        assert!(
            e.contains("/dev/shm") && e.contains("64 MiB") && e.contains("--l1-size-gb"),
            "{e}"
        );
        assert!(
            m.check_pool(GIB, PagePreference::Thp, false).is_ok(),
            "memfd pools are not in /dev/shm"
        );
        assert_eq!(
            stat_value("anon 5\ninactive_file 4096\nfile 9\n", "inactive_file"),
            Some(4096)
        );
        assert_eq!(stat_value("inactive_file_x 1\n", "inactive_file"), None);
    }

    /// A node that died leaves its pre-faulted segment in /dev/shm; the restart on the same
    /// name removes it before building its pool, so the check must count it as free (it used
    /// to refuse every pool larger than what the dead node's segment left free).
    #[test]
    fn a_stale_segment_of_the_pools_name_counts_as_free() {
        use std::io::Write;
        let name = format!("kvnode-meminfo-stale-{}", std::process::id());
        let (seg, fd) = crate::shm::ShmSegment::create(&name).unwrap();
        let mut f = std::fs::File::from(fd);
        f.write_all(&vec![1u8; 8 << 20]).unwrap();
        drop(f);
        seg.abandon(); // the node dies: segment and pages stay
                       // What the machine shows now: 6 MiB free in /dev/shm, 6 MiB available.
        let m = MemoryAvailable {
            mem_available: Some(6 << 20),
            cgroup_headroom: Some(6 << 20),
            dev_shm_free: Some(6 << 20),
            ..MemoryAvailable::default()
        };
        assert!(m
            .check_pool(8 << 20, PagePreference::Pages4K, true)
            .is_err());
        let counted = m.counting_stale_shm_segment(&name);
        assert!(
            counted
                .check_pool(8 << 20, PagePreference::Pages4K, true)
                .is_ok(),
            "{counted:?}"
        );
        let other = format!("{name}-other");
        assert_eq!(
            m.counting_stale_shm_segment(&other),
            m,
            "another name frees nothing"
        );
        // The restart itself: the stale segment is replaced.
        let (seg2, _fd) = crate::shm::ShmSegment::create(&name).unwrap();
        assert_eq!(
            m.counting_stale_shm_segment(&name),
            m,
            "a live segment frees nothing"
        );
        drop(seg2);
        let _ = std::fs::remove_file(format!("/dev/shm/{name}.lock"));
    }

    #[test]
    fn parses_meminfo_and_cgroup_files() {
        let t = "MemTotal:       24683652 kB\nMemFree:        21521172 kB\n\
                 MemAvailable:   23752956 kB\nHugePages_Free:        0\n";
        assert_eq!(meminfo_bytes(t, "MemAvailable"), Some(23_752_956 * 1024));
        assert_eq!(meminfo_bytes(t, "MemFree"), Some(21_521_172 * 1024));
        assert_eq!(meminfo_bytes(t, "HugePages_Free"), Some(0));
        assert_eq!(meminfo_bytes(t, "Mem"), None);
        assert_eq!(meminfo_bytes(t, "SwapFree"), None);
        assert_eq!(
            cgroup_v2_path("0::/user.slice/x.scope\n"),
            Some("/user.slice/x.scope")
        );
        assert_eq!(cgroup_v2_path("12:memory:/a\n"), None);
        assert_eq!(parse_limit("max\n"), None);
        assert_eq!(parse_limit("1073741824\n"), Some(GIB));
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human_bytes(64 << 40), "64 TiB");
        assert_eq!(human_bytes(3 << 29), "1.5 GiB");
        assert_eq!(human_bytes(2 << 20), "2 MiB");
        assert_eq!(human_bytes(1000), "1000 bytes");
        assert_eq!(human_bytes(23_752_956 * 1024), "22.7 GiB");
    }

    #[test]
    fn the_larger_backing_counts_never_the_sum() {
        // 8 GiB of ordinary memory plus 4 GiB of 2 MiB hugepages: a 10 GiB pool fits neither.
        let m = mem(8, 2048, 0);
        assert!(m
            .check_pool(10 * GIB, PagePreference::Huge2M, false)
            .is_err());
        assert!(m.check_pool(8 * GIB, PagePreference::Huge2M, false).is_ok());
        assert!(m.check_pool(4 * GIB, PagePreference::Huge2M, false).is_ok());
        // Hugepages only help when the preference tries them, and for POSIX shm only as root
        // (the hugetlbfs file is bind-mounted at the segment's name).
        let m = mem(1, 4096, 0);
        assert!(m.check_pool(6 * GIB, PagePreference::Huge2M, false).is_ok());
        assert!(m
            .check_pool(6 * GIB, PagePreference::Pages4K, false)
            .is_err());
        assert!(m.check_pool(6 * GIB, PagePreference::Thp, false).is_err());
        assert_eq!(
            m.check_pool(6 * GIB, PagePreference::Huge2M, true).is_ok(),
            crate::peer::effective_uid() == 0
        );
        assert!(m.check_pool(6 * GIB, PagePreference::Thp, true).is_err());
        // The 1 GiB preference tries 1 GiB then 2 MiB pages; 1 GiB pages round the pool up.
        let m = mem(1, 0, 4);
        assert!(m.check_pool(4 * GIB, PagePreference::Huge1G, false).is_ok());
        assert!(m
            .check_pool(4 * GIB + 1, PagePreference::Huge1G, false)
            .is_err());
        assert!(m
            .check_pool(4 * GIB, PagePreference::Huge2M, false)
            .is_err());
    }

    #[test]
    fn cgroup_limit_bounds_ordinary_memory() {
        let m = MemoryAvailable {
            cgroup_headroom: Some(2 * GIB),
            ..mem(20, 0, 0)
        };
        let e = m
            .check_pool(4 * GIB, PagePreference::Pages4K, false)
            .unwrap_err();
        assert!(
            e.contains("2 GiB of memory available") && e.contains("cgroup"),
            "{e}"
        );
        assert!(m.check_pool(GIB, PagePreference::Pages4K, false).is_ok());
    }

    #[test]
    fn unknown_memory_allows_everything_and_the_message_names_sizes() {
        assert!(MemoryAvailable::default()
            .check_pool(64 << 40, PagePreference::Huge2M, false)
            .is_ok());
        let e = mem(22, 0, 0)
            .check_pool(64 << 40, PagePreference::Huge2M, false)
            .unwrap_err();
        assert!(
            e.contains("64 TiB") && e.contains("22 GiB of memory available"),
            "{e}"
        );
        assert!(e.contains("no free 2 MiB hugepages"), "{e}");
    }

    #[test]
    fn reading_the_machine_does_not_panic() {
        let m = MemoryAvailable::read();
        assert!(m.mem_available.is_some(), "Linux has MemAvailable");
        assert!(m
            .check_pool(64 << 40, PagePreference::Huge2M, false)
            .is_err());
    }
}
