//! The owner of one TCP socket, asked of the kernel by the socket's addresses (netlink
//! `sock_diag`). The kernel looks the socket up directly, where reading `/proc/net/tcp` walks its
//! whole connection hash table: milliseconds per read on a machine with much memory (a large
//! table), however few connections there are.

use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// `SOCK_DIAG_BY_FAMILY` (linux/sock_diag.h).
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `NLMSG_ERROR` and `NLMSG_DONE` (linux/netlink.h).
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
/// `NLM_F_REQUEST`.
const NLM_F_REQUEST: u16 = 1;
/// `INET_DIAG_NOCOOKIE`: match the socket by its addresses only.
const INET_DIAG_NOCOOKIE: u32 = !0;
/// How long the kernel's answer is waited for (it answers synchronously; this only bounds a
/// kernel that does not).
const DIAG_TIMEOUT: Duration = Duration::from_secs(1);
/// Bytes of `struct nlmsghdr`.
const NLMSG_HDR: usize = 16;
/// Bytes of `struct inet_diag_sockid`.
const SOCKID: usize = 48;
/// Offset of `idiag_uid` in `struct inet_diag_msg` (family, state, timer, retrans, id,
/// expires, rqueue, wqueue, then uid).
const MSG_UID: usize = 4 + SOCKID + 12;

/// The uid owning the TCP socket of this network namespace whose own address is `local` and
/// whose peer is `remote`; `Ok(None)` when there is no such socket (it closed, or it lives on
/// another machine or in another network namespace). An IPv4-mapped IPv6 pair is also looked up
/// as the IPv4 pair (an IPv4 client of a dual-stack listener). Errors only when the kernel
/// cannot be asked (no `sock_diag`).
pub fn tcp_socket_owner(local: SocketAddr, remote: SocketAddr) -> std::io::Result<Option<u32>> {
    let mut pairs = Vec::with_capacity(2);
    if local.is_ipv6() || remote.is_ipv6() {
        if let (Some(l), Some(r)) = (mapped_v4(local), mapped_v4(remote)) {
            pairs.push((l, r));
        }
    }
    pairs.push((local, remote));
    let sock = open_diag_socket()?;
    for (l, r) in pairs {
        if l.is_ipv4() != r.is_ipv4() {
            continue;
        }
        if let Some((uid, _inode)) = query(&sock, l, r)? {
            return Ok(Some(uid));
        }
    }
    Ok(None)
}

fn mapped_v4(a: SocketAddr) -> Option<SocketAddr> {
    match a.ip() {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(|v4| SocketAddr::new(IpAddr::V4(v4), a.port())),
        IpAddr::V4(_) => Some(a),
    }
}

fn open_diag_socket() -> std::io::Result<OwnedFd> {
    // SAFETY: socket() takes no pointers; a non-negative result is a new descriptor we own.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nothing else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let tv = libc::timeval {
        tv_sec: DIAG_TIMEOUT.as_secs() as libc::time_t,
        tv_usec: 0,
    };
    // SAFETY: `tv` is a timeval of the stated size, read by the kernel during the call.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(sock)
}

/// `struct inet_diag_sockid` for the socket with own address `l` and peer `r`.
fn sockid(l: SocketAddr, r: SocketAddr) -> [u8; SOCKID] {
    let mut id = [0u8; SOCKID];
    id[0..2].copy_from_slice(&l.port().to_be_bytes());
    id[2..4].copy_from_slice(&r.port().to_be_bytes());
    let octets = |a: SocketAddr| match a.ip() {
        IpAddr::V4(v4) => {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&v4.octets());
            b
        }
        IpAddr::V6(v6) => v6.octets(),
    };
    id[4..20].copy_from_slice(&octets(l));
    id[20..36].copy_from_slice(&octets(r));
    // idiag_if = 0 (any interface), then the cookie.
    id[40..44].copy_from_slice(&INET_DIAG_NOCOOKIE.to_ne_bytes());
    id[44..48].copy_from_slice(&INET_DIAG_NOCOOKIE.to_ne_bytes());
    id
}

/// The owner's uid and the socket's inode.
fn query(sock: &OwnedFd, l: SocketAddr, r: SocketAddr) -> std::io::Result<Option<(u32, u32)>> {
    // nlmsghdr + inet_diag_req_v2 (family, protocol, ext, pad, states, id).
    let len = NLMSG_HDR + 8 + SOCKID;
    let mut req = Vec::with_capacity(len);
    req.extend_from_slice(&(len as u32).to_ne_bytes());
    req.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes()); // seq
    req.extend_from_slice(&0u32.to_ne_bytes()); // pid: the kernel fills it
    let family = if l.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    req.push(family as u8);
    req.push(libc::IPPROTO_TCP as u8);
    req.push(0); // no extensions
    req.push(0);
    req.extend_from_slice(&u32::MAX.to_ne_bytes()); // every state
    req.extend_from_slice(&sockid(l, r));
    debug_assert_eq!(req.len(), len);
    // SAFETY: an all-zero sockaddr_nl is valid; nl_pid 0 addresses the kernel.
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: `req` holds `req.len()` initialised bytes and `kernel` is a sockaddr_nl of the
    // stated size; both are only read during the call.
    let sent = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            req.as_ptr().cast(),
            req.len(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut buf = vec![0u8; 8192];
    // SAFETY: `buf` is writable for `buf.len()` bytes; the kernel writes at most that many.
    let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    parse_reply(&buf[..n as usize], l, r)
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

/// The uid and inode in the kernel's answer, `None` for "no such socket".
fn parse_reply(mut b: &[u8], l: SocketAddr, r: SocketAddr) -> std::io::Result<Option<(u32, u32)>> {
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed sock_diag reply");
    while b.len() >= NLMSG_HDR {
        let len = u32_at(b, 0).ok_or_else(bad)? as usize;
        let typ = u16_at(b, 4).ok_or_else(bad)?;
        if len < NLMSG_HDR || len > b.len() {
            return Err(bad());
        }
        let body = &b[NLMSG_HDR..len];
        match typ {
            NLMSG_ERROR => {
                let code = u32_at(body, 0).ok_or_else(bad)? as i32;
                return match -code {
                    0 | libc::ENOENT => Ok(None),
                    e => Err(std::io::Error::from_raw_os_error(e)),
                };
            }
            NLMSG_DONE => return Ok(None),
            SOCK_DIAG_BY_FAMILY => {
                // The answer must be the socket asked about.
                let id = body.get(4..4 + SOCKID).ok_or_else(bad)?;
                let want = sockid(l, r);
                if id[..36] != want[..36] {
                    return Err(bad());
                }
                // A TIME_WAIT socket is a kernel leftover listed with uid 0: it has no owner,
                // and must never pass for root.
                if body.get(1) == Some(&TCP_TIME_WAIT) {
                    return Ok(None);
                }
                let uid = u32_at(body, MSG_UID).ok_or_else(bad)?;
                let inode = u32_at(body, MSG_UID + 4).ok_or_else(bad)?;
                return Ok(Some((uid, inode)));
            }
            _ => {}
        }
        // Messages are 4-byte aligned.
        let next = (len + 3) & !3;
        b = b.get(next..).unwrap_or(&[]);
    }
    Ok(None)
}

/// `idiag_state` of a socket in TIME_WAIT (`TCP_TIME_WAIT` in the kernel's `tcp_states.h`).
const TCP_TIME_WAIT: u8 = 6;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_connection_is_owned_by_us_and_closed_ones_by_nobody() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server_side, peer) = listener.accept().unwrap();
        let me = crate::effective_uid();
        // The client's socket: own address `peer`, peer the listener's address.
        let ours = server_side.local_addr().unwrap();
        assert_eq!(tcp_socket_owner(peer, ours).unwrap(), Some(me));
        // The accepted socket too.
        assert_eq!(tcp_socket_owner(ours, peer).unwrap(), Some(me));
        // Its IPv4-mapped form is found as well.
        let mapped = |a: SocketAddr| match a.ip() {
            IpAddr::V4(v4) => SocketAddr::new(IpAddr::V6(v4.to_ipv6_mapped()), a.port()),
            _ => a,
        };
        assert_eq!(
            tcp_socket_owner(mapped(peer), mapped(ours)).unwrap(),
            Some(me)
        );
        // The answer is about the socket asked for: its inode.
        let sock = open_diag_socket().unwrap();
        let (_, inode) = query(&sock, peer, ours).unwrap().unwrap();
        use std::os::fd::AsRawFd as _;
        let want = crate::socket_inode(client.as_raw_fd()).unwrap().unwrap();
        assert_eq!(u64::from(inode), want);
        let absent: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(tcp_socket_owner(absent, ours).unwrap(), None);
        let v6: SocketAddr = "[::]:1".parse().unwrap();
        assert_eq!(tcp_socket_owner(v6, v6).unwrap(), None);
        drop(client);
    }

    #[test]
    fn it_agrees_with_the_socket_table() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server_side, peer) = listener.accept().unwrap();
        let ours = server_side.local_addr().unwrap();
        assert_eq!(
            tcp_socket_owner(peer, ours).unwrap(),
            crate::tcp_peer_uid(ours, peer).unwrap()
        );
    }

    #[test]
    fn replies_are_parsed_defensively() {
        let l: SocketAddr = "127.0.0.1:5".parse().unwrap();
        assert!(
            parse_reply(&[0u8; 8], l, l).unwrap().is_none(),
            "short: nothing"
        );
        let mut err = vec![0u8; 20];
        err[0..4].copy_from_slice(&20u32.to_ne_bytes());
        err[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        err[16..20].copy_from_slice(&(-libc::ENOENT).to_ne_bytes());
        assert_eq!(parse_reply(&err, l, l).unwrap(), None);
        err[16..20].copy_from_slice(&(-libc::EPERM).to_ne_bytes());
        assert!(parse_reply(&err, l, l).is_err());
        let mut lying = vec![0u8; 16];
        lying[0..4].copy_from_slice(&4000u32.to_ne_bytes());
        assert!(parse_reply(&lying, l, l).is_err(), "a length past the end");
    }
}
