//! Minimal reproductions of the tier bugs the L2 simulator found, each a directed scenario on
//! the simulated device; they failed before the fixes in `src/l2/` (failed fdatasyncs drop every
//! unsynced object, the CLEAR's format id is in force before its superblock is durable, a batch
//! whose I/O overlapped a failed fdatasync commits nothing) and guard them now.

use super::disk::{Fate, FaultRates};
use super::engine::{Release, StallAt};
use super::ops::Stop;
use super::worker::{self, Job, Started};
use super::*;

/// A fresh simulation on a healthy device (seed 1's geometry: 5 extents).
fn fresh() -> L2Sim {
    L2Sim::new(L2SimOptions::new(1)).expect("a new tier opens")
}

fn set_rates(sim: &mut L2Sim, rates: FaultRates) {
    sim.rates = rates;
    sim.node.disk.set_rates(rates);
}

const ALL_SYNCS_FAIL: FaultRates = FaultRates {
    read_eio: 0,
    read_flip: 0,
    write_eio: 0,
    write_enospc: 0,
    sync_eio: 1000,
};

/// Found by seeds 2 and 13 (`--l2 --steps 300`): an `fdatasync` that fails *inside* the tier
/// (after a new extent's header, `plan_write`; or after a superblock copy, `write_durable`)
/// leaves every object committed since the last good sync in the index and in `unsynced`, so
/// the next successful `L2Tier::sync` acknowledges them durable, although, by the tier's own
/// rule (`L2Tier::sync`: after a failed fdatasync nothing written since the last good one can
/// be trusted), they may be lost. A power loss then loses an acknowledged object.
#[test]
fn a_failed_fdatasync_after_an_extent_header_unacknowledges_earlier_writes() {
    let mut sim = fresh();
    assert!(sim.store_version(0, 0) && sim.persist_ids(&[0]) == 1);
    // Another stride: a new extent, whose header's fdatasync fails. Object 0's write was
    // issued before that failed fdatasync.
    assert!(sim.store_version(1, 3));
    set_rates(&mut sim, ALL_SYNCS_FAIL);
    assert_eq!(sim.persist_ids(&[1]), 0, "the extent header is not durable");
    set_rates(&mut sim, FaultRates::default());
    sim.sync().unwrap();
    sim.node.disk.set_fate(Fate::UndoAll);
    sim.restart(Stop::PowerLoss)
        .expect("no object acknowledged durable is lost");
}

/// Found by seed 37 (`--l2 --steps 300 --skip internal-sync`): a CLEAR whose new superblock
/// copy reached the device but whose write or fdatasync reported an error returns `Err` and
/// keeps the old format id in force, yet leaves on the device a copy with a higher `update`
/// and the new format id. At the next start that copy wins: every object written after the
/// failed CLEAR (under the old id) is ignored, acknowledged durable or not.
#[test]
fn a_failed_clear_never_hides_the_objects_written_after_it() {
    let mut sim = fresh();
    set_rates(&mut sim, ALL_SYNCS_FAIL);
    sim.clear().unwrap();
    assert_eq!(sim.stats.clears, 1);
    set_rates(&mut sim, FaultRates::default());
    assert!(sim.store_version(0, 0) && sim.persist_ids(&[0]) == 1);
    sim.sync().unwrap();
    // The copy whose fdatasync failed had landed: it survives the restart.
    sim.node.disk.set_fate(Fate::KeepAll);
    sim.restart(Stop::Clean)
        .expect("no object acknowledged durable is lost");
}

/// Found by seeds 70, 88 and 108 (`--l2 --steps 2000 --skip internal-sync,superblock`): a
/// write-behind batch whose payloads were written *before* a failed fdatasync but whose slot
/// headers (and commit) come after it is not among the objects that failure drops, so the
/// next successful sync acknowledges an object whose payload may be lost. In the node this
/// interleaving is the writer thread's fdatasync (extent headers) failing while the I/O thread
/// is between a batch's payload and header writes.
#[test]
fn a_failed_fdatasync_between_payload_and_header_writes_is_not_forgotten() {
    let mut sim = fresh();
    assert!(sim.store_version(0, 0));
    let key = sim.key_of(0);
    let stuck = match worker::start(
        &sim.node,
        vec![0],
        Job::Persist(vec![key]),
        StallAt::HeaderWrite,
    )
    .unwrap()
    {
        Started::Parked(s) => s,
        Started::Finished(..) => panic!("the batch did not reach its header writes"),
    };
    sim.stuck = Some(stuck);
    set_rates(&mut sim, ALL_SYNCS_FAIL);
    sim.sync().unwrap(); // fails: the payload just written is in limbo
    assert_eq!(sim.stats.failed_syncs, 1);
    set_rates(&mut sim, FaultRates::default());
    sim.release_with(Release::Complete).unwrap();
    sim.check_step().unwrap();
    assert!(
        !sim.model.claims.contains_key(&0),
        "a batch whose I/O overlapped a failed fdatasync committed its object"
    );
    sim.sync().unwrap();
    sim.node.disk.set_fate(Fate::UndoAll);
    sim.restart(Stop::PowerLoss)
        .expect("no object acknowledged durable is lost");
}
