//! The soak's LMCache client: a ZMQ DEALER speaking LMCache's multiprocess frames (built with
//! `kvnode::lmcache::wire`'s encoders, replies decoded with `rmpv`), copying through the POSIX
//! shm segment the registration reply names (`kvnode_hw::PoolMapping::open_posix_shm`), the
//! engine-driven path an unmodified LMCache worker takes.

use kvnode::lmcache::wire::{self, IpcKey, Op, RegisterPayload};
use kvnode::{Error, ErrorKind};
use kvnode_hw::{PoolMapping, PoolRegion};
use rmpv::Value;

use crate::soak_engine::{Conv, Engine, Prepared, Slot, DTYPE, HIDDEN, LAYERS, MODEL};

/// How long a reply may take before the worker gives up (a hung node fails the soak loudly).
const REPLY_TIMEOUT_MS: i32 = 30_000;

/// A registered LMCache worker. Invariant: `pool` maps the segment the node named.
pub struct LmEngine {
    dealer: Dealer,
    _ctx: zmq::Context,
    instance: u64,
    pool: PoolMapping,
}

fn io(what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Io, format!("{what}: {e}"))
}

fn field<'a>(v: &'a Value, k: &str) -> Result<&'a Value, Error> {
    v.as_map()
        .and_then(|m| m.iter().find(|(kk, _)| kk.as_str() == Some(k)))
        .map(|(_, vv)| vv)
        .ok_or_else(|| Error::internal(format!("LMCache reply without field {k}: {v}")))
}

fn uint(v: &Value, what: &str) -> Result<u64, Error> {
    v.as_u64()
        .ok_or_else(|| Error::internal(format!("LMCache {what}: expected an integer, got {v}")))
}

impl LmEngine {
    /// Connects to `tcp://127.0.0.1:port`, registers `instance` engine-driven and maps the pool;
    /// returns the engine and the node's chunk size.
    pub fn connect(port: u16, instance: u64) -> Result<(LmEngine, u32), Error> {
        let ctx = zmq::Context::new();
        let sock = ctx.socket(zmq::DEALER).map_err(|e| io("zmq socket", e))?;
        sock.set_rcvtimeo(REPLY_TIMEOUT_MS)
            .and_then(|()| sock.set_sndtimeo(REPLY_TIMEOUT_MS))
            .and_then(|()| sock.set_linger(0))
            .map_err(|e| io("zmq options", e))?;
        sock.connect(&format!("tcp://127.0.0.1:{port}"))
            .map_err(|e| io("zmq connect", e))?;
        let mut d = Dealer { sock, uid: 0 };
        let chunk = d.call(Op::GetChunkSize, vec![])?;
        let chunk = uint(chunk.as_ref().unwrap_or(&Value::Nil), "GET_CHUNK_SIZE")?;
        let chunk = u32::try_from(chunk).map_err(|_| Error::internal("chunk size out of range"))?;
        let reg = RegisterPayload {
            instance_id: instance,
            model_name: MODEL.into(),
            world_size: 1,
            block_size: 16,
            num_layers: LAYERS,
            hidden_dim_size: HIDDEN,
            dtype_str: DTYPE.into(),
            use_mla: false,
            num_physical_slots: None,
        };
        let r = d
            .call(
                Op::RegisterEngineDriven,
                vec![wire::encode_register_payload(&reg)],
            )?
            .ok_or_else(|| Error::internal("REGISTER without a reply"))?;
        let shm = field(&r, "shm_name")?
            .as_str()
            .ok_or_else(|| Error::internal("shm_name is not a string"))?
            .to_owned();
        let size = uint(field(&r, "pool_size")?, "pool_size")?;
        let pool = PoolMapping::open_posix_shm(&shm, size)?;
        let mut e = LmEngine {
            dealer: d,
            _ctx: ctx,
            instance,
            pool,
        };
        e.ping()?;
        Ok((e, chunk))
    }

    fn call(&mut self, op: Op, payload: Vec<Vec<u8>>) -> Result<Option<Value>, Error> {
        self.dealer.call(op, payload)
    }

    fn inst(&self) -> Vec<u8> {
        wire::encode_uint(self.instance)
    }

    fn key(
        conv: &Conv,
        end_chunk: u32,
        chunk_tokens: u64,
        worker: Option<u32>,
        req: &str,
    ) -> Vec<u8> {
        wire::encode_key(
            &IpcKey {
                model_name: MODEL.into(),
                world_size: 1,
                worker_id: worker,
                token_ids: conv.tokens.clone(),
                start: 0,
                end: u64::from(end_chunk) * chunk_tokens,
                request_id: req.into(),
                cache_salt: String::new(),
                num_kv_readers: 1,
            },
            true,
        )
    }

    fn chunk_tokens(conv: &Conv) -> u64 {
        (conv.tokens.len() / conv.hashes.len().max(1)) as u64
    }

    fn slots(ctx: &Value, chunks: Option<&Value>) -> Result<Vec<Slot>, Error> {
        let slots = field(ctx, "slots")?
            .as_array()
            .ok_or_else(|| Error::internal("slots is not an array"))?;
        let idx: Vec<u32> = match chunks {
            Some(c) => c
                .as_array()
                .ok_or_else(|| Error::internal("chunk_indices is not an array"))?
                .iter()
                .map(|v| uint(v, "chunk index").map(|i| i as u32))
                .collect::<Result<_, _>>()?,
            None => (0..slots.len() as u32).collect(),
        };
        if idx.len() != slots.len() {
            return Err(Error::internal(format!(
                "{} slots, {} chunk indices",
                slots.len(),
                idx.len()
            )));
        }
        slots
            .iter()
            .zip(idx)
            .map(|(s, chunk)| {
                Ok(Slot {
                    offset: uint(field(s, "offset")?, "offset")?,
                    length: uint(field(s, "length")?, "length")?,
                    chunk,
                })
            })
            .collect()
    }

    fn expect_bool(r: Option<Value>, what: &str) -> Result<bool, Error> {
        r.as_ref()
            .and_then(Value::as_bool)
            .ok_or_else(|| Error::internal(format!("{what}: expected a bool, got {r:?}")))
    }
}

/// One DEALER request/reply: `[uid, type, payload...]` out, `[uid, type, (reply)]` back.
struct Dealer {
    sock: zmq::Socket,
    uid: u64,
}

impl Dealer {
    fn call(&mut self, op: Op, payload: Vec<Vec<u8>>) -> Result<Option<Value>, Error> {
        let uid = wire::encode_uint(self.uid);
        self.uid += 1;
        let typ = wire::encode_op(op);
        let mut frames = vec![uid.clone(), typ.clone()];
        frames.extend(payload);
        self.sock
            .send_multipart(frames, 0)
            .map_err(|e| io("zmq send", e))?;
        let reply = self
            .sock
            .recv_multipart(0)
            .map_err(|e| io(&format!("no reply to {op:?}"), e))?;
        if !(2..=3).contains(&reply.len()) || reply[0] != uid || reply[1] != typ {
            return Err(Error::internal(format!(
                "malformed reply to {op:?}: {} frames",
                reply.len()
            )));
        }
        reply
            .get(2)
            .map(|f| {
                rmpv::decode::read_value(&mut f.as_slice())
                    .map_err(|e| Error::internal(format!("reply to {op:?} does not decode: {e}")))
            })
            .transpose()
    }
}

impl Engine for LmEngine {
    fn pool(&self) -> &PoolRegion {
        self.pool.region()
    }

    fn ping(&mut self) -> Result<(), Error> {
        let r = self.call(Op::Ping, vec![self.inst()])?;
        Self::expect_bool(r, "PING").map(drop)
    }

    fn prepare_store(&mut self, conv: &Conv, n: u32, req: &str) -> Result<Prepared, Error> {
        let key = Self::key(conv, n, Self::chunk_tokens(conv), Some(0), req);
        let r = self
            .call(Op::PrepareStore, vec![key, self.inst()])?
            .ok_or_else(|| Error::internal("PREPARE_STORE without a reply"))?;
        let ctx = field(&r, "context")?;
        if field(ctx, "slots").is_err() {
            // No slot list: nothing was reserved (out of memory, a budget, a refusal). The
            // empty list, by contrast, means "already cached".
            return Err(Error::new(
                ErrorKind::OutOfMemory,
                "PREPARE_STORE reserved nothing (no slot list)",
            ));
        }
        let slots = Self::slots(ctx, Some(field(ctx, "chunk_indices")?))?;
        Ok(Prepared {
            transfer_id: 0,
            slots,
        })
    }

    fn commit_store(
        &mut self,
        conv: &Conv,
        n: u32,
        req: &str,
        _: &Prepared,
    ) -> Result<bool, Error> {
        let key = Self::key(conv, n, Self::chunk_tokens(conv), Some(0), req);
        let r = self.call(Op::CommitStore, vec![key, self.inst(), vec![0xc4, 0x00]])?;
        Self::expect_bool(r, "COMMIT_STORE")
    }

    fn abort_store(&mut self, _: &Prepared) -> Result<bool, Error> {
        Ok(false)
    }

    fn lookup(&mut self, conv: &Conv, req: &str) -> Result<u32, Error> {
        let key = Self::key(conv, conv.chunks(), Self::chunk_tokens(conv), None, req);
        self.call(Op::Lookup, vec![key, wire::encode_uint(1)])?;
        let r = self.call(Op::QueryPrefetchStatus, vec![wire::encode_str(req)])?;
        let hits = uint(r.as_ref().unwrap_or(&Value::Nil), "QUERY_PREFETCH_STATUS")?;
        Ok(u32::try_from(hits).unwrap_or(u32::MAX))
    }

    fn prepare_retrieve(
        &mut self,
        conv: &Conv,
        n: u32,
        req: &str,
        _looked_up: bool,
    ) -> Result<Option<Prepared>, Error> {
        let key = Self::key(conv, n, Self::chunk_tokens(conv), Some(0), req);
        let r = self
            .call(Op::PrepareRetrieve, vec![key, self.inst()])?
            .ok_or_else(|| Error::internal("PREPARE_RETRIEVE without a reply"))?;
        if field(&r, "success")?.as_bool() != Some(true) {
            return Ok(None);
        }
        let slots = Self::slots(field(&r, "context")?, None)?;
        Ok(Some(Prepared {
            transfer_id: 0,
            slots,
        }))
    }

    fn commit_retrieve(
        &mut self,
        conv: &Conv,
        n: u32,
        req: &str,
        _: &Prepared,
    ) -> Result<bool, Error> {
        let key = Self::key(conv, n, Self::chunk_tokens(conv), Some(0), req);
        let r = self.call(Op::CommitRetrieve, vec![key, self.inst()])?;
        // LMCache's COMMIT_RETRIEVE answers true whether or not the transfer was still known.
        Self::expect_bool(r, "COMMIT_RETRIEVE")
    }

    fn free_lookup_locks(&mut self, conv: &Conv, req: &str) -> Result<(), Error> {
        let key = Self::key(conv, conv.chunks(), Self::chunk_tokens(conv), None, req);
        self.call(Op::FreeLookupLocks, vec![key, wire::encode_uint(1)])
            .map(drop)
    }

    fn end_session(&mut self, req: &str) -> Result<(), Error> {
        self.call(Op::EndSession, vec![wire::encode_str(req)])
            .map(drop)
    }

    fn end_request(&mut self, req: &str) -> Result<(), Error> {
        self.end_session(req)
    }

    fn unregister(&mut self) -> Result<(), Error> {
        self.call(Op::UnregisterEngineDriven, vec![self.inst()])
            .map(drop)
    }
}
