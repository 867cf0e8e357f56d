//! `kvnode-bench soak-worker`: one client process of the kill soak (`kvnode-bench soak`).
//!
//! A worker speaks one protocol ([`ClientKind::Native`] through `kvnode::client::Client`, or
//! [`ClientKind::Lmcache`] through a ZMQ DEALER with LMCache's frames) and loops over stores,
//! LOOKUP + retrieves with the lookup's locks, and plain retrieves, pausing at random between
//! PREPARE, the copy and COMMIT so that the parent's SIGKILLs often land mid-transfer. Every
//! chunk's bytes are a function of its key ([`crate::payload`]), so any reader verifies any
//! chunk, whoever wrote it: a mismatch means the node handed out wrong bytes.
//!
//! Stdout is line-oriented, one `write` per line (so a SIGKILL never tears a line):
//! `phase NAME` before each step, `stats {json}` (cumulative [`WorkerStats`]) after each
//! operation, `corrupt ...` / `anomaly ...` / `error ...` as they happen, `final` when a
//! survivor has re-verified its chunks, `exit` on a clean exit. The parent stops a worker by
//! writing `stop` to its stdin (or closing it); killable workers are normally SIGKILLed instead.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvnode::hashing::ChunkHash;
use kvnode::{Error, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::payload::{splitmix64, Payload};
use crate::soak_engine::{object_bytes, Conv, Engine, NativeEngine, Prepared, Slot};

/// Interval between a worker's PINGs (well below any reap timeout the soak uses).
const PING_EVERY: Duration = Duration::from_millis(250);
/// Conversation ids with this bit set are private to one worker instance (never deduplicated).
const PRIVATE: u64 = 1 << 63;

/// Which protocol a worker speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ClientKind {
    /// kvnode's native protocol (`kvnode::client::Client`, Unix socket).
    Native,
    /// LMCache's multiprocess protocol (ZMQ DEALER, POSIX shm segment).
    Lmcache,
}

/// Whether the parent kills the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// SIGKILLed at a random moment.
    Killable,
    /// Runs the whole soak, re-verifies what it stored, unregisters and exits 0.
    Survivor,
}

/// `kvnode-bench soak-worker` arguments (given by the soak parent).
#[derive(clap::Args, Debug, Clone)]
pub struct WorkerArgs {
    /// Protocol.
    #[arg(long, value_enum)]
    pub kind: ClientKind,
    /// Killable or survivor.
    #[arg(long, value_enum)]
    pub role: Role,
    /// The node's native socket (native workers).
    #[arg(long, required_if_eq("kind", "native"))]
    pub socket: Option<PathBuf>,
    /// The node's LMCache ZMQ port on 127.0.0.1 (LMCache workers).
    #[arg(long, required_if_eq("kind", "lmcache"))]
    pub port: Option<u16>,
    /// Instance id to register (unique per worker process).
    #[arg(long)]
    pub instance_id: u64,
    /// Seed of this worker's random choices.
    #[arg(long)]
    pub seed: u64,
    /// The soak's nonce, hashed into every conversation's tokens.
    #[arg(long)]
    pub run_nonce: u64,
    /// Shared conversations (key space every worker draws from).
    #[arg(long)]
    pub conversations: u64,
    /// Chunks of the longest conversation.
    #[arg(long, default_value_t = 8)]
    pub max_chunks: u32,
    /// Longest random pause between PREPARE, copy and COMMIT, in milliseconds.
    #[arg(long, default_value_t = 20)]
    pub max_pause_ms: u64,
    /// Conversations a survivor remembers and re-verifies at the end (the most recent ones).
    #[arg(long, default_value_t = 4096)]
    pub final_verify_limit: usize,
    /// Test of the harness: every 8th chunk this worker stores gets one wrong byte.
    #[arg(long, hide = true)]
    pub sabotage: bool,
}

/// Cumulative counters of one worker process (printed as `stats {json}` after every operation).
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct WorkerStats {
    /// Committed stores that published at least one chunk.
    pub stores: u64,
    /// Chunks those stores published.
    pub chunks_stored: u64,
    /// Chunks PREPARE_STORE gave no slot (cached already, in flight elsewhere, or no room).
    pub chunks_skipped: u64,
    /// Prepared stores aborted on purpose (native only).
    pub stores_aborted: u64,
    /// PREPARE_STOREs refused for lack of memory or a limit.
    pub stores_refused: u64,
    /// LOOKUPs.
    pub lookups: u64,
    /// Chunks those LOOKUPs reported as hits.
    pub lookup_hit_chunks: u64,
    /// Retrieves that got slots.
    pub retrieves: u64,
    /// Plain retrieves that missed (all-or-nothing; evictions make these normal).
    pub retrieve_misses: u64,
    /// Retrieved chunks whose every byte matched their key.
    pub chunks_verified: u64,
    /// Retrieved chunks with wrong bytes (must stay 0).
    pub corrupt: u64,
    /// Retrieves that missed right after their LOOKUP reported hits (locks held: must stay 0).
    pub lookup_then_miss: u64,
    /// COMMIT_STOREs the node no longer knew (the reservation was dropped under a live worker).
    pub stale_commits: u64,
    /// COMMIT_RETRIEVEs the node no longer knew (read locks dropped while copying: unverifiable).
    pub stale_reads: u64,
    /// PINGs.
    pub pings: u64,
    /// Conversations a survivor re-read at the end.
    pub final_convs: u64,
    /// Chunks verified in that final pass.
    pub final_chunks_verified: u64,
    /// Chunks of that pass no longer cached (evicted: fine).
    pub final_chunks_missing: u64,
}

/// The stdout protocol. A failed write (the parent is gone) stops the worker.
struct Out {
    stop: Arc<AtomicBool>,
}

impl Out {
    fn line(&self, s: &str) {
        let mut buf = String::with_capacity(s.len() + 1);
        buf.push_str(s);
        buf.push('\n');
        let mut o = std::io::stdout().lock();
        if o.write_all(buf.as_bytes())
            .and_then(|()| o.flush())
            .is_err()
        {
            self.stop.store(true, Ordering::Relaxed);
        }
    }
}

/// Small xorshift generator (deterministic per seed).
pub struct SoakRng(u64);

impl SoakRng {
    /// A generator from `seed` (any value).
    pub fn new(seed: u64) -> SoakRng {
        SoakRng(splitmix64(seed) | 1)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }
}

struct Worker<'a> {
    args: &'a WorkerArgs,
    engine: Box<dyn Engine>,
    chunk_tokens: u32,
    payload: Payload,
    rng: SoakRng,
    out: Out,
    stats: WorkerStats,
    /// Survivors: conversations stored (or found cached), most recent last, with chunk counts.
    own: VecDeque<(u64, u32)>,
    next_req: u64,
    next_private: u64,
    /// Chunks copied into the pool so far.
    written: u64,
    /// In the final verification (no pauses: nobody is killed any more).
    finishing: bool,
    last_ping: Instant,
}

impl Worker<'_> {
    fn phase(&self, p: &str) {
        self.out.line(&format!("phase {p}"));
    }

    fn pause(&mut self) {
        if self.finishing {
            return;
        }
        let ms = self.rng.below(self.args.max_pause_ms + 1);
        if ms > 0 {
            std::thread::sleep(Duration::from_millis(ms));
        }
    }

    fn req(&mut self, what: &str) -> String {
        self.next_req += 1;
        let tag = match self.args.kind {
            ClientKind::Native => 'n',
            ClientKind::Lmcache => 'l',
        };
        format!("{tag}{}-{what}{}", self.args.instance_id, self.next_req)
    }

    fn conv(&self, id: u64) -> Conv {
        let a = self.args;
        Conv::new(a.run_nonce, id, a.max_chunks, self.chunk_tokens)
    }

    /// A conversation to store: shared (70 %) or a new private one.
    fn store_conv(&mut self) -> Conv {
        if self.rng.below(10) < 7 {
            let id = self.rng.below(self.args.conversations.max(1));
            self.conv(id)
        } else {
            self.next_private += 1;
            let id = PRIVATE | (self.args.instance_id << 24) | (self.next_private & 0xFF_FFFF);
            self.conv(id)
        }
    }

    /// A conversation to read: one of this worker's own (30 %, when it has some) or a shared one.
    fn read_conv(&mut self) -> Conv {
        if !self.own.is_empty() && self.rng.below(10) < 3 {
            let i = self.rng.below(self.own.len() as u64) as usize;
            return self.conv(self.own[i].0);
        }
        let id = self.rng.below(self.args.conversations.max(1));
        self.conv(id)
    }

    fn remember(&mut self, conv: &Conv, n: u32) {
        if self.args.role == Role::Survivor {
            self.own.push_back((conv.id, n));
            while self.own.len() > self.args.final_verify_limit {
                self.own.pop_front();
            }
        }
    }

    fn emit_stats(&self) {
        let json = serde_json::to_string(&self.stats).unwrap_or_default();
        self.out.line(&format!("stats {json}"));
    }

    fn step(&mut self) -> Result<(), Error> {
        if self.last_ping.elapsed() >= PING_EVERY {
            self.phase("ping");
            self.engine.ping()?;
            self.stats.pings += 1;
            self.last_ping = Instant::now();
        }
        let r = self.rng.below(100);
        if r < 45 {
            self.store(false)?;
        } else if r < 50 && self.args.kind == ClientKind::Native {
            self.store(true)?;
        } else if r < 90 {
            let conv = self.read_conv();
            self.lookup_retrieve(&conv, false)?;
        } else {
            self.plain_retrieve()?;
        }
        self.phase("idle");
        self.emit_stats();
        Ok(())
    }

    fn store(&mut self, abort: bool) -> Result<(), Error> {
        let conv = self.store_conv();
        let n = if self.rng.below(3) == 0 {
            1 + self.rng.below(u64::from(conv.chunks())) as u32
        } else {
            conv.chunks()
        };
        let req = self.req("s");
        self.phase("prepare_store");
        let p = match self.engine.prepare_store(&conv, n, &req) {
            Ok(p) => p,
            Err(e) if matches!(e.kind, ErrorKind::OutOfMemory | ErrorKind::LimitExceeded) => {
                self.stats.stores_refused += 1;
                return self.engine.end_request(&req);
            }
            Err(e) => return Err(e),
        };
        self.stats.chunks_skipped += u64::from(n) - p.slots.len() as u64;
        if p.slots.is_empty() {
            self.remember(&conv, n);
            return self.engine.end_request(&req);
        }
        self.phase("store_prepared");
        self.pause();
        self.phase("copy_in");
        let want = self.payload_len();
        let mut buf = vec![0u8; want];
        for s in &p.slots {
            let h = slot_hash(&conv, s, want)?;
            self.payload.fill(h, &mut buf);
            self.written += 1;
            if self.args.sabotage && self.written.is_multiple_of(8) {
                buf[want / 2] ^= 0x5A;
            }
            self.engine.pool().write_at(s.offset, &buf)?;
        }
        self.phase("store_copied");
        self.pause();
        if abort {
            self.phase("abort_store");
            self.engine.abort_store(&p)?;
            self.stats.stores_aborted += 1;
            return Ok(());
        }
        self.phase("commit_store");
        if self.engine.commit_store(&conv, n, &req, &p)? {
            self.stats.stores += 1;
            self.stats.chunks_stored += p.slots.len() as u64;
            self.remember(&conv, n);
        } else {
            self.stats.stale_commits += 1;
            self.out.line(&format!(
                "anomaly stale_commit conv={} chunks={n} req={req}",
                conv.id
            ));
        }
        self.phase("end_request");
        self.engine.end_request(&req)
    }

    fn payload_len(&self) -> usize {
        object_bytes(self.chunk_tokens) as usize
    }

    /// LOOKUP, retrieve of the hit prefix with the lookup's locks, FREE_LOOKUP_LOCKS,
    /// END_SESSION; returns the hit chunks.
    fn lookup_retrieve(&mut self, conv: &Conv, last: bool) -> Result<u32, Error> {
        let session = self.req("q");
        self.phase("lookup");
        let hits = self.engine.lookup(conv, &session)?.min(conv.chunks());
        self.stats.lookups += 1;
        self.stats.lookup_hit_chunks += u64::from(hits);
        if hits > 0 {
            self.phase("lookup_locked");
            self.pause();
            self.phase("prepare_retrieve");
            match self.engine.prepare_retrieve(conv, hits, &session, true)? {
                None => {
                    self.stats.lookup_then_miss += 1;
                    self.out.line(&format!(
                        "anomaly lookup_then_miss conv={} hits={hits} session={session}",
                        conv.id
                    ));
                }
                Some(p) => self.read_verify(conv, hits, &session, &p, last)?,
            }
        }
        self.phase("free_locks");
        self.engine.free_lookup_locks(conv, &session)?;
        self.phase("end_session");
        self.engine.end_session(&session)?;
        Ok(hits)
    }

    fn plain_retrieve(&mut self) -> Result<(), Error> {
        let conv = self.read_conv();
        let n = 1 + self.rng.below(u64::from(conv.chunks())) as u32;
        let req = self.req("r");
        self.phase("prepare_retrieve");
        match self.engine.prepare_retrieve(&conv, n, &req, false)? {
            None => self.stats.retrieve_misses += 1,
            Some(p) => self.read_verify(&conv, n, &req, &p, false)?,
        }
        self.phase("end_request");
        self.engine.end_request(&req)
    }

    /// Copies the chunks out, commits, then checks every byte (only if the commit says the
    /// locks were held throughout).
    fn read_verify(
        &mut self,
        conv: &Conv,
        n: u32,
        req: &str,
        p: &Prepared,
        last: bool,
    ) -> Result<(), Error> {
        self.stats.retrieves += 1;
        if p.slots.len() != n as usize {
            return Err(Error::internal(format!(
                "retrieve of {n} chunks got {} slots",
                p.slots.len()
            )));
        }
        self.phase("retrieve_prepared");
        self.pause();
        self.phase("copy_out");
        let want = self.payload_len();
        let mut bufs = Vec::with_capacity(p.slots.len());
        for s in &p.slots {
            slot_hash(conv, s, want)?;
            let mut buf = vec![0u8; want];
            self.engine.pool().read_at(s.offset, &mut buf)?;
            bufs.push(buf);
        }
        self.phase("retrieve_copied");
        self.pause();
        self.phase("commit_retrieve");
        if !self.engine.commit_retrieve(conv, n, req, p)? {
            self.stats.stale_reads += 1;
            return Ok(());
        }
        for (s, buf) in p.slots.iter().zip(&bufs) {
            let h = &conv.hashes[s.chunk as usize];
            if self.payload.check(h, buf) {
                self.stats.chunks_verified += 1;
                if last {
                    self.stats.final_chunks_verified += 1;
                }
            } else {
                self.stats.corrupt += 1;
                let bad = first_difference(&self.payload, h, buf);
                self.out.line(&format!(
                    "corrupt kind={:?} conv={} chunk={} offset={} hash={} first_bad_byte={bad} req={req}",
                    self.args.kind,
                    conv.id,
                    s.chunk,
                    s.offset,
                    kvnode::hashing::to_hex(h)
                ));
            }
        }
        Ok(())
    }

    /// Survivors: re-read every remembered conversation still cached and verify every byte.
    fn final_verify(&mut self) -> Result<(), Error> {
        self.finishing = true;
        let mut latest: HashMap<u64, u32> = HashMap::new();
        for &(id, n) in &self.own {
            let e = latest.entry(id).or_insert(0);
            *e = (*e).max(n);
        }
        let mut ids: Vec<(u64, u32)> = latest.into_iter().collect();
        ids.sort_unstable();
        for (id, n) in ids {
            let conv = self.conv(id);
            let hits = self.lookup_retrieve(&conv, true)?;
            self.stats.final_convs += 1;
            self.stats.final_chunks_missing += u64::from(n.saturating_sub(hits));
            if self.last_ping.elapsed() >= PING_EVERY {
                self.engine.ping()?;
                self.last_ping = Instant::now();
            }
        }
        Ok(())
    }
}

/// The hash of the chunk a slot holds, after checking the slot's length and chunk index.
fn slot_hash<'c>(conv: &'c Conv, s: &Slot, want: usize) -> Result<&'c ChunkHash, Error> {
    if s.length != want as u64 {
        return Err(Error::internal(format!(
            "slot of {} bytes, the layout has {want}",
            s.length
        )));
    }
    conv.hashes
        .get(s.chunk as usize)
        .ok_or_else(|| Error::internal(format!("slot for chunk {} out of range", s.chunk)))
}

fn first_difference(p: &Payload, h: &ChunkHash, data: &[u8]) -> usize {
    let mut want = vec![0u8; data.len()];
    p.fill(h, &mut want);
    want.iter().zip(data).position(|(a, b)| a != b).unwrap_or(0)
}

/// Runs a worker until `stop` arrives on stdin (or stdin closes); returns the exit code.
pub fn run(args: &WorkerArgs) -> i32 {
    let stop = Arc::new(AtomicBool::new(false));
    let out = Out { stop: stop.clone() };
    {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let stdin = std::io::stdin();
            for line in stdin.lock().lines() {
                match line {
                    Ok(l) if l.trim() == "stop" => break,
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            stop.store(true, Ordering::Relaxed);
        });
    }
    out.line("phase register");
    let connected: Result<(Box<dyn Engine>, u32), Error> = match args.kind {
        ClientKind::Native => args
            .socket
            .as_deref()
            .ok_or_else(|| Error::invalid("--socket is required for native workers"))
            .and_then(|s| NativeEngine::connect(s, args.instance_id))
            .map(|(e, c)| (Box::new(e) as Box<dyn Engine>, c)),
        ClientKind::Lmcache => args
            .port
            .ok_or_else(|| Error::invalid("--port is required for LMCache workers"))
            .and_then(|p| crate::soak_lmcache::LmEngine::connect(p, args.instance_id))
            .map(|(e, c)| (Box::new(e) as Box<dyn Engine>, c)),
    };
    let (engine, chunk_tokens) = match connected {
        Ok(x) => x,
        Err(e) => {
            out.line(&format!("error registering: {e}"));
            return 1;
        }
    };
    let mut w = Worker {
        args,
        engine,
        chunk_tokens,
        payload: Payload::new(object_bytes(chunk_tokens) as usize),
        rng: SoakRng::new(args.seed),
        out,
        stats: WorkerStats::default(),
        own: VecDeque::new(),
        next_req: 0,
        next_private: 0,
        written: 0,
        finishing: false,
        last_ping: Instant::now(),
    };
    w.out.line(&format!("ready {}", args.instance_id));
    let mut result = Ok(());
    while !stop.load(Ordering::Relaxed) {
        result = w.step();
        if result.is_err() {
            break;
        }
    }
    if result.is_ok() && args.role == Role::Survivor {
        result = w.final_verify();
        if result.is_ok() {
            w.emit_stats();
            w.out.line("final");
        }
    }
    if let Err(e) = result {
        w.out.line(&format!("error {:?}: {e}", e.kind));
        return 1;
    }
    w.phase("unregister");
    if let Err(e) = w.engine.unregister() {
        w.out.line(&format!("error unregistering: {e}"));
        return 1;
    }
    w.emit_stats();
    w.out.line("exit");
    0
}
