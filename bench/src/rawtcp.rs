//! The network's limit between the bench and a remote node's host, measured in the same run:
//! a raw TCP stream in each direction (one connection, chunk-sized writes, the receiver reading
//! into one buffer and discarding) and a TCP ping-pong of small messages (`TCP_NODELAY` on both
//! ends). The other end is [`serve`] (`kvnode-bench --raw-peer ADDR:PORT`), started beside the
//! node (same host, same network namespace) so that both figures cross the same path.
//!
//! Wire protocol (little endian): the client opens with a [`HEADER_BYTES`]-byte header
//! `magic u32, mode u32, a u64, b u64, pages u64` (`pages`: the [`Pages`] code the peer's
//! buffer should be on, the node pool's):
//! * `MODE_SINK` (`a` = read size): the peer reads into one buffer and discards until EOF, then
//!   answers `bytes u64, cpu_ns u64, pages u64` (its thread's CPU time over the connection, the
//!   buffer's backing);
//! * `MODE_SOURCE` (`a` = write size, `b` = total bytes): the peer sends `b` bytes in writes of
//!   `a`, then `bytes u64, cpu_ns u64, pages u64`;
//! * `MODE_ECHO` (`a` = message size): the peer echoes every `a`-byte message until EOF.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::peerbuf::{give_back, Pages, PeerBuf};

/// Opening word of every raw-peer connection ("KVRP").
const MAGIC: u32 = 0x5052_564B;
/// Length of the opening header.
const HEADER_BYTES: usize = 32;
/// Length of the totals a sink or source connection ends with.
const TOTALS_BYTES: usize = 24;
/// Peer reads and discards.
const MODE_SINK: u32 = 1;
/// Peer sends.
const MODE_SOURCE: u32 = 2;
/// Peer echoes.
const MODE_ECHO: u32 = 3;
/// Largest buffer the peer allocates for one connection (a larger write size is served in
/// pieces of this size): bounds the peer's memory per connection.
pub const MAX_PEER_BUF_BYTES: u64 = 64 << 20;
/// Largest echo message.
pub const MAX_ECHO_BYTES: u64 = 4096;
/// Largest total a source connection may ask for (1 TiB: far beyond any run).
const MAX_SOURCE_BYTES: u64 = 1 << 40;
/// Connections the peer serves at once (each is a thread); more are refused (closed).
const MAX_PEER_CONNECTIONS: usize = 16;
/// Longest one read or write may block on either side before the measurement gives up.
const IO_TIMEOUT: Duration = Duration::from_secs(30);
/// Size of a ping-pong message (a small request frame).
pub const PINGPONG_MSG_BYTES: usize = 32;
/// Stream samples (connections) per direction per call of [`Streams::sample`]. One long one:
/// short fresh connections undercount on a loaded machine (0.25 s samples gave a third of the
/// rate of 1 s ones here), and the workload's connection is long-lived too.
const STREAM_SAMPLES: usize = 1;

fn header(mode: u32, a: u64, b: u64, pages: Pages) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4..8].copy_from_slice(&mode.to_le_bytes());
    h[8..16].copy_from_slice(&a.to_le_bytes());
    h[16..24].copy_from_slice(&b.to_le_bytes());
    h[24..32].copy_from_slice(&(pages as u64).to_le_bytes());
    h
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// CPU time (user + system) of the calling thread, from `/proc/thread-self/stat` (one clock
/// tick of resolution; zero if unreadable).
fn thread_cpu() -> Duration {
    thread_cpu_ticks()
        .map(|t| Duration::from_secs_f64(t as f64 / *TICKS.get_or_init(crate::disk::clock_ticks)))
        .unwrap_or_default()
}

/// Clock ticks per second, asked once.
static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();

fn thread_cpu_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    // Fields resume after the command name's last ')': index 0 is field 3; utime and stime
    // are fields 14 and 15.
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// User + system CPU time of process `pid` (all its threads); `None` if it is gone.
pub fn process_cpu(pid: u32) -> Option<Duration> {
    let ticks = *TICKS.get_or_init(crate::disk::clock_ticks);
    crate::disk::process_cpu_seconds_of(pid, ticks).map(Duration::from_secs_f64)
}

// ---------------------------------------------------------------------------------------------
// The peer.

/// Runs the raw peer on `addr` until killed: prints `LISTENING <addr>` on stdout once bound
/// (port 0 picks one), then serves every connection on its own thread (at most
/// [`MAX_PEER_CONNECTIONS`] at once).
pub fn serve(addr: &str) -> Result<(), String> {
    let listener = TcpListener::bind(addr).map_err(|e| format!("raw peer: binding {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    println!("LISTENING {local}");
    let _ = std::io::stdout().flush();
    let active = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for conn in listener.incoming() {
        let Ok(stream) = conn else { continue };
        use std::sync::atomic::Ordering;
        if active.fetch_add(1, Ordering::AcqRel) >= MAX_PEER_CONNECTIONS {
            active.fetch_sub(1, Ordering::AcqRel);
            eprintln!("raw peer: more than {MAX_PEER_CONNECTIONS} connections; refusing one");
            continue;
        }
        let active = active.clone();
        let spawned = std::thread::Builder::new()
            .name("raw-peer-conn".into())
            .spawn(move || {
                if let Err(e) = serve_one(stream) {
                    eprintln!("raw peer: {e}");
                }
                active.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            eprintln!("raw peer: cannot start a thread: {e}");
        }
    }
    Ok(())
}

fn serve_one(mut s: TcpStream) -> Result<(), String> {
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(IO_TIMEOUT))
        .and_then(|()| s.set_write_timeout(Some(IO_TIMEOUT)))
        .map_err(|e| e.to_string())?;
    let mut h = [0u8; HEADER_BYTES];
    s.read_exact(&mut h).map_err(|e| format!("header: {e}"))?;
    if u32::from_le_bytes([h[0], h[1], h[2], h[3]]) != MAGIC {
        return Err("not a raw-peer client (bad magic)".into());
    }
    let mode = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
    let (a, b) = (u64_at(&h, 8), u64_at(&h, 16));
    let pages = Pages::from_code(u64_at(&h, 24));
    let cpu0 = thread_cpu();
    match mode {
        MODE_SINK => {
            let mut buf = PeerBuf::take(a.clamp(1, MAX_PEER_BUF_BYTES) as usize, pages);
            let mut total = 0u64;
            loop {
                match s.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => total += n as u64,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(format!("sink: {e}")),
                }
            }
            let cpu = thread_cpu().saturating_sub(cpu0);
            let got = buf.pages();
            give_back(buf);
            reply_totals(&mut s, total, cpu, got)
        }
        MODE_SOURCE => {
            if b > MAX_SOURCE_BYTES {
                return Err(format!(
                    "source of {b} bytes asked; the limit is {MAX_SOURCE_BYTES}"
                ));
            }
            let buf = PeerBuf::take(a.clamp(1, MAX_PEER_BUF_BYTES) as usize, pages);
            let mut left = b;
            while left > 0 {
                let n = left.min(buf.len() as u64) as usize;
                s.write_all(&buf[..n]).map_err(|e| format!("source: {e}"))?;
                left -= n as u64;
            }
            let cpu = thread_cpu().saturating_sub(cpu0);
            let got = buf.pages();
            give_back(buf);
            reply_totals(&mut s, b, cpu, got)
        }
        MODE_ECHO => {
            if a == 0 || a > MAX_ECHO_BYTES {
                return Err(format!(
                    "echo of {a}-byte messages asked; 1..={MAX_ECHO_BYTES}"
                ));
            }
            let mut msg = vec![0u8; a as usize];
            loop {
                match s.read_exact(&mut msg) {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(()),
                    Err(e) => return Err(format!("echo: {e}")),
                }
                s.write_all(&msg).map_err(|e| format!("echo: {e}"))?;
            }
        }
        m => Err(format!("unknown raw-peer mode {m}")),
    }
}

fn reply_totals(s: &mut TcpStream, bytes: u64, cpu: Duration, pages: Pages) -> Result<(), String> {
    let mut r = [0u8; TOTALS_BYTES];
    r[..8].copy_from_slice(&bytes.to_le_bytes());
    r[8..16].copy_from_slice(&(cpu.as_nanos() as u64).to_le_bytes());
    r[16..].copy_from_slice(&(pages as u64).to_le_bytes());
    s.write_all(&r).map_err(|e| format!("totals: {e}"))
}

/// A non-zero buffer, every page touched (no zero-page or lazy-fault effects in the timing).
fn pattern(len: usize) -> Vec<u8> {
    let mut v = vec![0xA5u8; len];
    for (i, b) in v.iter_mut().enumerate().step_by(251) {
        *b = i as u8;
    }
    v
}

// ---------------------------------------------------------------------------------------------
// The client side.

/// One direction of the raw stream.
#[derive(Debug, Clone, Serialize)]
pub struct StreamRate {
    /// Bytes over time of all the samples together, GB/s (1e9 bytes/s): measured like the
    /// workload's goodput.
    pub gbps: f64,
    /// Every sample, GB/s, in the order taken (half before the load, half after).
    pub samples_gbps: Vec<f64>,
    /// The peer's CPU seconds per GB moved (its thread, kernel time included), over all the
    /// samples: the cost of a bare `read`/`write` loop on the node's host.
    pub peer_cpu_s_per_gb: f64,
    /// The bench's own CPU seconds per GB moved (this thread).
    pub local_cpu_s_per_gb: f64,
    /// What the peer's buffer was on (the last sample): `hugetlb-2m`, `thp-advised`, `4k`.
    pub peer_pages: &'static str,
}

/// The network's limits between this process and the raw peer.
#[derive(Debug, Clone, Serialize)]
pub struct RawTcp {
    /// The peer's address.
    pub peer: String,
    /// Bytes per write (the workload's chunk, at most [`MAX_PEER_BUF_BYTES`]).
    pub write_bytes: u64,
    /// Bench -> peer (the store direction).
    pub send: StreamRate,
    /// Peer -> bench (the retrieve direction).
    pub recv: StreamRate,
}

/// One stream sample: bytes, elapsed, the peer's CPU, this thread's CPU, the peer buffer's
/// backing.
type Sample = (u64, Duration, Duration, Duration, Pages);

fn connect(addr: SocketAddr) -> Result<TcpStream, String> {
    let s = TcpStream::connect_timeout(&addr, IO_TIMEOUT)
        .map_err(|e| format!("raw peer at {addr}: {e}"))?;
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(IO_TIMEOUT))
        .and_then(|()| s.set_write_timeout(Some(IO_TIMEOUT)))
        .map_err(|e| e.to_string())?;
    Ok(s)
}

fn read_totals(s: &mut TcpStream) -> Result<(u64, Duration, Pages), String> {
    let mut r = [0u8; TOTALS_BYTES];
    s.read_exact(&mut r)
        .map_err(|e| format!("raw peer totals: {e}"))?;
    Ok((
        u64_at(&r, 0),
        Duration::from_nanos(u64_at(&r, 8)),
        Pages::from_code(u64_at(&r, 16)),
    ))
}

/// One send sample: chunk-sized writes for `secs`, then EOF; timed until the peer confirms it
/// read every byte. Returns (bytes, elapsed, peer cpu, local cpu).
fn send_sample(
    addr: SocketAddr,
    buf: &[u8],
    secs: Duration,
    pages: Pages,
) -> Result<Sample, String> {
    let mut s = connect(addr)?;
    s.write_all(&header(MODE_SINK, buf.len() as u64, 0, pages))
        .map_err(|e| e.to_string())?;
    let cpu0 = thread_cpu();
    let t = Instant::now();
    let mut sent = 0u64;
    while t.elapsed() < secs || sent == 0 {
        s.write_all(buf).map_err(|e| format!("raw send: {e}"))?;
        sent += buf.len() as u64;
    }
    s.shutdown(Shutdown::Write).map_err(|e| e.to_string())?;
    let (got, peer_cpu, got_pages) = read_totals(&mut s)?;
    let elapsed = t.elapsed();
    if got != sent {
        return Err(format!("raw send: the peer read {got} of {sent} bytes"));
    }
    Ok((
        sent,
        elapsed,
        peer_cpu,
        thread_cpu().saturating_sub(cpu0),
        got_pages,
    ))
}

/// One receive sample of `total` bytes. Returns (bytes, elapsed, peer cpu, local cpu).
fn recv_sample(
    addr: SocketAddr,
    buf: &mut [u8],
    total: u64,
    pages: Pages,
) -> Result<Sample, String> {
    let mut s = connect(addr)?;
    let cpu0 = thread_cpu();
    let t = Instant::now();
    s.write_all(&header(MODE_SOURCE, buf.len() as u64, total, pages))
        .map_err(|e| e.to_string())?;
    let mut left = total;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        s.read_exact(&mut buf[..n])
            .map_err(|e| format!("raw receive: {e}"))?;
        left -= n as u64;
    }
    let elapsed = t.elapsed();
    let (sent, peer_cpu, got_pages) = read_totals(&mut s)?;
    if sent != total {
        return Err(format!(
            "raw receive: the peer sent {sent} of {total} bytes"
        ));
    }
    Ok((
        total,
        elapsed,
        peer_cpu,
        thread_cpu().saturating_sub(cpu0),
        got_pages,
    ))
}

fn rate_of(samples: &[Sample]) -> StreamRate {
    let gb: f64 = samples.iter().map(|s| s.0 as f64 / 1e9).sum();
    let per_gb = |cpu: Duration| {
        if gb > 0.0 {
            cpu.as_secs_f64() / gb
        } else {
            0.0
        }
    };
    StreamRate {
        gbps: gb
            / samples
                .iter()
                .map(|s| s.1.as_secs_f64())
                .sum::<f64>()
                .max(1e-9),
        samples_gbps: samples
            .iter()
            .map(|s| s.0 as f64 / s.1.as_secs_f64().max(1e-9) / 1e9)
            .collect(),
        peer_cpu_s_per_gb: per_gb(samples.iter().map(|s| s.2).sum()),
        local_cpu_s_per_gb: per_gb(samples.iter().map(|s| s.3).sum()),
        peer_pages: samples.last().map_or("none", |s| s.4.as_str()),
    }
}

/// Resolves `HOST:PORT`.
pub fn resolve(addr: &str) -> Result<SocketAddr, String> {
    addr.to_socket_addrs()
        .map_err(|e| format!("raw peer address {addr:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("raw peer address {addr:?} resolves to nothing"))
}

/// Stream samples of both directions, accumulated over several calls of [`Streams::sample`].
#[derive(Debug, Default)]
pub struct Streams {
    send: Vec<Sample>,
    recv: Vec<Sample>,
}

impl Streams {
    /// Takes [`STREAM_SAMPLES`] samples per direction, about `secs` per direction in all, with
    /// `write_bytes`-byte writes (send first; the receive samples ask for about as many bytes as
    /// a send sample moved), the peer's buffer on `pages`.
    pub fn sample(
        &mut self,
        addr: SocketAddr,
        write_bytes: u64,
        secs: Duration,
        pages: Pages,
    ) -> Result<(), String> {
        let write = write_bytes.clamp(1, MAX_PEER_BUF_BYTES) as usize;
        let mut buf = pattern(write);
        let per_sample = secs / STREAM_SAMPLES as u32;
        // Untimed: the peer allocates (and faults in) its buffers for both modes.
        send_sample(addr, &buf, Duration::ZERO, pages)?;
        recv_sample(addr, &mut buf, write as u64, pages)?;
        let mut moved = 0u64;
        let mut took = Duration::ZERO;
        for _ in 0..STREAM_SAMPLES {
            let s = send_sample(addr, &buf, per_sample, pages)?;
            moved += s.0;
            took += s.1;
            self.send.push(s);
        }
        let rate = moved as f64 / took.as_secs_f64().max(1e-9);
        let total = ((rate * per_sample.as_secs_f64()) as u64 / write as u64).max(4) * write as u64;
        for _ in 0..STREAM_SAMPLES {
            self.recv.push(recv_sample(addr, &mut buf, total, pages)?);
        }
        Ok(())
    }

    /// The figures over every sample taken.
    pub fn finish(&self, addr: SocketAddr, write_bytes: u64) -> RawTcp {
        RawTcp {
            peer: addr.to_string(),
            write_bytes: write_bytes.clamp(1, MAX_PEER_BUF_BYTES),
            send: rate_of(&self.send),
            recv: rate_of(&self.recv),
        }
    }
}

/// A ping-pong connection to the peer (echo mode, `TCP_NODELAY` on both ends).
pub struct Echo {
    s: TcpStream,
    round: u64,
    msg: [u8; PINGPONG_MSG_BYTES],
    back: [u8; PINGPONG_MSG_BYTES],
}

impl Echo {
    /// Connects.
    pub fn connect(addr: SocketAddr) -> Result<Echo, String> {
        let mut s = connect(addr)?;
        s.write_all(&header(
            MODE_ECHO,
            PINGPONG_MSG_BYTES as u64,
            0,
            Pages::Small,
        ))
        .map_err(|e| e.to_string())?;
        Ok(Echo {
            s,
            round: 0,
            msg: [0x5A; PINGPONG_MSG_BYTES],
            back: [0; PINGPONG_MSG_BYTES],
        })
    }

    /// One timed round trip of a [`PINGPONG_MSG_BYTES`]-byte message.
    pub fn round_trip(&mut self) -> Result<Duration, String> {
        self.round += 1;
        self.msg[..8].copy_from_slice(&self.round.to_le_bytes());
        let t = Instant::now();
        self.s
            .write_all(&self.msg)
            .and_then(|()| self.s.read_exact(&mut self.back))
            .map_err(|e| format!("tcp ping-pong round {}: {e}", self.round))?;
        let rtt = t.elapsed();
        if self.back != self.msg {
            return Err(format!(
                "tcp ping-pong round {}: different bytes echoed",
                self.round
            ));
        }
        Ok(rtt)
    }
}

/// Nearest-rank percentile of ascending `sorted` (0 when empty).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A raw peer this run started (`kvnode-bench --raw-peer 127.0.0.1:0`). Invariant: killed and
/// reaped on drop.
pub struct SpawnedPeer {
    child: std::process::Child,
    /// Where it listens.
    pub addr: SocketAddr,
}

impl SpawnedPeer {
    /// Starts a peer on `bind` (port 0: any) and reads its address.
    pub fn start(bind: &str) -> Result<SpawnedPeer, String> {
        use std::io::BufRead;
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = std::process::Command::new(exe)
            .args(["--raw-peer", bind])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting the raw peer: {e}"))?;
        let out = child.stdout.take().ok_or("raw peer: no stdout")?;
        let mut line = String::new();
        let read = std::io::BufReader::new(out).read_line(&mut line);
        let addr = line
            .trim()
            .strip_prefix("LISTENING ")
            .and_then(|a| a.parse().ok());
        match (read, addr) {
            (Ok(_), Some(addr)) => Ok(SpawnedPeer { child, addr }),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                Err(format!("the raw peer did not start (said {line:?})"))
            }
        }
    }
}

impl Drop for SpawnedPeer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_and_pingpong_against_an_in_process_peer() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for c in l.incoming().take(4 * STREAM_SAMPLES + 5) {
                let s = c.unwrap();
                std::thread::spawn(move || serve_one(s).unwrap());
            }
        });
        let mut st = Streams::default();
        st.sample(addr, 1 << 20, Duration::from_millis(60), Pages::Small)
            .unwrap();
        st.sample(addr, 1 << 20, Duration::from_millis(60), Pages::Thp)
            .unwrap();
        let r = st.finish(addr, 1 << 20);
        assert!(r.send.gbps > 0.0 && r.recv.gbps > 0.0, "{r:?}");
        assert_eq!(r.send.samples_gbps.len(), 2 * STREAM_SAMPLES);
        assert_eq!(r.recv.samples_gbps.len(), 2 * STREAM_SAMPLES);
        let mut e = Echo::connect(addr).unwrap();
        for _ in 0..100 {
            assert!(e.round_trip().unwrap() > Duration::ZERO);
        }
    }

    #[test]
    fn cpu_times_are_readable() {
        assert!(thread_cpu_ticks().is_some());
        assert!(process_cpu(std::process::id()).is_some());
        assert!(process_cpu(u32::MAX).is_none());
    }

    #[test]
    fn percentile_is_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }
}
