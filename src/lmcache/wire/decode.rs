//! Payload frames: [`decode_request`] checks an op's frame count, then decodes each payload
//! frame as exactly one msgpack document (keys, register payloads, block-allocation records).

use super::reader::{Reader, Tok};
use super::{field_err, BlockRecord, IpcKey, LmRequest, Op, RegisterPayload, Result, WireError};

/// Decodes the payload frames of `op` (`name` is the printable name from [`parse_op`], used in
/// errors). Checks the frame count first, then decodes each frame as exactly one msgpack
/// document (trailing bytes are an error). Ops kvnode does not serve yield
/// [`LmRequest::Unsupported`] without looking at the payload.
///
/// [`parse_op`]: super::parse_op
pub fn decode_request(
    op: Op,
    name: &str,
    payload: &[&[u8]],
) -> std::result::Result<LmRequest, WireError> {
    decode_request_limited(op, name, payload, usize::MAX)
}

/// [`decode_request`] refusing a key of more than `max_tokens` tokens, and a block-allocation
/// report of more than `max_tokens` ids in all, with [`WireError::Limit`] (naming
/// `max_tokens_per_request`) as soon as the array header announces them, before anything is
/// allocated for them.
pub fn decode_request_limited(
    op: Op,
    name: &str,
    payload: &[&[u8]],
    max_tokens: usize,
) -> std::result::Result<LmRequest, WireError> {
    let decode_key = |r: &mut Reader<'_>| decode_key(r, max_tokens);
    let decode_records = |r: &mut Reader<'_>| decode_records(r, max_tokens);
    let n = payload.len();
    let count_err = |expected: &str| WireError::FrameCount {
        op: name.to_string(),
        expected: expected.to_string(),
        got: n,
    };
    let expect = |want: usize| -> Result<()> {
        if n == want {
            Ok(())
        } else {
            Err(count_err(&want.to_string()))
        }
    };
    match op {
        Op::RegisterKvCache
        | Op::UnregisterKvCache
        | Op::Store
        | Op::Retrieve
        | Op::Unsupported => Ok(LmRequest::Unsupported {
            op,
            name: name.to_string(),
        }),
        Op::GetChunkSize => expect(0).map(|_| LmRequest::GetChunkSize),
        Op::GetExperimental => expect(0).map(|_| LmRequest::GetExperimental),
        Op::Noop => expect(0).map(|_| LmRequest::Noop),
        Op::Ping => {
            expect(1)?;
            let instance_id = frame(payload, 0, |r| r.read_opt_u64("instance_id"))?;
            Ok(LmRequest::Ping { instance_id })
        }
        Op::RegisterEngineDriven => {
            expect(1)?;
            let p = frame(payload, 0, decode_register_payload)?;
            Ok(LmRequest::RegisterEngineDriven(p))
        }
        Op::UnregisterEngineDriven => {
            expect(1)?;
            let instance_id = frame(payload, 0, |r| r.read_u64("instance_id"))?;
            Ok(LmRequest::UnregisterEngineDriven { instance_id })
        }
        Op::PrepareStore | Op::PrepareRetrieve | Op::CommitRetrieve => {
            expect(2)?;
            let key = frame(payload, 0, decode_key)?;
            let instance_id = frame(payload, 1, |r| r.read_u64("instance_id"))?;
            Ok(match op {
                Op::PrepareStore => LmRequest::PrepareStore { key, instance_id },
                Op::PrepareRetrieve => LmRequest::PrepareRetrieve { key, instance_id },
                _ => LmRequest::CommitRetrieve { key, instance_id },
            })
        }
        Op::CommitStore => {
            if n != 2 && n != 3 {
                return Err(count_err("2 or 3"));
            }
            let key = frame(payload, 0, decode_key)?;
            let instance_id = frame(payload, 1, |r| r.read_u64("instance_id"))?;
            let cpu_data = if n == 3 {
                frame(payload, 2, |r| r.read_bin("cpu_data"))?
            } else {
                Vec::new()
            };
            Ok(LmRequest::CommitStore {
                key,
                instance_id,
                cpu_data,
            })
        }
        Op::Lookup | Op::FreeLookupLocks => {
            expect(2)?;
            let key = frame(payload, 0, decode_key)?;
            let tp_size = frame(payload, 1, |r| r.read_u32("tp_size"))?;
            Ok(if op == Op::Lookup {
                LmRequest::Lookup { key, tp_size }
            } else {
                LmRequest::FreeLookupLocks { key, tp_size }
            })
        }
        Op::QueryPrefetchStatus | Op::QueryPrefetchLookupHits | Op::EndSession => {
            expect(1)?;
            let request_id = frame(payload, 0, |r| r.read_str("request_id"))?;
            Ok(match op {
                Op::QueryPrefetchStatus => LmRequest::QueryPrefetchStatus { request_id },
                Op::QueryPrefetchLookupHits => LmRequest::QueryPrefetchLookupHits { request_id },
                _ => LmRequest::EndSession { request_id },
            })
        }
        Op::WaitPrefetchStatus => {
            expect(2)?;
            let request_id = frame(payload, 0, |r| r.read_str("request_id"))?;
            let timeout = frame(payload, 1, |r| r.read_f64("timeout"))?;
            if !timeout.is_finite() {
                return Err(field_err(
                    "timeout",
                    format!("not a finite number: {timeout}"),
                ));
            }
            Ok(LmRequest::WaitPrefetchStatus {
                request_id,
                timeout_secs: timeout.max(0.0),
            })
        }
        Op::ReportBlockAllocation => {
            expect(3)?;
            let instance_id = frame(payload, 0, |r| r.read_u64("instance_id"))?;
            let model_name = frame(payload, 1, |r| r.read_str("model_name"))?;
            let records = frame(payload, 2, decode_records)?;
            Ok(LmRequest::ReportBlockAllocation {
                instance_id,
                model_name,
                records,
            })
        }
        Op::Clear => {
            let force = match n {
                0 => None,
                1 => frame(payload, 0, |r| r.read_opt_bool("force"))?,
                _ => return Err(count_err("0 or 1")),
            };
            Ok(LmRequest::Clear { force })
        }
    }
}

/// Decodes payload frame `idx` with `f`, requiring that `f` consumes the whole frame.
fn frame<T>(
    payload: &[&[u8]],
    idx: usize,
    f: impl FnOnce(&mut Reader<'_>) -> Result<T>,
) -> Result<T> {
    let buf = payload.get(idx).copied().unwrap_or_default();
    let mut r = Reader::new(buf, idx + 2);
    let v = f(&mut r)?;
    r.finish()?;
    Ok(v)
}

fn missing(field: &str) -> WireError {
    field_err(field, "missing required field")
}

fn over_limit(field: &str, detail: String) -> WireError {
    WireError::Limit {
        field: field.to_string(),
        detail,
    }
}

fn decode_key(r: &mut Reader<'_>, max_tokens: usize) -> Result<IpcKey> {
    let n = r.read_map_len("key")?;
    let mut model_name = None;
    let mut world_size = None;
    let mut worker_id = None;
    let mut token_ids = None;
    let mut start = None;
    let mut end = None;
    let mut request_id = String::new();
    let mut cache_salt = String::new();
    let mut num_kv_readers = 0;
    for _ in 0..n {
        match r.read_key("key")? {
            b"model_name" => model_name = Some(r.read_str("key.model_name")?),
            b"world_size" => world_size = Some(r.read_u32("key.world_size")?),
            b"worker_id" => worker_id = Some(r.read_opt_u32("key.worker_id")?),
            b"token_ids" => {
                let field = "key.token_ids";
                let len = r.read_array_len(field)?;
                if len as usize > max_tokens {
                    return Err(over_limit(
                        field,
                        format!("{len} tokens: more than max_tokens_per_request = {max_tokens}"),
                    ));
                }
                let mut v = Vec::with_capacity(r.cap(len));
                for i in 0..len {
                    match r.next()? {
                        Tok::UInt(t) => match u32::try_from(t) {
                            Ok(t) => v.push(t),
                            Err(_) => {
                                return Err(field_err(
                                    field,
                                    format!("token id {t} at index {i} is not below 2^32"),
                                ))
                            }
                        },
                        Tok::NegInt(t) => {
                            return Err(field_err(
                                field,
                                format!("negative token id {t} at index {i}"),
                            ))
                        }
                        t => {
                            return Err(field_err(
                                field,
                                format!("expected integer token id at index {i}, got {}", t.kind()),
                            ))
                        }
                    }
                }
                token_ids = Some(v);
            }
            b"start" => start = Some(r.read_u64("key.start")?),
            b"end" => end = Some(r.read_u64("key.end")?),
            b"request_id" => request_id = r.read_str("key.request_id")?,
            b"cache_salt" => cache_salt = r.read_str("key.cache_salt")?,
            b"num_kv_readers" => num_kv_readers = r.read_u32("key.num_kv_readers")?,
            // request_configs and anything newer: ignored.
            _ => r.skip_value()?,
        }
    }
    let model_name = model_name.ok_or_else(|| missing("key.model_name"))?;
    if model_name.contains('@') {
        return Err(field_err("key.model_name", "must not contain '@'"));
    }
    if cache_salt
        .chars()
        .any(|c| matches!(c, '@' | '/' | '\\' | '\0'))
    {
        return Err(field_err(
            "key.cache_salt",
            "must not contain '@', '/', '\\' or NUL",
        ));
    }
    if cache_salt.chars().count() > 128 {
        return Err(field_err("key.cache_salt", "longer than 128 characters"));
    }
    Ok(IpcKey {
        model_name,
        world_size: world_size.ok_or_else(|| missing("key.world_size"))?,
        worker_id: worker_id.ok_or_else(|| missing("key.worker_id"))?,
        token_ids: token_ids.ok_or_else(|| missing("key.token_ids"))?,
        start: start.ok_or_else(|| missing("key.start"))?,
        end: end.ok_or_else(|| missing("key.end"))?,
        request_id,
        cache_salt,
        num_kv_readers,
    })
}

fn decode_register_payload(r: &mut Reader<'_>) -> Result<RegisterPayload> {
    let n = r.read_map_len("payload")?;
    let mut instance_id = None;
    let mut model_name = None;
    let mut world_size = None;
    let mut block_size = None;
    let mut num_layers = None;
    let mut hidden_dim_size = None;
    let mut dtype_str = None;
    let mut use_mla = None;
    let mut num_physical_slots = None;
    for _ in 0..n {
        match r.read_key("payload")? {
            b"instance_id" => instance_id = Some(r.read_u64("payload.instance_id")?),
            b"model_name" => model_name = Some(r.read_str("payload.model_name")?),
            b"world_size" => world_size = Some(r.read_u32("payload.world_size")?),
            b"block_size" => block_size = Some(r.read_u32("payload.block_size")?),
            b"num_layers" => num_layers = Some(r.read_u32("payload.num_layers")?),
            b"hidden_dim_size" => hidden_dim_size = Some(r.read_u32("payload.hidden_dim_size")?),
            b"dtype_str" => dtype_str = Some(r.read_str("payload.dtype_str")?),
            b"use_mla" => use_mla = Some(r.read_bool("payload.use_mla")?),
            b"num_physical_slots" => {
                num_physical_slots = r.read_opt_u32("payload.num_physical_slots")?;
                if num_physical_slots == Some(0) {
                    return Err(field_err(
                        "payload.num_physical_slots",
                        "must be positive, got 0",
                    ));
                }
            }
            _ => r.skip_value()?,
        }
    }
    Ok(RegisterPayload {
        instance_id: instance_id.ok_or_else(|| missing("payload.instance_id"))?,
        model_name: model_name.ok_or_else(|| missing("payload.model_name"))?,
        world_size: world_size.ok_or_else(|| missing("payload.world_size"))?,
        block_size: block_size.ok_or_else(|| missing("payload.block_size"))?,
        num_layers: num_layers.ok_or_else(|| missing("payload.num_layers"))?,
        hidden_dim_size: hidden_dim_size.ok_or_else(|| missing("payload.hidden_dim_size"))?,
        dtype_str: dtype_str.ok_or_else(|| missing("payload.dtype_str"))?,
        use_mla: use_mla.ok_or_else(|| missing("payload.use_mla"))?,
        num_physical_slots,
    })
}

/// Block-allocation records; `max_ids` bounds the records plus all their ids together.
fn decode_records(r: &mut Reader<'_>, max_ids: usize) -> Result<Vec<BlockRecord>> {
    let n = r.read_array_len("records")?;
    let mut left = max_ids;
    let mut take = |field: &str, k: usize| -> Result<()> {
        left = left.checked_sub(k).ok_or_else(|| {
            over_limit(
                field,
                format!("more records and ids than max_tokens_per_request = {max_ids}"),
            )
        })?;
        Ok(())
    };
    take("records", n as usize)?;
    let mut out = Vec::with_capacity(r.cap(n));
    for i in 0..n {
        let path = |f: &str| format!("records[{i}]{f}");
        let fields = r.read_map_len(&path(""))?;
        let mut req_id = None;
        let mut new_block_ids = None;
        let mut new_token_ids = None;
        for _ in 0..fields {
            match r.read_key(&path(""))? {
                b"req_id" => req_id = Some(r.read_str(&path(".req_id"))?),
                b"new_block_ids" => {
                    let f = path(".new_block_ids");
                    let len = r.read_array_len(&f)?;
                    take(&f, len as usize)?;
                    new_block_ids = Some(read_u64s(r, &f, len)?);
                }
                b"new_token_ids" => {
                    let f = path(".new_token_ids");
                    let len = r.read_array_len(&f)?;
                    take(&f, len as usize)?;
                    new_token_ids = Some(read_u64s(r, &f, len)?);
                }
                _ => r.skip_value()?,
            }
        }
        out.push(BlockRecord {
            req_id: req_id.ok_or_else(|| missing(&path(".req_id")))?,
            new_block_ids: new_block_ids.ok_or_else(|| missing(&path(".new_block_ids")))?,
            new_token_ids: new_token_ids.ok_or_else(|| missing(&path(".new_token_ids")))?,
        });
    }
    Ok(out)
}

/// The `len` integers of an array whose header was read.
fn read_u64s(r: &mut Reader<'_>, field: &str, len: u32) -> Result<Vec<u64>> {
    let mut v = Vec::with_capacity(r.cap(len));
    for _ in 0..len {
        v.push(r.read_u64(field)?);
    }
    Ok(v)
}
