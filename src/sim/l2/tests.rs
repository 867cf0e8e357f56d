//! The L2 simulator's own tests: the bounded CI run, exact reproduction of a seed, and
//! sabotaged devices proving that the checks catch what they claim to.

use super::disk::{FaultRates, Restart, Sabotage};
use super::engine::Release;
use super::ops::LoadPlan;
use super::*;
use kvnode_hw::BlockIo;

/// Seeds the CI test runs; `scripts/simulate.sh --l2` runs many more, longer.
const SMOKE_SEEDS: u64 = 8;
/// Known tier bugs the CI run steers around until they are fixed (each with a reproduction in
/// `repro.rs`); none is open.
const KNOWN_BUGS: [&str; 0] = [];
/// Steps per CI seed.
const SMOKE_STEPS: u64 = 300;

/// The bounded CI run: every seed holds every invariant, and together they reach every kind
/// of event the checks are about.
#[test]
fn l2_simulator_seeds_hold_every_invariant() {
    let mut total = L2SimStats::default();
    for seed in 1..=SMOKE_SEEDS {
        let opts = L2SimOptions {
            steps: SMOKE_STEPS,
            skip: KNOWN_BUGS.map(String::from).to_vec(),
            ..L2SimOptions::new(seed)
        };
        let s = run(&opts).unwrap_or_else(|f| panic!("{f}"));
        assert!(
            s.stores > 0 && s.persisted > 0 && s.loaded > 0,
            "seed {seed} exercised too little: {s:?}"
        );
        total.persisted += s.persisted;
        total.loaded += s.loaded;
        total.failed_syncs += s.failed_syncs;
        total.clears += s.clears;
        total.power_losses += s.power_losses;
        total.crashes += s.crashes;
        total.stalls += s.stalls;
        total.durable_verified += s.durable_verified;
        total.reverted_blocks += s.reverted_blocks;
        total.faults += s.faults;
    }
    // Coverage floor: the events the invariants are about happen in every CI run.
    assert!(total.durable_verified >= 10 * SMOKE_SEEDS, "{total:?}");
    assert!(total.power_losses > 0 && total.crashes > 0, "{total:?}");
    assert!(
        total.reverted_blocks > 0 && total.failed_syncs > 0,
        "{total:?}"
    );
    assert!(
        total.stalls > 0 && total.clears > 0 && total.faults > 0,
        "{total:?}"
    );
}

/// A seed reproduces exactly: same trace, same tier counters, same device.
#[test]
fn an_l2_seed_reproduces_exactly() {
    let opts = L2SimOptions {
        steps: 250,
        skip: KNOWN_BUGS.map(String::from).to_vec(),
        ..L2SimOptions::new(77)
    };
    let a = run(&opts).unwrap_or_else(|f| panic!("{f}"));
    let b = run(&opts).unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(a.trace_digest, b.trace_digest, "the traces differ");
    assert_eq!(
        (a.stores, a.persisted, a.loaded, a.faults, a.reverted_blocks),
        (b.stores, b.persisted, b.loaded, b.faults, b.reverted_blocks)
    );
    let c = run(&L2SimOptions {
        steps: 250,
        ..opts.clone()
    }
    .with_seed(78))
    .unwrap_or_else(|f| panic!("{f}"));
    assert_ne!(a.trace_digest, c.trace_digest, "another seed, another run");
}

/// A simulation after `steps` random steps, with nothing stuck and a healthy device.
fn settled_sim(seed: u64, steps: u64) -> L2Sim {
    let opts = L2SimOptions {
        skip: KNOWN_BUGS.map(String::from).to_vec(),
        ..L2SimOptions::new(seed)
    };
    let mut sim = L2Sim::new(opts).expect("a new tier opens");
    for _ in 0..steps {
        sim.step().unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    }
    sim.release_with(Release::Complete).expect("released");
    sim.rates = FaultRates::default();
    sim.node.disk.set_rates(sim.rates);
    sim
}

/// Stores a new version of key `id` and writes it behind: true once the tier holds it.
fn store_and_persist(sim: &mut L2Sim, id: u32) -> bool {
    sim.store_version(id, 0) && sim.persist_ids(&[id]) == 1
}

/// The durability check can fail: a device that loses a write after acknowledging the
/// `fdatasync` that covered it (the newest durable slot header, undone at a power loss) is
/// caught at the reopen.
#[test]
fn the_l2_checks_catch_a_lost_synced_write() {
    let mut sim = settled_sim(5, 120);
    let id = (0..sim.model.keys.len() as u32)
        .find(|&i| store_and_persist(&mut sim, i))
        .expect("some key is written");
    sim.sync().unwrap();
    assert!(
        sim.model.claims.get(&id).is_some_and(|c| c.synced),
        "key {id} is acknowledged durable"
    );
    // Undamaged, a power loss keeps it.
    sim.restart(ops::Stop::PowerLoss)
        .expect("a healthy device keeps durable writes");
    assert!(store_and_persist(&mut sim, id));
    sim.sync().unwrap();
    sim.node.disk.set_sabotage(Sabotage::LoseSyncedHeader);
    let e = sim
        .restart(ops::Stop::PowerLoss)
        .expect_err("a lost durable object went unnoticed");
    assert!(e.contains("lost a durable object: key"), "{e}");
}

/// The serving checks can fail: a device that forges a slot header (another key, with a valid
/// checksum) makes the tier index and serve another key's bytes; the index check and the load
/// check both see it.
#[test]
fn the_l2_checks_catch_another_keys_bytes() {
    let mut sim = L2Sim::new(L2SimOptions::new(9)).expect("a new tier opens");
    let (a, b) = (0u32, 6u32); // same namespace and kv_rank (see Node::key), b never stored
    assert!(store_and_persist(&mut sim, a));
    sim.check_step().expect("clean so far");
    sim.node.disk.set_sabotage(Sabotage::ForgeKey {
        from: sim.model.keys[a as usize].chunk_hash,
        to: sim.model.keys[b as usize].chunk_hash,
    });
    // A process crash: the write survives; the next start reads the forged header.
    sim.node.close();
    sim.node.disk.restart(Restart::Process).unwrap();
    sim.node.open().unwrap();
    let e = sim
        .refresh_claims()
        .expect_err("a forged index entry went unnoticed");
    assert!(
        e.contains(&format!("L2 holds key {b} under a layout")),
        "{e}"
    );
    let p = LoadPlan {
        ids: vec![b],
        keys: vec![sim.key_of(b)],
        extra: 0,
        expected: None,
    };
    let leases = sim.node.tier().load(&sim.node.storage, &p.keys, 0, None);
    assert!(
        leases[0].is_some(),
        "the forged entry loads (its checksum is valid)"
    );
    let e = sim
        .check_loaded(&p, &leases, "load")
        .expect_err("another key's bytes went unnoticed");
    assert!(e.contains(&format!("those of key {a}")), "{e}");
}

/// The CLEAR check can fail: a device that drops the CLEAR's new superblock copy (while
/// acknowledging it) brings the cleared objects back at the next start, and the simulator
/// sees the tier hold an object stored before an acknowledged CLEAR.
#[test]
fn the_l2_checks_catch_cleared_objects_coming_back() {
    let mut sim = L2Sim::new(L2SimOptions::new(13)).expect("a new tier opens");
    assert!(store_and_persist(&mut sim, 0));
    sim.sync().unwrap();
    sim.clear().unwrap();
    assert_eq!(sim.model.cleared_below, sim.model.next_version());
    // Undamaged, a crash keeps it cleared.
    sim.restart(ops::Stop::Crash)
        .expect("a CLEAR holds across a crash");
    assert!(store_and_persist(&mut sim, 0));
    sim.sync().unwrap();
    sim.node.disk.set_sabotage(Sabotage::DropSuperblockWrites);
    sim.clear().unwrap();
    let e = sim
        .restart(ops::Stop::Crash)
        .expect_err("a cleared object came back unnoticed");
    assert!(
        e.contains("stored before a CLEAR that was acknowledged"),
        "{e}"
    );
}

/// The device rules can fail: writes past `l2.bytes`, into an extent that was never given a
/// header, or off a slot's payload start, are reported by the next step's check.
#[test]
fn the_l2_checks_catch_writes_outside_the_tiers_extents() {
    let mut sim = L2Sim::new(L2SimOptions::new(11)).expect("a new tier opens");
    let bytes = sim.node.cfg.bytes;
    let bad = [
        BlockIo {
            pool_offset: 0,
            file_offset: bytes - 4096,
            len: 8192,
        },
        BlockIo {
            pool_offset: 0,
            file_offset: (2 << 20) + 4096,
            len: 4096,
        },
    ];
    for io in bad {
        sim.node.disk.check_io(&io, true);
        let e = sim.check_step().expect_err("a bad write went unnoticed");
        assert!(e.contains("broke the device's rules"), "{e}");
    }
    sim.check_step().expect("reported once");
}
