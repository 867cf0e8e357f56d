//! A cluster across a real (virtual) link: etcd and one node on this side of a veth pair, two
//! nodes in their own network namespace (three nodes in all). Chunks stored on one side are hits on the other; when the
//! link dies the namespaced node keeps serving its own cache, answers misses for the rest within
//! its peer deadline, and says in status that etcd is lost; when the link returns it rejoins.
//! Needs root and a real etcd (skips with a message otherwise).

mod common;

use std::time::{Duration, Instant};

use common::etcd::{etcd_available, Etcd};
use common::netns::Netns;
use common::remote::new_token;
use common::{num, payloads, range, reg, tokens, NodeProc, TestDir};

fn as_refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn nodes_on_both_sides_of_a_veth_link_share_chunks_and_survive_the_link_dying() {
    if !etcd_available() {
        eprintln!("SKIPPED: no `etcd` binary (scripts/setup.sh unpacks Debian's etcd-server)");
        return;
    }
    let ns = match Netns::try_new() {
        Ok(ns) => ns,
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            return;
        }
    };
    let etcd = Etcd::start_on("clns", &ns.host_ip);
    let dir = TestDir::new("clns-tok");
    let token = new_token(&dir, "peer.token");
    let flags = |listen: String, id: &str| -> Vec<String> {
        vec![
            "--listen".into(),
            listen,
            "--auth-token-file".into(),
            token.to_str().unwrap().into(),
            "--etcd".into(),
            etcd.url.clone(),
            "--cluster".into(),
            "clns".into(),
            "--node-id".into(),
            id.into(),
        ]
    };
    let host_flags = flags(format!("tcp://{}:0", ns.host_ip), "host");
    let ns_flags = flags(format!("tcp://{}:0", ns.ns_ip), "inside");
    let ns2_flags = flags(format!("tcp://{}:0", ns.ns_ip), "inside2");
    let host = NodeProc::start("clns-host", &as_refs(&host_flags));
    let inside = NodeProc::start_in_netns("clns-in", &ns.name, &as_refs(&ns_flags));
    let inside2 = NodeProc::start_in_netns("clns-in2", &ns.name, &as_refs(&ns2_flags));
    for n in [&host, &inside, &inside2] {
        n.wait_status("3 members", |s| {
            s["cluster"]["members"]
                .as_array()
                .is_some_and(|m| m.len() == 3)
        });
    }
    let st = inside.status();
    let endpoints: Vec<&str> = st["cluster"]["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["endpoint"].as_str().unwrap())
        .collect();
    assert!(
        endpoints.iter().any(|e| e.contains(&ns.ns_ip))
            && endpoints.iter().any(|e| e.contains(&ns.host_ip)),
        "{endpoints:?}"
    );
    // Stored on the host, read inside (and the other way round).
    let mut w = host.client();
    w.register(&reg(1)).unwrap();
    let len = w.object_bytes().unwrap() as usize;
    let r = range(&tokens(51, 16));
    let data = payloads(&r, len);
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    w.store(1, &r, &refs).unwrap();
    host.wait_status("pushes drained", |s| {
        num(s, &["cluster", "push_queue_bytes"]) == 0 && num(s, &["cluster", "push_in_flight"]) == 0
    });
    let mut rd = inside.client();
    rd.register(&reg(2)).unwrap();
    assert_eq!(
        rd.retrieve(2, &r).unwrap().unwrap(),
        data,
        "bytes across the link"
    );
    let r2 = range(&tokens(52, 8));
    let d2 = payloads(&r2, len);
    let refs: Vec<&[u8]> = d2.iter().map(Vec::as_slice).collect();
    rd.store(2, &r2, &refs).unwrap();
    inside.wait_status("pushes drained", |s| {
        num(s, &["cluster", "push_queue_bytes"]) == 0 && num(s, &["cluster", "push_in_flight"]) == 0
    });
    assert_eq!(w.retrieve(1, &r2).unwrap().unwrap(), d2);
    // The third node, beside the second in the namespace, reads both prefixes too.
    let mut rd2 = inside2.client();
    rd2.register(&reg(3)).unwrap();
    assert_eq!(rd2.retrieve(3, &r).unwrap().unwrap(), data);
    assert_eq!(rd2.retrieve(3, &r2).unwrap().unwrap(), d2);
    // The link dies silently.
    ns.set_link(false);
    let r3 = range(&tokens(53, 12));
    let d3 = payloads(&r3, len);
    let refs: Vec<&[u8]> = d3.iter().map(Vec::as_slice).collect();
    w.store(1, &r3, &refs).unwrap();
    let started = Instant::now();
    let got = rd.retrieve(2, &r3).unwrap();
    assert!(got.is_none() || got == Some(d3.clone()));
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "a retrieve waited {:?} across a dead link",
        started.elapsed()
    );
    // Its own cache (what it fetched before) still serves.
    assert_eq!(rd.retrieve(2, &r).unwrap().unwrap(), data);
    let lost = inside.wait_status("etcd lost", |s| s["cluster"]["etcd"]["state"] == "lost");
    assert!(lost["cluster"]["etcd"]["reason"].as_str().is_some());
    let mc = rd.memcheck().unwrap();
    assert!(mc.0, "{mc:?}");
    // The partition outlasts the lease: the host drops the node from its view.
    host.wait_status("the far nodes left the view", |s| {
        s["cluster"]["members"]
            .as_array()
            .is_some_and(|m| m.len() == 1)
    });
    // The link returns: the node rejoins (a new lease) and is a member on both sides again.
    ns.set_link(true);
    for n in [&host, &inside, &inside2] {
        n.wait_status("rejoined", |s| {
            s["cluster"]["etcd"]["state"] == "connected"
                && s["cluster"]["members"]
                    .as_array()
                    .is_some_and(|m| m.len() == 3)
        });
    }
    // The host hands the returning node the chunks it owns that it missed meanwhile (its
    // pushes failed while the link was down): the whole prefix is served inside again.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match rd.retrieve(2, &r3).unwrap() {
            Some(back) => {
                assert_eq!(back, d3);
                break;
            }
            None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(200)),
            None => panic!(
                "the returning node never got its share: {:#}\nhost: {:#}",
                inside.status()["cluster"],
                host.status()["cluster"]
            ),
        }
    }
    assert!(num(&host.status(), &["cluster", "handoff_queued"]) > 0);
}
