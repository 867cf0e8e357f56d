//! The one error type of kvnode: a kind (what went wrong, stable on the wire) plus context text.

use std::fmt;

/// What class of failure an [`Error`] is. Invariant: the discriminant values are the wire codes of
/// the native protocol and never change meaning once released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[repr(u16)]
pub enum ErrorKind {
    /// The request is malformed or violates a documented rule (bad dtype, misaligned range...).
    InvalidRequest = 1,
    /// The request names an instance that is not registered (never was, reaped or unregistered).
    NotRegistered = 2,
    /// The pool cannot hold the request even after evicting everything evictable.
    OutOfMemory = 3,
    /// An object is in a state that forbids the operation (the L1 state machine's error codes).
    KeyState = 4,
    /// A configured limit (frame size, instances, pending ops, sessions...) would be exceeded.
    LimitExceeded = 5,
    /// An operating-system or device error.
    Io = 6,
    /// The operation is understood but not supported by this node.
    Unsupported = 7,
    /// A transfer id that is unknown to the instance (already committed, aborted or never issued).
    UnknownTransfer = 8,
    /// The node is shutting down.
    ShuttingDown = 9,
    /// A broken internal invariant; always a bug.
    Internal = 10,
    /// The caller may not do this: the instance, transfer or session belongs to another
    /// connection or process, or the operation is for the node's administrators only.
    PermissionDenied = 11,
}

impl ErrorKind {
    /// Decodes a wire code; unknown codes map to `Internal` so a newer server never crashes an older client.
    pub fn from_code(code: u16) -> ErrorKind {
        match code {
            1 => ErrorKind::InvalidRequest,
            2 => ErrorKind::NotRegistered,
            3 => ErrorKind::OutOfMemory,
            4 => ErrorKind::KeyState,
            5 => ErrorKind::LimitExceeded,
            6 => ErrorKind::Io,
            7 => ErrorKind::Unsupported,
            8 => ErrorKind::UnknownTransfer,
            9 => ErrorKind::ShuttingDown,
            11 => ErrorKind::PermissionDenied,
            _ => ErrorKind::Internal,
        }
    }

    /// The wire code of this kind.
    pub fn code(self) -> u16 {
        self as u16
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// kvnode's error: a kind plus a human-readable context. Invariant: `kind` alone decides how a
/// caller reacts; `context` is for people and logs. Display prints the context only (a sentence
/// naming the path or value involved): the kind is for code and the wire, never shown to users.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{context}")]
pub struct Error {
    /// The class of failure.
    pub kind: ErrorKind,
    /// What happened, with the values involved.
    pub context: String,
}

impl Error {
    /// Builds an error of `kind` with `context`.
    pub fn new(kind: ErrorKind, context: impl Into<String>) -> Error {
        Error {
            kind,
            context: context.into(),
        }
    }

    /// Shorthand for [`ErrorKind::InvalidRequest`].
    pub fn invalid(context: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidRequest, context)
    }

    /// Shorthand for [`ErrorKind::LimitExceeded`].
    pub fn limit(context: impl Into<String>) -> Error {
        Error::new(ErrorKind::LimitExceeded, context)
    }

    /// Shorthand for [`ErrorKind::PermissionDenied`].
    pub fn denied(context: impl Into<String>) -> Error {
        Error::new(ErrorKind::PermissionDenied, context)
    }

    /// Shorthand for [`ErrorKind::Internal`].
    pub fn internal(context: impl Into<String>) -> Error {
        Error::new(ErrorKind::Internal, context)
    }

    /// Prepends `what` to the context, keeping the kind.
    pub fn context(mut self, what: impl fmt::Display) -> Error {
        self.context = format!("{what}: {}", self.context);
        self
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        Error::new(ErrorKind::Io, e.to_string())
    }
}

impl From<kvnode_hw::HwError> for Error {
    fn from(e: kvnode_hw::HwError) -> Error {
        match e {
            kvnode_hw::HwError::Invalid(m) => Error::invalid(m),
            kvnode_hw::HwError::OutOfBounds { .. } => Error::invalid(e.to_string()),
            kvnode_hw::HwError::GpuUnavailable(_) => {
                Error::new(ErrorKind::Unsupported, e.to_string())
            }
            other => Error::new(ErrorKind::Io, other.to_string()),
        }
    }
}

/// kvnode's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_shows_the_context_without_the_kind() {
        let e = Error::new(ErrorKind::Io, "No such file or directory (os error 2)")
            .context("cannot open /x");
        assert_eq!(
            e.to_string(),
            "cannot open /x: No such file or directory (os error 2)"
        );
        assert_eq!(e.kind, ErrorKind::Io);
    }
}
