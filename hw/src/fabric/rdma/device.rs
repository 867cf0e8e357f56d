//! Opening an RDMA device: the device list, the port, the GID, the protection domain.
//!
//! **Untested on hardware**: the development machine has no RDMA (InfiniBand is compiled out of
//! its kernel, `ibv_get_device_list` fails with `ENOSYS`); only that path runs in tests.

use std::ffi::CStr;
use std::io;
use std::path::Path;
use std::ptr;

use rdma_sys::{
    ___ibv_query_port, ibv_alloc_pd, ibv_close_device, ibv_context, ibv_dealloc_pd,
    ibv_device_attr, ibv_fork_init, ibv_free_device_list, ibv_get_device_list, ibv_get_device_name,
    ibv_open_device, ibv_pd, ibv_port_attr, ibv_port_state, ibv_query_device,
};

use super::gid::{choose_gid, parse_gid, GidEntry, GidType};
use super::RdmaOptions;
use crate::{HwError, HwResult};

/// Where the kernel publishes RDMA devices.
pub(super) const SYSFS_INFINIBAND: &str = "/sys/class/infiniband";

/// Most GID table entries read per port (the index is a `u8`).
pub(super) const MAX_GID_TABLE: usize = 256;

/// Outstanding RDMA READs per queue pair we ask for (clamped to the device's limits).
pub(super) const QP_RD_ATOMIC: u8 = 16;

/// `IBV_LINK_LAYER_INFINIBAND` (a `#define` in verbs.h, absent from the bindings).
const LINK_LAYER_INFINIBAND: u8 = 1;

/// The RDMA fabric's error for "no usable RDMA here": the reason is the whole message.
pub(super) fn unavailable(reason: String) -> HwError {
    HwError::Os {
        op: "rdma",
        source: io::Error::new(io::ErrorKind::Unsupported, reason),
    }
}

/// How packets are addressed on the port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LinkLayer {
    /// InfiniBand: LID routing inside the subnet (GID index 0).
    InfiniBand,
    /// Ethernet (RoCE): GID routing; the GID comes from [`choose_gid`].
    Ethernet,
}

/// An open device with its protection domain, port and GID.
///
/// Invariant: `ctx` and `pd` are valid until drop (PD freed before the context is closed);
/// everything built on them (CQs, QPs, MRs) holds an `Arc<Device>`, so it is destroyed first.
pub(super) struct Device {
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    /// The device name (`mlx5_0`).
    pub name: String,
    /// The port (1-based).
    pub port: u8,
    /// The port's link layer.
    pub link: LinkLayer,
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The port's active MTU (`IBV_MTU_*`).
    pub mtu: u32,
    /// The chosen GID entry.
    pub gid: GidEntry,
    /// Outstanding RDMA READs per QP (initiator and responder), clamped to the device.
    pub rd_atomic: u8,
}

// SAFETY: libibverbs contexts and PDs may be used from any thread (verbs are thread-safe, the
// providers lock internally); the raw pointers are only freed in `Drop`.
unsafe impl Send for Device {}
// SAFETY: as above; `&Device` only hands the pointers to thread-safe verbs.
unsafe impl Sync for Device {}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: `pd` came from `ibv_alloc_pd` on `ctx`; every object on it holds an
        // `Arc<Device>` and is gone. Errors (EBUSY) only leak.
        let rc = unsafe { ibv_dealloc_pd(self.pd) };
        if rc != 0 {
            tracing::warn!(device = %self.name, rc, "ibv_dealloc_pd failed (leaked)");
        }
        // SAFETY: `ctx` came from `ibv_open_device` and is closed once, here.
        unsafe { ibv_close_device(self.ctx) };
    }
}

impl Device {
    /// The verbs context.
    pub fn ctx(&self) -> *mut ibv_context {
        self.ctx
    }

    /// The protection domain every MR and QP of the fabric uses.
    pub fn pd(&self) -> *mut ibv_pd {
        self.pd
    }

    /// `"mlx5_0 port 1 gid 3 (RoCEv2 ::ffff:10.0.0.5 on eth0)"` (InfiniBand: with the LID).
    pub fn describe(&self) -> String {
        match self.link {
            LinkLayer::Ethernet => format!("{} port {} {}", self.name, self.port, self.gid),
            LinkLayer::InfiniBand => {
                format!(
                    "{} port {} lid {} {}",
                    self.name, self.port, self.lid, self.gid
                )
            }
        }
    }
}

/// The device list, freed on drop.
struct DeviceList {
    list: *mut *mut rdma_sys::ibv_device,
    len: usize,
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: `list` came from `ibv_get_device_list` and is freed once; opened contexts stay
        // valid after it (verbs man page).
        unsafe { ibv_free_device_list(self.list) };
    }
}

impl DeviceList {
    fn get() -> HwResult<DeviceList> {
        let mut n: libc::c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the result is NULL or an array of `n` devices.
        let list = unsafe { ibv_get_device_list(&mut n) };
        if list.is_null() {
            let e = io::Error::last_os_error();
            let reason = match e.raw_os_error() {
                Some(libc::ENOSYS) => {
                    "no RDMA kernel support (ibv_get_device_list: ENOSYS)".to_owned()
                }
                _ => format!("ibv_get_device_list failed: {e}"),
            };
            return Err(unavailable(reason));
        }
        let list = DeviceList {
            list,
            len: usize::try_from(n).unwrap_or(0),
        };
        if list.len == 0 {
            return Err(unavailable("no RDMA device".to_owned()));
        }
        Ok(list)
    }

    fn device(&self, i: usize) -> *mut rdma_sys::ibv_device {
        debug_assert!(i < self.len);
        // SAFETY: `i < len`, the array holds `len` valid device pointers.
        unsafe { *self.list.add(i) }
    }

    fn name(&self, i: usize) -> String {
        // SAFETY: a valid device; the name is a NUL-terminated string owned by the list.
        let p = unsafe { ibv_get_device_name(self.device(i)) };
        if p.is_null() {
            return format!("device#{i}");
        }
        // SAFETY: non-NULL, NUL-terminated, valid while the list lives.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// The names of the RDMA devices, or why there are none.
pub(super) fn device_names() -> HwResult<Vec<String>> {
    let list = DeviceList::get()?;
    Ok((0..list.len).map(|i| list.name(i)).collect())
}

/// Opens the device `opts.device` (`"auto"`: the first one with an active port and a usable
/// GID) and allocates its protection domain.
pub(super) fn open(opts: &RdmaOptions) -> HwResult<Device> {
    if opts.fork_init {
        // SAFETY: no arguments; must precede every registration, which it does (nothing is
        // registered before `open` returns).
        let rc = unsafe { ibv_fork_init() };
        if rc != 0 {
            tracing::warn!(
                rc,
                "ibv_fork_init failed; a fork may corrupt registered memory"
            );
        }
    }
    let list = DeviceList::get()?;
    let auto = opts.device == "auto";
    let mut reasons = Vec::new();
    for i in 0..list.len {
        let name = list.name(i);
        if !auto && name != opts.device {
            continue;
        }
        match open_one(&list, i, &name, opts) {
            Ok(d) => return Ok(d),
            Err(why) => reasons.push(format!("{name}: {why}")),
        }
    }
    if reasons.is_empty() {
        let names: Vec<String> = (0..list.len).map(|i| list.name(i)).collect();
        return Err(unavailable(format!(
            "RDMA device {:?} (rdma_device) not found; present: {}",
            opts.device,
            names.join(", ")
        )));
    }
    Err(unavailable(format!(
        "no usable RDMA port: {}",
        reasons.join("; ")
    )))
}

/// Closes a context unless it was handed over.
struct CtxGuard(*mut ibv_context);

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: an open context not handed to a `Device`.
            unsafe { ibv_close_device(self.0) };
        }
    }
}

fn open_one(list: &DeviceList, i: usize, name: &str, opts: &RdmaOptions) -> Result<Device, String> {
    // SAFETY: a valid device of the live list.
    let ctx = unsafe { ibv_open_device(list.device(i)) };
    if ctx.is_null() {
        return Err(format!("ibv_open_device: {}", io::Error::last_os_error()));
    }
    let mut guard = CtxGuard(ctx);
    // SAFETY: all-zero is a valid `ibv_device_attr` (plain integers and arrays).
    let mut dattr: ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: valid context and out-pointer.
    let rc = unsafe { ibv_query_device(ctx, &mut dattr) };
    if rc != 0 {
        return Err(format!(
            "ibv_query_device: {}",
            io::Error::from_raw_os_error(rc)
        ));
    }
    let ports: Vec<u8> = match opts.port {
        Some(p) if p == 0 || p > dattr.phys_port_cnt => {
            return Err(format!(
                "port {p} (rdma_port) does not exist (the device has {} ports)",
                dattr.phys_port_cnt
            ))
        }
        Some(p) => vec![p],
        None => (1..=dattr.phys_port_cnt).collect(),
    };
    let mut why = Vec::new();
    for port in ports {
        // SAFETY: all-zero is a valid `ibv_port_attr` (plain integers).
        let mut pattr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: valid context, existing port number, valid out-pointer (the helper passes
        // its size to the provider).
        let rc = unsafe { ___ibv_query_port(ctx, port, &mut pattr) };
        if rc != 0 {
            why.push(format!(
                "port {port}: ibv_query_port: {}",
                io::Error::from_raw_os_error(rc)
            ));
            continue;
        }
        if pattr.state != ibv_port_state::IBV_PORT_ACTIVE {
            why.push(format!("port {port} is not active (state {})", pattr.state));
            continue;
        }
        let link = if pattr.link_layer == LINK_LAYER_INFINIBAND {
            LinkLayer::InfiniBand
        } else {
            LinkLayer::Ethernet
        };
        let n = usize::try_from(pattr.gid_tbl_len)
            .unwrap_or(0)
            .min(MAX_GID_TABLE);
        let table = read_gid_table(Path::new(SYSFS_INFINIBAND), name, port, n);
        let gid = match link {
            LinkLayer::Ethernet => choose_gid(&table, opts.gid_index),
            // InfiniBand routes by LID inside the subnet; GID index 0 is the port GID.
            LinkLayer::InfiniBand => Ok(opts.gid_index.unwrap_or(0)),
        };
        let gid = match gid.and_then(|g| {
            table
                .iter()
                .find(|e| e.index == g)
                .cloned()
                .ok_or_else(|| format!("GID index {g} unreadable in sysfs"))
        }) {
            Ok(g) => g,
            Err(e) => {
                why.push(format!("port {port}: {e}"));
                continue;
            }
        };
        // SAFETY: valid context.
        let pd = unsafe { ibv_alloc_pd(ctx) };
        if pd.is_null() {
            return Err(format!("ibv_alloc_pd: {}", io::Error::last_os_error()));
        }
        let clamp = |v: libc::c_int| u8::try_from(v.max(1)).unwrap_or(u8::MAX);
        let rd_atomic = QP_RD_ATOMIC
            .min(clamp(dattr.max_qp_rd_atom))
            .min(clamp(dattr.max_qp_init_rd_atom));
        guard.0 = ptr::null_mut();
        return Ok(Device {
            ctx,
            pd,
            name: name.to_owned(),
            port,
            link,
            lid: pattr.lid,
            mtu: pattr.active_mtu,
            gid,
            rd_atomic,
        });
    }
    Err(if why.is_empty() {
        "the device has no ports".to_owned()
    } else {
        why.join("; ")
    })
}

/// Reads entries `0..n` of a port's GID table from sysfs (`gids/<i>`, `gid_attrs/types/<i>`,
/// `gid_attrs/ndevs/<i>`); unreadable GIDs are skipped, an unreadable type is `Unknown`.
pub(super) fn read_gid_table(root: &Path, dev: &str, port: u8, n: usize) -> Vec<GidEntry> {
    let base = root.join(dev).join("ports").join(port.to_string());
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).ok();
    let mut out = Vec::new();
    for i in 0..n.min(MAX_GID_TABLE) {
        let Some(gid) = read(base.join("gids").join(i.to_string())).and_then(|s| parse_gid(&s))
        else {
            continue;
        };
        let kind = read(base.join("gid_attrs/types").join(i.to_string()))
            .map(|s| GidType::parse(&s))
            .unwrap_or(GidType::Unknown);
        let ndev = read(base.join("gid_attrs/ndevs").join(i.to_string()))
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty());
        out.push(GidEntry {
            index: i as u8,
            gid,
            kind,
            ndev,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_sysfs_gid_table() {
        let dir = std::env::temp_dir().join(format!("kvnode-rdma-sysfs-{}", std::process::id()));
        let base = dir.join("mlx5_0/ports/1");
        std::fs::create_dir_all(base.join("gids")).unwrap();
        std::fs::create_dir_all(base.join("gid_attrs/types")).unwrap();
        std::fs::create_dir_all(base.join("gid_attrs/ndevs")).unwrap();
        let w = |p: &str, s: &str| std::fs::write(base.join(p), s).unwrap();
        w("gids/0", "fe80:0000:0000:0000:0202:c9ff:fe00:0001\n");
        w("gid_attrs/types/0", "IB/RoCE v1\n");
        w("gid_attrs/ndevs/0", "eth0\n");
        w("gids/1", "0000:0000:0000:0000:0000:ffff:0a00:0005\n");
        w("gid_attrs/types/1", "RoCE v2\n");
        w("gid_attrs/ndevs/1", "eth0\n");
        w("gids/2", "0000:0000:0000:0000:0000:0000:0000:0000\n"); // empty slot, no attrs
        let t = read_gid_table(&dir, "mlx5_0", 1, 4);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(t.len(), 3, "entry 3 has no file: skipped");
        assert_eq!(t[1].kind, GidType::RoceV2);
        assert_eq!(t[1].ndev.as_deref(), Some("eth0"));
        assert_eq!(t[2].kind, GidType::Unknown);
        assert_eq!(choose_gid(&t, None), Ok(1));
    }

    #[test]
    fn unavailable_error_carries_only_the_reason() {
        let e = unavailable("no RDMA device".into());
        assert_eq!(e.to_string(), "rdma: no RDMA device");
    }
}
