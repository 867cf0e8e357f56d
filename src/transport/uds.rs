//! Unix-domain-socket transport: socket file with restrictive permissions, one reader thread per
//! connection, responses written without blocking and queued per connection when the client
//! reads slowly (see `reply`), the pool fd passed with SCM_RIGHTS.
//!
//! The socket file is handled so that the node never removes, truncates or chmods anything it
//! did not create: [`bind`] replaces only a stale *socket* (nobody accepting), refuses anything
//! else at the path, never creates directories, and remembers the identity (device, inode) of the
//! file it created; [`BoundSocket::unlink_if_ours`] removes the path only while it is still that
//! file. The accept loop is woken for shutdown through the listening fd itself ([`wake_acceptor`]),
//! never through the path, which may be gone or belong to someone else by then.

use std::fs::FileType;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Result};

pub use super::reply::{UdsReplySink, REPLY_QUEUE_FDS};

/// What a file system object is, in words for error messages ("a regular file", "a directory",
/// "a symbolic link", "a fifo (named pipe)", ...). Invariant: total over every file type.
pub fn describe_file_type(ft: &FileType) -> &'static str {
    if ft.is_file() {
        "a regular file"
    } else if ft.is_dir() {
        "a directory"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else if ft.is_fifo() {
        "a fifo (named pipe)"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else {
        "a file of unknown type"
    }
}

/// The socket file a node bound. Invariant: `id` identifies the socket file this node created
/// at `path` (captured right after `bind`, through a descriptor that does not follow symbolic
/// links), so the node can tell its own file from one someone put there later.
#[derive(Debug)]
pub struct BoundSocket {
    path: PathBuf,
    id: FileId,
}

/// Which file a path names: device and inode, plus the birth time (or, where the file system
/// has none, the change time), because file systems such as ext4 hand a freed inode number to
/// the next file created at once. Invariant: two different files created at different instants
/// never compare equal; the same file compares equal unless, without a birth time, its
/// metadata was changed (then the node leaves the file alone: the safe side).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    born: (i64, i64),
}

impl FileId {
    fn of(m: &std::fs::Metadata) -> FileId {
        let born = match m.created().map(|t| t.duration_since(std::time::UNIX_EPOCH)) {
            Ok(Ok(d)) => (d.as_secs() as i64, i64::from(d.subsec_nanos())),
            _ => (m.ctime(), m.ctime_nsec()),
        };
        FileId {
            dev: m.dev(),
            ino: m.ino(),
            born,
        }
    }
}

impl BoundSocket {
    /// The path the socket was bound at.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether `path` still holds the very socket file this node created (same device, inode and
    /// birth time, still a socket). A snapshot: it may change right after.
    pub fn is_ours(&self) -> bool {
        match std::fs::symlink_metadata(&self.path) {
            Ok(m) => m.file_type().is_socket() && FileId::of(&m) == self.id,
            Err(_) => false,
        }
    }

    /// Removes the socket file if the path still holds the file this node created and nobody
    /// accepts on it (call it after [`wake_acceptor`], or when the listener is gone); anything
    /// else found there (nothing, another node's socket, a file someone put there) is left
    /// alone. Returns whether the file was removed. Idempotent; never blocks on the socket.
    pub fn unlink_if_ours(&self) -> bool {
        // Serialised with other kvnodes binding or removing a socket in the same directory. A
        // lock someone else holds for long never holds up the node's shutdown: the file stays.
        let _dir = match DirLock::take(&self.path, DIR_LOCK_WAIT) {
            Ok(l) => l,
            Err(busy) => {
                tracing::warn!(
                    path = %self.path.display(),
                    directory = %busy.dir.display(),
                    "another process holds a lock on the socket's directory; leaving the socket \
                     file in place (remove it yourself if no node uses it)"
                );
                return false;
            }
        };
        self.unlink_if_ours_locked()
    }

    /// [`BoundSocket::unlink_if_ours`] for a caller that already holds the [`DirLock`] of the
    /// socket's directory (taking it again, through another open file description, would wait
    /// for the caller itself forever).
    fn unlink_if_ours_locked(&self) -> bool {
        let accepting = !matches!(
            probe(&self.path),
            Err(ref e) if e.kind() == io::ErrorKind::ConnectionRefused
        );
        if !self.is_ours() || accepting {
            tracing::info!(
                path = %self.path.display(),
                "socket path no longer holds this node's socket; leaving it alone"
            );
            return false;
        }
        match std::fs::remove_file(&self.path) {
            Ok(()) => true,
            Err(e) => {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!(path = %self.path.display(), error = %e, "could not remove socket file");
                }
                false
            }
        }
    }
}

/// How long kvnode tries to take the lock on a socket's directory before giving up.
const DIR_LOCK_WAIT: Duration = Duration::from_secs(3);

/// An exclusive `flock` on the directory of a socket path, held while kvnode checks, removes
/// or binds a socket there (advisory: it orders kvnode processes, creates no file, and is
/// released when dropped). Where the directory cannot be opened or locked at all the lock is
/// skipped (the operations still run); where another process holds it for longer than the
/// wait, [`DirLock::take`] says so instead of waiting for it.
struct DirLock {
    _held: Option<std::fs::File>,
}

/// The lock on `dir` was held by another process for the whole wait.
#[derive(Debug)]
struct DirBusy {
    dir: PathBuf,
}

impl DirLock {
    /// Takes the lock on the directory of `path`, trying without blocking until `wait` has
    /// passed: any process that can open the directory can lock it, so a blocking `flock` could
    /// hold up the node's start-up or shutdown forever.
    fn take(path: &Path, wait: Duration) -> std::result::Result<DirLock, DirBusy> {
        use rustix::fs::FlockOperation;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let Ok(file) = std::fs::File::open(dir) else {
            return Ok(DirLock { _held: None });
        };
        let deadline = Instant::now() + wait;
        loop {
            match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => return Ok(DirLock { _held: Some(file) }),
                Err(e) if e == rustix::io::Errno::WOULDBLOCK => {
                    if Instant::now() >= deadline {
                        return Err(DirBusy {
                            dir: dir.to_path_buf(),
                        });
                    }
                    std::thread::sleep(DIR_LOCK_RETRY);
                }
                Err(e) if e == rustix::io::Errno::INTR => {}
                // Locks not supported here (some network file systems): go on without.
                Err(_) => return Ok(DirLock { _held: None }),
            }
        }
    }
}

/// Pause between two tries of [`DirLock::take`].
const DIR_LOCK_RETRY: Duration = Duration::from_millis(10);

/// Binds the node's socket at `path` with permission bits `mode`.
///
/// Invariants: the directory of `path` must exist (it is never created); an existing *socket*
/// at `path` that nobody accepts on (stale) is removed and replaced; a live one is an error, so
/// two nodes never share a path; anything else at `path` (regular file, directory, symbolic
/// link, fifo, device) is an error naming the path and what it is, and is left untouched. The
/// file gets exactly `mode` (chmod through a descriptor of the file just created, never through
/// a path that could meanwhile name something else). On error nothing this call created remains.
pub fn bind(path: &Path, mode: u32) -> Result<(UnixListener, BoundSocket)> {
    bind_with(path, mode, |p, perms| std::fs::set_permissions(p, perms))
}

/// [`bind`], setting the permission bits with `set_mode` (tests inject a failing one).
fn bind_with(
    path: &Path,
    mode: u32,
    set_mode: impl Fn(&Path, std::fs::Permissions) -> io::Result<()>,
) -> Result<(UnixListener, BoundSocket)> {
    if mode > 0o777 {
        return Err(Error::invalid(format!(
            "socket mode {mode:#o} has bits beyond 0777 (permission bits only)"
        )));
    }
    check_socket_dir(path)?;
    // The check, the removal of a stale socket and the bind happen as one step for every other
    // kvnode using this directory: two nodes starting at once on a stale socket can no longer
    // both remove it and bind.
    let _dir = DirLock::take(path, DIR_LOCK_WAIT).map_err(|busy| {
        Error::new(
            ErrorKind::Io,
            format!(
                "another process holds a lock on {} (kvnode locks the socket's directory for a \
                 moment to bind {}) and did not release it within {} s; `lslocks` shows which \
                 process holds it; stop it or choose another --socket",
                busy.dir.display(),
                path.display(),
                DIR_LOCK_WAIT.as_secs(),
            ),
        )
    })?;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => replace_stale_socket(path)?,
        Ok(m) => {
            let what = describe_file_type(&m.file_type());
            let target = if m.file_type().is_symlink() {
                std::fs::read_link(path)
                    .map(|t| format!(" to {}", t.display()))
                    .unwrap_or_default()
            } else {
                String::new()
            };
            return Err(Error::invalid(format!(
                "the socket path {} exists and is {what}{target}, not a socket; kvnode only \
                 replaces a stale socket, never other files (choose another --socket, or remove it \
                 yourself)",
                path.display()
            )));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(Error::from(e)
                .context(format!("cannot inspect the socket path {}", path.display())))
        }
    }
    // Created with its final permission bits (no window in which others may connect).
    let old_umask = rustix::process::umask(rustix::fs::Mode::from_raw_mode(!mode & 0o777));
    let bound_listener = UnixListener::bind(path);
    rustix::process::umask(old_umask);
    let listener = bound_listener.map_err(|e| {
        let what = if e.kind() == io::ErrorKind::AddrInUse {
            format!(
                "cannot bind the socket {}: something was created there meanwhile",
                path.display()
            )
        } else {
            format!("cannot bind the socket {}", path.display())
        };
        Error::from(e).context(what)
    })?;
    // From here on the file is ours: remove it again if anything below fails.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            let _ = std::fs::remove_file(path);
            Error::from(e).context(format!(
                "cannot open the new socket file {}",
                path.display()
            ))
        })?;
    let meta = file.metadata().map_err(|e| {
        let _ = std::fs::remove_file(path);
        Error::from(e).context(format!(
            "cannot stat the new socket file {}",
            path.display()
        ))
    })?;
    if !meta.file_type().is_socket() {
        // Replaced between bind and open: not ours to touch any more.
        return Err(Error::new(
            ErrorKind::Io,
            format!(
                "the socket file {} was replaced by {} right after it was bound",
                path.display(),
                describe_file_type(&meta.file_type())
            ),
        ));
    }
    let mut bound = BoundSocket {
        path: path.to_path_buf(),
        id: FileId::of(&meta),
    };
    // chmod the inode the descriptor pins (an O_PATH descriptor cannot be fchmod'ed; its
    // /proc/self/fd link resolves to exactly that inode).
    let by_fd = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
    let chmod = set_mode(&by_fd, std::fs::Permissions::from_mode(mode)).or_else(|e| {
        // Without /proc: chmod by path, still only while the path holds our file.
        if e.kind() == io::ErrorKind::NotFound && bound.is_ours() {
            set_mode(path, std::fs::Permissions::from_mode(mode))
        } else {
            Err(e)
        }
    });
    if let Err(e) = chmod {
        drop(listener);
        // `_dir` is held: remove the file under it (taking it again would wait for ourselves).
        bound.unlink_if_ours_locked();
        return Err(Error::from(e).context(format!(
            "cannot set mode {mode:04o} on the socket {}",
            path.display()
        )));
    }
    // Without a birth time the identity includes the change time, which the chmod just moved.
    if let Ok(m) = file.metadata() {
        bound.id = FileId::of(&m);
    }
    Ok((listener, bound))
}

/// The directory a socket path lives in must exist already: kvnode creates no directories.
fn check_socket_dir(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => return Ok(()), // a bare name: the current directory
    };
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(m) => Err(Error::invalid(format!(
            "the socket directory {} is {}, not a directory",
            dir.display(),
            describe_file_type(&m.file_type())
        ))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(Error::invalid(format!(
            "the socket directory {} does not exist (kvnode does not create directories; create \
             it, or choose another --socket)",
            dir.display()
        ))),
        Err(e) => {
            Err(Error::from(e)
                .context(format!("cannot use the socket directory {}", dir.display())))
        }
    }
}

/// Connects to the socket at `path` without blocking and hangs up at once: `Ok` when something
/// accepts on it, `ConnectionRefused` when nothing listens (a stale socket, or a listener that
/// was shut down), `WouldBlock` when a listener's accept queue is full.
fn probe(path: &Path) -> io::Result<()> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        None,
    )?;
    let addr = SocketAddrUnix::new(path)?;
    rustix::net::connect(&fd, &addr)?;
    Ok(())
}

/// `path` is a socket: removes it if nobody accepts on it (stale), else refuses.
fn replace_stale_socket(path: &Path) -> Result<()> {
    match probe(path) {
        Ok(_) => Err(Error::invalid(format!(
            "the socket {} is in use by a running node (or another program accepting on it); \
             stop it or choose another --socket",
            path.display()
        ))),
        // A full backlog: someone is listening.
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Err(Error::invalid(format!(
            "the socket {} is in use by a busy node (its accept queue is full)",
            path.display()
        ))),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            std::fs::remove_file(path).map_err(|e| {
                Error::from(e).context(format!("cannot remove the stale socket {}", path.display()))
            })?;
            tracing::info!(path = %path.display(), "removed a stale socket (nobody was accepting on it)");
            Ok(())
        }
        Err(e) => Err(Error::from(e).context(format!(
            "the socket {} exists and cannot be checked for a running node, so it is left alone",
            path.display()
        ))),
    }
}

/// Wakes a thread blocked in `accept` on `listener` (and makes every later `accept` fail at once)
/// by shutting down the listening socket's receive side: `shutdown(SHUT_RD)` on the node's own
/// descriptor, which works whether or not the socket path still exists or now names another
/// node's socket. New connections to the socket are refused from then on. Verified on Linux
/// (`accept` returns `EINVAL`); see this module's tests.
pub fn wake_acceptor(listener: impl AsFd) -> io::Result<()> {
    rustix::net::shutdown(listener, rustix::net::Shutdown::Read).map_err(io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvnode-uds-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// `wake_acceptor` ends a thread blocked in `accept`, even after the socket path was
    /// removed and taken by another listener (so a connect to the path would reach the wrong one).
    #[test]
    fn wake_acceptor_unblocks_accept_without_the_path() {
        let d = dir("wake");
        let path = d.join("s.sock");
        let (listener, _bound) = bind(&path, 0o600).unwrap();
        let wake = listener.try_clone().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            let r = listener.accept().map(|_| ());
            tx.send(r.map_err(|e| e.kind())).unwrap();
        });
        std::fs::remove_file(&path).unwrap();
        let _other = UnixListener::bind(&path).unwrap();
        // Give the thread time to block in accept (not required for correctness: a shut-down
        // listener fails every later accept at once, too).
        std::thread::sleep(Duration::from_millis(50));
        wake_acceptor(&wake).unwrap();
        let r = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("accept was woken");
        assert!(r.is_err(), "accept fails after the wake-up: {r:?}");
        t.join().unwrap();
        // A later accept fails at once too (a blocked one here would hang the test).
        assert!(wake.accept().is_err(), "later accepts fail at once");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn unlink_if_ours_leaves_a_replacement_alone() {
        let d = dir("ours");
        let path = d.join("s.sock");
        let (l, bound) = bind(&path, 0o600).unwrap();
        drop(l);
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, b"x").unwrap();
        assert!(!bound.unlink_if_ours());
        assert_eq!(std::fs::read(&path).unwrap(), b"x");
        std::fs::remove_file(&path).unwrap();
        // ext4 and others give the next file the inode number just freed: still not ours.
        let (l2, bound2) = bind(&path, 0o640).unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777,
            0o640
        );
        assert!(!bound.unlink_if_ours(), "another bind's socket is not ours");
        assert!(!bound2.unlink_if_ours(), "not while it accepts");
        wake_acceptor(&l2).unwrap();
        assert!(bound2.unlink_if_ours());
        assert!(!path.exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn describes_every_kind_of_file() {
        let d = dir("kinds");
        std::fs::write(d.join("f"), b"").unwrap();
        let ft = |p: &str| std::fs::symlink_metadata(d.join(p)).unwrap().file_type();
        assert_eq!(describe_file_type(&ft("f")), "a regular file");
        std::os::unix::fs::symlink("f", d.join("l")).unwrap();
        assert_eq!(describe_file_type(&ft("l")), "a symbolic link");
        let dir_ft = std::fs::symlink_metadata(&d).unwrap().file_type();
        assert_eq!(describe_file_type(&dir_ft), "a directory");
        let null = std::fs::metadata("/dev/null").unwrap().file_type();
        assert_eq!(describe_file_type(&null), "a character device");
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A chmod that fails right after the bind: the socket just created is removed again and
    /// `bind` returns the error (it used to take the directory lock a second time, through
    /// another open file description, and wait for itself forever).
    #[test]
    fn a_failed_chmod_removes_the_new_socket_and_returns() {
        let d = dir("chmod");
        let path = d.join("s.sock");
        let (tx, rx) = std::sync::mpsc::channel();
        let p = path.clone();
        std::thread::spawn(move || {
            let r = bind_with(&p, 0o600, |_, _| {
                Err(io::Error::from_raw_os_error(libc::EPERM))
            });
            tx.send(r.map(drop).map_err(|e| e.to_string())).unwrap();
        });
        let r = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("bind returns within 30 s when its chmod fails");
        let e = r.expect_err("the chmod failure is an error");
        assert!(e.contains("cannot set mode 0600"), "{e}");
        assert!(e.contains(path.to_str().unwrap()), "{e}");
        assert!(
            std::fs::symlink_metadata(&path).is_err(),
            "the socket bind created is removed again"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Another process holding a lock on the socket's directory (here: another open file
    /// description of it, as `flock DIR sleep inf` would) neither hangs `bind` nor the removal
    /// at shutdown: `bind` fails naming the directory, `unlink_if_ours` leaves the file.
    #[test]
    fn a_lock_held_on_the_directory_never_hangs_bind_or_unlink() {
        use rustix::fs::FlockOperation;
        let d = dir("dirlock");
        let path = d.join("s.sock");
        let (l, bound) = bind(&path, 0o600).unwrap();
        wake_acceptor(&l).unwrap();
        let other = d.join("t.sock");
        let holder = std::fs::File::open(&d).unwrap();
        rustix::fs::flock(&holder, FlockOperation::LockExclusive).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let o = other.clone();
        std::thread::spawn(move || {
            let r = bind(&o, 0o600).map(drop).map_err(|e| e.to_string());
            let removed = bound.unlink_if_ours();
            tx.send((r, removed, bound)).unwrap();
        });
        let (r, removed, bound) = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("bind and unlink_if_ours return within 30 s");
        let e = r.expect_err("bind fails while the directory is locked");
        assert!(
            e.contains(&format!("another process holds a lock on {}", d.display())),
            "{e}"
        );
        assert!(!other.exists(), "nothing was bound");
        assert!(!removed, "the socket file is left while the lock is held");
        assert!(path.exists());
        drop(holder);
        assert!(bound.unlink_if_ours(), "removed once the lock is free");
        drop(l);
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Two nodes starting at once on a stale socket: exactly one binds, and its socket is the
    /// one at the path (before the directory lock, both could remove and bind, one of them
    /// left with an unreachable socket).
    #[test]
    fn two_binds_racing_on_a_stale_socket_leave_one_reachable_node() {
        let d = dir("race");
        let path = d.join("s.sock");
        for round in 0..3000 {
            if !path.exists() {
                drop(UnixListener::bind(&path).unwrap()); // stale: the file stays, nobody accepts
            }
            let results: Vec<_> = std::thread::scope(|s| {
                let a = s.spawn(|| bind(&path, 0o600));
                let b = s.spawn(|| bind(&path, 0o600));
                vec![a.join().unwrap(), b.join().unwrap()]
            });
            let ok: Vec<_> = results.into_iter().filter_map(|r| r.ok()).collect();
            assert_eq!(ok.len(), 1, "round {round}: {} binds succeeded", ok.len());
            assert!(
                UnixStream::connect(&path).is_ok(),
                "round {round}: unreachable"
            );
            let (l, bound) = ok.into_iter().next().unwrap();
            drop(l); // stale again for the next round
            assert!(bound.is_ours());
        }
        let _ = std::fs::remove_dir_all(&d);
    }
}
