//! `kvnode status` and `kvnode ping`: one-shot requests to a running node.

use super::*;

pub(crate) fn status(
    socket: PathBuf,
    json: bool,
    timeout: std::time::Duration,
) -> Result<(), String> {
    let mut c = cli_client(&socket, timeout)?;
    let text = c.status_json().map_err(|e| e.to_string())?;
    if json {
        println!("{text}");
        return Ok(());
    }
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    print_status(&v, &socket.display().to_string());
    Ok(())
}

/// Prints the human form of a status report of the node at `at`.
pub(crate) fn print_status(v: &serde_json::Value, at: &str) {
    let mib = |k: &str| v[k].as_u64().unwrap_or(0) as f64 / (1 << 20) as f64;
    println!("kvnode {} at {at}", v["version"].as_str().unwrap_or("?"));
    println!(
        "pool      {:.1} MiB ({}), used {:.1} MiB",
        mib("pool_bytes"),
        v["pool_backing"].as_str().unwrap_or("?"),
        mib("used_bytes")
    );
    println!(
        "backing   {}",
        v["pool_backing_detail"].as_str().unwrap_or("?")
    );
    let o = &v["objects"];
    println!(
        "objects   ready {}  read-locked {}  write-reserved {}  temporary {}",
        o["ready"], o["read_locked"], o["write_reserved"], o["temporary"]
    );
    println!(
        "transfers pending writes {}  pending reads {}  evictions {}",
        v["pending_writes"], v["pending_reads"], v["evictions"]
    );
    println!(
        "memcheck  {}",
        if v["memcheck_ok"].as_bool() == Some(true) {
            "ok"
        } else {
            "FAILED"
        }
    );
    let empty = vec![];
    let instances = v["instances"].as_array().unwrap_or(&empty);
    println!("instances {}", instances.len());
    for i in instances {
        println!(
            "  {:>20}  {}  world {}  last seen {} ms ago  pinged {}  pending w/r {}/{}",
            i["id"],
            i["model"].as_str().unwrap_or("?"),
            i["world_size"],
            i["last_seen_ms_ago"],
            i["pinged"],
            i["pending_writes"],
            i["pending_reads"]
        );
    }
    let t = &v["transports"];
    if t.is_object() {
        println!(
            "transports uds {}  tcp {} (auth {}, engine {})  rdma {}",
            t["uds"], t["tcp"], t["tcp_auth"], t["tcp_engine"], t["rdma"]
        );
    }
    let r = &v["remote"];
    if r.is_object() {
        println!(
            "remote    connections {}  bytes in {}  out {}  handshakes {}",
            r["connections_total"], r["bytes_in"], r["bytes_out"], r["handshakes"]
        );
    }
}

pub(crate) fn ping(socket: PathBuf, timeout: std::time::Duration) -> Result<(), String> {
    let t = Instant::now();
    let mut c = cli_client(&socket, timeout)?;
    c.ping(None).map_err(|e| e.to_string())?;
    println!(
        "pong from {} in {} us",
        socket.display(),
        t.elapsed().as_micros()
    );
    Ok(())
}
