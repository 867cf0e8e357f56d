//! Workload definitions and the per-instance driver: one simulated engine instance with its own
//! connection and registration, storing and retrieving chunks through the public client library
//! exactly as an engine would: locally prepare, copy into/out of the shared pool, commit;
//! remotely (`--remote`) prepare, then WRITE_SLOTS / READ_SLOTS (the node moves the bytes over
//! TCP and commits in the same call).

use std::time::{Duration, Instant};

use kvnode::client::ChunkRangeBuilder;
use kvnode::hashing::{chunk_hashes, ChunkHash};
use kvnode::protocol::{ChunkRange, RegisterRequest};
use serde::{Deserialize, Serialize};

use crate::conn::{ensure_buffers, Conn, RemoteTarget};

#[path = "workload_io.rs"]
mod io;
use crate::payload::{splitmix64, Payload};
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
    /// Node socket (unused when `remote` is set).
    pub socket: String,
    /// The node over TCP instead of its socket.
    #[serde(default)]
    pub remote: Option<RemoteTarget>,
    /// Instance id (unique per instance and process; it names the registration, not the keys).
    pub instance_id: u64,
    /// Index of this instance in the run (0-based); hashed into its keys.
    pub index: u32,
    /// The run's nonce, shared by all its instances (threads or processes): hashed into every key,
    /// so runs with different nonces never share keys, and instances of one run (different
    /// `index`) never share keys either.
    pub run_nonce: u64,
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
    /// Bytes the node moved over TCP for this instance in every phase (fill, warm-up, timed,
    /// read-back): WRITE_SLOTS and READ_SLOTS trailers. Zero for a local instance.
    pub moved_bytes: u64,
    /// Chunks verified byte for byte.
    pub verified_chunks: u64,
    /// Chunks whose bytes differed (must be 0).
    pub corrupt_chunks: u64,
    /// Chunks of stores (every phase) that PREPARE_STORE did not hand out a slot for: already
    /// held by the node or in flight from another writer (deduplicated), or no room.
    pub store_skipped_chunks: u64,
    /// Measured length of the timed phase (all instances start it together): its wall time minus
    /// the harness's own work in it (`verify_time` + `payload_time`).
    pub elapsed: Duration,
    /// Time of the timed phase spent verifying retrieved bytes (the harness's work, not the
    /// engine's; excluded from `elapsed` and from the latencies).
    pub verify_time: Duration,
    /// Time of the timed phase spent generating the payloads to store from their keys (the
    /// harness's work: an engine already holds its KV; excluded like `verify_time`).
    pub payload_time: Duration,
}

/// Chunks re-read and verified after the timed phase (so every workload proves its data).
const RECENT_CHUNKS: usize = 16;

/// Key domains: multiturn conversations never share keys with the single-chunk conversations of
/// the store, retrieve and mixed workloads (which do share keys with each other under one nonce).
#[derive(Debug, Clone, Copy)]
pub enum Domain {
    /// Single-chunk conversations (store, retrieve, mixed), numbered per instance from 0.
    Chunk = 1,
    /// Multiturn conversations, numbered per instance from 0 up to its working set.
    Multiturn = 2,
}

/// The 64-bit seed of conversation `conv` of instance `index` in the run `nonce`. For fixed
/// `nonce`, `domain` and `index` it is a bijection of `conv` (no two conversations of an instance
/// collide); other instances and runs collide only by chance.
pub fn conversation_seed(nonce: u64, index: u32, domain: Domain, conv: u64) -> u64 {
    // Each input is XORed into an already mixed value, so small nonces, domains, indices and
    // numbers cannot cancel each other out (nonce 1 in one domain is not nonce 2 in another).
    let run = splitmix64(splitmix64(nonce) ^ domain as u64);
    let instance = splitmix64(run ^ u64::from(index));
    splitmix64(instance ^ conv)
}

/// The first `n` tokens of the conversation with `seed`: tokens 0 and 1 are the seed's halves
/// (so with chunks of at least 2 tokens the first chunk hash alone identifies the seed), the rest
/// pseudo-random. A longer conversation extends a shorter one (multiturn prefixes).
pub fn conversation_tokens(seed: u64, n: u32) -> Vec<u32> {
    (0..u64::from(n))
        .map(|j| match j {
            0 => seed as u32,
            1 => (seed >> 32) as u32,
            _ => splitmix64(seed.wrapping_add(j)) as u32,
        })
        .collect()
}

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
    client: Conn,
    chunk_tokens: u32,
    chunk_bytes: usize,
    /// Every chunk's bytes, a function of its key only (so any reader can verify any chunk).
    payload: Payload,
    /// The engine's private KV source: the payload of the chunk being stored.
    source: Vec<u8>,
    /// Private destination for retrieves.
    dest: Vec<u8>,
    /// Remote stores: one source per slot of a transfer (the node reads them all in one call).
    sources: Vec<Vec<u8>>,
    /// Remote retrieves: one destination per slot of a transfer.
    dests: Vec<Vec<u8>>,
    rng: Rng,
    next_conv: u64,
    stored: Vec<ChunkHash>,
    /// The last chunks this instance wrote (re-read and verified after the timed phase).
    recent: std::collections::VecDeque<ChunkHash>,
    result: InstanceResult,
    timing: bool,
    /// Time spent verifying bytes (excluded from measurements).
    verify_time: Duration,
    /// Time spent generating payloads to store (excluded from measurements).
    payload_time: Duration,
}

impl Instance {
    /// Connects and registers.
    pub fn connect(spec: InstanceSpec) -> Result<Instance, String> {
        let name = format!("kvnode-bench instance {}", spec.index);
        let mut client = Conn::connect(&spec.socket, spec.remote.as_ref(), &name)?;
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
                physical_slots: None,
            })
            .map_err(|e| format!("register: {e}"))?;
        let chunk_bytes = usize::try_from(reg.object_bytes)
            .map_err(|_| format!("{}-byte objects do not fit in memory", reg.object_bytes))?;
        let rng = Rng(spec.seed | 1);
        Ok(Instance {
            chunk_tokens: reg.chunk_tokens,
            chunk_bytes,
            dest: vec![0u8; chunk_bytes],
            sources: Vec::new(),
            dests: Vec::new(),
            source: vec![0u8; chunk_bytes],
            payload: Payload::new(chunk_bytes),
            client,
            rng,
            next_conv: 0,
            stored: Vec::new(),
            recent: std::collections::VecDeque::new(),
            result: InstanceResult::default(),
            timing: false,
            verify_time: Duration::ZERO,
            payload_time: Duration::ZERO,
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

    /// Hashes of the first `chunks` chunks of this instance's conversation `conv` in `domain`.
    fn conversation(&self, domain: Domain, conv: u64, chunks: u32) -> Vec<ChunkHash> {
        let seed = conversation_seed(self.spec.run_nonce, self.spec.index, domain, conv);
        let tokens = conversation_tokens(seed, chunks * self.chunk_tokens);
        chunk_hashes(&tokens, self.chunk_tokens)
    }

    /// Hashes of a fresh single-chunk-domain conversation of `chunks` chunks (the next number).
    fn new_conversation(&mut self, chunks: u32) -> Vec<ChunkHash> {
        let conv = self.next_conv;
        self.next_conv += 1;
        self.conversation(Domain::Chunk, conv, chunks)
    }

    fn range(&self, first_chunk: u32, hashes: Vec<ChunkHash>) -> ChunkRange {
        ChunkRangeBuilder::worker(&self.model(), 1, 0).hashes(first_chunk, hashes)
    }

    /// Stores `hashes` (chunks `first..`): prepare, copy the missing ones, commit. Generating a
    /// chunk's payload is the harness's work: it is timed apart and kept out of the latencies.
    fn store(&mut self, first: u32, hashes: &[ChunkHash]) -> Result<(), String> {
        let id = self.spec.instance_id;
        let range = self.range(first, hashes.to_vec());
        let t0 = Instant::now();
        let p = self
            .client
            .prepare_store(id, &range)
            .map_err(|e| format!("prepare_store: {e}"))?;
        self.record(Op::PrepareStore, t0);
        if p.slots.len() != p.chunk_indices.len() || p.slots.len() > hashes.len() {
            return Err(format!(
                "prepare_store: {} slots and {} chunk indices for {} chunks",
                p.slots.len(),
                p.chunk_indices.len(),
                hashes.len()
            ));
        }
        if self.client.is_remote() {
            ensure_buffers(&mut self.sources, p.slots.len(), self.chunk_bytes);
        }
        let mut generating = Duration::ZERO;
        for (k, (slot, &i)) in p.slots.iter().zip(&p.chunk_indices).enumerate() {
            let h = hashes.get(i as usize).ok_or_else(|| {
                format!(
                    "prepare_store: chunk index {i} of a {}-chunk range",
                    hashes.len()
                )
            })?;
            if slot.length != self.chunk_bytes as u64 {
                return Err(format!(
                    "prepare_store: a {}-byte slot for {}-byte chunks",
                    slot.length, self.chunk_bytes
                ));
            }
            let g = Instant::now();
            match &self.client {
                Conn::Local(c) => {
                    let pool = c.pool().ok_or("no pool mapped")?;
                    self.payload.fill(h, &mut self.source);
                    generating += g.elapsed();
                    pool.write_at(slot.offset, &self.source)
                        .map_err(|e| e.to_string())?;
                }
                // The node reads every slot's bytes in one WRITE_SLOTS below.
                Conn::Remote(_) => {
                    self.payload.fill(h, &mut self.sources[k]);
                    generating += g.elapsed();
                }
            }
        }
        self.payload_time += generating;
        self.result.store_skipped_chunks += (hashes.len() - p.slots.len()) as u64;
        // Every chunk of the range is on the node after the commit, whoever wrote it (chunks
        // the node skipped were already held or in flight elsewhere): re-read them all later.
        for h in hashes {
            if self.recent.len() == RECENT_CHUNKS {
                self.recent.pop_front();
            }
            self.recent.push_back(*h);
        }
        if !p.slots.is_empty() {
            let t1 = Instant::now();
            match &mut self.client {
                Conn::Local(c) => {
                    c.commit_store(id, p.transfer_id)
                        .map_err(|e| format!("commit_store: {e}"))?;
                    self.record(Op::CommitStore, t1);
                }
                Conn::Remote(c) => {
                    let data: Vec<&[u8]> = self.sources[..p.slots.len()]
                        .iter()
                        .map(Vec::as_slice)
                        .collect();
                    let (bytes, _) = c
                        .write_slots(id, p.transfer_id, &data, true)
                        .map_err(|e| format!("write_slots: {e}"))?;
                    self.result.moved_bytes += bytes;
                    self.record(Op::WriteSlots, t1);
                }
            }
        }
        if self.timing {
            self.result
                .hist
                .record(Op::Store, t0.elapsed().saturating_sub(generating));
        }
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
        let (bad, checked) = if self.client.is_remote() {
            self.read_remote(id, &p, hashes)?
        } else {
            self.read_local(id, &p, hashes)?
        };
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
        let hashes = self.conversation(Domain::Multiturn, c, chunks);
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
        self.payload_time = Duration::ZERO;
        let start = Instant::now();
        // The measured time: wall time minus the harness's own work (verification, payloads).
        let measured = |i: &Instance| {
            start
                .elapsed()
                .saturating_sub(i.verify_time + i.payload_time)
        };
        let budget = Duration::from_millis(self.spec.duration_ms);
        let mut n = 0;
        loop {
            match self.spec.ops {
                Some(max) if n >= max => break,
                None if measured(&self) >= budget => break,
                _ => {}
            }
            self.one_op(n)?;
            n += 1;
            progress(n);
        }
        self.result.elapsed = measured(&self);
        self.result.verify_time = self.verify_time;
        self.result.payload_time = self.payload_time;
        self.result.ops = n;
        self.timing = false;
        if self.spec.verify {
            // Read back the last chunks this instance stored (written by it, or already held by
            // the node), whatever was not evicted; untimed.
            let recent: Vec<ChunkHash> = self.recent.iter().copied().collect();
            for h in recent {
                self.retrieve(0, &[h], None)?;
            }
        }
        let _ = self.client.unregister(self.spec.instance_id);
        Ok(self.result)
    }
}

#[cfg(test)]
#[path = "workload_tests.rs"]
mod tests;
