//! The README's client example is `examples/client.rs` verbatim, and it works against a real
//! node (so the README never shows code that does not compile or run).

mod common;

#[allow(dead_code)]
#[path = "../examples/client.rs"]
mod example;

#[allow(dead_code)]
#[path = "../examples/gpu_client.rs"]
mod gpu_example;

use common::*;

#[test]
fn readme_shows_the_client_example_verbatim() {
    let readme = include_str!("../README.md");
    let example = include_str!("../examples/client.rs");
    let body = example
        .lines()
        .skip_while(|l| l.starts_with("//!") || l.is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        readme.contains(&format!("```rust\n{body}\n```")),
        "README.md must show examples/client.rs (without its //! header) in a ```rust block"
    );
}

#[test]
fn the_client_example_runs_against_a_node() {
    let node = NodeProc::start("example", &[]);
    example::round_trip(&node.socket).unwrap();
    let s = node.status();
    assert_eq!(num(&s, &["objects", "ready"]), 512 / u64::from(CHUNK));
}

#[test]
fn readme_shows_the_gpu_example_verbatim() {
    let readme = include_str!("../README.md");
    let example = include_str!("../examples/gpu_client.rs");
    let body = example
        .lines()
        .skip_while(|l| l.starts_with("//!") || l.is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        readme.contains(&format!("```rust\n{body}\n```")),
        "README.md must show examples/gpu_client.rs (without its //! header) in a ```rust block"
    );
}

#[test]
fn the_gpu_example_runs_against_a_node_with_the_simulated_gpu() {
    let node = NodeProc::start("gpu-example", &[]);
    let (gpu, ctl) = kvnode_hw::gpu::Gpu::fake(64 << 20, false);
    gpu_example::round_trip_gpu(&node.socket, &gpu).unwrap();
    assert_eq!(ctl.counters().synchronizations, 2, "one wait per request");
    assert_eq!(num(&node.status(), &["objects", "ready"]), 8);
}
