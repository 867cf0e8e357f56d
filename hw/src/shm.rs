//! POSIX shared memory segments (`shm_open` under `/dev/shm`).
//!
//! A node serving the segment `/dev/shm/<name>` holds an exclusive `flock` on its lock file
//! `/dev/shm/<name>.lock` (a regular file, mode 0600) from before it creates the segment until
//! after it unlinked it. That one lock both serialises creating and removing the name among
//! kvnode processes (two nodes starting at once on one name: exactly one gets it) and tells a
//! live node from a dead one (a segment whose lock file nobody holds is stale). The segment
//! itself carries no lock: its descriptor goes to clients over `SCM_RIGHTS`, and a lock on that
//! open file description would live on in every connected client after the node died.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::sync::Mutex;

use crate::error::{HwError, HwResult};
use crate::segment_mount::{self, PrivateHugeFile};

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
fn try_lock_exclusive(fd: BorrowedFd<'_>) -> std::io::Result<bool> {
    // SAFETY: flock on a descriptor the caller keeps open; no memory is passed.
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

/// `/dev/shm/<name>.lock`: the lock file of segment `name` (see the module documentation).
fn lock_path(name: &str) -> String {
    format!("{}/{name}{LOCK_SUFFIX}", crate::sys::DEV_SHM)
}

/// What a segment's lock file name adds to the segment's name; segment names may not end in it.
const LOCK_SUFFIX: &str = ".lock";
/// How a lock file records the bind mount its node made at the segment's path: this prefix,
/// then the mount's token (see [`crate::segment_mount`]). An empty lock file records none.
const MARKER_PREFIX: &str = "kvnode-segment-mount ";
/// The mode of a segment file the node created (and of the placeholder once no mount covers it).
const SEGMENT_MODE: u32 = 0o600;
/// The mode of the placeholder while a bind mount covers it: a non-root client of a mount
/// namespace without the mount gets `EACCES` instead of an empty file (root is not stopped).
const MOUNTED_PLACEHOLDER_MODE: u32 = 0o000;
/// The most of a lock file read when looking for the mount record.
const MAX_MARKER_BYTES: u64 = 256;

/// Whether two metadata describe the same file (device and inode).
fn same_file(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    a.dev() == b.dev() && a.ino() == b.ino()
}

/// Opens an existing segment read-write. Errors name its path.
pub(crate) fn open_existing(name: &str) -> HwResult<OwnedFd> {
    let c = c_name(name)?;
    shm_open(&c, libc::O_RDWR, 0).map_err(|e| HwError::os_path("shm_open", &segment_path(name), e))
}

/// How often [`NameLock::try_take`] starts over when the lock file it opened was removed or
/// replaced before it was locked (each time, the process that removed it had released it).
const LOCK_FILE_ATTEMPTS: usize = 100;

/// An exclusive `flock` on the lock file of a segment name.
///
/// Invariant: while it lives, this process holds the lock on the very file `path` names (checked
/// after locking: same device and inode), so no other kvnode creates or removes the segment.
/// When `created` (this process created the file), dropping it removes the file again, but only
/// while `path` still names that file; then the lock is released by closing it.
#[derive(Debug)]
struct NameLock {
    file: File,
    path: String,
    created: bool,
}

impl NameLock {
    /// Takes the lock on the lock file `path`, creating the file (mode 0600) if there is none,
    /// without waiting: `Ok(None)` when another process holds it (a running node). Symbolic
    /// links are not followed, and anything but a regular file there is an error naming it.
    fn try_take(path: &str, segment: &str) -> HwResult<Option<NameLock>> {
        let flags = libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
        for _ in 0..LOCK_FILE_ATTEMPTS {
            let created = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(flags)
                .open(path);
            let (file, created) = match created {
                Ok(f) => (f, true),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    match OpenOptions::new()
                        .read(true)
                        .write(true)
                        .custom_flags(flags)
                        .open(path)
                    {
                        Ok(f) => (f, false),
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                            return Err(not_a_lock_file(path, segment, "a symbolic link"))
                        }
                        Err(e) if e.raw_os_error() == Some(libc::EISDIR) => {
                            return Err(not_a_lock_file(path, segment, "not a regular file"))
                        }
                        Err(e) => return Err(HwError::os_path("open", path, e)),
                    }
                }
                Err(e) => return Err(HwError::os_path("create", path, e)),
            };
            let mut lock = NameLock {
                file,
                path: path.to_owned(),
                created,
            };
            let md = lock
                .file
                .metadata()
                .map_err(|e| HwError::os_path("fstat", path, e))?;
            if !md.file_type().is_file() {
                lock.created = false;
                return Err(not_a_lock_file(path, segment, "not a regular file"));
            }
            if created {
                // The umask may have removed bits from 0600; force exactly 0600 (our file).
                lock.file
                    .set_permissions(std::fs::Permissions::from_mode(0o600))
                    .map_err(|e| HwError::os_path("fchmod", path, e))?;
            }
            if !try_lock_exclusive(lock.file.as_fd())
                .map_err(|e| HwError::os_path("flock", path, e))?
            {
                // Another node opened the file and locked it first: it is that node's now.
                lock.created = false;
                return Ok(None);
            }
            match std::fs::symlink_metadata(path) {
                Ok(now) if same_file(&now, &md) => return Ok(Some(lock)),
                // Removed or replaced between our open and our lock: whoever did it had
                // released it. Not ours to remove; start over on what the path names now.
                _ => lock.created = false,
            }
        }
        Err(HwError::Invalid(format!(
            "the lock file {path} was removed or replaced {LOCK_FILE_ATTEMPTS} times while kvnode \
             was locking it; is another program deleting files in {}?",
            crate::sys::DEV_SHM
        )))
    }

    /// The mount token recorded in the lock file (see [`crate::segment_mount`]), if any.
    fn read_marker(&self) -> Option<String> {
        use std::io::Read;
        let mut text = String::new();
        (&self.file)
            .take(MAX_MARKER_BYTES)
            .read_to_string(&mut text)
            .ok()?;
        let token = text.trim().strip_prefix(MARKER_PREFIX)?.trim();
        let ok = !token.is_empty()
            && token
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-');
        ok.then(|| token.to_owned())
    }

    /// Records `token` as the mount this node made at the segment's path (replacing any
    /// earlier record); durable as long as the file is.
    fn write_marker(&self, token: &str) -> HwResult<()> {
        use std::os::unix::fs::FileExt;
        let text = format!("{MARKER_PREFIX}{token}\n");
        self.file
            .set_len(0)
            .and_then(|()| self.file.write_all_at(text.as_bytes(), 0))
            .map_err(|e| HwError::os_path("write (mount record)", &self.path, e))
    }

    /// Forgets the recorded mount (the file becomes empty again).
    fn clear_marker(&self) {
        if let Err(e) = self.file.set_len(0) {
            tracing::warn!(path = %self.path, error = %e, "could not clear the mount record");
        }
    }

    /// Whether `path` still names the file this lock holds.
    fn is_at_path(&self) -> bool {
        match (self.file.metadata(), std::fs::symlink_metadata(&self.path)) {
            (Ok(mine), Ok(now)) => same_file(&mine, &now),
            _ => false,
        }
    }
}

impl Drop for NameLock {
    fn drop(&mut self) {
        // Removed while still locked: a node opening the old file meanwhile sees, once it has
        // the lock, that the path no longer names it, and starts over.
        if self.created && self.is_at_path() {
            if let Err(e) = std::fs::remove_file(&self.path) {
                tracing::warn!(path = %self.path, error = %e, "could not remove the shm lock file");
            }
        }
    }
}

/// The error for something at a lock file's path that is not a lock file.
fn not_a_lock_file(path: &str, segment: &str, what: &str) -> HwError {
    HwError::Invalid(format!(
        "{path} is {what}; kvnode uses that name as the lock file of the POSIX shm segment \
         {segment} and leaves it alone: remove it yourself or choose another --shm-name"
    ))
}

/// A named segment this process created. Invariant: while `lock` holds the name's lock file,
/// `/dev/shm/<name>` was created by us (`O_EXCL`, under that lock) with mode 0600 (0000 while
/// a bind mount of ours covers it), with device and inode (`dev`, `ino`). [`ShmSegment::unlink_if_ours`] (also on drop) unlinks the name if
/// it still refers to that inode and then releases the lock.
#[derive(Debug)]
pub(crate) struct ShmSegment {
    name: String,
    c_name: CString,
    dev: u64,
    ino: u64,
    /// The name's lock; `None` once the name was given up.
    lock: Mutex<Option<NameLock>>,
    /// The token of the bind mount this node put over the name (a hugepage file, see
    /// [`crate::segment_mount`]); `None` for a plain tmpfs segment.
    mount_token: Option<String>,
}

impl ShmSegment {
    /// Creates `/dev/shm/<name>` exclusively with mode 0600, holding the lock file
    /// `/dev/shm/<name>.lock` (see the module documentation) until the name is unlinked. An
    /// existing segment of that name is removed only when it is stale: no node holds its lock
    /// file, it belongs to this user, it is a regular file, no process holds a lock on it (a
    /// node of an earlier version locked the segment itself), and the name still refers to the
    /// file just checked. A segment a running node holds is never touched: the call fails naming
    /// it. Returns the guard and the fd (which carries no lock, so it may go to clients).
    ///
    /// Before creating anything, a bind mount a node that died left at the name is removed if
    /// the lock file records it (see [`segment_mount::recover_stale`]); any other mount there
    /// is an error naming it. A hugepage file goes over the new segment with
    /// [`ShmSegment::mount_over`].
    pub(crate) fn create(name: &str) -> HwResult<(ShmSegment, OwnedFd)> {
        let c = c_name(name)?;
        if name.ends_with(LOCK_SUFFIX) {
            return Err(HwError::Invalid(format!(
                "bad POSIX shm name {name:?}: names ending in {LOCK_SUFFIX:?} are kvnode's lock \
                 files"
            )));
        }
        let path = segment_path(name);
        let lock_path = lock_path(name);
        let Some(lock) = NameLock::try_take(&lock_path, &path)? else {
            return Err(HwError::Invalid(format!(
                "the POSIX shm segment {path} is in use by a running node (it holds the lock \
                 file {lock_path}); stop that node or choose another --shm-name"
            )));
        };
        // Under the lock no other kvnode creates or removes the name.
        let stale_token = lock.read_marker();
        segment_mount::recover_stale(&path, stale_token.as_deref())?;
        if stale_token.is_some() {
            lock.clear_marker();
        }
        remove_stale(&c, &path)?;
        let fd = match shm_open(&c, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600) {
            Ok(fd) => fd,
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                return Err(HwError::Invalid(format!(
                    "the POSIX shm segment {path} was created by another program while kvnode \
                     held its lock file {lock_path}; it is left alone"
                )))
            }
            Err(e) => return Err(HwError::os_path("shm_open(O_CREAT|O_EXCL)", &path, e)),
        };
        let file = File::from(fd);
        let md = match file.metadata() {
            Ok(md) => md,
            Err(e) => {
                let _ = shm_unlink(&c);
                return Err(HwError::os_path("fstat", &path, e));
            }
        };
        // From here on, dropping `seg` unlinks the name (still ours) and releases the lock.
        let seg = ShmSegment {
            name: name.to_owned(),
            c_name: c,
            dev: md.dev(),
            ino: md.ino(),
            lock: Mutex::new(Some(lock)),
            mount_token: None,
        };
        // The umask may have removed bits from 0600; force exactly 0600.
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(|e| HwError::os_path("fchmod", &path, e))?;
        Ok((seg, OwnedFd::from(file)))
    }

    /// Bind-mounts `huge`'s file over this (empty) segment, recording the mount's token in the
    /// lock file first: the name then opens `huge`'s file in this mount namespace (and in those
    /// the mount propagates to). `placeholder` is the segment's own descriptor: while the mount
    /// is up its mode is 0000, so that a non-root client of a mount namespace that does not see
    /// the mount gets `EACCES` opening the name instead of an empty file whose mapping raises
    /// SIGBUS (root bypasses the mode: a partial guard only).
    ///
    /// On failure everything this call did is undone (record, mode, any mount it made) and the
    /// segment is the plain empty one again, unless the mount could not be removed: then
    /// [`ShmSegment::is_mounted`] stays true and the segment must not serve as a plain one.
    pub(crate) fn mount_over(
        &mut self,
        huge: &PrivateHugeFile,
        placeholder: &File,
    ) -> HwResult<()> {
        let path = segment_path(&self.name);
        placeholder
            .set_permissions(std::fs::Permissions::from_mode(MOUNTED_PLACEHOLDER_MODE))
            .map_err(|e| HwError::os_path("fchmod (placeholder)", &path, e))?;
        let res = self.with_lock(|l| l.write_marker(huge.token()));
        let res = res.and_then(|()| {
            self.mount_token = Some(huge.token().to_owned());
            // From here on, dropping `self` also unmounts (if mounted) and clears the record.
            huge.expose(&path)
        });
        let Err(e) = res else { return Ok(()) };
        if let Some(token) = &self.mount_token {
            if !segment_mount::unmount_if_ours(&path, token) {
                return Err(e);
            }
        }
        self.mount_token = None;
        if let Err(e) = self.with_lock(|l| {
            l.clear_marker();
            Ok(())
        }) {
            tracing::debug!(error = %e, "no lock to clear the mount record in");
        }
        if let Err(e) = placeholder.set_permissions(std::fs::Permissions::from_mode(SEGMENT_MODE)) {
            tracing::warn!(path, error = %e, "could not give the segment its mode 0600 back");
        }
        Err(e)
    }

    /// Whether a bind mount this segment made may still cover its name (see
    /// [`ShmSegment::mount_over`]).
    pub(crate) fn is_mounted(&self) -> bool {
        self.mount_token.is_some()
    }

    /// Name without the leading slash.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Runs `f` on the name's lock (an error once the name was given up).
    fn with_lock<R>(&self, f: impl FnOnce(&NameLock) -> HwResult<R>) -> HwResult<R> {
        match self.lock.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(l) => f(l),
            None => Err(HwError::Invalid(format!(
                "the segment {} was already given up",
                self.name
            ))),
        }
    }

    /// Unlinks the name if it still refers to our inode, then releases the name's lock (and
    /// removes the lock file if this process created it and it is still that file).
    /// Idempotent: only the first call does anything.
    pub(crate) fn unlink_if_ours(&self) {
        let Some(mut lock) = self.lock.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return;
        };
        let path = segment_path(&self.name);
        if let Some(token) = &self.mount_token {
            if !segment_mount::unmount_if_ours(&path, token) {
                // Still mounted: keep the lock file and its record so that the next start on
                // this name removes the mount.
                lock.created = false;
                return;
            }
            lock.clear_marker();
        }
        match std::fs::metadata(&path) {
            Ok(md) if md.dev() == self.dev && md.ino() == self.ino => {
                if let Err(e) = shm_unlink(&self.c_name) {
                    tracing::warn!(path, error = %e, "shm_unlink failed");
                }
            }
            Ok(_) => tracing::warn!(
                path,
                "POSIX shm name now belongs to another segment; not unlinking"
            ),
            Err(_) => {} // already gone
        }
        drop(lock);
    }

    /// Gives the name up the way a node that dies does: the lock is released, the segment and
    /// the lock file stay.
    #[cfg(test)]
    pub(crate) fn abandon(self) {
        if let Some(mut lock) = self.lock.lock().unwrap_or_else(|p| p.into_inner()).take() {
            lock.created = false;
        }
    }
}

/// Bytes of memory the segment `name` occupies if it is stale, i.e. if [`ShmSegment::create`]
/// would remove it (no node holds its lock file, it is a regular file of this user, and nobody
/// holds a lock on it); 0 when there is none, or it is live or not removable. A snapshot: it
/// creates nothing and holds no lock once it returns (it tries both locks for a moment).
pub(crate) fn stale_segment_bytes(name: &str) -> u64 {
    let Ok(c) = c_name(name) else { return 0 };
    if name.ends_with(LOCK_SUFFIX) {
        return 0;
    }
    // A node's bind mount there holds hugetlb pages or a private tmpfs's, not /dev/shm's.
    if crate::sys::mounts_at(&segment_path(name)).map_or(true, |m| !m.is_empty()) {
        return 0;
    }
    let flags = libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
    match OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(lock_path(name))
    {
        Ok(lock) => {
            let is_file = lock.metadata().is_ok_and(|m| m.file_type().is_file());
            if !is_file || !try_lock_exclusive(lock.as_fd()).unwrap_or(false) {
                return 0; // a running node holds it (or create would refuse the name)
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(_) => return 0,
    }
    let Ok(old) = shm_open(&c, libc::O_RDONLY | libc::O_NONBLOCK, 0).map(File::from) else {
        return 0;
    };
    let Ok(md) = old.metadata() else { return 0 };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if !md.file_type().is_file()
        || md.uid() != me
        || !try_lock_exclusive(old.as_fd()).unwrap_or(false)
    {
        return 0;
    }
    md.blocks().saturating_mul(512)
}

/// Removes the segment `c` (at `path`) if it exists and is stale; the caller holds the name's
/// lock file, so no running node serves it (see [`ShmSegment::create`] for the other checks).
fn remove_stale(c: &CString, path: &str) -> HwResult<()> {
    let old = match shm_open(c, libc::O_RDONLY | libc::O_NONBLOCK, 0) {
        Ok(fd) => File::from(fd),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
        Err(e) => return Err(HwError::os_path("shm_open (existing segment)", path, e)),
    };
    let md = old
        .metadata()
        .map_err(|e| HwError::os_path("fstat", path, e))?;
    if !md.file_type().is_file() {
        return Err(HwError::Invalid(format!(
            "{path} exists and is not a regular file, so not a POSIX shm segment; kvnode leaves \
             it alone: remove it yourself or choose another --shm-name"
        )));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if md.uid() != me {
        return Err(HwError::Invalid(format!(
            "a stale POSIX shm segment {path} belongs to uid {}, not to this node's uid {me}; \
             remove it if no node uses it",
            md.uid()
        )));
    }
    if !try_lock_exclusive(old.as_fd()).map_err(|e| HwError::os_path("flock", path, e))? {
        return Err(HwError::Invalid(format!(
            "the POSIX shm segment {path} is locked by another process: a node of an earlier \
             kvnode version serving it, or a client still connected to such a node (the segment's \
             descriptor it received carries that node's lock); stop them or choose another \
             --shm-name"
        )));
    }
    // Still the file just checked? No kvnode changes the name while we hold its lock file;
    // another program might have.
    match std::fs::symlink_metadata(path) {
        Ok(now) if same_file(&now, &md) => {}
        Ok(_) => {
            return Err(HwError::Invalid(format!(
                "the POSIX shm segment {path} was replaced by another program while kvnode was \
                 checking whether it is stale; it is left alone"
            )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(HwError::os_path("stat", path, e)),
    }
    match shm_unlink(c) {
        Ok(()) => tracing::warn!(
            path,
            "removed a stale POSIX shm segment (no node held its lock file)"
        ),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
        Err(e) => return Err(HwError::os_path("shm_unlink (stale segment)", path, e)),
    }
    Ok(())
}

impl Drop for ShmSegment {
    fn drop(&mut self) {
        self.unlink_if_ours();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Barrier};

    fn unique(tag: &str) -> String {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        format!(
            "kvnode-shm-test-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        )
    }

    fn id_of(path: &str) -> Option<(u64, u64)> {
        std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
    }

    /// Two nodes creating one name at once, over and over, with and without a stale segment
    /// left there: exactly one wins, the other is told the name is in use, and the winner's
    /// segment is the one the name refers to (it is never unlinked under the winner).
    #[test]
    fn two_creates_racing_on_one_name_leave_exactly_one_segment() {
        let name = unique("race");
        let path = segment_path(&name);
        for round in 0..400 {
            let barrier = Arc::new(Barrier::new(2));
            let results: Vec<_> = (0..2)
                .map(|_| {
                    let (b, n) = (barrier.clone(), name.clone());
                    std::thread::spawn(move || {
                        b.wait();
                        ShmSegment::create(&n)
                    })
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|t| t.join().unwrap())
                .collect();
            let (won, lost): (Vec<_>, Vec<_>) = results.into_iter().partition(Result::is_ok);
            assert_eq!(
                won.len(),
                1,
                "round {round}: {} creates succeeded",
                won.len()
            );
            let e = lost.into_iter().next().unwrap().unwrap_err().to_string();
            assert!(
                e.contains("in use by a running node") && e.contains(&path),
                "round {round}: {e}"
            );
            let (seg, fd) = won.into_iter().next().unwrap().unwrap();
            assert_eq!(
                id_of(&path),
                Some((seg.dev, seg.ino)),
                "round {round}: the name refers to the winner's segment"
            );
            drop(fd);
            if round % 2 == 0 {
                seg.abandon(); // a stale segment for the next round
            } else {
                drop(seg);
                assert!(id_of(&path).is_none(), "round {round}: unlinked on drop");
            }
        }
        drop(ShmSegment::create(&name).unwrap());
        assert!(id_of(&path).is_none());
        let _ = std::fs::remove_file(lock_path(&name)); // left by the abandoned rounds
    }

    /// A client still holding the segment's descriptor (as received over SCM_RIGHTS) after its
    /// node died does not keep a new node out: the descriptor carries no lock.
    #[test]
    fn a_client_holding_the_descriptor_of_a_dead_nodes_segment_does_not_block_a_restart() {
        let name = unique("client");
        let path = segment_path(&name);
        let (seg, fd) = ShmSegment::create(&name).unwrap();
        let client = fd.try_clone().unwrap(); // the same open file description
        drop(fd);
        seg.abandon(); // the node dies
        let (seg2, _fd2) = ShmSegment::create(&name).expect("the restart is not refused");
        assert_eq!(id_of(&path), Some((seg2.dev, seg2.ino)));
        // And a second node is still refused while the first one runs.
        let e = ShmSegment::create(&name).unwrap_err().to_string();
        assert!(e.contains("in use by a running node"), "{e}");
        drop(client);
        drop(seg2);
        assert!(id_of(&path).is_none());
        let _ = std::fs::remove_file(lock_path(&name));
    }

    /// A stale segment counts with the memory it occupies; a live one, or none, with nothing.
    #[test]
    fn the_memory_of_a_stale_segment_is_counted_only_while_it_is_stale() {
        use std::io::Write;
        let name = unique("stale-bytes");
        assert_eq!(stale_segment_bytes(&name), 0, "no segment");
        let (seg, fd) = ShmSegment::create(&name).unwrap();
        let mut f = File::from(fd);
        f.write_all(&vec![1u8; 4 << 20]).unwrap(); // 4 MiB of tmpfs pages
        assert_eq!(
            stale_segment_bytes(&name),
            0,
            "live: its node holds the lock file"
        );
        drop(f);
        seg.abandon();
        assert!(stale_segment_bytes(&name) >= 4 << 20, "stale: counted");
        let (seg2, _fd2) = ShmSegment::create(&name).unwrap();
        assert_eq!(stale_segment_bytes(&name), 0, "replaced by a live one");
        drop(seg2);
        let _ = std::fs::remove_file(lock_path(&name));
    }

    /// The lock file: created 0600 and removed again by the node that created it; one left by a
    /// node that died is reused and left in place; something else at its path (a symbolic
    /// link, a directory) is refused naming it and left alone; segment names ending in
    /// ".lock" are refused.
    #[test]
    fn the_lock_file_is_the_nodes_own_and_nothing_else_is_touched() {
        let name = unique("lockfile");
        let lock = lock_path(&name);
        let (seg, _fd) = ShmSegment::create(&name).unwrap();
        let md = std::fs::symlink_metadata(&lock).unwrap();
        assert!(md.file_type().is_file());
        assert_eq!(md.permissions().mode() & 0o7777, 0o600);
        drop(seg);
        assert!(std::fs::symlink_metadata(&lock).is_err(), "removed");

        std::fs::write(&lock, b"").unwrap(); // left by a node that died
        drop(ShmSegment::create(&name).unwrap());
        assert!(std::fs::symlink_metadata(&lock).is_ok(), "not ours: kept");
        std::fs::remove_file(&lock).unwrap();

        let target = format!("{lock}.target");
        std::fs::write(&target, b"someone's").unwrap();
        std::os::unix::fs::symlink(&target, &lock).unwrap();
        let e = ShmSegment::create(&name).unwrap_err().to_string();
        assert!(e.contains(&lock) && e.contains("symbolic link"), "{e}");
        assert_eq!(std::fs::read(&target).unwrap(), b"someone's");
        assert!(id_of(&segment_path(&name)).is_none(), "no segment created");
        std::fs::remove_file(&lock).unwrap();
        std::fs::remove_file(&target).unwrap();

        std::fs::create_dir(&lock).unwrap();
        let e = ShmSegment::create(&name).unwrap_err().to_string();
        assert!(e.contains(&lock) && e.contains("not a regular file"), "{e}");
        std::fs::remove_dir(&lock).unwrap();

        let e = ShmSegment::create(&format!("{name}.lock"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("lock files"), "{e}");
    }
}
