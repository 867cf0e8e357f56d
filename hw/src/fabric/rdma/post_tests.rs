//! Unit tests of the pure post planning (slicing, chains, signalling, ids, credits, FIFO).

use super::*;
use crate::fabric::types::LocalRange;

const MIB: u64 = 1 << 20;

fn item(offset: u64, len: u64, addr: u64, rkey: u32) -> WorkItem {
    WorkItem {
        local: LocalRange { offset, len },
        remote: RemoteSeg::Rdma { addr, rkey },
    }
}

fn all_wrs(chains: &[ChainPlan]) -> Vec<WrPlan> {
    chains.iter().flat_map(|c| c.wrs.iter().copied()).collect()
}

#[test]
fn small_items_one_wr_each_in_order() {
    let items = [item(0, 4096, 0x1000, 7), item(8192, 100, 0x9000, 8)];
    let chains = build_chains(&items, MAX_WR_BYTES, MAX_CHAIN_WRS).unwrap();
    assert_eq!(chains.len(), 1);
    assert_eq!(
        chains[0].wrs,
        vec![
            WrPlan {
                item: 0,
                local_offset: 0,
                remote_addr: 0x1000,
                rkey: 7,
                len: 4096
            },
            WrPlan {
                item: 1,
                local_offset: 8192,
                remote_addr: 0x9000,
                rkey: 8,
                len: 100
            },
        ]
    );
    assert!(!chains[0].signalled(0));
    assert!(chains[0].signalled(1));
    assert_eq!(chains[0].bytes(), 4196);
}

#[test]
fn slices_at_one_mib_with_matching_local_and_remote_offsets() {
    // 2.5 MiB -> 1 MiB, 1 MiB, 0.5 MiB.
    let items = [item(3 * MIB, 5 * MIB / 2, 0x10_0000_0000, 1)];
    let wrs = all_wrs(&build_chains(&items, MAX_WR_BYTES, MAX_CHAIN_WRS).unwrap());
    assert_eq!(wrs.len(), 3);
    for (k, w) in wrs.iter().enumerate() {
        let k = k as u64;
        assert_eq!(w.local_offset, 3 * MIB + k * MIB);
        assert_eq!(w.remote_addr, 0x10_0000_0000 + k * MIB);
        assert!(u64::from(w.len) <= MAX_WR_BYTES);
    }
    assert_eq!(
        wrs.iter().map(|w| u64::from(w.len)).sum::<u64>(),
        5 * MIB / 2
    );
    assert_eq!(wrs[2].len as u64, MIB / 2);
    // Exactly 1 MiB is one WR; 1 MiB + 1 is two.
    assert_eq!(
        all_wrs(&build_chains(&[item(0, MIB, 0, 1)], MAX_WR_BYTES, 32).unwrap()).len(),
        1
    );
    let two = all_wrs(&build_chains(&[item(0, MIB + 1, 0, 1)], MAX_WR_BYTES, 32).unwrap());
    assert_eq!(
        two.iter().map(|w| w.len).collect::<Vec<_>>(),
        vec![MIB as u32, 1]
    );
}

#[test]
fn chains_hold_at_most_32_wrs_and_only_the_last_is_signalled() {
    // 100 MiB in one item -> 100 WRs -> chains of 32, 32, 32, 4.
    let items = [item(0, 100 * MIB, 0, 1)];
    let chains = build_chains(&items, MAX_WR_BYTES, MAX_CHAIN_WRS).unwrap();
    assert_eq!(
        chains.iter().map(|c| c.wrs.len()).collect::<Vec<_>>(),
        vec![32, 32, 32, 4]
    );
    for c in &chains {
        let sig: Vec<bool> = (0..c.wrs.len()).map(|i| c.signalled(i)).collect();
        assert_eq!(sig.iter().filter(|&&s| s).count(), 1);
        assert!(sig[c.wrs.len() - 1]);
    }
    // Order is preserved across chains.
    let wrs = all_wrs(&chains);
    assert!(wrs
        .windows(2)
        .all(|w| w[0].local_offset + u64::from(w[0].len) == w[1].local_offset));
}

#[test]
fn chains_span_items() {
    // 40 items of 4 KiB -> chains of 32 and 8, item indices in order.
    let items: Vec<WorkItem> = (0..40).map(|i| item(i * 8192, 4096, i * 4096, 3)).collect();
    let chains = build_chains(&items, MAX_WR_BYTES, MAX_CHAIN_WRS).unwrap();
    assert_eq!(chains.len(), 2);
    assert_eq!(chains[1].wrs.len(), 8);
    let idx: Vec<u32> = all_wrs(&chains).iter().map(|w| w.item).collect();
    assert_eq!(idx, (0..40).collect::<Vec<u32>>());
}

#[test]
fn refuses_bad_batches_whole() {
    let err = |items: &[WorkItem]| build_chains(items, MAX_WR_BYTES, MAX_CHAIN_WRS).unwrap_err();
    assert!(err(&[]).contains("no items"));
    let e = err(&[item(0, 10, 0, 1), item(100, 0, 0, 1)]);
    assert!(e.contains("item 1") && e.contains("empty"), "{e}");
    let e = err(&[item(u64::MAX - 1, 10, 0, 1)]);
    assert!(e.contains("local range overflows"), "{e}");
    let e = err(&[item(0, 10, u64::MAX - 3, 1)]);
    assert!(e.contains("remote range") && e.contains("overflows"), "{e}");
    let stream = WorkItem {
        local: LocalRange { offset: 0, len: 1 },
        remote: RemoteSeg::Stream,
    };
    assert!(err(&[stream]).contains("stream segments"));
    let e = err(&[item(0, (MAX_BATCH_WRS as u64 + 1) * MIB, 0, 1)]);
    assert!(e.contains("MAX_BATCH_WRS"), "{e}");
    // Exactly at the bound is accepted.
    assert!(build_chains(
        &[item(0, MAX_BATCH_WRS as u64 * MIB, 0, 1)],
        MAX_WR_BYTES,
        32
    )
    .is_ok());
    // Bad parameters.
    assert!(build_chains(&[item(0, 1, 0, 1)], 0, 32).is_err());
    assert!(build_chains(&[item(0, 1, 0, 1)], 1 << 32, 32).is_err());
    assert!(build_chains(&[item(0, 1, 0, 1)], MIB, 0).is_err());
    assert!(build_chains(&[item(0, 1, 0, 1)], MIB, 64).is_err());
}

#[test]
fn remote_end_exactly_at_u64_max_is_allowed() {
    // addr + len == u64::MAX does not overflow (the last byte is u64::MAX - 1).
    assert!(build_chains(&[item(0, 16, u64::MAX - 16, 1)], MAX_WR_BYTES, 32).is_ok());
}

#[test]
fn wr_ids_round_trip_and_reject_out_of_range() {
    for id in [
        WrId {
            seq: 0,
            chain: 0,
            wr: 0,
        },
        WrId {
            seq: 1,
            chain: 2,
            wr: 31,
        },
        WrId {
            seq: MAX_WR_SEQ,
            chain: 65535,
            wr: 63,
        },
        WrId {
            seq: 123_456_789,
            chain: 1024,
            wr: 7,
        },
    ] {
        assert_eq!(WrId::decode(id.encode().unwrap()), id);
    }
    assert_eq!(
        WrId {
            seq: MAX_WR_SEQ + 1,
            chain: 0,
            wr: 0
        }
        .encode(),
        None
    );
    assert_eq!(
        WrId {
            seq: 0,
            chain: 1 << 16,
            wr: 0
        }
        .encode(),
        None
    );
    assert_eq!(
        WrId {
            seq: 0,
            chain: 0,
            wr: 64
        }
        .encode(),
        None
    );
    // The largest batch's chain count fits the chain field.
    assert!(MAX_BATCH_WRS.div_ceil(1) <= 1 << 16);
}

#[test]
fn admission_bounds_outstanding_and_keeps_fifo_order() {
    let mut a: Admission<u32> = Admission::new(64).unwrap();
    a.push(1, [32, 32, 10]).unwrap();
    a.push(2, [5]).unwrap();
    a.push(3, [1]).unwrap();
    assert_eq!(a.next_ready(), Some((1, 0, 32)));
    assert_eq!(a.next_ready(), Some((1, 1, 32)));
    assert_eq!(a.outstanding(), 64);
    // Op 1's third chain does not fit; op 2 (which would fit) must wait behind it.
    assert_eq!(a.next_ready(), None);
    a.release(5);
    assert_eq!(
        a.next_ready(),
        None,
        "5 free, head needs 10: FIFO, no overtaking"
    );
    a.release(27);
    assert_eq!(a.next_ready(), Some((1, 2, 10)));
    assert_eq!(a.next_ready(), Some((2, 0, 5)));
    assert_eq!(a.next_ready(), Some((3, 0, 1)));
    assert_eq!(a.next_ready(), None);
    assert_eq!(a.queued_ops(), 0);
    assert_eq!(a.outstanding(), 32 + 10 + 5 + 1);
    assert!(a.outstanding() <= a.limit());
}

#[test]
fn admission_never_exceeds_the_limit_under_random_traffic() {
    // A small deterministic generator: pushes, hand-outs and releases in random order.
    let mut s = 0x1234_5678_u64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut a: Admission<u64> = Admission::new(256).unwrap();
    let mut out: VecDeque<u32> = VecDeque::new();
    let mut handed: Vec<(u64, usize)> = Vec::new();
    let mut key = 0u64;
    for _ in 0..20_000 {
        match next() % 3 {
            0 => {
                let n = 1 + next() % 5;
                let chains: Vec<u32> = (0..n).map(|_| 1 + (next() % 32) as u32).collect();
                a.push(key, chains).unwrap();
                key += 1;
            }
            1 => {
                if let Some((k, idx, n)) = a.next_ready() {
                    handed.push((k, idx));
                    out.push_back(n);
                }
            }
            _ => {
                if let Some(n) = out.pop_front() {
                    a.release(n);
                }
            }
        }
        assert!(a.outstanding() <= 256);
        assert_eq!(a.outstanding(), out.iter().sum::<u32>());
    }
    // Hand-outs are in (op, chain) order: FIFO across ops, in order within an op.
    assert!(handed.windows(2).all(|w| w[0] < w[1]), "not FIFO");
}

#[test]
fn admission_refuses_chains_that_can_never_fit() {
    let mut a: Admission<u8> = Admission::new(16).unwrap();
    assert!(a.push(1, [17]).unwrap_err().contains("limit 16"));
    assert!(a.push(1, [0]).is_err());
    assert!(a.push(1, Vec::<u32>::new()).is_err());
    assert_eq!(a.queued_ops(), 0);
    assert!(Admission::<u8>::new(0).is_err());
}

#[test]
fn admission_cancel_drops_only_unposted_chains_of_that_op() {
    let mut a: Admission<u8> = Admission::new(8).unwrap();
    a.push(1, [4, 4, 4]).unwrap();
    a.push(2, [2]).unwrap();
    assert_eq!(a.next_ready(), Some((1, 0, 4)));
    assert_eq!(a.next_ready(), Some((1, 1, 4)));
    assert_eq!(a.cancel(1), 1, "only chain 2 was still queued");
    assert_eq!(a.cancel(1), 0, "idempotent");
    assert_eq!(
        a.outstanding(),
        8,
        "handed-out chains keep their credit until released"
    );
    a.release(4);
    assert_eq!(a.next_ready(), Some((2, 0, 2)));
    assert_eq!(a.cancel(9), 0);
}

#[test]
fn progress_completes_only_when_nothing_is_out() {
    let mut p = OpProgress::new(3);
    assert!(!p.is_done());
    p.posted_one();
    p.posted_one();
    p.finished_one();
    assert!(!p.is_done());
    p.posted_one();
    p.finished_one();
    p.finished_one();
    assert!(p.is_done());
    assert_eq!(p.result(300), Ok(300));
}

#[test]
fn progress_cancelled_waits_for_posted_chains_then_flushes() {
    let mut p = OpProgress::new(4);
    p.posted_one();
    p.record(FabricError::Flushed);
    p.cancel_unposted();
    assert!(!p.is_done(), "a posted chain is still on the device");
    assert_eq!(p.outstanding_chains(), 1);
    p.finished_one();
    assert!(p.is_done());
    assert_eq!(p.result(1), Err(FabricError::Flushed));
    // Cancelled before anything was posted: done at once.
    let mut q = OpProgress::new(2);
    q.cancel_unposted();
    assert!(q.is_done());
    assert_eq!(q.result(0), Err(FabricError::Flushed));
}

#[test]
fn progress_first_error_wins() {
    let mut p = OpProgress::new(1);
    p.posted_one();
    p.record(FabricError::Deadline);
    p.record(FabricError::Flushed);
    p.record(FabricError::Remote("REM_ACCESS_ERR".into()));
    p.finished_one();
    assert_eq!(p.result(10), Err(FabricError::Deadline));
}
