//! Unix-domain-socket transport: socket file with restrictive permissions, one reader thread per
//! connection, responses written under a per-connection lock, the pool fd passed with SCM_RIGHTS.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use super::ReplySink;
use crate::error::{Error, Result};
use crate::protocol::frame::encode_response;
use crate::protocol::Response;

/// Binds the node's socket. A stale socket file (nobody accepting) is replaced; a live one is an
/// error, so two nodes never share a path. The file gets permission bits `mode`.
pub fn bind(path: &Path, mode: u32) -> Result<UnixListener> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(Error::invalid(format!(
                "{} is in use by a running node",
                path.display()
            )));
        }
        std::fs::remove_file(path)
            .map_err(|e| Error::from(e).context(format!("removing stale {}", path.display())))?;
    }
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() {
            std::fs::create_dir_all(dir)?;
        }
    }
    let l = UnixListener::bind(path)
        .map_err(|e| Error::from(e).context(format!("binding {}", path.display())))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(l)
}

/// Removes the socket file if it is still ours (called on shutdown).
pub fn unlink(path: &PathBuf) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != io::ErrorKind::NotFound {
            tracing::warn!(path = %path.display(), error = %e, "could not remove socket file");
        }
    }
}

/// The reply side of one Unix-socket connection.
pub struct UdsReplySink {
    stream: UnixStream,
    write_lock: Mutex<()>,
    id: u64,
}

impl UdsReplySink {
    /// Wraps the write half (a `try_clone` of the connection, with a write timeout set) with
    /// connection id `id`.
    pub fn new(stream: UnixStream, id: u64) -> UdsReplySink {
        UdsReplySink {
            stream,
            write_lock: Mutex::new(()),
            id,
        }
    }
}

impl ReplySink for UdsReplySink {
    fn send(&self, request_id: u64, opcode: u16, resp: &Response, fd: Option<BorrowedFd<'_>>) {
        let frame = match encode_response(request_id, opcode, fd.is_some(), resp) {
            Ok(f) => f,
            Err(e) => {
                tracing::error!(error = %e, "response could not be encoded; sending an error instead");
                let err = Response::Error {
                    kind: crate::error::ErrorKind::Internal.code(),
                    message: format!("response could not be encoded: {e}"),
                };
                encode_response(request_id, opcode, false, &err).expect("small error frames encode")
            }
        };
        let _g = self.write_lock.lock();
        if let Err(e) = kvnode_hw::send_with_fd(self.stream.as_fd(), &frame, fd) {
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) {
                // The client stopped reading: close the connection so its reader thread ends and
                // its instances are released, rather than stalling the sender.
                tracing::warn!(
                    connection = self.id,
                    "client not reading replies: closing connection"
                );
                let _ = self.stream.shutdown(std::net::Shutdown::Both);
            } else {
                tracing::debug!(connection = self.id, error = %e, "client went away before its reply");
            }
        }
    }

    fn connection_id(&self) -> u64 {
        self.id
    }

    fn can_pass_fd(&self) -> bool {
        true
    }
}
