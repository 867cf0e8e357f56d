//! libzmq socket options the `zmq` crate has no setter for: ROUTER connect/disconnect
//! notifications (`ZMQ_ROUTER_NOTIFY`, a DRAFT option in libzmq 4.3, which the workspace's
//! patched zmq-sys builds with its DRAFT API).
//!
//! With the option set, a ROUTER delivers a message `[routing id, empty frame]` when a peer's
//! connection completes its handshake (`ZMQ_NOTIFY_CONNECT`) and when it ends
//! (`ZMQ_NOTIFY_DISCONNECT`). Both travel through the connection's own pipe, so the
//! disconnect notification arrives after every message the connection delivered. libzmq
//! attaches no connection properties to them (a peer's own frames carry its `__fd`
//! property): that is how they are told apart from an empty frame a peer sends.

use std::os::raw::{c_int, c_void};

/// `ZMQ_ROUTER_NOTIFY` (zmq.h, DRAFT in libzmq 4.3).
pub const ZMQ_ROUTER_NOTIFY: c_int = 97;
/// Notify when a peer connects.
pub const ZMQ_NOTIFY_CONNECT: c_int = 1;
/// Notify when a peer's connection ends.
pub const ZMQ_NOTIFY_DISCONNECT: c_int = 2;

/// Sets `ZMQ_ROUTER_NOTIFY` to `flags` (a combination of [`ZMQ_NOTIFY_CONNECT`] and
/// [`ZMQ_NOTIFY_DISCONNECT`]) on `socket`. Fails (`EINVAL`) when `socket` is no ROUTER, when
/// `flags` is out of range, or when the linked libzmq was built without its DRAFT API; the
/// socket is unchanged then.
pub fn set_router_notify(socket: &mut zmq::Socket, flags: i32) -> Result<(), zmq::Error> {
    let value: c_int = flags;
    // SAFETY: `socket.as_mut_ptr()` is the live libzmq socket `socket` owns (valid for the
    // duration of the borrow, which is exclusive, so no other thread uses it meanwhile);
    // `optval` points to a `c_int` that outlives the call and `optvallen` is its size, which is
    // what libzmq reads for an integer option. libzmq copies the value before returning.
    let rc = unsafe {
        zmq_sys::zmq_setsockopt(
            socket.as_mut_ptr(),
            ZMQ_ROUTER_NOTIFY,
            (&value as *const c_int).cast::<c_void>(),
            std::mem::size_of::<c_int>(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        // SAFETY: `zmq_errno` only reads the calling thread's errno.
        Err(zmq::Error::from_raw(unsafe { zmq_sys::zmq_errno() }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Receives one multipart message (waiting up to 5 s), with whether any frame carried the
    /// peer's connection properties.
    fn recv(router: &zmq::Socket) -> (Vec<Vec<u8>>, bool) {
        assert!(
            router.poll(zmq::POLLIN, 5_000).unwrap() > 0,
            "nothing arrived"
        );
        let mut frames = Vec::new();
        let mut tagged = false;
        loop {
            let mut m = router.recv_msg(0).unwrap();
            tagged |= m.gets("__fd").is_some();
            let more = m.get_more();
            frames.push(m.to_vec());
            if !more {
                return (frames, tagged);
            }
        }
    }

    #[test]
    fn a_router_reports_connects_and_disconnects_after_the_peers_messages() {
        let ctx = zmq::Context::new();
        let mut router = ctx.socket(zmq::ROUTER).unwrap();
        set_router_notify(&mut router, ZMQ_NOTIFY_CONNECT | ZMQ_NOTIFY_DISCONNECT)
            .expect("libzmq built with its DRAFT API");
        router.bind("tcp://127.0.0.1:*").unwrap();
        let ep = router.get_last_endpoint().unwrap().unwrap();
        let dealer = ctx.socket(zmq::DEALER).unwrap();
        dealer.set_linger(1_000).unwrap();
        dealer.connect(&ep).unwrap();
        dealer
            .send_multipart([b"a".to_vec(), b"b".to_vec()], 0)
            .unwrap();
        dealer.send(Vec::<u8>::new(), 0).unwrap();
        let (connect, tagged) = recv(&router);
        assert_eq!(connect.len(), 2);
        assert!(connect[1].is_empty() && !tagged, "{connect:?}");
        let id = connect[0].clone();
        let (req, tagged) = recv(&router);
        assert_eq!(req, vec![id.clone(), b"a".to_vec(), b"b".to_vec()]);
        assert!(tagged);
        let (forged, tagged) = recv(&router);
        assert_eq!(forged, vec![id.clone(), Vec::new()]);
        assert!(
            tagged,
            "an empty frame the peer sent carries its properties"
        );
        drop(dealer);
        let (disconnect, tagged) = recv(&router);
        assert_eq!(disconnect, vec![id, Vec::new()]);
        assert!(!tagged);
    }

    #[test]
    fn other_sockets_refuse_the_option() {
        let ctx = zmq::Context::new();
        let mut dealer = ctx.socket(zmq::DEALER).unwrap();
        assert_eq!(
            set_router_notify(&mut dealer, ZMQ_NOTIFY_DISCONNECT),
            Err(zmq::Error::EINVAL)
        );
        let mut router = ctx.socket(zmq::ROUTER).unwrap();
        assert_eq!(set_router_notify(&mut router, 4), Err(zmq::Error::EINVAL));
    }
}
