//! The simulated device under the tier: what every write did to the data file, which of those
//! writes a power loss may still undo, the seeded fault decisions, and the rules the tier's
//! I/O must follow (every write inside `[0, l2.bytes)`, on a superblock copy, an extent header,
//! or the header or payload of a slot of the stride its extent was last given).
//!
//! The model of durability: a write that completed is readable at once; it is *durable* once a
//! later `fdatasync` succeeded. A failed `fdatasync` leaves every write not yet durable in
//! limbo: a later successful one does not cover them (the tier's own assumption, see
//! `L2Tier::sync`), so a power loss may still undo them. A process restart settles limbo
//! writes (each kept or undone then, at random: what the next run reads is what it gets). A
//! power loss undoes a random subset of the writes that are not durable, some of them torn at
//! 4 KiB granularity; durable writes always survive (unless a sabotage says otherwise).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use kvnode_hw::{BlockIo, SharedPool};
use parking_lot::Mutex;

use super::engine::StallArm;
use crate::l2::format::{extent_count, ExtentHeader, SlotHeader, EXTENT_BASE};
use crate::sim::rng::Rng;

mod rules;

use rules::note_header;

/// Block size of the model (and of every tier I/O's alignment).
pub const BLOCK: u64 = 4096;

/// Fault rates, in I/Os per thousand. Invariant: plain data; all zero means a healthy device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultRates {
    /// Reads failing with EIO.
    pub read_eio: u64,
    /// Reads that succeed with one byte flipped in the pool afterwards.
    pub read_flip: u64,
    /// Writes failing with EIO, after a random prefix of their blocks reached the device.
    pub write_eio: u64,
    /// Writes failing with ENOSPC, nothing written.
    pub write_enospc: u64,
    /// `fdatasync` calls failing with EIO.
    pub sync_eio: u64,
}

/// Device misbehaviour the tier is *not* expected to survive, used by tests to prove that the
/// checks catch what they claim to. Invariant: `None` in every ordinary run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Sabotage {
    /// A well-behaved device.
    #[default]
    None,
    /// At the next power loss, the slot header write that became durable last is undone too
    /// (a device that acknowledges a flush it did not do).
    LoseSyncedHeader,
    /// Superblock writes report success but never reach the device (a device that drops
    /// writes it acknowledged).
    DropSuperblockWrites,
    /// Every slot header read with chunk hash `from` comes back naming `to` instead, with a
    /// valid header checksum (a device returning forged metadata).
    ForgeKey {
        /// The key whose headers are rewritten.
        from: [u8; 32],
        /// The key they are made to name.
        to: [u8; 32],
    },
}

/// How the tier went away before it is opened again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restart {
    /// The process stopped (cleanly or not): completed writes stay, limbo writes settle.
    Process,
    /// The machine lost power: writes that are not durable may be undone or torn.
    PowerLoss,
}

/// What a restart does to each write it may undo (a power loss: those not durable; a
/// process restart: those in limbo). Invariant: `Random` in every ordinary run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Fate {
    /// Each is kept, undone, or torn, at random.
    #[default]
    Random,
    /// Every one is kept.
    KeepAll,
    /// Every one is undone.
    UndoAll,
}

/// Counters of what the device did. Invariant: monotonic over a run.
#[derive(Debug, Clone, Copy, Default)]
pub struct DiskStats {
    /// Read I/Os.
    pub reads: u64,
    /// Write I/Os.
    pub writes: u64,
    /// `fdatasync` calls.
    pub syncs: u64,
    /// Injected read EIOs.
    pub read_eio: u64,
    /// Injected bit flips.
    pub flips: u64,
    /// Injected write EIOs.
    pub write_eio: u64,
    /// Injected ENOSPCs.
    pub enospc: u64,
    /// Injected sync failures.
    pub sync_eio: u64,
    /// Blocks a power loss or a limbo settlement put back to older contents.
    pub reverted: u64,
}

/// One write not yet durable: the new contents of each of its blocks (blocks overwritten by a
/// later durable write are dropped from it).
struct Pending {
    blocks: BTreeMap<u64, Box<[u8]>>,
    /// Issued before a failed `fdatasync`: a later successful one does not make it durable.
    limbo: bool,
}

/// The fate of one write I/O.
pub enum WriteFate {
    /// Written in full.
    Ok,
    /// Fails with `errno` after its first `applied` blocks reached the device.
    Fail {
        /// The error returned.
        errno: i32,
        /// Leading blocks written anyway.
        applied: u64,
    },
}

/// The fate of one read I/O.
pub enum ReadFate {
    /// Read as is.
    Ok,
    /// Fails with EIO (nothing read).
    Eio,
    /// Read, then the byte at this offset of the I/O flipped.
    Flip(u64),
}

struct State {
    rates: FaultRates,
    rng: Rng,
    read_seed: u64,
    read_counts: HashMap<u64, u64>,
    /// The data file as the device holds it now (what a read returns).
    image: Vec<u8>,
    /// Durable contents of every block some pending write covers.
    base: BTreeMap<u64, Box<[u8]>>,
    /// Writes not yet durable, oldest first; limbo ones always precede the others.
    pending: Vec<Pending>,
    violations: Vec<String>,
    /// The extent header last written (or attempted) for each extent.
    extents: Vec<Option<ExtentHeader>>,
    /// `(chunk hash, layout) -> (seq, offset)` of the newest slot header written for it.
    headers: BTreeMap<([u8; 32], u64), (u64, u64)>,
    faulted_reads: BTreeSet<u64>,
    sabotage: Sabotage,
    /// Only the `fdatasync` of `L2Tier::sync` may fail (the others always succeed).
    explicit_sync_faults_only: bool,
    /// What a restart does to the writes it may undo (directed tests fix it).
    fate: Fate,
    /// A failed superblock write lands nothing (to look past a known bug).
    clean_superblock_failures: bool,
    /// Slot header blocks in the order they became durable, with their previous contents.
    settled_headers: Vec<(u64, Box<[u8]>)>,
    stats: DiskStats,
}

/// The simulated device: one per run, shared by both engines of every tier opened on it.
/// Invariant: `image` always equals the data file's contents (checked at every restart), and
/// every write the tier issued is accounted for in `pending` until it is durable.
pub struct SimDisk {
    state: Mutex<State>,
    pool: Arc<SharedPool>,
    path: PathBuf,
    bytes: u64,
    extent_bytes: u64,
    /// Where the stuck-I/O worker's thread parks (see [`super::engine`]).
    pub(super) stall: Mutex<Option<StallArm>>,
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SimDisk {
    /// A device for the data file at `path` of `bytes` bytes (not created yet: the tier
    /// creates it; all zero until written), with extents of `extent_bytes`.
    pub fn new(
        pool: Arc<SharedPool>,
        path: PathBuf,
        bytes: u64,
        extent_bytes: u64,
        seed: u64,
    ) -> Arc<SimDisk> {
        let mut rng = Rng::new(seed);
        let read_seed = rng.next_u64();
        Arc::new(SimDisk {
            state: Mutex::new(State {
                rates: FaultRates::default(),
                rng,
                read_seed,
                read_counts: HashMap::new(),
                image: vec![0; bytes as usize],
                base: BTreeMap::new(),
                pending: Vec::new(),
                violations: Vec::new(),
                extents: vec![None; extent_count(bytes, extent_bytes) as usize],
                headers: BTreeMap::new(),
                faulted_reads: BTreeSet::new(),
                sabotage: Sabotage::None,
                explicit_sync_faults_only: false,
                fate: Fate::Random,
                clean_superblock_failures: false,
                settled_headers: Vec::new(),
                stats: DiskStats::default(),
            }),
            pool,
            path,
            bytes,
            extent_bytes,
            stall: Mutex::new(None),
        })
    }

    /// The fault rates in force.
    pub fn rates(&self) -> FaultRates {
        self.state.lock().rates
    }

    /// Sets the fault rates.
    pub fn set_rates(&self, rates: FaultRates) {
        self.state.lock().rates = rates;
    }

    /// Arms a sabotage (tests only).
    pub fn set_sabotage(&self, s: Sabotage) {
        self.state.lock().sabotage = s;
    }

    /// Lets only the `fdatasync` of `L2Tier::sync` fail (to look past a known bug).
    pub fn set_explicit_sync_faults_only(&self, on: bool) {
        self.state.lock().explicit_sync_faults_only = on;
    }

    /// Makes a failed superblock write land nothing (to look past a known bug).
    pub fn set_clean_superblock_failures(&self, on: bool) {
        self.state.lock().clean_superblock_failures = on;
    }

    /// Fixes what restarts do to the writes they may undo (directed tests).
    pub fn set_fate(&self, fate: Fate) {
        self.state.lock().fate = fate;
    }

    /// Counters so far.
    pub fn stats(&self) -> DiskStats {
        self.state.lock().stats
    }

    /// Broken I/O rules seen since the last call (empty when the tier behaved).
    pub fn take_violations(&self) -> Vec<String> {
        std::mem::take(&mut self.state.lock().violations)
    }

    /// Offsets whose reads were faulted since the last [`SimDisk::begin_open`].
    pub fn faulted_reads(&self) -> BTreeSet<u64> {
        self.state.lock().faulted_reads.clone()
    }

    /// Called before the tier is opened: forgets the faulted reads of earlier opens.
    pub fn begin_open(&self) {
        self.state.lock().faulted_reads.clear();
    }

    /// Whether a sabotage makes the device acknowledge `io` without writing it.
    pub fn drops(&self, io: &BlockIo) -> bool {
        io.file_offset < EXTENT_BASE && self.state.lock().sabotage == Sabotage::DropSuperblockWrites
    }

    /// Decides what happens to a write (seeded; writes come from one thread at a time).
    pub fn decide_write(&self, io: &BlockIo) -> WriteFate {
        let mut st = self.state.lock();
        st.stats.writes += 1;
        let r = st.rates;
        let x = st.rng.below(1000);
        if x < r.write_enospc {
            st.stats.enospc += 1;
            return WriteFate::Fail {
                errno: libc::ENOSPC,
                applied: 0,
            };
        }
        if x < r.write_enospc + r.write_eio {
            st.stats.write_eio += 1;
            let mut applied = st.rng.below(io.len / BLOCK + 1);
            if io.file_offset < EXTENT_BASE && st.clean_superblock_failures {
                applied = 0;
            }
            return WriteFate::Fail {
                errno: libc::EIO,
                applied,
            };
        }
        WriteFate::Ok
    }

    /// Records that `io` (its first `len` bytes) reached the device: the image follows and the
    /// write is pending until a sync makes it durable.
    pub fn record_write(&self, io: &BlockIo, len: u64) {
        let mut data = vec![0u8; len as usize];
        self.pool
            .region()
            .read_at(io.pool_offset, &mut data)
            .expect("a validated I/O lies in the pool");
        let mut st = self.state.lock();
        let mut w = Pending {
            blocks: BTreeMap::new(),
            limbo: false,
        };
        for (i, chunk) in data.chunks(BLOCK as usize).enumerate() {
            let b = io.file_offset / BLOCK + i as u64;
            let at = (b * BLOCK) as usize;
            if !st.base.contains_key(&b) {
                let old: Box<[u8]> = st.image[at..at + BLOCK as usize].into();
                st.base.insert(b, old);
            }
            st.image[at..at + BLOCK as usize].copy_from_slice(chunk);
            w.blocks.insert(b, chunk.into());
        }
        st.pending.push(w);
        if len == BLOCK {
            note_header(&mut st, io.file_offset, &data);
        }
    }

    /// Decides what happens to a read: a pure function of the seed, the offset and how often
    /// that offset was read (reads at start-up come from several threads at once).
    pub fn decide_read(&self, io: &BlockIo) -> ReadFate {
        let mut st = self.state.lock();
        st.stats.reads += 1;
        let n = {
            let c = st.read_counts.entry(io.file_offset).or_insert(0);
            *c += 1;
            *c
        };
        let h = mix(st.read_seed ^ mix(io.file_offset ^ mix(n)));
        let (r, x) = (st.rates, h % 1000);
        if x < r.read_eio {
            st.stats.read_eio += 1;
            st.faulted_reads.insert(io.file_offset);
            ReadFate::Eio
        } else if x < r.read_eio + r.read_flip {
            st.stats.flips += 1;
            st.faulted_reads.insert(io.file_offset);
            ReadFate::Flip((h >> 16) % io.len)
        } else {
            ReadFate::Ok
        }
    }

    /// After a successful read: applies its fate and any sabotage to the bytes in the pool.
    pub fn after_read(&self, io: &BlockIo, fate: &ReadFate) {
        let region = self.pool.region();
        if let ReadFate::Flip(at) = fate {
            let mut b = [0u8; 1];
            region
                .read_at(io.pool_offset + at, &mut b)
                .expect("in pool");
            region
                .write_at(io.pool_offset + at, &[b[0] ^ 0x10])
                .expect("in pool");
        }
        let Sabotage::ForgeKey { from, to } = self.state.lock().sabotage else {
            return;
        };
        if let Some(block) = self.pool_block(io) {
            if let Ok(mut h) = SlotHeader::decode(&block) {
                if h.chunk_hash == from {
                    h.chunk_hash = to;
                    let mut out = vec![0u8; BLOCK as usize];
                    h.encode(&mut out).expect("a decoded header encodes");
                    region.write_at(io.pool_offset, &out).expect("in pool");
                }
            }
        }
    }

    /// `fdatasync` (`explicit`: called by `L2Tier::sync`): `true` when it succeeded (every
    /// write so far is durable, limbo ones excepted); a failure puts every pending write in
    /// limbo.
    pub fn sync(&self, explicit: bool) -> bool {
        let mut st = self.state.lock();
        st.stats.syncs += 1;
        let may_fail = explicit || !st.explicit_sync_faults_only;
        if st.rng.below(1000) < st.rates.sync_eio && may_fail {
            st.stats.sync_eio += 1;
            for w in &mut st.pending {
                w.limbo = true;
            }
            return false;
        }
        // A block is durable when its newest write is not in limbo.
        let mut newest: BTreeMap<u64, bool> = BTreeMap::new();
        for w in &st.pending {
            for b in w.blocks.keys() {
                newest.insert(*b, w.limbo);
            }
        }
        let settled: BTreeSet<u64> = newest
            .into_iter()
            .filter(|(_, limbo)| !limbo)
            .map(|(b, _)| b)
            .collect();
        let mut order = Vec::new();
        for w in &st.pending {
            for b in w.blocks.keys().filter(|b| settled.contains(b)) {
                order.retain(|x| x != b);
                order.push(*b);
            }
        }
        for b in order {
            let old = st.base.remove(&b).expect("pending blocks have a base");
            let at = (b * BLOCK) as usize;
            if SlotHeader::decode(&st.image[at..at + BLOCK as usize]).is_ok() {
                st.settled_headers.push((b, old));
                if st.settled_headers.len() > 64 {
                    st.settled_headers.remove(0);
                }
            }
        }
        for w in &mut st.pending {
            w.blocks.retain(|b, _| !settled.contains(b));
        }
        st.pending.retain(|w| !w.blocks.is_empty());
        true
    }

    /// The tier is gone (dropped); the device goes through `how` before the next open.
    /// Returns the number of blocks whose contents changed.
    pub fn restart(&self, how: Restart) -> std::io::Result<u64> {
        let mut st = self.state.lock();
        let power = how == Restart::PowerLoss;
        // Each affected write is kept, lost, or torn (a random subset of its blocks kept).
        let n = st.pending.len();
        let mut keep: Vec<Option<Vec<bool>>> = Vec::with_capacity(n);
        for i in 0..n {
            let w = &st.pending[i];
            let blocks = w.blocks.len();
            if !(power || w.limbo) {
                keep.push(None); // stays pending, unchanged
                continue;
            }
            let fate = match st.fate {
                Fate::Random => st.rng.below(3),
                Fate::KeepAll => 0,
                Fate::UndoAll => 1,
            };
            keep.push(Some(
                (0..blocks)
                    .map(|_| match fate {
                        0 => true,
                        1 => false,
                        _ => st.rng.chance(50),
                    })
                    .collect(),
            ));
        }
        // Settled contents of every affected block: its newest kept write, else its base.
        let mut settled: BTreeMap<u64, Box<[u8]>> = BTreeMap::new();
        for (w, k) in st.pending.iter().zip(&keep) {
            let Some(k) = k else { continue };
            for ((b, data), kept) in w.blocks.iter().zip(k) {
                let entry = settled.entry(*b).or_insert_with(|| st.base[b].clone());
                if *kept {
                    *entry = data.clone();
                }
            }
        }
        let survivors: Vec<Pending> = std::mem::take(&mut st.pending)
            .into_iter()
            .zip(&keep)
            .filter(|(_, k)| k.is_none())
            .map(|(w, _)| w)
            .collect();
        let mut changed = BTreeMap::new();
        for (b, data) in settled {
            if survivors.iter().any(|w| w.blocks.contains_key(&b)) {
                st.base.insert(b, data); // a later write still pending covers it
            } else {
                st.base.remove(&b);
                changed.insert(b, data);
            }
        }
        st.pending = survivors;
        if power && st.sabotage == Sabotage::LoseSyncedHeader {
            if let Some((b, old)) = st.settled_headers.pop() {
                changed.insert(b, old);
            }
        }
        let file = std::fs::OpenOptions::new().write(true).open(&self.path)?;
        let mut reverted = 0;
        for (b, data) in changed {
            let at = (b * BLOCK) as usize;
            if st.image[at..at + BLOCK as usize] != *data {
                reverted += 1;
                st.image[at..at + BLOCK as usize].copy_from_slice(&data);
                file.write_all_at(&data, b * BLOCK)?;
            }
        }
        file.sync_data()?;
        st.stats.reverted += reverted;
        self.rebuild_maps(&mut st);
        Ok(reverted)
    }

    /// Where the data file differs from the image (a write that did not go through the
    /// block engine, or a bug of this model); `None` when they agree.
    pub fn file_mismatch(&self) -> Option<String> {
        let st = self.state.lock();
        let file = match std::fs::read(&self.path) {
            Ok(f) => f,
            Err(e) => return Some(format!("reading the data file: {e}")),
        };
        if file.len() != st.image.len() {
            return Some(format!(
                "the data file is {} bytes, not l2.bytes = {}",
                file.len(),
                st.image.len()
            ));
        }
        if file == st.image {
            return None;
        }
        let at = file.iter().zip(&st.image).position(|(a, b)| a != b)?;
        Some(format!(
            "byte {at:#x} of the data file differs from what the block engine wrote there"
        ))
    }
}
