//! The TCP listener for remote engines: admission limits, the authenticated handshake (nothing
//! is allocated or registered for a connection before it), then the ordinary frame loop with
//! the remote data-op hooks. Every connection is handed to the TCP fabric (inline data: the
//! bytes on the stream); one that chose RDMA in its handshake also gets a queue pair of the
//! node's RDMA fabric (created after authentication, in the handshake's RDMA exchange) for its
//! descriptor-based data ops. The RDMA path is untested on hardware.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvnode_hw::fabric::{ConnSetup, Fabric, TcpEngine, TcpFabric, TcpFabricOptions};
use parking_lot::Mutex;

use super::descriptors::RegionTable;
use super::mover::Mover;
use super::rdma::{MoverQp, NodeRdma};
use super::rdma_ops::RemotePath;
use super::registry::{Admitted, RemoteConnInfo, RemoteRegistry};
use super::serve::RemoteHooks;
use crate::access::Role;
use crate::config::{RemoteConfig, TcpEngineChoice};
use crate::error::{Error, Result};
use crate::modules::{Caller, NodeContext};
use crate::protocol::frame::{PlainSource, VERSION};
use crate::server::connection::{serve_frames, REPLY_QUEUE_BYTES};
use crate::transport::reply::StreamReplySink;
use crate::transport::tcp::auth::{os_random, Token};
use crate::transport::tcp::handshake::{
    send_busy, server_handshake, server_rdma_exchange, FrameRange, HandshakeError, Offer,
    ServerKeys, FABRIC_RDMA, FABRIC_TCP,
};
use crate::transport::ReplySink;
use kvnode_hw::fabric::FabricKind;

/// How long a refused connection is given to take its "busy" answer.
const BUSY_WRITE: Duration = Duration::from_millis(100);
/// Back-off of a failing `accept` (e.g. EMFILE).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// What every connection thread shares.
struct Shared {
    ctx: Arc<NodeContext>,
    config: RemoteConfig,
    keys: ServerKeys,
    offer: Offer,
    mover: Arc<Mover>,
    /// The RDMA fabric, when offered, and what status says about it.
    rdma: NodeRdma,
    registry: Arc<RemoteRegistry>,
    stop: AtomicBool,
    /// Open authenticated connections' streams (shut down at stop).
    streams: Mutex<HashMap<u64, Arc<TcpStream>>>,
}

/// The running remote listener. Invariant: `accept` runs until [`RemoteService::shutdown`];
/// every connection it admitted holds an [`Admitted`] place until its thread ends.
pub struct RemoteService {
    addr: SocketAddr,
    listener: Arc<TcpListener>,
    accept: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
}

/// The keys the configuration names: the client token, the admin token, or none (insecure).
fn load_keys(config: &RemoteConfig) -> Result<ServerKeys> {
    match &config.auth_token_file {
        None => Ok(ServerKeys::Insecure),
        Some(client) => ServerKeys::token(
            Token::from_file(client)?,
            config
                .admin_token_file
                .as_deref()
                .map(Token::from_file)
                .transpose()?,
        ),
    }
}

impl RemoteService {
    /// Starts listening when `ctx.config.remote` asks for it (`Ok(None)` otherwise): loads the
    /// tokens (refusing unsafe files), binds the address, starts the TCP fabric over the pool.
    pub fn start(ctx: &Arc<NodeContext>) -> Result<Option<RemoteService>> {
        let config = ctx.config.remote.clone();
        if !config.enabled() {
            return Ok(None);
        }
        let keys = load_keys(&config)?;
        let addr = config.listen_addr()?;
        let listener = TcpListener::bind(addr).map_err(|e| {
            Error::invalid(format!("cannot listen on {} ({addr}): {e}", config.listen))
        })?;
        let addr = listener.local_addr()?;
        let engine = match config.engine()? {
            TcpEngineChoice::Uring => TcpEngine::Uring,
            TcpEngineChoice::Plain => TcpEngine::Plain,
        };
        let fabric = TcpFabric::new(TcpFabricOptions {
            engine,
            rings: config.tcp_rings,
            max_inflight_ops: config.max_inflight_ops,
            ..TcpFabricOptions::default()
        })
        .map_err(|e| Error::from(e).context("cannot start the TCP fabric"))?;
        fabric
            .register(&ctx.pool)
            .map_err(|e| Error::from(e).context("cannot register the pool with the TCP fabric"))?;
        let mover = Mover::start(Arc::new(fabric))?;
        let rdma = NodeRdma::open(&config, &ctx.pool);
        let mut node_id = [0u8; 16];
        os_random(&mut node_id)?;
        let offer = Offer {
            frames: FrameRange {
                min: VERSION,
                max: VERSION,
            },
            fabrics: if rdma.offered() {
                FABRIC_TCP | FABRIC_RDMA
            } else {
                FABRIC_TCP
            },
            node_id,
        };
        let auth = match keys {
            ServerKeys::Insecure => "none",
            ServerKeys::Token { .. } => "token",
        };
        if auth == "none" {
            tracing::warn!(
                %addr,
                "listening for remote engines WITHOUT authentication (--insecure-no-auth): \
                 anyone who reaches this port may read and write the cache"
            );
        }
        let shared = Arc::new(Shared {
            ctx: ctx.clone(),
            config,
            keys,
            offer,
            mover,
            rdma,
            registry: Arc::new(RemoteRegistry::default()),
            stop: AtomicBool::new(false),
            streams: Mutex::new(HashMap::new()),
        });
        let status = Arc::downgrade(&shared);
        ctx.add_status_part(
            "remote",
            Box::new(move || {
                status.upgrade().map_or(serde_json::Value::Null, |s| {
                    let mut v = s.registry.status();
                    v["mover"] = s.mover.status();
                    if let Some(m) = &s.rdma.mover {
                        v["rdma_mover"] = m.status();
                    }
                    v
                })
            }),
        );
        let listener = Arc::new(listener);
        let accept = {
            let (shared, listener) = (shared.clone(), listener.clone());
            std::thread::Builder::new()
                .name("kvnode-remote-accept".into())
                .spawn(move || accept_loop(&shared, &listener))?
        };
        tracing::info!(%addr, auth, engine = engine.as_str(), rdma = %shared.rdma.status, "listening for remote engines");
        Ok(Some(RemoteService {
            addr,
            listener,
            accept: Some(accept),
            shared,
        }))
    }

    /// The address bound (the port the OS chose when the configuration said 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `"token"` or `"none"`.
    pub fn auth(&self) -> &'static str {
        match self.shared.keys {
            ServerKeys::Insecure => "none",
            ServerKeys::Token { .. } => "token",
        }
    }

    /// What status `transports.rdma` says: the RDMA device offered to remote engines, or
    /// `"unavailable: <reason>"`, or `"disabled (...)"`.
    pub fn rdma_status(&self) -> &str {
        &self.shared.rdma.status
    }

    /// The TCP fabric's engine name (`uring` or `plain`).
    pub fn engine(&self) -> &str {
        &self.shared.config.tcp_engine
    }

    /// Stops accepting and shuts every remote connection down (their threads release their
    /// instances as on any disconnect).
    pub fn shutdown(self) {
        drop(self);
    }
}

impl Drop for RemoteService {
    /// The same as [`RemoteService::shutdown`]: a listener dropped on a failed node start stops
    /// too (nothing keeps accepting for a node that is not there).
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wakes the accept thread: a shut-down listening socket fails `accept`.
        let _ = rustix::net::shutdown(&*self.listener, rustix::net::Shutdown::Read);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        for s in self.shared.streams.lock().values() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    loop {
        let accepted = listener.accept();
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "accepting a remote connection failed");
                std::thread::sleep(ACCEPT_BACKOFF);
                continue;
            }
        };
        let c = &shared.config;
        let place = match shared.registry.admit(
            peer.ip(),
            c.max_connections,
            c.max_connections_per_ip,
            c.max_handshakes,
        ) {
            Ok(p) => p,
            Err(why) => {
                shared
                    .registry
                    .handshakes
                    .busy
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%peer, %why, "refused a remote connection");
                let _ = send_busy(
                    &stream,
                    &shared.keys,
                    &shared.offer,
                    Instant::now() + BUSY_WRITE,
                );
                continue;
            }
        };
        let s = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("kvnode-remote-conn".into())
            .spawn(move || serve_connection(&s, stream, peer, place));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "could not start a remote connection thread");
        }
    }
}

/// Counts and logs a failed handshake.
fn handshake_failed(shared: &Shared, peer: SocketAddr, e: &HandshakeError) {
    let h = &shared.registry.handshakes;
    let counter = match e {
        HandshakeError::BadToken | HandshakeError::TokenRequired => &h.auth_failed,
        HandshakeError::TimedOut => &h.timed_out,
        HandshakeError::Busy => &h.busy,
        _ => &h.refused,
    };
    counter.fetch_add(1, Ordering::Relaxed);
    if e.is_auth_failure() {
        tracing::warn!(%peer, error = %e, "remote handshake: authentication failed");
    } else {
        tracing::info!(%peer, error = %e, "remote handshake failed");
    }
}

fn serve_connection(
    shared: &Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    mut place: Admitted,
) {
    let _ = stream.set_nodelay(true);
    let deadline = Instant::now() + shared.config.handshake_timeout();
    let negotiated = match server_handshake(&stream, &shared.keys, &shared.offer, deadline) {
        Ok(n) => n,
        Err(e) => {
            handshake_failed(shared, peer, &e);
            return;
        }
    };
    // The RDMA exchange (queue pairs created only now, after authentication) still counts as
    // the handshake: bounded by `max_handshakes` and by its own `handshake_timeout_ms`.
    let rdma = match (negotiated.fabric, &shared.rdma.mover) {
        (FabricKind::Rdma, Some(mover)) => {
            let deadline = Instant::now() + shared.config.handshake_timeout();
            match server_rdma_exchange(&stream, &mut MoverQp(mover), deadline) {
                Ok(conn) => Some(RemotePath {
                    mover: mover.clone(),
                    conn,
                }),
                Err(e) => {
                    handshake_failed(shared, peer, &e);
                    return;
                }
            }
        }
        (FabricKind::Rdma, None) => {
            // Unreachable: the handshake refuses a fabric the offer lacks.
            handshake_failed(
                shared,
                peer,
                &HandshakeError::Rdma("RDMA chosen but not offered".into()),
            );
            return;
        }
        _ => None,
    };
    place.handshake_over();
    shared
        .registry
        .handshakes
        .ok
        .fetch_add(1, Ordering::Relaxed);
    let ctx = &shared.ctx;
    let id = crate::server::next_connection_id();
    let fconn = match stream.try_clone().map_err(Error::from).and_then(|dup| {
        shared
            .mover
            .connect(ConnSetup::Tcp(OwnedFd::from(dup)))
            .map_err(Error::from)
    }) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(%peer, error = %e, "cannot hand a remote connection to the TCP fabric");
            if let Some(r) = &rdma {
                r.mover.teardown(r.conn);
            }
            return;
        }
    };
    let stream = Arc::new(stream);
    let sink = Arc::new(StreamReplySink::tcp(stream.clone(), id, REPLY_QUEUE_BYTES));
    let dyn_sink: Arc<dyn ReplySink> = sink.clone();
    let role = if negotiated.role >= Role::Admin {
        "admin"
    } else {
        "client"
    };
    let info = Arc::new(RemoteConnInfo {
        id,
        peer,
        name: negotiated.client_name.clone(),
        fabric: if rdma.is_some() { "rdma" } else { "tcp" },
        role,
        since: Instant::now(),
        bytes_in: Default::default(),
        bytes_out: Default::default(),
        data_ops: Default::default(),
    });
    shared.registry.add(info.clone());
    shared.streams.lock().insert(id, stream.clone());
    if shared.stop.load(Ordering::SeqCst) {
        // The listener stopped while this handshake finished: its sweep of the streams may have
        // missed this one; the frame loop below ends at once.
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
    tracing::info!(connection = id, %peer, name = %negotiated.client_name, role, fabric = info.fabric, "remote engine connected");
    let mut hooks = RemoteHooks {
        ctx: ctx.clone(),
        sink,
        dyn_sink: dyn_sink.clone(),
        stream: stream.clone(),
        mover: shared.mover.clone(),
        fconn,
        rdma: rdma.clone(),
        info,
        registry: shared.registry.clone(),
        regions: RegionTable::new(shared.config.max_registered_regions),
        config: shared.config.clone(),
        caller: {
            let base = Caller::remote(id, negotiated.role);
            if negotiated
                .client_name
                .starts_with(crate::modules::caller::PEER_NODE_NAME_PREFIX)
            {
                Caller {
                    peer_node: true,
                    owner: crate::modules::caller::REMOTE_OWNER_PEER,
                    ..base
                }
            } else {
                base
            }
        },
    };
    serve_frames(ctx, &mut PlainSource(&*stream), &dyn_sink, &mut hooks);
    shared.mover.teardown(fconn);
    if let Some(r) = &rdma {
        // Every op of the queue pair completed (its reader was the only poster); QP -> ERR,
        // then destroyed once drained.
        r.mover.teardown(r.conn);
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
    shared.streams.lock().remove(&id);
    shared.registry.remove(id);
    tracing::info!(connection = id, %peer, "remote engine disconnected");
}
