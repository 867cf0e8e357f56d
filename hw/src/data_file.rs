//! Opening, inspecting and sizing a data file or block device *before* anything is written to
//! it: the caller decides whether the contents are its own, provably empty, or someone else's
//! data, and only then grows the file ([`grow_data_file`]).
//!
//! * [`open_data_file_locked`]: opens an existing file without touching its length, or creates
//!   a new one (`O_EXCL`, so "created" is a fact, not a guess), and locks it.
//! * [`read_direct`]: reads a few blocks through an aligned buffer (the descriptor is
//!   `O_DIRECT`), stopping at end of file.
//! * [`scan_for_data`]: proves a file all zero, reading only its allocated ranges (`SEEK_DATA`),
//!   up to a byte budget.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use crate::block::{lock_exclusive, BLOCK_ALIGN};
use crate::error::{HwError, HwResult};

/// A data file opened and locked for this process, its length untouched.
///
/// Invariant: `file` is open `O_RDWR | O_DIRECT`, exclusively `flock`ed by this process, and was
/// `len` bytes long when opened; `created` is true only if this call created it (`O_EXCL`).
#[derive(Debug)]
pub struct OpenedDataFile {
    /// The open, locked file.
    pub file: File,
    /// Whether the file did not exist and this call created it (empty, length 0).
    pub created: bool,
    /// Length in bytes when opened.
    pub len: u64,
}

/// Opens the data file at `path` read-write with `O_DIRECT`, creating it (mode 0600) only if it
/// does not exist, and takes [`lock_exclusive`] on it (waiting up to `wait`). Never changes the
/// length of an existing file: see [`grow_data_file`].
///
/// Errors: `Os { op: "open(O_DIRECT)" }` (e.g. `EINVAL` where the file system has no
/// `O_DIRECT`), `Os { op: "flock" }` with `EWOULDBLOCK` when another process holds the lock,
/// `Os { op: "fstat" }`.
pub fn open_data_file_locked(path: &Path, wait: std::time::Duration) -> HwResult<OpenedDataFile> {
    let open = |create: bool| {
        let mut o = std::fs::OpenOptions::new();
        o.read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC);
        if create {
            o.create_new(true).mode(0o600);
        }
        o.open(path)
    };
    let not_regular = || {
        HwError::Invalid(format!(
            "{} is not a regular file (give a block device as the L2 path itself)",
            path.display()
        ))
    };
    if std::fs::metadata(path).is_ok_and(|m| !m.file_type().is_file()) {
        return Err(not_regular());
    }
    // An existing file first; create only what is not there (a file created between the two
    // calls by someone else is opened as existing on the next round).
    let mut rounds = 0;
    let (file, created) = loop {
        rounds += 1;
        match open(false) {
            Ok(f) => break (f, false),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && rounds < 4 => {}
            Err(e) => return Err(HwError::os("open(O_DIRECT)", e)),
        }
        match open(true) {
            Ok(f) => break (f, true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && rounds < 4 => {}
            Err(e) => return Err(HwError::os("open(O_DIRECT)", e)),
        }
    };
    let meta = file.metadata().map_err(|e| HwError::os("fstat", e))?;
    if !meta.file_type().is_file() {
        // A device node or anything else behind the name (a symlink to a disk, say, swapped in
        // after the check above): its length reads as 0, which must not pass for empty.
        return Err(not_regular());
    }
    lock_exclusive(&file, wait)?;
    let len = file.metadata().map_err(|e| HwError::os("fstat", e))?.len();
    Ok(OpenedDataFile { file, created, len })
}

/// Grows the locked data file `file` (at `path`, for messages) to `size` bytes: space reserved
/// with `fallocate` when `reserve` (falling back to a sparse `ftruncate` where the file system
/// has no `fallocate`), else sparse. A file already `size` bytes long is left alone; a longer
/// one is refused (`Invalid`), never truncated.
///
/// Errors: `Invalid` for a `size` that is not a multiple of [`BLOCK_ALIGN`] or a longer file;
/// `Os { op: "fallocate" }` (e.g. `ENOSPC`), `Os { op: "ftruncate" }`, `Os { op: "fstat" }`.
pub fn grow_data_file(file: &File, path: &Path, size: u64, reserve: bool) -> HwResult<()> {
    if size & (BLOCK_ALIGN - 1) != 0 || size > i64::MAX as u64 {
        return Err(HwError::Invalid(format!(
            "data file size {size} is not a multiple of {BLOCK_ALIGN}"
        )));
    }
    let cur = file.metadata().map_err(|e| HwError::os("fstat", e))?.len();
    if cur > size {
        return Err(HwError::Invalid(format!(
            "{} is {cur} bytes, larger than the {size} requested; refusing to truncate it",
            path.display()
        )));
    }
    if cur == size {
        return Ok(());
    }
    if reserve {
        // SAFETY: fallocate on a descriptor we own; no memory is passed.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, size as libc::off_t) };
        if rc == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if !matches!(
            err.raw_os_error(),
            Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)
        ) {
            return Err(HwError::os("fallocate", err));
        }
    }
    file.set_len(size).map_err(|e| HwError::os("ftruncate", e))
}

/// A zeroed buffer of `len` bytes whose start is [`BLOCK_ALIGN`]-aligned (as `O_DIRECT` needs):
/// the vector and the offset of the aligned part in it.
fn aligned_buffer(len: usize) -> (Vec<u8>, usize) {
    let buf = vec![0u8; len + BLOCK_ALIGN as usize];
    let at = buf.as_ptr().align_offset(BLOCK_ALIGN as usize);
    (buf, at)
}

/// Reads up to `len` bytes at `offset` (both multiples of [`BLOCK_ALIGN`]) from the `O_DIRECT`
/// descriptor `file`; the result is shorter than `len` only where the file ends.
///
/// Errors: `Invalid` for unaligned arguments; `Os { op: "pread" }` for an I/O error.
pub fn read_direct(file: &File, offset: u64, len: usize) -> HwResult<Vec<u8>> {
    if offset & (BLOCK_ALIGN - 1) != 0 || (len as u64) & (BLOCK_ALIGN - 1) != 0 {
        return Err(HwError::Invalid(format!(
            "direct read not {BLOCK_ALIGN}-aligned: offset {offset} len {len}"
        )));
    }
    let (mut buf, at) = aligned_buffer(len);
    let mut done = 0usize;
    while done < len {
        match file.read_at(&mut buf[at + done..at + len], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(HwError::os("pread", e)),
        }
    }
    Ok(buf[at..at + done].to_vec())
}

/// What [`scan_for_data`] found.
///
/// Invariant: `Zero` only when every byte below the length was proven zero (a hole, or read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataScan {
    /// Every byte is zero: the file holds nothing.
    Zero,
    /// The first non-zero byte found is at this offset.
    DataAt(u64),
    /// More than the budget of allocated bytes would have to be read to prove the rest zero;
    /// everything up to `checked` (a file offset) is zero.
    Unproven {
        /// File offset up to which the contents were proven zero.
        checked: u64,
    },
}

/// Bytes read per call while scanning.
const SCAN_CHUNK: usize = 1 << 20;

/// Proves the first `len` bytes of `file` all zero, or finds data. Holes are skipped without
/// reading (`SEEK_DATA`/`SEEK_HOLE`; ranges the file system reports as data, and every byte of a
/// block device, are read), and at most `max_read` bytes are read.
///
/// Errors: `Os { op: "pread" }` or `Os { op: "lseek" }` for an I/O error.
pub fn scan_for_data(file: &File, len: u64, max_read: u64) -> HwResult<DataScan> {
    let (mut buf, at) = aligned_buffer(SCAN_CHUNK);
    let mut read = 0u64;
    let mut pos = 0u64;
    while pos < len {
        // The next allocated range [start, end) at or after `pos`.
        let start = match seek(file, pos, libc::SEEK_DATA)? {
            None => return Ok(DataScan::Zero), // only holes from here on
            Some(s) if s >= len => return Ok(DataScan::Zero),
            Some(s) => s & !(BLOCK_ALIGN - 1),
        };
        let end = seek(file, start, libc::SEEK_HOLE)?
            .unwrap_or(len)
            .min(len)
            .max(start + BLOCK_ALIGN);
        let mut off = start;
        while off < end {
            if read >= max_read {
                return Ok(DataScan::Unproven { checked: off });
            }
            let want = ((end - off) as usize)
                .min(SCAN_CHUNK)
                .next_multiple_of(BLOCK_ALIGN as usize);
            let n = loop {
                match file.read_at(&mut buf[at..at + want], off) {
                    Ok(n) => break n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(HwError::os("pread", e)),
                }
            };
            if n == 0 {
                return Ok(DataScan::Zero); // the file ended (shorter than `len`)
            }
            if let Some(i) = buf[at..at + n].iter().position(|&b| b != 0) {
                return Ok(DataScan::DataAt(off + i as u64));
            }
            read += n as u64;
            off += n as u64;
        }
        pos = end;
    }
    Ok(DataScan::Zero)
}

/// `lseek(fd, offset, whence)` for `SEEK_DATA`/`SEEK_HOLE`: `None` where there is no data past
/// `offset` (`ENXIO`); file systems and devices without these (`EINVAL`) report everything as
/// data (for `SEEK_DATA`, `offset` itself; for `SEEK_HOLE`, no hole: `None`).
fn seek(file: &File, offset: u64, whence: libc::c_int) -> HwResult<Option<u64>> {
    // SAFETY: lseek on a descriptor we own; no memory is passed.
    let rc = unsafe { libc::lseek(file.as_raw_fd(), offset as libc::off_t, whence) };
    if rc >= 0 {
        return Ok(Some(rc as u64));
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::ENXIO) => Ok(None),
        Some(libc::EINVAL) if whence == libc::SEEK_DATA => Ok(Some(offset)),
        Some(libc::EINVAL) => Ok(None),
        _ => Err(HwError::os("lseek", err)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Dir(std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    fn dir(name: &str) -> Dir {
        let p = std::env::temp_dir().join(format!("kvnode-datafile-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Dir(p)
    }
    const WAIT: std::time::Duration = std::time::Duration::from_millis(10);

    #[test]
    fn opens_existing_files_untouched_and_creates_only_missing_ones() {
        let d = dir("open");
        let p = d.0.join("f");
        std::fs::write(&p, vec![7u8; 1 << 20]).unwrap();
        let Ok(o) = open_data_file_locked(&p, WAIT) else {
            return; // no O_DIRECT on this file system
        };
        assert!(!o.created);
        assert_eq!(
            o.len,
            1 << 20,
            "the length of an existing file is not touched"
        );
        drop(o);
        let q = d.0.join("new");
        let o = open_data_file_locked(&q, WAIT).unwrap();
        assert!(o.created);
        assert_eq!(o.len, 0);
        // Locked: a second opener is refused.
        let e = open_data_file_locked(&q, WAIT).unwrap_err();
        assert!(matches!(e, HwError::Os { op: "flock", .. }), "{e}");
    }

    #[test]
    fn grow_refuses_to_shrink_and_keeps_a_file_of_the_right_size() {
        let d = dir("grow");
        let p = d.0.join("f");
        let Ok(o) = open_data_file_locked(&p, WAIT) else {
            return;
        };
        grow_data_file(&o.file, &p, 8 << 20, true).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 8 << 20);
        grow_data_file(&o.file, &p, 8 << 20, true).unwrap();
        let e = grow_data_file(&o.file, &p, 4 << 20, true).unwrap_err();
        assert!(e.to_string().contains("refusing to truncate"), "{e}");
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 8 << 20);
        assert!(grow_data_file(&o.file, &p, 100, true).is_err());
    }

    #[test]
    fn scan_finds_data_anywhere_and_proves_holes_and_zeros_empty() {
        let d = dir("scan");
        let p = d.0.join("f");
        let Ok(o) = open_data_file_locked(&p, WAIT) else {
            return;
        };
        let len = 16u64 << 20;
        grow_data_file(&o.file, &p, len, true).unwrap();
        assert_eq!(
            scan_for_data(&o.file, len, u64::MAX).unwrap(),
            DataScan::Zero
        );
        // Zeros written explicitly are data to the file system, and still empty.
        let plain = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        plain.write_all_at(&vec![0u8; 1 << 20], 2 << 20).unwrap();
        plain.sync_all().unwrap();
        assert_eq!(
            scan_for_data(&o.file, len, u64::MAX).unwrap(),
            DataScan::Zero
        );
        // One byte deep inside (an md superblock sits at 4 KiB, btrfs at 64 KiB).
        plain.write_all_at(&[1], (12 << 20) + 4097).unwrap();
        plain.sync_all().unwrap();
        assert_eq!(
            scan_for_data(&o.file, len, u64::MAX).unwrap(),
            DataScan::DataAt((12 << 20) + 4097)
        );
        // A budget too small to get there proves nothing.
        assert!(matches!(
            scan_for_data(&o.file, len, 1 << 20).unwrap(),
            DataScan::Unproven { .. } | DataScan::DataAt(_)
        ));
        let head = read_direct(&o.file, (12 << 20) + 4096, 8192).unwrap();
        assert_eq!((head.len(), head[1]), (8192, 1));
        assert_eq!(read_direct(&o.file, len - 4096, 8192).unwrap().len(), 4096);
    }
}
