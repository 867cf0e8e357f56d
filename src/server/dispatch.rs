//! Routing: requests with instance affinity go to the instance's mailbox (run in order on its
//! shard); everything else is answered inline on the connection thread.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::access::Role;
use crate::error::{Error, ErrorKind};
use crate::modules::instances::Job;
use crate::modules::{management, Caller, NodeContext};
use crate::protocol::{RegisterReply, Request, Response};
use crate::transport::ReplySink;

/// What the node keeps per connection: the instances registered over it (when it closes, each
/// one that no other open connection registered is released) and its caller identity, decided
/// once on the first request. Invariant: at most `max_instances + 1` ids; beyond that, ids
/// whose instance no longer lists this connection are dropped (lookups and inserts O(1)).
#[derive(Debug, Default, Clone)]
pub struct Registered {
    ids: HashSet<u64>,
    caller: Option<Caller>,
    looked_up: bool,
}

impl Registered {
    /// The caller identity of connection `sink` (read from the sink's peer credentials once).
    pub fn caller(&mut self, ctx: &NodeContext, sink: &Arc<dyn ReplySink>) -> &Caller {
        self.caller
            .get_or_insert_with(|| Caller::new(ctx, sink.connection_id(), sink.peer()))
    }

    /// Sets the caller identity the transport decided (remote engines: from the handshake).
    pub fn set_caller(&mut self, caller: Caller) {
        self.caller = Some(caller);
    }

    /// Whether this connection ran a LOOKUP (so it may own lookup sessions).
    pub fn looked_up(&self) -> bool {
        self.looked_up
    }

    /// Instances this connection registered that still list it.
    fn live(&self, ctx: &NodeContext, connection: u64) -> usize {
        self.ids
            .iter()
            .filter(|i| {
                ctx.instances
                    .get(**i)
                    .is_some_and(|inst| inst.connections.lock().contains(&connection))
            })
            .count()
    }

    /// Records that `id` was registered over connection `connection`.
    pub fn add(&mut self, ctx: &NodeContext, connection: u64, id: u64) {
        if self.ids.insert(id) && self.ids.len() > ctx.config.limits.max_instances {
            self.ids.retain(|i| {
                ctx.instances
                    .get(*i)
                    .is_some_and(|inst| inst.connections.lock().contains(&connection))
            });
        }
    }

    /// The ids recorded, sorted.
    pub fn ids(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.ids.iter().copied().collect();
        v.sort_unstable();
        v
    }

    /// Whether `id` was recorded.
    pub fn contains(&self, id: u64) -> bool {
        self.ids.contains(&id)
    }

    /// Ids recorded.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether none is recorded.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// Counts a request out of `dispatching` when dispatch returns (also on unwind).
struct InFlight<'a>(&'a NodeContext);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.counters.dispatching.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Routes one decoded request. `registered` collects instance ids registered over this
/// connection (released when it closes).
pub fn dispatch(
    ctx: &NodeContext,
    sink: &Arc<dyn ReplySink>,
    request_id: u64,
    req: Request,
    registered: &mut Registered,
) {
    let opcode = req.opcode();
    let started = std::time::Instant::now();
    // SeqCst here and in `Node::shutdown`: either shutdown sees this request in flight and
    // waits for it, or this request sees the node stopping and is refused.
    ctx.counters.dispatching.fetch_add(1, Ordering::SeqCst);
    let _in_flight = InFlight(ctx);
    if ctx.shutting_down.load(Ordering::SeqCst) {
        let e = Error::new(ErrorKind::ShuttingDown, "node is shutting down");
        return reply(ctx, sink, request_id, opcode, started, Response::error(&e));
    }
    let caller = registered.caller(ctx, sink).clone();
    if matches!(req, Request::Lookup { .. }) {
        registered.looked_up = true;
    }
    if caller.role == Role::Refused {
        // Transports refuse such peers at connect; this holds for any that does not.
        let e = Error::denied("this user may not use the node ([access] allow_uids/allow_gids)");
        return reply(ctx, sink, request_id, opcode, started, Response::error(&e));
    }
    if let Request::Register(r) = &req {
        let max = ctx.config.limits.max_instances_per_connection;
        if !registered.contains(r.instance_id) && registered.live(ctx, caller.connection) >= max {
            let e = Error::limit(format!(
                "this connection registered {max} instances (limit max_instances_per_connection)"
            ));
            return reply(ctx, sink, request_id, opcode, started, Response::error(&e));
        }
        return match ctx.register(r, &caller) {
            Ok(inst) => {
                registered.add(ctx, sink.connection_id(), inst.id);
                let fd = sink.can_pass_fd();
                let resp = Response::Registered(RegisterReply {
                    pool_bytes: ctx.pool.len(),
                    pool_backing: ctx.pool.backing().as_str().to_owned(),
                    shm_name: ctx.pool.posix_shm_name().unwrap_or_default().to_owned(),
                    chunk_tokens: ctx.config.chunk_tokens,
                    layout: NodeContext::wire_layout(&inst.layout),
                    object_bytes: inst.layout.object_bytes(),
                    fd_attached: fd,
                });
                ctx.counters.answered(opcode, false, started);
                sink.send(request_id, opcode, &resp, fd.then(|| ctx.pool.fd()));
            }
            Err(e) => {
                tracing::warn!(instance = r.instance_id, error = %e, "registration refused");
                reply(ctx, sink, request_id, opcode, started, Response::error(&e))
            }
        };
    }
    match req.instance_affinity() {
        Some(id) => {
            let Some(inst) = ctx.instances.get(id) else {
                let e = Error::new(
                    ErrorKind::NotRegistered,
                    format!("instance {id} is not registered"),
                );
                return reply(ctx, sink, request_id, opcode, started, Response::error(&e));
            };
            if let Err(e) = caller.require_attached(&inst) {
                return reply(ctx, sink, request_id, opcode, started, Response::error(&e));
            }
            if let Request::PrepareRetrieve { range, .. } = &req {
                bring_in(ctx, &caller, range);
            }
            inst.touch(ctx.now_ms());
            let job = Job {
                request_id,
                request: req,
                reply: sink.clone(),
                received: started,
            };
            if ctx.shards.run_or_submit(ctx, &inst, job).is_err() {
                let e = Error::limit(format!(
                    "instance {id} has {} requests queued (limit)",
                    ctx.config.limits.max_queued_per_instance
                ));
                reply(ctx, sink, request_id, opcode, started, Response::error(&e));
            }
        }
        None => {
            if let Request::Lookup { range, .. } = &req {
                bring_in(ctx, &caller, range);
            }
            let resp = management::handle_inline(ctx, &caller, req)
                .unwrap_or_else(|e| Response::error(&e));
            reply(ctx, sink, request_id, opcode, started, resp);
        }
    }
}

/// Cluster-wide hits: before a LOOKUP or PREPARE_RETRIEVE of `range` runs, the chunks this node
/// lacks are brought in from their owners (never for another node's calls: one hop only).
fn bring_in(ctx: &NodeContext, caller: &Caller, range: &crate::protocol::ChunkRange) {
    if caller.peer_node {
        return;
    }
    if let Some(link) = ctx.cluster.get() {
        link.bring_in(range);
    }
}

/// Answers request `request_id` (`opcode`, received at `started`) with `resp` and counts it.
fn reply(
    ctx: &NodeContext,
    sink: &Arc<dyn ReplySink>,
    request_id: u64,
    opcode: u16,
    started: std::time::Instant,
    resp: Response,
) {
    ctx.counters
        .answered(opcode, matches!(resp, Response::Error { .. }), started);
    sink.send(request_id, opcode, &resp, None);
}
