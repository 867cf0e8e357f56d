//! Directed reproductions of what the remote workers found (`kvnode-sim --remote-late`).
//!
//! **The storage lock TTL freed slots under a fabric op in flight** (found by these workers and
//! by review, fixed): [`crate::remote::ops`] takes a transfer out of its instance's table while
//! its bytes move, so the instance's TTL sweep cannot free it; but storage keeps a TTL of its own
//! on every reservation and read lock (`lock_deadline_ms`), and `StorageCore::expire_locks` (and
//! any other reader's lock) used to expire them under the op: a late store overwrote another
//! object's bytes, a late retrieve sent another object's bytes. The take now pins its entries
//! (`StorageCore::pin_for_move`), which no TTL expires. Before the pins, seeds 4-6, 11, 13, 15 and
//! 17-20 of `kvnode-sim --remote-late --seeds 20` failed (10 of 20), and both tests below failed.

use super::super::world::{HIDDEN, READ_TTL_MS, WRITE_TTL_MS};
use super::super::{Sim, SimOptions};

/// A simulation with one remote worker (no other client), registered, whose data ops start
/// whenever asked.
fn one_remote_worker() -> Sim {
    let mut sim = Sim::new(SimOptions {
        native_instances: 0,
        lmcache_instances: 0,
        remote_instances: 1,
        remote_late: true,
        // The liveness wheel and the reaper are not stepped here.
        // The model's own slot check would see the dropped object first: the in-flight check
        // names the op.
        skip: vec!["wheel".into(), "reaper".into(), "slots".into()],
        ..SimOptions::new(1)
    });
    sim.remote_connect(0);
    sim.remote_register(0, HIDDEN).expect("registers");
    sim
}

/// Connects and registers the worker again if a failed op closed its connection.
fn reconnect(sim: &mut Sim) {
    if sim.remote.actors[0].conn.is_none() {
        sim.remote_connect(0);
    }
    if sim.remote.actors[0].reg.is_none() {
        sim.remote_register(0, HIDDEN).expect("registers");
    }
}

/// Posts one WRITE_SLOTS (descriptors may be drawn invalid: then again) and leaves it in
/// flight: the fabric's clock is not advanced.
fn post_a_store(sim: &mut Sim) {
    for _ in 0..1_000 {
        if !sim.remote.ops.is_empty() {
            return;
        }
        reconnect(sim);
        if sim.remote.actors[0].writes.is_empty() {
            sim.remote_prepare_store(0).expect("prepares");
        } else {
            sim.remote_write_slots(0).expect("posts");
        }
    }
    panic!("no store was posted");
}

#[test]
fn the_lock_ttl_never_frees_a_store_slot_the_fabric_is_writing() {
    let mut sim = one_remote_worker();
    while sim.remote.actors[0].writes.is_empty() {
        sim.remote_prepare_store(0).expect("prepares");
    }
    // A slow engine: its WRITE_SLOTS comes one second before the store's TTL (or it came with
    // the PREPARE, and the fabric has not completed it since: the mover waits for it).
    sim.clock.advance(WRITE_TTL_MS - 1_000);
    post_a_store(&mut sim);
    sim.check().expect("the op's slots are held");
    // The op is still in flight when the TTL passes and maintenance runs (the model sets aside
    // the transfers whose TTL passed, as a step does).
    sim.clock.advance(1_500);
    sim.model.expire(sim.now());
    sim.maintenance().expect("maintenance");
    sim.check()
        .expect("the slots of a store in flight stay reserved");
}

#[test]
fn the_lock_ttl_never_frees_a_retrieve_slot_the_fabric_is_reading() {
    let mut sim = one_remote_worker();
    // Objects to read: stored, committed and settled, until a retrieve hits.
    for _ in 0..500 {
        reconnect(&mut sim);
        if !sim.remote.actors[0].reads.is_empty() {
            break;
        }
        post_a_store(&mut sim);
        // Within the transfer deadline: the op completes (unless the fabric dropped it).
        sim.clock.advance(super::TRANSFER_TIMEOUT_MS - 1_000);
        sim.remote_progress().expect("settles");
        reconnect(&mut sim);
        while sim.remote.actors[0].writes.iter().any(|w| w.2) {
            sim.remote_commit_store(0).expect("commits");
        }
        sim.remote_prepare_retrieve(0).expect("prepares");
    }
    assert!(!sim.remote.actors[0].reads.is_empty(), "a retrieve hit");
    sim.clock.advance(READ_TTL_MS - 1_000);
    for _ in 0..100 {
        if sim.remote.ops.is_empty() {
            sim.remote_read_slots(0).expect("posts");
        }
    }
    assert!(!sim.remote.ops.is_empty(), "a retrieve was posted");
    sim.check().expect("the op's slots are held");
    sim.clock.advance(1_500);
    sim.maintenance().expect("maintenance");
    sim.check()
        .expect("the slots of a retrieve in flight stay read-locked");
}
