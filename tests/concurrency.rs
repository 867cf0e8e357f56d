//! Concurrency against the real binary: many connections and instances at once, two connections
//! driving the same instance (so requests queue in its mailbox and run on worker shards), and
//! pipelined bursts. Every request must get exactly one answer; the books must balance.

mod common;

use common::*;
use kvnode::protocol::{Request, Response};

#[test]
fn many_connections_and_shared_instances_balance() {
    let node = NodeProc::start("concurrency", &["--workers", "2", "--pool-size", "128MiB"]);
    let mut setup = node.client();
    let len = setup.register(&reg(1)).unwrap().object_bytes as usize;
    setup.register(&reg(2)).unwrap();
    // Four threads: two per instance, each on its own connection.
    let threads: Vec<_> = (0..4u32)
        .map(|t| {
            let socket = node.socket.clone();
            std::thread::spawn(move || {
                let instance = u64::from(t % 2) + 1;
                let mut c = kvnode::client::Client::connect(&socket).unwrap();
                // Map the pool through a registration refresh of the shared instance.
                c.register(&reg(instance)).unwrap();
                let mut written = 0;
                for i in 0..150u32 {
                    let r = range(&tokens(1000 * (t + 1) + i, 2));
                    let data = payloads(&r, len);
                    written += c.store(instance, &r, &[&data[0], &data[1]]).unwrap();
                    let back = c.retrieve(instance, &r).unwrap().expect("own chunks hit");
                    assert_eq!(back, data);
                }
                written
            })
        })
        .collect();
    let written: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(written, 4 * 150 * 2);
    let s = node.status();
    assert_eq!(num(&s, &["objects", "ready"]), 1200);
    assert_eq!(num(&s, &["pending_writes"]), 0);
    assert_eq!(num(&s, &["pending_reads"]), 0);
    assert_eq!(num(&s, &["objects", "read_locked"]), 0);
    assert_eq!(s["memcheck_ok"], true);
}

#[test]
fn pipelined_bursts_on_one_instance_keep_order() {
    let node = NodeProc::start("burst", &["--workers", "2"]);
    let mut c = node.client();
    c.register(&reg(1)).unwrap();
    // A second connection keeps the instance busy so part of the burst queues in its mailbox.
    let socket = node.socket.clone();
    let noise = std::thread::spawn(move || {
        let mut c2 = kvnode::client::Client::connect(&socket).unwrap();
        // A second connection of the same process joins the instance by registering it too.
        c2.register(&reg(1)).unwrap();
        for i in 0..200u32 {
            let r = range(&tokens(50_000 + i, 1));
            let p = c2.prepare_store(1, &r).unwrap();
            c2.abort_store(1, p.transfer_id).unwrap();
        }
    });
    // Burst: 100 prepares pipelined, then their commits pipelined; per-instance order means every
    // commit finds its prepare.
    let mut ids = Vec::new();
    for i in 0..100u32 {
        let r = range(&tokens(i, 1));
        ids.push(
            c.send(&Request::PrepareStore {
                instance_id: 1,
                range: r,
            })
            .unwrap(),
        );
    }
    let mut transfers = Vec::new();
    for expect in &ids {
        let (id, resp, _) = c.recv().unwrap();
        assert_eq!(
            id, *expect,
            "responses of one connection and instance come in order"
        );
        match resp {
            Response::StorePrepared { transfer_id, .. } => transfers.push(transfer_id),
            other => panic!("unexpected {other:?}"),
        }
    }
    let mut commit_ids = Vec::new();
    for t in &transfers {
        commit_ids.push(
            c.send(&Request::CommitStore {
                instance_id: 1,
                transfer_id: *t,
            })
            .unwrap(),
        );
    }
    for expect in &commit_ids {
        let (id, resp, _) = c.recv().unwrap();
        assert_eq!(id, *expect);
        assert_eq!(resp, Response::StoreCommitted { published: 1 });
    }
    noise.join().unwrap();
    let s = node.status();
    assert_eq!(num(&s, &["objects", "ready"]), 100);
    assert_eq!(num(&s, &["used_bytes"]), 100 * 16384);
    assert_eq!(s["memcheck_ok"], true);
}
