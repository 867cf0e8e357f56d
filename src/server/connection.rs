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
use crate::modules::NodeContext;
use crate::protocol::frame::{
    decode_request, encode_response, FrameError, FrameReader, FrameSource, PlainSource,
};
use crate::protocol::Response;
use crate::transport::uds::UdsReplySink;
use crate::transport::ReplySink;

/// Most bytes of replies that may wait for one client to read them (replies are never written
/// with a blocking send: what the socket does not take waits in the connection's queue). A
/// client whose queue would pass it does not read its replies: its connection is closed and its
/// instances released, so it can neither stall a worker shard nor hold unbounded memory. A
/// single reply always fits an empty queue, whatever its size. Node-wide bound: this times
/// `limits.max_connections`.
pub const REPLY_QUEUE_BYTES: usize = 1 << 20;

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
    if ctx.access.role(sink.peer().as_ref()) == Role::Refused {
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
    serve_frames(ctx, &mut PlainSource(&*stream), &sink);
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// The transport-independent connection loop: read frames from `src`, validate, dispatch, answer
/// through `sink`; on close, release at once the instances registered over this connection.
/// Any transport (Unix socket now, TCP or RDMA later) runs its connections through this.
pub fn serve_frames<S: FrameSource>(
    ctx: &Arc<NodeContext>,
    src: &mut S,
    sink: &Arc<dyn ReplySink>,
) {
    let id = sink.connection_id();
    let mut payload = AlignedVec::<16>::new();
    let mut reader = FrameReader::default();
    let mut registered = dispatch::Registered::default();
    tracing::debug!(connection = id, "client connected");
    loop {
        if ctx.shutting_down.load(Ordering::Acquire) {
            break;
        }
        match reader.read_frame(src, &mut payload) {
            Ok(None) => break,
            Ok(Some((header, _))) => match decode_request(&header, &payload) {
                Ok(req) => dispatch::dispatch(ctx, sink, header.request_id, req, &mut registered),
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
            },
            Err(FrameError::Truncated) | Err(FrameError::Io(_)) => break,
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
    ctx.connection_closed(id, &registered.ids());
    tracing::debug!(connection = id, "client disconnected");
}
