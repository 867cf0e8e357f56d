//! A tiny, bounded HTTP/1.x responder for `GET /metrics` (and `HEAD`): anything else gets a
//! plain 404, 405 or 400, and every connection is closed after one answer.
//!
//! Bounds, so the metrics port cannot be used to exhaust the node or to starve scrapes: one
//! thread accepts and collects request heads for up to [`HTTP_PENDING`] connections at once,
//! with non-blocking reads under `poll` (an idle connection costs a slot, never a thread); a
//! head must arrive within [`HTTP_HEAD_DEADLINE`] of the accept and within [`HTTP_HEAD_BYTES`]
//! (else 431); when every slot is taken, the oldest connection still sending its head is
//! closed for the new one, so a scraper, whose head arrives at once, gets through even while
//! someone holds idle connections open. Complete heads go to [`HTTP_WORKERS`] threads (at most
//! [`HTTP_WAITING`] wait for them; beyond, the connection is closed unanswered), which write the
//! answer within [`HTTP_DEADLINE`] of the accept. A request body is never read. Memory: at most
//! `HTTP_PENDING` heads of `HTTP_HEAD_BYTES`, and `HTTP_WORKERS` answers at once.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Threads answering metrics requests (connections served at once).
pub const HTTP_WORKERS: usize = 2;
/// Accepted connections waiting for a worker; beyond, new ones are closed at once.
pub const HTTP_WAITING: usize = 16;
/// Most bytes of a request's head (request line and headers).
pub const HTTP_HEAD_BYTES: usize = 8 << 10;
/// Connections whose head is still arriving, at most (the oldest is closed for a new one).
pub const HTTP_PENDING: usize = 128;
/// Longest a request's head may take to arrive, from the accept.
pub const HTTP_HEAD_DEADLINE: Duration = Duration::from_secs(2);
/// Longest one connection may take, from accept to the last byte of its answer.
pub const HTTP_DEADLINE: Duration = Duration::from_secs(5);
/// How often idle threads look at the stop flag.
const STOP_POLL: Duration = Duration::from_millis(200);

/// Builds the body of a `GET /metrics` answer and its content type.
pub type Render = Arc<dyn Fn() -> (String, &'static str) + Send + Sync>;

/// A running responder. Stop it with [`HttpServer::shutdown`] (dropping it stops it too).
pub struct HttpServer {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    addr: SocketAddr,
}

impl HttpServer {
    /// Serves `listener` (already bound) with `render` for `/metrics`.
    pub fn start(listener: TcpListener, render: Render) -> std::io::Result<HttpServer> {
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = sync_channel::<Ready>(HTTP_WAITING);
        let rx = Arc::new(Mutex::new(rx));
        let mut threads = Vec::new();
        for i in 0..HTTP_WORKERS {
            let (rx, stop, render) = (rx.clone(), stop.clone(), render.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("kvnode-metrics-{i}"))
                    .spawn(move || work(&rx, &stop, &render))?,
            );
        }
        let s = stop.clone();
        threads.push(
            std::thread::Builder::new()
                .name("kvnode-metrics-accept".into())
                .spawn(move || accept_loop(&listener, &tx, &s))?,
        );
        Ok(HttpServer {
            stop,
            threads,
            addr,
        })
    }

    /// The address served.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets the connections being answered finish (each within
    /// [`HTTP_DEADLINE`]) and joins the threads.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        self.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// A connection whose request head is still arriving.
struct Pending {
    stream: TcpStream,
    accepted: Instant,
    head: Vec<u8>,
}

/// A connection handed to a worker: its head (`None`: over [`HTTP_HEAD_BYTES`]) and when it was
/// accepted.
type Ready = (TcpStream, Option<Vec<u8>>, Instant);

fn accept_loop(listener: &TcpListener, tx: &SyncSender<Ready>, stop: &AtomicBool) {
    let timeout = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: STOP_POLL.as_nanos() as _,
    };
    let mut pending: std::collections::VecDeque<Pending> = std::collections::VecDeque::new();
    let mut dropped = 0u64;
    let mut note_drop = |why: &str| {
        dropped += 1;
        if dropped.is_power_of_two() {
            tracing::warn!(dropped, why, "metrics endpoint busy: closing connections");
        }
    };
    while !stop.load(Ordering::Acquire) {
        let (listener_ready, readable) = {
            let mut fds = Vec::with_capacity(pending.len() + 1);
            fds.push(rustix::event::PollFd::new(
                listener,
                rustix::event::PollFlags::IN,
            ));
            for p in &pending {
                fds.push(rustix::event::PollFd::new(
                    &p.stream,
                    rustix::event::PollFlags::IN,
                ));
            }
            let _ = rustix::event::poll(&mut fds, Some(&timeout));
            let ready = |f: &rustix::event::PollFd<'_>| !f.revents().is_empty();
            let readable: Vec<bool> = fds[1..].iter().map(ready).collect();
            (ready(&fds[0]), readable)
        };
        // Heads that arrived (or connections that broke), then the expired ones.
        let now = Instant::now();
        let mut keep = std::collections::VecDeque::with_capacity(pending.len());
        for (mut p, ready) in pending.drain(..).zip(readable) {
            if ready {
                match read_available(&mut p) {
                    HeadState::Complete => {
                        let head = std::mem::take(&mut p.head);
                        if tx.try_send((p.stream, Some(head), p.accepted)).is_err() {
                            note_drop("workers busy");
                        }
                        continue;
                    }
                    HeadState::TooLarge => {
                        if tx.try_send((p.stream, None, p.accepted)).is_err() {
                            note_drop("workers busy");
                        }
                        continue;
                    }
                    HeadState::Closed => continue,
                    HeadState::More => {}
                }
            }
            if now.duration_since(p.accepted) < HTTP_HEAD_DEADLINE {
                keep.push_back(p);
            }
        }
        pending = keep;
        if !listener_ready {
            continue;
        }
        loop {
            match listener.accept() {
                Ok((stream, _)) => {
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    if pending.len() >= HTTP_PENDING {
                        // The oldest head still arriving goes: a scraper sends its head at once.
                        pending.pop_front();
                        note_drop("too many connections sending their request head");
                    }
                    pending.push_back(Pending {
                        stream,
                        accepted: Instant::now(),
                        head: Vec::new(),
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    // E.g. EMFILE: the node's descriptors are short; back off for a poll round.
                    tracing::debug!(error = %e, "metrics accept failed");
                    std::thread::sleep(STOP_POLL);
                    break;
                }
            }
        }
    }
}

/// Where a pending connection's head stands after reading what arrived.
enum HeadState {
    Complete,
    TooLarge,
    Closed,
    More,
}

/// Reads what arrived on `p` without blocking.
fn read_available(p: &mut Pending) -> HeadState {
    let mut buf = [0u8; 1024];
    loop {
        match p.stream.read(&mut buf) {
            Ok(0) => return HeadState::Closed,
            Ok(n) => {
                let before = p.head.len();
                p.head.extend_from_slice(&buf[..n]);
                // The blank line may straddle two reads: look back a few bytes.
                let end = p.head[before.saturating_sub(3)..]
                    .windows(4)
                    .any(|w| w == b"\r\n\r\n")
                    || p.head[before.saturating_sub(1)..]
                        .windows(2)
                        .any(|w| w == b"\n\n");
                if end {
                    return HeadState::Complete;
                }
                if p.head.len() > HTTP_HEAD_BYTES {
                    return HeadState::TooLarge;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return HeadState::More,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return HeadState::Closed,
        }
    }
}

fn work(rx: &Mutex<Receiver<Ready>>, stop: &AtomicBool, render: &Render) {
    while !stop.load(Ordering::Acquire) {
        let next = {
            let Ok(rx) = rx.lock() else { return };
            rx.recv_timeout(STOP_POLL)
        };
        match next {
            Ok((stream, head, accepted)) => serve(stream, head, accepted + HTTP_DEADLINE, render),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
enum Ask {
    Metrics { head_only: bool },
    NotFound,
    BadMethod,
    Bad,
}

/// Parses the request line of `head` (headers are not needed).
fn parse(head: &[u8]) -> Ask {
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let Ok(line) = std::str::from_utf8(line) else {
        return Ask::Bad;
    };
    let mut parts = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Ask::Bad;
    };
    if !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return Ask::Bad;
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Ask::BadMethod,
    };
    match target.split('?').next() {
        Some("/metrics") => Ask::Metrics { head_only },
        _ => Ask::NotFound,
    }
}

fn serve(mut stream: TcpStream, head: Option<Vec<u8>>, deadline: Instant, render: &Render) {
    if stream.set_nonblocking(false).is_err() {
        return;
    }
    let ask = match head {
        Some(head) => parse(&head),
        None => {
            answer(
                &mut stream,
                deadline,
                "431 Request Header Fields Too Large",
                "text/plain",
                &format!("request head over {HTTP_HEAD_BYTES} bytes\n"),
                false,
            );
            return;
        }
    };
    match ask {
        Ask::Metrics { head_only } => {
            let (body, content_type) = render();
            answer(
                &mut stream,
                deadline,
                "200 OK",
                content_type,
                &body,
                head_only,
            );
        }
        Ask::NotFound => answer(
            &mut stream,
            deadline,
            "404 Not Found",
            "text/plain",
            "not found: metrics are at /metrics\n",
            false,
        ),
        Ask::BadMethod => answer(
            &mut stream,
            deadline,
            "405 Method Not Allowed",
            "text/plain",
            "only GET and HEAD\n",
            false,
        ),
        Ask::Bad => answer(
            &mut stream,
            deadline,
            "400 Bad Request",
            "text/plain",
            "bad request line\n",
            false,
        ),
    }
}

fn answer(
    stream: &mut TcpStream,
    deadline: Instant,
    status: &str,
    content_type: &str,
    body: &str,
    head_only: bool,
) {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() || stream.set_write_timeout(Some(left)).is_err() {
        return;
    }
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes());
    if !head_only {
        let _ = stream.write_all(body.as_bytes());
    }
    let _ = stream.flush();
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines_are_parsed_strictly() {
        assert_eq!(
            parse(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            Ask::Metrics { head_only: false }
        );
        assert_eq!(
            parse(b"HEAD /metrics?x=1 HTTP/1.0\r\n\r\n"),
            Ask::Metrics { head_only: true }
        );
        assert_eq!(parse(b"GET / HTTP/1.1\r\n\r\n"), Ask::NotFound);
        assert_eq!(parse(b"GET /metricsx HTTP/1.1\r\n\r\n"), Ask::NotFound);
        assert_eq!(parse(b"POST /metrics HTTP/1.1\r\n\r\n"), Ask::BadMethod);
        assert_eq!(parse(b"GET /metrics\r\n\r\n"), Ask::Bad);
        assert_eq!(parse(b"GET  /metrics HTTP/1.1\r\n\r\n"), Ask::Bad);
        assert_eq!(parse(b"GET metrics HTTP/1.1\r\n\r\n"), Ask::Bad);
        assert_eq!(parse(b"\xff\xfe\r\n\r\n"), Ask::Bad);
    }
}
