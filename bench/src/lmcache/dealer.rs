//! The load generator's LMCache client: one ZMQ DEALER speaking the 0.5.6 client's frames
//! (`[uid, type, payload...]` out, `[uid, type, (reply)]` back, msgpack documents built with
//! `kvnode::lmcache::wire`'s encoders), timing each call on the wire: from just after the send
//! returns to the reply's arrival, before it is decoded.

use std::time::{Duration, Instant};

use kvnode::lmcache::wire::{self, IpcKey, Op};
use rmpv::Value;

/// How long a reply may take before the run fails (a hung server fails loudly, never hangs).
pub const REPLY_TIMEOUT_MS: i32 = 60_000;

/// One connection. Invariant: requests are strictly sequential (one outstanding at a time), so
/// each reply belongs to the request just sent.
pub struct Dealer {
    sock: zmq::Socket,
    _ctx: zmq::Context,
    uid: u64,
}

/// A decoded reply and the call's wire time.
pub struct Answer {
    /// The reply's third frame, decoded (`None`: the server sent no payload frame).
    pub value: Option<Value>,
    /// From just after the send to the reply's arrival.
    pub wire: Duration,
}

impl Dealer {
    /// Connects to `url` (e.g. `tcp://127.0.0.1:5555`).
    pub fn connect(url: &str) -> Result<Dealer, String> {
        let ctx = zmq::Context::new();
        let sock = ctx
            .socket(zmq::DEALER)
            .map_err(|e| format!("zmq socket: {e}"))?;
        sock.set_rcvtimeo(REPLY_TIMEOUT_MS)
            .and_then(|()| sock.set_sndtimeo(REPLY_TIMEOUT_MS))
            .and_then(|()| sock.set_linger(0))
            .map_err(|e| format!("zmq options: {e}"))?;
        sock.connect(url)
            .map_err(|e| format!("zmq connect {url}: {e}"))?;
        Ok(Dealer {
            sock,
            _ctx: ctx,
            uid: 0,
        })
    }

    /// One request/reply round trip.
    pub fn call(&mut self, op: Op, payload: Vec<Vec<u8>>) -> Result<Answer, String> {
        let uid = wire::encode_uint(self.uid);
        self.uid += 1;
        let typ = wire::encode_op(op);
        let mut frames = Vec::with_capacity(2 + payload.len());
        frames.push(uid.clone());
        frames.push(typ.clone());
        frames.extend(payload);
        self.sock
            .send_multipart(frames, 0)
            .map_err(|e| format!("zmq send {op:?}: {e}"))?;
        let sent = Instant::now();
        let reply = self
            .sock
            .recv_multipart(0)
            .map_err(|e| format!("no reply to {op:?} within {REPLY_TIMEOUT_MS} ms: {e}"))?;
        let wire_time = sent.elapsed();
        if !(2..=3).contains(&reply.len()) || reply[0] != uid || reply[1] != typ {
            return Err(format!("malformed reply to {op:?}: {} frames", reply.len()));
        }
        let value = reply
            .get(2)
            .map(|f| {
                rmpv::decode::read_value(&mut f.as_slice())
                    .map_err(|e| format!("reply to {op:?} does not decode: {e}"))
            })
            .transpose()?;
        Ok(Answer {
            value,
            wire: wire_time,
        })
    }
}

/// The 0.5.6 client's `RegisterEngineDrivenContextPayload` (9 fields, `num_physical_slots`
/// last, as `lmcache_driver.py` sends it: one physical slot per token of a chunk).
pub fn register_payload(
    instance_id: u64,
    model: &str,
    layers: u32,
    hidden: u32,
    dtype: &str,
    chunk_tokens: u32,
) -> Vec<u8> {
    use rmpv::Value as V;
    let fields: Vec<(&str, V)> = vec![
        ("instance_id", V::from(instance_id)),
        ("model_name", V::from(model)),
        ("world_size", V::from(1u32)),
        ("block_size", V::from(16u32)),
        ("num_layers", V::from(layers)),
        ("hidden_dim_size", V::from(hidden)),
        ("dtype_str", V::from(dtype)),
        ("use_mla", V::from(false)),
        ("num_physical_slots", V::from(chunk_tokens)),
    ];
    let map = V::Map(fields.into_iter().map(|(k, v)| (V::from(k), v)).collect());
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &map).expect("writing to a Vec cannot fail");
    out
}

/// A 0.5.6 key (10 fields, `num_kv_readers` 1) over `tokens`, for worker 0 or, for the
/// scheduler's LOOKUP, no worker.
pub fn key(model: &str, tokens: &[u32], worker: Option<u32>, request_id: &str) -> Vec<u8> {
    wire::encode_key(
        &IpcKey {
            model_name: model.into(),
            world_size: 1,
            worker_id: worker,
            token_ids: tokens.to_vec(),
            start: 0,
            end: tokens.len() as u64,
            request_id: request_id.into(),
            cache_salt: String::new(),
            num_kv_readers: 1,
        },
        true,
    )
}

/// A msgpack float64 (WAIT_PREFETCH_STATUS's timeout, as Python's msgspec sends it).
pub fn float(v: f64) -> Vec<u8> {
    let mut out = vec![0xcb];
    out.extend_from_slice(&v.to_be_bytes());
    out
}

/// A map field of a reply.
pub fn field<'a>(v: &'a Value, k: &str) -> Result<&'a Value, String> {
    v.as_map()
        .and_then(|m| m.iter().find(|(kk, _)| kk.as_str() == Some(k)))
        .map(|(_, vv)| vv)
        .ok_or_else(|| format!("reply without field {k}: {v}"))
}

/// An unsigned integer of a reply.
pub fn uint(v: &Value, what: &str) -> Result<u64, String> {
    v.as_u64()
        .ok_or_else(|| format!("{what}: expected an integer, got {v}"))
}

/// The `(offset, length)` of each slot of a PREPARE_* reply's context.
pub fn slots(ctx: &Value) -> Result<Vec<(u64, u64)>, String> {
    field(ctx, "slots")?
        .as_array()
        .ok_or("slots is not an array")?
        .iter()
        .map(|s| {
            Ok((
                uint(field(s, "offset")?, "offset")?,
                uint(field(s, "length")?, "length")?,
            ))
        })
        .collect()
}
