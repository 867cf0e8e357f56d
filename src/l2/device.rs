//! Opening an L2 device and deciding whether the node may use it, before anything is written
//! or resized: a file or device is used only when it already holds a kvnode L2 tier, or is
//! provably empty (new, zero length, or every byte zero), or the operator said `overwrite`.
//!
//! Ownership is judged from the two superblock copies (blocks 0 and 1, see
//! [`super::format`]): the device is kvnode's when one copy is valid and the other is valid,
//! carries the kvnode magic (a torn or damaged copy), or (only right after the first
//! formatting, `update <= 2`) is still all zero. Anything else in a superblock block means
//! another program wrote there since (a file system, an md or LVM label) and the device is
//! treated as foreign, even if an old kvnode copy survives next to it.

use std::fs::File;
use std::path::{Path, PathBuf};

use kvnode_hw::{DataScan, HwError};

use super::format::{FormatError, Superblock, BLOCK, EXTENT_BASE, SUPERBLOCK_MAGIC};
use crate::config::{L2Config, L2Format};
use crate::error::{Error, Result};

/// Name of the data file created inside an L2 directory.
pub const DATA_FILE: &str = "kvnode-l2.dat";

/// At most this many allocated bytes are read to prove a non-empty file or device all zero
/// (holes of a sparse or preallocated file cost nothing); larger ones need `overwrite`.
pub const MAX_EMPTY_SCAN_BYTES: u64 = 64 << 20;

/// An opened, locked L2 device whose length has not been touched.
///
/// Invariant: `file` is `O_DIRECT`, flocked by this process; `bytes` is the usable size (a
/// multiple of 2 MiB, at most `l2.bytes`); `len` the length found at opening (a regular file
/// is grown to `bytes` only by [`Device::grow`], after [`identify`] accepted it).
pub struct Device {
    /// The open, locked file or device.
    pub file: File,
    /// The data file or device path.
    pub path: PathBuf,
    /// Usable bytes.
    pub bytes: u64,
    /// Length when opened.
    pub len: u64,
    /// Whether this node created the file just now.
    pub created: bool,
    /// A block device (never resized).
    pub block_device: bool,
}

/// What a device holds, judged before anything is written. Invariant: `Ours` carries the
/// current (valid, highest `update`) superblock copy.
#[derive(Debug)]
pub enum Found {
    /// A kvnode L2 tier.
    Ours(Superblock),
    /// The kvnode magic, but no valid superblock copy: kvnode's own, damaged (the reason).
    OursDamaged(String),
    /// Nothing: a new or zero-length file, or every byte zero (how it was proven).
    Empty(&'static str),
    /// Data of another program (what was found and where).
    Foreign(String),
}

fn round_2m(n: u64) -> u64 {
    n & !((2 << 20) - 1)
}

/// Opens the device or data file at `p` (a directory gets [`DATA_FILE`] inside it; a missing
/// path is created as a directory), locked for this process (waiting up to `l2.lock_wait_ms`
/// for a previous holder), without changing its length.
pub fn open(cfg: &L2Config, p: &Path) -> Result<Device> {
    use std::os::unix::fs::FileTypeExt;
    let lock_wait = std::time::Duration::from_millis(cfg.lock_wait_ms);
    let meta = match std::fs::metadata(p) {
        Ok(m) => Some(m),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(Error::invalid(format!("L2 path {}: {e}", p.display()))),
    };
    let file_path = match &meta {
        Some(m) if m.file_type().is_block_device() => {
            let (file, dev_bytes) = kvnode_hw::open_block_device(p)
                .map_err(|e| Error::from(e).context(format!("opening {}", p.display())))?;
            kvnode_hw::lock_exclusive(&file, lock_wait).map_err(|e| in_use(p, e))?;
            return Ok(Device {
                file,
                path: p.to_path_buf(),
                bytes: round_2m(dev_bytes.min(cfg.bytes)),
                len: dev_bytes,
                created: false,
                block_device: true,
            });
        }
        Some(m) if m.is_dir() => p.join(DATA_FILE),
        Some(m) if m.is_file() => p.to_path_buf(),
        Some(_) => {
            return Err(Error::invalid(format!(
                "L2 path {} is neither a directory, a file nor a block device",
                p.display()
            )))
        }
        None => {
            std::fs::create_dir_all(p).map_err(|e| {
                Error::invalid(format!("creating L2 directory {}: {e}", p.display()))
            })?;
            p.join(DATA_FILE)
        }
    };
    let opened = match kvnode_hw::open_data_file_locked(&file_path, lock_wait) {
        Ok(o) => o,
        Err(e @ HwError::Os { op: "flock", .. }) => return Err(in_use(&file_path, e)),
        Err(e) => return Err(Error::from(e).context(format!("opening {}", file_path.display()))),
    };
    Ok(Device {
        file: opened.file,
        path: file_path,
        bytes: round_2m(cfg.bytes),
        len: opened.len,
        created: opened.created,
        block_device: false,
    })
}

/// The error for a data file or device another process holds locked.
fn in_use(path: &Path, e: HwError) -> Error {
    Error::from(e).context(format!("{} is in use by another kvnode", path.display()))
}

/// Reads the superblock copies and, where needed, the rest of the device, and says what it
/// holds. Reads only; an I/O error is returned as such (never taken for "empty").
pub fn identify(dev: &Device) -> Result<Found> {
    if dev.created || dev.len == 0 {
        return Ok(Found::Empty(if dev.created {
            "created now"
        } else {
            "zero length"
        }));
    }
    // The superblock copies and the rest of the reserved area before the first extent, which a
    // kvnode tier never writes: anything there is another program's.
    let head = kvnode_hw::read_direct(&dev.file, 0, EXTENT_BASE as usize).map_err(|e| {
        Error::from(e).context(format!("reading the superblocks of {}", dev.path.display()))
    })?;
    let copies: Vec<&[u8]> = head.chunks(BLOCK).take(2).collect();
    let reserved_data = head
        .iter()
        .skip(2 * BLOCK)
        .position(|&b| b != 0)
        .map(|i| i + 2 * BLOCK);
    let decoded: Vec<std::result::Result<Superblock, FormatError>> = copies
        .iter()
        .map(|c| {
            if c.len() == BLOCK {
                Superblock::decode(c)
            } else {
                Err(FormatError::Empty) // the file ends inside it: never written
            }
        })
        .collect();
    let ours_magic = |c: &[u8]| c.len() >= 8 && c[..8] == SUPERBLOCK_MAGIC.to_le_bytes();
    let zero = |c: &[u8]| c.iter().all(|&b| b == 0);
    let best = decoded
        .iter()
        .filter_map(|d| d.as_ref().ok())
        .max_by_key(|sb| sb.update)
        .cloned();
    if let Some(sb) = best {
        // Every other copy must be ours too (valid, or damaged with our magic), or still zero
        // right after the first formatting; a foreign block there means someone else wrote
        // over the device since.
        for (i, c) in copies.iter().enumerate() {
            let fine = decoded[i].is_ok() || ours_magic(c) || (zero(c) && sb.update <= 2);
            if !fine {
                return Ok(Found::Foreign(format!(
                    "a kvnode superblock, but block {i} (byte {}) holds another program's data",
                    i * BLOCK
                )));
            }
        }
        if let Some(at) = reserved_data {
            return Ok(Found::Foreign(format!(
                "a kvnode superblock, but another program's data at byte {at} of the area \
                 kvnode leaves empty"
            )));
        }
        return Ok(Found::Ours(sb));
    }
    if copies.iter().any(|c| ours_magic(c)) {
        // Damaged copies of ours, next to nothing else: ours to format again. A block that is
        // not ours next to them, or data in the reserved area, is someone else's.
        if let Some(i) = copies.iter().position(|c| !ours_magic(c) && !zero(c)) {
            return Ok(Found::Foreign(format!(
                "a damaged kvnode superblock, but block {i} (byte {}) holds another program's \
                 data",
                i * BLOCK
            )));
        }
        if let Some(at) = reserved_data {
            return Ok(Found::Foreign(format!(
                "a damaged kvnode superblock, but another program's data at byte {at}"
            )));
        }
        let why = decoded
            .iter()
            .enumerate()
            .map(|(i, d)| match d {
                Ok(_) => format!("copy {i} valid"),
                Err(e) => format!("copy {i}: {e}"),
            })
            .collect::<Vec<_>>()
            .join("; ");
        return Ok(Found::OursDamaged(why));
    }
    let scan_len = if dev.block_device { dev.bytes } else { dev.len };
    match kvnode_hw::scan_for_data(&dev.file, scan_len, MAX_EMPTY_SCAN_BYTES).map_err(|e| {
        Error::from(e).context(format!("checking that {} is empty", dev.path.display()))
    })? {
        DataScan::Zero => Ok(Found::Empty("every byte is zero")),
        DataScan::DataAt(at) => Ok(Found::Foreign(format!(
            "no kvnode superblock, and data at byte {at}"
        ))),
        DataScan::Unproven { checked } => Ok(Found::Foreign(format!(
            "no kvnode superblock; the first {checked} bytes are zero, but proving the rest \
             empty would take reading more than {MAX_EMPTY_SCAN_BYTES} bytes"
        ))),
    }
}

/// What to do with a device [`accept`]ed. Invariant: `wipe` only for a device to format.
#[derive(Debug)]
pub struct Accepted {
    /// The superblock to recover from; `None`: format.
    pub previous: Option<Superblock>,
    /// The reserved area (everything before the first extent) must be zeroed before the
    /// superblocks are written: it may hold old data (an overwritten device, damaged copies).
    pub wipe: bool,
}

/// Applies `l2.format` to what [`identify`] found: the superblock to recover from, a device to
/// format, or the refusal that names the device.
pub fn accept(cfg: &L2Config, dev: &Device, found: Found) -> Result<Accepted> {
    let format = |wipe| Accepted {
        previous: None,
        wipe,
    };
    match found {
        Found::Ours(sb) => Ok(Accepted {
            previous: Some(sb),
            wipe: false,
        }),
        Found::Empty(how) => {
            tracing::info!(path = %dev.path.display(), how, "L2 device empty: formatting it");
            Ok(format(false))
        }
        Found::OursDamaged(why) => {
            tracing::error!(
                path = %dev.path.display(),
                why,
                "no valid L2 superblock copy (damaged, or written by an older kvnode format): \
                 formatting the tier again (its cached objects are lost)"
            );
            Ok(format(true))
        }
        Found::Foreign(what) if cfg.format == L2Format::Overwrite => {
            tracing::warn!(
                path = %dev.path.display(),
                what,
                "L2 device holds other data; formatting it because l2.format = overwrite"
            );
            Ok(format(true))
        }
        Found::Foreign(what) => Err(Error::invalid(format!(
            "{} holds data that is not a kvnode L2 tier ({what}); refusing to use it. Point \
             --l2-path at an empty file, directory or device, or pass --l2-format overwrite \
             (l2.format = \"overwrite\") to destroy its contents",
            dev.path.display()
        ))),
    }
}

impl Device {
    /// Grows a regular file to `bytes` (reserving the space; a sparse file with a warning when
    /// the file system is too full); block devices are never resized. Call only after
    /// [`accept`]. A longer file is refused, never truncated.
    pub fn grow(&mut self) -> Result<()> {
        if self.block_device || self.len == self.bytes {
            return Ok(());
        }
        let sized =
            |reserve| kvnode_hw::grow_data_file(&self.file, &self.path, self.bytes, reserve);
        match sized(true) {
            Ok(()) => {}
            Err(HwError::Os {
                op: "fallocate",
                source,
            }) if source.raw_os_error() == Some(libc::ENOSPC) => {
                tracing::warn!(
                    path = %self.path.display(),
                    bytes = self.bytes,
                    "not enough free space to reserve the L2 file; using a sparse file (writes \
                     that find the disk full fail per object and are counted as errors)"
                );
                sized(false).map_err(|e| self.grow_error(e))?;
            }
            Err(e) => return Err(self.grow_error(e)),
        }
        self.len = self.bytes;
        Ok(())
    }

    fn grow_error(&self, e: HwError) -> Error {
        match e {
            HwError::Invalid(m) => Error::invalid(format!(
                "{m} (pass the size the file was created with, or remove it)"
            )),
            e => Error::from(e).context(format!("sizing {}", self.path.display())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    struct Dir(PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    fn dir(tag: &str) -> Dir {
        let p = std::env::temp_dir().join(format!("kvnode-l2dev-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Dir(p)
    }
    fn cfg(bytes: u64) -> L2Config {
        L2Config {
            bytes,
            lock_wait_ms: 10,
            ..L2Config::default()
        }
    }
    fn superblock(update: u64) -> Vec<u8> {
        let mut b = vec![0u8; BLOCK];
        Superblock {
            format_id: 9,
            file_bytes: 64 << 20,
            extent_bytes: 2 << 20,
            update,
            seq_limit: 10,
            epoch_limit: 10,
            checkpoint: 0,
            torn_below: 0,
        }
        .encode(&mut b);
        b
    }
    /// Writes `blocks` (offset, bytes) into a file of `len` bytes and identifies it.
    fn judge(tag: &str, len: u64, blocks: &[(u64, &[u8])]) -> Found {
        let d = dir(tag);
        let p = d.0.join("f");
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(len).unwrap();
        for (off, b) in blocks {
            f.write_all_at(b, *off).unwrap();
        }
        f.sync_all().unwrap();
        let dev = open(&cfg(64 << 20), &p).unwrap();
        identify(&dev).unwrap()
    }

    #[test]
    fn zero_first_blocks_do_not_make_foreign_data_empty() {
        // An md 1.2 superblock sits at 4 KiB, ZFS labels at 16 KiB, btrfs at 64 KiB.
        for at in [4096u64, 16 << 10, 64 << 10, 3 << 20, (64 << 20) - 1] {
            match judge("md", 64 << 20, &[(at, b"\xfc\x4e\x2b\xa9")]) {
                Found::Foreign(what) => assert!(what.contains(&format!("byte {at}")), "{what}"),
                other => panic!("data at {at} taken for {other:?}"),
            }
        }
    }

    #[test]
    fn new_zero_and_preallocated_files_are_empty() {
        assert!(matches!(judge("zero", 0, &[]), Found::Empty(_)));
        assert!(matches!(judge("sparse", 64 << 20, &[]), Found::Empty(_)));
        let zeros = vec![0u8; 1 << 20];
        assert!(matches!(
            judge("zeros", 64 << 20, &[(0, &zeros), (8 << 20, &zeros)]),
            Found::Empty(_)
        ));
        let d = dir("created");
        let dev = open(&cfg(64 << 20), &d.0).unwrap();
        assert!(dev.created && dev.path.ends_with(DATA_FILE));
        assert!(matches!(
            identify(&dev).unwrap(),
            Found::Empty("created now")
        ));
    }

    #[test]
    fn ownership_needs_every_superblock_block_to_be_ours() {
        let (one, two) = (superblock(1), superblock(2));
        // Right after the first format (copy 1 written, block 0 still zero): ours.
        assert!(
            matches!(judge("fresh", 64 << 20, &[(4096, &one)]), Found::Ours(sb) if sb.update == 1)
        );
        // Both copies: the higher update wins.
        assert!(matches!(
            judge("both", 64 << 20, &[(0, &two), (4096, &one)]),
            Found::Ours(sb) if sb.update == 2
        ));
        // A torn copy next to a valid one: ours.
        let mut torn = superblock(4);
        torn[100] ^= 1;
        assert!(matches!(
            judge("torn", 64 << 20, &[(0, &torn), (4096, &superblock(3))]),
            Found::Ours(sb) if sb.update == 3
        ));
        // Another program's superblock over block 0 (XFS), an old kvnode copy left in block 1.
        assert!(matches!(
            judge(
                "xfs",
                64 << 20,
                &[(0, b"XFSB\0\0\x10\0"), (4096, &superblock(7))]
            ),
            Found::Foreign(_)
        ));
        // Block 0 zeroed by someone, long after the first format: not provably ours.
        assert!(matches!(
            judge("wiped", 64 << 20, &[(4096, &superblock(9))]),
            Found::Foreign(_)
        ));
        // Only damaged copies with the kvnode magic: ours, damaged.
        assert!(matches!(
            judge("damaged", 64 << 20, &[(0, &torn)]),
            Found::OursDamaged(_)
        ));
    }

    #[test]
    fn foreign_data_is_refused_by_name_unless_overwrite() {
        let d = dir("refuse");
        let p = d.0.join("f");
        std::fs::write(&p, b"someone's notes").unwrap();
        let dev = open(&cfg(64 << 20), &p).unwrap();
        let found = identify(&dev).unwrap();
        let e = accept(&cfg(64 << 20), &dev, found).unwrap_err().to_string();
        assert!(
            e.contains(&p.display().to_string()) && e.contains("overwrite"),
            "{e}"
        );
        let found = identify(&dev).unwrap();
        let over = L2Config {
            format: L2Format::Overwrite,
            ..cfg(64 << 20)
        };
        let a = accept(&over, &dev, found).unwrap();
        assert!(a.previous.is_none() && a.wipe);
        assert_eq!(
            std::fs::read(&p).unwrap(),
            b"someone's notes",
            "judging writes nothing"
        );
    }

    #[test]
    fn a_data_file_that_is_not_a_regular_file_is_refused() {
        let d = dir("devnode");
        std::os::unix::fs::symlink("/dev/null", d.0.join(DATA_FILE)).unwrap();
        let e = open(&cfg(64 << 20), &d.0)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }
}
