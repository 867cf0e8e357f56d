//! The L2 disk tier against the real binary: round trips through L2 after L1 eviction (both
//! engines, every byte verified), restart recovery after a clean stop and after SIGKILL during
//! write-behind, a corrupted slot rejected, ENOSPC on a small tmpfs, the on-evict policy, CLEAR.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use kvnode::client::Client;
use kvnode::protocol::RegisterRequest;

/// A 64 KiB object layout: [2, 2, CHUNK, 256] float32.
fn reg64k(instance_id: u64) -> RegisterRequest {
    RegisterRequest {
        hidden_dim: 256,
        ..reg(instance_id)
    }
}

const OBJ: usize = 64 << 10;

/// A directory that outlives node restarts, removed at the end of the test.
struct L2Dir(PathBuf, &'static str);

impl L2Dir {
    /// A fresh directory for a test running on `engine` (`uring`, `pread` or `auto`).
    fn new(tag: &str, engine: &'static str) -> L2Dir {
        let d =
            std::env::temp_dir().join(format!("kvnode-l2-{}-{tag}-{engine}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        L2Dir(d, engine)
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for L2Dir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Starts a node with L2 in `dir` on `dir`'s engine (64 MiB unless `extra` sets `--l2-size`).
fn start(tag: &str, dir: &L2Dir, pool: &str, extra: &[&str]) -> NodeProc {
    let mut args = vec![
        "--pool-size",
        pool,
        "--l2-path",
        dir.path(),
        "--l2-engine",
        dir.1,
    ];
    if !extra.contains(&"--l2-size") {
        args.extend(["--l2-size", "64MiB"]);
    }
    args.extend_from_slice(extra);
    NodeProc::start(&format!("{tag}-{}", dir.1), &args)
}

/// Stores `convs` conversations of `chunks` chunks each (64 KiB objects, instance 1).
fn store_all(c: &mut Client, convs: std::ops::Range<u32>, chunks: u32) -> usize {
    let mut written = 0;
    for conv in convs {
        let r = range(&tokens(conv, chunks));
        let data = payloads(&r, OBJ);
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        written += c.store(1, &r, &refs).unwrap();
    }
    written
}

/// Retrieves every conversation and checks every byte; returns how many conversations hit.
fn verify_all(c: &mut Client, convs: std::ops::Range<u32>, chunks: u32) -> u32 {
    let mut hits = 0;
    for conv in convs {
        let r = range(&tokens(conv, chunks));
        if let Some(back) = c.retrieve(1, &r).unwrap() {
            assert_eq!(back, payloads(&r, OBJ), "conversation {conv}: bytes differ");
            hits += 1;
        }
    }
    hits
}

fn l2(s: &serde_json::Value, field: &str) -> u64 {
    num(s, &["l2", field])
}

fn wait_written(node: &NodeProc, n: u64) -> serde_json::Value {
    node.wait_status("write-behind to finish", |s| {
        l2(s, "writes") >= n && l2(s, "queued") == 0
    })
}

fn sigterm_and_wait(node: &mut NodeProc) {
    let ok = Command::new("kill")
        .args(["-TERM", &node.child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -TERM");
    let deadline = Instant::now() + Duration::from_secs(30);
    while node.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "node did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn round_trip_through_l2_after_eviction(engine: &'static str) {
    let dir = L2Dir::new("rt", engine);
    // 4 MiB pool = 2 MiB of objects after the L2 staging area: 32 objects of 64 KiB.
    let node = start("l2rt", &dir, "4MiB", &[]);
    let mut c = node.client();
    c.register(&reg64k(1)).unwrap();
    let mut stored = 0;
    for conv in 0..12 {
        // Conversations of 8 chunks; L1 holds 4 of them, so most end up on L2 only.
        stored += store_all(&mut c, conv..conv + 1, 8);
        wait_written(&node, stored as u64);
    }
    assert_eq!(stored, 96);
    let s = node.status();
    assert_eq!(s["l2"]["engine"], engine);
    assert!(num(&s, &["evictions"]) > 0, "L1 must have evicted: {s:#}");
    // Lookups see every conversation in some tier and load the L2 part into L1.
    for conv in 0..12 {
        let r =
            kvnode::client::ChunkRangeBuilder::all_ranks(MODEL, 1).tokens(&tokens(conv, 8), CHUNK);
        let id = format!("req-{conv}");
        assert_eq!(c.lookup(&id, &r, 1).unwrap(), 8, "conversation {conv}");
        c.end_session(&id).unwrap();
    }
    // Retrieves (with no lookup) load from L2 as needed; every byte must match.
    assert_eq!(verify_all(&mut c, 0..12, 8), 12);
    let s = node.status();
    assert!(l2(&s, "hits") > 0, "some objects must come from L2: {s:#}");
    assert_eq!(l2(&s, "errors"), 0);
    assert_eq!(l2(&s, "corrupt"), 0);
    assert_eq!(l2(&s, "objects"), 96);
    assert_eq!(s["memcheck_ok"], true, "{s:#}");
}

fn restart_after_clean_stop(engine: &'static str) {
    let dir = L2Dir::new("clean", engine);
    let mut node = start("l2clean", &dir, "16MiB", &[]);
    let mut c = node.client();
    c.register(&reg64k(1)).unwrap();
    assert_eq!(store_all(&mut c, 0..10, 4), 40);
    drop(c);
    // No waiting: a clean stop drains the write-behind queue first.
    sigterm_and_wait(&mut node);
    let node = start("l2clean2", &dir, "16MiB", &[]);
    let s = node.status();
    assert_eq!(l2(&s, "recovered"), 40, "{s:#}");
    assert_eq!(l2(&s, "objects"), 40);
    // The clean stop wrote a checkpoint: the start read the extent tables, not 40+ slot headers.
    assert_eq!(s["l2"]["clean_start"], true, "{s:#}");
    assert!(l2(&s, "startup_blocks_read") < 40, "{s:#}");
    assert_eq!(num(&s, &["objects", "ready"]), 0, "L1 starts empty");
    let mut c = node.client();
    // Before any instance of the model registers, nothing on disk can be checked against its
    // layout: a lookup sees L1 only and loads nothing.
    let lookup = |c: &mut Client, conv: u32| {
        let r =
            kvnode::client::ChunkRangeBuilder::all_ranks(MODEL, 1).tokens(&tokens(conv, 4), CHUNK);
        let n = c.lookup("early", &r, 1).unwrap();
        c.end_session("early").unwrap();
        n
    };
    assert_eq!(lookup(&mut c, 0), 0);
    assert_eq!(l2(&node.status(), "hits"), 0);
    c.register(&reg64k(1)).unwrap();
    assert_eq!(lookup(&mut c, 0), 4);
    assert_eq!(verify_all(&mut c, 0..10, 4), 10);
    assert_eq!(l2(&node.status(), "hits"), 40);
}

fn restart_after_sigkill_during_write_behind(engine: &'static str) {
    let dir = L2Dir::new("kill", engine);
    let mut node = start("l2kill", &dir, "32MiB", &[]);
    let socket = node.socket.clone();
    // A client keeps storing in a thread; the node is killed while writes are queued.
    let writer = std::thread::spawn(move || {
        let mut c = Client::connect(&socket).unwrap();
        c.register(&reg64k(1)).unwrap();
        let mut committed = Vec::new();
        for conv in 0..2000u32 {
            let r = range(&tokens(conv, 1));
            let data = payloads(&r, OBJ);
            match c.store(1, &r, &[&data[0]]) {
                Ok(_) => committed.push(conv),
                Err(_) => break, // node killed
            }
        }
        committed
    });
    node.wait_status("some objects on L2", |s| l2(s, "writes") >= 50);
    node.child.kill().unwrap(); // SIGKILL
    node.child.wait().unwrap();
    let committed = writer.join().unwrap();
    assert!(committed.len() >= 50);
    let node = start("l2kill2", &dir, "32MiB", &[]);
    let s = node.status();
    let recovered = l2(&s, "recovered");
    assert!(
        recovered >= 50,
        "objects written before the kill survive: {s:#}"
    );
    // No checkpoint after a kill: every slot header was read.
    assert_eq!(s["l2"]["clean_start"], false, "{s:#}");
    assert!(l2(&s, "startup_blocks_read") >= recovered, "{s:#}");
    let mut c = node.client();
    c.register(&reg64k(1)).unwrap();
    // Every committed object is present with exact bytes or cleanly absent; never corrupt.
    // (One more than the client saw committed: the node may have committed the last store
    // without the reply reaching the client.)
    let mut present = 0;
    for conv in 0..=committed.len() as u32 {
        let r = range(&tokens(conv, 1));
        if let Some(back) = c.retrieve(1, &r).unwrap() {
            assert_eq!(back, payloads(&r, OBJ), "conversation {conv}");
            present += 1;
        }
    }
    // A checksum failure after a kill is the kill's doing: counted torn, never corrupt.
    let s = node.status();
    assert_eq!(l2(&s, "corrupt"), 0, "{s:#}");
    assert!(present as u64 >= recovered - l2(&s, "torn"));
    assert_eq!(node.status()["memcheck_ok"], true);
}

/// Offsets of slot headers in the data file (4 KiB blocks starting with the slot magic).
fn slot_headers(file: &Path) -> Vec<u64> {
    let bytes = std::fs::read(file).unwrap();
    bytes
        .chunks(4096)
        .enumerate()
        .filter(|(_, b)| b.starts_with(b"KVL2SLOT"))
        .map(|(i, _)| i as u64 * 4096)
        .collect()
}

fn corrupted_slot_is_rejected(engine: &'static str) {
    let dir = L2Dir::new("corrupt", engine);
    let mut node = start("l2corrupt", &dir, "16MiB", &[]);
    let mut c = node.client();
    c.register(&reg64k(1)).unwrap();
    assert_eq!(store_all(&mut c, 0..20, 1), 20);
    drop(c);
    sigterm_and_wait(&mut node);
    let data = dir.0.join("kvnode-l2.dat");
    let headers = slot_headers(&data);
    assert_eq!(headers.len(), 20);
    // Flip one payload byte of one object (a bad sector, a torn write).
    let mut bytes = std::fs::read(&data).unwrap();
    let at = (headers[7] + 4096 + 1000) as usize;
    bytes[at] ^= 0x5a;
    std::fs::write(&data, &bytes).unwrap();
    let node = start("l2corrupt2", &dir, "16MiB", &[]);
    assert_eq!(l2(&node.status(), "recovered"), 20);
    let mut c = node.client();
    c.register(&reg64k(1)).unwrap();
    assert_eq!(
        verify_all(&mut c, 0..20, 1),
        19,
        "the corrupt object is never served"
    );
    let s = node.status();
    assert_eq!(l2(&s, "corrupt"), 1);
    assert_eq!(
        l2(&s, "objects"),
        19,
        "the corrupt object is dropped from L2"
    );
    assert_eq!(s["memcheck_ok"], true);
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

/// Unmounts on drop.
struct Tmpfs(PathBuf);

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

fn enospc_is_handled_per_object(engine: &'static str) {
    if !is_root() {
        eprintln!("skipped: mounting a small tmpfs needs root");
        return;
    }
    let dir = L2Dir::new("enospc", engine);
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=6m", "tmpfs", dir.path()])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipped: this root cannot mount a tmpfs (no CAP_SYS_ADMIN?)");
        return;
    }
    let _mount = Tmpfs(dir.0.clone());
    // 64 MiB of L2 on a 6 MiB file system: reserved sparsely, writes beyond ~4 MiB fail.
    let node = start("l2enospc", &dir, "32MiB", &[]);
    let mut c = node.client();
    c.register(&reg64k(1)).unwrap();
    assert_eq!(store_all(&mut c, 0..20, 8), 160); // 10 MiB: all of it fits in L1
    let s = node.wait_status("write-behind to give up or finish", |s| {
        l2(s, "queued") == 0 && l2(s, "writes") + l2(s, "errors") >= 160
    });
    assert!(l2(&s, "errors") > 0, "the disk filled up: {s:#}");
    assert!(
        l2(&s, "writes") > 0,
        "objects before the disk filled are on L2"
    );
    assert!(node.log().contains("L2 write failed"));
    // The node keeps serving everything from L1.
    assert_eq!(verify_all(&mut c, 0..20, 8), 20);
    assert_eq!(node.status()["memcheck_ok"], true);
}

fn on_evict_policy_writes_only_under_pressure(engine: &'static str) {
    let dir = L2Dir::new("onevict", engine);
    let node = start(
        "l2onevict",
        &dir,
        "8MiB",
        &["--l2-write-policy", "on-evict"],
    );
    let mut c = node.client();
    c.register(&reg64k(1)).unwrap();
    // 6 MiB of objects in L1 (capacity 6 MiB: watermark 95 % not reached with 5 MiB).
    assert_eq!(store_all(&mut c, 0..10, 8), 80);
    std::thread::sleep(Duration::from_millis(300)); // a few maintenance ticks
    let s = node.status();
    assert_eq!(s["l2"]["write_policy"], "on-evict");
    assert_eq!(
        l2(&s, "writes"),
        0,
        "nothing written without pressure: {s:#}"
    );
    // Past the high watermark: the maintenance pass demotes before it evicts.
    assert_eq!(store_all(&mut c, 10..12, 8), 16);
    let s = node.wait_status("demotion", |s| l2(s, "writes") > 0);
    assert!(l2(&s, "objects") > 0);
    // Whatever a lookup reports is retrievable with exact bytes.
    assert!(verify_all(&mut c, 0..12, 8) >= 2);
    assert_eq!(node.status()["memcheck_ok"], true);
}

fn clear_empties_l2_durably(engine: &'static str) {
    let dir = L2Dir::new("clear", engine);
    let mut node = start("l2clear", &dir, "16MiB", &[]);
    let mut c = node.client();
    c.register(&reg64k(1)).unwrap();
    assert_eq!(store_all(&mut c, 0..4, 4), 16);
    wait_written(&node, 16);
    c.clear().unwrap();
    let s = node.status();
    assert_eq!(l2(&s, "objects"), 0);
    assert_eq!(verify_all(&mut c, 0..4, 4), 0);
    drop(c);
    sigterm_and_wait(&mut node);
    let node = start("l2clear2", &dir, "16MiB", &[]);
    assert_eq!(
        l2(&node.status(), "recovered"),
        0,
        "cleared objects stay gone"
    );
}

/// Runs `kvnode serve` on `dir`'s L2 of `l2_size`, expecting it to refuse to start; returns
/// stderr.
fn serve_must_fail(dir: &L2Dir, l2_size: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvnode"))
        .args([
            "serve",
            "--socket",
            &format!("{}/other.sock", dir.path()),
            "--pool-size",
            "16MiB",
            "--l2-path",
            dir.path(),
            "--l2-size",
            l2_size,
        ])
        .output()
        .unwrap();
    assert!(!out.status.success(), "the node must refuse to start");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A burst of stores into a small L1 outruns the write-behind: eviction takes objects already on
/// L2 before any still waiting for their write, and every object is afterwards either served
/// (exact bytes) or counted as evicted before it could be written; none vanishes silently.
#[test]
fn l1_pressure_evicts_written_objects_before_unwritten_ones() {
    let dir = L2Dir::new("pressure", "auto");
    // 32 objects of 64 KiB fit in L1; 240 single-chunk conversations are stored without pause.
    let node = start("l2pressure", &dir, "4MiB", &[]);
    let mut c = node.client();
    c.register(&reg64k(1)).unwrap();
    // (A store finding L1 full of objects being written is refused, not queued: counted here.)
    let stored = store_all(&mut c, 0..240, 1) as u64;
    assert!(stored > 32, "{stored}");
    // Wait until the writer has dealt with every object: written, or skipped because it was
    // evicted from L1 before its turn (the only reason to skip here).
    let s = node.wait_status("the write-behind to catch up", |s| {
        l2(s, "queued") == 0 && l2(s, "writes") + l2(s, "skipped") >= stored
    });
    let lost = num(&s, &["eviction_counters", "unwritten_evictions"]);
    assert_eq!(l2(&s, "errors"), 0, "{s:#}");
    assert_eq!(l2(&s, "writes") + l2(&s, "skipped"), stored, "{s:#}");
    assert_eq!(l2(&s, "skipped"), lost, "{s:#}");
    let hits = verify_all(&mut c, 0..240, 1);
    assert_eq!(
        u64::from(hits) + lost,
        stored,
        "every object served or counted lost: {s:#}"
    );
    let s = node.status();
    assert_eq!(s["memcheck_ok"], true, "{s:#}");
}

/// Storing again objects that L2 already holds (same layout) writes nothing twice.
#[test]
fn objects_already_on_l2_are_not_written_again() {
    let dir = L2Dir::new("again", "auto");
    // 32 objects of 64 KiB fit in L1.
    let node = start("l2again", &dir, "4MiB", &[]);
    let mut c = node.client();
    c.register(&reg64k(1)).unwrap();
    assert_eq!(store_all(&mut c, 0..4, 8), 32);
    wait_written(&node, 32);
    // Another 32 push the first ones out of L1 (they are on L2, so that costs nothing).
    assert_eq!(store_all(&mut c, 4..8, 8), 32);
    wait_written(&node, 64);
    // The engine recomputes and stores the first prefixes again: nothing new for L2, so they
    // are neither queued nor marked as waiting for a write (evicted last) at commit.
    assert_eq!(store_all(&mut c, 0..4, 8), 32);
    assert_eq!(num(&node.status(), &["objects", "unwritten"]), 0);
    let s = node.wait_status("the re-stores to settle", |s| l2(s, "queued") == 0);
    assert_eq!((l2(&s, "writes"), l2(&s, "skipped")), (64, 0), "{s:#}");
    assert_eq!(num(&s, &["eviction_counters", "unwritten_evictions"]), 0);
    assert_eq!(verify_all(&mut c, 0..8, 8), 8);
    assert_eq!(l2(&node.status(), "writes"), 64);
}

#[test]
fn second_node_on_the_same_l2_is_refused() {
    let dir = L2Dir::new("lock", "auto");
    let _node = start("l2lock", &dir, "16MiB", &[]);
    let data = dir.0.join("kvnode-l2.dat");
    assert_eq!(std::fs::metadata(&data).unwrap().len(), 64 << 20);
    // Asking for a bigger file must not grow the one the running node holds.
    let err = serve_must_fail(&dir, "128MiB");
    assert!(err.contains("in use by another kvnode"), "{err}");
    assert_eq!(std::fs::metadata(&data).unwrap().len(), 64 << 20);
}

fn full_l2_evicts_least_recently_used(engine: &'static str) {
    let dir = L2Dir::new("full", engine);
    // 8 MiB of L2 = three 2 MiB extents of thirty 68 KiB slots: 90 objects.
    let node = start("l2full", &dir, "4MiB", &["--l2-size", "8MiB"]);
    let mut c = node.client();
    c.register(&reg64k(1)).unwrap();
    let mut stored = 0;
    for conv in 0..25 {
        stored += store_all(&mut c, conv..conv + 1, 8);
        wait_written(&node, stored as u64);
    }
    let s = node.status();
    assert_eq!(l2(&s, "writes"), 200);
    assert!(l2(&s, "evictions") >= 110, "{s:#}");
    assert!(l2(&s, "objects") <= 90);
    assert!(l2(&s, "used_bytes") <= l2(&s, "bytes"));
    // The newest conversations survive in some tier with exact bytes; older ones miss cleanly.
    assert_eq!(verify_all(&mut c, 20..25, 8), 5);
    let older = verify_all(&mut c, 0..20, 8);
    assert!(older < 20, "not everything fits");
    let s = node.status();
    assert_eq!((l2(&s, "errors"), l2(&s, "corrupt")), (0, 0));
    assert_eq!(s["memcheck_ok"], true, "{s:#}");
}

#[test]
fn foreign_data_is_never_overwritten() {
    let dir = L2Dir::new("foreign", "auto");
    let data = dir.0.join("kvnode-l2.dat");
    let mut bytes = vec![0u8; 64 << 20];
    bytes[..26].copy_from_slice(b"someone else's file system");
    std::fs::write(&data, &bytes).unwrap();
    let err = serve_must_fail(&dir, "64MiB");
    assert!(err.contains("not a kvnode L2 tier"), "{err}");
    assert_eq!(
        std::fs::read(&data).unwrap()[..26],
        bytes[..26],
        "left untouched"
    );
}

/// Issue 10, defect 1: file systems and RAID labels that begin with zeros (md 1.2 at 4 KiB,
/// ZFS at 16 KiB, btrfs at 64 KiB) are still someone else's data: refused, byte for byte
/// untouched, and a refused file is never grown.
#[test]
fn data_behind_a_zero_first_block_is_never_overwritten_nor_grown() {
    let dir = L2Dir::new("md", "auto");
    let data = dir.0.join("kvnode-l2.dat");
    let mut bytes = vec![0u8; 64 << 20];
    bytes[4096..4100].copy_from_slice(&[0xfc, 0x4e, 0x2b, 0xa9]); // md superblock magic
    for (i, b) in bytes[2 << 20..].iter_mut().enumerate() {
        *b = (i % 251) as u8; // the array's data
    }
    std::fs::write(&data, &bytes).unwrap();
    let err = serve_must_fail(&dir, "64MiB");
    assert!(
        err.contains("not a kvnode L2 tier") && err.contains("byte 4096"),
        "{err}"
    );
    assert!(std::fs::read(&data).unwrap() == bytes, "the file changed");
    // A small foreign file with a larger --l2-size: refused before it is resized.
    let small = vec![7u8; 1 << 20];
    std::fs::write(&data, &small).unwrap();
    let err = serve_must_fail(&dir, "64MiB");
    assert!(err.contains("not a kvnode L2 tier"), "{err}");
    assert_eq!(std::fs::metadata(&data).unwrap().len(), 1 << 20, "grown");
    assert!(std::fs::read(&data).unwrap() == small);
}

/// `--l2-format overwrite` hands a disk with other data to kvnode explicitly; an all-zero file
/// needs nothing.
#[test]
fn overwrite_formats_foreign_data_and_zeros_need_no_flag() {
    let dir = L2Dir::new("overwrite", "auto");
    let data = dir.0.join("kvnode-l2.dat");
    let mut bytes = vec![0u8; 64 << 20];
    bytes[64 << 10] = 1;
    std::fs::write(&data, &bytes).unwrap();
    let mut node = start("overwrite", &dir, "16MiB", &["--l2-format", "overwrite"]);
    let mut c = node.client();
    c.register(&reg64k(1)).unwrap();
    assert_eq!(store_all(&mut c, 0..2, 4), 8);
    wait_written(&node, 8);
    drop(c);
    sigterm_and_wait(&mut node);
    // Now kvnode's: a restart without the flag recovers it.
    let node = start("overwrite2", &dir, "16MiB", &[]);
    assert_eq!(l2(&node.status(), "recovered"), 8);
    drop(node);
    std::fs::write(&data, vec![0u8; 64 << 20]).unwrap();
    let node = start("zeros", &dir, "16MiB", &[]);
    assert_eq!(l2(&node.status(), "recovered"), 0);
}

fn two_devices_spread_objects_and_recover(engine: &'static str) {
    let dir = L2Dir::new("two", engine);
    let (a, b) = (dir.0.join("a"), dir.0.join("b"));
    let paths = format!("{},{}", a.display(), b.display());
    let args = [
        "--pool-size",
        "16MiB",
        "--l2-path",
        &paths,
        "--l2-size",
        "32MiB",
        "--l2-engine",
        engine,
    ];
    let mut node = NodeProc::start(&format!("l2two-{engine}"), &args);
    let mut c = node.client();
    c.register(&reg64k(1)).unwrap();
    assert_eq!(store_all(&mut c, 0..10, 4), 40);
    let s = wait_written(&node, 40);
    let devices = s["l2"]["devices"].as_array().unwrap().clone();
    assert_eq!(devices.len(), 2);
    let per: Vec<u64> = devices
        .iter()
        .map(|d| d["objects"].as_u64().unwrap())
        .collect();
    assert!(
        per.iter().all(|&n| n > 0),
        "both devices hold objects: {per:?}"
    );
    assert_eq!(per.iter().sum::<u64>(), 40);
    assert_eq!(l2(&s, "bytes"), 64 << 20, "capacity adds up");
    // The index's memory, per device and in total (l2.max_index_bytes, 1 GiB, per device).
    let index: Vec<(u64, u64)> = devices
        .iter()
        .map(|d| {
            let n = |f: &str| d[f].as_u64().unwrap();
            (n("index_bytes"), n("index_limit_bytes"))
        })
        .collect();
    assert!(index
        .iter()
        .all(|&(b, limit)| 0 < b && b <= limit && limit == 1 << 30));
    assert_eq!(l2(&s, "index_limit_bytes"), 2 << 30);
    assert_eq!(l2(&s, "index_bytes"), index[0].0 + index[1].0);
    assert_eq!(l2(&s, "unindexed"), 0);
    drop(c);
    sigterm_and_wait(&mut node);
    let node = NodeProc::start(&format!("l2two2-{engine}"), &args);
    let s = node.status();
    assert_eq!(l2(&s, "recovered"), 40, "{s:#}");
    let mut c = node.client();
    c.register(&reg64k(1)).unwrap();
    assert_eq!(verify_all(&mut c, 0..10, 4), 10);
    let s = node.status();
    assert_eq!(l2(&s, "hits"), 40);
    assert_eq!(s["memcheck_ok"], true);
    drop(c);
    drop(node);
    // The same devices in the other order: every object is still found where it was written.
    let reversed = format!("{},{}", b.display(), a.display());
    let mut args = args;
    args[3] = &reversed;
    let node = NodeProc::start(&format!("l2two3-{engine}"), &args);
    assert_eq!(l2(&node.status(), "recovered"), 40);
    let mut c = node.client();
    c.register(&reg64k(1)).unwrap();
    assert_eq!(verify_all(&mut c, 0..10, 4), 10);
    // CLEAR empties every device, durably.
    c.clear().unwrap();
    assert_eq!(l2(&node.status(), "objects"), 0);
}

/// A loop device over a scratch file, detached on drop.
struct LoopDevice(String, PathBuf);

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
        let _ = std::fs::remove_file(&self.1);
    }
}

fn block_device_via_loop(engine: &'static str) {
    if !is_root() {
        eprintln!("skipped: loop devices need root");
        return;
    }
    let backing = std::env::temp_dir().join(format!(
        "kvnode-l2-{}-loop-{engine}.img",
        std::process::id()
    ));
    std::fs::write(&backing, vec![0u8; 96 << 20]).unwrap();
    let out = Command::new("losetup")
        .args(["-f", "--show", "--direct-io=on"])
        .arg(&backing)
        .output();
    let dev = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_owned(),
        _ => {
            let _ = std::fs::remove_file(&backing);
            eprintln!("skipped: no loop device available");
            return;
        }
    };
    let _loop = LoopDevice(dev.clone(), backing);
    let dir = L2Dir(PathBuf::from(&dev), engine);
    // 64 MiB of the 96 MiB device.
    let mut node = start("l2dev", &dir, "16MiB", &[]);
    assert_eq!(node.status()["l2"]["path"], dev.as_str());
    let mut c = node.client();
    c.register(&reg64k(1)).unwrap();
    assert_eq!(store_all(&mut c, 0..6, 4), 24);
    drop(c);
    sigterm_and_wait(&mut node);
    let node = start("l2dev2", &dir, "16MiB", &[]);
    assert_eq!(l2(&node.status(), "recovered"), 24);
    let mut c = node.client();
    c.register(&reg64k(1)).unwrap();
    assert_eq!(verify_all(&mut c, 0..6, 4), 6);
    drop(node);
    std::mem::forget(dir); // the device is not ours to remove; LoopDevice detaches it
}

/// Every tier test runs once per block engine: `<test>::uring` and `<test>::pread`.
macro_rules! on_both_engines {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[test]
                fn uring() {
                    super::$name("uring");
                }
                #[test]
                fn pread() {
                    super::$name("pread");
                }
            }
        )*
    };
}

on_both_engines!(
    round_trip_through_l2_after_eviction,
    restart_after_clean_stop,
    restart_after_sigkill_during_write_behind,
    corrupted_slot_is_rejected,
    enospc_is_handled_per_object,
    on_evict_policy_writes_only_under_pressure,
    clear_empties_l2_durably,
    full_l2_evicts_least_recently_used,
    block_device_via_loop,
    two_devices_spread_objects_and_recover,
);

#[test]
fn objects_stored_under_another_layout_are_not_served() {
    let dir = L2Dir::new("relayout", "auto");
    let mut node = start("l2relayout", &dir, "16MiB", &[]);
    let mut c = node.client();
    c.register(&reg64k(1)).unwrap(); // [2, 2, 16, 256] float32: 64 KiB
    assert_eq!(store_all(&mut c, 0..3, 2), 6);
    drop(c);
    sigterm_and_wait(&mut node);
    let node = start("l2relayout2", &dir, "16MiB", &[]);
    assert_eq!(l2(&node.status(), "recovered"), 6);
    let mut c = node.client();
    // Same model name and object size, another dtype: the bytes would be misread.
    c.register(&RegisterRequest {
        hidden_dim: 512,
        dtype: "bfloat16".into(),
        ..reg(1)
    })
    .unwrap();
    assert_eq!(
        verify_all(&mut c, 0..3, 2),
        0,
        "never served under another layout"
    );
    let s = node.status();
    assert_eq!(
        (l2(&s, "hits"), l2(&s, "objects")),
        (0, 6),
        "kept on disk, not faults"
    );
}
