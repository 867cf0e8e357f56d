//! Smoke run of `kvnode-bench --etcd ... --cluster ...` against two nodes on loopback and a real
//! etcd (skipped, saying so, when there is no `etcd`): every retrieved chunk verified, peer and
//! local hits reported from the members' counters, per-member and total figures present. No
//! timing thresholds.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Kills (and reaps) its processes and removes its directory on drop.
struct Procs {
    children: Vec<Child>,
    dir: PathBuf,
}

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn kvnode_bin() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_kvnode-bench"))
        .parent()
        .unwrap()
        .join("kvnode")
}

#[test]
fn the_cluster_bench_verifies_every_chunk_and_reports_peer_and_local_hits() {
    let etcd = std::env::var_os("KVNODE_ETCD_BIN").unwrap_or_else(|| "etcd".into());
    if !Command::new(&etcd)
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
    {
        eprintln!("SKIPPED: no `etcd` binary (scripts/setup.sh unpacks Debian's etcd-server)");
        return;
    }
    assert!(
        kvnode_bin().exists(),
        "no kvnode binary beside kvnode-bench"
    );
    let dir = std::env::temp_dir().join(format!("kvnode-bench-cluster-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut procs = Procs {
        children: Vec::new(),
        dir: dir.clone(),
    };
    let (ep, pp) = (free_port(), free_port());
    let url = format!("http://127.0.0.1:{ep}");
    procs.children.push(
        Command::new(&etcd)
            .args(["--name", "s", "--data-dir"])
            .arg(dir.join("etcd"))
            .args([
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
            ])
            .arg("--listen-peer-urls")
            .arg(format!("http://127.0.0.1:{pp}"))
            .arg("--initial-advertise-peer-urls")
            .arg(format!("http://127.0.0.1:{pp}"))
            .arg("--initial-cluster")
            .arg(format!("s=http://127.0.0.1:{pp}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    for t in ["token", "admin"] {
        let st = Command::new(kvnode_bin())
            .args(["token", "generate"])
            .arg(dir.join(t))
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(st.success());
    }
    for i in 0..2 {
        procs.children.push(
            Command::new(kvnode_bin())
                .arg("serve")
                .arg("--socket")
                .arg(dir.join(format!("n{i}.sock")))
                .args(["--pool-size", "64MiB", "--chunk-size", "16"])
                .args(["--listen", "tcp://127.0.0.1:0", "--auth-token-file"])
                .arg(dir.join("token"))
                .arg("--admin-token-file")
                .arg(dir.join("admin"))
                .args(["--etcd", &url, "--cluster", "smoke", "--node-id"])
                .arg(format!("s{i}"))
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join(format!("n{i}.log"))).unwrap())
                .spawn()
                .unwrap(),
        );
    }
    // Both members in etcd.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = Command::new(kvnode_bin())
            .args([
                "cluster",
                "status",
                "--etcd",
                &url,
                "--cluster",
                "smoke",
                "--json",
            ])
            .output()
            .unwrap();
        let n = serde_json::from_slice::<serde_json::Value>(&out.stdout)
            .ok()
            .and_then(|v| v["members"].as_array().map(Vec::len))
            .unwrap_or(0);
        if n == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "the members never both joined");
        std::thread::sleep(Duration::from_millis(50));
    }
    let json = dir.join("out.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvnode-bench"))
        .args(["--etcd", &url, "--cluster", "smoke", "--token-file"])
        .arg(dir.join("token"))
        .arg("--admin-token-file")
        .arg(dir.join("admin"))
        .args([
            "--preset",
            "tiny",
            "--ops",
            "2",
            "--raw-secs",
            "0.06",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kvnode-bench --etcd failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(j["verified"], true, "{j:#}");
    assert_eq!(j["corrupt_chunks"], 0);
    assert_eq!(j["misses"], 0, "{j:#}");
    assert_eq!(j["members"].as_array().unwrap().len(), 2);
    for key in [
        "total_store_gbps",
        "total_cross_retrieve_gbps",
        "total_local_retrieve_gbps",
        "raw_tcp_recv_gbps",
        "cross_retrieve_vs_raw",
    ] {
        let v = j[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} missing: {j:#}"));
        assert!(v > 0.0 && v.is_finite(), "{key} = {v}");
    }
    // 2 members x 2 prefixes x 8 chunks read twice: each member fetched the chunks the other
    // owns once (cold), then served everything locally (warm).
    let peer = j["peer_hits"].as_u64().unwrap();
    let local = j["local_hits"].as_u64().unwrap();
    assert_eq!(peer + local, 64, "{j:#}");
    assert!(peer > 0 && peer <= 32, "{j:#}");
}
