//! The default socket directory: one only the node's user can write, created by the node when
//! missing and refused when someone else owns it or may write it.

use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorKind, Result};

/// The default socket path: `kvnode.sock` in [`default_socket_dir`].
pub fn default_socket_path() -> PathBuf {
    default_socket_dir().join("kvnode.sock")
}

/// The default socket directory, one only this user can write: `$XDG_RUNTIME_DIR` when it is a
/// directory of this user that nobody else may write, else `/run/kvnode` for root, else
/// `/tmp/kvnode-<uid>`. The node creates the last two (see [`ensure_private_dir`]); nobody else
/// can put a socket in them, so `ping`, `status` and clients never talk to an impostor.
pub fn default_socket_dir() -> PathBuf {
    let uid = kvnode_hw::effective_uid();
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        if check_private_dir(Path::new(&d), uid).is_ok() {
            return PathBuf::from(d);
        }
    }
    if uid == 0 {
        PathBuf::from("/run/kvnode")
    } else {
        PathBuf::from(format!("/tmp/kvnode-{uid}"))
    }
}

/// `Ok` when `dir` is a real directory (not a link) owned by `uid` that no one else may write.
pub fn check_private_dir(dir: &Path, uid: u32) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(dir).map_err(|e| {
        Error::new(
            ErrorKind::Io,
            format!("cannot inspect {}: {e}", dir.display()),
        )
    })?;
    if !m.is_dir() {
        return Err(Error::invalid(format!(
            "{} is not a directory (a link or a file); the socket needs a private directory",
            dir.display()
        )));
    }
    if m.uid() != uid {
        return Err(Error::denied(format!(
            "{} belongs to user {}, not to the node's user {uid}: another user could replace \
             the socket there; remove it or choose another --socket",
            dir.display(),
            m.uid()
        )));
    }
    if m.mode() & 0o022 != 0 {
        return Err(Error::denied(format!(
            "{} has mode {:04o}: group or others may write it, so another user could replace \
             the socket; chmod go-w it or choose another --socket",
            dir.display(),
            m.mode() & 0o7777
        )));
    }
    Ok(())
}

/// Creates the default socket directory `dir` if it is missing (mode 0700; 0755 for root's
/// `/run/kvnode`, so users that `[access]` allows can reach the socket, whose own mode still
/// decides), then checks it is private ([`check_private_dir`]). Never changes an existing one.
pub fn ensure_private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let uid = kvnode_hw::effective_uid();
    let mode = if uid == 0 { 0o755 } else { 0o700 };
    match std::fs::DirBuilder::new().mode(mode).create(dir) {
        Ok(()) => {
            tracing::info!(dir = %dir.display(), mode = format!("{mode:04o}"), "created the socket directory")
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(Error::new(
                ErrorKind::Io,
                format!("cannot create the socket directory {}: {e}", dir.display()),
            ))
        }
    }
    check_private_dir(dir, uid)
}
