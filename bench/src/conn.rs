//! One simulated engine's connection to the node: a local client (Unix socket, copies through
//! the mapped pool) or a remote one (authenticated TCP, the node moves the bytes). The
//! workloads drive both through the same control calls; only the data movement differs.

use std::path::Path;
use std::time::Duration;

use kvnode::client::{Client, RemoteClient, RemoteOptions, RetrievePrepared, StorePrepared};
use kvnode::protocol::{ChunkRange, RegisterReply, RegisterRequest};
use kvnode::transport::tcp::auth::Token;
use serde::{Deserialize, Serialize};

/// How to reach a node over TCP (serialisable: `--processes` hands it to a child process).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RemoteTarget {
    /// `tcp://HOST:PORT`.
    pub url: String,
    /// The client token's file (`None`: a node started with `--insecure-no-auth`).
    pub token_file: Option<String>,
}

/// Longest the TCP connect plus the handshake may take (generous: loaded machines).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest one reply (or one chunk trailer) may take.
const REPLY_TIMEOUT: Duration = Duration::from_secs(120);

impl RemoteTarget {
    /// Connects and authenticates (not registered yet).
    pub fn connect(&self, name: &str) -> Result<RemoteClient, String> {
        let token = match &self.token_file {
            Some(f) => Some(Token::from_file(Path::new(f)).map_err(|e| e.to_string())?),
            None => None,
        };
        let opts = RemoteOptions {
            name: name.into(),
            connect_timeout: CONNECT_TIMEOUT,
            reply_timeout: Some(REPLY_TIMEOUT),
            // The workloads move bytes inline (on the TCP stream); see `remote::FabricArg`.
            fabric: kvnode::client::FabricChoice::Tcp,
            ..RemoteOptions::default()
        };
        RemoteClient::connect_remote(&self.url, token.as_ref(), &opts)
            .map_err(|e| format!("{}: {e}", self.url))
    }
}

/// A connection of either kind. Invariant: a `Local` one maps the pool once registered; a
/// `Remote` one never maps anything.
pub enum Conn {
    /// Over the node's Unix socket.
    Local(Box<Client>),
    /// Over TCP.
    Remote(Box<RemoteClient>),
}

/// Runs `$e` with `$c` bound to the client, whichever kind it is.
macro_rules! either {
    ($self:expr, $c:ident => $e:expr) => {
        match $self {
            Conn::Local($c) => $e,
            Conn::Remote($c) => $e,
        }
    };
}

fn s<T>(r: kvnode::error::Result<T>) -> Result<T, String> {
    r.map_err(|e| e.to_string())
}

impl Conn {
    /// Connects to `remote` if given, else to the Unix socket `socket`.
    pub fn connect(
        socket: &str,
        remote: Option<&RemoteTarget>,
        name: &str,
    ) -> Result<Conn, String> {
        match remote {
            Some(r) => Ok(Conn::Remote(Box::new(r.connect(name)?))),
            None => Ok(Conn::Local(Box::new(s(Client::connect(socket))?))),
        }
    }

    /// Whether the node moves the bytes (TCP).
    pub fn is_remote(&self) -> bool {
        matches!(self, Conn::Remote(_))
    }

    /// REGISTER.
    pub fn register(&mut self, req: &RegisterRequest) -> Result<RegisterReply, String> {
        either!(self, c => s(c.register(req)))
    }

    /// Tokens per chunk.
    pub fn chunk_tokens(&mut self) -> Result<u32, String> {
        either!(self, c => s(c.chunk_tokens()))
    }

    /// The status report (a remote client token sees the totals and `transports`).
    pub fn status(&mut self) -> Result<serde_json::Value, String> {
        either!(self, c => s(c.status()))
    }

    /// NOOP round trip.
    pub fn noop(&mut self) -> Result<(), String> {
        either!(self, c => s(c.noop()).map(drop))
    }

    /// PING round trip.
    pub fn ping(&mut self, instance_id: Option<u64>) -> Result<(), String> {
        either!(self, c => s(c.ping(instance_id)))
    }

    /// PREPARE_STORE.
    pub fn prepare_store(&mut self, id: u64, range: &ChunkRange) -> Result<StorePrepared, String> {
        either!(self, c => s(c.prepare_store(id, range)))
    }

    /// PREPARE_RETRIEVE.
    pub fn prepare_retrieve(
        &mut self,
        id: u64,
        range: &ChunkRange,
        session: Option<&str>,
    ) -> Result<Option<RetrievePrepared>, String> {
        either!(self, c => s(c.prepare_retrieve(id, range, session)))
    }

    /// COMMIT_RETRIEVE.
    pub fn commit_retrieve(&mut self, id: u64, transfer_id: u64) -> Result<(), String> {
        either!(self, c => s(c.commit_retrieve(id, transfer_id)))
    }

    /// LOOKUP.
    pub fn lookup(&mut self, req: &str, range: &ChunkRange, tp: u32) -> Result<u32, String> {
        either!(self, c => s(c.lookup(req, range, tp)))
    }

    /// FREE_LOOKUP_LOCKS.
    pub fn free_lookup_locks(&mut self, req: &str, start: u32, end: u32) -> Result<(), String> {
        either!(self, c => s(c.free_lookup_locks(req, start, end)))
    }

    /// END_SESSION.
    pub fn end_session(&mut self, req: &str) -> Result<(), String> {
        either!(self, c => s(c.end_session(req)))
    }

    /// UNREGISTER.
    pub fn unregister(&mut self, id: u64) -> Result<(), String> {
        either!(self, c => s(c.unregister(id)).map(drop))
    }
}

/// Makes `bufs` hold at least `n` buffers of exactly `len` bytes (every page written once, so
/// no first-touch faults land in a timed transfer).
pub fn ensure_buffers(bufs: &mut Vec<Vec<u8>>, n: usize, len: usize) {
    while bufs.len() < n {
        bufs.push(vec![0x11u8; len]);
    }
}
