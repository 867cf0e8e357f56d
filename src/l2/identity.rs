//! [`Identity`]: the tier's current superblock and the numbers leased under it (slot sequence
//! numbers and extent epochs).
//!
//! Numbers are never reused, whatever a run could read at start-up: the superblock records
//! limits below which every number ever written lies, and a run raises a limit (writing and
//! syncing a new superblock copy) *before* it issues a number at or above it. A run that opens
//! the tier raises both limits at once and starts from the old ones, so its numbers are above
//! every number of every earlier run, including those in headers it could not read.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::format::{Superblock, BLOCK};
use crate::error::{Error, ErrorKind, Result};

/// Sequence numbers leased per superblock write.
pub const SEQ_LEASE: u64 = 1 << 32;
/// Extent epochs leased per superblock write.
pub const EPOCH_LEASE: u64 = 1 << 24;
/// A new epoch lease is taken when fewer than this many epochs are left (more than the number
/// of threads that can reserve at once, each taking at most one epoch per reservation).
pub const EPOCH_MARGIN: u64 = 1 << 10;

/// Writes one superblock block at a file offset and makes it durable (write + fdatasync).
pub type WriteDurable<'a> = &'a dyn Fn(u64, &[u8]) -> Result<()>;

/// The current superblock and the lease counters. Invariants: `current` is the copy last
/// written durably; every sequence number handed out is below `current.seq_limit`, and the
/// caller keeps every epoch it assigns below `current.epoch_limit` ([`Identity::ensure_epochs`]).
pub struct Identity {
    /// The durable copy; locked only to read or replace it, never across I/O.
    current: Mutex<Superblock>,
    /// Serialises superblock writes (held across their I/O).
    writing: Mutex<()>,
    /// Format id of the durable copy.
    durable_format_id: AtomicU64,
    format_id: AtomicU64,
    next_seq: AtomicU64,
    seq_limit: AtomicU64,
    epoch_limit: AtomicU64,
    first_epoch: u64,
    /// The first sequence number of this run: every object numbered below it was written by an
    /// earlier run.
    first_seq: u64,
    /// The superblock's checkpoint when the tier was opened (0: no clean stop before).
    opened_checkpoint: u64,
    /// Objects numbered below this were written before an unclean stop (see
    /// [`Superblock::torn_below`]), as of this run's open.
    torn_below: u64,
}

fn random_format_id() -> u64 {
    let mut b = [0u8; 8];
    let from_os = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .is_ok();
    let mut id = u64::from_le_bytes(b);
    if !from_os {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        id = t ^ (u64::from(std::process::id()) << 32);
    }
    id.max(1)
}

fn exhausted(what: &str) -> Error {
    Error::new(
        ErrorKind::LimitExceeded,
        format!("the L2 tier has used up its {what} (format the tier again)"),
    )
}

impl Identity {
    /// Formats: writes a superblock with a fresh format id, twice (both copies, one after the
    /// other, each durable), continuing the update count and the limits of `previous` when the
    /// device held a kvnode tier, so numbers keep growing across formats too.
    pub fn format(
        previous: Option<&Superblock>,
        file_bytes: u64,
        extent_bytes: u64,
        write: WriteDurable<'_>,
    ) -> Result<Identity> {
        let base = previous.map_or(
            Superblock {
                format_id: 0,
                file_bytes,
                extent_bytes,
                update: 0,
                seq_limit: 1,
                epoch_limit: 1,
                checkpoint: 0,
                torn_below: 0,
            },
            |p| Superblock {
                file_bytes,
                extent_bytes,
                ..p.clone()
            },
        );
        let mut sb = Superblock {
            format_id: random_format_id(),
            checkpoint: 0,
            torn_below: 0,
            ..base
        };
        for _ in 0..2 {
            sb.update = sb
                .update
                .checked_add(1)
                .ok_or_else(|| exhausted("updates"))?;
            write_copy(&sb, write)?;
        }
        let id = Identity::recovered(sb.clone());
        id.lease(write)?;
        Ok(id)
    }

    /// Opens a tier recovered from `sb` (the current copy read from the device): raises both
    /// limits durably before anything is numbered, and numbers from the old limits on.
    pub fn open(sb: Superblock, write: WriteDurable<'_>) -> Result<Identity> {
        let id = Identity::recovered(sb);
        id.lease(write)?;
        Ok(id)
    }

    /// A placeholder for a tier being opened, replaced by [`Identity::format`] or
    /// [`Identity::open`] before anything is numbered or written under it.
    pub(super) fn unformatted() -> Identity {
        Identity::recovered(Superblock {
            format_id: 0,
            file_bytes: 0,
            extent_bytes: 0,
            update: 0,
            seq_limit: 0,
            epoch_limit: 0,
            checkpoint: 0,
            torn_below: 0,
        })
    }

    fn recovered(sb: Superblock) -> Identity {
        Identity {
            writing: Mutex::new(()),
            durable_format_id: AtomicU64::new(sb.format_id),
            format_id: AtomicU64::new(sb.format_id),
            next_seq: AtomicU64::new(sb.seq_limit),
            seq_limit: AtomicU64::new(sb.seq_limit),
            epoch_limit: AtomicU64::new(sb.epoch_limit),
            first_epoch: sb.epoch_limit,
            first_seq: sb.seq_limit,
            opened_checkpoint: sb.checkpoint,
            // What the open's lease will record (see `lease`).
            torn_below: if sb.checkpoint == 0 {
                sb.torn_below.max(sb.seq_limit)
            } else {
                sb.torn_below
            },
            current: Mutex::new(sb),
        }
    }

    /// Raises both limits by a lease (one superblock write), and withdraws the checkpoint: from
    /// now on this run may change any extent, so its tables no longer describe the tier.
    fn lease(&self, write: WriteDurable<'_>) -> Result<()> {
        self.update(write, |sb| {
            if sb.checkpoint == 0 {
                // Not stopped cleanly: every object of the runs before may be torn.
                sb.torn_below = sb.torn_below.max(sb.seq_limit);
            }
            sb.checkpoint = 0;
            sb.seq_limit = sb
                .seq_limit
                .checked_add(SEQ_LEASE)
                .ok_or_else(|| exhausted("sequence numbers"))?;
            sb.epoch_limit = sb
                .epoch_limit
                .checked_add(EPOCH_LEASE)
                .ok_or_else(|| exhausted("extent epochs"))?;
            Ok(())
        })
    }

    /// Writes the next superblock copy: `change` applied to the current one, `update` + 1.
    /// The in-memory state follows only once the copy is durable. Writers are serialised; the
    /// durable copy's lock is never held across the I/O, so readers (STATUS, the next-number
    /// fast paths) never wait for a device.
    fn update(
        &self,
        write: WriteDurable<'_>,
        change: impl FnOnce(&mut Superblock) -> Result<()>,
    ) -> Result<()> {
        let _one = self.writing.lock();
        let mut next = self.current.lock().clone();
        // Only `mark_clean` names a checkpoint: any other superblock write comes from a run
        // that may still change the tier, so it withdraws whatever checkpoint was named.
        next.checkpoint = 0;
        change(&mut next)?;
        next.update = next
            .update
            .checked_add(1)
            .ok_or_else(|| exhausted("updates"))?;
        write_copy(&next, write)?;
        self.seq_limit.store(next.seq_limit, Ordering::Release);
        self.epoch_limit.store(next.epoch_limit, Ordering::Release);
        self.durable_format_id
            .store(next.format_id, Ordering::Release);
        *self.current.lock() = next;
        Ok(())
    }

    /// The format id headers are written under now.
    pub fn format_id(&self) -> u64 {
        self.format_id.load(Ordering::Acquire)
    }

    /// The current superblock copy.
    pub fn superblock(&self) -> Superblock {
        self.current.lock().clone()
    }

    /// Starts a new format (CLEAR), in memory: headers staged from now on carry a fresh format
    /// id, so every header written before is stale once [`Identity::persist_format`] has made
    /// the id durable. Until then a restart still finds the old id (the CLEAR is not durable).
    pub fn begin_reformat(&self) {
        self.format_id.store(random_format_id(), Ordering::Release);
    }

    /// Whether the format id in force is not yet durable (a CLEAR waits for its superblock).
    pub fn format_pending(&self) -> bool {
        self.durable_format_id.load(Ordering::Acquire) != self.format_id()
    }

    /// Writes the format id in force durably, if it is not already.
    pub fn persist_format(&self, write: WriteDurable<'_>) -> Result<()> {
        // The id is read under the writers' lock: of two writes racing, the later one writes
        // the id in force when it runs, never an older one.
        self.update(write, |sb| {
            sb.format_id = self.format_id();
            sb.checkpoint = 0;
            Ok(())
        })
    }

    /// Records a clean stop: the extent tables stamped `checkpoint` (written and synced under
    /// format `format_id`) describe the tier. Refused when the format in force is another one
    /// or not durable (a CLEAR came in between). Nothing may be written to the tier after it.
    pub fn mark_clean(
        &self,
        checkpoint: u64,
        format_id: u64,
        write: WriteDurable<'_>,
    ) -> Result<()> {
        assert!(checkpoint != 0, "checkpoint 0 means none");
        self.update(write, |sb| {
            if sb.format_id != format_id || self.format_id() != format_id {
                return Err(Error::new(
                    ErrorKind::Io,
                    "the L2 tier was cleared while its tables were written: no checkpoint",
                ));
            }
            sb.checkpoint = checkpoint;
            Ok(())
        })
    }

    /// A fresh checkpoint number (random, never 0).
    pub fn new_checkpoint(&self) -> u64 {
        random_format_id()
    }

    /// The checkpoint the tier was opened with (0: it was not stopped cleanly, or never had
    /// one): only tables stamped with it may be read.
    pub fn opened_checkpoint(&self) -> u64 {
        self.opened_checkpoint
    }

    /// The first sequence number of this run (objects below it were found at start-up).
    pub fn first_seq(&self) -> u64 {
        self.first_seq
    }

    /// Objects numbered below this were written before an unclean stop: a checksum failure of
    /// theirs is what the stop left (a torn write, a reused slot), not a change of the medium.
    pub fn torn_below(&self) -> u64 {
        self.torn_below
    }

    /// [`Identity::begin_reformat`] and [`Identity::persist_format`] in one.
    pub fn reformat(&self, write: WriteDurable<'_>) -> Result<()> {
        self.begin_reformat();
        self.persist_format(write)
    }

    /// Makes the next sequence number at least `floor` (recovery found a header numbered
    /// `floor - 1`, which a tier written by this code never has at or above its limit).
    pub fn seq_at_least(&self, floor: u64) {
        self.next_seq.fetch_max(floor, Ordering::AcqRel);
    }

    /// The next slot sequence number: above every number written before, in this run or any
    /// earlier one; extends the lease (a superblock write) when the current one is used up.
    pub fn next_seq(&self, write: WriteDurable<'_>) -> Result<u64> {
        let s = self.next_seq.fetch_add(1, Ordering::AcqRel);
        if s < self.seq_limit.load(Ordering::Acquire) {
            return Ok(s);
        }
        if s < self.current.lock().seq_limit {
            return Ok(s);
        }
        self.update(write, |sb| {
            if sb.seq_limit <= s {
                sb.seq_limit = s
                    .checked_add(SEQ_LEASE)
                    .ok_or_else(|| exhausted("sequence numbers"))?;
            }
            Ok(())
        })?;
        Ok(s)
    }

    /// The next sequence number if the current lease covers it, without any I/O (`None`: call
    /// [`Identity::prepare`] first; the number is then skipped, never reused).
    pub fn try_next_seq(&self) -> Option<u64> {
        let s = self.next_seq.fetch_add(1, Ordering::AcqRel);
        (s < self.seq_limit.load(Ordering::Acquire)).then_some(s)
    }

    /// Whether epochs up to `next_epoch` are leased (no I/O).
    pub fn epochs_leased(&self, next_epoch: u64) -> bool {
        next_epoch < self.epoch_limit.load(Ordering::Acquire)
    }

    /// Extends the leases, if needed, so that `objects` more sequence numbers and as many
    /// epochs above `next_epoch` can be taken without I/O. Call outside any critical section:
    /// it may write the superblock.
    pub fn prepare(&self, objects: u64, next_epoch: u64, write: WriteDurable<'_>) -> Result<()> {
        let want = self
            .next_seq
            .load(Ordering::Acquire)
            .saturating_add(objects);
        if want >= self.seq_limit.load(Ordering::Acquire) {
            self.update(write, |sb| {
                if sb.seq_limit <= want {
                    sb.seq_limit = want
                        .checked_add(SEQ_LEASE)
                        .ok_or_else(|| exhausted("sequence numbers"))?;
                }
                Ok(())
            })?;
        }
        self.ensure_epochs(next_epoch.saturating_add(objects), write)
    }

    /// Makes sure epochs up to `next_epoch + EPOCH_MARGIN` are leased (a superblock write when
    /// not): call before any reservation that may assign an extent the epoch `next_epoch`.
    pub fn ensure_epochs(&self, next_epoch: u64, write: WriteDurable<'_>) -> Result<()> {
        let need = next_epoch.saturating_add(EPOCH_MARGIN);
        if need < self.epoch_limit.load(Ordering::Acquire) {
            return Ok(());
        }
        self.update(write, |sb| {
            if sb.epoch_limit <= need {
                sb.epoch_limit = need
                    .checked_add(EPOCH_LEASE)
                    .ok_or_else(|| exhausted("extent epochs"))?;
            }
            Ok(())
        })
    }

    /// The first epoch this run may assign: the epoch limit before this run's lease, above
    /// every epoch written in earlier runs.
    pub fn first_epoch(&self) -> u64 {
        self.first_epoch
    }
}

/// Encodes `sb` and writes it durably to its copy.
fn write_copy(sb: &Superblock, write: WriteDurable<'_>) -> Result<()> {
    let mut b = vec![0u8; BLOCK];
    sb.encode(&mut b);
    write(sb.offset(), &b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::Mutex as StdMutex;

    /// A device of superblock copies, with a switch that makes writes fail.
    #[derive(Default)]
    struct Disk {
        blocks: StdMutex<HashMap<u64, Vec<u8>>>,
        fail: std::sync::atomic::AtomicBool,
    }
    impl Disk {
        fn write(&self, off: u64, b: &[u8]) -> Result<()> {
            if self.fail.load(Ordering::Relaxed) {
                return Err(Error::new(ErrorKind::Io, "injected"));
            }
            self.blocks.lock().unwrap().insert(off, b.to_vec());
            Ok(())
        }
        fn current(&self) -> Superblock {
            self.blocks
                .lock()
                .unwrap()
                .values()
                .filter_map(|b| Superblock::decode(b).ok())
                .max_by_key(|s| s.update)
                .unwrap()
        }
    }

    #[test]
    fn numbers_of_a_reopened_tier_are_above_everything_leased_before() {
        let disk = Disk::default();
        let w = |o: u64, b: &[u8]| disk.write(o, b);
        let first = Identity::format(None, 64 << 20, 2 << 20, &w).unwrap();
        let a = first.next_seq(&w).unwrap();
        let b = first.next_seq(&w).unwrap();
        assert!(b > a);
        let sb = disk.current();
        assert_eq!(sb.update, 3, "two copies at format, one lease");
        assert!(sb.seq_limit > b && sb.epoch_limit > 1);
        // Reopened from what is on the disk, whatever headers were readable: the new run starts
        // at the old limits.
        let second = Identity::open(sb.clone(), &w).unwrap();
        assert_eq!(second.next_seq(&w).unwrap(), sb.seq_limit);
        assert_eq!(second.first_epoch(), sb.epoch_limit);
        assert!(disk.current().seq_limit >= sb.seq_limit + SEQ_LEASE);
        assert_eq!(disk.current().format_id, sb.format_id);
    }

    #[test]
    fn a_used_up_lease_is_extended_durably_before_its_numbers_are_used() {
        let disk = Disk::default();
        let w = |o: u64, b: &[u8]| disk.write(o, b);
        let id = Identity::format(None, 64 << 20, 2 << 20, &w).unwrap();
        let limit = disk.current().seq_limit;
        id.next_seq.store(limit - 1, Ordering::Relaxed);
        assert_eq!(id.next_seq(&w).unwrap(), limit - 1);
        disk.fail.store(true, Ordering::Relaxed);
        assert!(
            id.next_seq(&w).is_err(),
            "no number beyond a lease that is not durable"
        );
        disk.fail.store(false, Ordering::Relaxed);
        let s = id.next_seq(&w).unwrap();
        assert!(s > limit && s < disk.current().seq_limit);
        // Epochs: close to the limit, a new lease is written first.
        let el = disk.current().epoch_limit;
        id.ensure_epochs(el - EPOCH_MARGIN, &w).unwrap();
        assert!(disk.current().epoch_limit > el);
    }

    #[test]
    fn copies_alternate_and_a_reformat_keeps_the_limits() {
        let disk = Disk::default();
        let w = |o: u64, b: &[u8]| disk.write(o, b);
        let id = Identity::format(None, 64 << 20, 2 << 20, &w).unwrap();
        let before = disk.current();
        assert_eq!(disk.blocks.lock().unwrap().len(), 2, "both copies written");
        id.reformat(&w).unwrap();
        let after = disk.current();
        assert_ne!(after.format_id, before.format_id);
        assert_eq!(id.format_id(), after.format_id);
        assert_eq!(after.seq_limit, before.seq_limit);
        assert_eq!(after.update, before.update + 1);
        assert_ne!(after.offset(), before.offset());
        // A failed write leaves the new id in force for new headers, but not durable yet.
        disk.fail.store(true, Ordering::Relaxed);
        assert!(id.reformat(&w).is_err());
        assert_ne!(id.format_id(), after.format_id);
        assert!(id.format_pending());
        assert_eq!(disk.current().format_id, after.format_id);
        // A lease written meanwhile keeps the durable id; the pending one lands later.
        disk.fail.store(false, Ordering::Relaxed);
        id.ensure_epochs(u64::MAX / 4, &w).unwrap();
        assert_eq!(disk.current().format_id, after.format_id);
        id.persist_format(&w).unwrap();
        assert!(!id.format_pending());
        assert_eq!(disk.current().format_id, id.format_id());
        let after = disk.current();
        // A format over an old tier continues its numbers.
        disk.fail.store(false, Ordering::Relaxed);
        let again = Identity::format(Some(&after), 128 << 20, 4 << 20, &w).unwrap();
        let cur = disk.current();
        assert!(cur.update > after.update && cur.seq_limit > after.seq_limit);
        assert_eq!((cur.file_bytes, cur.extent_bytes), (128 << 20, 4 << 20));
        assert!(again.next_seq(&w).unwrap() >= after.seq_limit);
    }

    #[test]
    fn a_superblock_write_stuck_in_the_device_blocks_no_reader() {
        let disk = Disk::default();
        let w = |o: u64, b: &[u8]| disk.write(o, b);
        let id = Identity::format(None, 64 << 20, 2 << 20, &w).unwrap();
        let release = std::sync::atomic::AtomicBool::new(false);
        let stuck = |o: u64, b: &[u8]| {
            while !release.load(Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            disk.write(o, b)
        };
        id.begin_reformat();
        std::thread::scope(|s| {
            let writer = s.spawn(|| id.persist_format(&stuck));
            std::thread::sleep(std::time::Duration::from_millis(20));
            // STATUS and the numbering fast paths answer while the write hangs.
            let (tx, rx) = std::sync::mpsc::channel();
            let idr = &id;
            s.spawn(move || {
                let id = idr;
                let pending = id.format_pending();
                let sb = id.superblock();
                let seq = id.try_next_seq();
                let _ = tx.send((pending, sb.update, seq.is_some()));
            });
            let got = rx.recv_timeout(std::time::Duration::from_secs(20));
            release.store(true, Ordering::Relaxed);
            let (pending, _, numbered) = got.expect("a reader waited for a stuck superblock write");
            assert!(pending && numbered);
            writer.join().unwrap().unwrap();
        });
        assert!(!id.format_pending());
    }
}
