//! Error type of the hardware/OS layer.

/// Everything that can go wrong in `kvnode-hw`.
///
/// Invariant: `Os` and `OsPath` always carry the name of the failing system
/// call (or step) and the `std::io::Error` it produced, `OsPath` also the path
/// of the file it was about; `Invalid` is only produced for
/// caller mistakes that were detected before any OS resource was touched
/// (or after it was released again); `OutOfBounds` is only produced by
/// bounds checks on a pool region and never leaves memory modified.
#[derive(Debug, thiserror::Error)]
pub enum HwError {
    /// A system call failed.
    #[error("{op}: {source}")]
    Os {
        /// Name of the failing operation, e.g. `"mmap"`.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A system call on a named file failed.
    #[error("{op} of {path} failed: {source}")]
    OsPath {
        /// Name of the failing operation, e.g. `"shm_open"`.
        op: &'static str,
        /// The file it was about.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The caller passed an argument that can never work.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A GPU driver call failed (the message names the call and the driver's error).
    #[error("GPU: {0}")]
    Gpu(String),
    /// No GPU can be used (no driver library, no device, driver too old, not built in).
    #[error("no GPU: {0}")]
    GpuUnavailable(crate::gpu::GpuUnavailable),
    /// An access `[offset, offset + len)` does not fit in the pool.
    #[error("out of bounds: offset {offset} + len {len} > pool {pool_len}")]
    OutOfBounds {
        /// Requested start offset.
        offset: u64,
        /// Requested length.
        len: u64,
        /// Length of the pool region.
        pool_len: u64,
    },
}

/// Result alias for this crate.
///
/// Invariant: identical to `Result<T, HwError>`.
pub type HwResult<T> = Result<T, HwError>;

impl HwError {
    /// Builds `HwError::Os` from `errno` as it is right now.
    ///
    /// Must be called immediately after the failing call, before anything
    /// else can overwrite `errno`.
    pub(crate) fn last_os(op: &'static str) -> HwError {
        HwError::Os {
            op,
            source: std::io::Error::last_os_error(),
        }
    }

    /// Builds `HwError::Os` from an existing `io::Error`.
    pub(crate) fn os(op: &'static str, source: std::io::Error) -> HwError {
        HwError::Os { op, source }
    }

    /// Builds `HwError::OsPath` from an existing `io::Error` about the file `path`.
    pub(crate) fn os_path(op: &'static str, path: &str, source: std::io::Error) -> HwError {
        HwError::OsPath {
            op,
            path: path.to_owned(),
            source,
        }
    }

    /// The raw OS error number, if this is an `Os` or `OsPath` error carrying one.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            HwError::Os { source, .. } | HwError::OsPath { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}
