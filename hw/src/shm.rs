//! POSIX shared memory segments (`shm_open` under `/dev/shm`).

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;

use crate::error::{HwError, HwResult};

/// Validates a segment name (no leading slash) and returns `"/<name>"` as a
/// C string, as `shm_open` wants it.
pub(crate) fn c_name(name: &str) -> HwResult<CString> {
    if name.is_empty()
        || name.len() > 250
        || name.contains('/')
        || name.contains('\0')
        || name == "."
        || name == ".."
    {
        return Err(HwError::Invalid(format!(
            "bad POSIX shm name {name:?}: must be 1..=250 bytes, without '/' or NUL"
        )));
    }
    CString::new(format!("/{name}")).map_err(|e| HwError::Invalid(e.to_string()))
}

fn shm_open(name: &CString, oflag: libc::c_int, mode: libc::mode_t) -> std::io::Result<OwnedFd> {
    // SAFETY: name is a valid NUL-terminated string; shm_open sets
    // FD_CLOEXEC itself and we add O_CLOEXEC for clarity.
    let fd = unsafe { libc::shm_open(name.as_ptr(), oflag | libc::O_CLOEXEC, mode) };
    if fd < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        // SAFETY: fd is a freshly opened descriptor nobody else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

fn shm_unlink(name: &CString) -> std::io::Result<()> {
    // SAFETY: name is a valid NUL-terminated string.
    if unsafe { libc::shm_unlink(name.as_ptr()) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Takes an exclusive `flock` without waiting: `Ok(false)` when another open file holds it.
/// The lock lasts as long as this open file description (any duplicate of `fd`) is open.
fn try_lock_exclusive(fd: &OwnedFd) -> std::io::Result<bool> {
    // SAFETY: flock on a descriptor we own; no memory is passed.
    if unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

/// `/dev/shm/<name>`, for messages.
fn segment_path(name: &str) -> String {
    format!("{}/{name}", crate::sys::DEV_SHM)
}

/// Opens an existing segment read-write. Errors name its path.
pub(crate) fn open_existing(name: &str) -> HwResult<OwnedFd> {
    let c = c_name(name)?;
    shm_open(&c, libc::O_RDWR, 0).map_err(|e| HwError::os_path("shm_open", &segment_path(name), e))
}

/// A named segment this process created. Invariant: while it lives,
/// `/dev/shm/<name>` was created by us (`O_EXCL`) with mode 0600; on drop the
/// name is unlinked if it still refers to the same inode (`dev`, `ino`).
#[derive(Debug)]
pub(crate) struct ShmSegment {
    name: String,
    c_name: CString,
    dev: u64,
    ino: u64,
}

impl ShmSegment {
    /// Creates `/dev/shm/<name>` exclusively with mode 0600 and takes an exclusive `flock` on
    /// it, held for as long as the returned descriptor (the pool's) is open. An existing segment
    /// of that name is removed only when it is stale: nobody holds its lock (a node that died)
    /// and it belongs to this user. A segment another running node holds is never touched: the
    /// call fails naming it. Returns the guard and the fd.
    pub(crate) fn create(name: &str) -> HwResult<(ShmSegment, OwnedFd)> {
        let c = c_name(name)?;
        let path = format!("{}/{name}", crate::sys::DEV_SHM);
        let mut removed_stale = false;
        let fd = loop {
            match shm_open(&c, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600) {
                Ok(fd) => break fd,
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) && !removed_stale => {
                    let old = shm_open(&c, libc::O_RDONLY, 0)
                        .map_err(|e| HwError::os_path("shm_open (existing segment)", &path, e))?;
                    if !try_lock_exclusive(&old).map_err(|e| HwError::os("flock", e))? {
                        return Err(HwError::Invalid(format!(
                            "the POSIX shm segment {path} is in use by a running node (it holds \
                             the segment's lock); choose another --shm-name or stop that node"
                        )));
                    }
                    let owner = File::from(old)
                        .metadata()
                        .map_err(|e| HwError::os("fstat", e))?
                        .uid();
                    // SAFETY: geteuid has no preconditions and cannot fail.
                    let me = unsafe { libc::geteuid() };
                    if owner != me {
                        return Err(HwError::Invalid(format!(
                            "a stale POSIX shm segment {path} belongs to uid {owner}, not to this \
                             node's uid {me}; remove it if no node uses it"
                        )));
                    }
                    match shm_unlink(&c) {
                        Ok(()) => tracing::warn!(
                            path,
                            "removed a stale POSIX shm segment (no node held its lock)"
                        ),
                        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                        Err(e) => return Err(HwError::os("shm_unlink (stale segment)", e)),
                    }
                    removed_stale = true;
                }
                Err(e) => return Err(HwError::os("shm_open(O_CREAT|O_EXCL)", e)),
            }
        };
        let file = File::from(fd);
        let md = match file.metadata() {
            Ok(md) => md,
            Err(e) => {
                let _ = shm_unlink(&c);
                return Err(HwError::os("fstat", e));
            }
        };
        let seg = ShmSegment {
            name: name.to_owned(),
            c_name: c,
            dev: md.dev(),
            ino: md.ino(),
        };
        // The umask may have removed bits from 0600; force exactly 0600.
        // SAFETY: fchmod on a descriptor we own.
        if unsafe { libc::fchmod(file.as_raw_fd(), 0o600) } != 0 {
            return Err(HwError::last_os("fchmod"));
        }
        let fd = OwnedFd::from(file);
        if !try_lock_exclusive(&fd).map_err(|e| HwError::os("flock", e))? {
            return Err(HwError::Invalid(format!(
                "the POSIX shm segment {path} was locked by another process right after this \
                 node created it"
            )));
        }
        Ok((seg, fd))
    }

    /// Name without the leading slash.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }
}

impl ShmSegment {
    /// Unlinks the name if it still refers to our inode (idempotent).
    pub(crate) fn unlink_if_ours(&self) {
        let path = format!("{}/{}", crate::sys::DEV_SHM, self.name);
        match std::fs::metadata(&path) {
            Ok(md) if md.dev() == self.dev && md.ino() == self.ino => {
                if let Err(e) = shm_unlink(&self.c_name) {
                    tracing::warn!(name = %self.name, error = %e, "shm_unlink failed");
                }
            }
            Ok(_) => tracing::warn!(
                name = %self.name,
                "POSIX shm name now belongs to another segment; not unlinking"
            ),
            Err(_) => {} // already gone
        }
    }
}

impl Drop for ShmSegment {
    fn drop(&mut self) {
        self.unlink_if_ours();
    }
}
