//! Read-only probes of kernel memory settings (sysfs / procfs).
//!
//! Nothing here changes system state; every probe returns `None`/`false`
//! when the file is missing or unreadable, so callers degrade gracefully.

use std::fs;

/// sysfs directory of the 2 MiB hugetlb pool.
pub(crate) const HUGE_2M_DIR: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB";
/// sysfs directory of the 1 GiB hugetlb pool.
pub(crate) const HUGE_1G_DIR: &str = "/sys/kernel/mm/hugepages/hugepages-1048576kB";
const SHMEM_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
const SHMEM_ENABLED_2M: &str = "/sys/kernel/mm/transparent_hugepage/hugepages-2048kB/shmem_enabled";
/// Where glibc's `shm_open` puts POSIX shared memory segments.
pub(crate) const DEV_SHM: &str = "/dev/shm";

/// Number of free 2 MiB hugetlb pages
/// (`/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages`).
///
/// Invariant: `None` iff the counter could not be read or parsed (no hugetlb
/// support); the value is a snapshot and may be stale immediately. Note that
/// free pages may already be reserved by existing mappings (`resv_hugepages`).
pub fn hugepages_free_2m() -> Option<u64> {
    read_u64(&format!("{HUGE_2M_DIR}/free_hugepages"))
}

/// Free-and-unreserved hugetlb pages in the pool at `dir`, i.e. how many
/// pages a new mapping could still reserve (`free_hugepages - resv_hugepages`).
pub(crate) fn hugepages_available(dir: &str) -> Option<u64> {
    let free = read_u64(&format!("{dir}/free_hugepages"))?;
    let resv = read_u64(&format!("{dir}/resv_hugepages")).unwrap_or(0);
    Some(free.saturating_sub(resv))
}

/// Reads a file holding one decimal integer.
pub(crate) fn read_u64(path: &str) -> Option<u64> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Extracts the `[selected]` word of a sysfs multiple-choice file.
pub(crate) fn selected_value(text: &str) -> Option<&str> {
    let start = text.find('[')? + 1;
    let end = start + text[start..].find(']')?;
    Some(&text[start..end])
}

fn selected_in(path: &str) -> Option<String> {
    let text = fs::read_to_string(path).ok()?;
    selected_value(&text).map(str::to_owned)
}

fn is_huge_mode(mode: &str) -> bool {
    matches!(mode, "always" | "within_size" | "advise" | "force")
}

/// Whether PMD-sized THP can back a memfd (the kernel-internal shmem mount)
/// once the mapping is `madvise(MADV_HUGEPAGE)`d.
///
/// Invariant: `false` whenever the global shmem setting is `never`/`deny` and
/// no per-size override enables it, or when the settings cannot be read.
pub(crate) fn memfd_thp_active() -> bool {
    let global = selected_in(SHMEM_ENABLED);
    match selected_in(SHMEM_ENABLED_2M).as_deref() {
        // Per-size knob exists and overrides the global one (Linux >= 6.11),
        // except that the global `deny`/`force` testing modes always win.
        Some(per_size) if per_size != "inherit" => match global.as_deref() {
            Some("deny") => false,
            Some("force") => true,
            _ => is_huge_mode(per_size),
        },
        _ => global.as_deref().is_some_and(is_huge_mode),
    }
}

/// Whether the global shmem THP setting forbids huge pages on every tmpfs (`deny`).
pub(crate) fn shmem_thp_denied() -> bool {
    selected_in(SHMEM_ENABLED).as_deref() == Some("deny")
}

/// Whether THP can back files of the tmpfs mounted at `/dev/shm` (POSIX shm).
///
/// Invariant: `true` only if the global shmem setting is `force`, or it is
/// not `deny` and `/dev/shm` is a tmpfs mounted with
/// `huge=always|within_size|advise`.
pub(crate) fn dev_shm_thp_active() -> bool {
    match selected_in(SHMEM_ENABLED).as_deref() {
        Some("deny") => return false,
        Some("force") => return true,
        _ => {}
    }
    let Ok(mounts) = fs::read_to_string("/proc/self/mounts") else {
        return false;
    };
    dev_shm_huge_option(&mounts).is_some_and(|m| is_huge_mode(m) && m != "force")
}

/// The `huge=` option of the last (i.e. visible) tmpfs mount on `/dev/shm`
/// in a `/proc/self/mounts` text; `Some("never")` if mounted without one.
pub(crate) fn dev_shm_huge_option(mounts: &str) -> Option<&str> {
    let mut found = None;
    for line in mounts.lines() {
        let mut fields = line.split_whitespace();
        let (_src, Some(dir), Some(fstype), Some(opts)) =
            (fields.next(), fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if dir != DEV_SHM {
            continue;
        }
        found = if fstype == "tmpfs" {
            Some(
                opts.split(',')
                    .find_map(|o| o.strip_prefix("huge="))
                    .unwrap_or("never"),
            )
        } else {
            None
        };
    }
    found
}

/// Page statistics of one mapping of this process, from its `/proc/self/smaps` entry.
///
/// Invariant: a snapshot; sizes in bytes; `huge_bytes` counts the bytes mapped by huge pages of
/// any kind (hugetlb pages, or PMD-mapped shmem/file THP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct MappingPages {
    /// `KernelPageSize`: the page size the kernel backs the mapping with (2 MiB / 1 GiB for
    /// hugetlb, the base page size otherwise, also for THP).
    pub(crate) kernel_page_bytes: u64,
    /// `Rss` plus hugetlb pages (`Shared_Hugetlb + Private_Hugetlb`, which `Rss` leaves out).
    pub(crate) resident_bytes: u64,
    /// `ShmemPmdMapped + FilePmdMapped + Shared_Hugetlb + Private_Hugetlb`.
    pub(crate) huge_bytes: u64,
}

/// The smaps entry of this process's mapping starting at `addr`; `None` when there is none or
/// smaps cannot be read.
pub(crate) fn mapping_pages(addr: usize) -> Option<MappingPages> {
    let smaps = fs::read_to_string("/proc/self/smaps").ok()?;
    mapping_pages_in(&smaps, addr)
}

/// [`mapping_pages`] on a given smaps text.
pub(crate) fn mapping_pages_in(smaps: &str, addr: usize) -> Option<MappingPages> {
    let head = format!("{addr:x}-");
    let mut found = false;
    let mut m = MappingPages::default();
    for line in smaps.lines() {
        let is_header = line.split_whitespace().next().is_some_and(|r| {
            r.contains('-') && r.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
        });
        if is_header {
            if found {
                break;
            }
            found = line.starts_with(&head);
            continue;
        }
        if !found {
            continue;
        }
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let kb = || -> u64 {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .unwrap_or(0)
                .saturating_mul(1024)
        };
        match key {
            "KernelPageSize" => m.kernel_page_bytes = kb(),
            "Rss" => m.resident_bytes = m.resident_bytes.saturating_add(kb()),
            "ShmemPmdMapped" | "FilePmdMapped" => m.huge_bytes = m.huge_bytes.saturating_add(kb()),
            "Shared_Hugetlb" | "Private_Hugetlb" => {
                m.huge_bytes = m.huge_bytes.saturating_add(kb());
                m.resident_bytes = m.resident_bytes.saturating_add(kb());
            }
            _ => {}
        }
    }
    found.then_some(m)
}

/// The initial PID namespace as `/proc/self/ns/pid` names it (the kernel's fixed
/// `PROC_PID_INIT_INO`, 0xEFFFFFFC).
const INIT_PID_NAMESPACE: &str = "pid:[4026531836]";

/// Whether this process is in the initial PID namespace and in the mount namespace of PID 1
/// (then the host's init): only there is a mount the node
/// makes seen by processes of the host's namespace. Compares `/proc/self/ns/mnt` with
/// `/proc/1/ns/mnt`; where PID 1's is not readable (a PID 1 with capabilities this process
/// lacks), compares the mount IDs of the two processes' mountinfo instead (a mount belongs to
/// exactly one namespace, so sharing any mount ID means sharing the namespace). `Err` says why
/// it cannot tell, which callers treat as "not known to be".
pub(crate) fn in_init_mount_namespace() -> Result<bool, String> {
    let read = |p: &str| fs::read_link(p).map_err(|e| format!("cannot read {p}: {e}"));
    // PID 1 is the host's init only in the initial PID namespace (a container's own PID
    // namespace has its own PID 1, often sharing the container's mount namespace): anywhere
    // else the comparison below proves nothing, so the answer is no.
    if read("/proc/self/ns/pid")?.as_os_str() != INIT_PID_NAMESPACE {
        return Ok(false);
    }
    let mine = read("/proc/self/ns/mnt")?;
    match read("/proc/1/ns/mnt") {
        Ok(init) => Ok(mine == init),
        Err(link_err) => {
            let ids = |p: &str| {
                fs::read_to_string(p)
                    .map(|t| mount_ids(&t))
                    .map_err(|e| format!("{link_err}; cannot read {p}: {e}"))
            };
            let (init, me) = (ids("/proc/1/mountinfo")?, ids("/proc/self/mountinfo")?);
            Ok(init.iter().any(|id| me.contains(id)))
        }
    }
}

/// The mount IDs (first field) of a mountinfo text.
pub(crate) fn mount_ids(mountinfo: &str) -> std::collections::HashSet<u64> {
    mountinfo
        .lines()
        .filter_map(|l| l.split(' ').next()?.parse().ok())
        .collect()
}

/// One line of `/proc/self/mountinfo`, the fields kvnode looks at.
///
/// Invariant: `mount_point` is unescaped (`\040` -> space, ...); the others are as printed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MountEntry {
    /// Where it is mounted.
    pub(crate) mount_point: String,
    /// The path inside its file system that is mounted there (`/segment` for a file bind).
    pub(crate) root: String,
    /// File system type (`hugetlbfs`, `tmpfs`, ...).
    pub(crate) fstype: String,
    /// The mount source as printed (kvnode's own mounts: `kvnode-segment-<token>`).
    pub(crate) source: String,
}

/// The mounts whose mount point is exactly `path`, bottom first (the last one is the one
/// `path` resolves to), read from `/proc/self/mountinfo`; `Err` if that cannot be read.
pub(crate) fn mounts_at(path: &str) -> std::io::Result<Vec<MountEntry>> {
    Ok(mounts_at_in(
        &fs::read_to_string("/proc/self/mountinfo")?,
        path,
    ))
}

/// [`mounts_at`] on a given mountinfo text.
pub(crate) fn mounts_at_in(mountinfo: &str, path: &str) -> Vec<MountEntry> {
    let mut out = Vec::new();
    for line in mountinfo.lines() {
        // id parent major:minor root mount-point options [optional...] - fstype source super
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let l: Vec<&str> = left.split(' ').collect();
        let r: Vec<&str> = right.split(' ').collect();
        if l.len() < 5 || r.len() < 2 {
            continue;
        }
        let mount_point = unescape_mount_field(l[4]);
        if mount_point != path {
            continue;
        }
        out.push(MountEntry {
            mount_point,
            root: unescape_mount_field(l[3]),
            fstype: r[0].to_owned(),
            source: unescape_mount_field(r[1]),
        });
    }
    out
}

/// Undoes the kernel's octal escapes (`\040` space, `\011` tab, `\012` newline, `\134`
/// backslash) in a mountinfo field.
fn unescape_mount_field(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            let oct = &b[i + 1..i + 4];
            if oct.iter().all(|c| (b'0'..=b'7').contains(c)) {
                let v = oct.iter().fold(0u32, |a, c| a * 8 + u32::from(c - b'0'));
                if let Ok(v) = u8::try_from(v) {
                    out.push(v);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// User + system CPU time of this process so far, in seconds (`getrusage`),
/// for CPU-per-byte figures in benchmarks.
///
/// Invariant: monotonic within one process; `None` only if the call fails.
pub fn process_cpu_seconds() -> Option<f64> {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one rusage into the zeroed buffer we own.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: rc == 0, so the kernel filled the struct (and zeroed is valid anyway).
    let ru = unsafe { ru.assume_init() };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    Some(secs(ru.ru_utime) + secs(ru.ru_stime))
}

/// Heap bytes the C allocator holds for this process now, its per-block overhead included
/// (glibc `mallinfo2`: `uordblks + hblkhd`, summed over every arena), for memory-bound tests.
///
/// Invariant: `None` where the allocator is not glibc's; a snapshot of the whole process.
pub fn heap_in_use() -> Option<u64> {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: mallinfo2 takes no argument and returns a plain struct by value; it only
        // reads the allocator's statistics, under the allocator's own locks.
        let m = unsafe { libc::mallinfo2() };
        Some(m.uordblks.saturating_add(m.hblkhd) as u64)
    }
    #[cfg(not(target_env = "gnu"))]
    None
}

/// Bytes available to an unprivileged writer in the file system holding `path` (`statvfs`);
/// `None` if it cannot be queried.
pub(crate) fn free_bytes(path: &str) -> Option<u64> {
    let c = std::ffi::CString::new(path).ok()?;
    // SAFETY: `st` is a plain C struct that statvfs fully initialises on success; `c` is a
    // valid NUL-terminated path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: see above; the pointers are valid for the call.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selected_value_parses_brackets() {
        assert_eq!(
            selected_value("always within_size advise [never] deny force\n"),
            Some("never")
        );
        assert_eq!(selected_value("[always] madvise never"), Some("always"));
        assert_eq!(selected_value("always madvise never"), None);
    }

    #[test]
    fn dev_shm_option_parsing() {
        let m = "proc /proc proc rw 0 0\n\
                 tmpfs /dev/shm tmpfs rw,relatime,size=100k 0 0\n";
        assert_eq!(dev_shm_huge_option(m), Some("never"));
        let m2 = format!("{m}tmpfs /dev/shm tmpfs rw,huge=within_size 0 0\n");
        assert_eq!(dev_shm_huge_option(&m2), Some("within_size"));
        assert_eq!(dev_shm_huge_option("proc /proc proc rw 0 0\n"), None);
    }

    #[test]
    fn smaps_entry_parsing() {
        let smaps = "7f0000000000-7f0000400000 rw-s 00000000 00:27 5    /dev/shm/x\n\
                     Size:               4096 kB\n\
                     KernelPageSize:     2048 kB\n\
                     Rss:                   0 kB\n\
                     ShmemPmdMapped:        0 kB\n\
                     Shared_Hugetlb:     2048 kB\n\
                     Private_Hugetlb:    2048 kB\n\
                     VmFlags: rd wr sh\n\
                     7f0000400000-7f0000c00000 rw-s 00000000 00:27 6    /dev/shm/y\n\
                     KernelPageSize:        4 kB\n\
                     Rss:                8192 kB\n\
                     ShmemPmdMapped:     6144 kB\n";
        let a = mapping_pages_in(smaps, 0x7f00_0000_0000).unwrap();
        assert_eq!(a.kernel_page_bytes, 2 << 20);
        assert_eq!(a.huge_bytes, 4 << 20);
        assert_eq!(a.resident_bytes, 4 << 20);
        let b = mapping_pages_in(smaps, 0x7f00_0040_0000).unwrap();
        assert_eq!((b.kernel_page_bytes, b.huge_bytes), (4096, 6 << 20));
        assert!(mapping_pages_in(smaps, 0x1000).is_none());
    }

    #[test]
    fn mountinfo_parsing_unescapes_and_keeps_order() {
        let mi = "25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw\n\
                  44 30 0:39 /segment /dev/shm/a\\040b rw,nosuid shared:5 - hugetlbfs kvnode-segment-t1 rw\n\
                  45 44 0:40 /f /dev/shm/a\\040b rw - tmpfs other rw\n";
        let m = mounts_at_in(mi, "/dev/shm/a b");
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].root, "/segment");
        assert_eq!(m[0].fstype, "hugetlbfs");
        assert_eq!(m[0].source, "kvnode-segment-t1");
        assert_eq!(m[1].source, "other");
        assert!(mounts_at_in(mi, "/dev/shm/a").is_empty());
    }

    #[test]
    fn probes_do_not_panic() {
        let _ = hugepages_free_2m();
        let _ = hugepages_available(HUGE_1G_DIR);
        let _ = memfd_thp_active();
        let _ = dev_shm_thp_active();
    }
}
