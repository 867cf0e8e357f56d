//! The node process: builds the pool and context, starts the worker shards, the reaper, the
//! maintenance thread and the transports, and shuts them down.

pub mod connection;
pub mod dispatch;
pub mod maintenance;

use std::os::unix::net::{UnixListener, UnixStream};
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
pub struct Node {
    ctx: Arc<NodeContext>,
    threads: Vec<JoinHandle<()>>,
    socket: PathBuf,
}

impl Node {
    /// Validates the configuration, creates and pre-faults the pool, and starts every thread.
    pub fn start(config: NodeConfig) -> Result<Node> {
        config.validate()?;
        let pool = SharedPool::create(&PoolOptions {
            bytes: config.pool_bytes,
            prefer: config.page_preference()?,
            prefault: true,
            name: "kvnode-pool".into(),
            posix_shm_name: (!config.shm_name.is_empty()).then(|| config.shm_name.clone()),
        })
        .map_err(|e| Error::from(e).context("creating the pool"))?;
        tracing::info!(
            backing = pool.backing().as_str(),
            bytes = pool.len(),
            "pool ready"
        );
        let socket = config.socket.clone();
        let pool = Arc::new(pool);
        let namespaces = Namespaces::default();
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
            Some(
                L2Set::open(&config.l2, pool.clone(), staging, &namespaces)
                    .map_err(|e| e.context("opening the L2 tier"))?,
            )
        } else {
            None
        };
        let listener = if config.socket.as_os_str().is_empty() {
            None
        } else {
            Some(uds::bind(&config.socket, config.socket_mode)?)
        };
        let ctx = Arc::new(NodeContext::new(config, pool, namespaces, l2));
        let mut threads = ShardPool::spawn(&ctx)?;
        threads.extend(crate::l2::writer::spawn(&ctx)?);
        threads.extend(Liveness::spawn(&ctx)?);
        threads.push(maintenance::spawn(&ctx)?);
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
        Ok(Node {
            ctx,
            threads,
            socket,
        })
    }

    /// The shared context (tests and embedding).
    pub fn context(&self) -> &Arc<NodeContext> {
        &self.ctx
    }

    /// The socket path being served.
    pub fn socket_path(&self) -> &PathBuf {
        &self.socket
    }

    /// Stops accepting, stops the workers, reaper and maintenance thread, and removes the socket.
    pub fn shutdown(self) {
        self.ctx.shutting_down.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let has_socket = !self.socket.as_os_str().is_empty();
        if has_socket {
            let _ = UnixStream::connect(&self.socket);
        }
        self.ctx.shards.stop();
        self.ctx.liveness.stop();
        if has_socket {
            uds::unlink(&self.socket);
        }
        // Connection threads may still hold the context (and the pool): remove the shm name now.
        self.ctx.pool.unlink_shm_name();
        for t in self.threads {
            let _ = t.join();
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
        crate::l2::writer::drain(&self.ctx);
        if let Some(l2) = &self.ctx.l2 {
            l2.release();
        }
        tracing::info!("kvnode stopped");
    }
}

fn accept_loop(ctx: &Arc<NodeContext>, listener: UnixListener) {
    static NEXT_CONN: AtomicU64 = AtomicU64::new(1);
    for stream in listener.incoming() {
        if ctx.shutting_down.load(Ordering::Acquire) {
            break;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                continue;
            }
        };
        let id = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
        let open = ctx.counters.connections.fetch_add(1, Ordering::AcqRel);
        if open >= ctx.config.limits.max_connections {
            ctx.counters.connections.fetch_sub(1, Ordering::AcqRel);
            connection::refuse(stream, ctx.config.limits.max_connections);
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
