//! Namespaces (one per `(model, cache_salt)`) against the real binary: the node holds at most
//! 4096 at once, but reclaims the ones nothing uses, so per-tenant salts that come and go never
//! lock out new stores or new models.

mod common;

use std::time::{Duration, Instant};

use common::{reg, NodeProc, MODEL};
use kvnode::client::ChunkRangeBuilder;
use kvnode::protocol::RegisterRequest;
use kvnode::ErrorKind;

#[test]
fn namespaces_nothing_uses_are_reclaimed() {
    let node = NodeProc::start("namespaces", &[]);
    let mut c = node.client();
    c.register(&reg(1)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut refusals = 0;
    // More distinct salts than the node holds at once, each stored and aborted (nothing
    // remains under it).
    for i in 0..4200u32 {
        let mut hash = [0u8; 32];
        hash[..4].copy_from_slice(&i.to_le_bytes());
        let range = ChunkRangeBuilder::worker(MODEL, 1, 0)
            .salt(&format!("tenant-{i}"))
            .hashes(0, vec![hash]);
        loop {
            match c.prepare_store(1, &range) {
                Ok(p) => {
                    assert_eq!(c.abort_store(1, p.transfer_id).unwrap(), 1);
                    break;
                }
                Err(e) if e.kind == ErrorKind::LimitExceeded => {
                    // Held namespaces are at the limit: the unused ones are reclaimed shortly.
                    refusals += 1;
                    assert!(
                        Instant::now() < deadline,
                        "unused namespaces were never reclaimed: {e}"
                    );
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => panic!("store under salt {i}: {e}"),
            }
        }
    }
    // The limit was reached (refusals until the reclaim ran) or the maintenance thread's
    // reclaim at 90 % of the limit kept ahead of the stores (a slower client): either way more
    // salts than the limit went through, and `reclaimed` (below) shows it.
    eprintln!("stores refused at the limit before a reclaim: {refusals}");
    // A new model still registers.
    let r = c.register(&RegisterRequest {
        model: "another-model".into(),
        ..reg(2)
    });
    assert!(r.is_ok(), "{r:?}");
    let (ok, problems) = c.memcheck().unwrap();
    assert!(ok, "{problems:?}");
    let st = c.status().unwrap();
    let ns = &st["namespaces"];
    assert!(ns["reclaimed"].as_u64().unwrap() > 0, "{ns}");
    assert!(
        ns["held"].as_u64().unwrap() <= ns["limit"].as_u64().unwrap(),
        "{ns}"
    );
}
