//! The human-readable table of `kvnode-bench l2`'s JSON.

use serde_json::Value;

use super::TARGET_VS_DEVICE;

fn mark(ok: Option<bool>) -> &'static str {
    match ok {
        Some(true) => "met",
        Some(false) => "MISSED",
        None => "n/a",
    }
}

/// Prints the human-readable table of an `l2` section on stdout.
pub fn print_table(j: &Value) {
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    println!(
        "kvnode-bench l2  object {} KiB  total {} MiB ({} objects)  {} ({})",
        j["object_bytes"].as_u64().unwrap_or(0) >> 10,
        j["total_bytes"].as_u64().unwrap_or(0) >> 20,
        j["objects"],
        j["dir"].as_str().unwrap_or("?"),
        j["fs"].as_str().unwrap_or("?"),
    );
    println!(
        "{:<22}{:>11}{:>11}{:>13}{:>13}",
        "raw O_DIRECT", "write GB/s", "read GB/s", "w CPU s/GB", "r CPU s/GB"
    );
    let engines: Vec<&str> = j["engines"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    for &e in &engines {
        let r = &j["raw"][e];
        let label = if e == "uring" {
            format!("  {e} qd{}", r["queue_depth"])
        } else {
            format!("  {e}")
        };
        println!(
            "{label:<22}{:>11.2}{:>11.2}{:>13.3}{:>13.3}",
            f(&r["write_gbps"]),
            f(&r["read_gbps"]),
            f(&r["write_cpu_s_per_gb"]),
            f(&r["read_cpu_s_per_gb"]),
        );
    }
    let dev = &j["device"];
    println!(
        "{:<22}{:>11.2}{:>11.2}   (best raw: write {}, read {})",
        "  device limit",
        f(&dev["write_gbps"]),
        f(&dev["read_gbps"]),
        dev["write_engine"].as_str().unwrap_or("?"),
        dev["read_engine"].as_str().unwrap_or("?"),
    );
    let applies = j["targets"]["applies"] == true;
    let target = |v: f64| {
        if applies {
            mark(Some(v >= TARGET_VS_DEVICE))
        } else {
            "n/a < 2 MiB"
        }
    };
    for &e in &engines {
        let n = &j["node"][e];
        println!(
                "node {e:<6} write-behind {:>6.2} GB/s = {:>4.0}% of device ({:>3.0}% of raw {e}) [>= 90%: {}]  node CPU {:.3} s/GB",
                f(&n["write_behind_gbps"]),
                100.0 * f(&n["write_vs_device"]),
                100.0 * f(&n["write_vs_raw"]),
                target(f(&n["write_vs_device"])),
                f(&n["write_cpu_s_per_gb"]),
            );
        println!(
                "            L2 read      {:>6.2} GB/s = {:>4.0}% of device ({:>3.0}% of raw {e}) [>= 90%: {}]  node CPU {:.3} s/GB",
                f(&n["read_gbps"]),
                100.0 * f(&n["read_vs_device"]),
                100.0 * f(&n["read_vs_raw"]),
                target(f(&n["read_vs_device"])),
                f(&n["read_cpu_s_per_gb"]),
            );
        println!(
                "            L2 read vs raw reads of the same batches interleaved with it ({} {:.2} GB/s): {:>3.0}% [>= 90%: {}]",
                n["paired_raw_engine"].as_str().unwrap_or("?"),
                f(&n["paired_raw_read_gbps"]),
                100.0 * f(&n["read_vs_paired"]),
                target(f(&n["read_vs_paired"])),
            );
        println!(
                "            L2 read vs the same raw reads checksummed like the node does ({:.2} GB/s): {:>3.0}%",
                f(&n["paired_raw_checksum_read_gbps"]),
                100.0 * f(&n["read_vs_paired_checksum"]),
            );
        println!(
            "            then retrieve from L1 {:.2} GB/s (client copy out, after the prefetch)",
            f(&n["retrieve_gbps"]),
        );
        println!(
                "            L1 store {:.2} GB/s; start {:.2} s, stop {:.2} s, restart {:.2} s; recovered {}/{}; verified {} ({} corrupt, {} missed)",
                f(&n["store_gbps"]),
                f(&n["startup_s"]),
                f(&n["shutdown_s"]),
                f(&n["restart_s"]),
                n["recovered"],
                n["objects"],
                n["verified_chunks"],
                n["corrupt_chunks"],
                n["misses"],
            );
        let (rc, rk) = (&n["restart_clean"], &n["restart_crash"]);
        println!(
            "            L2 index rebuilt after a clean stop in {:.3} s ({} blocks read), after a crash in {:.3} s ({} blocks): {:.3}x; whole L2 start-up {:.3} s vs {:.3} s",
            f(&rc["l2_recovery_s"]),
            rc["blocks_read"],
            f(&rk["l2_recovery_s"]),
            rk["blocks_read"],
            f(&n["restart_tables_vs_headers"]),
            f(&rc["l2_startup_s"]),
            f(&rk["l2_startup_s"]),
        );
    }
    let c = &j["cpu_uring_over_pread"];
    if !c["node_write"].is_null() || !c["raw_write"].is_null() {
        let x = |v: &Value| v.as_f64().map_or("n/a".to_string(), |v| format!("{v:.2}x"));
        println!(
            "CPU/GB uring/pread: raw write {} read {}; node write-behind {} [< 1: {}] read {} [< 1: {}]",
            x(&c["raw_write"]),
            x(&c["raw_read"]),
            x(&c["node_write"]),
            mark(c["node_write"].as_f64().map(|v| v < 1.0)),
            x(&c["node_read"]),
            mark(c["node_read"].as_f64().map(|v| v < 1.0)),
        );
    }
    println!(
        "page cache: all L2 and raw I/O is O_DIRECT (bypasses it); drop_caches before each cold read: {}",
        j["node"]
            .as_object()
            .map(|n| n.values().all(|v| v["drop_caches"] == true))
            .unwrap_or(false)
    );
    println!("verified    {}", j["verified"]);
}
