//! The node process: builds the pool and context, starts the worker shards, the reaper, the
//! maintenance thread and the transports, and shuts them down.

pub mod connection;
pub mod dispatch;
pub mod maintenance;

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};

use kvnode_hw::{PoolOptions, SharedPool};

use crate::config::NodeConfig;
use crate::error::{Error, Result};
use crate::l2::L2Set;
use crate::liveness::Liveness;
use crate::modules::shards::ShardPool;
use crate::modules::NodeContext;
use crate::storage::Namespaces;
use crate::transport::uds;

/// How long shutdown waits for requests that were already being handled when it began.
const DISPATCH_DRAIN: std::time::Duration = std::time::Duration::from_secs(10);

/// A running node. Dropping it without [`Node::shutdown`] leaves threads running (the process
/// exit reaps them); `shutdown` is the clean path.
///
/// Invariant: when the node serves a socket, `socket` is the file this node created (identified
/// by device and inode) and `wake` is a second descriptor of the listening socket, so shutdown
/// can wake the accept thread without going through the file system.
pub struct Node {
    ctx: Arc<NodeContext>,
    threads: Vec<JoinHandle<()>>,
    socket: Option<uds::BoundSocket>,
    wake: Option<UnixListener>,
    remote: Option<crate::remote::RemoteService>,
    cluster: Option<Arc<crate::cluster::ClusterNode>>,
}

/// What [`Node::start_bound`] hands back: the context, the threads, the wake-up descriptor,
/// the remote listener and the cluster membership.
type Started = (
    Arc<NodeContext>,
    Vec<JoinHandle<()>>,
    Option<UnixListener>,
    Option<crate::remote::RemoteService>,
    Option<Arc<crate::cluster::ClusterNode>>,
);

impl Node {
    /// Validates the configuration, binds the socket, checks that the pool fits in the memory
    /// available, creates and pre-faults the pool, opens the L2 tier and starts every thread.
    ///
    /// The socket comes first, so a second node on a busy socket is refused before it touches
    /// memory or disks; the memory check comes before the pool, so a pool larger than the
    /// machine is refused at once. If any later step fails, the socket this node created is
    /// removed again.
    pub fn start(config: NodeConfig) -> Result<Node> {
        Node::start_cancellable(config, None)
    }

    /// [`Node::start`] that gives up (cleanly: the socket and the pool it created are removed)
    /// when `cancel` is raised while the pool is being pre-faulted, which is the long part of a
    /// start-up (a signal must not wait minutes for it).
    pub fn start_cancellable(
        config: NodeConfig,
        cancel: Option<Arc<std::sync::atomic::AtomicBool>>,
    ) -> Result<Node> {
        config.validate()?;
        let bound = if config.socket.as_os_str().is_empty() {
            None
        } else {
            // The default directory is the node's own: created private if missing, and refused
            // if someone else owns it or may write it. Other directories must exist.
            let default_dir = crate::config::default_socket_dir();
            if config.socket.parent() == Some(default_dir.as_path()) {
                crate::config::ensure_private_dir(&default_dir)?;
            }
            Some(uds::bind(&config.socket, config.socket_mode)?)
        };
        let (listener, socket) = match bound {
            Some((l, s)) => (Some(l), Some(s)),
            None => (None, None),
        };
        match Node::start_bound(config, listener, cancel) {
            Ok((ctx, threads, wake, remote, cluster)) => Ok(Node {
                ctx,
                threads,
                socket,
                wake,
                remote,
                cluster,
            }),
            Err(e) => {
                if let Some(s) = &socket {
                    s.unlink_if_ours();
                }
                Err(e)
            }
        }
    }

    /// Everything after the socket: returns the context, the threads and the listener's wake-up
    /// descriptor.
    fn start_bound(
        config: NodeConfig,
        listener: Option<UnixListener>,
        cancel: Option<Arc<std::sync::atomic::AtomicBool>>,
    ) -> Result<Started> {
        let prefer = config.page_preference()?;
        let mut available = kvnode_hw::MemoryAvailable::read();
        if !config.shm_name.is_empty() {
            // A segment of this name left by a node that died is removed before the pool is
            // built: the memory it holds is free for the pool.
            available = available.counting_stale_shm_segment(&config.shm_name);
        }
        available
            .check_pool(config.pool_bytes, prefer, !config.shm_name.is_empty())
            .map_err(Error::invalid)?;
        let pool = SharedPool::create(&PoolOptions {
            bytes: config.pool_bytes,
            prefer,
            prefault: true,
            name: "kvnode-pool".into(),
            posix_shm_name: (!config.shm_name.is_empty()).then(|| config.shm_name.clone()),
            segment_bind_mount: config.segment_bind_mount,
            cancel,
        })
        .map_err(|e| {
            Error::from(e).context(format!(
                "cannot create the pool of {}",
                kvnode_hw::human_bytes(config.pool_bytes)
            ))
        })?;
        tracing::info!(
            backing = pool.backing().as_str(),
            bytes = pool.len(),
            "pool ready"
        );
        let socket = config.socket.clone();
        let pool = Arc::new(pool);
        let namespaces = Arc::new(Namespaces::default());
        let l2 = if config.l2.enabled() {
            let staging_bytes = L2Set::staging_bytes(&config.l2);
            if pool.len() < 2 * staging_bytes {
                return Err(Error::invalid(format!(
                    "the pool ({} bytes) is too small for an L2 tier on {} device(s) (needs {} \
                     bytes of staging, and at least as much for objects)",
                    pool.len(),
                    config.l2.paths.len(),
                    staging_bytes
                )));
            }
            let staging = pool.len() - staging_bytes;
            // L2's errors name the device path.
            L2Set::open(&config.l2, pool.clone(), staging, &namespaces)
                .map_err(|e| e.context("cannot open the L2 tier"))?
        } else {
            None
        };
        let wake = listener.as_ref().map(UnixListener::try_clone).transpose()?;
        let ctx = Arc::new(NodeContext::new(config, pool, namespaces, l2));
        // Before any thread: a listener that cannot start leaves nothing running. Its
        // connections' requests wait in their instances' mailboxes for the shards below.
        let remote = crate::remote::RemoteService::start(&ctx)
            .map_err(|e| e.context("cannot start the remote listener"))?;
        // Published before the socket is served: a client's first STATUS sees it.
        publish_transports(&ctx, remote.as_ref());
        let mut threads = ShardPool::spawn(&ctx)?;
        threads.extend(crate::l2::writer::spawn(&ctx)?);
        threads.extend(crate::l2::loader::spawn(&ctx)?);
        threads.extend(Liveness::spawn(&ctx)?);
        threads.push(maintenance::spawn(&ctx)?);
        // Once the workers run, before the native socket accepts engines (the remote listener
        // runs already; until the node has joined it serves as a lone node). A failure here
        // leaves no membership behind. The cluster needs the listener (its peers reach this
        // node there; validation made sure there is one).
        let listen = remote
            .as_ref()
            .map(crate::remote::RemoteService::local_addr);
        let cluster = match listen.filter(|_| ctx.config.cluster.enabled()) {
            Some(addr) => match crate::cluster::ClusterNode::start(&ctx, addr) {
                Ok(c) => Some(c),
                Err(e) => {
                    ctx.shutting_down.store(true, Ordering::SeqCst);
                    if let Some(r) = remote {
                        r.shutdown();
                    }
                    ctx.shards.stop();
                    ctx.liveness.stop();
                    return Err(e.context("cannot join the cluster"));
                }
            },
            None => None,
        };
        if let Some(listener) = listener {
            let actx = ctx.clone();
            threads.push(
                thread::Builder::new()
                    .name("kvnode-accept".into())
                    .spawn(move || accept_loop(&actx, listener))?,
            );
        }
        tracing::info!(
            socket = %socket.display(),
            workers = ctx.shards.len(),
            chunk_tokens = ctx.config.chunk_tokens,
            reap_timeout_secs = ctx.config.reap_timeout_secs,
            "kvnode serving"
        );
        Ok((ctx, threads, wake, remote, cluster))
    }

    /// The remote listener's address, when the node listens for remote engines.
    pub fn remote_addr(&self) -> Option<std::net::SocketAddr> {
        self.remote
            .as_ref()
            .map(crate::remote::RemoteService::local_addr)
    }

    /// The shared context (tests and embedding).
    pub fn context(&self) -> &Arc<NodeContext> {
        &self.ctx
    }

    /// The socket path being served (empty when the node serves no native socket).
    pub fn socket_path(&self) -> &PathBuf {
        &self.ctx.config.socket
    }

    /// How long the shutdown waits for L2 work before it stops without it: one device timeout
    /// (`l2.io_timeout_ms`) plus 5 s.
    fn l2_patience(&self) -> std::time::Duration {
        let io = std::time::Duration::from_millis(self.ctx.config.l2.io_timeout_ms);
        io.saturating_add(std::time::Duration::from_secs(5))
    }

    /// Stops accepting, stops the workers, reaper and maintenance thread, and removes the socket
    /// file if the path still holds the one this node created (never a file someone else put
    /// there). Always returns: the accept thread is woken through the node's own listening
    /// descriptor, whatever became of the socket path, and threads blocked on an L2 device that
    /// stopped answering are left behind after a bounded wait.
    pub fn shutdown(mut self) {
        self.ctx.shutting_down.store(true, Ordering::SeqCst);
        if let Some(cluster) = self.cluster.take() {
            // First: peers stop asking this node (its lease is revoked) before it stops serving.
            cluster.stop();
        }
        if let Some(remote) = self.remote.take() {
            remote.shutdown();
        }
        // Wake the accept loop so it sees the flag.
        if let Some(wake) = &self.wake {
            if let Err(e) = uds::wake_acceptor(wake) {
                tracing::error!(error = %e, "could not wake the accept thread");
            }
        }
        self.ctx.shards.stop();
        self.ctx.liveness.stop();
        if let Some(socket) = &self.socket {
            socket.unlink_if_ours();
        }
        // Connection threads may still hold the context (and the pool): remove the shm name now.
        self.ctx.pool.unlink_shm_name();
        // Threads blocked on a device that stopped answering (L2 I/O) are left behind after a
        // bounded wait: SIGTERM always stops the node.
        let patience = self.l2_patience();
        let join_deadline = std::time::Instant::now() + patience;
        let mut left = Vec::new();
        for t in self.threads {
            while !t.is_finished() && std::time::Instant::now() < join_deadline {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            if t.is_finished() {
                let _ = t.join();
            } else {
                left.push(t.thread().name().unwrap_or("?").to_owned());
            }
        }
        if !left.is_empty() {
            tracing::error!(
                threads = ?left,
                "threads still blocked (an L2 device is not answering): stopping without them"
            );
        }
        // Requests already past the shutdown check (run inline on connection threads) finish
        // before the write-behind drains and the L2 engines let go of the pool.
        let deadline = std::time::Instant::now() + DISPATCH_DRAIN;
        while self.ctx.counters.dispatching.load(Ordering::SeqCst) > 0 {
            if std::time::Instant::now() >= deadline {
                tracing::warn!(
                    in_flight = self.ctx.counters.dispatching.load(Ordering::SeqCst),
                    "requests still running at shutdown; stopping anyway"
                );
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // The final write-behind and the release of the engines' registrations run on a thread
        // of their own, waited for a bounded time: a stuck device must not hold the shutdown.
        let ctx = self.ctx.clone();
        // The clean stop's extent tables get their own allowance (large devices write more).
        let checkpoint = ctx
            .l2
            .as_ref()
            .map_or(std::time::Duration::ZERO, |l2| l2.checkpoint_allowance());
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let finisher = thread::Builder::new()
            .name("kvnode-l2-drain".into())
            .spawn(move || {
                crate::l2::writer::drain(&ctx);
                if let Some(l2) = &ctx.l2 {
                    if l2.tiers().iter().any(crate::l2::L2Tier::stuck) {
                        tracing::error!("an L2 device is not answering: its registrations are left to the kernel");
                    } else {
                        l2.release();
                    }
                }
                let _ = done_tx.send(());
            });
        match finisher {
            Ok(_) => {
                if done_rx.recv_timeout(patience + checkpoint).is_err() {
                    tracing::error!(
                        "the L2 write-behind and checkpoint did not finish (a device is not \
                         answering, or is slow): stopping without them; unwritten objects are \
                         lost from L2, and the next start reads every slot header"
                    );
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "no thread for the final L2 write-behind: skipped");
            }
        }
        tracing::info!("kvnode stopped");
    }
}

/// Adds the `transports` part of the status report: the Unix socket, the TCP listener (address,
/// authentication, engine) and the RDMA fabric's availability.
fn publish_transports(ctx: &Arc<NodeContext>, remote: Option<&crate::remote::RemoteService>) {
    let uds = (!ctx.config.socket.as_os_str().is_empty())
        .then(|| ctx.config.socket.display().to_string());
    let tcp = remote.map(|r| r.local_addr().to_string());
    let tcp_auth = remote.map(crate::remote::RemoteService::auth);
    let tcp_engine = remote.map(|r| r.engine().to_owned());
    let rdma = crate::remote::rdma_status(&ctx.config.remote, remote);
    let value = serde_json::json!({
        "uds": uds,
        "tcp": tcp,
        "tcp_auth": tcp_auth,
        "tcp_engine": tcp_engine,
        "rdma": rdma,
    });
    ctx.add_status_part("transports", Box::new(move || value.clone()));
}

/// File descriptors one connection holds: its socket (the reader and the reply side share it),
/// and at most `transport::uds::REPLY_QUEUE_FDS` duplicate of the pool's descriptor waiting in
/// its reply queue.
const FDS_PER_CONNECTION: u64 = 1 + crate::transport::uds::REPLY_QUEUE_FDS as u64;
/// File descriptors kept for everything but connections (pool, L2 devices and their rings,
/// listeners, the LMCache endpoint, the reply flusher's epoll descriptor, logs).
const RESERVED_FDS: u64 = 64;
/// Back-off of a failing `accept` (e.g. EMFILE): from the first to the longest pause.
const ACCEPT_BACKOFF: (std::time::Duration, std::time::Duration) = (
    std::time::Duration::from_millis(10),
    std::time::Duration::from_secs(1),
);
/// A failing `accept` is logged at most this often (with the number of failures since).
const ACCEPT_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// The connection limit the process's file descriptors allow: `limits.max_connections`, or
/// fewer when `RLIMIT_NOFILE` cannot hold that many connections plus [`RESERVED_FDS`] (the soft
/// limit is first raised towards the hard one as far as needed). Connections beyond it get a
/// typed refusal instead of an `accept` that fails with EMFILE.
fn connection_limit(configured: usize) -> usize {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let want = (configured as u64)
        .saturating_mul(FDS_PER_CONNECTION)
        .saturating_add(RESERVED_FDS);
    let mut nofile = getrlimit(Resource::Nofile);
    if let Some(soft) = nofile.current.filter(|&s| s < want) {
        let raised = nofile.maximum.map_or(want, |hard| hard.min(want));
        if raised > soft {
            let mut wanted = nofile;
            wanted.current = Some(raised);
            if setrlimit(Resource::Nofile, wanted).is_ok() {
                nofile = getrlimit(Resource::Nofile);
            }
        }
    }
    let Some(soft) = nofile.current else {
        return configured;
    };
    let fit = usize::try_from(soft.saturating_sub(RESERVED_FDS) / FDS_PER_CONNECTION)
        .unwrap_or(usize::MAX)
        .max(1);
    if fit < configured {
        tracing::warn!(
            max_connections = configured,
            open_files = soft,
            limit = fit,
            "RLIMIT_NOFILE holds fewer connections than limits.max_connections: connections \
             are capped at the lower figure (raise the limit, e.g. LimitNOFILE=, to serve more)"
        );
    }
    configured.min(fit)
}

/// A connection id unique among every connection of this process, whatever its transport
/// (instances and sessions remember the connection that registered or created them).
pub fn next_connection_id() -> u64 {
    static NEXT_CONN: AtomicU64 = AtomicU64::new(1);
    NEXT_CONN.fetch_add(1, Ordering::Relaxed)
}

fn accept_loop(ctx: &Arc<NodeContext>, listener: UnixListener) {
    let limit = connection_limit(ctx.config.limits.max_connections);
    let mut backoff = ACCEPT_BACKOFF.0;
    let (mut failures, mut logged) = (0u64, None::<std::time::Instant>);
    let (mut refused, mut refusal_logged) = (0u64, None::<std::time::Instant>);
    for stream in listener.incoming() {
        if ctx.shutting_down.load(Ordering::Acquire) {
            break;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                // E.g. out of file descriptors: back off, and say so without flooding the log.
                failures += 1;
                if logged.is_none_or(|t| t.elapsed() >= ACCEPT_LOG_EVERY) {
                    tracing::warn!(error = %e, failures, "accept failed: retrying with a back-off");
                    (failures, logged) = (0, Some(std::time::Instant::now()));
                }
                thread::sleep(backoff);
                backoff = (backoff * 2).min(ACCEPT_BACKOFF.1);
                continue;
            }
        };
        backoff = ACCEPT_BACKOFF.0;
        let id = next_connection_id();
        let open = ctx.counters.connections.fetch_add(1, Ordering::AcqRel);
        if open >= limit {
            ctx.counters.connections.fetch_sub(1, Ordering::AcqRel);
            connection::refuse(stream, limit);
            refused += 1;
            if refusal_logged.is_none_or(|t| t.elapsed() >= ACCEPT_LOG_EVERY) {
                tracing::warn!(
                    limit,
                    refused,
                    "connections refused: too many open connections"
                );
                (refused, refusal_logged) = (0, Some(std::time::Instant::now()));
            }
            continue;
        }
        let cctx = ctx.clone();
        let spawned = thread::Builder::new()
            .name(format!("kvnode-conn-{id}"))
            .spawn(move || {
                connection::serve(&cctx, stream, id);
                cctx.counters.connections.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            ctx.counters.connections.fetch_sub(1, Ordering::AcqRel);
            tracing::error!(error = %e, "could not start a connection thread");
        }
    }
}
