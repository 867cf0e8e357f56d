//! Management requests answered inline on the transport thread (never queued behind transfers,
//! so a busy node still answers PING: LMCache weak point P2): NOOP, PING, GET_CHUNK_SIZE,
//! REPORT_BLOCK_ALLOCATION, CLEAR, STATUS, MEMCHECK, plus the dispatch of LOOKUP-family requests.

use std::sync::atomic::Ordering;

use super::context::NodeContext;
use super::events::Event;
use super::lookup;
use crate::error::{Error, Result};
use crate::protocol::{Request, Response};

/// Answers a request that has no instance affinity. Registration is handled by the dispatcher
/// (its reply carries a file descriptor).
pub fn handle_inline(ctx: &NodeContext, req: Request) -> Result<Response> {
    match req {
        Request::Noop => Ok(Response::Text("OK".into())),
        Request::Ping { instance_id } => {
            if let Some(inst) = instance_id.and_then(|id| ctx.instances.get(id)) {
                inst.ping(ctx.now_ms());
            }
            Ok(Response::Ok)
        }
        Request::GetChunkSize => Ok(Response::Number(u64::from(ctx.config.chunk_tokens))),
        Request::ReportBlockAllocation {
            instance_id,
            model,
            records,
        } => {
            if let Some(inst) = ctx.instances.get(instance_id) {
                inst.touch(ctx.now_ms());
            }
            ctx.events.publish(Event::BlockAllocation {
                instance_id,
                model,
                records: records.len(),
                new_blocks: records.iter().map(|r| r.new_block_ids.len()).sum(),
            });
            Ok(Response::Ok)
        }
        Request::Lookup {
            request_id,
            range,
            tp_size,
        } => lookup::lookup(ctx, &request_id, &range, tp_size),
        Request::FreeLookupLocks {
            request_id,
            start_chunk,
            end_chunk,
        } => lookup::free_lookup_locks(ctx, &request_id, start_chunk, end_chunk),
        Request::EndSession { request_id } => lookup::end_session(ctx, &request_id),
        Request::Clear => {
            let (deleted, deferred) = match &ctx.l2 {
                None => ctx.storage.clear(),
                Some(l2) => {
                    let (l1, (removed, pending)) = l2
                        .clear_with(|| ctx.storage.clear())
                        .map_err(|e| e.context("clearing L2"))?;
                    tracing::info!(removed, pending, "L2 cleared");
                    l1
                }
            };
            tracing::info!(deleted, deferred, "cache cleared");
            Ok(Response::Cleared { deleted, deferred })
        }
        Request::Status => {
            let report = super::status::report(ctx);
            serde_json::to_string(&report)
                .map(Response::Text)
                .map_err(|e| Error::internal(format!("status serialisation: {e}")))
        }
        Request::Memcheck => {
            let r = ctx.memcheck();
            if !r.ok {
                tracing::error!(problems = ?r.problems, "memcheck failed");
            }
            Ok(Response::Memcheck {
                ok: r.ok,
                problems: r.problems,
            })
        }
        other => {
            ctx.counters.errors.fetch_add(1, Ordering::Relaxed);
            Err(Error::internal(format!(
                "opcode {} has instance affinity but reached the inline handler",
                other.opcode()
            )))
        }
    }
}
