//! What is open at a descriptor number that another library owns (libzmq's connections): the
//! socket's inode and, for TCP, its two addresses. Only the number is known, not its lifetime:
//! the owner may close it at any moment and the kernel may reuse the number for something else,
//! so every answer describes whatever is open at that number *now*; callers pin an answer to one
//! socket by its inode (unique among open sockets) and compare it before and after.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::RawFd;

/// The inode of the socket open at descriptor number `fd`, `Ok(None)` when something other than
/// a socket is open there; an error (EBADF) when nothing is.
pub fn socket_inode(fd: RawFd) -> std::io::Result<Option<u64>> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct; fstat overwrites it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a writable stat buffer. The descriptor is only a number here: the kernel
    // checks it, and a closed or reused number is answered for what it is now (no memory is
    // touched but `st`).
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((st.st_mode & libc::S_IFMT == libc::S_IFSOCK).then_some(st.st_ino))
}

/// The local and peer addresses of the TCP (IPv4 or IPv6) socket open at descriptor number
/// `fd`; `Ok(None)` for a socket of another family (Unix) and for one that is not connected.
pub fn tcp_socket_addresses(fd: RawFd) -> std::io::Result<Option<(SocketAddr, SocketAddr)>> {
    let Some(local) = socket_address(fd, false)? else {
        return Ok(None);
    };
    match socket_address(fd, true) {
        Ok(Some(peer)) => Ok(Some((local, peer))),
        Ok(None) => Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => Ok(None),
        Err(e) => Err(e),
    }
}

fn socket_address(fd: RawFd, peer: bool) -> std::io::Result<Option<SocketAddr>> {
    // SAFETY: an all-zero sockaddr_storage is a valid value; the kernel overwrites it.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let p = (&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr>();
    // SAFETY: `p` points to a writable sockaddr_storage of `len` bytes, the largest address
    // any family has; the kernel writes at most `len` bytes and updates `len`. The descriptor is
    // only a number (see `socket_inode`).
    let rc = unsafe {
        if peer {
            libc::getpeername(fd, p, &mut len)
        } else {
            libc::getsockname(fd, p, &mut len)
        }
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(match i32::from(ss.ss_family) {
        libc::AF_INET if len as usize >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: the kernel wrote an AF_INET address, a sockaddr_in, of at least its size.
            let sin = unsafe { &*(p as *const libc::sockaddr_in) };
            Some(SocketAddr::new(
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))),
                u16::from_be(sin.sin_port),
            ))
        }
        libc::AF_INET6 if len as usize >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: the kernel wrote an AF_INET6 address, a sockaddr_in6, of at least its size.
            let sin6 = unsafe { &*(p as *const libc::sockaddr_in6) };
            Some(SocketAddr::new(
                IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)),
                u16::from_be(sin6.sin6_port),
            ))
        }
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_tcp_connection_reports_its_addresses_and_a_stable_inode() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server_side, peer) = listener.accept().unwrap();
        let fd = server_side.as_raw_fd();
        let (local, remote) = tcp_socket_addresses(fd).unwrap().unwrap();
        assert_eq!(local, listener.local_addr().unwrap());
        assert_eq!(remote, peer);
        assert_eq!(remote, client.local_addr().unwrap());
        let ino = socket_inode(fd).unwrap().unwrap();
        assert_eq!(socket_inode(fd).unwrap(), Some(ino));
        let other = socket_inode(client.as_raw_fd()).unwrap().unwrap();
        assert_ne!(ino, other, "each socket has its own inode");
    }

    #[test]
    fn files_unix_sockets_and_closed_numbers_are_told_apart() {
        let f = std::fs::File::open("/proc/self/status").unwrap();
        assert_eq!(socket_inode(f.as_raw_fd()).unwrap(), None);
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(socket_inode(a.as_raw_fd()).unwrap().is_some());
        assert_eq!(tcp_socket_addresses(a.as_raw_fd()).unwrap(), None);
        let unconnected = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        assert_eq!(tcp_socket_addresses(unconnected.as_raw_fd()).unwrap(), None);
        let n = f.as_raw_fd();
        drop(f);
        // The number may be reused by another test thread; when it is free, it is an error.
        if let Err(e) = socket_inode(n) {
            assert_eq!(e.raw_os_error(), Some(libc::EBADF));
        }
    }
}
