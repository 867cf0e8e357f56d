//! The exposition of an in-process node: families present, requests counted by opcode, the
//! histogram's buckets cumulative up to its count.

use std::sync::Arc;

use prometheus_client::registry::Registry;

use super::{render, NodeCollector};
use crate::clock::Clock;
use crate::protocol::{RegisterRequest, Request};
use crate::server::dispatch;
use crate::sim::world::{self, CaptureSink};
use crate::transport::ReplySink;

fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.parse().expect("a number"))
}

#[test]
fn a_scrape_shows_requests_by_opcode_and_the_pool() {
    let clock = Clock::manual(1_000);
    let ctx = world::build_node(&clock);
    let mut registry = Registry::default();
    registry.register_collector(Box::new(NodeCollector::new(ctx.clone(), None)));
    let before = render(&registry);
    assert_eq!(
        sample(&before, "kvnode_requests_total{op=\"noop\"}"),
        Some(0.0)
    );

    let conn = CaptureSink::new(7);
    let sink: Arc<dyn ReplySink> = conn.clone();
    let mut reg = dispatch::Registered::default();
    for _ in 0..3 {
        dispatch::dispatch(&ctx, &sink, 1, Request::Noop, &mut reg);
    }
    // A request for an instance nobody registered: an error of its opcode.
    dispatch::dispatch(
        &ctx,
        &sink,
        2,
        Request::Unregister { instance_id: 99 },
        &mut reg,
    );
    dispatch::dispatch(
        &ctx,
        &sink,
        3,
        Request::Register(RegisterRequest {
            instance_id: 5,
            model: "m".into(),
            world_size: 1,
            block_size: 16,
            num_layers: world::NUM_LAYERS,
            hidden_dim: world::HIDDEN,
            dtype: world::DTYPE.into(),
            use_mla: false,
            physical_slots: None,
        }),
        &mut reg,
    );
    let text = render(&registry);
    assert_eq!(
        sample(&text, "kvnode_requests_total{op=\"noop\"}"),
        Some(3.0)
    );
    assert_eq!(
        sample(&text, "kvnode_request_errors_total{op=\"unregister\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "kvnode_requests_total{op=\"register\"}"),
        Some(1.0)
    );
    assert_eq!(sample(&text, "kvnode_instances"), Some(1.0));
    assert_eq!(
        sample(&text, "kvnode_request_duration_seconds_count{op=\"noop\"}"),
        Some(3.0)
    );
    assert_eq!(
        sample(
            &text,
            "kvnode_request_duration_seconds_bucket{le=\"+Inf\",op=\"noop\"}"
        )
        .or_else(|| sample(
            &text,
            "kvnode_request_duration_seconds_bucket{op=\"noop\",le=\"+Inf\"}"
        )),
        Some(3.0),
        "{text}"
    );
    assert!(sample(&text, "kvnode_pool_capacity_bytes").unwrap() > 0.0);
    assert!(
        text.contains("# TYPE kvnode_requests_total counter"),
        "{text}"
    );
    assert!(text.contains("# TYPE kvnode_objects gauge"), "{text}");
    // No L2 tier, no LMCache frontend: their families are absent.
    assert!(!text.contains("kvnode_l2_"), "{text}");
    assert!(!text.contains("kvnode_lmcache_"), "{text}");
}
