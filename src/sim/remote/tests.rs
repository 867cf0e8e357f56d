//! The remote workers' bounded CI run and proofs that their checks can fail.

use super::super::{run, Sim, SimOptions, SimStats};
use super::Taken;

/// Seeds of the remote-focused CI run (the request-level smoke run has remote workers too).
const REMOTE_SEEDS: u64 = 8;

/// A world of mostly remote workers, each seed with its own fault mix: every invariant holds,
/// and the paths that matter are exercised.
#[test]
fn remote_seeds_hold_every_invariant() {
    let mut total = SimStats::default();
    for seed in 1..=REMOTE_SEEDS {
        let opts = SimOptions {
            steps: 1_500,
            native_instances: 1,
            lmcache_instances: 1,
            remote_instances: 4,
            ..SimOptions::new(seed)
        };
        let s = run(&opts).unwrap_or_else(|f| panic!("{f}"));
        assert!(s.remote_ops > 0, "seed {seed} posted no data op: {s:?}");
        total.remote_ops += s.remote_ops;
        total.remote_stores_committed += s.remote_stores_committed;
        total.remote_reads_verified += s.remote_reads_verified;
        total.remote_ops_failed += s.remote_ops_failed;
        total.remote_settled_released += s.remote_settled_released;
        total.remote_deadline_misses += s.remote_deadline_misses;
        total.remote_refused += s.remote_refused;
    }
    assert!(
        total.remote_stores_committed > 0
            && total.remote_reads_verified > 0
            && total.remote_ops_failed > 0
            && total.remote_settled_released > 0
            && total.remote_deadline_misses > 0
            && total.remote_refused > 0,
        "remote paths not all exercised: {total:?}"
    );
}

/// Steps seed `seed` until a data op of the kind `write` is in flight; returns its op id.
fn until_in_flight(sim: &mut Sim, write: bool) -> u64 {
    for _ in 0..4_000 {
        sim.step().expect("clean run");
        let found = sim.remote.ops.iter().find(|(_, o)| {
            matches!(
                (&o.taken, write),
                (Taken::Write(_), true) | (Taken::Read(_), false)
            )
        });
        if let Some((k, _)) = found {
            return *k;
        }
    }
    panic!("no data op in flight");
}

/// The checks can fail: a store's slot freed while its bytes move is caught.
#[test]
fn the_inflight_check_catches_a_store_slot_freed_under_its_op() {
    // Without the model's own slot check, which would see the dropped object first.
    let mut sim = Sim::new(SimOptions {
        skip: vec!["slots".into()],
        ..SimOptions::new(4)
    });
    let k = until_in_flight(&mut sim, true);
    let Taken::Write(take) = &sim.remote.ops[&k].taken else {
        unreachable!("a store")
    };
    let items = take.reserved().0.to_vec();
    // Sabotage: what a release path that ignored the take would do.
    sim.ctx.storage.abort_write(&items);
    let e = sim
        .check()
        .expect_err("a slot freed under a fabric op went unnoticed");
    assert!(e.contains("[inflight]"), "{e}");
    // The op's own settle would free the slots a second time: leave the run here.
    std::mem::forget(sim);
}

/// The checks can fail: a retrieve's read lock released while its bytes move is caught.
#[test]
fn the_inflight_check_catches_a_retrieve_lock_released_under_its_op() {
    let mut sim = Sim::new(SimOptions::new(6));
    let k = until_in_flight(&mut sim, false);
    let Taken::Read(take) = &sim.remote.ops[&k].taken else {
        unreachable!("a retrieve")
    };
    let keys = take.locked().to_vec();
    sim.ctx.storage.finish_read(&keys, 0);
    let e = sim
        .check()
        .expect_err("a lock released under a fabric op went unnoticed");
    assert!(e.contains("[inflight]") || e.contains("read locks"), "{e}");
    std::mem::forget(sim);
}

/// A seed with remote workers reproduces exactly.
#[test]
fn a_remote_seed_reproduces_exactly() {
    let opts = SimOptions {
        steps: 800,
        native_instances: 1,
        lmcache_instances: 0,
        remote_instances: 3,
        ..SimOptions::new(9)
    };
    let a = run(&opts).expect("seed 9 passes");
    let b = run(&opts).expect("seed 9 passes");
    assert_eq!(a.trace_digest, b.trace_digest, "the traces differ");
    assert!(a.remote_ops > 0, "{a:?}");
}
