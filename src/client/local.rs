//! The local transport: the node's Unix socket, which also hands the client the pool's file
//! descriptor so chunks are copied straight into and out of the shared pool.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use kvnode_hw::{PoolMapping, PoolRegion};
use rkyv::util::AlignedVec;

use super::connect::{check_node_user, connect_bounded, connect_error};
use super::{Client, ClientTransport};
use crate::error::{Error, ErrorKind, Result};
use crate::protocol::frame::{FrameError, FrameHeader, FrameReader, FrameSource};
use crate::protocol::{ChunkRange, RegisterReply, RegisterRequest, Request, Response, WireSlot};

/// The pool mappings of this process by (device, inode, length) of the pool file: clients of
/// one node in one process share one mapping (and so one GPU registration of it).
///
/// Invariant: holds only weak references; an entry whose mapping was dropped is replaced.
type MappingKey = (u64, u64, u64);
static MAPPINGS: std::sync::Mutex<Vec<(MappingKey, std::sync::Weak<PoolMapping>)>> =
    std::sync::Mutex::new(Vec::new());

/// Maps `len` bytes of the pool file `fd`, or shares this process's live mapping of it.
fn shared_mapping(fd: OwnedFd, len: u64) -> Result<std::sync::Arc<PoolMapping>> {
    let st = rustix::fs::fstat(&fd).map_err(|e| Error::from(io::Error::from(e)))?;
    let key = (st.st_dev, st.st_ino, len);
    let mut all = MAPPINGS.lock().unwrap_or_else(|p| p.into_inner());
    all.retain(|(_, w)| w.strong_count() > 0);
    if let Some(m) = all
        .iter()
        .find(|(k, _)| *k == key)
        .and_then(|(_, w)| w.upgrade())
    {
        return Ok(m);
    }
    let m = std::sync::Arc::new(PoolMapping::from_fd(fd, len)?);
    all.push((key, std::sync::Arc::downgrade(&m)));
    Ok(m)
}

/// A connected Unix socket to a node. Invariant: the node's user was checked at connect.
pub struct UnixTransport(UnixStream);

/// Receives bytes and any descriptor that came with them.
struct FdSource<'a>(&'a UnixStream);

impl FrameSource for FdSource<'_> {
    fn recv(&mut self, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
        kvnode_hw::recv_with_fd(self.0.as_fd(), buf)
    }
}

impl ClientTransport for UnixTransport {
    fn send_frame(&mut self, frame: &[u8]) -> Result<()> {
        kvnode_hw::send_with_fd(self.0.as_fd(), frame, None)?;
        Ok(())
    }

    fn read_frame(
        &mut self,
        reader: &mut FrameReader,
        payload: &mut AlignedVec<16>,
    ) -> std::result::Result<Option<(FrameHeader, Option<OwnedFd>)>, FrameError> {
        reader.read_frame(&mut FdSource(&self.0), payload)
    }

    fn set_timeout(&mut self, timeout: Option<Duration>) -> Result<()> {
        self.0.set_read_timeout(timeout)?;
        self.0.set_write_timeout(timeout)?;
        Ok(())
    }
}

impl Client<UnixTransport> {
    /// Connects to the node's Unix socket. Errors name the path and say why no node answered.
    /// Waits for a node whose accept queue is full as long as it takes; see
    /// [`Client::connect_timeout`] for a bounded wait.
    /// The node must run as this process's user or as root (checked with `SO_PEERCRED`): a
    /// socket another user put at the path is never trusted with requests or a pool fd.
    pub fn connect(path: impl AsRef<Path>) -> Result<Client> {
        let p = path.as_ref();
        let stream = UnixStream::connect(p).map_err(|e| connect_error(p, &e))?;
        check_node_user(p, &stream)?;
        Ok(Client::over(UnixTransport(stream)))
    }

    /// [`Client::connect`] that gives up after `timeout` when the node does not take the
    /// connection (its accept queue is full: a hung or overloaded node), with an error naming
    /// the path. Replies are not bounded by it (see [`Client::set_timeout`]).
    pub fn connect_timeout(path: impl AsRef<Path>, timeout: Duration) -> Result<Client> {
        let stream = connect_bounded(path.as_ref(), timeout)?;
        check_node_user(path.as_ref(), &stream)?;
        Ok(Client::over(UnixTransport(stream)))
    }

    /// Registers an engine-driven context and maps the pool received with the reply.
    pub fn register(&mut self, req: &RegisterRequest) -> Result<RegisterReply> {
        let (resp, fd) = self.call_with_fd(&Request::Register(req.clone()))?;
        let Response::Registered(reply) = resp else {
            return Err(Self::unexpected(resp));
        };
        if self.pool.is_none() {
            let mapping = match (fd, reply.shm_name.as_str()) {
                (Some(fd), _) => return self.adopt_pool(fd, reply),
                (None, name) if !name.is_empty() => {
                    PoolMapping::open_posix_shm(name, reply.pool_bytes)?
                }
                (None, _) => {
                    return Err(Error::new(
                        ErrorKind::Unsupported,
                        "registration reply carried no pool fd and no shm name",
                    ))
                }
            };
            self.pool = Some(std::sync::Arc::new(mapping));
        }
        self.registration = Some(reply.clone());
        self.pin_pool()?;
        Ok(reply)
    }

    /// Maps the pool received as `fd` (shared with the other clients of this process that
    /// mapped the same pool: one mapping, one GPU registration), then finishes `register`.
    fn adopt_pool(&mut self, fd: OwnedFd, reply: RegisterReply) -> Result<RegisterReply> {
        self.pool = Some(shared_mapping(fd, reply.pool_bytes)?);
        self.registration = Some(reply.clone());
        self.pin_pool()?;
        Ok(reply)
    }

    /// The mapped pool (after `register`).
    pub fn pool(&self) -> Option<&PoolRegion> {
        self.pool.as_deref().map(PoolMapping::region)
    }

    fn check_slot(&self, slot: &WireSlot, len: usize) -> Result<&PoolRegion> {
        let pool = self
            .pool()
            .ok_or_else(|| Error::new(ErrorKind::NotRegistered, "no pool mapped"))?;
        if slot.length != len as u64 {
            return Err(Error::invalid(format!(
                "chunk of {len} bytes for a slot of {} bytes",
                slot.length
            )));
        }
        Ok(pool)
    }

    /// Stores `chunks` (one per hash of `range`, each exactly `object_bytes`): prepare, copy the
    /// chunks the node lacks into the pool, commit. Returns how many chunks were written (the rest
    /// were cached already). On a copy failure the reservation is aborted.
    pub fn store(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
        chunks: &[&[u8]],
    ) -> Result<usize> {
        if chunks.len() != range.chunk_hashes.len() {
            return Err(Error::invalid(format!(
                "{} chunks for {} hashes",
                chunks.len(),
                range.chunk_hashes.len()
            )));
        }
        let want = self.object_bytes()?;
        if let Some(bad) = chunks.iter().find(|c| c.len() as u64 != want) {
            return Err(Error::invalid(format!(
                "chunk of {} bytes; the layout needs {want}",
                bad.len()
            )));
        }
        let p = self.prepare_store(instance_id, range)?;
        if p.slots.is_empty() {
            return Ok(0);
        }
        let copied: Result<()> = p
            .slots
            .iter()
            .zip(&p.chunk_indices)
            .try_for_each(|(slot, &i)| {
                let data = chunks
                    .get(i as usize)
                    .ok_or_else(|| Error::internal(format!("chunk index {i} out of range")))?;
                self.check_slot(slot, data.len())?
                    .write_at(slot.offset, data)?;
                Ok(())
            });
        if let Err(e) = copied {
            let _ = self.abort_store(instance_id, p.transfer_id);
            return Err(e);
        }
        self.commit_store(instance_id, p.transfer_id)?;
        Ok(p.slots.len())
    }

    /// Retrieves every chunk of `range` (fresh read locks, released on commit); `None` if any
    /// chunk is missing.
    pub fn retrieve(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
    ) -> Result<Option<Vec<Vec<u8>>>> {
        let Some(p) = self.prepare_retrieve(instance_id, range, None)? else {
            return Ok(None);
        };
        let out: Result<Vec<Vec<u8>>> = p
            .slots
            .iter()
            .map(|slot| {
                let mut buf = vec![0u8; slot.length as usize];
                self.check_slot(slot, buf.len())?
                    .read_at(slot.offset, &mut buf)?;
                Ok(buf)
            })
            .collect();
        self.commit_retrieve(instance_id, p.transfer_id)?;
        out.map(Some)
    }
}
