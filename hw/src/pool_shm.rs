//! The fallback chain of a pool backed by a named POSIX shm segment (`/dev/shm/<name>`):
//! with the opt-in, bind-mounted hugepage files first (see [`crate::segment_mount`]), then
//! `/dev/shm`'s own file (THP when it is mounted `huge=`, else 4 KiB pages).

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};

use super::{
    assemble, finish, is_cancelled, thp_or_4k, PagePreference, PoolBacking, PoolOptions, SharedPool,
};
use crate::error::{HwError, HwResult};
use crate::region::{round_up, PoolRegion, ALIGN_2M};
use crate::segment_mount::{HugeFs, PrivateHugeFile};
use crate::shm::ShmSegment;
use crate::sys;

/// The way to hugepages for a named segment that needs neither root nor a shared mount
/// namespace, and the opt-in that needs both, for messages.
const HUGE_SEGMENT_HOWTO: &str = "for huge pages, remount /dev/shm with huge=within_size \
     (scripts/setup.sh --shm-huge, host-wide, seen in every mount namespace sharing /dev/shm), or \
     run a root node with --segment-bind-mount (every client must share the node's mount \
     namespace)";

pub(super) fn create_posix_shm(opts: &PoolOptions, shm_name: &str) -> HwResult<SharedPool> {
    let path = format!("{}/{shm_name}", sys::DEV_SHM);
    let want_thp = opts.prefer != PagePreference::Pages4K;
    let dev_shm_thp = want_thp && sys::dev_shm_thp_active();
    let mut why_not: Vec<String> = Vec::new();
    // Taking the name first: a name held by a live node (or a foreign mount there) fails here,
    // before any option; a dead node's mount is removed before pages are reserved.
    let (mut seg, placeholder) = ShmSegment::create(shm_name)?;
    // From here on `seg` unlinks the name again (and removes its mount) if anything fails.
    let placeholder = File::from(placeholder);
    for fs in mount_candidates(opts, want_thp, dev_shm_thp, &mut why_not) {
        match try_mounted(opts, &mut seg, &placeholder, fs) {
            Ok((huge, region)) => {
                let backing = match huge.fs() {
                    HugeFs::Hugetlb1G => PoolBacking::Hugetlb1G,
                    HugeFs::Hugetlb2M => PoolBacking::Hugetlb2M,
                    HugeFs::HugeTmpfs => PoolBacking::Thp,
                };
                let detail = format!("private {} file bind-mounted at {path}", fs.describe());
                return Ok(assemble(
                    opts,
                    region,
                    huge.into_file(),
                    backing,
                    Some(seg),
                    detail,
                ));
            }
            Err(e) if is_cancelled(opts) => return Err(e),
            // Our own mount could not be removed: the name is not a plain segment any more.
            Err(e) if seg.is_mounted() => return Err(e),
            Err(e) => {
                tracing::warn!(
                    path,
                    option = fs.describe(),
                    error = %e,
                    "bind-mounted hugepage segment unavailable, falling back"
                );
                why_not.push(format!("{}: {e}", fs.describe()));
            }
        }
    }
    if want_thp && !dev_shm_thp && !sys::shmem_thp_denied() {
        why_not.push(format!(
            "{} is a tmpfs without huge= ({HUGE_SEGMENT_HOWTO})",
            sys::DEV_SHM
        ));
    }
    let len = round_up(opts.bytes, ALIGN_2M as u64).expect("bounded by MAX_POOL_BYTES");
    placeholder
        .set_len(len)
        .map_err(|e| HwError::os("ftruncate (posix shm)", e))?;
    let fd = OwnedFd::from(placeholder);
    let region = PoolRegion::map_shared(fd.as_fd(), len as usize, ALIGN_2M, len)?;
    let backing = if dev_shm_thp {
        thp_or_4k(&region, true, true, "/dev/shm")
    } else {
        let advice = if want_thp {
            libc::MADV_HUGEPAGE
        } else {
            libc::MADV_NOHUGEPAGE
        };
        if let Err(e) = region.madvise(advice) {
            tracing::debug!(error = %e, "madvise failed");
        }
        PoolBacking::Pages4K
    };
    let detail = if backing == PoolBacking::Pages4K {
        let why = if want_thp {
            why_not.join("; ")
        } else {
            "4k pages were asked for".to_owned()
        };
        if want_thp {
            tracing::warn!(
                path,
                why,
                "the POSIX shm segment is on 4 KiB pages: every first touch of a page in a \
                 client's mapping faults"
            );
        }
        format!("tmpfs {} (4 KiB pages: {why})", sys::DEV_SHM)
    } else {
        format!(
            "tmpfs {} huge={}",
            sys::DEV_SHM,
            std::fs::read_to_string("/proc/self/mounts")
                .ok()
                .and_then(|m| sys::dev_shm_huge_option(&m).map(str::to_owned))
                .unwrap_or_else(|| "?".into())
        )
    };
    finish(opts, region, fd, backing, Some(seg), detail)
}

/// The bind-mounted file systems to try for a named segment, best first; why the others are
/// not tried goes to `why_not`. None without the opt-in, or when the node is not in PID 1's
/// mount namespace (its mount would be invisible to the host's clients: warned).
fn mount_candidates(
    opts: &PoolOptions,
    want_thp: bool,
    dev_shm_thp: bool,
    why_not: &mut Vec<String>,
) -> Vec<HugeFs> {
    if !opts.segment_bind_mount {
        return Vec::new();
    }
    let mut candidates: Vec<HugeFs> = match opts.prefer {
        PagePreference::Huge1G => vec![HugeFs::Hugetlb1G, HugeFs::Hugetlb2M],
        PagePreference::Huge2M => vec![HugeFs::Hugetlb2M],
        PagePreference::Thp | PagePreference::Pages4K => vec![],
    };
    if want_thp && !dev_shm_thp {
        if sys::shmem_thp_denied() {
            why_not
                .push("shmem THP is disabled (transparent_hugepage/shmem_enabled = deny)".into());
        } else {
            candidates.push(HugeFs::HugeTmpfs);
        }
    }
    if candidates.is_empty() {
        return candidates;
    }
    let refused = match sys::in_init_mount_namespace() {
        Ok(true) => None,
        Ok(false) => Some(
            "the node is not in PID 1's mount namespace (or not in the initial PID namespace, \
             e.g. in a container, where PID 1 is not the host's init)"
                .to_owned(),
        ),
        Err(e) => Some(format!(
            "cannot tell whether the node is in PID 1's mount namespace ({e})"
        )),
    };
    if let Some(why) = refused {
        tracing::warn!(
            why,
            "--segment-bind-mount refused: the bind mount would be seen only in the node's own \
             mount namespace, and clients elsewhere would open an empty placeholder; falling back"
        );
        why_not.push(format!("--segment-bind-mount refused: {why}"));
        return Vec::new();
    }
    candidates
}

/// One mount-based option: a private hugepage file of the pool's size, mapped, pre-faulted
/// (when asked) and bind-mounted over `seg`. On failure nothing of it is left: the file system
/// instance goes with `huge`, and `mount_over` undoes its own steps.
fn try_mounted(
    opts: &PoolOptions,
    seg: &mut ShmSegment,
    placeholder: &File,
    fs: HugeFs,
) -> HwResult<(PrivateHugeFile, PoolRegion)> {
    let (huge, region) = prepare_huge(opts, fs)?;
    if opts.prefault {
        region.prefault_fresh(opts.cancel.as_deref())?;
    }
    seg.mount_over(&huge, placeholder)?;
    Ok((huge, region))
}

/// A private hugepage file of the pool's size, mapped (for hugetlb this reserves the pages, so
/// a shortage fails here, before anything is visible at the segment's name).
fn prepare_huge(opts: &PoolOptions, fs: HugeFs) -> HwResult<(PrivateHugeFile, PoolRegion)> {
    let page = match fs {
        HugeFs::Hugetlb1G => PoolBacking::Hugetlb1G.page_bytes(),
        HugeFs::Hugetlb2M | HugeFs::HugeTmpfs => ALIGN_2M as u64,
    };
    let len = round_up(opts.bytes, page).expect("bounded by MAX_POOL_BYTES");
    let huge = PrivateHugeFile::create(fs, len)?;
    let region = match PoolRegion::map_shared(huge.file(), len as usize, page as usize, len) {
        Ok(r) => r,
        Err(e) if e.raw_os_error() == Some(libc::ENOMEM) && fs != HugeFs::HugeTmpfs => {
            let dir = match fs {
                HugeFs::Hugetlb1G => sys::HUGE_1G_DIR,
                _ => sys::HUGE_2M_DIR,
            };
            return Err(HwError::Invalid(format!(
                "not enough free hugetlb pages: the pool needs {}, {} are free and unreserved \
                 (raise {dir}/nr_hugepages, e.g. scripts/setup.sh --hugepages)",
                len / page,
                sys::hugepages_available(dir).unwrap_or(0)
            )));
        }
        Err(e) => return Err(e),
    };
    if fs == HugeFs::HugeTmpfs {
        if let Err(e) = region.madvise(libc::MADV_HUGEPAGE) {
            tracing::debug!(error = %e, "madvise(MADV_HUGEPAGE) failed");
        }
    }
    Ok((huge, region))
}
