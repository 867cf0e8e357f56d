//! GPU memory of a remote engine on a connection that chose RDMA: the node's NIC reads and
//! writes the engine's device memory directly (GPUDirect RDMA: the device buffer is exported as
//! a dma-buf and registered with `ibv_reg_dmabuf_mr`), or, when the GPU, its driver or the NIC
//! cannot, a registered and pinned host staging buffer of the same size stands in (device →
//! staging before a store, staging → device after a retrieve, one wait each).
//!
//! **Untested on hardware**: registration needs an RDMA NIC (this development machine has
//! none); the staging copies ([`copy_staged`]) are tested with the simulated GPU, and the
//! node's half of these data ops through the fake fabric.

#![cfg_attr(not(feature = "rdma"), allow(dead_code, unused_imports))]

use kvnode_hw::gpu::{CopyItem, CopyReport, DeviceBuffer, GpuStream, HostMemory};

use crate::error::{Error, Result};

/// How a registered device buffer is reached by the node's NIC.
///
/// Invariant: plain report of what registration achieved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DevicePath {
    /// GPUDirect RDMA: the NIC moves bytes straight to and from device memory.
    GpuDirect,
    /// Through a pinned host buffer of the same size; `reason` says why GPUDirect was not used.
    HostStaging {
        /// Why not GPUDirect (the export's or registration's error).
        reason: String,
    },
}

/// Which way a staging copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StageDir {
    /// Device → staging (before a store).
    ToStaging,
    /// Staging → device (after a retrieve).
    ToDevice,
}

/// Copies `n` bytes at each of `offsets` between `device` and the same offsets of `staging`
/// (the staging buffer mirrors the device buffer), with one wait.
pub(crate) fn copy_staged<H: HostMemory>(
    stream: &mut GpuStream,
    device: &DeviceBuffer,
    staging: &mut H,
    offsets: &[u64],
    n: u64,
    dir: StageDir,
) -> Result<CopyReport> {
    if staging.host_range().1 as u64 != device.len() {
        return Err(Error::internal(
            "a staging buffer differs in size from its device buffer",
        ));
    }
    let items: Vec<CopyItem> = offsets
        .iter()
        .map(|&o| {
            Ok(CopyItem {
                host_offset: o,
                device: device.span(o, n)?,
            })
        })
        .collect::<Result<_>>()?;
    let r = match dir {
        StageDir::ToStaging => stream.device_to_host(staging, &items)?,
        StageDir::ToDevice => stream.host_to_device(&*staging, &items)?,
    };
    Ok(r)
}

#[cfg(feature = "rdma")]
pub(crate) use rdma::ClientBuffer;

#[cfg(feature = "rdma")]
mod rdma {
    use std::collections::BTreeMap;

    use kvnode_hw::fabric::{EngineBuffer, RegisteredBuffer, RegisteredDeviceBuffer};
    use kvnode_hw::gpu::{DeviceBuffer, Pinned};

    use super::{copy_staged, DevicePath, StageDir};
    use crate::client::remote::RemoteClient;
    use crate::client::remote_rdma::span_count;
    use crate::client::{BufSpan, BufferId};
    use crate::error::{Error, ErrorKind, Result};
    use crate::protocol::ChunkRange;

    /// A buffer registered with the node over an RDMA connection.
    ///
    /// Invariant: the memory the node's NIC reaches (host buffer, device memory, or staging
    /// buffer) stays registered and allocated while the entry is in the connection's table.
    pub(crate) enum ClientBuffer {
        /// Host memory ([`RemoteClient::register_buffer`]).
        Host(RegisteredBuffer),
        /// Device memory reached with GPUDirect RDMA.
        Device(RegisteredDeviceBuffer),
        /// Device memory behind a pinned, RDMA-registered host staging buffer of its size.
        Staged {
            staging: Pinned<RegisteredBuffer>,
            device: DeviceBuffer,
        },
    }

    impl ClientBuffer {
        /// (address, length, remote key) the node's work requests use.
        pub(crate) fn remote_view(&self) -> (u64, u64, u32) {
            match self {
                ClientBuffer::Host(b) => (b.addr(), b.len(), b.rkey()),
                ClientBuffer::Device(d) => (d.addr(), d.len(), d.rkey()),
                ClientBuffer::Staged { staging, .. } => {
                    let b = staging.inner();
                    (b.addr(), b.len(), b.rkey())
                }
            }
        }

        /// Its length in bytes.
        pub(crate) fn len(&self) -> u64 {
            self.remote_view().1
        }

        /// The device memory of a device entry (the registrations end first); `None` for host
        /// buffers.
        fn into_device(self) -> DeviceBuffer {
            match self {
                ClientBuffer::Device(d) => d.into_device(),
                ClientBuffer::Staged { staging, device } => {
                    drop(staging);
                    device
                }
                ClientBuffer::Host(_) => unreachable!("only device entries are turned back"),
            }
        }

        /// The host buffer, if this is one.
        pub(crate) fn host(&self) -> Option<&RegisteredBuffer> {
            match self {
                ClientBuffer::Host(b) => Some(b),
                _ => None,
            }
        }

        /// The host buffer, mutably, if this is one.
        pub(crate) fn host_mut(&mut self) -> Option<&mut RegisteredBuffer> {
            match self {
                ClientBuffer::Host(b) => Some(b),
                _ => None,
            }
        }
    }

    impl RemoteClient {
        /// Registers device memory for the node's RDMA READ and WRITE: GPUDirect RDMA through
        /// dma-buf when the GPU, driver and NIC allow it, else a pinned host staging buffer of
        /// the same size (the returned [`DevicePath`] says which, and why). Needs an attached
        /// GPU ([`RemoteClient::attach_gpu`]) of the same handle. Untested on hardware.
        pub fn register_device_buffer(
            &mut self,
            buf: DeviceBuffer,
        ) -> std::result::Result<(BufferId, DevicePath), (DeviceBuffer, Error)> {
            let att_gpu = match self.attachment_gpu() {
                Ok(g) => g,
                Err(e) => return Err((buf, e)),
            };
            if !buf.gpu().same_handle(&att_gpu) {
                let e = Error::invalid(
                    "the device buffer belongs to another GPU handle than the attached one",
                );
                return Err((buf, e));
            }
            let fabric = match self.rdma_mut() {
                Ok(r) => r.fabric.clone(),
                Err(e) => return Err((buf, e)),
            };
            let (entry, path) = match RegisteredDeviceBuffer::register(&fabric, buf) {
                Ok(reg) => (ClientBuffer::Device(reg), DevicePath::GpuDirect),
                Err((device, why)) => {
                    let reason = why.to_string();
                    tracing::info!(%reason, "GPUDirect RDMA unavailable: staging through host memory");
                    match staging_for(&fabric, &att_gpu, device.len()) {
                        Ok(staging) => (
                            ClientBuffer::Staged { staging, device },
                            DevicePath::HostStaging { reason },
                        ),
                        Err(e) => return Err((device, e)),
                    }
                }
            };
            let view = entry.remote_view();
            match self.announce_region(view) {
                Ok(id) => match self.rdma_mut() {
                    Ok(rdma) => {
                        rdma.buffers.insert(id.0, entry);
                        Ok((id, path))
                    }
                    Err(e) => Err((entry.into_device(), e)),
                },
                Err(e) => Err((entry.into_device(), e)),
            }
        }

        /// Unregisters a device buffer with the node, then deregisters it and gives the device
        /// memory back.
        pub fn unregister_device_buffer(&mut self, id: BufferId) -> Result<DeviceBuffer> {
            match self.rdma_mut()?.buffers.get(&id.0) {
                None => return Err(Error::invalid(format!("buffer {} is not registered", id.0))),
                Some(ClientBuffer::Host(_)) => {
                    return Err(Error::invalid(format!(
                        "buffer {} is host memory: use unregister_buffer",
                        id.0
                    )))
                }
                Some(_) => {}
            }
            match self.withdraw_buffer(id)? {
                ClientBuffer::Device(d) => Ok(d.into_device()),
                ClientBuffer::Staged { staging, device } => {
                    drop(staging);
                    Ok(device)
                }
                ClientBuffer::Host(_) => Err(Error::internal("checked to be device memory")),
            }
        }

        /// Stores `chunks` (one span per hash of `range`, each `object_bytes`, in registered
        /// device buffers): prepare; for staged buffers copy the chunks the node lacks into the
        /// staging buffer (one wait per buffer); the node reads them with RDMA; publish. Returns
        /// how many chunks moved. Untested on hardware.
        pub fn store_from_device_registered(
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
            let picked: Option<Vec<BufSpan>> = p
                .chunk_indices
                .iter()
                .map(|&i| chunks.get(i as usize).copied())
                .collect();
            let staged = match picked {
                None => Err(Error::internal("the node named a chunk index out of range")),
                Some(_) if p.slots.iter().any(|s| s.length != n) => {
                    Err(Error::internal("the node's slots do not match the layout"))
                }
                Some(picked) => self
                    .stage(&picked, n, StageDir::ToStaging)
                    .and_then(|()| self.descriptors(&picked, n)),
            };
            let bufs = match staged {
                Ok(b) => b,
                Err(e) => {
                    let _ = self.abort_store(instance_id, p.transfer_id);
                    return Err(e);
                }
            };
            self.write_slots_remote(instance_id, p.transfer_id, bufs, true)?;
            Ok(p.slots.len())
        }

        /// Retrieves every chunk of `range` into registered device buffers (one span per hash,
        /// each `object_bytes`): the node writes them with RDMA (into the staging buffer for
        /// staged ones, then copied to the device, one wait per buffer). `false` (nothing
        /// written) if any chunk is missing. Untested on hardware.
        pub fn retrieve_to_device_registered(
            &mut self,
            instance_id: u64,
            range: &ChunkRange,
            lookup_session: Option<&str>,
            out: &[BufSpan],
        ) -> Result<bool> {
            if !self.retrieve_registered(instance_id, range, lookup_session, out)? {
                return Ok(false);
            }
            let n = self.object_bytes()?;
            self.stage(out, n, StageDir::ToDevice)?;
            Ok(true)
        }

        /// Copies the staged buffers' spans between device and staging memory, one call (one
        /// wait) per staged buffer; GPUDirect and host buffers need nothing.
        fn stage(&mut self, spans: &[BufSpan], n: u64, dir: StageDir) -> Result<()> {
            let mut by_buffer: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
            for s in spans {
                by_buffer.entry(s.buffer.0).or_default().push(s.offset);
            }
            let Client { stream, gpu, .. } = self;
            let rdma = stream
                .rdma_state_mut()
                .ok_or_else(|| Error::new(ErrorKind::Unsupported, "not an RDMA connection"))?;
            for (id, offsets) in by_buffer {
                if let Some(ClientBuffer::Staged { staging, device }) = rdma.buffers.get_mut(&id) {
                    let att = gpu.as_mut().ok_or_else(no_gpu)?;
                    copy_staged(att.stream_mut(), device, staging, &offsets, n, dir)?;
                }
            }
            Ok(())
        }

        pub(crate) fn attachment_gpu(&self) -> Result<kvnode_hw::gpu::Gpu> {
            self.gpu().map(|a| a.gpu().clone()).ok_or_else(no_gpu)
        }
    }

    use crate::client::Client;

    /// A pinned, RDMA-registered host buffer of `len` bytes standing in for device memory.
    fn staging_for(
        fabric: &kvnode_hw::fabric::RdmaFabric,
        gpu: &kvnode_hw::gpu::Gpu,
        len: u64,
    ) -> Result<Pinned<RegisteredBuffer>> {
        let host = EngineBuffer::new(len as usize)?;
        let reg = RegisteredBuffer::register(fabric, host)
            .map_err(|e| Error::from(e).context("cannot register the staging buffer for RDMA"))?;
        gpu.pin(reg)
            .map_err(|e| Error::from(e).context("cannot register the staging buffer with the GPU"))
    }

    fn no_gpu() -> Error {
        Error::new(
            ErrorKind::InvalidRequest,
            "no GPU attached to this client: call attach_gpu first",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvnode_hw::fabric::EngineBuffer;
    use kvnode_hw::gpu::Gpu;

    #[test]
    fn staged_copies_mirror_the_device_buffer_with_one_wait() {
        let (gpu, ctl) = Gpu::fake(64 << 20, false);
        let n = 64 << 10;
        let device = gpu.alloc(8 * n).unwrap();
        let data: Vec<u8> = (0..8 * n).map(|i| (i % 251) as u8).collect();
        device.write(0, &data).unwrap();
        let mut staging = gpu.pin(EngineBuffer::new(8 * n as usize).unwrap()).unwrap();
        let mut stream = gpu.stream().unwrap();
        let offsets = [0, n, 5 * n];
        let r = copy_staged(
            &mut stream,
            &device,
            &mut staging,
            &offsets,
            n,
            StageDir::ToStaging,
        )
        .unwrap();
        assert_eq!((r.items, r.copies, r.bytes), (3, 2, 3 * n));
        for &o in &offsets {
            let (a, b) = (o as usize, (o + n) as usize);
            assert_eq!(&staging.inner().as_slice()[a..b], &data[a..b]);
        }
        assert!(
            staging.inner().as_slice()[2 * n as usize..5 * n as usize]
                .iter()
                .all(|&b| b == 0),
            "only the asked-for spans move"
        );
        // Back: change the staging bytes and copy two spans to the device.
        staging.inner_mut().as_mut_slice()[..n as usize].fill(7);
        copy_staged(
            &mut stream,
            &device,
            &mut staging,
            &[0],
            n,
            StageDir::ToDevice,
        )
        .unwrap();
        let mut got = vec![0u8; n as usize];
        device.read(0, &mut got).unwrap();
        assert!(got.iter().all(|&b| b == 7));
        assert_eq!(ctl.counters().synchronizations, 2);
        assert_eq!(ctl.counters().pageable_copies, 0);
        // A span past the device buffer, or a staging buffer of another size, is refused.
        assert!(copy_staged(
            &mut stream,
            &device,
            &mut staging,
            &[8 * n - 1],
            n,
            StageDir::ToDevice
        )
        .is_err());
        let mut small = EngineBuffer::new(n as usize).unwrap();
        assert!(copy_staged(
            &mut stream,
            &device,
            &mut small,
            &[0],
            n,
            StageDir::ToStaging
        )
        .is_err());
    }
}
