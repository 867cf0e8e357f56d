//! A hugepage-backed POSIX shm segment: a file on a private hugetlbfs (or huge-page tmpfs)
//! instance, exposed at `/dev/shm/<name>` by bind-mounting it over an empty regular file the
//! node created there.
//!
//! LMCache clients open the segment by name (`shm_open` = `open("/dev/shm/<name>",
//! O_NOFOLLOW)`), so the file must be reachable at that path without a symbolic link; a bind
//! mount is not one. The file system is created with the new mount API (`fsopen`, `fsmount`)
//! and is never attached anywhere but at the segment's path: there is no temporary directory
//! to clean up. Its mount source is `kvnode-segment-<token>` (visible in `findmnt` and
//! `/proc/self/mountinfo`), and the node writes the same token into the segment's lock file
//! while the mount exists: a node restarting after a crash unmounts a mount at the path only
//! when both agree (see [`recover_stale`]), so it never touches a mount it did not make.
//!
//! Used only when the node opted in (`PoolOptions::segment_bind_mount`) and runs in PID 1's
//! mount namespace: the mount is seen only in the node's mount namespace (and those it
//! propagates to), so a client elsewhere would open the empty placeholder. Mounting needs
//! `CAP_SYS_ADMIN` (root); without it [`PrivateHugeFile::create`] fails with `EPERM`, and any
//! failure here makes the pool fall back to the next option.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::error::{HwError, HwResult};
use crate::sys;

/// What the mount source of every segment mount starts with; the rest is the token.
pub(crate) const MOUNT_SOURCE_PREFIX: &str = "kvnode-segment-";
/// The name of the segment's file inside its private file system.
const FILE_NAME: &str = "segment";
/// How many stacked mounts at a segment's path [`recover_stale`] removes at most (each must be
/// one of this name's own); more means something else is going on, and it stops.
const MAX_STALE_MOUNTS: usize = 4;

// The new mount API (Linux >= 5.2); libc has the syscall numbers but no wrappers or flags.
const FSOPEN_CLOEXEC: libc::c_uint = 1;
const FSCONFIG_SET_STRING: libc::c_uint = 1;
const FSCONFIG_CMD_CREATE: libc::c_uint = 6;
const FSMOUNT_CLOEXEC: libc::c_uint = 1;
const MOUNT_ATTR_NOSUID: libc::c_uint = 0x2;
const MOUNT_ATTR_NODEV: libc::c_uint = 0x4;
const MOUNT_ATTR_NOEXEC: libc::c_uint = 0x8;
const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 4;

/// Which private file system holds the segment's file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HugeFs {
    /// hugetlbfs with 2 MiB pages (from the reserved pool, `nr_hugepages`).
    Hugetlb2M,
    /// hugetlbfs with 1 GiB pages.
    Hugetlb1G,
    /// tmpfs with `huge=within_size` (transparent huge pages, no reservation).
    HugeTmpfs,
}

impl HugeFs {
    /// The file system type and its options, for messages and `pool_backing_detail`.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            HugeFs::Hugetlb2M => "hugetlbfs pagesize=2M",
            HugeFs::Hugetlb1G => "hugetlbfs pagesize=1G",
            HugeFs::HugeTmpfs => "tmpfs huge=within_size",
        }
    }

    fn fstype(self) -> &'static str {
        match self {
            HugeFs::Hugetlb2M | HugeFs::Hugetlb1G => "hugetlbfs",
            HugeFs::HugeTmpfs => "tmpfs",
        }
    }
}

/// A file of `len` bytes on a fresh private instance of a hugepage file system that is mounted
/// nowhere (only this process's descriptors reach it) until [`PrivateHugeFile::expose`].
///
/// Invariant: `file` is the only file of that instance; dropping this before exposing it frees
/// the instance and its pages (once no mapping holds them).
#[derive(Debug)]
pub(crate) struct PrivateHugeFile {
    mnt: OwnedFd,
    file: OwnedFd,
    fs: HugeFs,
    token: String,
}

fn cstr(s: &str) -> CString {
    CString::new(s).expect("constant strings without NUL")
}

/// The result of a raw syscall returning a descriptor.
fn fd_result(rc: libc::c_long, op: &'static str) -> HwResult<OwnedFd> {
    if rc < 0 {
        return Err(HwError::os(op, std::io::Error::last_os_error()));
    }
    let fd = libc::c_int::try_from(rc).map_err(|_| HwError::Invalid(format!("{op}: bad fd")))?;
    // SAFETY: the kernel just returned this descriptor to us; nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn fsconfig_string(fs: BorrowedFd<'_>, key: &str, value: &str) -> HwResult<()> {
    let (k, v) = (cstr(key), cstr(value));
    // SAFETY: fsconfig reads the two NUL-terminated strings during the call only.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            FSCONFIG_SET_STRING,
            k.as_ptr(),
            v.as_ptr(),
            0,
        )
    };
    if rc < 0 {
        let e = std::io::Error::last_os_error();
        return Err(HwError::Invalid(format!(
            "fsconfig({key}={value}) failed: {e}"
        )));
    }
    Ok(())
}

/// A token unique to this process and moment (pid, clock, counter): it names the node's mount.
fn new_token() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!(
        "{:x}-{nanos:x}-{:x}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

impl PrivateHugeFile {
    /// Creates the file system instance and its file of `len` bytes (which must be a multiple
    /// of the page size). Errors say which step failed (`EPERM`: not root).
    pub(crate) fn create(fs: HugeFs, len: u64) -> HwResult<PrivateHugeFile> {
        let name = cstr(fs.fstype());
        // SAFETY: fsopen reads the NUL-terminated type name during the call only.
        let rc = unsafe { libc::syscall(libc::SYS_fsopen, name.as_ptr(), FSOPEN_CLOEXEC) };
        let fsfd = fd_result(rc, "fsopen").map_err(|e| match e.raw_os_error() {
            Some(libc::EPERM) => HwError::Invalid(
                "mounting a file system needs root (CAP_SYS_ADMIN), and kvnode is not".into(),
            ),
            Some(libc::ENOSYS) => {
                HwError::Invalid("the kernel has no fsopen (the new mount API, Linux 5.2)".into())
            }
            Some(libc::ENODEV) => {
                HwError::Invalid(format!("the kernel has no {} file system", fs.fstype()))
            }
            _ => e,
        })?;
        let token = new_token();
        fsconfig_string(
            fsfd.as_fd(),
            "source",
            &format!("{MOUNT_SOURCE_PREFIX}{token}"),
        )?;
        match fs {
            HugeFs::Hugetlb2M => fsconfig_string(fsfd.as_fd(), "pagesize", "2M")?,
            HugeFs::Hugetlb1G => fsconfig_string(fsfd.as_fd(), "pagesize", "1G")?,
            HugeFs::HugeTmpfs => {
                fsconfig_string(fsfd.as_fd(), "huge", "within_size")?;
                fsconfig_string(fsfd.as_fd(), "size", &len.to_string())?;
            }
        }
        fsconfig_string(fsfd.as_fd(), "mode", "0700")?;
        // SAFETY: no pointers; the descriptor is ours.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_fsconfig,
                fsfd.as_raw_fd(),
                FSCONFIG_CMD_CREATE,
                std::ptr::null::<libc::c_char>(),
                std::ptr::null::<libc::c_void>(),
                0,
            )
        };
        if rc < 0 {
            return Err(HwError::os(
                "fsconfig(create)",
                std::io::Error::last_os_error(),
            ));
        }
        let attrs = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC;
        // SAFETY: no pointers; the descriptor is ours.
        let rc =
            unsafe { libc::syscall(libc::SYS_fsmount, fsfd.as_raw_fd(), FSMOUNT_CLOEXEC, attrs) };
        let mnt = fd_result(rc, "fsmount")?;
        let file_name = cstr(FILE_NAME);
        // SAFETY: openat reads the NUL-terminated name during the call only.
        let fd = unsafe {
            libc::openat(
                mnt.as_raw_fd(),
                file_name.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC | libc::O_NOFOLLOW,
                0o600 as libc::c_uint,
            )
        };
        let file = fd_result(fd as libc::c_long, "openat (segment file)")?;
        let f = File::from(file);
        f.set_len(len)
            .map_err(|e| HwError::os("ftruncate (segment file)", e))?;
        Ok(PrivateHugeFile {
            mnt,
            file: OwnedFd::from(f),
            fs,
            token,
        })
    }

    /// The file (to map, and to hand to clients).
    pub(crate) fn file(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// The file, giving up the private instance's mount descriptor (once exposed, the bind
    /// mount and the file keep the instance alive).
    pub(crate) fn into_file(self) -> OwnedFd {
        self.file
    }

    /// Which file system it is.
    pub(crate) fn fs(&self) -> HugeFs {
        self.fs
    }

    /// The token naming this instance (its mount source is `kvnode-segment-<token>`).
    pub(crate) fn token(&self) -> &str {
        &self.token
    }

    /// Bind-mounts the file over `path` (an empty regular file the caller created), making it
    /// what `open(path)` returns. The private instance stays mounted only there.
    pub(crate) fn expose(&self, path: &str) -> HwResult<()> {
        let file_name = cstr(FILE_NAME);
        // SAFETY: open_tree reads the NUL-terminated name during the call only.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_open_tree,
                self.mnt.as_raw_fd(),
                file_name.as_ptr(),
                OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
            )
        };
        let tree = fd_result(rc, "open_tree (a bind mount of the segment file)").map_err(|e| {
            match e.raw_os_error() {
                Some(libc::EINVAL) => HwError::Invalid(
                    "this kernel cannot bind-mount a file of a detached mount (open_tree: \
                     EINVAL; needs Linux 6.15)"
                        .into(),
                ),
                _ => e,
            }
        })?;
        let (empty, target) = (cstr(""), CString::new(path).map_err(|_| bad_path(path))?);
        // SAFETY: move_mount reads the two NUL-terminated paths during the call only.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_move_mount,
                tree.as_raw_fd(),
                empty.as_ptr(),
                libc::AT_FDCWD,
                target.as_ptr(),
                MOVE_MOUNT_F_EMPTY_PATH,
            )
        };
        if rc < 0 {
            return Err(HwError::os_path(
                "move_mount (bind the segment file)",
                path,
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }
}

fn bad_path(path: &str) -> HwError {
    HwError::Invalid(format!("path {path:?} contains NUL"))
}

/// Whether `entry` is the mount a node made for this name with `token`.
fn is_ours(entry: &sys::MountEntry, token: &str) -> bool {
    entry.source == format!("{MOUNT_SOURCE_PREFIX}{token}")
        && entry.root == format!("/{FILE_NAME}")
        && matches!(entry.fstype.as_str(), "hugetlbfs" | "tmpfs")
}

/// Detaches the mount at `path` (lazily: clients' mappings stay valid and the pages are freed
/// when the last one goes), without following a symbolic link at `path`.
fn detach(path: &str) -> std::io::Result<()> {
    let c = CString::new(path).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: umount2 reads the NUL-terminated path during the call only.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Removes this node's mount at `path` (the one named by `token`) if it is still the topmost
/// mount there; anything else is left alone with a warning. Returns whether `path` is free of
/// that mount afterwards.
///
/// Reading mountinfo and `umount2(path)` are two steps: another root process stacking a mount
/// at `path` in between would have its mount detached instead of ours. That is detected after
/// the fact (ours is still there: warned, and `false`, so the lock file keeps its record and the
/// next start on the name removes ours); the other process's mount is not restored.
pub(crate) fn unmount_if_ours(path: &str, token: &str) -> bool {
    match sys::mounts_at(path) {
        Ok(m) => match m.last() {
            Some(top) if is_ours(top, token) => match detach(path) {
                Ok(()) => check_detached(path, token, sys::mounts_at(path)),
                Err(e) => {
                    tracing::warn!(path, error = %e, "could not unmount the segment's bind mount");
                    false
                }
            },
            Some(top) => {
                tracing::warn!(
                    path,
                    source = %top.source,
                    "another mount now covers the segment's path; not unmounting it"
                );
                !m.iter().any(|e| is_ours(e, token))
            }
            None => true,
        },
        Err(e) => {
            tracing::warn!(error = %e, "cannot read /proc/self/mountinfo; not unmounting");
            false
        }
    }
}

/// After detaching the top mount at `path` believing it ours: whether ours is gone (`after` is
/// mountinfo read again). If ours is still there, a mount stacked on it in between was detached
/// instead (see [`unmount_if_ours`]): warned, `false`.
fn check_detached(path: &str, token: &str, after: std::io::Result<Vec<sys::MountEntry>>) -> bool {
    match after {
        Ok(m) if m.iter().any(|e| is_ours(e, token)) => {
            tracing::warn!(
                path,
                "a mount stacked over the segment's bind mount between kvnode's check and its \
                 unmount was detached instead of the segment's; the segment's mount stays (the \
                 next node of this name removes it)"
            );
            false
        }
        Ok(_) => true,
        Err(e) => {
            tracing::warn!(error = %e, "cannot re-read /proc/self/mountinfo after unmounting");
            true
        }
    }
}

/// Under the name's lock (no live node serves it), removes the bind mounts a node that died
/// left at `path`: each topmost mount there is detached only when its source is
/// `kvnode-segment-<token>` with the `token` recorded in the lock file, its file system is
/// hugetlbfs or tmpfs and it mounts that file system's `/segment`. Any other mount at `path` is
/// an error naming it, and is left alone. Returns how many it removed.
pub(crate) fn recover_stale(path: &str, token: Option<&str>) -> HwResult<usize> {
    let mut removed = 0;
    for _ in 0..MAX_STALE_MOUNTS {
        let mounts = sys::mounts_at(path)
            .map_err(|e| HwError::os_path("read", "/proc/self/mountinfo", e))?;
        let Some(top) = mounts.last() else {
            return Ok(removed);
        };
        match token {
            Some(t) if is_ours(top, t) => {
                detach(path)
                    .map_err(|e| HwError::os_path("umount2 (stale segment mount)", path, e))?;
                tracing::warn!(
                    path,
                    source = %top.source,
                    fstype = %top.fstype,
                    "removed the bind mount a kvnode that died left over its segment"
                );
                removed += 1;
            }
            _ => {
                return Err(HwError::Invalid(format!(
                    "{path} is a mount point (a {} mount of {:?}) that this node's name does not \
                     record as its own; kvnode leaves it alone: unmount it yourself or choose \
                     another --shm-name",
                    top.fstype, top.source
                )))
            }
        }
    }
    Err(HwError::Invalid(format!(
        "{path} still has mounts after kvnode removed {MAX_STALE_MOUNTS} of its own; left alone"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(source: &str, root: &str, fstype: &str) -> sys::MountEntry {
        sys::MountEntry {
            mount_point: "/dev/shm/x".into(),
            root: root.into(),
            fstype: fstype.into(),
            source: source.into(),
        }
    }

    /// Only a mount with this name's token, of the segment file, on a hugepage file system, is
    /// recognised as the node's own.
    #[test]
    fn ownership_needs_the_token_the_file_and_the_file_system() {
        let t = "abc-1";
        assert!(is_ours(
            &entry("kvnode-segment-abc-1", "/segment", "hugetlbfs"),
            t
        ));
        assert!(is_ours(
            &entry("kvnode-segment-abc-1", "/segment", "tmpfs"),
            t
        ));
        assert!(!is_ours(
            &entry("kvnode-segment-abc-2", "/segment", "hugetlbfs"),
            t
        ));
        assert!(!is_ours(
            &entry("kvnode-segment-abc-1", "/other", "hugetlbfs"),
            t
        ));
        assert!(!is_ours(
            &entry("kvnode-segment-abc-1", "/segment", "ext4"),
            t
        ));
        assert!(!is_ours(&entry("tmpfs", "/", "tmpfs"), t));
    }

    /// After detaching what looked like its own top mount, a node whose mount is still there
    /// (someone stacked one in between, which got detached instead) says it is not unmounted.
    #[test]
    fn a_mount_stacked_in_between_is_noticed_after_detaching() {
        let t = "abc-1";
        let ours = entry("kvnode-segment-abc-1", "/segment", "hugetlbfs");
        assert!(!check_detached("/dev/shm/x", t, Ok(vec![ours])));
        assert!(check_detached("/dev/shm/x", t, Ok(vec![])));
        let other = entry("tmpfs", "/", "tmpfs");
        assert!(check_detached("/dev/shm/x", t, Ok(vec![other])));
    }

    #[test]
    fn tokens_differ() {
        assert_ne!(new_token(), new_token());
    }
}
