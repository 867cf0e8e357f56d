//! One authenticated remote connection's frame hooks: the data ops (WRITE_SLOTS, READ_SLOTS)
//! and buffer registration run on the connection's reader thread, which owns the stream while a
//! store's trailer arrives or a retrieve's trailer leaves; every other request goes through the
//! ordinary dispatch (same semantics as local engines).
//!
//! Data paths: `DataPath::Inline` (the bytes on the TCP stream, as a trailer) works on every
//! connection, including one that chose RDMA (an engine may send small or unregistered data
//! inline); `DataPath::Remote(bufs)` (descriptors of the engine's registered memory, moved by
//! the node with RDMA READ/WRITE: [`super::rdma_ops`]) only on a connection that chose RDMA in
//! its handshake, with no trailer. A failed RDMA op closes the connection (its queue pair is
//! in error; the connection's end tears it down).

use std::io::Read;
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use kvnode_hw::fabric::{ConnId, Dir};

use super::descriptors::{stream_items, RegionTable};
use super::mover::{Mover, Pace};
use super::ops;
use super::rdma_ops::{read_remote, write_remote, DataOpOutcome, RemoteDataOp, RemotePath};
use super::registry::{RemoteConnInfo, RemoteRegistry};
use crate::config::RemoteConfig;
use crate::error::{Error, ErrorKind};
use crate::modules::{Caller, NodeContext};
use crate::protocol::frame::{
    encode_response_with_trailer, FrameHeader, FrameReader, PlainSource, HEARTBEAT_REQUEST_ID,
};
use crate::protocol::{DataPath, Request, Response};
use crate::server::connection::{FrameHooks, Intercepted, CONNECTION_RETAINED_PAYLOAD_BYTES};
use crate::server::dispatch::Registered;
use crate::transport::reply::StreamReplySink;
use crate::transport::ReplySink;

/// The only opcode whose frames may carry a trailer (the store's bytes).
const WRITE_SLOTS_OPCODE: u16 = 18;

/// Bytes of scratch a refused store's trailer is read into and dropped.
const DRAIN_CHUNK: usize = 64 << 10;

/// A data op counted in `dispatching` (shutdown waits for it before it drains the write-behind
/// and lets the pool go), as the dispatcher counts requests.
struct Counted<'a>(&'a NodeContext);

impl Counted<'_> {
    /// Counts a data op in, unless the node is stopping (`None`).
    fn enter(ctx: &NodeContext) -> Option<Counted<'_>> {
        ctx.counters.dispatching.fetch_add(1, Ordering::SeqCst);
        let c = Counted(ctx);
        (!ctx.shutting_down.load(Ordering::SeqCst)).then_some(c)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.counters.dispatching.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Copies `buffered` (the first bytes of a store's trailer) into the first of `slots`; returns
/// the slot ranges still to receive, the bytes copied, and a copy's failure.
fn copy_buffered(
    ctx: &NodeContext,
    slots: &[(u64, u64)],
    buffered: &[u8],
) -> (Vec<(u64, u64)>, usize, Option<String>) {
    let mut copied = 0usize;
    let mut first = 0;
    let mut head = None;
    while copied < buffered.len() {
        let (off, len) = slots[first];
        let n = (len as usize).min(buffered.len() - copied);
        if let Err(e) = ctx
            .pool
            .region()
            .write_at(off, &buffered[copied..copied + n])
        {
            return (Vec::new(), copied, Some(e.to_string()));
        }
        copied += n;
        first += 1;
        if (n as u64) < len {
            head = Some((off + n as u64, len - n as u64));
        }
    }
    let rest = head
        .into_iter()
        .chain(slots[first..].iter().copied())
        .collect();
    (rest, copied, None)
}

/// The hooks of one authenticated TCP connection. Invariant: the TCP fabric's connection
/// `fconn` is only used by this connection's reader thread, one op at a time.
pub struct RemoteHooks {
    /// The node.
    pub ctx: Arc<NodeContext>,
    /// The connection's reply side (held while a retrieve's trailer is sent).
    pub sink: Arc<StreamReplySink>,
    /// The same sink, as the dispatcher takes it.
    pub dyn_sink: Arc<dyn ReplySink>,
    /// The control stream (for draining a refused trailer).
    pub stream: Arc<TcpStream>,
    /// The TCP fabric's mover.
    pub mover: Arc<Mover>,
    /// This connection in the TCP fabric.
    pub fconn: ConnId,
    /// This connection's queue pair in the RDMA fabric, when it chose RDMA.
    pub rdma: Option<RemotePath>,
    /// Status record of this connection.
    pub info: Arc<RemoteConnInfo>,
    /// Node-wide remote counters.
    pub registry: Arc<RemoteRegistry>,
    /// Buffers registered over this connection (RDMA descriptors).
    pub regions: RegionTable,
    /// The listener's configuration.
    pub config: RemoteConfig,
    /// The caller identity the handshake established.
    pub caller: Caller,
}

impl RemoteHooks {
    fn reply(&self, header: &FrameHeader, started: Instant, resp: Response) {
        let error = matches!(resp, Response::Error { .. });
        self.ctx.counters.answered(header.opcode, error, started);
        self.sink
            .send(header.request_id, header.opcode, &resp, None);
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.config.transfer_timeout()
    }

    /// The pace of a data op's bytes: a stall longer than `dead_after_ms` ends it.
    fn pace(&self) -> Pace {
        Pace {
            stall: self.config.dead_after(),
            min_bytes_per_sec: self.config.min_transfer_mbps.saturating_mul(1_000_000),
            cap: self.deadline(),
        }
    }

    /// Reads and drops `len` bytes of a refused trailer (first those the reader holds), each
    /// read within `dead_after_ms` and all within the transfer deadline. `false`: the stream
    /// could not be resynchronised.
    fn drain(&self, reader: &mut FrameReader, len: u64) -> bool {
        let mut left = len - reader.take_buffered(len).len() as u64;
        let deadline = self.deadline();
        let mut scratch = vec![0u8; DRAIN_CHUNK.min(left as usize)];
        let mut s = &*self.stream;
        while left > 0 {
            let rest = deadline
                .saturating_duration_since(Instant::now())
                .min(self.config.dead_after());
            if rest.is_zero() || s.set_read_timeout(Some(rest)).is_err() {
                return false;
            }
            let want = scratch.len().min(left as usize);
            match s.read(&mut scratch[..want]) {
                Ok(0) | Err(_) => return false,
                Ok(n) => left -= n as u64,
            }
        }
        reader.forget_armed_timeout();
        true
    }

    /// Answers a data op that arrived while the node stops, and closes the connection.
    fn refuse_stopping(&self, header: &FrameHeader) -> Intercepted {
        let e = Error::new(ErrorKind::ShuttingDown, "node is shutting down");
        self.reply(header, Instant::now(), Response::error(&e));
        Intercepted::Close
    }

    /// Before closing a connection whose client is still sending: stops reading frames, lets
    /// the reply already queued go, and discards what arrives for at most `dead_after_ms`, so
    /// the close is not a reset that destroys the reply on the client's side.
    fn linger_for_reply(&self) {
        let end = Instant::now() + self.config.dead_after();
        let _ = self.sink.hold(end);
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        let mut scratch = vec![0u8; DRAIN_CHUNK];
        let mut s = &*self.stream;
        loop {
            let rest = end.saturating_duration_since(Instant::now());
            if rest.is_zero() || s.set_read_timeout(Some(rest)).is_err() {
                return;
            }
            match s.read(&mut scratch) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    }

    fn write_slots(
        &mut self,
        header: &FrameHeader,
        reader: &mut FrameReader,
        (instance_id, transfer_id, data, commit): (u64, u64, DataPath, bool),
    ) -> Intercepted {
        let started = Instant::now();
        let trailer = header.trailer_len;
        let bufs = match data {
            DataPath::Inline => None,
            DataPath::Remote(bufs) => Some(bufs),
        };
        if let Some(bufs) = bufs {
            let e = match (&self.rdma, trailer) {
                (Some(_), 0) => {
                    let op = RemoteDataOp {
                        instance_id,
                        transfer_id,
                        bufs: &bufs,
                        commit,
                    };
                    return self.remote_op(header, started, Dir::Pull, &op);
                }
                (Some(_), _) => Error::new(
                    ErrorKind::InvalidRequest,
                    "a store with buffer descriptors carries no trailer",
                ),
                // This connection's fabric is TCP: descriptors of engine memory cannot be
                // served.
                (None, _) => Error::new(
                    ErrorKind::Unsupported,
                    "this connection chose TCP in its handshake: send the store's bytes \
                     inline (buffer descriptors need a connection that chose RDMA)",
                ),
            };
            self.reply(header, started, Response::error(&e));
            if trailer == 0 {
                return Intercepted::Done;
            }
            // Descriptors and a trailer together: a protocol violation, not drained.
            self.linger_for_reply();
            return Intercepted::Close;
        }
        if trailer > self.config.max_trailer_bytes {
            let e = Error::limit(format!(
                "a store of {trailer} bytes exceeds remote.max_trailer_bytes = {}; closing \
                 connection",
                self.config.max_trailer_bytes
            ));
            self.reply(header, started, Response::error(&e));
            self.linger_for_reply();
            return Intercepted::Close;
        }
        let take = match ops::take_write(&self.ctx, &self.caller, instance_id, transfer_id) {
            Ok(t) => t,
            Err(e) => {
                self.reply(header, started, Response::error(&e));
                return if self.drain(reader, trailer) {
                    Intercepted::Done
                } else {
                    Intercepted::Close
                };
            }
        };
        let slots = take.slots();
        let want: u64 = slots.iter().map(|s| s.1).sum();
        if trailer != want {
            take.put_back();
            let e = Error::new(
                ErrorKind::InvalidRequest,
                format!(
                    "the store's trailer holds {trailer} bytes but transfer {transfer_id}'s \
                     slots hold {want}"
                ),
            );
            self.reply(header, started, Response::error(&e));
            return if self.drain(reader, trailer) {
                Intercepted::Done
            } else {
                Intercepted::Close
            };
        }
        // Bytes that arrived with the frame go into the first slots (straight from the
        // reader's buffer); the fabric receives the rest straight into place.
        let (rest, copied, copy_failed) =
            copy_buffered(&self.ctx, &slots, reader.take_buffered(trailer));
        let moved = match copy_failed {
            Some(e) => Err(e),
            None if rest.is_empty() => Ok(trailer),
            None => self
                .mover
                .transfer_paced(self.fconn, Dir::Pull, &stream_items(&rest), &self.pace())
                .map(|n| n + copied as u64)
                .map_err(|e| e.to_string()),
        };
        let failed = moved.is_err();
        if let Ok(n) = moved {
            self.info.bytes_in.fetch_add(n, Ordering::Relaxed);
            self.registry.bytes_in.fetch_add(n, Ordering::Relaxed);
        } else {
            self.registry.failed_moves.fetch_add(1, Ordering::Relaxed);
        }
        if let Err(e) = &moved {
            tracing::warn!(connection = self.info.id, transfer_id, error = %e, "a store's bytes did not arrive; its slots are freed, nothing published, and the connection closed");
        }
        self.info.data_ops.fetch_add(1, Ordering::Relaxed);
        let resp = take.settle(moved, commit);
        self.reply(header, started, resp);
        if failed {
            // The stream is cut mid-trailer: it cannot carry another frame.
            Intercepted::Close
        } else {
            Intercepted::Done
        }
    }

    fn read_slots(
        &mut self,
        header: &FrameHeader,
        (instance_id, transfer_id, data, commit): (u64, u64, DataPath, bool),
    ) -> Intercepted {
        let started = Instant::now();
        if header.trailer_len > 0 {
            let e = Error::new(
                ErrorKind::InvalidRequest,
                "READ_SLOTS carries no trailer; closing connection",
            );
            self.reply(header, started, Response::error(&e));
            return Intercepted::Close;
        }
        if let DataPath::Remote(bufs) = data {
            if self.rdma.is_none() {
                let e = Error::new(
                    ErrorKind::Unsupported,
                    "this connection chose TCP in its handshake: ask for the retrieve's bytes \
                     inline (buffer descriptors need a connection that chose RDMA)",
                );
                self.reply(header, started, Response::error(&e));
                return Intercepted::Done;
            }
            let op = RemoteDataOp {
                instance_id,
                transfer_id,
                bufs: &bufs,
                commit,
            };
            return self.remote_op(header, started, Dir::Push, &op);
        }
        let take = match ops::take_read(&self.ctx, &self.caller, instance_id, transfer_id) {
            Ok(t) => t,
            Err(e) => {
                self.reply(header, started, Response::error(&e));
                return Intercepted::Done;
            }
        };
        let total = take.bytes();
        if total > self.config.max_trailer_bytes {
            drop(take);
            let e = Error::limit(format!(
                "a retrieve of {total} bytes exceeds remote.max_trailer_bytes = {}",
                self.config.max_trailer_bytes
            ));
            self.reply(header, started, Response::error(&e));
            return Intercepted::Done;
        }
        // The reply's header goes out once earlier replies are taken: an engine that asked for
        // the bytes reads them, so it gets `dead_after_ms` to do so.
        let deadline = Instant::now() + self.config.dead_after();
        let frame = match encode_response_with_trailer(
            header.request_id,
            header.opcode,
            &Response::SlotsRead { bytes: total },
            total,
        ) {
            Ok(f) => f,
            Err(e) => {
                drop(take);
                let e = Error::internal(format!("reply could not be encoded: {e}"));
                self.reply(header, started, Response::error(&e));
                return Intercepted::Done;
            }
        };
        let held = match self.sink.hold(deadline) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(connection = self.info.id, error = %e, "closing a remote connection that does not read its replies");
                return Intercepted::Close;
            }
        };
        let mut moved = held
            .write_all(&frame, deadline)
            .map(|()| 0)
            .map_err(|e| e.to_string());
        if moved.is_ok() && total > 0 {
            let items = stream_items(take.slots());
            moved = self
                .mover
                .transfer_paced(self.fconn, Dir::Push, &items, &self.pace())
                .map_err(|e| e.to_string());
        }
        if moved.is_err() {
            held.close();
        }
        drop(held);
        self.info.data_ops.fetch_add(1, Ordering::Relaxed);
        let ok = moved.is_ok();
        self.ctx.counters.answered(header.opcode, !ok, started);
        match &moved {
            Ok(_) => {
                self.info.bytes_out.fetch_add(total, Ordering::Relaxed);
                self.registry.bytes_out.fetch_add(total, Ordering::Relaxed);
            }
            Err(e) => {
                self.registry.failed_moves.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(connection = self.info.id, error = %e, "a retrieve's bytes could not be sent; closing the connection");
            }
        }
        if let Some(Response::Error { message, .. }) = take.settle(ok, commit) {
            // The bytes were read under the locks and are valid; the commit's failure (e.g.
            // the instance was released meanwhile, which released the locks) is only logged.
            tracing::debug!(connection = self.info.id, %message, "commit after a remote retrieve failed");
        }
        if ok {
            Intercepted::Done
        } else {
            Intercepted::Close
        }
    }
}

impl RemoteHooks {
    /// A data op with buffer descriptors, over this connection's RDMA queue pair (`Pull`: a
    /// store, `Push`: a retrieve); the caller checked that the connection has one.
    fn remote_op(
        &mut self,
        header: &FrameHeader,
        started: Instant,
        dir: Dir,
        op: &RemoteDataOp<'_>,
    ) -> Intercepted {
        let Some(path) = self.rdma.clone() else {
            return Intercepted::Close;
        };
        let pace = self.pace();
        let out: DataOpOutcome = match dir {
            Dir::Pull => write_remote(&self.ctx, &self.caller, &self.regions, &path, op, &pace),
            Dir::Push => read_remote(&self.ctx, &self.caller, &self.regions, &path, op, &pace),
        };
        self.info.data_ops.fetch_add(1, Ordering::Relaxed);
        let (mine, all) = match dir {
            Dir::Pull => (&self.info.bytes_in, &self.registry.bytes_in),
            Dir::Push => (&self.info.bytes_out, &self.registry.bytes_out),
        };
        mine.fetch_add(out.moved, Ordering::Relaxed);
        all.fetch_add(out.moved, Ordering::Relaxed);
        if out.broken {
            self.registry.failed_moves.fetch_add(1, Ordering::Relaxed);
        }
        self.reply(header, started, out.resp);
        if out.broken {
            tracing::warn!(
                connection = self.info.id,
                "an RDMA transfer failed: closing the connection (its queue pair is torn down)"
            );
            Intercepted::Close
        } else {
            Intercepted::Done
        }
    }
}

impl<'a> FrameHooks<PlainSource<&'a TcpStream>> for RemoteHooks {
    fn caller(&self) -> Option<Caller> {
        Some(self.caller.clone())
    }

    fn read_limits(&self, ctx: &NodeContext) -> crate::protocol::frame::ReadLimits {
        crate::protocol::frame::ReadLimits {
            frame_timeout: Some(ctx.config.limits.frame_timeout()),
            idle_timeout: Some(self.config.dead_after()),
            retain_bytes: CONNECTION_RETAINED_PAYLOAD_BYTES,
        }
    }

    fn idle_is_death(&self) -> bool {
        true
    }

    fn accepts_trailer(&self, opcode: u16) -> bool {
        opcode == WRITE_SLOTS_OPCODE
    }

    fn intercept(
        &mut self,
        header: &FrameHeader,
        req: Request,
        reader: &mut FrameReader,
        _src: &mut PlainSource<&'a TcpStream>,
        _registered: &mut Registered,
    ) -> Intercepted {
        match req {
            Request::Noop if header.request_id == HEARTBEAT_REQUEST_ID => Intercepted::Done,
            Request::WriteSlots {
                instance_id,
                transfer_id,
                data,
                commit,
            } => {
                let ctx = self.ctx.clone();
                let Some(_counted) = Counted::enter(&ctx) else {
                    return self.refuse_stopping(header);
                };
                self.write_slots(header, reader, (instance_id, transfer_id, data, commit))
            }
            Request::ReadSlots {
                instance_id,
                transfer_id,
                data,
                commit,
            } => {
                let ctx = self.ctx.clone();
                let Some(_counted) = Counted::enter(&ctx) else {
                    return self.refuse_stopping(header);
                };
                self.read_slots(header, (instance_id, transfer_id, data, commit))
            }
            Request::RegisterBuffers { regions } => {
                let started = Instant::now();
                let resp = match self.regions.register(&regions) {
                    Ok(count) => Response::BuffersRegistered { count },
                    Err(e) => Response::error(&e),
                };
                self.reply(header, started, resp);
                Intercepted::Done
            }
            Request::UnregisterBuffers { ids } => {
                let started = Instant::now();
                let resp = match self.regions.unregister(&ids) {
                    Ok(_) => Response::BuffersRegistered {
                        count: self.regions.len() as u32,
                    },
                    Err(e) => Response::error(&e),
                };
                self.reply(header, started, resp);
                Intercepted::Done
            }
            other => Intercepted::Dispatch(other),
        }
    }
}
