//! Quotas per instance, connection and user, against the real binary: one engine cannot take
//! the whole pool with uncommitted stores, nor every instance slot of the node.

mod common;

use common::*;
use kvnode::ErrorKind;

/// One instance keeps preparing stores without committing: it is refused once it would hold
/// more than half the pool, and another instance still gets slots (before: the first one took
/// every slot and the second got none).
#[test]
fn one_instance_cannot_reserve_the_whole_pool() {
    let node = NodeProc::start("quota-reserve", &["--pool-size", "64MiB"]);
    let mut hog = node.client();
    let obj = hog.register(&reg(1)).unwrap().object_bytes;
    let capacity = num(&node.status(), &["capacity_bytes"]);
    // 256 chunks per prepare (4 MiB of 16 KiB objects): the pool holds 16 such prepares.
    let mut reserved = 0u64;
    let mut refused = None;
    for i in 0..32u32 {
        match hog.prepare_store(1, &range(&tokens(1000 + i, 256))) {
            Ok(p) => reserved += p.slots.len() as u64 * obj,
            Err(e) => {
                refused = Some(e);
                break;
            }
        }
    }
    let e = refused.expect("the hog was never refused");
    assert_eq!(e.kind, ErrorKind::LimitExceeded, "{e}");
    assert!(
        e.context.contains("max_reserved_fraction_per_instance"),
        "{e}"
    );
    assert!(
        reserved <= capacity / 2,
        "{reserved} of {capacity} reserved"
    );
    let mut other = node.client();
    other.register(&reg(2)).unwrap();
    let p = other.prepare_store(2, &range(&tokens(1, 256))).unwrap();
    assert_eq!(p.slots.len(), 256, "the other engine still finds room");
    // Committing gives the hog its quota back.
    let s = node.status();
    assert!(num(&s, &["pending_writes"]) >= 2);
}

/// One connection registers at most `max_instances_per_connection` (64) instances; another
/// connection still registers (before: one connection could take all 1024 slots).
#[test]
fn one_connection_cannot_register_every_instance() {
    let node = NodeProc::start("quota-conn", &[]);
    let mut c = node.client();
    let mut refused = None;
    for id in 1..=100u64 {
        if let Err(e) = c.register(&reg(id)) {
            refused = Some((id, e));
            break;
        }
    }
    let (id, e) = refused.expect("never refused");
    assert_eq!(id, 65, "refused at the 65th");
    assert_eq!(e.kind, ErrorKind::LimitExceeded, "{e}");
    assert!(e.context.contains("max_instances_per_connection"), "{e}");
    // Refreshing one it holds is not a new instance.
    c.register(&reg(1)).unwrap();
    let mut d = node.client();
    d.register(&reg(500)).unwrap();
    assert_eq!(node.status()["instances"].as_array().unwrap().len(), 65);
}

/// One user holds at most `max_instances_per_user` instances across its connections.
#[test]
fn one_user_cannot_register_every_instance() {
    let node = NodeProc::start_with_config(
        "quota-user",
        "[limits]\nmax_instances_per_user = 5\nmax_instances_per_connection = 3\n",
        &[],
    );
    let mut a = node.client();
    let mut b = node.client();
    for id in 1..=3 {
        a.register(&reg(id)).unwrap();
    }
    b.register(&reg(4)).unwrap();
    b.register(&reg(5)).unwrap();
    let e = b.register(&reg(6)).unwrap_err();
    assert_eq!(e.kind, ErrorKind::LimitExceeded, "{e}");
    assert!(e.context.contains("max_instances_per_user = 5"), "{e}");
    // One released frees a place.
    a.unregister(1).unwrap();
    b.register(&reg(6)).unwrap();
}
