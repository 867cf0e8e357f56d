//! One client connection: read frames, validate, dispatch; on close, release the instances this
//! connection registered at once (a dead local engine leaks nothing and waits for no timeout).

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use rkyv::util::AlignedVec;

use super::dispatch;
use crate::access::Role;
use crate::error::ErrorKind;
use crate::modules::Caller;
use crate::modules::NodeContext;
use crate::protocol::frame::{
    decode_request, encode_response, FrameError, FrameHeader, FrameReader, FrameSource,
    PlainSource, ReadLimits,
};
use crate::protocol::{Request, Response};
use crate::transport::uds::UdsReplySink;
use crate::transport::ReplySink;

/// Most bytes of replies that may wait for one client to read them (replies are never written
/// with a blocking send: what the socket does not take waits in the connection's queue). A
/// client whose queue would pass it does not read its replies: its connection is closed and its
/// instances released, so it can neither stall a worker shard nor hold unbounded memory. A
/// single reply always fits an empty queue, whatever its size. Node-wide bound: this times
/// `limits.max_connections`.
pub const REPLY_QUEUE_BYTES: usize = 4 << 20;

/// Answers a connection beyond the limit with a typed error and closes it.
pub fn refuse(mut stream: UnixStream, limit: usize) {
    let resp = Response::Error {
        kind: ErrorKind::LimitExceeded.code(),
        message: format!("too many connections (limit {limit})"),
    };
    if let Ok(f) = encode_response(0, 0, false, &resp) {
        let _ = stream.write_all(&f);
    }
}

/// Serves one Unix-socket connection: sets up its reply half, runs the frame loop, then releases
/// the instances this connection registered.
pub fn serve(ctx: &Arc<NodeContext>, stream: UnixStream, id: u64) {
    // One descriptor serves both halves: the reader below and the reply side (which writes
    // without blocking, so no timeout is needed on it).
    let stream = Arc::new(stream);
    let sink: Arc<dyn ReplySink> =
        Arc::new(UdsReplySink::new(stream.clone(), id, REPLY_QUEUE_BYTES));
    let role = ctx.access.role(sink.peer().as_ref());
    if role == Role::Refused {
        // The socket's mode normally keeps other users out; this holds when it does not.
        tracing::warn!(connection = id, peer = ?sink.peer(), "refused a peer not allowed by [access]");
        let resp = Response::Error {
            kind: ErrorKind::PermissionDenied.code(),
            message: format!(
                "user {} may not use this node (allowed: the node's user, root and [access] allow_uids/allow_gids)",
                sink.peer().map_or_else(|| "unknown".to_owned(), |p| p.uid.to_string())
            ),
        };
        sink.send(0, 0, &resp, None);
        let _ = stream.shutdown(std::net::Shutdown::Both);
        return;
    }
    // A client user (not an admin) holds at most its share of the connections.
    let _slot = match (role, sink.peer()) {
        (Role::Client, Some(p)) => match ctx.user_connections.take(p.uid) {
            Some(slot) => Some(slot),
            None => {
                let max = ctx.config.limits.max_connections_per_client_user;
                tracing::warn!(
                    connection = id,
                    uid = p.uid,
                    max,
                    "refused a connection over its user's share"
                );
                let resp = Response::Error {
                    kind: ErrorKind::LimitExceeded.code(),
                    message: format!(
                        "user {} has {max} connections open (limit max_connections_per_client_user)",
                        p.uid
                    ),
                };
                sink.send(0, 0, &resp, None);
                let _ = stream.shutdown(std::net::Shutdown::Both);
                return;
            }
        },
        _ => None,
    };
    serve_frames(ctx, &mut PlainSource(&*stream), &sink, &mut LocalHooks);
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// What a request intercepted by a transport's [`FrameHooks`] leads to.
pub enum Intercepted {
    /// Not the transport's: dispatch it as usual.
    Dispatch(Request),
    /// Answered by the transport; read the next frame.
    Done,
    /// Answered (or not answerable); the stream cannot go on: close the connection.
    Close,
}

/// What a transport adds to the transport-independent frame loop ([`serve_frames`]).
pub trait FrameHooks<S: FrameSource> {
    /// The caller identity of the connection when the transport decided it (remote engines:
    /// the handshake's role); `None`: from the sink's peer credentials.
    fn caller(&self) -> Option<Caller> {
        None
    }

    /// The deadlines of this connection's frames (defaults: the node's limits).
    fn read_limits(&self, ctx: &NodeContext) -> ReadLimits {
        ReadLimits {
            frame_timeout: Some(ctx.config.limits.frame_timeout()),
            idle_timeout: ctx.config.limits.idle_timeout(),
            retain_bytes: CONNECTION_RETAINED_PAYLOAD_BYTES,
        }
    }

    /// Whether silence past the idle deadline closes the connection even when it has live
    /// instances (remote engines heartbeat: silence means the engine or the network died).
    fn idle_is_death(&self) -> bool {
        false
    }

    /// Whether a frame of `opcode` may announce a trailer on this connection (then
    /// [`FrameHooks::intercept`] must consume it). Any other frame with a trailer is refused and
    /// the connection closed before the request is looked at.
    fn accepts_trailer(&self, _opcode: u16) -> bool {
        false
    }

    /// Sees every decoded request first (with its header, the reader and the stream, for
    /// requests whose bytes follow the frame). A frame announcing a trailer must be handled
    /// here: one returned for dispatch closes the connection.
    fn intercept(
        &mut self,
        header: &FrameHeader,
        req: Request,
        reader: &mut FrameReader,
        src: &mut S,
        registered: &mut dispatch::Registered,
    ) -> Intercepted;
}

/// The hooks of local (Unix-socket) connections: nothing is intercepted and no trailer is
/// accepted.
pub struct LocalHooks;

impl<S: FrameSource> FrameHooks<S> for LocalHooks {
    fn intercept(
        &mut self,
        _: &FrameHeader,
        req: Request,
        _: &mut FrameReader,
        _: &mut S,
        _: &mut dispatch::Registered,
    ) -> Intercepted {
        Intercepted::Dispatch(req)
    }
}

/// Answers a frame whose trailer nobody on this connection takes (a Unix socket, an opcode
/// without data, or a payload that failed to decode): the stream cannot be resynchronised.
fn refuse_trailer(ctx: &NodeContext, sink: &Arc<dyn ReplySink>, header: &FrameHeader) {
    tracing::warn!(
        connection = sink.connection_id(),
        opcode = header.opcode,
        trailer_bytes = header.trailer_len,
        "closing a connection after a frame with an unexpected trailer"
    );
    ctx.counters.errors.fetch_add(1, Ordering::Relaxed);
    let resp = Response::Error {
        kind: ErrorKind::InvalidRequest.code(),
        message: format!(
            "opcode {} may not carry a trailer ({} bytes announced) on this connection; \
             closing connection",
            header.opcode, header.trailer_len
        ),
    };
    sink.send(header.request_id, header.opcode, &resp, None);
}

/// Payload buffer capacity a connection keeps between frames. A larger buffer (a frame whose
/// payload did not fit in the read buffer) is freed as soon as its frame is decoded, so a
/// connection that once received 16 MiB does not keep them while it idles.
pub const CONNECTION_RETAINED_PAYLOAD_BYTES: usize = 128 << 10;

/// Whether an instance registered over connection `id` is still registered and still lists it.
fn has_live_instances(ctx: &NodeContext, id: u64, registered: &dispatch::Registered) -> bool {
    registered.ids().iter().any(|i| {
        ctx.instances
            .get(*i)
            .is_some_and(|inst| inst.connections.lock().contains(&id))
    })
}

/// The transport-independent connection loop: read frames from `src`, validate, dispatch, answer
/// through `sink`; on close, release at once the instances registered over this connection.
/// Any transport (Unix socket now, TCP or RDMA later) runs its connections through this.
///
/// Budgets: a frame must arrive within `limits.frame_timeout_ms` of its first byte (else the
/// client is answered `LimitExceeded` and disconnected); a connection without live instances
/// that sends nothing for `limits.idle_timeout_secs` is closed (one with instances is left to
/// liveness); large payloads are received within the node-wide
/// `limits.max_inflight_payload_bytes` (a frame that does not fit waits, within its deadline).
pub fn serve_frames<S: FrameSource, H: FrameHooks<S>>(
    ctx: &Arc<NodeContext>,
    src: &mut S,
    sink: &Arc<dyn ReplySink>,
    hooks: &mut H,
) {
    let id = sink.connection_id();
    let mut payload = AlignedVec::<16>::new();
    let limits = hooks.read_limits(ctx);
    let mut reader = FrameReader::new(limits, Some(Arc::clone(&ctx.payload_budget)));
    let mut registered = dispatch::Registered::default();
    if let Some(caller) = hooks.caller() {
        registered.set_caller(caller);
    }
    tracing::debug!(connection = id, "client connected");
    loop {
        if ctx.shutting_down.load(Ordering::Acquire) {
            break;
        }
        match reader.read_frame(src, &mut payload) {
            Ok(None) => break,
            Ok(Some((header, _))) => {
                if header.trailer_len > 0 && !hooks.accepts_trailer(header.opcode) {
                    refuse_trailer(ctx, sink, &header);
                    break;
                }
                let decoded = decode_request(&header, &payload);
                // The payload is no longer needed: its budget and a large buffer go back now,
                // not after the request has run.
                reader.finish(&mut payload);
                match decoded {
                    Ok(req) => {
                        match hooks.intercept(&header, req, &mut reader, src, &mut registered) {
                            Intercepted::Dispatch(_) if header.trailer_len > 0 => {
                                refuse_trailer(ctx, sink, &header);
                                break;
                            }
                            Intercepted::Dispatch(req) => dispatch::dispatch(
                                ctx,
                                sink,
                                header.request_id,
                                req,
                                &mut registered,
                            ),
                            Intercepted::Done => {}
                            Intercepted::Close => break,
                        }
                    }
                    Err(_) if header.trailer_len > 0 => {
                        refuse_trailer(ctx, sink, &header);
                        break;
                    }
                    Err(e) => {
                        // Framing is intact (the header was valid), so answer and keep going.
                        tracing::warn!(connection = id, error = %e, "rejected request payload");
                        ctx.counters.errors.fetch_add(1, Ordering::Relaxed);
                        let resp = Response::Error {
                            kind: ErrorKind::InvalidRequest.code(),
                            message: e.to_string(),
                        };
                        sink.send(header.request_id, header.opcode, &resp, None);
                    }
                }
            }
            Err(FrameError::Truncated) | Err(FrameError::Io(_)) => break,
            Err(FrameError::Idle { limit_ms }) => {
                if hooks.idle_is_death() {
                    tracing::info!(
                        connection = id,
                        silent_ms = limit_ms,
                        "closing a remote connection that sent nothing, not even a heartbeat \
                         (remote.dead_after_ms): its instances are released"
                    );
                    break;
                }
                if has_live_instances(ctx, id, &registered) {
                    // Its instances' liveness (pings, reap timeout, registration grace) decides.
                    continue;
                }
                tracing::info!(
                    connection = id,
                    idle_ms = limit_ms,
                    "closing a connection without instances that sent nothing for \
                     limits.idle_timeout_secs"
                );
                break;
            }
            Err(
                e @ (FrameError::Stalled {
                    request_id, opcode, ..
                }
                | FrameError::BudgetTimeout {
                    request_id, opcode, ..
                }),
            ) => {
                tracing::warn!(connection = id, request_id, error = %e, "closing a connection whose frame did not arrive in time");
                ctx.counters.errors.fetch_add(1, Ordering::Relaxed);
                let limits = if matches!(e, FrameError::BudgetTimeout { .. }) {
                    "limits.frame_timeout_ms, limits.max_inflight_payload_bytes"
                } else {
                    "limits.frame_timeout_ms"
                };
                let resp = Response::Error {
                    kind: ErrorKind::LimitExceeded.code(),
                    message: format!("{e} ({limits}); closing connection"),
                };
                sink.send(request_id, opcode, &resp, None);
                break;
            }
            Err(
                e @ FrameError::Oversized {
                    request_id, opcode, ..
                },
            ) => {
                // A typed refusal to the request that announced it. Its payload follows on the
                // stream and is never read: the connection closes.
                tracing::warn!(connection = id, request_id, error = %e, "closing connection after an oversized frame");
                ctx.counters.errors.fetch_add(1, Ordering::Relaxed);
                let resp = Response::Error {
                    kind: ErrorKind::LimitExceeded.code(),
                    message: format!("{e}; closing connection"),
                };
                sink.send(request_id, opcode, &resp, None);
                break;
            }
            Err(e) => {
                // A bad header: the stream cannot be resynchronised. Say why, then close.
                tracing::warn!(connection = id, error = %e, "closing connection after an unframeable header");
                ctx.counters.errors.fetch_add(1, Ordering::Relaxed);
                let resp = Response::Error {
                    kind: ErrorKind::InvalidRequest.code(),
                    message: format!("{e}; closing connection"),
                };
                sink.send(0, 0, &resp, None);
                break;
            }
        }
    }
    ctx.connection_closed(id, &registered.ids(), registered.looked_up());
    tracing::debug!(connection = id, "client disconnected");
}
