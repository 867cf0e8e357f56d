//! `kvnode-bench l2-killloop`: the kill loop over the L2 disk tier. One `kvnode serve` with a small
//! pool and a disk tier on a private directory; every iteration a client stores objects whose
//! bytes are a function of their key, the node is SIGKILLed at a random moment while its
//! write-behind is busy (in the `--clear` variant: around a CLEAR), restarted on the same
//! directory, and every key ever stored is retrieved: each object served must carry exactly the
//! bytes of its key, and after a CLEAR that returned nothing stored before it may be served
//! again, ever. One summary line on stdout (`L2-KILLLOOP: ...`); exit status non-zero on any
//! wrong byte, resurrected object, MEMCHECK failure or node failure. See bench/README.md.
//!
//! This file holds the arguments, the keys and the loop's driver; `node` runs the node under
//! test, `kill` the store-and-kill phase, `disk` the data-file scan and sabotage, `verify` the
//! retrieve-and-judge phase, and `report` the figures.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvnode::client::{ChunkRangeBuilder, Client};
use kvnode::hashing::ChunkHash;
use kvnode::protocol::{ChunkRange, RegisterRequest};
use serde_json::{json, Value};

use crate::payload::splitmix64;
use crate::soak_worker::SoakRng;

mod disk;
mod kill;
mod node;
mod report;
mod verify;

use self::disk::{sabotage, scan};
use self::kill::Shared;
use self::node::Node;
use self::report::Iter;

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
                physical_slots: None,
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
