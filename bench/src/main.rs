//! `kvnode-bench`: the load harness. Only a skeleton for now; the harness itself is tracked as
//! issue 3 (HDR latencies, memcpy and socket baselines in the same run, PERFORMANCE.md).

fn main() {
    eprintln!("kvnode-bench: the load harness is not built yet (issue 3)");
    std::process::exit(2);
}
