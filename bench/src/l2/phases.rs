//! The node's phases of `kvnode-bench l2`, per engine: write-behind, cold read with its
//! paired raw reads, and the restarts after a clean stop and after a crash.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvnode::client::{ChunkRangeBuilder, Client};
use kvnode::hashing::ChunkHash;
use kvnode::protocol::RegisterRequest;
use kvnode_hw::EngineKind;
use serde_json::{json, Value};

use super::{ratio, Payload, CHUNK_TOKENS, MODEL, STALL};
use crate::disk::{self, cpu_per_gb, gbps, RawFile};
use crate::node::SpawnedNode;

/// Everything one node engine's phases need.
pub(super) struct NodePlan<'a> {
    pub(super) engine: EngineKind,
    pub(super) bin: Option<&'a Path>,
    pub(super) dir: PathBuf,
    pub(super) pool_size: String,
    pub(super) l2_size: u64,
    pub(super) extra: &'a [String],
    pub(super) object_bytes: u64,
    pub(super) layers: u32,
    pub(super) hidden: u32,
    pub(super) hashes: &'a [ChunkHash],
    pub(super) batch: usize,
    pub(super) poll: Duration,
    pub(super) ticks: f64,
    /// Engine of the raw reads interleaved with the node's L2 reads.
    pub(super) paired_engine: EngineKind,
    pub(super) raw_queue_depth: u32,
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
                physical_slots: None,
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
    pub(super) fn run(&self, payload: &mut Payload) -> Result<Value, String> {
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
