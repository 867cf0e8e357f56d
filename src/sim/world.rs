//! The simulated world around the real node: its configuration, the prompt universe clients draw
//! keys from, the byte stamps clients "copy" into slots, and a reply sink that captures answers.

use std::sync::Arc;

use kvnode_hw::{PagePreference, PoolOptions, SharedPool};
use parking_lot::Mutex;

use crate::clock::Clock;
use crate::config::{Limits, NodeConfig};
use crate::hashing::{chunk_hashes, ChunkHash};
use crate::modules::NodeContext;
use crate::protocol::Response;
use crate::storage::{Namespaces, StorageKey};
use crate::transport::ReplySink;

/// Tokens per chunk in the simulated node.
pub const CHUNK_TOKENS: u32 = 16;
/// Layers of the simulated model (objects stay small: the pool fills and evicts quickly).
pub const NUM_LAYERS: u32 = 1;
/// Hidden size of the main layout (8 KiB objects in float16).
pub const HIDDEN: u32 = 128;
/// Hidden size of the alternative layout a re-registration may switch to.
pub const HIDDEN_ALT: u32 = 256;
/// Dtype of every simulated layout.
pub const DTYPE: &str = "float16";
/// The two model names instances register.
pub const MODELS: [&str; 2] = ["sim-a", "sim-b"];
/// Pool size: a few hundred objects, so stores evict.
pub const POOL_BYTES: u64 = 4 << 20;
/// Liveness tick of the simulated node.
pub const TICK_MS: u64 = 100;
/// Reap timeout (pinged instances).
pub const REAP_TIMEOUT_MS: u64 = 3_000;
/// Registration grace (instances that never pinged): much longer than the reap timeout, so a
/// reaper that watches an instance on the wrong window is seen.
pub const GRACE_MS: u64 = 30_000;
/// Write TTL.
pub const WRITE_TTL_MS: u64 = 20_000;
/// Read TTL.
pub const READ_TTL_MS: u64 = 8_000;
/// Bytes the simulated node's lookup sessions may hold: about two sessions that hit a whole
/// prompt ([`PROMPT_CHUNKS`] chunks, world size 1), so LOOKUPs evict sessions.
pub const SESSION_BUDGET_BYTES: u64 = 2 << 10;
/// Session idle TTL.
pub const SESSION_TTL_MS: u64 = 15_000;
/// A namespace untouched for this long and used by nothing must not be kept by the node after
/// its maintenance pass (the node's reclaim grace must be no longer).
pub const NAMESPACE_IDLE_MS: u64 = 5_000;

/// The configuration of the simulated node: small limits and short deadlines so every limit
/// and timer is reached within a run.
pub fn config() -> NodeConfig {
    NodeConfig {
        socket: Default::default(),
        pool_bytes: POOL_BYTES,
        pages: "4k".into(),
        chunk_tokens: CHUNK_TOKENS,
        reap_timeout_secs: REAP_TIMEOUT_MS as f64 / 1000.0,
        registration_grace_secs: GRACE_MS as f64 / 1000.0,
        liveness_tick_ms: TICK_MS,
        workers: 1,
        write_ttl_secs: WRITE_TTL_MS / 1000,
        read_ttl_secs: READ_TTL_MS / 1000,
        session_ttl_secs: SESSION_TTL_MS / 1000,
        limits: Limits {
            max_instances: 32,
            max_pending_transfers: 12,
            max_sessions: 64,
            max_chunks_per_request: 64,
            // A few sessions' worth, so LOOKUPs evict sessions (whose locks the lock-ownership
            // check then accounts for).
            max_session_bytes: SESSION_BUDGET_BYTES,
            ..Limits::default()
        },
        access: crate::access::AccessConfig {
            // The foreign scheduler, and the users of the LMCache frontend's unit tests.
            allow_uids: vec![crate::sim::native::FOREIGN_UID, 1000, 1001, 1002],
            ..Default::default()
        },
        ..NodeConfig::default()
    }
}

/// Builds the node's shared context on `clock`: a small 4 KiB-page pool, no L2, no threads.
pub fn build_node(clock: &Clock) -> Arc<NodeContext> {
    let cfg = config();
    cfg.validate()
        .expect("the simulator's configuration is valid");
    let pool = SharedPool::create(&PoolOptions {
        bytes: cfg.pool_bytes,
        prefer: PagePreference::Pages4K,
        prefault: false,
        name: "kvnode-sim".into(),
        posix_shm_name: None,
        segment_bind_mount: false,
        cancel: None,
    })
    .expect("a small memfd pool for the simulator");
    let mut ctx = NodeContext::with_clock(
        cfg,
        Arc::new(pool),
        Arc::new(Namespaces::default()),
        None,
        clock.clone(),
    );
    // Transfer ids order the pending sweeps: a fixed key keeps runs reproducible.
    ctx.use_transfer_key([0x5a; 32]);
    Arc::new(ctx)
}

/// The prompts clients store and look up. Prompts of one family share their first chunks (a
/// system prompt), so lookups, locks and evictions of shared prefixes interleave.
pub struct Prompts {
    tokens: Vec<Vec<u32>>,
    hashes: Vec<Vec<ChunkHash>>,
}

/// Chunks per prompt.
pub const PROMPT_CHUNKS: usize = 8;
/// Chunks shared by the prompts of one family.
pub const SHARED_CHUNKS: usize = 2;
/// Prompt families.
pub const FAMILIES: u32 = 3;

impl Prompts {
    /// `n` prompts derived from `seed`.
    pub fn new(n: usize, seed: u64) -> Prompts {
        let per_chunk = CHUNK_TOKENS as usize;
        let mut tokens = Vec::with_capacity(n);
        for p in 0..n {
            let family = p as u32 % FAMILIES;
            let t: Vec<u32> = (0..PROMPT_CHUNKS * per_chunk)
                .map(|i| {
                    let (owner, salt) = if i < SHARED_CHUNKS * per_chunk {
                        (family, 0xFA)
                    } else {
                        (p as u32, 0x70)
                    };
                    let x = (seed as u32) ^ (owner.wrapping_mul(2_654_435_761)) ^ salt;
                    x.wrapping_add(i as u32).wrapping_mul(40_503) % 50_000
                })
                .collect();
            tokens.push(t);
        }
        let hashes = tokens
            .iter()
            .map(|t| chunk_hashes(t, CHUNK_TOKENS))
            .collect();
        Prompts { tokens, hashes }
    }

    /// Number of prompts.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The tokens of prompt `p`.
    pub fn tokens(&self, p: usize) -> &[u32] {
        &self.tokens[p]
    }

    /// The smallest prompt whose first `b` chunks are those of prompt `p` (the same LMCache
    /// key for any range ending at chunk `b`).
    pub fn canonical(&self, p: usize, b: usize) -> usize {
        (0..self.hashes.len())
            .find(|&q| self.hashes[q][..b] == self.hashes[p][..b])
            .unwrap_or(p)
    }

    /// The chunk hashes of prompt `p`.
    pub fn hashes(&self, p: usize) -> &[ChunkHash] {
        &self.hashes[p]
    }
}

const STAMP_MAGIC: u64 = 0x6b76_6e6f_6465_5349; // "kvnodeSI"

/// The 32-byte header of a stamp: magic, the key's fingerprint, the version and its complement.
fn stamp_header(key: &StorageKey, version: u64) -> [u8; 32] {
    let mut h = [0u8; 32];
    h[..8].copy_from_slice(&STAMP_MAGIC.to_le_bytes());
    h[8..16].copy_from_slice(&key.fingerprint().to_le_bytes());
    h[16..24].copy_from_slice(&version.to_le_bytes());
    h[24..32].copy_from_slice(&(!version).to_le_bytes());
    h
}

/// The version a stamp's header and tail name, if they form a complete stamp for `key`.
fn stamp_version(h: &[u8; 32], tail: [u8; 8], key: &StorageKey) -> Option<u64> {
    let word = |i: usize| u64::from_le_bytes(h[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    if word(0) != STAMP_MAGIC || word(1) != key.fingerprint() || word(3) != !word(2) {
        return None;
    }
    (u64::from_le_bytes(tail) == word(2)).then_some(word(2))
}

/// Writes the bytes a client copies into a slot for `key`, version `version`: a header naming
/// both, then a fill byte derived from the version. Any two versions or keys differ.
pub fn write_stamp(ctx: &NodeContext, offset: u64, len: u64, key: &StorageKey, version: u64) {
    let region = ctx.pool.region();
    region
        .fill_at(offset, len, (version as u8) | 1)
        .expect("grants lie inside the pool");
    region
        .write_at(offset, &stamp_header(key, version))
        .expect("grants lie inside the pool");
    region
        .write_at(offset + len - 8, &version.to_le_bytes())
        .expect("grants lie inside the pool");
}

/// The bytes [`write_stamp`] writes, as a buffer (a remote engine's memory holds them).
pub fn stamp_bytes(len: u64, key: &StorageKey, version: u64) -> Vec<u8> {
    let mut b = vec![(version as u8) | 1; len as usize];
    b[..32].copy_from_slice(&stamp_header(key, version));
    let n = b.len();
    b[n - 8..].copy_from_slice(&version.to_le_bytes());
    b
}

/// Reads back the stamp of a slot: `Some(version)` when it holds a complete stamp for `key`.
pub fn read_stamp(ctx: &NodeContext, offset: u64, len: u64, key: &StorageKey) -> Option<u64> {
    let region = ctx.pool.region();
    let mut h = [0u8; 32];
    region.read_at(offset, &mut h).ok()?;
    let mut tail = [0u8; 8];
    region.read_at(offset + len - 8, &mut tail).ok()?;
    stamp_version(&h, tail, key)
}

/// [`read_stamp`] of a buffer (what a retrieve delivered into a remote engine's memory):
/// `Some(version)` when all of `bytes` is the stamp of `key` at that version.
pub fn parse_stamp(bytes: &[u8], key: &StorageKey) -> Option<u64> {
    if bytes.len() < 40 {
        return None;
    }
    let h: [u8; 32] = bytes[..32].try_into().expect("32 bytes");
    let tail: [u8; 8] = bytes[bytes.len() - 8..].try_into().expect("8 bytes");
    let v = stamp_version(&h, tail, key)?;
    (bytes == stamp_bytes(bytes.len() as u64, key, v).as_slice()).then_some(v)
}

/// A reply sink that keeps the last response (the simulator runs every request inline, so each
/// request's answer is there when `dispatch` returns).
pub struct CaptureSink {
    id: u64,
    peer: Option<kvnode_hw::PeerCred>,
    last: Mutex<Option<Response>>,
}

impl CaptureSink {
    /// A sink for connection `id` of a process of the node's own user.
    pub fn new(id: u64) -> Arc<CaptureSink> {
        CaptureSink::with_peer(
            id,
            kvnode_hw::PeerCred {
                pid: Some(1),
                uid: kvnode_hw::effective_uid(),
                gid: kvnode_hw::effective_gid(),
            },
        )
    }

    /// A sink for connection `id` whose peer has credentials `peer`.
    pub fn with_peer(id: u64, peer: kvnode_hw::PeerCred) -> Arc<CaptureSink> {
        Arc::new(CaptureSink {
            id,
            peer: Some(peer),
            last: Mutex::new(None),
        })
    }

    /// A sink for remote connection `id`: no kernel credentials (a token decided its role).
    pub fn remote(id: u64) -> Arc<CaptureSink> {
        Arc::new(CaptureSink {
            id,
            peer: None,
            last: Mutex::new(None),
        })
    }

    /// Takes the captured response.
    pub fn take(&self) -> Option<Response> {
        self.last.lock().take()
    }
}

impl ReplySink for CaptureSink {
    fn send(
        &self,
        _request_id: u64,
        _opcode: u16,
        resp: &Response,
        _fd: Option<std::os::fd::BorrowedFd<'_>>,
    ) {
        *self.last.lock() = Some(resp.clone());
    }

    fn connection_id(&self) -> u64 {
        self.id
    }

    fn can_pass_fd(&self) -> bool {
        false
    }

    fn peer(&self) -> Option<kvnode_hw::PeerCred> {
        self.peer
    }
}
