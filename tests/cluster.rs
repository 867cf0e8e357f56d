//! A cluster of real `kvnode` processes on a real etcd: a prefix stored through one node is
//! retrieved, byte-identical, through the others; a killed node's chunks become misses while
//! the others keep serving; a joining node receives its share. Skipped, with a message, when
//! the `etcd` binary is missing.

mod common;
#[path = "metrics/expo.rs"]
#[allow(dead_code)]
mod expo;

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
            "--metrics-addr",
            "127.0.0.1:0",
        ],
    )
}

/// The metrics address node `n` logged.
fn metrics_addr(n: &NodeProc) -> std::net::SocketAddr {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(a) = n
            .log()
            .lines()
            .find_map(|l| l.split("Prometheus metrics at http://").nth(1))
            .and_then(|r| r.split('/').next())
            .and_then(|a| a.parse().ok())
        {
            return a;
        }
        assert!(Instant::now() < deadline, "no metrics address logged");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A cluster node that pushes nothing (chunks stay where they are stored), plus `extra` flags.
fn unpushed_node(
    tag: &str,
    etcd: &Etcd,
    cluster: &str,
    token: &std::path::Path,
    id: &str,
    extra: &[&str],
) -> NodeProc {
    let mut args = extra.to_vec();
    args.extend([
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
    ]);
    NodeProc::start_with_config(tag, "[cluster]\npush = false\n", &args)
}

/// Whether placement, over the members in status `st`, puts every chunk of `r` on member `id`.
fn all_owned_by(st: &serde_json::Value, id: &str, r: &kvnode::protocol::ChunkRange) -> bool {
    use kvnode::cluster::placement::{node_hash, owner, placement_key, weight_of, Candidate};
    let members = st["cluster"]["members"].as_array().unwrap();
    let cands: Vec<Candidate> = members
        .iter()
        .map(|m| Candidate {
            hash: node_hash(m["node_id"].as_str().unwrap()),
            weight: weight_of(m["capacity_bytes"].as_u64().unwrap()),
        })
        .collect();
    r.chunk_hashes.iter().all(|h| {
        let k = placement_key(&r.model, &r.cache_salt, h);
        members[owner(k, &cands).unwrap()]["node_id"] == id
    })
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
    // Metrics count the same: members, fetched objects and bytes, misses by cause.
    let e = expo::scrape(metrics_addr(&c.nodes[1]));
    assert_eq!(e.value("kvnode_cluster_members", &[]), 3.0);
    assert_eq!(e.value("kvnode_cluster_etcd_connected", &[]), 1.0);
    let fetched = e.value("kvnode_cluster_fetched_objects_total", &[]);
    assert_eq!(
        fetched,
        num(&c.nodes[1].status(), &["cluster", "fetched_objects"]) as f64
    );
    assert!(e
        .get("kvnode_cluster_fetch_misses_total", &[("cause", "timeout")])
        .is_some());
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
fn a_joining_node_receives_its_share_of_cached_and_new_chunks() {
    let Some(mut c) = cluster("cljoin", 2) else {
        return;
    };
    let mut writer = client(&c.nodes[0], 1);
    let len = writer.object_bytes().unwrap() as usize;
    // Cached before the join.
    let old = range(&tokens(31, 30));
    let old_data = payloads(&old, len);
    let refs: Vec<&[u8]> = old_data.iter().map(Vec::as_slice).collect();
    writer.store(1, &old, &refs).unwrap();
    wait_pushes(&c.nodes[0]);
    let joiner = node("cljoin9", &c._etcd, "cljoin", &c.token, "n9");
    for n in c.nodes.iter().chain(std::iter::once(&joiner)) {
        wait_members(n, 3);
    }
    // The others hand it the chunks it now owns (about a third), without anyone asking.
    let st = joiner.wait_status("hand-off", |s| num(s, &["objects", "ready"]) >= 3);
    for n in &c.nodes {
        wait_pushes(n);
    }
    let held = num(&joiner.status(), &["objects", "ready"]);
    assert!(
        (3..=20).contains(&held),
        "the joiner holds {held} of 30 cached chunks: {st:#}"
    );
    let queued: u64 = c
        .nodes
        .iter()
        .map(|n| num(&n.status(), &["cluster", "handoff_queued"]))
        .sum();
    assert!(
        queued >= held,
        "hand-off queued {queued}, joiner holds {held}"
    );
    // New stores: its share goes to it as well.
    let new = range(&tokens(32, 30));
    let new_data = payloads(&new, len);
    let refs: Vec<&[u8]> = new_data.iter().map(Vec::as_slice).collect();
    writer.store(1, &new, &refs).unwrap();
    wait_pushes(&c.nodes[0]);
    let more = num(&joiner.status(), &["objects", "ready"]) - held;
    assert!(
        (3..=20).contains(&more),
        "the joiner got {more} of 30 new chunks"
    );
    // And it serves both prefixes to its own engines, byte-identical.
    let mut reader = client(&joiner, 2);
    assert_eq!(reader.retrieve(2, &old).unwrap().unwrap(), old_data);
    assert_eq!(reader.retrieve(2, &new).unwrap().unwrap(), new_data);
    c.nodes.push(joiner);
}

/// Unmodified LMCache clients (the Rust DEALER checker speaking LMCache's protocol) on three
/// `lmcache-server` nodes: a prefix stored through one is retrieved byte-identical through the
/// others, from their own shared-memory segments.
#[test]
fn lmcache_clients_get_cluster_wide_hits_through_lmcache_server() {
    use common::lm::{self, get, Dealer};
    use kvnode::lmcache::wire::{self, Op};
    let Some(etcd) = start_or_skip("cllm") else {
        return;
    };
    let tokens_dir = TestDir::new("cllm-tok");
    let token = new_token(&tokens_dir, "peer.token");
    let nodes: Vec<lm::LmNode> = (0..3)
        .map(|i| {
            lm::start(
                &format!("cllm{i}"),
                "",
                &[
                    "--listen",
                    "tcp://127.0.0.1:0",
                    "--auth-token-file",
                    token.to_str().unwrap(),
                    "--etcd",
                    &etcd.url,
                    "--cluster",
                    "cllm",
                    "--node-id",
                    &format!("lm{i}"),
                ],
            )
        })
        .collect();
    let wait = |n: &lm::LmNode, what: &str, pred: &dyn Fn(&serde_json::Value) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let s = lm::status(n);
            if pred(&s) {
                return;
            }
            assert!(Instant::now() < deadline, "{what}: {:#}", s["cluster"]);
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    for n in &nodes {
        wait(n, "3 members", &|s| {
            s["cluster"]["members"]
                .as_array()
                .is_some_and(|m| m.len() == 3)
        });
    }
    let segment =
        |n: &lm::LmNode| kvnode_hw::PoolMapping::open_posix_shm(&n.shm, 64 << 20).unwrap();
    // Store 8 chunks (16 tokens each) through node 0, bytes written into its segment.
    let toks: Vec<u32> = (0..128).map(|i| i * 7 + 3).collect();
    let mut w = Dealer::connect(nodes[0].port);
    lm::register(&mut w, 1);
    let offsets = lm::prepare_store(&mut w, 1, &toks, 128, "st");
    assert_eq!(offsets.len(), 8);
    let seg0 = segment(&nodes[0]);
    let chunk = |i: usize| -> Vec<u8> { (0..2048).map(|b| (b * 31 + i * 17 + 5) as u8).collect() };
    for (i, off) in offsets.iter().enumerate() {
        seg0.region().write_at(*off, &chunk(i)).unwrap();
    }
    assert_eq!(
        lm::commit_store(&mut w, 1, &toks, 128, "st"),
        Some(rmpv::Value::Boolean(true))
    );
    wait(&nodes[0], "pushes drained", &|s| {
        num(s, &["cluster", "push_queue_bytes"]) == 0 && num(s, &["cluster", "push_in_flight"]) == 0
    });
    for (i, n) in nodes.iter().enumerate().skip(1) {
        let mut r = Dealer::connect(n.port);
        lm::register(&mut r, 10 + i as u64);
        lm::lookup(&mut r, &toks, "rq");
        assert_eq!(
            lm::query(&mut r, "rq"),
            8,
            "node {i}: {:#}",
            lm::status(n)["cluster"]
        );
        let key = lm::key(&toks, 0, 128, Some(0), "rq");
        let p = r
            .call(
                Op::PrepareRetrieve,
                vec![key.clone(), wire::encode_uint(10 + i as u64)],
            )
            .unwrap();
        assert_eq!(get(&p, "success").as_bool(), Some(true), "{p}");
        let slots = get(get(&p, "context"), "slots").as_array().unwrap().clone();
        assert_eq!(slots.len(), 8);
        let seg = segment(n);
        for (c, s) in slots.iter().enumerate() {
            let mut back = vec![0u8; 2048];
            seg.region()
                .read_at(get(s, "offset").as_u64().unwrap(), &mut back)
                .unwrap();
            assert_eq!(back, chunk(c), "node {i} chunk {c}");
        }
        assert_eq!(
            r.call(
                Op::CommitRetrieve,
                vec![key, wire::encode_uint(10 + i as u64)]
            ),
            Some(rmpv::Value::Boolean(true))
        );
    }
}

/// A peer that stops answering (SIGSTOP: its sockets stay open) costs a lookup at most the peer
/// deadline and is a miss; nothing stays reserved on the asking node, and once the peer runs
/// again it has released everything the abandoned call held there.
#[test]
fn a_silent_peer_is_a_miss_within_the_deadline_and_leaks_nothing_on_either_side() {
    let Some(c) = cluster("clstop", 2) else {
        return;
    };
    let mut writer = client(&c.nodes[0], 1);
    let len = writer.object_bytes().unwrap() as usize;
    let r = range(&tokens(41, 16));
    let data = payloads(&r, len);
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    writer.store(1, &r, &refs).unwrap();
    wait_pushes(&c.nodes[0]);
    let mut reader = client(&c.nodes[1], 2);
    let before = c.nodes[1].status();
    let used_before = num(&before, &["used_bytes"]);
    // Node 0 freezes.
    let pid = c.nodes[0].child.id().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
    let started = Instant::now();
    let mut lookup = r.clone();
    lookup.worker_id = None;
    let hits = reader.lookup("req", &lookup, 1).unwrap() as usize;
    let took = started.elapsed();
    // Node 1 has what it owns (pushed to it); the rest, node 0's, are misses.
    assert!(hits < 16, "hits {hits} with the owner frozen");
    assert!(took < Duration::from_secs(10), "the lookup took {took:?}");
    let st = c.nodes[1].status();
    assert!(
        num(&st, &["cluster", "fetch_misses", "timeout"])
            + num(&st, &["cluster", "fetch_misses", "unreachable"])
            > 0,
        "{:#}",
        st["cluster"]
    );
    reader.free_lookup_locks("req", 0, 16).ok();
    reader.end_session("req").ok();
    // Nothing reserved for the abandoned fetch on the asking node.
    let after = c.nodes[1].status();
    assert_eq!(num(&after, &["objects", "write_reserved"]), 0, "{after:#}");
    assert!(num(&after, &["used_bytes"]) >= used_before);
    let mc = reader.memcheck().unwrap();
    assert!(mc.0, "{mc:?}");
    // Node 0 runs again: it has dropped the connection and everything it held for it.
    assert!(std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status()
        .unwrap()
        .success());
    let s0 = c.nodes[0].wait_status("peer connection released", |s| {
        num(s, &["objects", "read_locked"]) == 0 && num(s, &["pending_reads"]) == 0
    });
    assert!(s0["memcheck_ok"].as_bool().unwrap_or(true));
    // And serves again.
    let mut again = client(&c.nodes[1], 3);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match again.retrieve(3, &r).unwrap() {
            Some(back) => {
                assert_eq!(back, data);
                break;
            }
            None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(200)),
            None => panic!(
                "node 1 never fetched from node 0 again: {:#}",
                c.nodes[1].status()["cluster"]
            ),
        }
    }
}

/// A remote engine with no node of its own talks to the cluster directly: each chunk goes to
/// its owner, reads come from the owners in parallel, a dead member is a miss (never an error),
/// and after a join a chunk the new owner lacks is read from the member that held it before.
#[test]
fn the_cluster_client_routes_to_owners_survives_a_death_and_follows_a_join() {
    use kvnode::cluster::ClusterClient;
    use kvnode::transport::tcp::auth::Token;
    let Some(etcd) = start_or_skip("clcli") else {
        return;
    };
    let tokens_dir = TestDir::new("clcli-tok");
    let token_file = new_token(&tokens_dir, "peer.token");
    // No pushes or hand-offs: where a chunk is, is where the client put it.
    let start = |tag: &str, id: &str| unpushed_node(tag, &etcd, "clcli", &token_file, id, &[]);
    let mut nodes: Vec<NodeProc> = (0..3)
        .map(|i| start(&format!("clcli{i}"), &format!("c{i}")))
        .collect();
    for n in &nodes {
        wait_members(n, 3);
    }
    let token = Token::from_file(&token_file).unwrap();
    let mut cc = ClusterClient::connect(
        std::slice::from_ref(&etcd.url),
        "clcli",
        Some(token),
        common::remote::options(),
    )
    .unwrap();
    assert_eq!(cc.members().len(), 3);
    let len = cc.register(&reg(7)).unwrap() as usize;
    let r = range(&tokens(61, 30));
    let data = payloads(&r, len);
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    assert_eq!(cc.store(7, &r, &refs).unwrap(), 30);
    // Spread over the owners, each chunk once.
    let held: Vec<u64> = nodes
        .iter()
        .map(|n| num(&n.status(), &["objects", "ready"]))
        .collect();
    assert_eq!(held.iter().sum::<u64>(), 30, "{held:?}");
    assert!(held.iter().all(|&h| h > 0), "{held:?}");
    let mut lookup = r.clone();
    lookup.worker_id = None;
    assert_eq!(cc.lookup("q1", &lookup).unwrap(), 30);
    assert_eq!(cc.retrieve(7, &r).unwrap().unwrap(), data);
    // A member dies: its chunks are misses, nothing errs or hangs.
    let mut dead = nodes.remove(2);
    dead.child.kill().unwrap();
    dead.child.wait().unwrap();
    let started = Instant::now();
    assert!(cc.retrieve(7, &r).unwrap().is_none());
    assert!(cc.lookup("q2", &lookup).unwrap() < 30);
    assert!(started.elapsed() < Duration::from_secs(15));
    // Once it has left the view, stores land on the survivors and are whole again.
    for n in &nodes {
        wait_members(n, 2);
    }
    cc.refresh().unwrap();
    assert_eq!(cc.members().len(), 2);
    cc.store(7, &r, &refs).unwrap();
    assert_eq!(cc.retrieve(7, &r).unwrap().unwrap(), data);
    // A member joins: keys move to it (about a third); it lacks them (no hand-off here), so the
    // client reads them from their previous owners.
    let joiner = start("clcli9", "c9");
    for n in nodes.iter().chain(std::iter::once(&joiner)) {
        wait_members(n, 3);
    }
    cc.refresh().unwrap();
    assert_eq!(cc.members().len(), 3);
    assert_eq!(cc.retrieve(7, &r).unwrap().unwrap(), data);
    assert_eq!(num(&joiner.status(), &["objects", "ready"]), 0);
    drop(dead);
}

/// Bad cluster flags and an unreachable etcd get clear errors naming the value, never a node
/// that starts half-configured or a command that hangs.
#[test]
fn cluster_flags_and_an_unreachable_etcd_are_refused_with_clear_errors() {
    use common::{assert_no_kind_prefix, kvnode_until_exit};
    let dir = TestDir::new("clflags");
    let sock = dir.join("n.sock");
    let sock = sock.to_str().unwrap();
    let token = new_token(&dir, "t");
    let token = token.to_str().unwrap();
    let cases: [(&[&str], &str); 4] = [
        (
            &[
                "serve",
                "--socket",
                sock,
                "--pool-size",
                "64MiB",
                "--etcd",
                "http://127.0.0.1:1",
            ],
            "--cluster",
        ),
        (
            &[
                "serve",
                "--socket",
                sock,
                "--pool-size",
                "64MiB",
                "--etcd",
                "http://127.0.0.1:1",
                "--cluster",
                "c",
            ],
            "--listen",
        ),
        (
            &[
                "serve",
                "--socket",
                sock,
                "--pool-size",
                "64MiB",
                "--listen",
                "tcp://127.0.0.1:0",
                "--auth-token-file",
                token,
                "--etcd",
                "http://127.0.0.1:1",
                "--cluster",
                "bad/name",
            ],
            "bad/name",
        ),
        (
            &[
                "serve",
                "--socket",
                sock,
                "--pool-size",
                "64MiB",
                "--listen",
                "tcp://127.0.0.1:0",
                "--auth-token-file",
                token,
                "--etcd",
                "https://e:2379",
                "--cluster",
                "c",
            ],
            "TLS",
        ),
    ];
    for (args, needle) in cases {
        let out = kvnode_until_exit(&dir, args);
        assert!(out.failed(), "{args:?} did not fail: {}", out.stderr);
        assert!(out.stderr.contains(needle), "{args:?}: {}", out.stderr);
        assert_no_kind_prefix(&out.stderr);
    }
    // Nothing listens on port 1: the status command fails within its timeout, naming etcd.
    let out = kvnode_until_exit(
        &dir,
        &[
            "cluster",
            "status",
            "--etcd",
            "http://127.0.0.1:1",
            "--cluster",
            "c",
            "--timeout",
            "2",
        ],
    );
    assert!(out.failed(), "{}", out.stderr);
    assert!(out.stderr.contains("etcd"), "{}", out.stderr);
}

/// The owner holds only the first part of what a node asks it for: the node brings in exactly
/// that part (the pipelined retrieve of the whole batch misses, and each rank then retrieves the
/// prefix held with locks of its own), and its lookup answers that many chunks.
#[test]
fn a_partial_prefix_on_the_owner_is_fetched_up_to_its_gap() {
    let Some(etcd) = start_or_skip("clpart") else {
        return;
    };
    let tokens_dir = TestDir::new("clpart-tok");
    let token_file = new_token(&tokens_dir, "peer.token");
    // No pushes: chunks stay where they were stored.
    let start = |tag: &str, id: &str| unpushed_node(tag, &etcd, "clpart", &token_file, id, &[]);
    let a = start("clpart0", "pa");
    let b = start("clpart1", "pb");
    let st = wait_members(&a, 2);
    wait_members(&b, 2);
    // A prompt whose first 6 chunks all belong to node a.
    let r = (0..10_000u32)
        .map(|conv| range(&tokens(1000 + conv, 6)))
        .find(|r| all_owned_by(&st, "pa", r))
        .expect("a prompt placed on node a");
    // Node a holds only its first 3 chunks.
    let mut w = client(&a, 1);
    let len = w.object_bytes().unwrap() as usize;
    let data = payloads(&r, len);
    let mut head = r.clone();
    head.chunk_hashes.truncate(3);
    let refs: Vec<&[u8]> = data[..3].iter().map(Vec::as_slice).collect();
    w.store(1, &head, &refs).unwrap();
    // Node b asks for all 6: it gets 3, byte-identical, and nothing is left locked anywhere.
    let mut rd = client(&b, 2);
    let mut lookup = r.clone();
    lookup.worker_id = None;
    assert_eq!(
        rd.lookup("q", &lookup, 1).unwrap(),
        3,
        "{:#}",
        b.status()["cluster"]
    );
    rd.end_session("q").unwrap();
    assert_eq!(rd.retrieve(2, &head).unwrap().unwrap(), data[..3].to_vec());
    let sb = b.status();
    assert_eq!(
        num(&sb, &["cluster", "fetched_objects"]),
        3,
        "{:#}",
        sb["cluster"]
    );
    assert_eq!(num(&sb, &["cluster", "fetch_misses", "not_held"]), 3);
    a.wait_status("no lock left on the owner", |s| {
        num(s, &["objects", "read_locked"]) == 0 && num(s, &["pending_reads"]) == 0
    });
}

/// Tensor-parallel engines (world size 2): both ranks of every chunk live on the chunk's owner;
/// a node that lacks them brings in both ranks, and each rank's retrieve is byte-identical.
#[test]
fn both_ranks_of_a_tensor_parallel_prefix_are_fetched() {
    use kvnode::client::ChunkRangeBuilder;
    let Some(c) = cluster("cltp", 2) else { return };
    let reg2 = |id: u64| kvnode::protocol::RegisterRequest {
        world_size: 2,
        ..reg(id)
    };
    let toks = tokens(71, 10);
    let ranges: Vec<_> = (0..2)
        .map(|rank| ChunkRangeBuilder::worker(common::MODEL, 2, rank).tokens(&toks, common::CHUNK))
        .collect();
    let mut w = c.nodes[0].client();
    w.register(&reg2(1)).unwrap();
    w.register(&reg2(2)).unwrap();
    let len = w.object_bytes().unwrap() as usize;
    let data: Vec<Vec<Vec<u8>>> = ranges
        .iter()
        .enumerate()
        .map(|(rank, r)| {
            payloads(r, len)
                .into_iter()
                .map(|mut p| {
                    p[0] ^= rank as u8 + 1; // the ranks' bytes differ
                    p
                })
                .collect()
        })
        .collect();
    for (rank, r) in ranges.iter().enumerate() {
        let refs: Vec<&[u8]> = data[rank].iter().map(Vec::as_slice).collect();
        w.store(1 + rank as u64, r, &refs).unwrap();
    }
    wait_pushes(&c.nodes[0]);
    let mut rd = c.nodes[1].client();
    rd.register(&reg2(11)).unwrap();
    rd.register(&reg2(12)).unwrap();
    let mut lookup = ranges[0].clone();
    lookup.worker_id = None;
    assert_eq!(
        rd.lookup("tp", &lookup, 2).unwrap(),
        10,
        "{:#}",
        c.nodes[1].status()["cluster"]
    );
    rd.end_session("tp").unwrap();
    // Node 0's chunks were fetched with both their ranks.
    let fetched = num(&c.nodes[1].status(), &["cluster", "fetched_objects"]);
    assert!(
        fetched > 0 && fetched.is_multiple_of(2),
        "fetched {fetched} objects"
    );
    for (rank, r) in ranges.iter().enumerate() {
        let back = rd.retrieve(11 + rank as u64, r).unwrap().unwrap();
        assert_eq!(back, data[rank], "rank {rank}");
    }
    let mc = rd.memcheck().unwrap();
    assert!(mc.0, "{mc:?}");
}

/// The owner is SIGKILLed while a node is bringing a long prefix in from it (bytes in flight):
/// the fetch is abandoned cleanly — every lookup answers (no error, no hang), nothing stays
/// reserved or budgeted on the asking node, and its pool is consistent.
#[test]
fn an_owner_killed_mid_fetch_leaves_nothing_reserved_on_the_asking_node() {
    let Some(etcd) = start_or_skip("clmid") else {
        return;
    };
    let tokens_dir = TestDir::new("clmid-tok");
    let token_file = new_token(&tokens_dir, "peer.token");
    let start = |tag: &str, id: &str| {
        unpushed_node(
            tag,
            &etcd,
            "clmid",
            &token_file,
            id,
            &["--pool-size", "512MiB"],
        )
    };
    let mut a = start("clmid0", "ma");
    let b = start("clmid1", "mb");
    let st = wait_members(&a, 2);
    wait_members(&b, 2);
    // Prompts whose every chunk node a owns: b fetches all of each from a.
    let on_a = |r: &kvnode::protocol::ChunkRange| all_owned_by(&st, "ma", r);
    // 2 MiB objects: 16 layers x 16 tokens x 1024 hidden x float32 x K/V.
    let big = |id: u64| kvnode::protocol::RegisterRequest {
        num_layers: 16,
        hidden_dim: 1024,
        ..reg(id)
    };
    let mut w = a.client();
    w.register(&big(1)).unwrap();
    let len = w.object_bytes().unwrap() as usize;
    // Prompts stored on a (no pushes), 16 MiB each, all of which b must fetch from a.
    let prompts: Vec<_> = (0..100_000u32)
        .map(|p| range(&tokens(5000 + p, 8)))
        .filter(|r| on_a(r))
        .take(12)
        .collect();
    assert_eq!(prompts.len(), 12);
    for r in &prompts {
        let data = payloads(r, len);
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        w.store(1, r, &refs).unwrap();
    }
    // A reader on b looks the prompts up (each lookup brings a's chunks in) while a dies.
    let sock = b.socket.clone();
    let prompts2 = prompts.clone();
    let (first_done, first) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut c = kvnode::client::Client::connect(&sock).unwrap();
        c.register(&big(2)).unwrap();
        let mut answered = 0;
        for (i, r) in prompts2.iter().enumerate() {
            let mut l = r.clone();
            l.worker_id = None;
            let hits = c.lookup(&format!("q{i}"), &l, 1).expect("a lookup answers");
            assert!(hits as usize <= r.chunk_hashes.len());
            c.end_session(&format!("q{i}")).unwrap();
            answered += 1;
            let _ = first_done.send(());
        }
        answered
    });
    // Killed while the next prompts' bytes are moving.
    first.recv().unwrap();
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    assert_eq!(reader.join().unwrap(), prompts.len());
    // Nothing left reserved or budgeted on b, and its pool is consistent.
    let st = b.wait_status("no fetch in flight", |s| {
        num(s, &["cluster", "fetch_bytes_in_flight"]) == 0
    });
    assert_eq!(num(&st, &["objects", "write_reserved"]), 0, "{st:#}");
    let mc = b.client().memcheck().unwrap();
    assert!(mc.0, "{mc:?}");
    // The death came mid-sequence: some prompts were fetched, later ones failed.
    let fetched = num(&st, &["cluster", "fetched_objects"]);
    let failed = num(&st, &["cluster", "fetch_misses", "unreachable"])
        + num(&st, &["cluster", "fetch_misses", "timeout"]);
    assert!(fetched >= 8 && failed > 0, "{:#}", st["cluster"]);
    drop(a);
}
