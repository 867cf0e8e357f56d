//! The index's public types: where a slot lives, what a reservation or recovery gives, the
//! space statistics, and the errors of reservations, state transitions and recovery.

use std::fmt;

/// Where a slot lives. Invariant: `file_offset == format::slot_offset(extent_bytes, extent,
/// stride, index)`, and `epoch` is the extent's epoch
/// at the time the slot was handed out (stale if the extent was reassigned).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotRef {
    /// Extent number, `< extent_count`.
    pub extent: u32,
    /// Slot number within the extent, `< format::slots_per_extent(extent_bytes, stride)`.
    pub index: u32,
    /// Bytes per slot (header + payload), a multiple of `BLOCK`, `>= MIN_STRIDE`.
    pub stride: u64,
    /// Epoch of the extent's assignment, `>= 1`.
    pub epoch: u64,
    /// File offset of the slot header.
    pub file_offset: u64,
}

/// A visible (Ready, not doomed) entry as seen by readers. Invariant:
/// `0 < object_len <= slot.stride - BLOCK`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Located {
    /// The slot holding the object.
    pub slot: SlotRef,
    /// Payload length in bytes.
    pub object_len: u64,
    /// Payload checksum recorded at commit.
    pub checksum: u64,
    /// Caller's sequence number (higher = newer version).
    pub seq: u64,
    /// Caller's layout fingerprint recorded at commit (0 = unknown).
    pub layout: u64,
}

/// What recovery read from one slot header. Invariant: as found on disk, unvalidated;
/// `recover_entry` checks it against the slot before inserting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recovered {
    /// Payload length in bytes.
    pub object_len: u64,
    /// Payload checksum from the header.
    pub checksum: u64,
    /// Write sequence number from the header.
    pub seq: u64,
    /// Layout fingerprint from the header (0 = unknown).
    pub layout: u64,
}

/// Result of [`L2Index::reserve`]. Invariant: `slot` is exclusively owned by the
/// new Writing entry; `new_extent`, when set, is `(extent, epoch, stride)` of an
/// extent just (re)assigned, whose header the caller must write first; no key
/// in `evicted` is in the index any more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation<K> {
    /// The slot to write the payload into.
    pub slot: SlotRef,
    /// `(extent, epoch, stride)` of a newly assigned extent, if any.
    pub new_extent: Option<(u32, u64, u64)>,
    /// Keys evicted to make room (for counters and logs).
    pub evicted: Vec<K>,
}

/// Space usage snapshot. Invariant: `used_bytes <= capacity_bytes`,
/// `free_extents <= extents`, `entries <= max_entries`, `index_bytes <= index_limit_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpaceStats {
    /// `extent_count * extent_bytes`.
    pub capacity_bytes: u64,
    /// Sum of the strides of all entries, Writing and doomed included.
    pub used_bytes: u64,
    /// Entries that are Ready and not doomed.
    pub objects: u64,
    /// Entries in the Writing state (doomed or not).
    pub writing: u64,
    /// Entries with at least one pin.
    pub pinned: u64,
    /// Extents assigned to no stride.
    pub free_extents: u32,
    /// Total extents.
    pub extents: u32,
    /// Every entry, in any state (what the entry cap counts).
    pub entries: u64,
    /// Most entries the index holds ([`L2Index::max_entries`]).
    pub max_entries: u64,
    /// Index memory charged now ([`L2Index::index_bytes`]); `<= index_limit_bytes`.
    pub index_bytes: u64,
    /// The index's memory limit (`u64::MAX` for an index made by [`L2Index::new`]).
    pub index_limit_bytes: u64,
    /// Records recovery left out because of the entry cap ([`L2Index::unindexed`]).
    pub unindexed: u64,
}

/// Why [`L2Index::reserve`] failed. Invariant: a failed reserve changes nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveError {
    /// The key already has an entry (possibly Writing or doomed).
    Exists,
    /// `object_len` is 0 or above `max`.
    TooLarge {
        /// Requested length.
        object_len: u64,
        /// [`L2Index::max_object_len`].
        max: u64,
    },
    /// Every slot that could hold the object is pinned, Writing or doomed, or the index is
    /// at its entry cap and no entry is evictable.
    NoSpace,
}

/// Why a state transition failed. Invariant: only `Doomed` comes with a change
/// (the doomed entry was freed); the others change nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateError {
    /// The key has no entry.
    NotFound,
    /// The entry is in another state, or its slot differs from the one given.
    WrongState,
    /// The entry was removed while in flight; it has now been freed.
    Doomed,
}

/// Why [`L2Index::recover_extent`] refused an extent. Invariant: nothing changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecoverError {
    /// Extent out of range, already assigned, bad stride or bad epoch.
    BadExtent(String),
}

/// Outcome of [`L2Index::recover_entry`]. Invariant: only `Inserted` and
/// `ReplacedOlder` leave the given slot occupied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecoverOutcome {
    /// New key, entry inserted.
    Inserted,
    /// The key had a lower seq; the old slot was freed, this one inserted.
    ReplacedOlder,
    /// The key has an equal or higher seq; this slot stays free.
    KeptNewer,
    /// The record does not fit the index; the slot stays free.
    Rejected(String),
    /// The index is at its entry cap and the record is older (by seq) than every entry: not
    /// indexed, counted in [`L2Index::unindexed`]; the slot stays free.
    OverCap,
}

impl fmt::Display for ReserveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Exists => write!(f, "key already has an L2 entry"),
            Self::TooLarge { object_len, max } => {
                write!(
                    f,
                    "object of {object_len} bytes does not fit L2 (max {max})"
                )
            }
            Self::NoSpace => write!(f, "no evictable L2 space"),
        }
    }
}

impl fmt::Display for StateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotFound => write!(f, "no L2 entry for key"),
            Self::WrongState => write!(f, "L2 entry in wrong state or slot mismatch"),
            Self::Doomed => write!(f, "L2 entry was removed while in flight"),
        }
    }
}

impl fmt::Display for RecoverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BadExtent(why) => write!(f, "bad L2 extent: {why}"),
        }
    }
}

impl std::error::Error for ReserveError {}
impl std::error::Error for StateError {}
impl std::error::Error for RecoverError {}
