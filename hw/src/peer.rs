//! Who is on the other end of a local connection: `SO_PEERCRED` for Unix sockets, the kernel's
//! socket table (`/proc/net/tcp`, `/proc/net/tcp6`) for loopback TCP, and a user's groups.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, BorrowedFd};

use crate::error::{HwError, HwResult};

/// Credentials of a connected peer. Invariant: `uid`/`gid` are the peer's effective ids when it
/// connected (the kernel's record, not something the peer claimed); `pid` is `None` when the
/// transport cannot tell (TCP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerCred {
    /// Process id of the peer at connect time, if known.
    pub pid: Option<i32>,
    /// Effective user id.
    pub uid: u32,
    /// Effective primary group id.
    pub gid: u32,
}

/// The credentials the kernel recorded for the peer of the connected Unix socket `fd`.
pub fn unix_peer_credentials(fd: BorrowedFd<'_>) -> HwResult<PeerCred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a writable ucred and `len` its size; the kernel writes at most `len`
    // bytes and updates `len`. `fd` is a live descriptor borrowed for the call.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(HwError::last_os("getsockopt(SO_PEERCRED)"));
    }
    Ok(PeerCred {
        pid: (cred.pid > 0).then_some(cred.pid),
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// This process's effective user id.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// This process's effective group id.
pub fn effective_gid() -> u32 {
    // SAFETY: getegid has no preconditions and cannot fail.
    unsafe { libc::getegid() }
}

/// Most groups of one user considered (a bound on the lookup's buffer).
pub const MAX_USER_GROUPS: usize = 1024;

/// Every group `uid` belongs to (its primary group from the user database, then its
/// supplementary groups), at most [`MAX_USER_GROUPS`]. Empty when the user database does not know
/// `uid` (a bare uid in a container): callers then match its primary gid only.
pub fn user_groups(uid: u32) -> Vec<u32> {
    let mut pwd: libc::passwd = unsafe_zeroed_passwd();
    let mut buf = vec![0u8; 16 * 1024];
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is to a live, writable buffer of the stated size; on success
    // `result` points at `pwd`, whose strings live in `buf` (kept until the end of this fn).
    let rc = unsafe {
        libc::getpwuid_r(
            uid,
            &mut pwd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 || result.is_null() {
        return Vec::new();
    }
    let primary = pwd.pw_gid;
    let mut groups = vec![0 as libc::gid_t; MAX_USER_GROUPS];
    let mut n = MAX_USER_GROUPS as libc::c_int;
    // SAFETY: `pw_name` is a NUL-terminated string in `buf`; `groups` holds `n` gids and
    // getgrouplist writes at most `n` of them (it returns -1 and the needed count otherwise).
    let rc = unsafe { libc::getgrouplist(pwd.pw_name, primary, groups.as_mut_ptr(), &mut n) };
    if rc < 0 {
        // More than MAX_USER_GROUPS: keep the ones that fit.
        n = MAX_USER_GROUPS as libc::c_int;
    }
    groups.truncate(n.max(0) as usize);
    if !groups.contains(&primary) {
        groups.insert(0, primary);
    }
    groups
}

fn unsafe_zeroed_passwd() -> libc::passwd {
    // SAFETY: passwd is a plain C struct of pointers and integers; all-zero is a valid value
    // (null pointers), and getpwuid_r overwrites it before anything reads it.
    unsafe { std::mem::zeroed() }
}

/// The owner (uid) of the local TCP socket whose address is `peer` and which is connected to
/// `local`: for a connection accepted on `local` from a process of this machine, the uid of the
/// process that connected. Read from the kernel's socket tables; `Ok(None)` when no such socket is
/// listed (the peer is on another machine, or it closed meanwhile).
pub fn tcp_peer_uid(local: SocketAddr, peer: SocketAddr) -> std::io::Result<Option<u32>> {
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = match std::fs::read_to_string(table) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        if let Some(uid) = find_socket_owner(&text, peer, local) {
            return Ok(Some(uid));
        }
    }
    Ok(None)
}

/// In a `/proc/net/tcp{,6}` listing, the uid of the socket with local address `local` and
/// remote address `remote` (IPv4 addresses also match their IPv4-mapped IPv6 form).
pub fn find_socket_owner(table: &str, local: SocketAddr, remote: SocketAddr) -> Option<u32> {
    for line in table.lines().skip(1) {
        let mut f = line.split_whitespace();
        let (Some(_slot), Some(l), Some(r)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        // st, tx:rx, tr:when, retrnsmt, then uid. A TIME_WAIT socket (st 06) is a kernel
        // leftover listed with uid 0: it has no owner and must never pass for root.
        let Some(state) = f.next() else { continue };
        if state == "06" {
            continue;
        }
        let Some(uid) = f.nth(3).and_then(|u| u.parse::<u32>().ok()) else {
            continue;
        };
        let (Some(l), Some(r)) = (parse_proc_addr(l), parse_proc_addr(r)) else {
            continue;
        };
        if same_endpoint(l, local) && same_endpoint(r, remote) {
            return Some(uid);
        }
    }
    None
}

fn same_endpoint(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port() && canonical(a.ip()) == canonical(b.ip())
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    }
}

/// Parses `0100007F:1F90` (IPv4) or a 32-hex-digit IPv6 address with its port. The kernel prints
/// each 32-bit word of the address in host byte order (little-endian here).
fn parse_proc_addr(s: &str) -> Option<SocketAddr> {
    let (addr, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let ip = match addr.len() {
        8 => IpAddr::V4(Ipv4Addr::from(
            u32::from_str_radix(addr, 16).ok()?.swap_bytes(),
        )),
        32 => {
            let mut bytes = [0u8; 16];
            for w in 0..4 {
                let word = u32::from_str_radix(&addr[w * 8..w * 8 + 8], 16).ok()?;
                bytes[w * 4..w * 4 + 4].copy_from_slice(&word.to_le_bytes());
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_unix_socket_pair_reports_this_process() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let c = unix_peer_credentials(a.as_fd()).unwrap();
        assert_eq!(c.uid, effective_uid());
        assert_eq!(c.gid, effective_gid());
        assert_eq!(c.pid, Some(std::process::id() as i32));
    }

    #[test]
    fn proc_addresses_parse_in_host_order() {
        let a = parse_proc_addr("0100007F:1F90").unwrap();
        assert_eq!(a, "127.0.0.1:8080".parse().unwrap());
        let six = parse_proc_addr("00000000000000000000000001000000:0050").unwrap();
        assert_eq!(six, "[::1]:80".parse().unwrap());
        let mapped = parse_proc_addr("0000000000000000FFFF00000100007F:0050").unwrap();
        assert!(same_endpoint(mapped, "127.0.0.1:80".parse().unwrap()));
        assert!(parse_proc_addr("zz:1").is_none());
    }

    #[test]
    fn a_loopback_connection_is_found_in_the_socket_table_with_our_uid() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server_side, peer) = listener.accept().unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
        let uid = tcp_peer_uid(server_side.local_addr().unwrap(), peer).unwrap();
        assert_eq!(uid, Some(effective_uid()));
        // A port nobody connected from is not found.
        let absent: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(
            tcp_peer_uid(server_side.local_addr().unwrap(), absent).unwrap(),
            None
        );
    }

    #[test]
    fn the_table_lookup_picks_the_line_with_both_endpoints() {
        let t = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
                 0: 0100007F:15B3 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1\n\
                 1: 0100007F:D431 0100007F:15B3 01 00000000:00000000 00:00000000 00000000  1000        0 2 1\n\
                 2: 0100007F:15B3 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 3 1\n";
        let node: SocketAddr = "127.0.0.1:5555".parse().unwrap();
        let peer: SocketAddr = "127.0.0.1:54321".parse().unwrap();
        assert_eq!(find_socket_owner(t, peer, node), Some(1000));
        assert_eq!(find_socket_owner(t, node, peer), Some(0));
        let time_wait = t.replace(
            " 01 00000000:00000000 00:00000000 00000000  1000",
            " 06 00000000:00000000 00:00000000 00000000     0",
        );
        assert_eq!(
            find_socket_owner(&time_wait, peer, node),
            None,
            "no owner, never root"
        );
    }

    #[test]
    fn root_belongs_to_its_primary_group() {
        let g = user_groups(0);
        assert!(g.contains(&0), "{g:?}");
        assert!(user_groups(u32::MAX - 7).is_empty());
    }
}
