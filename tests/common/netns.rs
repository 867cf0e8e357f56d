//! A network namespace joined to this one by a veth pair, for tests that cross a real (virtual)
//! network link. Needs root and `ip`; [`Netns::try_new`] says why it cannot when it cannot.

use std::process::Command;

/// A namespace with a veth pair: `host_ip` (`10.231.<n>.1`) on this side, `ns_ip`
/// (`10.231.<n>.2`) inside. Deleted, with the pair, on drop.
pub struct Netns {
    /// The namespace's name.
    pub name: String,
    /// This side's address.
    pub host_ip: String,
    /// The address inside the namespace.
    pub ns_ip: String,
    /// This side's veth device.
    pub host_dev: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let st = Command::new("ip")
        .args(args)
        .status()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if st.success() {
        Ok(())
    } else {
        Err(format!("ip {args:?} failed ({st})"))
    }
}

impl Netns {
    /// A new namespace, or why none can be made here (not root, no `ip`, no netns support).
    pub fn try_new() -> Result<Netns, String> {
        if kvnode_hw::effective_uid() != 0 {
            return Err("network namespaces need root".into());
        }
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let k = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let n = (std::process::id() + 7 * k) % 250;
        let name = format!("kvt{}-{k}", std::process::id());
        let (vh, vn) = (format!("vkh{n}x{k}"), format!("vkn{n}x{k}"));
        let host_ip = format!("10.231.{n}.1");
        let ns_ip = format!("10.231.{n}.2");
        ip(&["netns", "add", &name])?;
        let ns = Netns {
            name: name.clone(),
            host_ip: host_ip.clone(),
            ns_ip: ns_ip.clone(),
            host_dev: vh.clone(),
        };
        ip(&["link", "add", &vh, "type", "veth", "peer", "name", &vn])?;
        ip(&["link", "set", &vn, "netns", &name])?;
        ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &vh])?;
        ip(&["link", "set", &vh, "up"])?;
        let inside = |args: &[&str]| {
            let mut a = vec!["netns", "exec", &name, "ip"];
            a.extend_from_slice(args);
            ip(&a)
        };
        inside(&["addr", "add", &format!("{ns_ip}/30"), "dev", &vn])?;
        inside(&["link", "set", &vn, "up"])?;
        inside(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// [`Netns::try_new`], panicking with the reason.
    pub fn new() -> Netns {
        Netns::try_new().unwrap_or_else(|e| panic!("cannot make a network namespace: {e}"))
    }

    /// Takes this side's veth link down (the namespace becomes unreachable, silently: no
    /// FIN, no RST) or up again.
    pub fn set_link(&self, up: bool) {
        ip(&[
            "link",
            "set",
            &self.host_dev,
            if up { "up" } else { "down" },
        ])
        .unwrap();
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_dev])
            .status();
    }
}
