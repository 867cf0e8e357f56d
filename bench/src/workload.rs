//! Workload definitions and the per-instance driver: one simulated engine instance with its own
//! connection and registration, storing and retrieving chunks through the public client library
//! exactly as an engine would (prepare, copy into/out of the shared pool, commit).

use std::time::{Duration, Instant};

use kvnode::client::{ChunkRangeBuilder, Client};
use kvnode::hashing::{chunk_hashes, ChunkHash};
use kvnode::protocol::{ChunkRange, RegisterRequest};
use serde::{Deserialize, Serialize};

use crate::stats::{Op, OpHistograms};

/// A model layout preset (or an explicit layout). Object bytes = 2 x layers x chunk x hidden x itemsize.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LayoutSpec {
    /// Preset name or "custom".
    pub name: String,
    /// Layers.
    pub layers: u32,
    /// `num_kv_heads * head_dim`.
    pub hidden: u32,
    /// PyTorch dtype name.
    pub dtype: String,
    /// Tokens per chunk.
    pub chunk_tokens: u32,
}

impl LayoutSpec {
    /// The named preset: `tiny` (16 KiB chunks, latency-bound), `qwen2.5-0.5b` (3 MiB),
    /// `llama3-8b` (32 MiB).
    pub fn preset(name: &str) -> Option<LayoutSpec> {
        let (layers, hidden, dtype, chunk_tokens) = match name {
            "tiny" => (2, 128, "float16", 16),
            "qwen2.5-0.5b" => (24, 128, "bfloat16", 256),
            "llama3-8b" => (32, 1024, "bfloat16", 256),
            _ => return None,
        };
        Some(LayoutSpec {
            name: name.into(),
            layers,
            hidden,
            dtype: dtype.into(),
            chunk_tokens,
        })
    }

    /// Bytes per element of the dtype.
    pub fn item_bytes(&self) -> Option<u64> {
        kvnode::storage::Dtype::parse(&self.dtype)
            .ok()
            .map(|d| d.item_bytes())
    }

    /// Bytes of one chunk object (K and V planes).
    pub fn chunk_bytes(&self) -> u64 {
        2 * u64::from(self.layers)
            * u64::from(self.chunk_tokens)
            * u64::from(self.hidden)
            * self.item_bytes().unwrap_or(2)
    }
}

/// Which operations a run issues.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum WorkloadKind {
    /// New chunks only.
    Store,
    /// Fill the working set, then read random chunks of it.
    Retrieve,
    /// Reads of stored chunks with probability `hit_ratio`, new stores otherwise.
    Mixed,
    /// Conversations that extend a prefix: LOOKUP, RETRIEVE of the hit prefix, STORE of the new chunks.
    Multiturn,
}

/// Everything one instance needs (serialisable: `--processes` hands it to a child process).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InstanceSpec {
    /// Node socket.
    pub socket: String,
    /// Instance id (unique per instance).
    pub instance_id: u64,
    /// Index of this instance in the run (0-based).
    pub index: u32,
    /// Layout.
    pub layout: LayoutSpec,
    /// Workload.
    pub workload: WorkloadKind,
    /// Read probability for `mixed`.
    pub hit_ratio: f64,
    /// Timed operations to run (None: until `duration_ms`).
    pub ops: Option<u64>,
    /// Time budget in milliseconds (used when `ops` is None).
    pub duration_ms: u64,
    /// Untimed operations first.
    pub warmup: u64,
    /// Chunks in this instance's working set (retrieve/mixed) or conversations (multiturn).
    pub working_set_chunks: u64,
    /// Chunks a multiturn turn appends.
    pub turn_chunks: u32,
    /// Turns per multiturn conversation.
    pub turns: u32,
    /// Verify every retrieved byte.
    pub verify: bool,
    /// Seed for the random choices.
    pub seed: u64,
}

/// What one instance reports.
#[derive(Debug, Default)]
pub struct InstanceResult {
    /// Timed operations completed.
    pub ops: u64,
    /// Latencies per operation.
    pub hist: OpHistograms,
    /// Bytes copied into the pool by timed stores.
    pub stored_bytes: u64,
    /// Bytes copied out of the pool by timed retrieves.
    pub retrieved_bytes: u64,
    /// Retrieves that hit.
    pub hits: u64,
    /// Retrieves that missed (evicted or never stored).
    pub misses: u64,
    /// Chunks verified byte for byte.
    pub verified_chunks: u64,
    /// Chunks whose bytes differed (must be 0).
    pub corrupt_chunks: u64,
    /// Wall time of the timed phase (all instances start it together).
    pub elapsed: Duration,
    /// Part of `elapsed` spent verifying bytes (the harness's work, not the engine's).
    pub verify_time: Duration,
}

/// Chunks re-read and verified after the timed phase (so every workload proves its data).
const RECENT_CHUNKS: usize = 16;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

/// The simulated engine instance.
pub struct Instance {
    spec: InstanceSpec,
    client: Client,
    chunk_tokens: u32,
    chunk_bytes: usize,
    /// The engine's private KV source (pattern); each stored chunk is this with its hash stamped
    /// in the first 32 bytes, so any reader can verify it.
    source: Vec<u8>,
    /// Private destination for retrieves.
    dest: Vec<u8>,
    rng: Rng,
    next_conv: u64,
    stored: Vec<ChunkHash>,
    /// The last chunks this instance wrote (re-read and verified after the timed phase).
    recent: std::collections::VecDeque<ChunkHash>,
    result: InstanceResult,
    timing: bool,
    /// Time spent verifying bytes (excluded from measurements).
    verify_time: Duration,
}

impl Instance {
    /// Connects and registers.
    pub fn connect(spec: InstanceSpec) -> Result<Instance, String> {
        let mut client = Client::connect(&spec.socket).map_err(|e| e.to_string())?;
        let reg = client
            .register(&RegisterRequest {
                instance_id: spec.instance_id,
                model: format!("bench-{}", spec.layout.name),
                world_size: 1,
                block_size: 16,
                num_layers: spec.layout.layers,
                hidden_dim: spec.layout.hidden,
                dtype: spec.layout.dtype.clone(),
                use_mla: false,
            })
            .map_err(|e| format!("register: {e}"))?;
        let chunk_bytes = reg.object_bytes as usize;
        let mut source = vec![0u8; chunk_bytes];
        let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ spec.instance_id;
        for w in source.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_le_bytes()[..w.len()]);
        }
        let rng = Rng(spec.seed | 1);
        Ok(Instance {
            chunk_tokens: reg.chunk_tokens,
            chunk_bytes,
            dest: vec![0u8; chunk_bytes],
            source,
            client,
            rng,
            next_conv: 0,
            stored: Vec::new(),
            recent: std::collections::VecDeque::new(),
            result: InstanceResult::default(),
            timing: false,
            verify_time: Duration::ZERO,
            spec,
        })
    }

    fn record(&mut self, op: Op, t: Instant) {
        if self.timing {
            self.result.hist.record(op, t.elapsed());
        }
    }

    fn model(&self) -> String {
        format!("bench-{}", self.spec.layout.name)
    }

    /// Hashes of a fresh conversation of `chunks` chunks, unique to this instance.
    fn new_conversation(&mut self, chunks: u32) -> Vec<ChunkHash> {
        let conv = self.next_conv;
        self.next_conv += 1;
        let base = (self.spec.instance_id << 40) ^ (conv << 20);
        let tokens: Vec<u32> = (0..chunks * self.chunk_tokens)
            .map(|i| (base.wrapping_add(u64::from(i)) as u32) ^ (base >> 32) as u32)
            .collect();
        chunk_hashes(&tokens, self.chunk_tokens)
    }

    fn range(&self, first_chunk: u32, hashes: Vec<ChunkHash>) -> ChunkRange {
        ChunkRangeBuilder::worker(&self.model(), 1, 0).hashes(first_chunk, hashes)
    }

    /// Stores `hashes` (chunks `first..`): prepare, copy the missing ones, commit.
    fn store(&mut self, first: u32, hashes: &[ChunkHash]) -> Result<(), String> {
        let id = self.spec.instance_id;
        let range = self.range(first, hashes.to_vec());
        let t0 = Instant::now();
        let p = self
            .client
            .prepare_store(id, &range)
            .map_err(|e| format!("prepare_store: {e}"))?;
        self.record(Op::PrepareStore, t0);
        let pool = self.client.pool().ok_or("no pool mapped")?;
        for (slot, &i) in p.slots.iter().zip(&p.chunk_indices) {
            pool.write_at(slot.offset, &self.source)
                .map_err(|e| e.to_string())?;
            pool.write_at(slot.offset, &hashes[i as usize])
                .map_err(|e| e.to_string())?;
        }
        for &i in &p.chunk_indices {
            if self.recent.len() == RECENT_CHUNKS {
                self.recent.pop_front();
            }
            self.recent.push_back(hashes[i as usize]);
        }
        if !p.slots.is_empty() {
            let t1 = Instant::now();
            self.client
                .commit_store(id, p.transfer_id)
                .map_err(|e| format!("commit_store: {e}"))?;
            self.record(Op::CommitStore, t1);
        }
        self.record(Op::Store, t0);
        if self.timing {
            self.result.stored_bytes += p.slots.len() as u64 * self.chunk_bytes as u64;
        }
        Ok(())
    }

    /// Retrieves `hashes`; returns whether it hit. Verifies every byte after the commit.
    fn retrieve(
        &mut self,
        first: u32,
        hashes: &[ChunkHash],
        lookup_session: Option<&str>,
    ) -> Result<bool, String> {
        let id = self.spec.instance_id;
        let range = self.range(first, hashes.to_vec());
        let verify_before = self.verify_time;
        let t0 = Instant::now();
        let p = self
            .client
            .prepare_retrieve(id, &range, lookup_session)
            .map_err(|e| format!("prepare_retrieve: {e}"))?;
        self.record(Op::PrepareRetrieve, t0);
        let Some(p) = p else {
            self.result.misses += u64::from(self.timing);
            return Ok(false);
        };
        if p.slots.len() != hashes.len() {
            return Err(format!(
                "retrieve hit with {} slots for {} chunks",
                p.slots.len(),
                hashes.len()
            ));
        }
        let pool = self.client.pool().ok_or("no pool mapped")?;
        let mut bad = 0;
        let mut checked = 0;
        for (slot, h) in p.slots.iter().zip(hashes) {
            pool.read_at(slot.offset, &mut self.dest)
                .map_err(|e| e.to_string())?;
            if self.spec.verify {
                // Verification is the harness's work, not the engine's: it is kept out of the
                // measured time (the retrieve latency and the goodput).
                let v = Instant::now();
                checked += 1;
                if self.dest[..32] != h[..] || self.dest[32..] != self.source[32..] {
                    bad += 1;
                }
                self.verify_time += v.elapsed();
            }
        }
        let t1 = Instant::now();
        self.client
            .commit_retrieve(id, p.transfer_id)
            .map_err(|e| format!("commit_retrieve: {e}"))?;
        self.record(Op::CommitRetrieve, t1);
        if self.timing {
            let verifying = self.verify_time - verify_before;
            self.result
                .hist
                .record(Op::Retrieve, t0.elapsed().saturating_sub(verifying));
        }
        if self.timing {
            self.result.retrieved_bytes += p.slots.len() as u64 * self.chunk_bytes as u64;
            self.result.hits += 1;
        }
        self.result.verified_chunks += checked;
        self.result.corrupt_chunks += bad;
        Ok(true)
    }

    fn ping(&mut self) -> Result<(), String> {
        let t = Instant::now();
        self.client
            .ping(Some(self.spec.instance_id))
            .map_err(|e| format!("ping: {e}"))?;
        self.record(Op::Ping, t);
        Ok(())
    }

    fn fill(&mut self) -> Result<(), String> {
        while (self.stored.len() as u64) < self.spec.working_set_chunks {
            let h = self.new_conversation(1);
            self.store(0, &h)?;
            self.stored.push(h[0]);
        }
        Ok(())
    }

    fn one_op(&mut self, n: u64) -> Result<(), String> {
        if n.is_multiple_of(16) {
            self.ping()?;
        }
        match self.spec.workload {
            WorkloadKind::Store => {
                let h = self.new_conversation(1);
                self.store(0, &h)
            }
            WorkloadKind::Retrieve => {
                let i = self.rng.below(self.stored.len() as u64) as usize;
                let h = [self.stored[i]];
                self.retrieve(0, &h, None).map(drop)
            }
            WorkloadKind::Mixed => {
                if !self.stored.is_empty() && self.rng.chance(self.spec.hit_ratio) {
                    let i = self.rng.below(self.stored.len() as u64) as usize;
                    let h = [self.stored[i]];
                    self.retrieve(0, &h, None).map(drop)
                } else {
                    let h = self.new_conversation(1);
                    self.store(0, &h)?;
                    if (self.stored.len() as u64) < self.spec.working_set_chunks.max(1) {
                        self.stored.push(h[0]);
                    } else {
                        let i = self.rng.below(self.stored.len() as u64) as usize;
                        self.stored[i] = h[0];
                    }
                    Ok(())
                }
            }
            WorkloadKind::Multiturn => self.turn(),
        }
    }

    /// One multiturn turn, as vLLM does: LOOKUP the whole prompt (scheduler), RETRIEVE the hit
    /// prefix relying on the lookup's locks, FREE the locks of chunks not retrieved, STORE the new
    /// chunks, END_SESSION. A conversation grows by `turn_chunks` per turn for `turns` turns.
    fn turn(&mut self) -> Result<(), String> {
        let convs = self.spec.working_set_chunks.max(1);
        let c = self.rng.below(convs);
        let turn = (self.rng.next() % u64::from(self.spec.turns.max(1))) as u32 + 1;
        let chunks = turn * self.spec.turn_chunks.max(1);
        let base = (self.spec.instance_id << 40) ^ (c << 20) ^ 0xABCD;
        let tokens: Vec<u32> = (0..chunks * self.chunk_tokens)
            .map(|i| (base.wrapping_add(u64::from(i)) as u32) ^ (base >> 32) as u32)
            .collect();
        let hashes = chunk_hashes(&tokens, self.chunk_tokens);
        let req = format!("{}-{c}-{turn}-{}", self.spec.instance_id, self.rng.next());
        let all = ChunkRangeBuilder::all_ranks(&self.model(), 1).hashes(0, hashes.clone());
        let t = Instant::now();
        let hit = self
            .client
            .lookup(&req, &all, 1)
            .map_err(|e| format!("lookup: {e}"))?;
        self.record(Op::Lookup, t);
        let hit = hit.min(chunks);
        if hit > 0 && !self.retrieve(0, &hashes[..hit as usize], Some(&req))? {
            // Evicted between lookup and retrieve cannot happen (locks); a miss here is a bug.
            return Err("retrieve of a locked prefix missed".into());
        }
        if hit < chunks {
            self.store(hit, &hashes[hit as usize..])?;
        }
        // The hit prefix's locks were consumed by the retrieve; free whatever else the lookup holds.
        self.client
            .free_lookup_locks(&req, hit, chunks)
            .map_err(|e| format!("free_lookup_locks: {e}"))?;
        self.client
            .end_session(&req)
            .map_err(|e| format!("end_session: {e}"))?;
        Ok(())
    }

    /// Runs warm-up, waits in `ready` (the start barrier shared by all instances), then the timed
    /// phase; `progress` is called after every timed op.
    pub fn run(
        mut self,
        ready: impl FnOnce(),
        mut progress: impl FnMut(u64),
    ) -> Result<InstanceResult, String> {
        if matches!(
            self.spec.workload,
            WorkloadKind::Retrieve | WorkloadKind::Mixed
        ) {
            self.fill()?;
        }
        for n in 0..self.spec.warmup {
            self.one_op(n)?;
        }
        ready();
        self.timing = true;
        self.verify_time = Duration::ZERO;
        let start = Instant::now();
        let deadline = start + Duration::from_millis(self.spec.duration_ms);
        let mut n = 0;
        loop {
            match self.spec.ops {
                Some(max) if n >= max => break,
                None if Instant::now() >= deadline => break,
                _ => {}
            }
            self.one_op(n)?;
            n += 1;
            progress(n);
        }
        self.result.elapsed = start.elapsed();
        self.result.verify_time = self.verify_time;
        self.result.ops = n;
        self.timing = false;
        if self.spec.verify {
            // Read back what this instance wrote last (whatever was not evicted), untimed.
            let recent: Vec<ChunkHash> = self.recent.iter().copied().collect();
            for h in recent {
                self.retrieve(0, &[h], None)?;
            }
        }
        let _ = self.client.unregister(self.spec.instance_id);
        Ok(self.result)
    }
}
