//! `kvnode-bench l2`: the L2 disk tier against the disk it sits on. For one object size and
//! total, in a scratch directory:
//!
//! 1. the raw `O_DIRECT` baseline per engine ([`crate::disk::raw_baseline`]);
//! 2. node write-behind: a private node (`--l2-write-policy always`) gets every object stored
//!    once; timed from the first COMMIT_STORE until STATUS says every object is on disk;
//! 3. node cold read: SIGTERM, restart on the same data file (L1 empty, L2 index recovered from
//!    disk), LOOKUPs that load every object from disk into L1 (the L2 read rate), then every
//!    object retrieved from L1 and verified byte for byte.
//! 4. restarts: after that clean stop (the index rebuilt from the extent tables) and after a
//!    SIGKILL (from every slot header), each on cold caches, every object found both times.
//!
//! Steps 2-3 run once per node engine. The JSON schema is documented in `bench/README.md`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvnode::client::{ChunkRangeBuilder, Client};
use kvnode::hashing::{chunk_hashes, ChunkHash};
use kvnode::protocol::RegisterRequest;
use kvnode_hw::EngineKind;
use serde_json::{json, Value};

use crate::disk::{self, cpu_per_gb, gbps, RawFile, RawResult};
use crate::node::SpawnedNode;

/// Tokens per chunk of the layout (a spawned node gets it as `--chunk-size`).
const CHUNK_TOKENS: u32 = 256;
/// Every object stamps its hash and page number every this many bytes (so a misplaced page or
/// object is caught, not only a wrong first block).
const STAMP_EVERY: usize = 4096;
/// Waiting for write-behind fails after this long without a new write.
const STALL: Duration = Duration::from_secs(30);
/// The model name the bench registers.
const MODEL: &str = "bench-l2";
/// Node write-behind and read should reach this fraction of the device (for objects >= 2 MiB).
const TARGET_VS_DEVICE: f64 = 0.9;

/// Block engine choices for `--engines`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineArg {
    /// io_uring with the pool as fixed buffers.
    Uring,
    /// pread/pwrite threads.
    Pread,
}

impl EngineArg {
    fn kind(self) -> EngineKind {
        match self {
            EngineArg::Uring => EngineKind::Uring,
            EngineArg::Pread => EngineKind::Pread,
        }
    }
}

/// Flags of `kvnode-bench l2`.
#[derive(clap::Args, Debug)]
pub struct L2Args {
    /// Object (chunk) size: a multiple of 128KiB, e.g. 2MiB, or a preset: qwen2.5-0.5b (3 MiB),
    /// llama3-8b (32 MiB).
    #[arg(long, default_value = "2MiB")]
    pub object_size: String,
    /// Bytes written and read per phase, e.g. 1GiB (rounded down to whole objects).
    #[arg(long, default_value = "1GiB")]
    pub total: String,
    /// Directory on the disk under test; a fresh subdirectory is made in it and removed after
    /// (default /var/tmp).
    #[arg(long)]
    pub l2_dir: Option<PathBuf>,
    /// Engines to run, comma separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "uring,pread")]
    pub engines: Vec<EngineArg>,
    /// io_uring queue depth of the raw baseline.
    #[arg(long, default_value_t = 64)]
    pub queue_depth: u32,
    /// I/Os per raw baseline batch.
    #[arg(long, default_value_t = 64)]
    pub raw_batch: usize,
    /// Milliseconds between STATUS polls while waiting for the write-behind (each STATUS costs
    /// the node a memcheck).
    #[arg(long, default_value_t = 5)]
    pub poll_ms: u64,
    /// Chunks per STORE and per RETRIEVE call to the node.
    #[arg(long, default_value_t = 16)]
    pub batch_chunks: usize,
    /// The `kvnode` binary to spawn (default: next to this binary, else on PATH).
    #[arg(long)]
    pub node_bin: Option<PathBuf>,
    /// Extra argument for the spawned node (repeatable).
    #[arg(long = "node-arg", allow_hyphen_values = true)]
    pub node_args: Vec<String>,
    /// Write every figure as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// A layout whose object is exactly `bytes` (bf16, 256-token chunks, world size 1).
fn layout_for(spec: &str) -> Result<(u64, u32, u32), String> {
    let bytes = match spec {
        "qwen2.5-0.5b" => 3 << 20,
        "llama3-8b" => 32 << 20,
        s => kvnode::config::parse_size(s).map_err(|e| e.to_string())?,
    };
    // 2 (K, V) x 256 tokens x 128 hidden x 2 bytes = 128 KiB per layer of 128 hidden.
    let unit = 2 * u64::from(CHUNK_TOKENS) * 128 * 2;
    if bytes == 0 || bytes % unit != 0 {
        return Err(format!(
            "--object-size {spec}: must be a positive multiple of 128KiB"
        ));
    }
    let units = bytes / unit;
    let layers = [32u64, 64, 128, 16, 8, 4, 2, 1]
        .into_iter()
        .find(|l| units % l == 0 && units / l <= 64)
        .unwrap_or(units);
    let hidden = 128 * units / layers;
    match (u32::try_from(layers), u32::try_from(hidden)) {
        (Ok(l), Ok(h)) => Ok((bytes, l, h)),
        _ => Err(format!("--object-size {spec}: too large")),
    }
}

/// The deterministic payload: one pseudo-random pattern shared by all objects, with the object's
/// hash and the page number stamped into the first 32 bytes of every 4 KiB page.
struct Payload {
    source: Vec<u8>,
    buf: Vec<u8>,
}

impl Payload {
    fn new(bytes: usize) -> Payload {
        let source = disk::pseudo_random_bytes(bytes, 0x9E37_79B9_7F4A_7C15);
        Payload {
            buf: source.clone(),
            source,
        }
    }

    fn stamp(hash: &ChunkHash, page: usize) -> [u8; 32] {
        let mut s = [0u8; 32];
        s[..24].copy_from_slice(&hash[..24]);
        s[24..].copy_from_slice(&(page as u64).to_le_bytes());
        s
    }

    /// The bytes of the object with `hash`.
    fn object(&mut self, hash: &ChunkHash) -> &[u8] {
        for (page, p) in self.buf.chunks_mut(STAMP_EVERY).enumerate() {
            let n = p.len().min(32);
            p[..n].copy_from_slice(&Self::stamp(hash, page)[..n]);
        }
        &self.buf
    }

    /// Whether `data` is exactly the object with `hash`.
    fn check(&self, hash: &ChunkHash, data: &[u8]) -> bool {
        data.len() == self.source.len()
            && data
                .chunks(STAMP_EVERY)
                .zip(self.source.chunks(STAMP_EVERY))
                .enumerate()
                .all(|(page, (d, s))| {
                    let n = d.len().min(32);
                    d[..n] == Self::stamp(hash, page)[..n] && d[n..] == s[n..]
                })
    }
}

/// Everything one node engine's phases need.
struct NodePlan<'a> {
    engine: EngineKind,
    bin: Option<&'a Path>,
    dir: PathBuf,
    pool_size: String,
    l2_size: u64,
    extra: &'a [String],
    object_bytes: u64,
    layers: u32,
    hidden: u32,
    hashes: &'a [ChunkHash],
    batch: usize,
    poll: Duration,
    ticks: f64,
    /// Engine of the raw reads interleaved with the node's L2 reads.
    paired_engine: EngineKind,
    raw_queue_depth: u32,
}

impl NodePlan<'_> {
    fn start(&self) -> Result<(SpawnedNode, Duration), String> {
        let mut args: Vec<String> = vec![
            "--l2-path".into(),
            self.dir.display().to_string(),
            "--l2-size".into(),
            self.l2_size.to_string(),
            "--l2-engine".into(),
            self.engine.as_str().into(),
            "--l2-write-policy".into(),
            "always".into(),
        ];
        args.extend(self.extra.iter().cloned());
        let t = Instant::now();
        let node = SpawnedNode::start(self.bin, &self.pool_size, CHUNK_TOKENS, &args)?;
        Ok((node, t.elapsed()))
    }

    fn register(&self, client: &mut Client, instance_id: u64) -> Result<(), String> {
        let reg = client
            .register(&RegisterRequest {
                instance_id,
                model: MODEL.into(),
                world_size: 1,
                block_size: 16,
                num_layers: self.layers,
                hidden_dim: self.hidden,
                dtype: "bfloat16".into(),
                use_mla: false,
            })
            .map_err(|e| format!("register: {e}"))?;
        if reg.object_bytes != self.object_bytes || reg.chunk_tokens != CHUNK_TOKENS {
            return Err(format!(
                "node layout: {} bytes per object with {}-token chunks, expected {} and {CHUNK_TOKENS}",
                reg.object_bytes, reg.chunk_tokens, self.object_bytes
            ));
        }
        Ok(())
    }

    fn cpu(&self, node: &SpawnedNode) -> f64 {
        disk::process_cpu_seconds_of(node.pid(), self.ticks).unwrap_or(0.0)
    }

    fn range(&self, batch_index: usize, hashes: &[ChunkHash]) -> kvnode::protocol::ChunkRange {
        ChunkRangeBuilder::worker(MODEL, 1, 0)
            .hashes((batch_index * self.batch) as u32, hashes.to_vec())
    }

    /// Phases 2 and 3 for this engine.
    fn run(&self, payload: &mut Payload) -> Result<Value, String> {
        let n = self.hashes.len() as u64;
        let bytes = n * self.object_bytes;
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("{}: {e}", self.dir.display()))?;
        eprintln!("kvnode-bench l2: node {} write-behind", self.engine);
        let (node, startup) = self.start()?;
        let write = self.write_phase(&node, payload);
        let write = match write {
            Ok(w) => w,
            Err(e) => return Err(format!("{e}\nnode log:\n{}", node.log())),
        };
        let shutdown = node.stop(Duration::from_secs(300))?;
        // The paired baseline: the same objects written raw on the same disk, read back batch
        // for batch between the node's L2 reads, so both see the disk in the same state.
        let paired = RawFile::create(
            &self.dir,
            "raw-paired.dat",
            self.paired_engine,
            self.object_bytes,
            n,
            self.batch,
            // One buffer per object of a lookup, so a lookup's worth is one raw batch, like
            // the node's single load of it (512 MiB of buffers for 16 x 32 MiB).
            self.batch as u64 * self.object_bytes,
            self.raw_queue_depth,
        )?;
        paired.pass(true, 0, n, self.batch)?;
        paired.sync()?;
        let drop_caches = std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok();
        eprintln!("kvnode-bench l2: node {} cold read", self.engine);
        let (node, restart) = self.start()?;
        let read = match self.read_phase(&node, payload, &paired) {
            Ok(r) => r,
            Err(e) => return Err(format!("{e}\nnode log:\n{}", node.log())),
        };
        node.stop(Duration::from_secs(300))?;
        drop(paired);
        let restarts = self.restart_phase()?;
        let _ = std::fs::remove_dir_all(&self.dir);
        let s = |v: &Value, k: &str| v[k].as_u64().unwrap_or(0);
        let written = &write["status"];
        let loaded = &read["status"];
        let verified = read["corrupt_chunks"] == 0
            && read["misses"] == 0
            && read["verified_chunks"].as_u64() == Some(n)
            && s(written, "writes") == n
            && s(loaded, "recovered") == n;
        Ok(json!({
            "engine": self.engine.as_str(),
            "objects": n,
            "bytes": bytes,
            "pool_size": self.pool_size,
            "l2_size": self.l2_size,
            "startup_s": startup.as_secs_f64(),
            "store_gbps": write["store_gbps"],
            "store_s": write["store_s"],
            "write_behind_gbps": write["write_behind_gbps"],
            "write_behind_s": write["write_behind_s"],
            "write_cpu_s_per_gb": write["node_cpu_s_per_gb"],
            "write_node_cpu_s": write["node_cpu_s"],
            "max_queued": write["max_queued"],
            "writes": s(written, "writes"),
            "shutdown_s": shutdown.as_secs_f64(),
            "drop_caches": drop_caches,
            "restart_s": restart.as_secs_f64(),
            "recovered": s(loaded, "recovered"),
            "read_gbps": read["read_gbps"],
            "paired_raw_engine": self.paired_engine.as_str(),
            "paired_raw_read_gbps": read["paired_raw_read_gbps"],
            "read_vs_paired": read["read_vs_paired"],
            "paired_raw_checksum_read_gbps": read["paired_raw_checksum_read_gbps"],
            "read_vs_paired_checksum": read["read_vs_paired_checksum"],
            "retrieve_gbps": read["retrieve_gbps"],
            "retrieve_s": read["retrieve_s"],
            "read_s": read["read_s"],
            "read_prepare_share": read["prepare_share"],
            "read_cpu_s_per_gb": read["node_cpu_s_per_gb"],
            "read_node_cpu_s": read["node_cpu_s"],
            "verified": verified,
            "verified_chunks": read["verified_chunks"],
            "corrupt_chunks": read["corrupt_chunks"],
            "misses": read["misses"],
            "restart_clean": restarts["clean"],
            "restart_crash": restarts["crash"],
            "restart_tables_vs_headers": restarts["tables_vs_headers"],
            "restart_startup_tables_vs_headers": restarts["startup_tables_vs_headers"],
            "status_after_write": write["status"],
            "status_after_read": read["status"],
        }))
    }

    /// Phase 4: the node was just stopped with SIGTERM (a clean stop: its extent tables were
    /// written). It is started on cold caches and its L2 start-up measured, then killed with
    /// SIGKILL (a crash) and started again on cold caches: that start reads every slot header,
    /// as every start did before the tables. Both starts must find every object.
    fn restart_phase(&self) -> Result<Value, String> {
        let n = self.hashes.len() as u64;
        let mut starts = Vec::new();
        for crash in [false, true] {
            let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
            let (node, spawn_to_answer) = self.start()?;
            let l2 = Client::connect(&node.socket)
                .and_then(|mut c| c.status())
                .map_err(|e| format!("status: {e}"))?["l2"]
                .clone();
            let u = |k: &str| l2[k].as_u64().unwrap_or(0);
            let expect_clean = !crash;
            // A node from before the checkpoints (an A/B baseline) reports no clean_start.
            let clean = l2["clean_start"].as_bool();
            if u("recovered") != n || clean.is_some_and(|c| c != expect_clean) {
                return Err(format!(
                    "restart {}: expected {n} objects recovered and clean_start {expect_clean},                      got {l2}
node log:
{}",
                    if crash { "after a crash" } else { "after a clean stop" },
                    node.log()
                ));
            }
            starts.push(json!({
                "spawn_to_answer_s": spawn_to_answer.as_secs_f64(),
                "l2_startup_s": u("startup_ms") as f64 / 1e3,
                "l2_recovery_s": u("recovery_ms") as f64 / 1e3,
                "blocks_read": u("startup_blocks_read"),
                "recovered": u("recovered"),
            }));
            // The first start crashes (its checkpoint is withdrawn at open), the second stops.
            if crash {
                node.stop(Duration::from_secs(300))?;
            } else {
                node.kill()?;
            }
        }
        let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(0.0);
        Ok(json!({
            "clean": starts[0],
            "crash": starts[1],
            "tables_vs_headers": ratio(f(&starts[0], "l2_recovery_s"), f(&starts[1], "l2_recovery_s")),
            "startup_tables_vs_headers": ratio(f(&starts[0], "l2_startup_s"), f(&starts[1], "l2_startup_s")),
        }))
    }

    fn write_phase(&self, node: &SpawnedNode, payload: &mut Payload) -> Result<Value, String> {
        let n = self.hashes.len() as u64;
        let bytes = n * self.object_bytes;
        let mut client = Client::connect(&node.socket).map_err(|e| e.to_string())?;
        let id = u64::from(std::process::id()) << 8 | 1;
        self.register(&mut client, id)?;
        let mut first: Option<(Instant, f64)> = None;
        for (b, hashes) in self.hashes.chunks(self.batch).enumerate() {
            let p = client
                .prepare_store(id, &self.range(b, hashes))
                .map_err(|e| format!("prepare_store: {e}"))?;
            if p.slots.len() != hashes.len() {
                return Err(format!(
                    "prepare_store reserved {} slots for {} new chunks",
                    p.slots.len(),
                    hashes.len()
                ));
            }
            let pool = client.pool().ok_or("no pool mapped")?;
            for (slot, &i) in p.slots.iter().zip(&p.chunk_indices) {
                pool.write_at(slot.offset, payload.object(&hashes[i as usize]))
                    .map_err(|e| e.to_string())?;
            }
            if first.is_none() {
                first = Some((Instant::now(), self.cpu(node)));
            }
            client
                .commit_store(id, p.transfer_id)
                .map_err(|e| format!("commit_store: {e}"))?;
        }
        let (t0, cpu0) = first.ok_or("nothing stored")?;
        let stored = t0.elapsed();
        let mut max_queued = 0;
        let mut progress = (0, Instant::now());
        let (done, status) = loop {
            let st = client.status().map_err(|e| format!("status: {e}"))?;
            let now = Instant::now();
            let l2 = st["l2"].clone();
            let get = |k: &str| l2[k].as_u64().unwrap_or(0);
            max_queued = max_queued.max(get("queued"));
            let writes = get("writes");
            if writes >= n {
                break (now, l2);
            }
            let lost = get("errors") + get("skipped");
            if l2.is_null() || lost > 0 || writes + lost >= n {
                return Err(format!(
                    "node L2 did not write every object ({writes} of {n} written): {l2}"
                ));
            }
            if writes > progress.0 {
                progress = (writes, now);
            } else if now - progress.1 > STALL {
                return Err(format!(
                    "node L2 wrote nothing for {STALL:?} ({writes} of {n} written): {l2}"
                ));
            }
            std::thread::sleep(self.poll);
        };
        let cpu = self.cpu(node) - cpu0;
        let _ = client.unregister(id);
        let wb = done - t0;
        Ok(json!({
            "store_gbps": gbps(bytes, stored),
            "store_s": stored.as_secs_f64(),
            "write_behind_gbps": gbps(bytes, wb),
            "write_behind_s": wb.as_secs_f64(),
            "node_cpu_s": cpu,
            "node_cpu_s_per_gb": cpu_per_gb(cpu, bytes),
            "max_queued": max_queued,
            "status": status,
        }))
    }

    fn read_phase(
        &self,
        node: &SpawnedNode,
        payload: &Payload,
        paired: &RawFile,
    ) -> Result<Value, String> {
        let n = self.hashes.len() as u64;
        let bytes = n * self.object_bytes;
        let mut client = Client::connect(&node.socket).map_err(|e| e.to_string())?;
        let recovered = client.status().map_err(|e| format!("status: {e}"))?["l2"]["recovered"]
            .as_u64()
            .unwrap_or(0);
        if recovered != n {
            return Err(format!(
                "restarted node recovered {recovered} of {n} objects from L2: {}",
                client.status().map(|s| s["l2"].clone()).unwrap_or_default()
            ));
        }
        let id = u64::from(std::process::id()) << 8 | 2;
        self.register(&mut client, id)?;
        // Prefetch (what LMCache does: LOOKUP, then retrieve): each lookup loads its chunks
        // from L2 into L1, checksums verified, before it answers. This is the L2 read rate.
        // Between lookups the same number of objects is read raw from the paired file (not
        // counted in the node's time), so node and device are timed under the same conditions.
        let cpu_l0 = self.cpu(node);
        let mut prefetch = Duration::ZERO;
        let mut raw_read = Duration::ZERO;
        let mut raw_checked = Duration::ZERO;
        let mut cpu_raw = 0.0;
        for (b, hashes) in self.hashes.chunks(self.batch).enumerate() {
            let tl = Instant::now();
            let req = format!("l2-read-{b}");
            let range = ChunkRangeBuilder::all_ranks(MODEL, 1)
                .hashes((b * self.batch) as u32, hashes.to_vec());
            let hit = client
                .lookup(&req, &range, 1)
                .map_err(|e| format!("lookup: {e}"))?;
            if hit as usize != hashes.len() {
                return Err(format!(
                    "lookup after restart found {hit} of {} chunks",
                    hashes.len()
                ));
            }
            client
                .end_session(&req)
                .map_err(|e| format!("end_session: {e}"))?;
            prefetch += tl.elapsed();
            let c = self.cpu(node);
            // Plain and checksummed raw reads of the same objects, in alternating order (the
            // second read of a block could profit from anything the host caches).
            let first = (b * self.batch) as u64;
            let count = hashes.len() as u64;
            for checksum in [b % 2 == 1, b % 2 == 0] {
                let t = paired.pass_then(false, first, count, self.batch, checksum)?;
                if checksum {
                    raw_checked += t;
                } else {
                    raw_read += t;
                }
            }
            cpu_raw += self.cpu(node) - c;
        }
        // The node's CPU while the raw reads ran (idle polling, if any) is not the L2 read's.
        let prefetch_cpu = self.cpu(node) - cpu_l0 - cpu_raw;
        let mut dest = vec![0u8; self.object_bytes as usize];
        let (mut verified, mut corrupt, mut misses, mut moved) = (0u64, 0u64, 0u64, 0u64);
        let mut prepare = Duration::ZERO;
        let mut checking = Duration::ZERO;
        let cpu0 = self.cpu(node);
        let t0 = Instant::now();
        for (b, hashes) in self.hashes.chunks(self.batch).enumerate() {
            let tp = Instant::now();
            let p = client
                .prepare_retrieve(id, &self.range(b, hashes), None)
                .map_err(|e| format!("prepare_retrieve: {e}"))?;
            prepare += tp.elapsed();
            let Some(p) = p else {
                misses += hashes.len() as u64;
                continue;
            };
            if p.slots.len() != hashes.len() {
                return Err(format!(
                    "retrieve hit with {} slots for {} chunks",
                    p.slots.len(),
                    hashes.len()
                ));
            }
            let pool = client.pool().ok_or("no pool mapped")?;
            for (slot, h) in p.slots.iter().zip(hashes) {
                pool.read_at(slot.offset, &mut dest)
                    .map_err(|e| e.to_string())?;
                moved += self.object_bytes;
                // Verification is the harness's work: kept out of the measured time.
                let v = Instant::now();
                if payload.check(h, &dest) {
                    verified += 1;
                } else {
                    corrupt += 1;
                }
                checking += v.elapsed();
            }
            client
                .commit_retrieve(id, p.transfer_id)
                .map_err(|e| format!("commit_retrieve: {e}"))?;
        }
        let elapsed = t0.elapsed().saturating_sub(checking);
        let cpu = self.cpu(node) - cpu0;
        let status = client.status().map_err(|e| format!("status: {e}"))?["l2"].clone();
        let _ = client.unregister(id);
        Ok(json!({
            "read_gbps": gbps(bytes, prefetch),
            "read_s": prefetch.as_secs_f64(),
            "paired_raw_read_gbps": gbps(bytes, raw_read),
            "read_vs_paired": ratio(raw_read.as_secs_f64(), prefetch.as_secs_f64()),
            "paired_raw_checksum_read_gbps": gbps(bytes, raw_checked),
            "read_vs_paired_checksum": ratio(raw_checked.as_secs_f64(), prefetch.as_secs_f64()),
            "node_cpu_s": prefetch_cpu,
            "node_cpu_s_per_gb": cpu_per_gb(prefetch_cpu, bytes),
            "retrieve_gbps": gbps(moved, elapsed),
            "retrieve_s": elapsed.as_secs_f64(),
            "prepare_share": prepare.as_secs_f64() / elapsed.as_secs_f64().max(1e-9),
            "retrieve_node_cpu_s": cpu,
            "verified_chunks": verified,
            "corrupt_chunks": corrupt,
            "misses": misses,
            "status": status,
        }))
    }
}

fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

/// File system type and device of `dir` (`findmnt`), e.g. `ext4 /dev/nvme0n1p2`; empty if unknown.
fn fs_type(dir: &Path) -> String {
    std::process::Command::new("findmnt")
        .args(["-n", "-o", "FSTYPE,SOURCE", "-T"])
        .arg(dir)
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// Runs the whole `l2` mode; returns whether every object was written, recovered and verified.
pub fn run(args: &L2Args) -> Result<bool, String> {
    let (object_bytes, layers, hidden) = layout_for(&args.object_size)?;
    let total = kvnode::config::parse_size(&args.total).map_err(|e| e.to_string())?;
    let objects = total / object_bytes;
    if objects == 0 {
        return Err(format!(
            "--total {} is smaller than one object ({object_bytes} bytes)",
            args.total
        ));
    }
    if args.engines.is_empty() || args.batch_chunks == 0 || args.raw_batch == 0 {
        return Err("--engines, --batch-chunks and --raw-batch must not be empty or 0".into());
    }
    let total = objects * object_bytes;
    let base = args
        .l2_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("/var/tmp"));
    let dir = base.join(format!("kvnode-bench-l2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let out = run_in(args, &dir, object_bytes, layers, hidden, total);
    let _ = std::fs::remove_dir_all(&dir);
    let doc = out?;
    print_table(&doc["l2"]);
    if let Some(p) = &args.json {
        std::fs::write(
            p,
            serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?,
        )
        .map_err(|e| format!("writing {}: {e}", p.display()))?;
    }
    Ok(doc["verified"] == true)
}

fn run_in(
    args: &L2Args,
    dir: &Path,
    object_bytes: u64,
    layers: u32,
    hidden: u32,
    total: u64,
) -> Result<Value, String> {
    let objects = total / object_bytes;
    eprintln!(
        "kvnode-bench l2: {objects} objects of {} KiB ({} MiB) in {} ({})",
        object_bytes >> 10,
        total >> 20,
        dir.display(),
        fs_type(dir)
    );
    let seed = std::process::id();
    let tokens: Vec<u32> = (0..objects as u32 * CHUNK_TOKENS)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ seed)
        .collect();
    let hashes = chunk_hashes(&tokens, CHUNK_TOKENS);
    let mut payload = Payload::new(object_bytes as usize);
    let ticks = disk::clock_ticks();
    let l2_size = round_up(total + total / 4 + (64 << 20), 2 << 20);
    let pool_size = (total + (256 << 20)).to_string();
    // Each engine's raw baseline runs right before its node phases, so both see the disk in
    // the same state (this VM's disk drifts by tens of percent within minutes); the device limit
    // is the best raw figure of the whole run.
    let mut raw: Vec<RawResult> = Vec::new();
    let mut nodes = serde_json::Map::new();
    for e in &args.engines {
        eprintln!("kvnode-bench l2: raw O_DIRECT {}", e.kind());
        raw.push(disk::raw_baseline(
            dir,
            e.kind(),
            object_bytes,
            total,
            args.raw_batch,
            args.queue_depth,
        )?);
        let plan = NodePlan {
            engine: e.kind(),
            bin: args.node_bin.as_deref(),
            dir: dir.join(format!("node-{}", e.kind())),
            pool_size: pool_size.clone(),
            l2_size,
            extra: &args.node_args,
            object_bytes,
            layers,
            hidden,
            hashes: &hashes,
            batch: args.batch_chunks,
            poll: Duration::from_millis(args.poll_ms.max(1)),
            ticks,
            paired_engine: if args.engines.iter().any(|e| e.kind() == EngineKind::Uring) {
                EngineKind::Uring
            } else {
                EngineKind::Pread
            },
            raw_queue_depth: args.queue_depth,
        };
        nodes.insert(e.kind().as_str().into(), plan.run(&mut payload)?);
    }
    let best = |f: fn(&RawResult) -> f64| {
        raw.iter()
            .max_by(|a, b| f(a).total_cmp(&f(b)))
            .map(|r| (f(r), r.engine.clone()))
            .unwrap_or_default()
    };
    let (dev_write, dev_write_engine) = best(|r| r.write_gbps);
    let (dev_read, dev_read_engine) = best(|r| r.read_gbps);
    for (engine, r) in nodes.iter_mut() {
        let same = raw
            .iter()
            .find(|x| &x.engine == engine)
            .expect("one raw run per engine");
        let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
        let extra = json!({
            "write_vs_raw": ratio(f("write_behind_gbps"), same.write_gbps),
            "write_vs_device": ratio(f("write_behind_gbps"), dev_write),
            "read_vs_raw": ratio(f("read_gbps"), same.read_gbps),
            "read_vs_device": ratio(f("read_gbps"), dev_read),
        });
        for (k, v) in extra.as_object().expect("object") {
            r[k] = v.clone();
        }
    }
    let raw_of = |e: &str| raw.iter().find(|r| r.engine == e);
    let node_f = |e: &str, k: &str| nodes.get(e).and_then(|n| n[k].as_f64());
    let cpu_ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => json!(a / b),
        _ => Value::Null,
    };
    let cpu = json!({
        "raw_write": cpu_ratio(raw_of("uring").map(|r| r.write_cpu_s_per_gb), raw_of("pread").map(|r| r.write_cpu_s_per_gb)),
        "raw_read": cpu_ratio(raw_of("uring").map(|r| r.read_cpu_s_per_gb), raw_of("pread").map(|r| r.read_cpu_s_per_gb)),
        "node_write": cpu_ratio(node_f("uring", "write_cpu_s_per_gb"), node_f("pread", "write_cpu_s_per_gb")),
        "node_read": cpu_ratio(node_f("uring", "read_cpu_s_per_gb"), node_f("pread", "read_cpu_s_per_gb")),
    });
    let applies = object_bytes >= 2 << 20;
    let all = |k: &str| {
        nodes
            .values()
            .all(|n| n[k].as_f64().is_some_and(|v| v >= TARGET_VS_DEVICE))
    };
    let lt1 = |v: &Value| v.as_f64().map(|x| x < 1.0);
    let targets = json!({
        "applies": applies,
        "node_vs_device_min": TARGET_VS_DEVICE,
        "write_met": all("write_vs_device"),
        "read_met": all("read_vs_device"),
        "read_paired_met": all("read_vs_paired"),
        "cpu_uring_below_pread_write": lt1(&cpu["node_write"]),
        "cpu_uring_below_pread_read": lt1(&cpu["node_read"]),
    });
    let verified = nodes.values().all(|n| n["verified"] == true);
    let l2 = json!({
        "object_bytes": object_bytes,
        "total_bytes": total,
        "objects": objects,
        "layout": {"layers": layers, "hidden": hidden, "dtype": "bfloat16", "chunk_tokens": CHUNK_TOKENS},
        "dir": dir.display().to_string(),
        "fs": fs_type(dir),
        "engines": args.engines.iter().map(|e| e.kind().as_str()).collect::<Vec<_>>(),
        "batch_chunks": args.batch_chunks,
        "clock_ticks": ticks,
        "raw": raw.iter().map(|r| (r.engine.clone(), serde_json::to_value(r).expect("plain numbers"))).collect::<serde_json::Map<_, _>>(),
        "device": {
            "write_gbps": dev_write,
            "write_engine": dev_write_engine,
            "read_gbps": dev_read,
            "read_engine": dev_read_engine,
        },
        "node": nodes,
        "cpu_uring_over_pread": cpu,
        "targets": targets,
        "verified": verified,
    });
    Ok(json!({"mode": "l2", "verified": verified, "l2": l2}))
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_hit_the_object_size() {
        for (spec, bytes) in [
            ("256KiB", 256u64 << 10),
            ("2MiB", 2 << 20),
            ("32MiB", 32 << 20),
            ("qwen2.5-0.5b", 3 << 20),
            ("llama3-8b", 32 << 20),
            ("3200KiB", 3200 << 10),
        ] {
            let (b, l, h) = layout_for(spec).unwrap();
            assert_eq!(b, bytes);
            assert_eq!(2 * u64::from(l) * 256 * u64::from(h) * 2, bytes, "{spec}");
        }
        assert_eq!(layout_for("llama3-8b").unwrap(), (32 << 20, 32, 1024));
        assert!(layout_for("100KiB").is_err());
        assert!(layout_for("0").is_err());
    }

    #[test]
    fn payload_catches_misplaced_pages() {
        let mut p = Payload::new(64 << 10);
        let a = [1u8; 32];
        let b = [2u8; 32];
        let obj_a = p.object(&a).to_vec();
        assert!(p.check(&a, &obj_a));
        assert!(!p.check(&b, &obj_a));
        let obj_b = p.object(&b).to_vec();
        assert!(p.check(&b, &obj_b));
        let mut swapped = obj_a.clone();
        swapped[..4096].copy_from_slice(&obj_a[4096..8192]);
        assert!(!p.check(&a, &swapped));
        let mut flipped = obj_a;
        flipped[40_000] ^= 1;
        assert!(!p.check(&a, &flipped));
    }
}
