//! Choosing the GID (the port's network address table entry) a RoCE queue pair uses.
//!
//! Pure code: the entries are read from sysfs by `device.rs` (`rdma-sys` 0.3 lacks
//! `ibv_query_gid_ex`/`ibv_query_gid_type`, so the GID *type* — RoCE v1 or v2 — and its network
//! device come from `/sys/class/infiniband/<dev>/ports/<p>/gid_attrs/{types,ndevs}/<i>`).
//!
//! The rule: RoCE v2 (routable UDP/IP) before RoCE v1 (plain Ethernet frames); an IPv4-mapped
//! address (`::ffff:a.b.c.d`, the usual data-centre setup) before a global IPv6 one; never a
//! link-local (`fe80::/10`), zero, loopback or multicast GID (not routable between hosts, or an
//! empty table slot); ties go to the lowest index.

use std::fmt;
use std::net::Ipv6Addr;

/// What kind of GID a table entry is.
///
/// Invariant: parsed from the sysfs `gid_attrs/types/<i>` text by [`GidType::parse`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GidType {
    /// `"RoCE v2"`: RoCE over UDP/IP (routable).
    RoceV2,
    /// `"IB/RoCE v1"`: InfiniBand, or RoCE v1 on an Ethernet port (same L2 only).
    IbRoceV1,
    /// Anything else (unreadable attribute, a newer kernel's name).
    Unknown,
}

impl GidType {
    /// Parses the sysfs text (trailing whitespace ignored).
    pub fn parse(s: &str) -> GidType {
        match s.trim() {
            "RoCE v2" => GidType::RoceV2,
            "IB/RoCE v1" => GidType::IbRoceV1,
            _ => GidType::Unknown,
        }
    }

    /// A short name for logs and status: `"RoCEv2"`, `"RoCEv1"`, `"unknown"`.
    pub fn as_str(self) -> &'static str {
        match self {
            GidType::RoceV2 => "RoCEv2",
            GidType::IbRoceV1 => "RoCEv1",
            GidType::Unknown => "unknown",
        }
    }
}

/// One entry of a port's GID table.
///
/// Invariant: plain data; `index` is the table index the queue pair's `sgid_index` takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidEntry {
    /// Table index.
    pub index: u8,
    /// The 16 GID bytes (network order, like an IPv6 address).
    pub gid: [u8; 16],
    /// RoCE v1/v2.
    pub kind: GidType,
    /// The network device the entry belongs to (sysfs `gid_attrs/ndevs/<i>`), if any.
    pub ndev: Option<String>,
}

impl GidEntry {
    /// The GID as an IPv6 address (IPv4-mapped ones print as `::ffff:a.b.c.d`).
    pub fn addr(&self) -> Ipv6Addr {
        Ipv6Addr::from(self.gid)
    }
}

impl fmt::Display for GidEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "gid {} ({} {}",
            self.index,
            self.kind.as_str(),
            self.addr()
        )?;
        if let Some(n) = &self.ndev {
            write!(f, " on {n}")?;
        }
        f.write_str(")")
    }
}

/// What kind of address a GID holds, for ranking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AddrClass {
    Ipv4Mapped,
    GlobalV6,
    /// Zero, link-local, loopback, multicast, or an IPv4-mapped 0.0.0.0: never used.
    Unusable(&'static str),
}

fn classify(gid: &[u8; 16]) -> AddrClass {
    let a = Ipv6Addr::from(*gid);
    if a.is_unspecified() {
        return AddrClass::Unusable("zero GID (empty table slot)");
    }
    if let Some(v4) = a.to_ipv4_mapped() {
        if v4.is_unspecified() {
            return AddrClass::Unusable("IPv4-mapped 0.0.0.0");
        }
        return AddrClass::Ipv4Mapped;
    }
    let seg0 = a.segments()[0];
    if seg0 & 0xffc0 == 0xfe80 {
        return AddrClass::Unusable("link-local fe80::/10 (not routable between hosts)");
    }
    if a.is_loopback() {
        return AddrClass::Unusable("loopback ::1");
    }
    if a.is_multicast() {
        return AddrClass::Unusable("multicast ff00::/8");
    }
    AddrClass::GlobalV6
}

/// Rank of a usable entry (lower is better), or why it is not usable.
fn rank(e: &GidEntry) -> Result<u8, &'static str> {
    let class = classify(&e.gid);
    if let AddrClass::Unusable(why) = class {
        return Err(why);
    }
    let v4 = class == AddrClass::Ipv4Mapped;
    match e.kind {
        GidType::RoceV2 if v4 => Ok(0),
        GidType::RoceV2 => Ok(1),
        GidType::IbRoceV1 if v4 => Ok(2),
        GidType::IbRoceV1 => Ok(3),
        GidType::Unknown => Err("GID type unknown (gid_attrs/types unreadable)"),
    }
}

/// The GID index to use among `entries` (one port's table).
///
/// `want = Some(i)`: index `i` if it exists and is usable (else an error naming why);
/// `None`: the best usable entry — RoCE v2 before v1, IPv4-mapped before global IPv6, lowest
/// index on ties. Never a zero, link-local, loopback or multicast GID, never an entry of unknown
/// type.
pub fn choose_gid(entries: &[GidEntry], want: Option<u8>) -> Result<u8, String> {
    if let Some(i) = want {
        let Some(e) = entries.iter().find(|e| e.index == i) else {
            return Err(format!(
                "GID index {i} (rdma_gid_index) is not in the port's GID table ({} entries)",
                entries.len()
            ));
        };
        return rank(e).map(|_| i).map_err(|why| {
            format!(
                "GID index {i} (rdma_gid_index, {}) is not usable: {why}",
                e.addr()
            )
        });
    }
    entries
        .iter()
        .filter_map(|e| rank(e).ok().map(|r| (r, e.index)))
        .min()
        .map(|(_, i)| i)
        .ok_or_else(|| {
            format!(
                "no usable GID among {} entries (need a RoCE GID with an IPv4-mapped or global \
                 IPv6 address: give the network interface an IP address)",
                entries.len()
            )
        })
}

/// Parses a GID as sysfs prints it (`"fe80:0000:0000:0000:0202:c9ff:fe00:0001"`, or any IPv6
/// text form).
pub fn parse_gid(s: &str) -> Option<[u8; 16]> {
    s.trim().parse::<Ipv6Addr>().ok().map(|a| a.octets())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(index: u8, addr: &str, kind: GidType) -> GidEntry {
        GidEntry {
            index,
            gid: parse_gid(addr).expect("test address"),
            kind,
            ndev: Some("eth0".into()),
        }
    }

    /// A typical mlx5 RoCE table: link-local v1/v2, then IPv4-mapped v1/v2, then a global v6.
    fn mlx5_table() -> Vec<GidEntry> {
        vec![
            e(0, "fe80::202:c9ff:fe00:1", GidType::IbRoceV1),
            e(1, "fe80::202:c9ff:fe00:1", GidType::RoceV2),
            e(2, "::ffff:10.0.0.5", GidType::IbRoceV1),
            e(3, "::ffff:10.0.0.5", GidType::RoceV2),
            e(4, "2001:db8::5", GidType::IbRoceV1),
            e(5, "2001:db8::5", GidType::RoceV2),
        ]
    }

    #[test]
    fn prefers_roce_v2_ipv4_mapped() {
        assert_eq!(choose_gid(&mlx5_table(), None), Ok(3));
    }

    #[test]
    fn then_roce_v2_global_v6_then_v1() {
        let mut t = mlx5_table();
        t.retain(|x| x.index != 3);
        assert_eq!(choose_gid(&t, None), Ok(5));
        t.retain(|x| x.index != 5);
        assert_eq!(choose_gid(&t, None), Ok(2));
        t.retain(|x| x.index != 2);
        assert_eq!(choose_gid(&t, None), Ok(4));
    }

    #[test]
    fn never_link_local_zero_loopback_multicast_or_unknown() {
        let t = vec![
            e(0, "fe80::1", GidType::RoceV2),
            e(1, "febf::1", GidType::RoceV2), // still fe80::/10
            e(2, "::", GidType::RoceV2),
            e(3, "::1", GidType::RoceV2),
            e(4, "ff02::1", GidType::RoceV2),
            e(5, "::ffff:0.0.0.0", GidType::RoceV2),
            e(6, "::ffff:10.1.1.1", GidType::Unknown),
        ];
        let err = choose_gid(&t, None).unwrap_err();
        assert!(err.contains("no usable GID among 7 entries"), "{err}");
        assert!(choose_gid(&[], None).unwrap_err().contains("0 entries"));
    }

    #[test]
    fn fec0_is_not_link_local() {
        // fec0::/10 (deprecated site-local) is outside fe80::/10: allowed as "global".
        let t = vec![e(7, "fec0::1", GidType::RoceV2)];
        assert_eq!(choose_gid(&t, None), Ok(7));
    }

    #[test]
    fn ties_go_to_the_lowest_index() {
        let t = vec![
            e(9, "::ffff:10.0.0.9", GidType::RoceV2),
            e(4, "::ffff:10.0.0.4", GidType::RoceV2),
            e(6, "::ffff:10.0.0.6", GidType::RoceV2),
        ];
        assert_eq!(choose_gid(&t, None), Ok(4));
    }

    #[test]
    fn explicit_index_is_checked() {
        let t = mlx5_table();
        assert_eq!(choose_gid(&t, Some(2)), Ok(2), "v1 allowed when asked for");
        assert_eq!(choose_gid(&t, Some(5)), Ok(5));
        let err = choose_gid(&t, Some(1)).unwrap_err();
        assert!(
            err.contains("GID index 1") && err.contains("link-local"),
            "{err}"
        );
        let err = choose_gid(&t, Some(42)).unwrap_err();
        assert!(
            err.contains("42") && err.contains("not in the port's GID table"),
            "{err}"
        );
        let zero = vec![e(0, "::", GidType::RoceV2)];
        assert!(choose_gid(&zero, Some(0)).unwrap_err().contains("zero GID"));
    }

    #[test]
    fn parses_sysfs_forms() {
        assert_eq!(
            parse_gid("fe80:0000:0000:0000:0202:c9ff:fe00:0001\n"),
            parse_gid("fe80::202:c9ff:fe00:1")
        );
        assert_eq!(
            parse_gid("0000:0000:0000:0000:0000:ffff:0a00:0005"),
            parse_gid("::ffff:10.0.0.5")
        );
        assert_eq!(parse_gid("not a gid"), None);
        assert_eq!(parse_gid(""), None);
        assert_eq!(GidType::parse("RoCE v2\n"), GidType::RoceV2);
        assert_eq!(GidType::parse("IB/RoCE v1"), GidType::IbRoceV1);
        assert_eq!(GidType::parse(""), GidType::Unknown);
    }

    #[test]
    fn display_names_the_address_and_netdev() {
        let t = mlx5_table();
        assert_eq!(t[3].to_string(), "gid 3 (RoCEv2 ::ffff:10.0.0.5 on eth0)");
    }
}
