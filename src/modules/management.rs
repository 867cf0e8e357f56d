//! Management requests answered inline on the transport thread (never queued behind transfers,
//! so a busy node still answers PING: LMCache weak point P2): NOOP, PING, GET_CHUNK_SIZE,
//! REPORT_BLOCK_ALLOCATION, CLEAR, STATUS, MEMCHECK, plus the dispatch of LOOKUP-family requests.

use std::sync::atomic::Ordering;

use super::caller::Caller;
use super::context::NodeContext;
use super::events::Event;
use super::lookup;
use crate::access::Role;
use crate::error::{Error, Result};
use crate::protocol::{Request, Response};

/// Answers a request that has no instance affinity. Registration is handled by the dispatcher
/// (its reply carries a file descriptor).
/// Requests about an instance are accepted only from a connection that registered it; CLEAR
/// and MEMCHECK only from admins; a non-admin's STATUS lists only its own user's instances;
/// lookup sessions live in the caller's user name space.
pub fn handle_inline(ctx: &NodeContext, caller: &Caller, req: Request) -> Result<Response> {
    let req_opcode = req.opcode();
    match req {
        Request::Noop => Ok(Response::Text("OK".into())),
        Request::Ping { instance_id } => {
            if let Some(inst) = instance_id.and_then(|id| ctx.instances.get(id)) {
                caller.require_attached(&inst)?;
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
                caller.require_attached(&inst)?;
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
            readers,
        } => lookup::lookup(
            ctx,
            caller.session_owner(),
            caller.connection,
            &request_id,
            &range,
            tp_size,
            readers,
        ),
        Request::FreeLookupLocks {
            request_id,
            start_chunk,
            end_chunk,
        } => lookup::free_lookup_locks(
            ctx,
            caller.session_owner(),
            caller.connection,
            &request_id,
            start_chunk,
            end_chunk,
        ),
        Request::EndSession { request_id } => {
            lookup::end_session(ctx, caller.session_owner(), caller.connection, &request_id)
        }
        Request::Clear => {
            caller.require_admin("CLEAR")?;
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
            let mut report = super::status::report(ctx);
            if caller.role < Role::Admin {
                // A client sees the node's totals, its transports and its own user's (or remote
                // trust domain's) instances only.
                let uid = caller.session_owner();
                report.parts.retain(|k, _| k == "transports");
                report.instances.retain(|i| {
                    ctx.instances
                        .get(i.id)
                        .is_some_and(|inst| inst.session_owner == uid)
                });
            }
            serde_json::to_string(&report)
                .map(Response::Text)
                .map_err(|e| Error::internal(format!("status serialisation: {e}")))
        }
        Request::Memcheck => {
            caller.require_admin("MEMCHECK")?;
            let r = ctx.memcheck();
            if !r.ok {
                tracing::error!(problems = ?r.problems, "memcheck failed");
            }
            Ok(Response::Memcheck {
                ok: r.ok,
                problems: r.problems,
            })
        }
        Request::WriteSlots { .. }
        | Request::ReadSlots { .. }
        | Request::RegisterBuffers { .. }
        | Request::UnregisterBuffers { .. } => Err(Error::new(
            crate::error::ErrorKind::Unsupported,
            format!(
                "opcode {} is for remote engines (TCP or RDMA connections); a local engine \
                 copies into the pool slots itself",
                req_opcode
            ),
        )),
        other => {
            ctx.counters.errors.fetch_add(1, Ordering::Relaxed);
            Err(Error::internal(format!(
                "opcode {} has instance affinity but reached the inline handler",
                other.opcode()
            )))
        }
    }
}
