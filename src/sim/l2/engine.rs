//! [`SimEngine`]: the block engine the tier is given in the simulator. It wraps the real
//! engine (pread, on the real data file) and, through the [`SimDisk`], checks every I/O
//! against the device's rules, injects the seeded faults, records every write for the power
//! loss model, and parks the stuck-I/O worker's thread at the I/O it was told to stall on.

use std::cell::Cell;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

use kvnode_hw::{BlockEngine, BlockIo, EngineKind, HwError, HwResult};

use super::disk::{ReadFate, SimDisk, WriteFate, BLOCK};

thread_local! {
    /// Set on the stuck-I/O worker's thread: only its I/O can be parked.
    static STALLABLE: Cell<bool> = const { Cell::new(false) };
}

thread_local! {
    /// Set while the simulator is inside `L2Tier::sync` (as opposed to the `fdatasync` calls
    /// the tier makes on its own: after extent headers and superblock copies).
    static EXPLICIT_SYNC: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread as the stuck-I/O worker (its matching I/O parks).
pub fn mark_stallable_thread() {
    STALLABLE.with(|s| s.set(true));
}

/// Runs `f` (a call of `L2Tier::sync`) with its `fdatasync` calls marked as explicit.
pub fn explicit_sync<T>(f: impl FnOnce() -> T) -> T {
    EXPLICIT_SYNC.with(|s| s.set(true));
    let out = f();
    EXPLICIT_SYNC.with(|s| s.set(false));
    out
}

/// Which I/O of the worker parks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StallAt {
    /// The payload writes of a write-behind batch (before any reaches the device).
    PayloadWrite,
    /// The slot header writes of a batch, after its payloads were written.
    HeaderWrite,
    /// The payload reads of a load.
    PayloadRead,
}

/// How a parked I/O ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// It runs (with the faults in force then).
    Complete,
    /// Every I/O of the batch fails with EIO, nothing written or read.
    Fail,
}

/// What the worker tells the simulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerEvent {
    /// Its I/O is parked; the simulator goes on.
    Parked,
    /// Its operation returned.
    Finished,
}

/// A stall waiting for the worker's I/O. Invariant: fires at most once (taken out of the
/// device when it does).
pub struct StallArm {
    /// Where to park.
    pub at: StallAt,
    /// A payload write batch went by (for [`StallAt::HeaderWrite`]).
    pub seen_payload: bool,
    /// Where to say it parked.
    pub events: Sender<WorkerEvent>,
    /// Where the release comes from (a closed channel releases with [`Release::Fail`]).
    pub release: Receiver<Release>,
}

/// The engine wrapper. Invariant: every I/O of the tier goes through `disk` (rules, faults,
/// write records) before or instead of reaching `inner`.
pub struct SimEngine {
    inner: Box<dyn BlockEngine>,
    disk: Arc<SimDisk>,
}

impl SimEngine {
    /// Wraps `inner` (the real engine on the data file) over `disk`.
    pub fn new(inner: Box<dyn BlockEngine>, disk: Arc<SimDisk>) -> SimEngine {
        SimEngine { inner, disk }
    }

    /// Parks the calling thread if it is the worker's and `ios` is the batch it stalls on;
    /// returns how the batch was released then.
    fn maybe_park(&self, ios: &[BlockIo], write: bool) -> Option<Release> {
        if !STALLABLE.with(Cell::get) || ios.is_empty() {
            return None;
        }
        let payload = ios.iter().any(|io| io.len > BLOCK);
        let arm = {
            let mut slot = self.disk.stall.lock();
            let fire = match slot.as_mut() {
                None => false,
                Some(a) => match a.at {
                    StallAt::PayloadWrite => write && payload,
                    StallAt::PayloadRead => !write && payload,
                    StallAt::HeaderWrite if write && payload => {
                        a.seen_payload = true;
                        false
                    }
                    StallAt::HeaderWrite => write && a.seen_payload,
                },
            };
            if !fire {
                return None;
            }
            slot.take().expect("armed")
        };
        let _ = arm.events.send(WorkerEvent::Parked);
        Some(arm.release.recv().unwrap_or(Release::Fail))
    }
}

fn os(op: &'static str, errno: i32) -> HwError {
    HwError::Os {
        op,
        source: std::io::Error::from_raw_os_error(errno),
    }
}

impl BlockEngine for SimEngine {
    fn kind(&self) -> EngineKind {
        self.inner.kind()
    }

    fn write_batch(&self, ios: &[BlockIo]) -> Vec<HwResult<u64>> {
        let released = self.maybe_park(ios, true);
        let mut out = Vec::with_capacity(ios.len());
        for io in ios {
            self.disk.check_io(io, true);
            if released == Some(Release::Fail) {
                out.push(Err(os("write (stuck, failed)", libc::EIO)));
                continue;
            }
            if self.disk.drops(io) {
                out.push(Ok(io.len));
                continue;
            }
            match self.disk.decide_write(io) {
                WriteFate::Ok => {
                    let r = self.inner.write_batch(std::slice::from_ref(io)).pop();
                    let r = r.unwrap_or_else(|| Err(HwError::Invalid("no result".into())));
                    if r.is_ok() {
                        self.disk.record_write(io, io.len);
                    }
                    out.push(r);
                }
                WriteFate::Fail { errno, applied } => {
                    if applied > 0 {
                        let part = BlockIo {
                            len: applied * BLOCK,
                            ..*io
                        };
                        if let Some(Ok(_)) = self.inner.write_batch(&[part]).pop() {
                            self.disk.record_write(&part, part.len);
                        }
                    }
                    out.push(Err(os("write (injected)", errno)));
                }
            }
        }
        out
    }

    fn read_batch(&self, ios: &[BlockIo]) -> Vec<HwResult<u64>> {
        let released = self.maybe_park(ios, false);
        let fates: Vec<ReadFate> = ios
            .iter()
            .map(|io| {
                self.disk.check_io(io, false);
                if released == Some(Release::Fail) {
                    ReadFate::Eio
                } else {
                    self.disk.decide_read(io)
                }
            })
            .collect();
        let run: Vec<BlockIo> = ios
            .iter()
            .zip(&fates)
            .filter(|(_, f)| !matches!(f, ReadFate::Eio))
            .map(|(io, _)| *io)
            .collect();
        let mut done = self.inner.read_batch(&run).into_iter();
        ios.iter()
            .zip(&fates)
            .map(|(io, fate)| {
                if matches!(fate, ReadFate::Eio) {
                    return Err(os("read (injected)", libc::EIO));
                }
                let r = done
                    .next()
                    .unwrap_or_else(|| Err(HwError::Invalid("no result".into())));
                if r.is_ok() {
                    self.disk.after_read(io, fate);
                }
                r
            })
            .collect()
    }

    /// No real `fdatasync`: the device model decides durability (and the real call would
    /// only make runs slower).
    fn sync(&self) -> HwResult<()> {
        if self.disk.sync(EXPLICIT_SYNC.with(Cell::get)) {
            Ok(())
        } else {
            Err(os("fdatasync (injected)", libc::EIO))
        }
    }

    fn release(&self) {
        self.inner.release()
    }
}
