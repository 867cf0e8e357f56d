//! A cluster of real `kvnode` processes on a real etcd: a prefix stored through one node is
//! retrieved, byte-identical, through the others; a killed node's chunks become misses while
//! the others keep serving; a joining node receives its share. Skipped, with a message, when
//! the `etcd` binary is missing.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::etcd::{start_or_skip, Etcd};
use common::remote::new_token;
use common::{num, payloads, range, reg, tokens, NodeProc, TestDir};
use kvnode::client::Client;

/// A cluster node: `kvnode serve` listening on loopback, member of `cluster`.
fn node(tag: &str, etcd: &Etcd, cluster: &str, token: &std::path::Path, id: &str) -> NodeProc {
    NodeProc::start(
        tag,
        &[
            "--listen",
            "tcp://127.0.0.1:0",
            "--auth-token-file",
            token.to_str().unwrap(),
            "--etcd",
            &etcd.url,
            "--cluster",
            cluster,
            "--node-id",
            id,
        ],
    )
}

/// Waits until `n` sees exactly `members` live members.
fn wait_members(n: &NodeProc, members: usize) -> serde_json::Value {
    n.wait_status(&format!("{members} members"), |s| {
        s["cluster"]["members"]
            .as_array()
            .is_some_and(|m| m.len() == members)
            && s["cluster"]["etcd"]["state"] == "connected"
    })
}

/// Waits until `n` has pushed everything it queued (queue empty, no push in flight).
fn wait_pushes(n: &NodeProc) {
    n.wait_status("pushes drained", |s| {
        num(s, &["cluster", "push_queue_bytes"]) == 0 && num(s, &["cluster", "push_in_flight"]) == 0
    });
}

/// Registers instance `id` on `n` (the model's layout must be known where engines read).
fn client(n: &NodeProc, id: u64) -> Client {
    let mut c = n.client();
    c.register(&reg(id)).unwrap();
    c
}

struct Cluster {
    _etcd: Etcd,
    nodes: Vec<NodeProc>,
    _tokens: TestDir,
    token: PathBuf,
}

fn cluster(tag: &str, n: usize) -> Option<Cluster> {
    let etcd = start_or_skip(tag)?;
    let tokens = TestDir::new(&format!("{tag}-tok"));
    let token = new_token(&tokens, "peer.token");
    let nodes: Vec<NodeProc> = (0..n)
        .map(|i| node(&format!("{tag}{i}"), &etcd, tag, &token, &format!("n{i}")))
        .collect();
    for x in &nodes {
        wait_members(x, n);
    }
    Some(Cluster {
        _etcd: etcd,
        nodes,
        _tokens: tokens,
        token,
    })
}

#[test]
fn a_prefix_stored_on_one_node_is_retrieved_byte_identical_on_every_other() {
    let Some(c) = cluster("clhit", 3) else { return };
    let mut writer = client(&c.nodes[0], 1);
    let len = writer.object_bytes().unwrap() as usize;
    let r = range(&tokens(11, 12));
    let data = payloads(&r, len);
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    writer.store(1, &r, &refs).unwrap();
    // Stores reach their owners in the background: a prefix is cluster-wide once the writer's
    // pushes landed (milliseconds; before that, the chunks a third node owns are misses there).
    wait_pushes(&c.nodes[0]);
    for (i, n) in c.nodes.iter().enumerate().skip(1) {
        let mut reader = client(n, 10 + i as u64);
        let mut lookup = r.clone();
        lookup.worker_id = None;
        let hits = reader.lookup("req", &lookup, 1).unwrap();
        assert_eq!(hits, 12, "node {i}: {:#}", n.status()["cluster"]);
        let back = reader
            .retrieve(10 + i as u64, &r)
            .unwrap()
            .unwrap_or_else(|| panic!("node {i} missed after its lookup hit"));
        assert_eq!(back, data, "node {i} returned other bytes");
        let mc = reader.memcheck().unwrap();
        assert!(mc.0, "{mc:?}");
    }
    // A retrieve with no LOOKUP before it is served cluster-wide too.
    let r2 = range(&tokens(12, 5));
    let d2 = payloads(&r2, len);
    let refs: Vec<&[u8]> = d2.iter().map(Vec::as_slice).collect();
    writer.store(1, &r2, &refs).unwrap();
    wait_pushes(&c.nodes[0]);
    let mut reader = client(&c.nodes[2], 30);
    assert_eq!(reader.retrieve(30, &r2).unwrap().unwrap(), d2);
    // Every node's view and counters say what happened.
    let st = c.nodes[2].status();
    let cl = &st["cluster"];
    assert!(
        num(&st, &["cluster", "fetched_objects"])
            + num(&c.nodes[0].status(), &["cluster", "pushed_batches"])
            > 0,
        "{cl:#}"
    );
    assert_eq!(cl["node_id"], "n2");
}

#[test]
fn a_killed_node_turns_its_chunks_into_misses_and_the_others_keep_serving() {
    let Some(mut c) = cluster("clkill", 3) else {
        return;
    };
    let mut writer = client(&c.nodes[0], 1);
    let len = writer.object_bytes().unwrap() as usize;
    let r = range(&tokens(21, 24));
    let data = payloads(&r, len);
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    writer.store(1, &r, &refs).unwrap();
    wait_pushes(&c.nodes[0]);
    // SIGKILL node 2: no lease revoke, no goodbye.
    let mut dead = c.nodes.remove(2);
    dead.child.kill().unwrap();
    dead.child.wait().unwrap();
    let started = Instant::now();
    let mut reader = client(&c.nodes[1], 2);
    let mut lookup = r.clone();
    lookup.worker_id = None;
    // Before or after the lease expires: never an error or a hang, a (shorter) prefix.
    let hits = reader.lookup("req", &lookup, 1).unwrap() as usize;
    assert!(hits <= 24);
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "a lookup waited {:?} on a dead peer",
        started.elapsed()
    );
    if hits > 0 {
        let mut part = r.clone();
        part.chunk_hashes.truncate(hits);
        let back = reader.retrieve(2, &part).unwrap().unwrap();
        assert_eq!(back, data[..hits].to_vec());
    }
    // The dead node leaves the view within its lease (5 s) ...
    wait_members(&c.nodes[0], 2);
    wait_members(&c.nodes[1], 2);
    // ... and the writer still serves all of it from its own pool.
    let mut again = client(&c.nodes[0], 3);
    assert_eq!(again.retrieve(3, &r).unwrap().unwrap(), data);
    // Nothing leaked on the survivors.
    for n in &c.nodes {
        let mc = n.client().memcheck().unwrap();
        assert!(mc.0, "{mc:?}");
    }
    drop(dead);
}

#[test]
fn a_joining_node_receives_its_share_of_new_stores() {
    let Some(mut c) = cluster("cljoin", 2) else {
        return;
    };
    let joiner = node("cljoin9", &c._etcd, "cljoin", &c.token, "n9");
    for n in c.nodes.iter().chain(std::iter::once(&joiner)) {
        wait_members(n, 3);
    }
    let mut writer = client(&c.nodes[0], 1);
    let len = writer.object_bytes().unwrap() as usize;
    let r = range(&tokens(31, 30));
    let data = payloads(&r, len);
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    writer.store(1, &r, &refs).unwrap();
    wait_pushes(&c.nodes[0]);
    // About a third of 30 chunks is the joiner's; it holds them without anyone asking.
    let held = num(&joiner.status(), &["objects", "ready"]);
    assert!(
        (3..=20).contains(&held),
        "the joiner holds {held} of 30 chunks: {:#}",
        joiner.status()
    );
    // And serves the whole prefix to its own engines.
    let mut reader = client(&joiner, 2);
    assert_eq!(reader.retrieve(2, &r).unwrap().unwrap(), data);
    c.nodes.push(joiner);
}
