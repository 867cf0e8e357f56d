//! The RDMA side of a [`RemoteClient`]: the fabric choice, the engine's RDMA fabric (opened
//! before the handshake to know whether RDMA can be offered; its queue pair is created only
//! after the node authenticated, in the handshake's RDMA exchange), the engine buffers it
//! registers with the node, and the data ops whose bytes the node moves with RDMA READ/WRITE
//! straight from and into those buffers.
//!
//! **Untested on hardware**: on a host without RDMA, [`FabricChoice::Auto`] falls back to TCP
//! and [`FabricChoice::Rdma`] fails with the reason; everything past opening the device is
//! compiled only (the node's half of these data ops is tested through the fake fabric).

#![cfg_attr(not(feature = "rdma"), allow(unused_imports, dead_code))]

use std::str::FromStr;

use crate::error::{Error, ErrorKind, Result};

use super::remote::{RemoteClient, TcpTransport};
use crate::protocol::{ChunkRange, DataPath, RemoteBuf, RemoteRegion, Request, Response};

/// Which fabric a [`RemoteClient`] asks for.
///
/// Invariant: plain choice; [`FabricChoice::Auto`] never fails for lack of RDMA (it falls back
/// to TCP when this host or the node lacks it); [`FabricChoice::Rdma`] fails with the reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FabricChoice {
    /// RDMA when both this host and the node can, else TCP.
    #[default]
    Auto,
    /// TCP only (the bytes on the connection's stream).
    Tcp,
    /// RDMA or an error saying why not.
    Rdma,
}

impl FabricChoice {
    /// `"auto"`, `"tcp"` or `"rdma"`.
    pub fn as_str(self) -> &'static str {
        match self {
            FabricChoice::Auto => "auto",
            FabricChoice::Tcp => "tcp",
            FabricChoice::Rdma => "rdma",
        }
    }
}

impl FromStr for FabricChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<FabricChoice> {
        match s {
            "auto" => Ok(FabricChoice::Auto),
            "tcp" => Ok(FabricChoice::Tcp),
            "rdma" => Ok(FabricChoice::Rdma),
            other => Err(Error::invalid(format!(
                "fabric {other:?}: expected auto, tcp or rdma"
            ))),
        }
    }
}

/// A buffer registered with the node over this connection ([`RemoteClient::register_buffer`]).
///
/// Invariant: names a buffer of the client that created it, until unregistered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(pub u32);

/// Where one chunk lies in a registered buffer: `object_bytes` bytes from `offset`.
///
/// Invariant: plain data; checked against the buffer before anything is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufSpan {
    /// The registered buffer.
    pub buffer: BufferId,
    /// Offset of the chunk's first byte in it.
    pub offset: u64,
}

/// The error of an RDMA-only call on a connection that chose TCP.
fn not_rdma() -> Error {
    Error::new(
        ErrorKind::Unsupported,
        "this connection moves bytes over TCP (its handshake chose tcp): registered buffers \
         need a connection that chose RDMA; use store/retrieve_into",
    )
}

#[cfg(feature = "rdma")]
mod engine {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use kvnode_hw::fabric::{
        ConnId, ConnSetup, EngineBuffer, Fabric, PendingQp, RdmaEndpoint, RdmaFabric, RdmaOptions,
        RegisteredBuffer,
    };

    use crate::transport::tcp::handshake::QpSetup;

    /// The engine's RDMA fabric, opened before the handshake.
    pub type EngineFabric = Arc<RdmaFabric>;

    /// Opens the engine's RDMA fabric on `device` (`"auto"` or a name), for remote access by
    /// the node; the error is the reason (e.g. no kernel support).
    pub fn open(device: &str) -> Result<EngineFabric, String> {
        RdmaFabric::open(RdmaOptions {
            device: device.to_owned(),
            remote_access: true,
            ..RdmaOptions::default()
        })
        .map(Arc::new)
        .map_err(|e| match e {
            kvnode_hw::HwError::Os { op: "rdma", source } => source.to_string(),
            other => other.to_string(),
        })
    }

    /// The engine's queue-pair setup for the handshake's RDMA exchange.
    pub struct EngineQp<'a>(pub &'a RdmaFabric);

    impl QpSetup for EngineQp<'_> {
        type Pending = PendingQp;
        type Conn = ConnId;

        fn prepare(&mut self) -> Result<(PendingQp, RdmaEndpoint), String> {
            match self.0.prepare_endpoint() {
                Ok(Some(p)) => Ok(p),
                Ok(None) => Err("the RDMA fabric gave no queue pair".into()),
                Err(e) => Err(e.to_string()),
            }
        }

        fn connect(&mut self, local: PendingQp, remote: RdmaEndpoint) -> Result<ConnId, String> {
            self.0
                .connect(ConnSetup::Rdma { local, remote })
                .map_err(|e| e.to_string())
        }

        fn abandon(&mut self, conn: ConnId) {
            self.0.teardown(conn);
        }
    }

    /// A connection's RDMA state: the engine's fabric, its queue pair towards the node, the
    /// registered buffers. Invariant: every buffer in `buffers` is registered with the node
    /// under its id; the queue pair is torn down on drop (the engine never posts: the node
    /// moves the bytes).
    pub struct ClientRdma {
        pub(in crate::client) buffers: BTreeMap<u32, super::super::remote_gpu::ClientBuffer>,
        pub(in crate::client) next_id: u32,
        pub(in crate::client) fabric: EngineFabric,
        conn: ConnId,
    }

    impl ClientRdma {
        pub fn new(fabric: EngineFabric, conn: ConnId) -> ClientRdma {
            ClientRdma {
                buffers: BTreeMap::new(),
                next_id: 1,
                fabric,
                conn,
            }
        }

        pub fn register(&self, buf: EngineBuffer) -> crate::Result<RegisteredBuffer> {
            RegisteredBuffer::register(&self.fabric, buf).map_err(|e| {
                crate::error::Error::from(e).context("cannot register the buffer for RDMA")
            })
        }

        pub fn describe(&self) -> String {
            self.fabric.describe()
        }
    }

    impl Drop for ClientRdma {
        fn drop(&mut self) {
            self.fabric.teardown(self.conn);
        }
    }
}

#[cfg(not(feature = "rdma"))]
mod engine {
    /// No RDMA in this build: no value exists.
    pub enum EngineFabric {}
    /// No RDMA in this build: no value exists.
    pub enum ClientRdma {}

    pub fn open(_device: &str) -> Result<EngineFabric, String> {
        Err("kvnode was built without the `rdma` feature".into())
    }
}

pub(super) use engine::{ClientRdma, EngineFabric};

/// Opens the engine's RDMA fabric for `choice`: `Ok(None)` for TCP (or `Auto` on a host that
/// cannot, the reason logged at debug level); `Rdma` on such a host is an `Unsupported` error
/// naming the reason.
pub(super) fn open_for(choice: FabricChoice, device: &str) -> Result<Option<EngineFabric>> {
    match choice {
        FabricChoice::Tcp => Ok(None),
        FabricChoice::Auto => Ok(engine::open(device)
            .map_err(|why| tracing::debug!(%why, "RDMA unavailable on this host: offering TCP"))
            .ok()),
        FabricChoice::Rdma => engine::open(device).map(Some).map_err(|why| {
            Error::new(
                ErrorKind::Unsupported,
                format!(
                    "RDMA was asked for (fabric rdma) but this host cannot use it: {why}; use \
                     fabric auto or tcp"
                ),
            )
        }),
    }
}

/// Runs the handshake's RDMA exchange with the engine's fabric; `Ok(None)` when the handshake
/// chose TCP.
#[cfg(feature = "rdma")]
pub(super) fn exchange(
    stream: &std::net::TcpStream,
    fabric: Option<EngineFabric>,
    chose_rdma: bool,
    deadline: std::time::Instant,
) -> std::result::Result<Option<ClientRdma>, crate::transport::tcp::handshake::HandshakeError> {
    use crate::transport::tcp::handshake::{client_rdma_exchange, HandshakeError};
    if !chose_rdma {
        return Ok(None);
    }
    let Some(fabric) = fabric else {
        return Err(HandshakeError::Malformed(
            "the node chose RDMA, which this client did not offer".into(),
        ));
    };
    let conn = client_rdma_exchange(stream, &mut engine::EngineQp(&fabric), deadline)?;
    Ok(Some(ClientRdma::new(fabric, conn)))
}

/// Without the `rdma` feature no fabric exists: the handshake never chooses RDMA.
#[cfg(not(feature = "rdma"))]
pub(super) fn exchange(
    _stream: &std::net::TcpStream,
    _fabric: Option<EngineFabric>,
    chose_rdma: bool,
    _deadline: std::time::Instant,
) -> std::result::Result<Option<ClientRdma>, crate::transport::tcp::handshake::HandshakeError> {
    if chose_rdma {
        return Err(crate::transport::tcp::handshake::HandshakeError::Malformed(
            "the node chose RDMA, which this client did not offer".into(),
        ));
    }
    Ok(None)
}

#[cfg(feature = "rdma")]
impl TcpTransport {
    fn rdma(&self) -> Result<&ClientRdma> {
        self.rdma_state().ok_or_else(not_rdma)
    }
}

impl RemoteClient {
    /// The RDMA device this connection uses, when its handshake chose RDMA.
    pub fn rdma_device(&self) -> Option<String> {
        #[cfg(feature = "rdma")]
        return self.stream.rdma_state().map(ClientRdma::describe);
        #[cfg(not(feature = "rdma"))]
        return self.stream.rdma_state().map(|r| match *r {});
    }
}

#[cfg(feature = "rdma")]
impl RemoteClient {
    pub(super) fn rdma_mut(&mut self) -> Result<&mut ClientRdma> {
        self.check_unpoisoned()?;
        self.stream.rdma_state_mut().ok_or_else(not_rdma)
    }

    /// `Err` once a descriptor op failed without the node's answer: the node may still be
    /// reading or writing the registered buffers, so they are never handed out again.
    fn check_unpoisoned(&self) -> Result<()> {
        match &self.stream.rdma_poisoned {
            None => Ok(()),
            Some(why) => Err(Error::new(
                ErrorKind::Io,
                format!(
                    "the registered buffers are no longer usable: a transfer failed without the \
                     node's answer ({why}), so its RDMA may still be running; reconnect"
                ),
            )),
        }
    }

    /// Sends a descriptor op and poisons the buffers if it fails without the node's answer.
    fn descriptor_call(&mut self, req: &Request) -> Result<Response> {
        self.check_unpoisoned()?;
        match self.call(req) {
            Err(e) if e.kind == ErrorKind::Io || e.kind == ErrorKind::Internal => {
                self.stream.rdma_poisoned = Some(e.to_string());
                Err(e)
            }
            other => other,
        }
    }

    /// Registers `buf` for the node's RDMA READ and WRITE and tells the node (REGISTER_BUFFERS);
    /// the client owns it from now on (fill it with [`RemoteClient::buffer_mut`]). Only on a
    /// connection that chose RDMA. Untested on hardware.
    pub fn register_buffer(&mut self, buf: kvnode_hw::fabric::EngineBuffer) -> Result<BufferId> {
        let reg = self.rdma_mut()?.register(buf)?;
        self.announce_buffer(super::remote_gpu::ClientBuffer::Host(reg))
    }

    /// Tells the node about `buf` (REGISTER_BUFFERS) under the next id and keeps it.
    pub(super) fn announce_buffer(
        &mut self,
        buf: super::remote_gpu::ClientBuffer,
    ) -> Result<BufferId> {
        let id = self.announce_region(buf.remote_view())?;
        self.rdma_mut()?.buffers.insert(id.0, buf);
        Ok(id)
    }

    /// REGISTER_BUFFERS for a region `(addr, len, rkey)` under the next id (taken on success).
    pub(super) fn announce_region(
        &mut self,
        (addr, len, rkey): (u64, u64, u32),
    ) -> Result<BufferId> {
        let id = self.rdma_mut()?.next_id;
        let region = RemoteRegion {
            id,
            addr,
            len,
            rkey,
        };
        match self.call(&Request::RegisterBuffers {
            regions: vec![region],
        })? {
            Response::BuffersRegistered { .. } => {}
            r => return Err(Self::unexpected(r)),
        }
        let rdma = self.rdma_mut()?;
        rdma.next_id = rdma
            .next_id
            .checked_add(1)
            .ok_or_else(|| Error::limit("buffer ids of this connection are exhausted (u32)"))?;
        Ok(BufferId(id))
    }

    /// Unregisters `id` with the node (UNREGISTER_BUFFERS), then deregisters it and gives the
    /// memory back.
    pub fn unregister_buffer(&mut self, id: BufferId) -> Result<kvnode_hw::fabric::EngineBuffer> {
        match self.rdma_mut()?.buffers.get(&id.0) {
            None => return Err(Error::invalid(format!("buffer {} is not registered", id.0))),
            Some(b) if b.host().is_none() => {
                return Err(Error::invalid(format!(
                    "buffer {} is device memory: use unregister_device_buffer",
                    id.0
                )))
            }
            Some(_) => {}
        }
        match self.withdraw_buffer(id)? {
            super::remote_gpu::ClientBuffer::Host(reg) => Ok(reg.into_buffer()),
            _ => Err(Error::internal("checked to be a host buffer")),
        }
    }

    /// Tells the node to forget `id` (UNREGISTER_BUFFERS), then takes it out of the table.
    pub(super) fn withdraw_buffer(
        &mut self,
        id: BufferId,
    ) -> Result<super::remote_gpu::ClientBuffer> {
        self.call(&Request::UnregisterBuffers { ids: vec![id.0] })?;
        self.rdma_mut()?
            .buffers
            .remove(&id.0)
            .ok_or_else(|| Error::invalid(format!("buffer {} is not registered", id.0)))
    }

    /// The bytes of registered buffer `id`.
    pub fn buffer(&self, id: BufferId) -> Result<&[u8]> {
        self.check_unpoisoned()?;
        let rdma = self.stream.rdma()?;
        match rdma.buffers.get(&id.0) {
            Some(b) => b
                .host()
                .map(|h| h.as_slice())
                .ok_or_else(|| device_buffer(id)),
            None => Err(Error::invalid(format!("buffer {} is not registered", id.0))),
        }
    }

    /// The bytes of registered buffer `id`, to fill before a store.
    pub fn buffer_mut(&mut self, id: BufferId) -> Result<&mut [u8]> {
        let rdma = self.rdma_mut()?;
        match rdma.buffers.get_mut(&id.0) {
            Some(b) => b
                .host_mut()
                .map(|h| h.as_mut_slice())
                .ok_or_else(|| device_buffer(id)),
            None => Err(Error::invalid(format!("buffer {} is not registered", id.0))),
        }
    }

    /// Descriptors of `spans`, each `len` bytes, checked against the registered buffers.
    pub(super) fn descriptors(&self, spans: &[BufSpan], len: u64) -> Result<Vec<RemoteBuf>> {
        let rdma = self.stream.rdma()?;
        spans
            .iter()
            .map(|s| {
                let b = rdma.buffers.get(&s.buffer.0).ok_or_else(|| {
                    Error::invalid(format!("buffer {} is not registered", s.buffer.0))
                })?;
                if s.offset.checked_add(len).is_none_or(|end| end > b.len()) {
                    return Err(Error::invalid(format!(
                        "{len} bytes at offset {} run past buffer {} ({} bytes)",
                        s.offset,
                        s.buffer.0,
                        b.len()
                    )));
                }
                Ok(RemoteBuf {
                    region: s.buffer.0,
                    offset: s.offset,
                    len,
                })
            })
            .collect()
    }

    /// WRITE_SLOTS with descriptors: the node reads `bufs` (one per slot of prepared store
    /// `transfer_id`, each its slot's length) from this engine's registered memory into the
    /// slots, and publishes when `commit`. Returns (bytes, published).
    pub fn write_slots_remote(
        &mut self,
        instance_id: u64,
        transfer_id: u64,
        bufs: Vec<RemoteBuf>,
        commit: bool,
    ) -> Result<(u64, Option<u32>)> {
        match self.descriptor_call(&Request::WriteSlots {
            instance_id,
            transfer_id,
            data: DataPath::Remote(bufs),
            commit,
        })? {
            Response::SlotsWritten { bytes, published } => Ok((bytes, published)),
            r => Err(Self::unexpected(r)),
        }
    }

    /// READ_SLOTS with descriptors: the node writes prepared retrieve `transfer_id`'s slots
    /// into `bufs` of this engine's registered memory and releases its locks when `commit`.
    /// Returns the bytes written.
    pub fn read_slots_remote(
        &mut self,
        instance_id: u64,
        transfer_id: u64,
        bufs: Vec<RemoteBuf>,
        commit: bool,
    ) -> Result<u64> {
        match self.descriptor_call(&Request::ReadSlots {
            instance_id,
            transfer_id,
            data: DataPath::Remote(bufs),
            commit,
        })? {
            Response::SlotsRead { bytes } => Ok(bytes),
            r => Err(Self::unexpected(r)),
        }
    }

    /// Stores `chunks` (one span per hash of `range`, each `object_bytes` long) from registered
    /// buffers: prepare, the node reads the chunks it lacks with RDMA, publish. Returns how many
    /// chunks moved (the rest were cached already). Untested on hardware.
    pub fn store_registered(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
        chunks: &[BufSpan],
    ) -> Result<usize> {
        let n = self.object_bytes()?;
        span_count(chunks.len(), range)?;
        self.descriptors(chunks, n)?;
        let p = self.prepare_store(instance_id, range)?;
        if p.slots.is_empty() {
            return Ok(0);
        }
        let picked: Vec<BufSpan> = p
            .chunk_indices
            .iter()
            .map(|&i| chunks.get(i as usize).copied())
            .collect::<Option<_>>()
            .ok_or_else(|| Error::internal("the node named a chunk index out of range"))?;
        let bufs = self.descriptors(&picked, n)?;
        if p.slots.iter().any(|s| s.length != n) {
            let _ = self.abort_store(instance_id, p.transfer_id);
            return Err(Error::internal("the node's slots do not match the layout"));
        }
        self.write_slots_remote(instance_id, p.transfer_id, bufs, true)?;
        Ok(p.slots.len())
    }

    /// Retrieves every chunk of `range` into registered buffers (one span per hash, each
    /// `object_bytes` long), written by the node with RDMA; `false` (nothing written) if any
    /// chunk is missing. With `lookup_session`, relies on that LOOKUP's locks. Untested on
    /// hardware.
    pub fn retrieve_registered(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
        lookup_session: Option<&str>,
        out: &[BufSpan],
    ) -> Result<bool> {
        let n = self.object_bytes()?;
        span_count(out.len(), range)?;
        let bufs = self.descriptors(out, n)?;
        let Some(p) = self.prepare_retrieve(instance_id, range, lookup_session)? else {
            return Ok(false);
        };
        if p.slots.len() != out.len() || p.slots.iter().any(|s| s.length != n) {
            let _ = self.commit_retrieve(instance_id, p.transfer_id);
            return Err(Error::internal(
                "the node's slots do not match the buffers (layout changed?)",
            ));
        }
        self.read_slots_remote(instance_id, p.transfer_id, bufs, true)?;
        Ok(true)
    }
}

/// The error of a host-bytes accessor on a device buffer.
#[cfg(feature = "rdma")]
fn device_buffer(id: BufferId) -> Error {
    Error::invalid(format!(
        "buffer {} is device memory: its bytes are not host memory",
        id.0
    ))
}

#[cfg(feature = "rdma")]
pub(super) fn span_count(n: usize, range: &ChunkRange) -> Result<()> {
    if n != range.chunk_hashes.len() {
        return Err(Error::invalid(format!(
            "{n} buffer spans for {} hashes",
            range.chunk_hashes.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fabric_choices_parse_and_name_themselves() {
        for c in [FabricChoice::Auto, FabricChoice::Tcp, FabricChoice::Rdma] {
            assert_eq!(c.as_str().parse::<FabricChoice>().unwrap(), c);
        }
        let e = "ib".parse::<FabricChoice>().unwrap_err().to_string();
        assert!(e.contains("auto, tcp or rdma"), "{e}");
        assert_eq!(FabricChoice::default(), FabricChoice::Auto);
    }

    /// On a host without RDMA (this one), `Auto` opens nothing and `Rdma` names the reason.
    #[test]
    fn rdma_on_a_host_without_it_is_a_clear_error_and_auto_falls_back() {
        if kvnode_hw::fabric::rdma_availability("auto").is_ok() {
            eprintln!("this host has RDMA: the fallback is not exercised here");
            return;
        }
        assert!(open_for(FabricChoice::Auto, "auto").unwrap().is_none());
        assert!(open_for(FabricChoice::Tcp, "auto").unwrap().is_none());
        let e = open_for(FabricChoice::Rdma, "auto").expect_err("no RDMA here");
        assert_eq!(e.kind, ErrorKind::Unsupported);
        let m = e.to_string();
        assert!(m.contains("this host cannot use it"), "{m}");
    }
}
