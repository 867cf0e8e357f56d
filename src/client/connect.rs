//! Connecting to a node: bounded waits, errors that name the path and say why, and the check
//! that the listening process is this user's or root's.

use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Result};

/// Why connecting to a node at `path` failed, as a sentence naming the path: no socket file,
/// a stale socket (connection refused), something that is not a socket, or permission denied.
pub(super) fn connect_error(path: &Path, e: &io::Error) -> Error {
    let p = path.display();
    let msg = match e.kind() {
        io::ErrorKind::NotFound => format!("no kvnode is running at {p}: no such socket file"),
        io::ErrorKind::ConnectionRefused => match std::fs::metadata(path) {
            Ok(m) if !m.file_type().is_socket() => format!(
                "no kvnode is running at {p}: it is {}, not a socket",
                crate::transport::uds::describe_file_type(&m.file_type())
            ),
            _ => format!(
                "no kvnode is running at {p}: connection refused (a stale socket file, left by a \
                 node that did not stop cleanly)"
            ),
        },
        io::ErrorKind::PermissionDenied => format!(
            "cannot connect to the kvnode at {p}: permission denied (the socket's mode, see \
             `kvnode serve --socket-mode`, or its directory does not let this user in)"
        ),
        _ => format!("cannot connect to the kvnode at {p}: {e}"),
    };
    Error::new(ErrorKind::Io, msg)
}

/// Connects to the Unix socket at `path`, waiting at most `timeout` for the listener to take
/// the connection (a blocking `connect` waits for room in its accept queue without limit: a
/// hung node). The socket is non-blocking while connecting and blocking afterwards.
pub(super) fn connect_bounded(path: &Path, timeout: Duration) -> Result<UnixStream> {
    use rustix::io::Errno;
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let fail = |e: Errno| connect_error(path, &io::Error::from(e));
    let addr = SocketAddrUnix::new(path).map_err(fail)?;
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        None,
    )
    .map_err(fail)?;
    let deadline = Instant::now() + timeout;
    loop {
        match rustix::net::connect(&fd, &addr) {
            Ok(()) | Err(Errno::ISCONN) => break,
            // The listener's accept queue is full (Linux Unix sockets do not connect in the
            // background: the call is simply tried again).
            Err(Errno::AGAIN | Errno::INPROGRESS | Errno::ALREADY) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::new(
                        ErrorKind::Io,
                        format!(
                            "the kvnode at {} did not accept the connection within {} (its \
                             accept queue stayed full: the node is hung or overloaded)",
                            path.display(),
                            seconds(timeout)
                        ),
                    ));
                }
                std::thread::sleep(left.min(CONNECT_RETRY));
            }
            Err(Errno::INTR) => {}
            Err(e) => return Err(fail(e)),
        }
    }
    let stream = UnixStream::from(fd);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// Pause between two connection attempts while a node's accept queue is full.
const CONNECT_RETRY: Duration = Duration::from_millis(5);

/// `d` in words for messages: "10 s", "0.2 s".
pub(super) fn seconds(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{} s", d.as_secs_f64())
    }
}

/// Refuses a node that runs as neither this process's user nor root: whoever listens on the
/// socket is identified by the kernel (`SO_PEERCRED`), so a socket another user planted at the
/// path (a squatted `/tmp` name) is never sent requests or trusted with a pool fd.
pub(super) fn check_node_user(path: &Path, stream: &UnixStream) -> Result<()> {
    let node = kvnode_hw::unix_peer_credentials(stream.as_fd())
        .map_err(|e| Error::new(ErrorKind::Io, format!("{}: {e}", path.display())))?;
    let me = kvnode_hw::effective_uid();
    if node.uid == me || node.uid == 0 {
        return Ok(());
    }
    Err(Error::denied(format!(
        "the socket {} is served by user {} (pid {}), neither you (user {me}) nor root; \
         refusing to trust it (someone else may have put a socket at that path)",
        path.display(),
        node.uid,
        node.pid.map_or_else(|| "?".to_owned(), |p| p.to_string())
    )))
}
