use super::*;
use crate::{PagePreference, PoolMapping, PoolOptions, SharedPool};
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;

fn small_pool() -> SharedPool {
    SharedPool::create(&PoolOptions {
        bytes: 4 << 20,
        prefer: PagePreference::Pages4K,
        prefault: false,
        name: "kvnode-hw-fdpass-test".into(),
        posix_shm_name: None,
        segment_bind_mount: false,
        cancel: None,
    })
    .unwrap()
}

fn ino(fd: BorrowedFd<'_>) -> (u64, u64) {
    let md = std::fs::File::from(fd.try_clone_to_owned().unwrap())
        .metadata()
        .unwrap();
    (md.dev(), md.ino())
}

#[test]
fn pool_fd_over_scm_rights_is_shared() {
    let pool = small_pool();
    pool.region().write_at(100, b"node wrote this").unwrap();
    let len = pool.len();
    let (mut node, client) = UnixStream::pair().unwrap();
    let t = std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        let (n, fd) = recv_with_fd(client.as_fd(), &mut buf).unwrap();
        assert_eq!(&buf[..n], b"POOL");
        let fd = fd.expect("fd attached");
        // MSG_CMSG_CLOEXEC took effect.
        // SAFETY: fcntl(F_GETFD) on a descriptor we own.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
        assert!(flags & libc::FD_CLOEXEC != 0);
        let m = PoolMapping::from_fd(fd, len).unwrap();
        let mut got = [0u8; 15];
        m.region().read_at(100, &mut got).unwrap();
        assert_eq!(&got, b"node wrote this");
        m.region().write_at(len - 6, b"client").unwrap();
        (&client).write_all(b"k").unwrap();
    });
    send_with_fd(node.as_fd(), b"POOL", Some(pool.fd())).unwrap();
    let mut ack = [0u8; 1];
    node.read_exact(&mut ack).unwrap();
    t.join().unwrap();
    let mut got = [0u8; 6];
    pool.region().read_at(len - 6, &mut got).unwrap();
    assert_eq!(&got, b"client");
}

#[test]
fn no_fd_and_eof() {
    let (a, b) = UnixStream::pair().unwrap();
    send_with_fd(a.as_fd(), b"hello", None).unwrap();
    let mut buf = [0u8; 16];
    let (n, fd) = recv_with_fd(b.as_fd(), &mut buf).unwrap();
    assert_eq!(&buf[..n], b"hello");
    assert!(fd.is_none());
    send_with_fd(a.as_fd(), b"", None).unwrap(); // no-op
    drop(a);
    let (n, fd) = recv_with_fd(b.as_fd(), &mut buf).unwrap();
    assert_eq!(n, 0);
    assert!(fd.is_none());
}

#[test]
fn argument_errors() {
    let (a, b) = UnixStream::pair().unwrap();
    let pool = small_pool();
    let e = send_with_fd(a.as_fd(), b"", Some(pool.fd())).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    let e = recv_with_fd(b.as_fd(), &mut []).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    drop(b);
    // Peer gone: EPIPE as an error, no SIGPIPE killing the test process.
    let e = send_with_fd(a.as_fd(), b"x", Some(pool.fd())).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPIPE));
}

#[test]
fn large_message_fd_only_once() {
    let pool = small_pool();
    let want = ino(pool.fd());
    let (a, b) = UnixStream::pair().unwrap();
    let data: Vec<u8> = (0..(3usize << 20)).map(|i| (i % 251) as u8).collect();
    let expect = data.clone();
    let t = std::thread::spawn(move || {
        let mut got = Vec::new();
        let mut fds = Vec::new();
        let mut buf = vec![0u8; 100_000];
        while got.len() < expect.len() {
            let (n, fd) = recv_with_fd(b.as_fd(), &mut buf).unwrap();
            assert!(n > 0);
            if let Some(fd) = fd {
                fds.push((got.len(), fd));
            }
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got, expect);
        assert_eq!(fds.len(), 1, "fd arrives exactly once");
        assert_eq!(fds[0].0, 0, "with the first bytes");
        ino(fds[0].1.as_fd())
    });
    send_with_fd(a.as_fd(), &data, Some(pool.fd())).unwrap();
    assert_eq!(t.join().unwrap(), want);
}

#[test]
fn extra_fds_are_closed_first_is_returned() {
    let p1 = small_pool();
    let p2 = small_pool();
    let p3 = small_pool();
    let (a, b) = UnixStream::pair().unwrap();
    let raw = [
        p1.fd().as_raw_fd(),
        p2.fd().as_raw_fd(),
        p3.fd().as_raw_fd(),
    ];
    send_with_fds(a.as_fd(), b"three", &raw).unwrap();
    let mut buf = [0u8; 8];
    let (n, fd) = recv_with_fd(b.as_fd(), &mut buf).unwrap();
    assert_eq!(&buf[..n], b"three");
    assert_eq!(ino(fd.unwrap().as_fd()), ino(p1.fd()));
}
