//! The L2 disk tier: committed L1 objects written behind to local NVMe (a data file opened
//! `O_DIRECT`, or a block device) straight from their pool slots, loaded back into L1 slots by
//! prefetch when a lookup finds them only on disk, and rebuilt from on-disk headers at start-up.
//!
//! * [`device`]: opening a device and judging it ours, empty or foreign before any write.
//! * [`format`]: the on-disk layout (superblock, extent headers, slot headers, checksums).
//! * [`table`]: extent tables, a clean shutdown's record of every slot (fast restarts).
//! * [`identity`]: the superblock in force and the sequence numbers and epochs leased under it.
//! * [`iowatch`]: device calls in progress (a device that stops answering makes the tier stuck).
//! * [`loader`]: the threads that run loads for requests, which wait for them at most
//!   `l2.io_timeout_ms` (a stuck device costs misses, never a request thread).
//! * [`gate`]: the CLEAR gate (many operations at once, or one CLEAR alone).
//! * [`space`]: the in-memory index and space manager (extents, fixed-stride slots, LRU).
//! * [`tier`]: [`L2Tier`], the I/O around both: open/recover, write-behind batches, loads.
//! * [`set`]: [`L2Set`], the tier over one or more devices (objects spread by key).
//! * [`writer`]: the write-behind thread and its bounded queue.

pub mod device;
pub mod format;
pub mod gate;
pub mod identity;
pub mod iowatch;
pub mod loader;
pub mod set;
pub mod space;
pub mod table;
pub mod tier;
pub mod writer;

#[cfg(test)]
mod tests;

pub use set::{L2Set, L2SetStatus};
pub use tier::{L2Status, L2Tier};
