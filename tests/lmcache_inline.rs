//! Issue 12 §4, no thread hops on the request path: a small request whose connection has
//! nothing queued or running is answered by the LMCache frontend's I/O thread itself (status
//! counts them in `lmcache.inline_requests`); a small request behind a large one of the same
//! connection still waits for it (one client's replies stay in order); and the load generator
//! `kvnode-bench lmcache` is exercised in `bench/tests`.

mod common;

use common::lm::*;
use common::num;
use kvnode::lmcache::wire::{self, Op};
use rmpv::Value;

/// A key larger than the I/O thread runs itself (1-byte tokens: about 20 KiB).
fn long_key(first: &[u32], n: usize, req: &str) -> Vec<u8> {
    let mut tokens = first.to_vec();
    tokens.extend((0..n - first.len()).map(|i| (i % 128) as u32));
    key(&tokens, 0, tokens.len() as u64, None, req)
}

#[test]
fn small_requests_run_on_the_io_thread_and_replies_stay_in_order() {
    let node = start("inline", "", &["--max-workers", "1"]);
    let mut a = Dealer::connect(node.port);
    register(&mut a, 71);
    let first: Vec<u32> = (0..16).map(|t| 500 + t).collect();
    assert_eq!(prepare_store(&mut a, 71, &first, 16, "s").len(), 1);
    assert_eq!(
        commit_store(&mut a, 71, &first, 16, "s"),
        Some(Value::Boolean(true))
    );
    // A connection whose previous request is done runs its next small one on the I/O thread
    // (the handler marks it done just after queueing its reply: a few PINGs at most).
    let ran_inline = |d: &mut Dealer, id: u64, above: u64| {
        for _ in 0..1000 {
            let pong = d.call(Op::Ping, vec![wire::encode_uint(id)]);
            assert_eq!(pong, Some(Value::Boolean(true)));
            let n = num(&status(&node), &["lmcache", "inline_requests"]);
            if n > above {
                return n;
            }
        }
        panic!("no PING of an idle connection ran on the I/O thread");
    };
    let before = ran_inline(&mut a, 71, 0);

    // Pipelined: a large LOOKUP (decoded on the handler), then small requests of the same
    // connection. Each small one must wait for the lookup: the QUERY answers its 1 hit.
    for round in 0..20 {
        let rid = format!("l{round:03}");
        let mut uids = vec![a.send(
            Op::Lookup,
            vec![long_key(&first, 20_000, &rid), wire::encode_uint(1)],
        )];
        uids.push(a.send(Op::QueryPrefetchStatus, vec![wire::encode_str(&rid)]));
        uids.push(a.send(Op::Ping, vec![wire::encode_uint(71)]));
        uids.push(a.send(Op::EndSession, vec![wire::encode_str(&rid)]));
        let replies: Vec<(u64, Option<Value>)> = uids.iter().map(|_| a.recv()).collect();
        assert_eq!(
            replies.iter().map(|r| r.0).collect::<Vec<_>>(),
            uids,
            "replies in request order"
        );
        assert_eq!(replies[0].1, None, "LOOKUP answers no frame");
        assert_eq!(
            replies[1].1.as_ref().and_then(Value::as_u64),
            Some(1),
            "the QUERY ran after its connection's LOOKUP (round {round})"
        );
        assert_eq!(replies[2].1, Some(Value::Boolean(true)));
    }
    // Another connection is served meanwhile and after: still on the I/O thread when idle.
    let mut b = Dealer::connect(node.port);
    register(&mut b, 72);
    ran_inline(&mut b, 72, before);
}
