//! The soak's client side shared by both protocols: the layout every soak worker registers,
//! conversations (tokens and chunk hashes as a function of the soak nonce and an id), the
//! [`Engine`] trait a worker drives, and its native implementation over
//! `kvnode::client::Client`. The LMCache implementation is `crate::soak_lmcache`.

use kvnode::client::{ChunkRangeBuilder, Client};
use kvnode::hashing::ChunkHash;
use kvnode::protocol::RegisterRequest;
use kvnode::{Error, ErrorKind};
use kvnode_hw::PoolRegion;

use crate::payload::splitmix64;

/// Model name every soak worker registers (one layout for both protocols, so keys are shared).
pub const MODEL: &str = "soak-model";
/// Layers of the soak layout.
pub const LAYERS: u32 = 2;
/// Hidden size of the soak layout.
pub const HIDDEN: u32 = 64;
/// Dtype of the soak layout (4 bytes per element: 16 KiB objects with 16-token chunks).
pub const DTYPE: &str = "float32";
/// Bytes of one object of the soak layout for `chunk_tokens`-token chunks (K and V planes).
pub fn object_bytes(chunk_tokens: u32) -> u64 {
    2 * u64::from(LAYERS) * u64::from(chunk_tokens) * u64::from(HIDDEN) * 4
}

/// A conversation: its tokens (a function of the soak nonce and its id) and chunk hashes.
pub struct Conv {
    /// Conversation id.
    pub id: u64,
    /// Every token (`chunks * chunk_tokens`).
    pub tokens: Vec<u32>,
    /// Rolling chunk hashes (LMCache's, as the node computes them).
    pub hashes: Vec<ChunkHash>,
}

impl Conv {
    /// Conversation `id` of the soak with `nonce`: 1..=`max_chunks` chunks.
    pub fn new(nonce: u64, id: u64, max_chunks: u32, chunk_tokens: u32) -> Conv {
        let seed = splitmix64(nonce ^ splitmix64(id));
        let chunks = 1 + (splitmix64(seed ^ 0xC4) % u64::from(max_chunks.max(1))) as u32;
        let tokens: Vec<u32> = (0..u64::from(chunks * chunk_tokens))
            .map(|i| match i {
                0 => (seed >> 32) as u32,
                1 => seed as u32,
                _ => splitmix64(seed.wrapping_add(i)) as u32,
            })
            .collect();
        let hashes = ChunkRangeBuilder::worker(MODEL, 1, 0)
            .tokens(&tokens, chunk_tokens)
            .chunk_hashes;
        Conv { id, tokens, hashes }
    }

    /// Chunks of the conversation.
    pub fn chunks(&self) -> u32 {
        self.hashes.len() as u32
    }
}

/// One slot handed out by PREPARE.
pub struct Slot {
    /// Offset in the pool.
    pub offset: u64,
    /// Bytes.
    pub length: u64,
    /// Chunk of the conversation it holds.
    pub chunk: u32,
}

/// A prepared transfer.
pub struct Prepared {
    /// Native transfer id (0 for LMCache, which pairs by key).
    pub transfer_id: u64,
    /// The slots.
    pub slots: Vec<Slot>,
}

/// The operations a worker needs, over either protocol. `req` is the request / session id.
pub trait Engine {
    /// The mapped pool.
    fn pool(&self) -> &PoolRegion;
    /// Heartbeat.
    fn ping(&mut self) -> Result<(), Error>;
    /// PREPARE_STORE of the first `n` chunks of `conv`.
    fn prepare_store(&mut self, conv: &Conv, n: u32, req: &str) -> Result<Prepared, Error>;
    /// COMMIT_STORE; `false` when the node no longer knew the transfer.
    fn commit_store(&mut self, conv: &Conv, n: u32, req: &str, p: &Prepared)
        -> Result<bool, Error>;
    /// ABORT_STORE; `false` when the protocol has none (LMCache).
    fn abort_store(&mut self, p: &Prepared) -> Result<bool, Error>;
    /// LOOKUP of all of `conv` under session `req`: prefix hit count in chunks.
    fn lookup(&mut self, conv: &Conv, req: &str) -> Result<u32, Error>;
    /// PREPARE_RETRIEVE of the first `n` chunks (with the lookup locks of `req` if `looked_up`).
    fn prepare_retrieve(
        &mut self,
        conv: &Conv,
        n: u32,
        req: &str,
        looked_up: bool,
    ) -> Result<Option<Prepared>, Error>;
    /// COMMIT_RETRIEVE; `false` when the node no longer knew the transfer (its locks expired).
    fn commit_retrieve(
        &mut self,
        conv: &Conv,
        n: u32,
        req: &str,
        p: &Prepared,
    ) -> Result<bool, Error>;
    /// FREE_LOOKUP_LOCKS over all of `conv`.
    fn free_lookup_locks(&mut self, conv: &Conv, req: &str) -> Result<(), Error>;
    /// END_SESSION of a lookup session.
    fn end_session(&mut self, req: &str) -> Result<(), Error>;
    /// End of a request that took no lookup (LMCache: END_SESSION drops its cached hashes).
    fn end_request(&mut self, req: &str) -> Result<(), Error>;
    /// UNREGISTER.
    fn unregister(&mut self) -> Result<(), Error>;
}

/// A native engine: `kvnode::client::Client` on the node's socket.
pub struct NativeEngine {
    client: Client,
    id: u64,
}

impl NativeEngine {
    /// Connects and registers instance `id`; returns the engine and the chunk size.
    pub fn connect(socket: &std::path::Path, id: u64) -> Result<(NativeEngine, u32), Error> {
        let mut client = Client::connect(socket)?;
        let reply = client.register(&RegisterRequest {
            instance_id: id,
            model: MODEL.into(),
            world_size: 1,
            block_size: 16,
            num_layers: LAYERS,
            hidden_dim: HIDDEN,
            dtype: DTYPE.into(),
            use_mla: false,
            physical_slots: None,
        })?;
        Ok((NativeEngine { client, id }, reply.chunk_tokens))
    }

    fn range(conv: &Conv, n: u32) -> kvnode::protocol::ChunkRange {
        ChunkRangeBuilder::worker(MODEL, 1, 0).hashes(0, conv.hashes[..n as usize].to_vec())
    }

    fn slots(slots: &[kvnode::protocol::WireSlot], chunks: &[u32]) -> Vec<Slot> {
        slots
            .iter()
            .zip(chunks)
            .map(|(s, &chunk)| Slot {
                offset: s.offset,
                length: s.length,
                chunk,
            })
            .collect()
    }
}

/// Whether a failed commit means "the node dropped the transfer" (not a protocol failure).
fn dropped(e: &Error) -> bool {
    matches!(e.kind, ErrorKind::UnknownTransfer)
}

impl Engine for NativeEngine {
    fn pool(&self) -> &PoolRegion {
        self.client.pool().expect("registered clients have a pool")
    }
    fn ping(&mut self) -> Result<(), Error> {
        self.client.ping(Some(self.id))
    }
    fn prepare_store(&mut self, conv: &Conv, n: u32, _req: &str) -> Result<Prepared, Error> {
        let p = self.client.prepare_store(self.id, &Self::range(conv, n))?;
        Ok(Prepared {
            transfer_id: p.transfer_id,
            slots: Self::slots(&p.slots, &p.chunk_indices),
        })
    }
    fn commit_store(&mut self, _: &Conv, _: u32, _: &str, p: &Prepared) -> Result<bool, Error> {
        match self.client.commit_store(self.id, p.transfer_id) {
            Ok(_) => Ok(true),
            Err(e) if dropped(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }
    fn abort_store(&mut self, p: &Prepared) -> Result<bool, Error> {
        self.client
            .abort_store(self.id, p.transfer_id)
            .map(|_| true)
    }
    fn lookup(&mut self, conv: &Conv, req: &str) -> Result<u32, Error> {
        let range = ChunkRangeBuilder::all_ranks(MODEL, 1).hashes(0, conv.hashes.clone());
        self.client.lookup(req, &range, 1)
    }
    fn prepare_retrieve(
        &mut self,
        conv: &Conv,
        n: u32,
        req: &str,
        looked_up: bool,
    ) -> Result<Option<Prepared>, Error> {
        let session = looked_up.then_some(req);
        let p = self
            .client
            .prepare_retrieve(self.id, &Self::range(conv, n), session)?;
        Ok(p.map(|p| Prepared {
            transfer_id: p.transfer_id,
            slots: Self::slots(&p.slots, &(0..n).collect::<Vec<_>>()),
        }))
    }
    fn commit_retrieve(&mut self, _: &Conv, _: u32, _: &str, p: &Prepared) -> Result<bool, Error> {
        match self.client.commit_retrieve(self.id, p.transfer_id) {
            Ok(()) => Ok(true),
            Err(e) if dropped(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }
    fn free_lookup_locks(&mut self, conv: &Conv, req: &str) -> Result<(), Error> {
        self.client.free_lookup_locks(req, 0, conv.chunks())
    }
    fn end_session(&mut self, req: &str) -> Result<(), Error> {
        self.client.end_session(req)
    }
    fn end_request(&mut self, _req: &str) -> Result<(), Error> {
        Ok(())
    }
    fn unregister(&mut self) -> Result<(), Error> {
        self.client.unregister(self.id).map(drop)
    }
}
