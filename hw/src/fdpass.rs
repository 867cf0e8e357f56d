//! Passing file descriptors over Unix stream sockets (`SCM_RIGHTS`).

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// Control-message buffer, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct CmsgBuf([u8; 256]);

/// Most fds one `recvmsg` will accept (the rest are discarded by the kernel).
const MAX_RECV_FDS: usize = 16;

/// Sends all of `data` on a connected Unix stream socket, attaching `fd`
/// (`SCM_RIGHTS`) to the first `sendmsg`. Retries `EINTR` and short writes.
///
/// Invariants: the fd travels with the first byte(s) of `data`, exactly
/// once; `data` must be non-empty when an fd is attached (`InvalidInput`
/// otherwise) since a stream socket cannot carry an fd without payload; no
/// `SIGPIPE` is raised (`MSG_NOSIGNAL`). The socket should be blocking: on a
/// non-blocking socket a `WouldBlock` error may leave `data` partly sent.
pub fn send_with_fd(
    sock: BorrowedFd<'_>,
    data: &[u8],
    fd: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    match fd {
        Some(fd) => send_with_fds(sock, data, &[fd.as_raw_fd()]),
        None => send_with_fds(sock, data, &[]),
    }
}

/// [`send_with_fd`] for any number of fds (at most [`MAX_RECV_FDS`] make
/// sense); the caller keeps the fds open during the call.
pub(crate) fn send_with_fds(sock: BorrowedFd<'_>, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    if data.is_empty() {
        return if fds.is_empty() {
            Ok(())
        } else {
            Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "cannot pass an fd without at least one byte of data",
            ))
        };
    }
    let fd_bytes = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE is pure arithmetic.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as libc::c_uint) } as usize;
    if space > size_of::<CmsgBuf>() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "too many fds"));
    }
    let mut cbuf = CmsgBuf([0; 256]);
    let mut sent = 0usize;
    let mut attach = !fds.is_empty();
    while sent < data.len() {
        let rest = &data[sent..];
        let mut iov = libc::iovec {
            iov_base: rest.as_ptr() as *mut libc::c_void,
            iov_len: rest.len(),
        };
        // SAFETY: msghdr is plain old data; all-zero is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if attach {
            msg.msg_control = cbuf.0.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            // SAFETY: msg_control points at `space` bytes of our aligned
            // buffer, enough for one cmsghdr plus `fds.len()` ints, so
            // CMSG_FIRSTHDR is non-null and CMSG_DATA has room for them.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(fd_bytes as libc::c_uint) as _;
                let data_ptr = libc::CMSG_DATA(c).cast::<libc::c_int>();
                for (i, fd) in fds.iter().enumerate() {
                    data_ptr.add(i).write_unaligned(*fd);
                }
            }
        }
        // SAFETY: msg references iov (valid for rest.len() readable bytes)
        // and, when attaching, our control buffer; both outlive the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue; // nothing was sent, fds not yet attached
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "sendmsg sent 0 bytes",
            ));
        }
        attach = false;
        sent += n as usize;
    }
    Ok(())
}

/// One `recvmsg` into `buf`; returns the bytes read (0 = EOF) and a received
/// fd if an `SCM_RIGHTS` control message arrived. Retries `EINTR`.
///
/// Invariants: received fds are close-on-exec (`MSG_CMSG_CLOEXEC`); at most
/// one fd is returned, any extra ones are closed, so no descriptor leaks;
/// `buf` must be non-empty (`InvalidInput`), so that 0 always means EOF.
pub fn recv_with_fd(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    if buf.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "recv_with_fd needs a non-empty buffer",
        ));
    }
    let mut cbuf = CmsgBuf([0; 256]);
    // SAFETY: CMSG_SPACE is pure arithmetic.
    let space =
        unsafe { libc::CMSG_SPACE((MAX_RECV_FDS * size_of::<libc::c_int>()) as libc::c_uint) };
    let space = (space as usize).min(size_of::<CmsgBuf>());
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain old data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    let n = loop {
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.0.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        msg.msg_flags = 0;
        // SAFETY: msg references iov (buf: buf.len() writable bytes) and our
        // aligned control buffer of `space` bytes; both outlive the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut first: Option<OwnedFd> = None;
    let mut extra = 0usize;
    // SAFETY: the kernel filled msg_control/msg_controllen with well-formed
    // control messages; CMSG_FIRSTHDR/CMSG_NXTHDR stay within that buffer,
    // and each SCM_RIGHTS payload holds (cmsg_len - CMSG_LEN(0)) / 4 fds that
    // were installed in our fd table and are owned by nobody else yet.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let payload = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data_ptr = libc::CMSG_DATA(c).cast::<libc::c_int>();
                for i in 0..payload / size_of::<libc::c_int>() {
                    let owned = OwnedFd::from_raw_fd(data_ptr.add(i).read_unaligned());
                    if first.is_none() {
                        first = Some(owned);
                    } else {
                        extra += 1;
                        drop(owned); // closes it
                    }
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if extra > 0 {
        tracing::warn!(extra, "recv_with_fd: closed extra received fds");
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        tracing::warn!("recv_with_fd: control data truncated; some fds were discarded");
    }
    Ok((n, first))
}

#[cfg(test)]
#[path = "fdpass_tests.rs"]
mod tests;
