//! `kvnode-bench l2-killloop`: the kill loop over the L2 disk tier. One `kvnode serve` with a small
//! pool and a disk tier on a private directory; every iteration a client stores objects whose
//! bytes are a function of their key, the node is SIGKILLed at a random moment while its
//! write-behind is busy (in the `--clear` variant: around a CLEAR), restarted on the same
//! directory, and every key ever stored is retrieved: each object served must carry exactly the
//! bytes of its key, and after a CLEAR that returned nothing stored before it may be served
//! again, ever. One summary line on stdout (`L2-KILLLOOP: ...`); exit status non-zero on any
//! wrong byte, resurrected object, MEMCHECK failure or node failure. See bench/README.md.

use std::collections::HashSet;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvnode::client::{ChunkRangeBuilder, Client};
use kvnode::error::ErrorKind;
use kvnode::hashing::ChunkHash;
use kvnode::l2::format::{payload_checksum, SlotHeader, BLOCK, EXTENT_BASE, SLOT_MAGIC};
use kvnode::protocol::{ChunkRange, RegisterRequest};
use serde_json::{json, Value};

use crate::payload::{splitmix64, Payload};
use crate::soak_worker::SoakRng;

/// Tokens per chunk of the node (`--chunk-size`).
const CHUNK_TOKENS: u32 = 16;
/// The two layouts objects are stored under: (model, layers); [2, layers, 16, hidden] float32,
/// so 64 KiB and 192 KiB objects at the default hidden size of 256 (slot strides of 68 and
/// 196 KiB share the tier's extents).
const MODELS: [(&str, u32); 2] = [("killloop-64k", 2), ("killloop-192k", 6)];
/// Every 4th key is a large object.
const LARGE_EVERY: u64 = 4;
/// Longest wait for one answer of the node (a hung node fails the loop instead of hanging it).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest wait for the node to answer after a start, and for the write-behind to get busy.
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// Block engine of the tier.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    Uring,
    Pread,
    Auto,
}

impl Engine {
    fn as_str(self) -> &'static str {
        match self {
            Engine::Uring => "uring",
            Engine::Pread => "pread",
            Engine::Auto => "auto",
        }
    }
}

/// Tests of the loop itself, applied to the data file between a kill and the restart.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sabotage {
    /// Flip one payload byte of every slot: the node must count them `corrupt` and serve none.
    Corrupt,
    /// Flip one payload byte of every slot and fix its header checksum: the node cannot tell,
    /// serves wrong bytes, and the loop must fail.
    Forge,
}

/// `kvnode-bench l2-killloop` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct KillLoopArgs {
    /// Kill/restart iterations.
    #[arg(long, default_value_t = 10)]
    pub iterations: u32,
    /// Block engine of the node's disk tier (`--l2-engine`).
    #[arg(long, value_enum, default_value = "auto")]
    pub engine: Engine,
    /// The CLEAR variant: each iteration sends a CLEAR while the write-behind is busy and kills
    /// the node at a random moment around it.
    #[arg(long)]
    pub clear: bool,
    /// Directory in which a fresh working directory (data file, socket, node log) is made.
    #[arg(long, default_value = "/var/tmp")]
    pub l2_dir: PathBuf,
    /// `--l2-size` of the node.
    #[arg(long, default_value = "256MiB")]
    pub l2_size: String,
    /// `--pool-size` of the node (small, so objects leave L1 and are served from L2).
    #[arg(long, default_value = "24MiB")]
    pub pool_size: String,
    /// Hidden size of both layouts: objects of 2 x layers (2 or 6) x 16 tokens x hidden x 4
    /// bytes (256: 64 KiB and 192 KiB).
    #[arg(long, default_value_t = 256)]
    pub hidden: u32,
    /// Most objects stored per iteration.
    #[arg(long, default_value_t = 1024)]
    pub max_objects: u64,
    /// Seed of every random choice (default: random; printed and in the JSON).
    #[arg(long)]
    pub seed: Option<u64>,
    /// The `kvnode` binary (default: next to this binary, else on PATH).
    #[arg(long)]
    pub node_bin: Option<PathBuf>,
    /// Also write the results as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Keep the working directory even when the loop passes.
    #[arg(long)]
    pub keep_dir: bool,
    /// Test of the loop itself: damage the data file after one kill (see [`Sabotage`]).
    #[arg(long, value_enum, hide = true)]
    pub sabotage: Option<Sabotage>,
    /// Iteration after whose kill the sabotage happens.
    #[arg(long, hide = true, default_value_t = 2)]
    pub sabotage_iteration: u32,
}

/// One object's identity: the CLEAR epoch it was stored in and its index there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    epoch: u32,
    idx: u64,
}

impl Key {
    fn hash(self, nonce: u64) -> ChunkHash {
        let base = splitmix64(nonce ^ splitmix64((u64::from(self.epoch) << 40) ^ self.idx));
        let mut h = [0u8; 32];
        for (k, w) in h.chunks_mut(8).enumerate() {
            w.copy_from_slice(&splitmix64(base ^ k as u64).to_le_bytes());
        }
        h
    }

    /// Index into [`MODELS`].
    fn model(self) -> usize {
        usize::from(self.idx % LARGE_EVERY == LARGE_EVERY - 1)
    }
}

/// Which keys the storer hands out: every key once, so whatever a restarted node serves can only
/// be what was stored under that key, and every key ever handed out is retrieved after every
/// restart. Invariant: keys `0..issued[e]` of epoch `e` have been (or are being) prepared; the
/// plain variant stays in epoch 0.
struct Keys {
    epoch: u32,
    issued: Vec<u64>,
}

impl Keys {
    fn next(&mut self) -> Key {
        let e = self.epoch as usize;
        let n = self.issued[e];
        self.issued[e] += 1;
        Key {
            epoch: self.epoch,
            idx: n,
        }
    }

    /// Starts a new epoch; returns the old one.
    fn advance(&mut self) -> u32 {
        self.epoch += 1;
        self.issued.push(0);
        self.epoch - 1
    }
}

fn register(c: &mut Client, first_id: u64, hidden: u32) -> Result<[u64; 2], String> {
    let mut ids = [0; 2];
    for (m, (model, layers)) in MODELS.iter().enumerate() {
        ids[m] = first_id + m as u64;
        let r = c
            .register(&RegisterRequest {
                instance_id: ids[m],
                model: (*model).into(),
                world_size: 1,
                block_size: CHUNK_TOKENS,
                num_layers: *layers,
                hidden_dim: hidden,
                dtype: "float32".into(),
                use_mla: false,
            })
            .map_err(|e| format!("register {model}: {e}"))?;
        let want = object_bytes(hidden, m);
        if r.object_bytes != want as u64 {
            return Err(format!(
                "{model}: {} bytes per object, expected {want}",
                r.object_bytes
            ));
        }
    }
    Ok(ids)
}

fn object_bytes(hidden: u32, model: usize) -> usize {
    2 * MODELS[model].1 as usize * CHUNK_TOKENS as usize * hidden as usize * 4
}

fn range(key_hash: ChunkHash, model: usize) -> ChunkRange {
    ChunkRangeBuilder::worker(MODELS[model].0, 1, 0).hashes(0, vec![key_hash])
}

fn connect(socket: &Path) -> Result<Client, String> {
    let mut c = Client::connect_timeout(socket, Duration::from_secs(10))
        .map_err(|e| format!("connect: {e}"))?;
    c.set_timeout(Some(ANSWER_TIMEOUT))
        .map_err(|e| e.to_string())?;
    Ok(c)
}

fn l2(s: &Value, field: &str) -> u64 {
    s["l2"][field].as_u64().unwrap_or(0)
}

/// The node under test. Invariant: killed and reaped on drop if still running.
struct Node {
    child: Child,
    socket: PathBuf,
}

impl Node {
    fn start(a: &KillLoopArgs, bin: &Path, dir: &Path, n: u32) -> Result<Node, String> {
        let socket = dir.join("kvnode.sock");
        let mut log = File::options()
            .create(true)
            .append(true)
            .open(dir.join("node.log"))
            .map_err(|e| format!("node log: {e}"))?;
        let _ = writeln!(log, "=== kvnode-bench l2-killloop: node start {n} ===");
        let child = Command::new(bin)
            .args(["serve", "--socket"])
            .arg(&socket)
            .args(["--pool-size", &a.pool_size])
            .args(["--chunk-size", &CHUNK_TOKENS.to_string()])
            .arg("--l2-path")
            .arg(dir)
            .args(["--l2-size", &a.l2_size, "--l2-engine", a.engine.as_str()])
            .args(["--l2-write-policy", "always"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", bin.display()))?;
        let mut node = Node { child, socket };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if connect(&node.socket)
                .and_then(|mut c| c.noop().map_err(|e| e.to_string()))
                .is_ok()
            {
                return Ok(node);
            }
            if let Ok(Some(st)) = node.child.try_wait() {
                return Err(format!("kvnode exited ({st}) during start-up {n}"));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "kvnode start-up {n}: no answer within {START_TIMEOUT:?}"
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL and reap.
    fn kill(&mut self) -> Result<(), String> {
        if let Ok(Some(st)) = self.child.try_wait() {
            return Err(format!("the node had died before the kill ({st})"));
        }
        self.child.kill().map_err(|e| format!("kill: {e}"))?;
        self.child.wait().map_err(|e| format!("wait: {e}"))?;
        Ok(())
    }

    /// SIGTERM; the node must exit 0 within a minute.
    fn stop(mut self) -> Result<(), String> {
        crate::soak_node::sigterm(self.child.id())?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) if st.success() => return Ok(()),
                Ok(Some(st)) => return Err(format!("the node exited with {st} after SIGTERM")),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Ok(None) => return Err("the node did not exit within 60 s of SIGTERM".into()),
                Err(e) => return Err(format!("waiting for the node: {e}")),
            }
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // Never signal a pid already reaped: it may belong to another process by now.
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// What the storer thread did in one iteration.
#[derive(Default)]
struct Stored {
    /// Keys whose COMMIT_STORE the node acknowledged.
    committed: Vec<Key>,
    /// PREPAREs that found the key present already (nothing to write).
    present: u64,
    /// PREPAREs and COMMITs the node refused while alive (no memory, key busy...).
    refused: u64,
    /// Why the storer stopped before it was told to (the node died under it), if it did.
    lost: Option<String>,
}

/// State the storer shares with the main thread.
struct Shared {
    keys: Mutex<Keys>,
    stop: AtomicBool,
    done: AtomicBool,
}

/// Stores up to `max` objects (one per STORE) until told to stop. Each key is taken and
/// PREPAREd under the keys lock, so once the main thread has advanced the epoch under that lock
/// every PREPARE of an older epoch has been answered (its COMMIT may still be on the way).
fn storer(
    socket: PathBuf,
    first_id: u64,
    max: u64,
    (nonce, hidden): (u64, u32),
    shared: Arc<Shared>,
) -> Stored {
    let mut out = Stored::default();
    let run = |out: &mut Stored| -> Result<(), String> {
        let mut c = connect(&socket)?;
        let ids = register(&mut c, first_id, hidden)?;
        let len = |m| object_bytes(hidden, m);
        let payloads = [Payload::new(len(0)), Payload::new(len(1))];
        let mut bufs = [vec![0u8; len(0)], vec![0u8; len(1)]];
        // Backpressure: at most half of L1 waits for the write-behind (in objects of the larger
        // size's two thirds, a little more than the mean), counted both as unwritten objects and as entries of the
        // write queue (which still holds objects evicted before their turn), so the writer stays
        // busy without L1 evicting most objects before their turn.
        let capacity = c.status().map_err(|e| format!("status: {e}"))?["capacity_bytes"]
            .as_u64()
            .unwrap_or(0);
        let bound = (capacity / 2 / (len(1) as u64 * 2 / 3)).max(4);
        let mut stored = 0;
        while !shared.stop.load(Ordering::Relaxed) && stored < max {
            if stored % 8 == 0 {
                loop {
                    let s = c.status().map_err(|e| format!("status: {e}"))?;
                    let unwritten = s["objects"]["unwritten"].as_u64().unwrap_or(0);
                    let waiting = unwritten.max(l2(&s, "queued"));
                    if waiting <= bound || shared.stop.load(Ordering::Relaxed) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            let (key, p) = {
                let mut keys = shared.keys.lock().unwrap();
                let key = keys.next();
                let m = key.model();
                (key, c.prepare_store(ids[m], &range(key.hash(nonce), m)))
            };
            stored += 1;
            let m = key.model();
            let p = match p {
                Ok(p) => p,
                Err(e) if e.kind == ErrorKind::Io => return Err(format!("prepare_store: {e}")),
                Err(_) => {
                    out.refused += 1;
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
            };
            if p.slots.is_empty() {
                out.present += 1;
                continue;
            }
            payloads[m].fill(&key.hash(nonce), &mut bufs[m]);
            let pool = c.pool().ok_or("no pool mapped")?;
            pool.write_at(p.slots[0].offset, &bufs[m])
                .map_err(|e| format!("copy into the pool: {e}"))?;
            match c.commit_store(ids[m], p.transfer_id) {
                Ok(_) => out.committed.push(key),
                Err(e) if e.kind == ErrorKind::Io => return Err(format!("commit_store: {e}")),
                Err(_) => out.refused += 1,
            }
        }
        Ok(())
    };
    if let Err(e) = run(&mut out) {
        // An error after the main thread decided to kill is the kill.
        if !shared.stop.load(Ordering::Relaxed) {
            out.lost = Some(e);
        }
    }
    shared.done.store(true, Ordering::Relaxed);
    out
}

/// Damages every slot of the data file (see [`Sabotage`]); returns how many slots. Takes the
/// file's lock first, as a node does, so the killed node's last I/O has landed.
fn sabotage(path: &Path, kind: Sabotage) -> Result<u64, String> {
    let err = |e: std::io::Error| format!("sabotage of {}: {e}", path.display());
    let file = File::options()
        .read(true)
        .write(true)
        .open(path)
        .map_err(err)?;
    kvnode_hw::lock_exclusive(&file, Duration::from_secs(60)).map_err(|e| e.to_string())?;
    let bytes = std::fs::read(path).map_err(err)?;
    let mut n = 0;
    let mut off = EXTENT_BASE as usize;
    while off + BLOCK <= bytes.len() {
        let block = &bytes[off..off + BLOCK];
        if block[..8] != SLOT_MAGIC.to_le_bytes() {
            off += BLOCK;
            continue;
        }
        let Ok(mut h) = SlotHeader::decode(block) else {
            off += BLOCK;
            continue;
        };
        let start = off + BLOCK;
        let end = start + h.object_len as usize;
        if h.file_offset != off as u64 || end > bytes.len() {
            off += BLOCK;
            continue;
        }
        let mut payload = bytes[start..end].to_vec();
        let at = payload.len() / 2;
        payload[at] ^= 0x5a;
        file.write_all_at(&payload[at..at + 1], (start + at) as u64)
            .map_err(err)?;
        if kind == Sabotage::Forge {
            h.payload_checksum = payload_checksum(&payload);
            let mut hb = vec![0u8; BLOCK];
            h.encode(&mut hb).map_err(|e| e.to_string())?;
            file.write_all_at(&hb, off as u64).map_err(err)?;
        }
        n += 1;
        off = end.div_ceil(BLOCK) * BLOCK;
    }
    file.sync_data().map_err(err)?;
    Ok(n)
}

/// What the data file holds right after a kill, judged as recovery will (see [`scan`]).
#[derive(Default, Clone, Copy, Debug)]
struct Scan {
    /// Slot headers recovery will index: current format, extent epoch and offset, newest copy
    /// of their key.
    live: u64,
    /// ...whose payload fails the header's checksum (recovery indexes them; the first load
    /// counts them `corrupt`).
    torn: u64,
    /// ...of them, the payload starts with another key (a slot reused: the evicted object's
    /// header still on disk over the new object's payload, written first).
    torn_other_key: u64,
    /// ...the payload starts with the header's own key (the same object, partly written).
    torn_same_key: u64,
}

/// Reads the data file as recovery does (superblock, extent headers, slot headers) and checks
/// every payload recovery would index against its header's checksum. Takes the file's lock
/// first, as a node does, so the killed node's last I/O has landed.
fn scan(path: &Path) -> Result<Scan, String> {
    use kvnode::l2::format::{
        extent_count, extent_offset, slot_offset, slots_per_extent, ExtentHeader, Superblock,
        SUPERBLOCK_OFFSETS,
    };
    let file = File::open(path).map_err(|e| format!("scan of {}: {e}", path.display()))?;
    kvnode_hw::lock_exclusive(&file, Duration::from_secs(60)).map_err(|e| e.to_string())?;
    let bytes = std::fs::read(path).map_err(|e| format!("scan of {}: {e}", path.display()))?;
    let block = |off: u64| bytes.get(off as usize..off as usize + BLOCK);
    let Some(sb) = SUPERBLOCK_OFFSETS
        .iter()
        .filter_map(|&o| block(o).and_then(|b| Superblock::decode(b).ok()))
        .max_by_key(|sb| sb.update)
    else {
        return Ok(Scan::default());
    };
    // Newest copy per key (hash, rank, group, model, salt).
    type SlotKey = (ChunkHash, u32, u32, String, String);
    let mut newest: std::collections::HashMap<SlotKey, SlotHeader> =
        std::collections::HashMap::new();
    for e in 0..extent_count(sb.file_bytes, sb.extent_bytes) {
        let Some(Ok(eh)) = block(extent_offset(sb.extent_bytes, e)).map(ExtentHeader::decode)
        else {
            continue;
        };
        if eh.format_id != sb.format_id || eh.extent_index != e {
            continue;
        }
        for j in 0..slots_per_extent(sb.extent_bytes, eh.stride) {
            let off = slot_offset(sb.extent_bytes, e, eh.stride, j);
            let Some(Ok(h)) = block(off).map(SlotHeader::decode) else {
                continue;
            };
            if h.format_id != sb.format_id || h.extent_epoch != eh.epoch || h.file_offset != off {
                continue;
            }
            let key = (
                h.chunk_hash,
                h.kv_rank,
                h.object_group,
                h.model.clone(),
                h.cache_salt.clone(),
            );
            if newest.get(&key).is_none_or(|old| old.seq < h.seq) {
                newest.insert(key, h);
            }
        }
    }
    let mut out = Scan::default();
    for h in newest.values() {
        out.live += 1;
        let start = (h.file_offset + BLOCK as u64) as usize;
        let payload = bytes
            .get(start..start + h.object_len as usize)
            .unwrap_or(&[]);
        if payload.len() as u64 == h.object_len && payload_checksum(payload) == h.payload_checksum {
            continue;
        }
        out.torn += 1;
        match payload.get(..32) {
            Some(k) if k == h.chunk_hash => out.torn_same_key += 1,
            Some(k) if k.iter().any(|&b| b != 0) => out.torn_other_key += 1,
            _ => {}
        }
    }
    Ok(out)
}

/// Figures of one iteration.
#[derive(Default, Clone)]
struct Iter {
    kill_target_writes: u64,
    writes_at_kill: u64,
    queued_at_kill: u64,
    unwritten_at_kill: u64,
    /// The node's STATUS at the last poll before the kill: its `l2` object and eviction counters.
    status_at_kill: Value,
    busy: bool,
    kill_delay_us: u64,
    committed: u64,
    present: u64,
    refused: u64,
    clear: Option<ClearOutcome>,
    sabotaged_slots: Option<u64>,
    scan: Scan,
    recovered: u64,
    served: u64,
    served_committed: u64,
    /// Committed in this iteration, not served, and not dropped by a CLEAR that returned.
    missing: u64,
    /// Committed in this iteration and dropped by a CLEAR that returned (never served).
    cleared: u64,
    wrong: u64,
    resurrected: u64,
    /// STATUS `l2.corrupt`: checksum failures the node blames on the medium.
    corrupt: u64,
    /// STATUS `l2.torn`: checksum failures the node puts down to the kill before the restart.
    torn_counted: u64,
    errors: u64,
    stalled: u64,
    hits: u64,
    objects_after: u64,
    memcheck_ok: bool,
    memcheck_problems: Vec<String>,
}

#[derive(Clone)]
struct ClearOutcome {
    /// The kill was aimed at the CLEAR itself (else at the write-behind after it returned).
    during: bool,
    /// CLEAR returned OK (whether before or after the SIGKILL was sent, it was acknowledged).
    returned: bool,
    /// Its error, if it answered one (an error naming a CLEAR not durable yet, say).
    error: Option<String>,
    latency_us: Option<u64>,
    /// Every epoch below this must never be served again.
    forbidden_below: u32,
}

impl Iter {
    fn json(&self, n: u32) -> Value {
        json!({
            "iteration": n,
            "kill_target_writes": self.kill_target_writes,
            "writes_at_kill": self.writes_at_kill,
            "queued_at_kill": self.queued_at_kill,
            "unwritten_at_kill": self.unwritten_at_kill,
            "status_at_kill": self.status_at_kill,
            "busy": self.busy,
            "kill_delay_us": self.kill_delay_us,
            "committed": self.committed,
            "present": self.present,
            "refused": self.refused,
            "clear": self.clear.as_ref().map(|c| json!({
                "kill": if c.during { "during" } else { "after" },
                "returned": c.returned,
                "error": c.error,
                "latency_us": c.latency_us,
                "forbidden_below_epoch": c.forbidden_below,
            })),
            "sabotaged_slots": self.sabotaged_slots,
            "scan": {
                "live": self.scan.live,
                "torn": self.scan.torn,
                "torn_other_key": self.scan.torn_other_key,
                "torn_same_key": self.scan.torn_same_key,
            },
            "recovered": self.recovered,
            "served": self.served,
            "served_committed": self.served_committed,
            "missing": self.missing,
            "cleared": self.cleared,
            "wrong": self.wrong,
            "resurrected": self.resurrected,
            "corrupt": self.corrupt,
            "torn_counted": self.torn_counted,
            "errors": self.errors,
            "stalled": self.stalled,
            "hits": self.hits,
            "objects_after": self.objects_after,
            "memcheck_ok": self.memcheck_ok,
            "memcheck_problems": self.memcheck_problems,
        })
    }

    fn line(&self, n: u32, of: u32) -> String {
        let clear = match &self.clear {
            None => String::new(),
            Some(c) => {
                let kill = if c.during { "during" } else { "after" };
                match (&c.error, c.returned) {
                    (_, true) => format!(
                        " | kill {kill} a CLEAR that returned ({} us)",
                        c.latency_us.unwrap_or(0)
                    ),
                    (Some(e), _) => format!(" | kill {kill} a CLEAR that failed: {e}"),
                    (None, false) => format!(" | kill {kill} a CLEAR that did not return"),
                }
            }
        };
        format!(
            "iteration {n}/{of}: kill at writes={} queued={} unwritten={}{}{clear} | committed {} \
             present {} refused {} | torn on disk {} (slot reused {}) | recovered {} served {} \
             (committed this iteration {}) missing {}{} wrong {} resurrected {} | corrupt {} torn {} \
             errors {} stalled {} | memcheck {}",
            self.writes_at_kill,
            self.queued_at_kill,
            self.unwritten_at_kill,
            if self.busy { "" } else { " (idle)" },
            self.committed,
            self.present,
            self.refused,
            self.scan.torn,
            self.scan.torn_other_key,
            self.recovered,
            self.served,
            self.served_committed,
            self.missing,
            if self.clear.is_some() {
                format!(" cleared {}", self.cleared)
            } else {
                String::new()
            },
            self.wrong,
            self.resurrected,
            self.corrupt,
            self.torn_counted,
            self.errors,
            self.stalled,
            if self.memcheck_ok { "ok" } else { "FAILED" },
        )
    }
}

struct Loop<'a> {
    a: &'a KillLoopArgs,
    bin: PathBuf,
    dir: PathBuf,
    seed: u64,
    nonce: u64,
    rng: SoakRng,
    keys: Arc<Shared>,
    forbidden_below: u32,
    clear_latency_us: u64,
    engine_used: String,
    iters: Vec<Iter>,
    failures: Vec<String>,
    notes: Vec<String>,
}

impl Loop<'_> {
    fn fail(&mut self, f: String) {
        eprintln!("l2-killloop failure: {f}");
        self.failures.push(f);
    }

    fn note(&mut self, n: String) {
        if self.notes.len() < 50 {
            self.notes.push(n);
        }
    }

    /// Stores until the kill; kills; returns what was stored and the kill's figures.
    fn store_and_kill(&mut self, node: &mut Node, n: u32, it: &mut Iter) -> Result<Stored, String> {
        let shared = Arc::clone(&self.keys);
        shared.stop.store(false, Ordering::Relaxed);
        shared.done.store(false, Ordering::Relaxed);
        let (socket, max, nonce) = (node.socket.clone(), self.a.max_objects, self.nonce);
        let first_id = u64::from(n) * 8 + 1;
        let hidden = self.a.hidden;
        let storer =
            std::thread::spawn(move || storer(socket, first_id, max, (nonce, hidden), shared));
        let target = 1 + self.rng.below((self.a.max_objects / 2).max(1));
        let killed = match self.wait_busy(node, target, it) {
            Ok(()) if self.a.clear => self.clear_and_kill(node, n, it),
            Ok(()) => {
                it.kill_delay_us = self.rng.below(2000);
                std::thread::sleep(Duration::from_micros(it.kill_delay_us));
                self.keys.stop.store(true, Ordering::Relaxed);
                node.kill()
            }
            Err(e) => Err(e),
        };
        self.keys.stop.store(true, Ordering::Relaxed);
        let stored = storer.join().map_err(|_| "the storer thread panicked")?;
        killed.map(|()| stored)
    }

    /// Polls STATUS until the node has written at least `target` objects to L2 in this run and
    /// more are waiting for (or in) the write-behind; or until the storer is done and nothing
    /// waits (an idle kill).
    fn wait_busy(&mut self, node: &Node, target: u64, it: &mut Iter) -> Result<(), String> {
        it.kill_target_writes = target;
        let mut c = connect(&node.socket)?;
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let s = c
                .status()
                .map_err(|e| format!("STATUS while storing: {e}"))?;
            it.writes_at_kill = l2(&s, "writes");
            it.queued_at_kill = l2(&s, "queued");
            it.unwritten_at_kill = s["objects"]["unwritten"].as_u64().unwrap_or(0);
            it.status_at_kill = json!({
                "l2": s["l2"],
                "objects": s["objects"],
                "eviction_counters": s["eviction_counters"],
            });
            let pending = it.queued_at_kill + it.unwritten_at_kill;
            it.busy = pending > 0;
            if it.writes_at_kill >= target && pending > 0 {
                return Ok(());
            }
            if self.keys.done.load(Ordering::Relaxed) && pending == 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the write-behind did not reach {target} writes within {START_TIMEOUT:?}: {}",
                    s["l2"]
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Sends a CLEAR (the storer moves to a new epoch first) and SIGKILLs the node: in odd
    /// iterations during the CLEAR, at a random moment from 0 to twice the last CLEAR's latency
    /// after sending it; in even ones after it returned, once the write-behind is busy again
    /// with 1 to 64 more objects written.
    fn clear_and_kill(&mut self, node: &mut Node, n: u32, it: &mut Iter) -> Result<(), String> {
        let old_epoch = self.keys.keys.lock().unwrap().advance();
        let mut c = connect(&node.socket)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let clearer = std::thread::spawn(move || {
            let _ = rx.recv();
            let t = Instant::now();
            let r = c.clear();
            (r, t.elapsed())
        });
        let during = n % 2 == 1;
        let _ = tx.send(());
        let (r, took) = if during {
            it.kill_delay_us = self.rng.below(2 * self.clear_latency_us + 1);
            std::thread::sleep(Duration::from_micros(it.kill_delay_us));
            self.keys.stop.store(true, Ordering::Relaxed);
            node.kill()?;
            clearer.join().map_err(|_| "the CLEAR thread panicked")?
        } else {
            let r = clearer.join().map_err(|_| "the CLEAR thread panicked")?;
            let written = l2(
                &connect(&node.socket)?.status().map_err(|e| e.to_string())?,
                "writes",
            );
            let target = written + 1 + self.rng.below(64);
            self.wait_busy(node, target, it)?;
            it.kill_delay_us = self.rng.below(2000);
            std::thread::sleep(Duration::from_micros(it.kill_delay_us));
            self.keys.stop.store(true, Ordering::Relaxed);
            node.kill()?;
            r
        };
        let mut out = ClearOutcome {
            during,
            returned: r.is_ok(),
            error: None,
            latency_us: None,
            forbidden_below: self.forbidden_below,
        };
        match r {
            Ok(_) => {
                out.latency_us = Some(took.as_micros() as u64);
                self.clear_latency_us = (took.as_micros() as u64).max(100);
                self.forbidden_below = self.forbidden_below.max(old_epoch + 1);
                out.forbidden_below = self.forbidden_below;
            }
            // Killed before it answered: nothing is promised.
            Err(e) if e.kind == ErrorKind::Io => {}
            Err(e) => out.error = Some(e.to_string()),
        }
        it.clear = Some(out);
        Ok(())
    }

    /// Retrieves every key ever handed out; checks bytes and CLEARs.
    fn verify(
        &mut self,
        node: &Node,
        n: u32,
        committed: &HashSet<Key>,
        it: &mut Iter,
    ) -> Result<(), String> {
        let mut c = connect(&node.socket)?;
        let s = c
            .status()
            .map_err(|e| format!("STATUS after restart: {e}"))?;
        if s["l2"].is_null() {
            return Err(format!("the restarted node has no L2 tier: {s}"));
        }
        if s["l2"]["failed_devices"]
            .as_array()
            .is_some_and(|d| !d.is_empty())
        {
            return Err(format!(
                "the restarted node left out its device: {}",
                s["l2"]
            ));
        }
        self.engine_used = s["l2"]["engine"].as_str().unwrap_or("?").to_owned();
        it.recovered = l2(&s, "recovered");
        let hidden = self.a.hidden;
        let ids = register(&mut c, u64::from(n) * 8 + 5, hidden)?;
        let payloads = [
            Payload::new(object_bytes(hidden, 0)),
            Payload::new(object_bytes(hidden, 1)),
        ];
        let (epochs, counts): (u32, Vec<u64>) = {
            let keys = self.keys.keys.lock().unwrap();
            (keys.epoch, keys.issued.clone())
        };
        for epoch in 0..=epochs {
            for idx in 0..counts[epoch as usize] {
                let key = Key { epoch, idx };
                let (h, m) = (key.hash(self.nonce), key.model());
                let Some(data) = c
                    .retrieve(ids[m], &range(h, m))
                    .map_err(|e| format!("retrieve of {key:?}: {e}"))?
                else {
                    continue;
                };
                it.served += 1;
                if committed.contains(&key) {
                    it.served_committed += 1;
                }
                if data.len() != 1 || !payloads[m].check(&h, &data[0]) {
                    it.wrong += 1;
                    let first = data.first().map(|d| {
                        let mut want = vec![0u8; object_bytes(hidden, m)];
                        payloads[m].fill(&h, &mut want);
                        d.iter().zip(&want).position(|(a, b)| a != b)
                    });
                    self.note(format!(
                        "iteration {n}: {key:?} ({}) served with wrong bytes (first differing byte {first:?})",
                        MODELS[m].0
                    ));
                }
                if epoch < self.forbidden_below {
                    it.resurrected += 1;
                    self.note(format!(
                        "iteration {n}: {key:?} served although a CLEAR after it returned \
                         (epochs below {} are cleared)",
                        self.forbidden_below
                    ));
                }
            }
        }
        it.cleared = committed
            .iter()
            .filter(|k| k.epoch < self.forbidden_below)
            .count() as u64;
        it.missing = committed.len() as u64 - it.served_committed - it.cleared;
        let s = c
            .status()
            .map_err(|e| format!("STATUS after the retrieves: {e}"))?;
        it.corrupt = l2(&s, "corrupt");
        it.torn_counted = l2(&s, "torn");
        it.errors = l2(&s, "errors");
        it.stalled = l2(&s, "stalled");
        it.hits = l2(&s, "hits");
        it.objects_after = l2(&s, "objects");
        let (ok, problems) = c.memcheck().map_err(|e| format!("MEMCHECK: {e}"))?;
        it.memcheck_ok = ok && s["memcheck_ok"] == true;
        it.memcheck_problems = problems;
        for id in ids {
            let _ = c.unregister(id);
        }
        Ok(())
    }

    fn judge(&mut self, n: u32, it: &Iter) {
        if it.wrong > 0 {
            self.fail(format!(
                "iteration {n}: {} objects served with wrong bytes",
                it.wrong
            ));
        }
        if it.resurrected > 0 {
            self.fail(format!(
                "iteration {n}: {} objects stored before a CLEAR that returned were served",
                it.resurrected
            ));
        }
        if !it.memcheck_ok {
            self.fail(format!(
                "iteration {n}: MEMCHECK failed: {:?}",
                it.memcheck_problems
            ));
        }
        // Every restart follows a SIGKILL, and nothing damages the device but the kill (and a
        // sabotage): every checksum failure is the kill's doing, none the medium's.
        if it.corrupt > 0 && self.a.sabotage.is_none() {
            self.fail(format!(
                "iteration {n}: {} checksum failures counted as media corruption after a kill \
                 (they are torn: the node restarted after an unclean stop)",
                it.corrupt
            ));
        }
        // L1 starts empty after a restart: whatever is served came from the recovered objects.
        if it.served > it.recovered {
            self.fail(format!(
                "iteration {n}: {} objects served but only {} recovered",
                it.served, it.recovered
            ));
        }
    }

    fn run(&mut self) -> Result<(), String> {
        let mut node = Node::start(self.a, &self.bin, &self.dir, 0)?;
        for n in 1..=self.a.iterations {
            let mut it = Iter::default();
            let stored = self.store_and_kill(&mut node, n, &mut it)?;
            if let Some(e) = &stored.lost {
                return Err(format!(
                    "iteration {n}: the storer lost the node before the kill: {e}"
                ));
            }
            it.committed = stored.committed.len() as u64;
            it.present = stored.present;
            it.refused = stored.refused;
            it.scan = scan(&self.dir.join("kvnode-l2.dat"))?;
            if self.a.sabotage.is_some() && n == self.a.sabotage_iteration {
                let kind = self.a.sabotage.unwrap_or(Sabotage::Corrupt);
                it.sabotaged_slots = Some(sabotage(&self.dir.join("kvnode-l2.dat"), kind)?);
            }
            node = Node::start(self.a, &self.bin, &self.dir, n)?;
            let committed: HashSet<Key> = stored.committed.into_iter().collect();
            self.verify(&node, n, &committed, &mut it)?;
            eprintln!("{}", it.line(n, self.a.iterations));
            self.judge(n, &it);
            self.iters.push(it);
        }
        node.stop()
    }

    fn totals(&self) -> Value {
        let sum = |f: fn(&Iter) -> u64| self.iters.iter().map(f).sum::<u64>();
        let clears = self.iters.iter().filter_map(|i| i.clear.as_ref());
        json!({
            "kills": self.iters.len(),
            "busy_kills": sum(|i| u64::from(i.busy)),
            "committed": sum(|i| i.committed),
            "present": sum(|i| i.present),
            "refused": sum(|i| i.refused),
            "recovered": sum(|i| i.recovered),
            "served": sum(|i| i.served),
            "served_committed": sum(|i| i.served_committed),
            "missing": sum(|i| i.missing),
            "cleared": sum(|i| i.cleared),
            "wrong": sum(|i| i.wrong),
            "resurrected": sum(|i| i.resurrected),
            "corrupt": sum(|i| i.corrupt),
            "torn_counted": sum(|i| i.torn_counted),
            "torn": sum(|i| i.scan.torn),
            "torn_other_key": sum(|i| i.scan.torn_other_key),
            "torn_same_key": sum(|i| i.scan.torn_same_key),
            "errors": sum(|i| i.errors),
            "stalled": sum(|i| i.stalled),
            "memcheck_failures": sum(|i| u64::from(!i.memcheck_ok)),
            "clears": clears.clone().count(),
            "clears_returned": clears.clone().filter(|c| c.returned).count(),
            "clears_killed_during": clears.clone().filter(|c| c.during).count(),
            "clears_killed_during_returned": clears.clone().filter(|c| c.during && c.returned).count(),
            "clears_failed": clears.filter(|c| c.error.is_some()).count(),
        })
    }

    fn summary(&self, t: &Value) -> String {
        let n = |k: &str| t[k].as_u64().unwrap_or(0);
        let clear = if self.a.clear {
            format!(
                ", {} CLEARs ({} killed during the CLEAR, {} of those returned; {} returned in all, \
                 {} errors), {} resurrected",
                n("clears"),
                n("clears_killed_during"),
                n("clears_killed_during_returned"),
                n("clears_returned"),
                n("clears_failed"),
                n("resurrected")
            )
        } else {
            String::new()
        };
        let cleared = if self.a.clear {
            format!(", {} dropped by CLEARs", n("cleared"))
        } else {
            String::new()
        };
        format!(
            "L2-KILLLOOP: {} iterations, {} kills, {} served, {} wrong, {} recovered, {} missing \
             (of {} committed{cleared}), {} corrupt, {} torn counted ({} torn on disk after the \
             kills, {} of them in reused slots), {} errors, memcheck {}{clear}; {} kills with the write-behind \
             busy, variant {}, engine {}, seed {}: {}",
            self.iters.len(),
            n("kills"),
            n("served"),
            n("wrong"),
            n("recovered"),
            n("missing"),
            n("committed"),
            n("corrupt"),
            n("torn_counted"),
            n("torn"),
            n("torn_other_key"),
            n("errors"),
            if n("memcheck_failures") == 0 {
                "ok"
            } else {
                "FAILED"
            },
            n("busy_kills"),
            if self.a.clear { "clear" } else { "store" },
            self.engine_used,
            self.seed,
            if self.failures.is_empty() {
                "PASS"
            } else {
                "FAIL"
            },
        )
    }
}

/// Runs the loop; `Ok(true)` when it passed. The summary line goes to stdout, the rest to
/// stderr.
pub fn run(a: &KillLoopArgs) -> Result<bool, String> {
    if a.iterations == 0 || a.max_objects < 2 || a.hidden == 0 {
        return Err(
            "the kill loop needs --iterations >= 1, --max-objects >= 2 and --hidden >= 1".into(),
        );
    }
    let seed = a.seed.unwrap_or_else(crate::soak::random_seed);
    let bin = crate::node::find_node_bin(a.node_bin.as_deref())?;
    let dir = a
        .l2_dir
        .join(format!("kvnode-l2-killloop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    eprintln!(
        "l2-killloop: seed {seed}, {} iterations, variant {}, engine {}, pool {}, L2 {} in {}",
        a.iterations,
        if a.clear { "clear" } else { "store" },
        a.engine.as_str(),
        a.pool_size,
        a.l2_size,
        dir.display()
    );
    let mut l = Loop {
        a,
        bin,
        dir: dir.clone(),
        seed,
        nonce: splitmix64(seed ^ 0x4C32),
        rng: SoakRng::new(seed ^ 0x4B11),
        keys: Arc::new(Shared {
            keys: Mutex::new(Keys {
                epoch: 0,
                issued: vec![0],
            }),
            stop: AtomicBool::new(false),
            done: AtomicBool::new(false),
        }),
        forbidden_below: 0,
        clear_latency_us: 10_000,
        engine_used: a.engine.as_str().to_owned(),
        iters: Vec::new(),
        failures: Vec::new(),
        notes: Vec::new(),
    };
    if let Err(e) = l.run() {
        l.fail(e);
    }
    let totals = l.totals();
    let line = l.summary(&totals);
    for note in &l.notes {
        eprintln!("l2-killloop note: {note}");
    }
    println!("{line}");
    if let Some(path) = &a.json {
        let doc = json!({
            "pass": l.failures.is_empty(),
            "summary": line,
            "failures": l.failures,
            "notes": l.notes,
            "seed": seed,
            "variant": if a.clear { "clear" } else { "store" },
            "engine": a.engine.as_str(),
            "engine_used": l.engine_used,
            "pool_size": a.pool_size,
            "l2_size": a.l2_size,
            "max_objects": a.max_objects,
            "object_bytes": [object_bytes(a.hidden, 0), object_bytes(a.hidden, 1)],
            "keys": l.keys.keys.lock().unwrap().issued.iter().sum::<u64>(),
            "dir": dir.display().to_string(),
            "totals": totals,
            "iterations": l.iters.iter().enumerate().map(|(i, it)| it.json(i as u32 + 1)).collect::<Vec<_>>(),
        });
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    let pass = l.failures.is_empty();
    if (pass || a.sabotage.is_some()) && !a.keep_dir {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!(
            "l2-killloop: data file and node log kept in {}",
            dir.display()
        );
    }
    Ok(pass)
}
