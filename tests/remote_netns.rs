//! Remote engines across a real link: the node in its own network namespace, the engine on
//! this side of a veth pair. Needs root (skips with a message otherwise).

mod common;

use common::netns::Netns;
use common::remote::{new_token, options};
use common::{num, payloads, range, reg, tokens, NodeProc, TestDir};
use kvnode::client::RemoteClient;
use kvnode::transport::tcp::auth::Token;

#[test]
fn an_engine_across_a_veth_link_stores_retrieves_and_is_released_when_the_link_dies() {
    let ns = match Netns::try_new() {
        Ok(ns) => ns,
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            return;
        }
    };
    let dir = TestDir::new("remote-netns-tok");
    let token_file = new_token(&dir, "t");
    let listen = format!("tcp://{}:7377", ns.ns_ip);
    let node = NodeProc::start_in_netns(
        "remote-netns",
        &ns.name,
        &[
            "--pool-size",
            "128MiB",
            "--listen",
            &listen,
            "--auth-token-file",
            token_file.to_str().unwrap(),
        ],
    );
    let token = Token::from_file(&token_file).unwrap();
    let mut c = RemoteClient::connect_remote(&listen, Some(&token), &options()).unwrap();
    let r = c
        .register(&kvnode::protocol::RegisterRequest {
            num_layers: 16,
            hidden_dim: 1024,
            ..reg(1)
        })
        .unwrap();
    let rg = range(&tokens(1, 6));
    let data = payloads(&rg, r.object_bytes as usize);
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    assert_eq!(c.store(1, &rg, &refs).unwrap(), 6);
    assert!(
        c.retrieve(1, &rg).unwrap().unwrap() == data,
        "bytes across the link"
    );
    let st = node.status();
    let conns = st["remote"]["connections"].as_array().unwrap();
    assert_eq!(conns.len(), 1, "{st:#}");
    assert!(
        conns[0]["peer"].as_str().unwrap().starts_with(&ns.host_ip),
        "{st:#}"
    );
    // The link dies silently (no FIN, no RST): heartbeats stop arriving, the node releases
    // the engine's instance.
    ns.set_link(false);
    node.wait_status("release after the link died", |s| {
        s["instances"].as_array().is_some_and(Vec::is_empty)
    });
    let st = node.status();
    assert_eq!(num(&st, &["pending_writes"]), 0, "{st:#}");
    drop(c);
}
