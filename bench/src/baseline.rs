//! Baselines measured in the same run as the node benchmark: the physical
//! limits the node's numbers are compared against.
//!
//! * [`memcpy_baseline`]: memcpy bandwidth between private memory and a
//!   shared pool of the same page backing the node uses (the most a
//!   zero-protocol store/retrieve could move).
//! * [`uds_pingpong`] / [`uds_echo`]: the round-trip time of a bare Unix
//!   socket ping-pong between two processes (the kernel's floor for one
//!   request/response over a UDS).

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Barrier, OnceLock};
use std::time::{Duration, Instant};

use kvnode_hw::{PagePreference, PoolOptions, SharedPool};

const MIB: u64 = 1 << 20;
/// Smallest per-thread pool slice (before the `max_pool_bytes` cap): big
/// enough that cycling over it defeats the CPU caches.
const MIN_SLICE_BYTES: u64 = 64 * MIB;
/// Pools are sized in multiples of 2 MiB by the hw crate.
const POOL_ALIGN: u64 = 2 * MIB;
/// Ops are timed in batches of at least this many bytes, so that reading
/// the clock stays negligible for small chunks.
const MIN_BATCH_BYTES: u64 = 256 * 1024;

/// Size in bytes of every ping-pong message (roughly a small request frame).
pub const PINGPONG_MSG_BYTES: usize = 32;
/// How long [`uds_pingpong`] waits for the echo process to connect.
const ACCEPT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one round trip may take before the ping-pong gives up.
const ROUND_TRIP_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the echo process gets to exit after EOF before it is killed.
const CHILD_EXIT_GRACE: Duration = Duration::from_secs(2);

/// memcpy bandwidth between private memory and a shared pool of the same
/// page backing the node uses.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MemcpyBaseline {
    /// Bytes copied per operation.
    pub chunk_bytes: u64,
    /// Number of copying threads (each with its own buffer and pool slice).
    pub threads: usize,
    /// Backing actually obtained for the destination pool
    /// (`PoolBacking::as_str()`: `"hugetlb-1g"`, `"hugetlb-2m"`, `"thp"`,
    /// `"4k"`).
    pub backing: String,
    /// Length in bytes of the pool actually created (after the hw crate's
    /// rounding to whole pages).
    pub pool_bytes: u64,
    /// Private -> pool (the store direction), aggregate over all threads,
    /// in GB/s (1 GB/s = 1e9 bytes/s); median of the samples.
    pub write_gbps: f64,
    /// Pool -> private (the retrieve direction), aggregate over all
    /// threads, in GB/s; median of the samples.
    pub read_gbps: f64,
    /// Number of time-window samples taken per direction.
    pub samples: usize,
}

/// Copy direction of one measurement phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// Private buffer -> pool (store).
    Write,
    /// Pool -> private buffer (retrieve).
    Read,
}

/// Measures memcpy bandwidth with `threads` threads, each copying
/// `chunk_bytes` per op between its own private buffer (a `Vec` filled with
/// a non-zero pattern, so every page is faulted in once before timing) and
/// its own slice of one [`SharedPool`] (created with `prefer`, prefaulted).
///
/// Each thread's slice is `max(chunk_bytes * 4, 64 MiB)`, capped so that the
/// requested pool (`threads` slices) stays within `max_pool_bytes`, then
/// rounded down to a whole number of chunks. The private side is one reused
/// chunk (an engine's staging buffer) and the pool side cycles over the chunk
/// slots of the slice: the access pattern of the harness's own stores and
/// retrieves, so the ratio between them compares like with like. Note that a pool that ends up on 1 GiB hugetlb pages is
/// rounded up to whole GiB by the hw crate (those pages are reserved memory
/// anyway); [`MemcpyBaseline::pool_bytes`] reports the real size.
///
/// Per direction (write first, then read): a short warm-up (a tenth of
/// `duration`, between 20 and 200 ms), then about `duration` of copying,
/// all threads started together. The measured span is cut into equal time
/// windows (about 10 ms each, at most 100); each window's sample is the
/// bytes all threads copied in it (timed per batch of ops, attributed
/// proportionally to the windows a batch overlaps) divided by the window
/// length. The reported rates are the medians of those samples.
///
/// # Errors
///
/// A message (as text) for: zero `chunk_bytes`/`threads`/`duration`, a
/// `max_pool_bytes` too small for one chunk per thread, sizes that do not
/// fit this machine's address space, or pool creation failing.
pub fn memcpy_baseline(
    chunk_bytes: u64,
    threads: usize,
    prefer: PagePreference,
    duration: Duration,
    max_pool_bytes: u64,
) -> Result<MemcpyBaseline, String> {
    if chunk_bytes == 0 {
        return Err("memcpy baseline: chunk_bytes must be > 0".into());
    }
    if threads == 0 {
        return Err("memcpy baseline: threads must be > 0".into());
    }
    if duration.is_zero() {
        return Err("memcpy baseline: duration must be > 0".into());
    }
    let slice = slice_bytes(chunk_bytes, threads as u64, max_pool_bytes)?;
    let slice_usize = usize::try_from(slice)
        .map_err(|_| format!("memcpy baseline: slice of {slice} bytes is too large"))?;
    let chunk = chunk_bytes as usize; // <= slice, so it fits in usize.
    let total = slice
        .checked_mul(threads as u64)
        .ok_or("memcpy baseline: pool size overflows")?;
    let pool = SharedPool::create(&PoolOptions {
        bytes: total,
        prefer,
        prefault: true,
        name: "kvnode-bench-memcpy".into(),
        posix_shm_name: None,
        segment_bind_mount: false,
        cancel: None,
    })
    .map_err(|e| format!("memcpy baseline: creating the {total}-byte pool failed: {e}"))?;

    let warmup = (duration / 10).clamp(Duration::from_millis(20), Duration::from_millis(200));
    let windows = window_count(duration);
    let plan = Plan {
        chunk,
        slice: slice_usize,
        duration,
        warmup,
        windows,
        batch_ops: (MIN_BATCH_BYTES.div_ceil(chunk_bytes)).max(1) as usize,
    };

    let barrier = Barrier::new(threads);
    let starts = [OnceLock::new(), OnceLock::new()];
    let per_thread: Vec<Result<[Vec<f64>; 2], String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (pool, plan, barrier, starts) = (&pool, &plan, &barrier, &starts);
                s.spawn(move || copy_thread(pool, t as u64 * slice, plan, barrier, starts))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("memcpy baseline: a copy thread panicked".into()))
            })
            .collect()
    });

    let mut agg = [vec![0.0f64; windows], vec![0.0f64; windows]];
    for r in per_thread {
        let bins = r?;
        for (dir_agg, dir_bins) in agg.iter_mut().zip(bins.iter()) {
            for (a, b) in dir_agg.iter_mut().zip(dir_bins) {
                *a += b;
            }
        }
    }
    let window_secs = duration.as_secs_f64() / windows as f64;
    let [write_bins, read_bins] = agg;
    let rate = |bins: Vec<f64>| median(bins.into_iter().map(|b| b / window_secs / 1e9).collect());
    Ok(MemcpyBaseline {
        chunk_bytes,
        threads,
        backing: pool.backing().as_str().to_string(),
        pool_bytes: pool.len(),
        write_gbps: rate(write_bins),
        read_gbps: rate(read_bins),
        samples: windows,
    })
}

/// Per-thread slice size: `max(4 chunks, 64 MiB)` rounded up to 2 MiB,
/// capped to (`max_pool_bytes` rounded down to 2 MiB) / `threads`, then
/// rounded down to whole chunks.
fn slice_bytes(chunk: u64, threads: u64, max_pool_bytes: u64) -> Result<u64, String> {
    let want = chunk
        .checked_mul(4)
        .and_then(|b| b.max(MIN_SLICE_BYTES).checked_next_multiple_of(POOL_ALIGN))
        .ok_or("memcpy baseline: chunk_bytes too large")?;
    // The pool is rounded up to 2 MiB: cap against a 2 MiB multiple.
    let cap = max_pool_bytes / POOL_ALIGN * POOL_ALIGN / threads;
    let slice = want.min(cap) / chunk * chunk;
    if slice == 0 {
        return Err(format!(
            "memcpy baseline: max_pool_bytes {max_pool_bytes} is too small for {threads} \
             thread(s) with one {chunk}-byte chunk each"
        ));
    }
    Ok(slice)
}

/// Number of sample windows for a measurement span: one per ~10 ms, between
/// 1 and 100.
fn window_count(duration: Duration) -> usize {
    (duration.as_millis() / 10).clamp(1, 100) as usize
}

/// What every copy thread does, shared read-only.
struct Plan {
    chunk: usize,
    slice: usize,
    duration: Duration,
    warmup: Duration,
    windows: usize,
    batch_ops: usize,
}

/// One copy thread: allocates and touches its private buffer, then runs the
/// write phase and the read phase over its pool slice at `base`. Returns the
/// bytes copied per window for each direction (index 0: write, 1: read).
fn copy_thread(
    pool: &SharedPool,
    base: u64,
    plan: &Plan,
    barrier: &Barrier,
    starts: &[OnceLock<Instant>; 2],
) -> Result<[Vec<f64>; 2], String> {
    // vec! with a non-zero byte writes every byte: the buffer is faulted in
    // here, by the thread that uses it (first-touch NUMA placement).
    // One reused private chunk, as an engine copies from (or into) one staging buffer while the
    // pool side cycles over slots: the same access pattern as the harness's store and retrieve.
    let mut private = vec![0xA5u8; plan.chunk];
    let mut out = [vec![0.0f64; plan.windows], vec![0.0f64; plan.windows]];
    // Every thread must reach every barrier, even after an error, or the
    // others would wait forever: the first error is kept, not returned early.
    let mut result = Ok(());
    for (i, dir) in [Direction::Write, Direction::Read].into_iter().enumerate() {
        if result.is_ok() {
            result = run_phase(pool, base, &mut private, plan, dir, plan.warmup, None);
        }
        barrier.wait();
        let start = *starts[i].get_or_init(Instant::now);
        if result.is_ok() {
            let record = Some((start, out[i].as_mut_slice()));
            result = run_phase(pool, base, &mut private, plan, dir, plan.duration, record);
        }
        barrier.wait();
    }
    result.map(|()| out)
}

/// Copies chunk after chunk (cycling over the slots) in `dir` until `span`
/// has passed since the phase start. With `record`, the phase start is the
/// shared start instant and each batch's bytes are added to the windows of
/// `bins` that it overlaps, in proportion to the overlap.
fn run_phase(
    pool: &SharedPool,
    base: u64,
    private: &mut [u8],
    plan: &Plan,
    dir: Direction,
    span: Duration,
    mut record: Option<(Instant, &mut [f64])>,
) -> Result<(), String> {
    let region = pool.region();
    let slots = plan.slice / plan.chunk;
    let t0 = record.as_ref().map_or_else(Instant::now, |(s, _)| *s);
    let span_secs = span.as_secs_f64();
    let window_secs = span_secs / plan.windows as f64;
    let mut slot = 0usize;
    let mut batch_start = Instant::now();
    loop {
        for _ in 0..plan.batch_ops {
            let off = slot * plan.chunk;
            let buf = &mut private[..plan.chunk];
            let pool_off = base + off as u64;
            match dir {
                Direction::Write => region.write_at(pool_off, buf),
                Direction::Read => region.read_at(pool_off, buf),
            }
            .map_err(|e| format!("memcpy baseline: pool access failed: {e}"))?;
            slot += 1;
            if slot == slots {
                slot = 0;
            }
        }
        std::hint::black_box(&mut *private);
        let now = Instant::now();
        if let Some((_, bins)) = record.as_mut() {
            let a = batch_start.saturating_duration_since(t0).as_secs_f64();
            let b = now.saturating_duration_since(t0).as_secs_f64();
            let bytes = (plan.batch_ops * plan.chunk) as f64;
            spread(bins, window_secs, a, b, bytes);
        }
        batch_start = now;
        if now.saturating_duration_since(t0).as_secs_f64() >= span_secs {
            return Ok(());
        }
    }
}

/// Adds `bytes`, copied uniformly during `[a, b)` seconds, to the windows of
/// width `w` it overlaps; anything past the last window is dropped.
fn spread(bins: &mut [f64], w: f64, a: f64, b: f64, bytes: f64) {
    if b <= a {
        // Clock did not advance (coarse clock): credit the window of `a`.
        if let Some(bin) = bins.get_mut((a / w) as usize) {
            *bin += bytes;
        }
        return;
    }
    let rate = bytes / (b - a);
    let mut i = (a / w) as usize;
    while i < bins.len() {
        let lo = (i as f64 * w).max(a);
        let hi = ((i + 1) as f64 * w).min(b);
        if hi > lo {
            bins[i] += rate * (hi - lo);
        }
        if (i + 1) as f64 * w >= b {
            break;
        }
        i += 1;
    }
}

/// Median of `v` (mean of the two middle values for even lengths); 0 when
/// empty.
fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Round-trip time of a bare Unix-socket ping-pong between two processes
/// (the kernel's floor for a request/response over a UDS), in microseconds.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PingPong {
    /// Number of timed round trips (after the warm-up).
    pub iterations: usize,
    /// Median round trip, µs.
    pub p50_us: f64,
    /// 99th percentile round trip (nearest rank), µs.
    pub p99_us: f64,
    /// Mean round trip, µs.
    pub mean_us: f64,
}

/// Parent side of the ping-pong: binds a Unix listener at a fresh path in
/// the temp directory, starts `echo_cmd` with that socket path appended as
/// its last argument (the caller builds the command: normally this same
/// binary with a hidden subcommand that calls [`uds_echo`]), accepts its
/// connection (waiting at most 10 s, and failing early if the child exits),
/// then sends [`PINGPONG_MSG_BYTES`]-byte messages and waits for each echo,
/// `warmup` untimed rounds and then `iterations` rounds each timed with
/// [`Instant`]. Each echo is checked to equal what was sent. At the end the
/// connection is closed, the child gets 2 s to exit and is killed after
/// that; it is also killed on any error. The socket file is removed.
///
/// # Errors
///
/// A message (as text) for: `iterations == 0`, socket or spawn failures, a
/// child that exits or never connects, a round trip over 5 s, or a wrong
/// echo.
pub fn uds_pingpong(
    mut echo_cmd: Command,
    iterations: usize,
    warmup: usize,
) -> Result<PingPong, String> {
    if iterations == 0 {
        return Err("uds ping-pong: iterations must be > 0".into());
    }
    let (listener, sock) = bind_temp_listener()?;
    echo_cmd.arg(sock.path());
    let child = echo_cmd
        .spawn()
        .map_err(|e| format!("uds ping-pong: starting the echo process failed: {e}"))?;
    let mut child = ChildGuard(Some(child));
    let mut stream = accept_with_timeout(&listener, ACCEPT_TIMEOUT, || child.check_running())?;
    drop(listener);
    drop(sock); // Connected: the path is no longer needed.
    let result = measure_pingpong(&mut stream, iterations, warmup);
    drop(stream); // EOF for the echo side.
    child.finish(CHILD_EXIT_GRACE);
    result
}

/// Child side of the ping-pong: connects to `socket_path` and echoes every
/// [`PINGPONG_MSG_BYTES`]-byte message back until the peer closes the
/// connection, then returns `Ok(())`.
///
/// # Errors
///
/// Connect, read and write errors; a connection closed in the middle of a
/// message is an `UnexpectedEof` error.
pub fn uds_echo(socket_path: &Path) -> std::io::Result<()> {
    let mut stream = UnixStream::connect(socket_path)?;
    let mut buf = [0u8; PINGPONG_MSG_BYTES];
    loop {
        let mut filled = 0;
        while filled < buf.len() {
            match stream.read(&mut buf[filled..]) {
                Ok(0) if filled == 0 => return Ok(()),
                Ok(0) => {
                    return Err(std::io::Error::new(
                        ErrorKind::UnexpectedEof,
                        "peer closed in the middle of a message",
                    ))
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        stream.write_all(&buf)?;
    }
}

/// Removes the socket file when dropped.
struct SocketPath(PathBuf);

impl SocketPath {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for SocketPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Binds a listener at a fresh, unique path in the temp directory.
fn bind_temp_listener() -> Result<(UnixListener, SocketPath), String> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "kvnode-bench-pp-{}-{}.sock",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let path = std::env::temp_dir().join(name);
    let _ = std::fs::remove_file(&path); // A stale file from a crashed run.
    let listener = UnixListener::bind(&path)
        .map_err(|e| format!("uds ping-pong: binding {} failed: {e}", path.display()))?;
    Ok((listener, SocketPath(path)))
}

/// Accepts one connection, polling until `timeout`; `alive` is asked between
/// polls and aborts the wait with its error (e.g. the peer process exited).
/// The returned stream is blocking.
fn accept_with_timeout(
    listener: &UnixListener,
    timeout: Duration,
    mut alive: impl FnMut() -> Result<(), String>,
) -> Result<UnixStream, String> {
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("uds ping-pong: set_nonblocking failed: {e}"))?;
    let deadline = Instant::now() + timeout;
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream
                    .set_nonblocking(false)
                    .map_err(|e| format!("uds ping-pong: set_nonblocking failed: {e}"))?;
                return Ok(stream);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                alive()?;
                if Instant::now() >= deadline {
                    return Err(format!(
                        "uds ping-pong: the echo side did not connect within {timeout:?}"
                    ));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(format!("uds ping-pong: accept failed: {e}")),
        }
    }
}

/// Runs `warmup` untimed and `iterations` timed round trips over a connected
/// stream whose peer echoes every message, and summarizes the timings.
fn measure_pingpong(
    stream: &mut UnixStream,
    iterations: usize,
    warmup: usize,
) -> Result<PingPong, String> {
    if iterations == 0 {
        return Err("uds ping-pong: iterations must be > 0".into());
    }
    stream
        .set_read_timeout(Some(ROUND_TRIP_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(ROUND_TRIP_TIMEOUT)))
        .map_err(|e| format!("uds ping-pong: setting socket timeouts failed: {e}"))?;
    let mut msg = [0x5Au8; PINGPONG_MSG_BYTES];
    let mut echo = [0u8; PINGPONG_MSG_BYTES];
    let mut samples_us = Vec::with_capacity(iterations);
    for round in 0..warmup + iterations {
        msg[..8].copy_from_slice(&(round as u64).to_le_bytes());
        let t = Instant::now();
        stream
            .write_all(&msg)
            .and_then(|()| stream.read_exact(&mut echo))
            .map_err(|e| format!("uds ping-pong: round trip {round} failed: {e}"))?;
        let rtt = t.elapsed();
        if echo != msg {
            return Err(format!(
                "uds ping-pong: round trip {round} echoed different bytes"
            ));
        }
        if round >= warmup {
            samples_us.push(rtt.as_secs_f64() * 1e6);
        }
    }
    let mean_us = samples_us.iter().sum::<f64>() / samples_us.len() as f64;
    samples_us.sort_by(f64::total_cmp);
    Ok(PingPong {
        iterations,
        p50_us: percentile_sorted(&samples_us, 50.0),
        p99_us: percentile_sorted(&samples_us, 99.0),
        mean_us,
    })
}

/// Nearest-rank percentile `p` (0..=100) of ascending, non-empty `sorted`.
fn percentile_sorted(sorted: &[f64], p: f64) -> f64 {
    let n = sorted.len();
    let rank = ((p / 100.0) * n as f64).ceil() as usize;
    sorted[rank.clamp(1, n) - 1]
}

/// Owns the echo child; kills and reaps it when dropped unless it was
/// already reaped by [`ChildGuard::finish`].
struct ChildGuard(Option<Child>);

impl ChildGuard {
    /// `Err` if the child has already exited (it can then never connect).
    fn check_running(&mut self) -> Result<(), String> {
        let Some(child) = self.0.as_mut() else {
            return Err("uds ping-pong: echo process already reaped".into());
        };
        match child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(format!(
                "uds ping-pong: the echo process exited before connecting ({status})"
            )),
            Err(e) => Err(format!("uds ping-pong: waiting for the echo process: {e}")),
        }
    }

    /// Gives the child `grace` to exit by itself, then kills it; reaps it.
    fn finish(&mut self, grace: Duration) {
        let Some(mut child) = self.0.take() else {
            return;
        };
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            match child.try_wait() {
                Ok(Some(_)) => return,
                Ok(None) => std::thread::sleep(Duration::from_millis(2)),
                Err(_) => break,
            }
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Env var that turns [`echo_child_process`] into the echo side.
    const ECHO_CHILD_ENV: &str = "KVNODE_BENCH_TEST_ECHO_CHILD";

    #[test]
    fn memcpy_baseline_one_thread_reports_positive_rates() {
        let r = memcpy_baseline(
            MIB,
            1,
            PagePreference::Huge2M,
            Duration::from_millis(200),
            256 * MIB,
        )
        .expect("memcpy baseline");
        assert_eq!(r.chunk_bytes, MIB);
        assert_eq!(r.threads, 1);
        assert!(
            ["hugetlb-1g", "hugetlb-2m", "thp", "4k"].contains(&r.backing.as_str()),
            "backing {:?}",
            r.backing
        );
        assert!(r.pool_bytes >= 64 * MIB);
        assert!(r.write_gbps.is_finite() && r.write_gbps > 0.0, "{r:?}");
        assert!(r.read_gbps.is_finite() && r.read_gbps > 0.0, "{r:?}");
        assert_eq!(r.samples, 20);
    }

    #[test]
    fn memcpy_baseline_two_threads_small_cap() {
        // 8 MiB cap over 2 threads: 4 MiB slices of 3 chunks of 1.25 MiB.
        let chunk = 5 * MIB / 4;
        let r = memcpy_baseline(
            chunk,
            2,
            PagePreference::Pages4K,
            Duration::from_millis(50),
            8 * MIB,
        )
        .expect("memcpy baseline");
        assert_eq!(r.backing, "4k");
        assert!(r.pool_bytes <= 8 * MIB, "{r:?}");
        assert!(r.write_gbps > 0.0 && r.read_gbps > 0.0, "{r:?}");
        assert_eq!(r.samples, 5);
    }

    #[test]
    fn memcpy_baseline_rejects_bad_arguments() {
        let d = Duration::from_millis(10);
        let p = PagePreference::Pages4K;
        assert!(memcpy_baseline(0, 1, p, d, 64 * MIB).is_err());
        assert!(memcpy_baseline(MIB, 0, p, d, 64 * MIB).is_err());
        assert!(memcpy_baseline(MIB, 1, p, Duration::ZERO, 64 * MIB).is_err());
        let e = memcpy_baseline(MIB, 4, p, d, 3 * MIB).unwrap_err();
        assert!(e.contains("too small"), "{e}");
    }

    #[test]
    fn slice_sizes() {
        assert_eq!(slice_bytes(MIB, 1, u64::MAX).unwrap(), 64 * MIB);
        assert_eq!(slice_bytes(32 * MIB, 1, u64::MAX).unwrap(), 128 * MIB);
        assert_eq!(slice_bytes(MIB, 4, 100 * MIB).unwrap(), 25 * MIB);
        assert_eq!(slice_bytes(3 * MIB, 1, 10 * MIB).unwrap(), 9 * MIB);
        assert_eq!(
            slice_bytes(3000, 1, u64::MAX).unwrap(),
            64 * MIB / 3000 * 3000
        );
        assert!(slice_bytes(MIB, 2, MIB).is_err());
        assert!(slice_bytes(u64::MAX, 1, u64::MAX).is_err());
    }

    #[test]
    fn spread_is_proportional_and_drops_overflow() {
        let mut bins = vec![0.0; 4];
        spread(&mut bins, 1.0, 0.5, 2.5, 4.0);
        assert_eq!(bins, vec![1.0, 2.0, 1.0, 0.0]);
        spread(&mut bins, 1.0, 3.5, 5.5, 4.0); // Only 0.5 s lands in bin 3.
        assert_eq!(bins, vec![1.0, 2.0, 1.0, 1.0]);
        spread(&mut bins, 1.0, 1.2, 1.2, 7.0);
        assert_eq!(bins, vec![1.0, 9.0, 1.0, 1.0]);
        spread(&mut bins, 1.0, 9.0, 9.0, 7.0);
        assert_eq!(bins, vec![1.0, 9.0, 1.0, 1.0]);
    }

    #[test]
    fn median_and_percentiles() {
        assert_eq!(median(vec![]), 0.0);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile_sorted(&v, 50.0), 50.0);
        assert_eq!(percentile_sorted(&v, 99.0), 99.0);
        assert_eq!(percentile_sorted(&v, 100.0), 100.0);
        assert_eq!(percentile_sorted(&v, 0.0), 1.0);
        assert_eq!(percentile_sorted(&[7.0], 99.0), 7.0);
    }

    #[test]
    fn pingpong_against_echo_thread() {
        let (listener, sock) = bind_temp_listener().unwrap();
        let path = sock.path().to_path_buf();
        let echo = std::thread::spawn(move || uds_echo(&path));
        let mut stream =
            accept_with_timeout(&listener, Duration::from_secs(10), || Ok(())).unwrap();
        let r = measure_pingpong(&mut stream, 2000, 200).unwrap();
        drop(stream);
        echo.join().unwrap().expect("echo returns Ok on EOF");
        assert_eq!(r.iterations, 2000);
        assert!(r.p50_us > 0.0 && r.p50_us.is_finite(), "{r:?}");
        assert!(r.p99_us >= r.p50_us, "{r:?}");
        assert!(r.mean_us > 0.0 && r.mean_us.is_finite(), "{r:?}");
        assert!(r.p50_us < 100_000.0, "{r:?}");
    }

    #[test]
    fn pingpong_against_echo_process() {
        // Re-runs this test binary with only `echo_child_process` selected;
        // uds_pingpong appends the socket path, which libtest takes as one
        // more (non-matching) name filter, and the child reads it back.
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["echo_child_process", "--test-threads=1", "-q"])
            .env(ECHO_CHILD_ENV, "1")
            .stdout(std::process::Stdio::null());
        let r = uds_pingpong(cmd, 500, 50).expect("ping-pong with a child process");
        assert_eq!(r.iterations, 500);
        assert!(r.p50_us > 0.0 && r.p99_us >= r.p50_us, "{r:?}");
    }

    /// The echo side of `pingpong_against_echo_process`; a no-op in normal
    /// test runs.
    #[test]
    fn echo_child_process() {
        if std::env::var_os(ECHO_CHILD_ENV).is_none() {
            return;
        }
        let path = std::env::args_os().last().expect("socket path argument");
        uds_echo(Path::new(&path)).expect("echo");
    }

    #[test]
    fn pingpong_reports_a_child_that_never_connects() {
        let cmd = Command::new("true");
        let e = uds_pingpong(cmd, 10, 0).unwrap_err();
        assert!(e.contains("exited before connecting"), "{e}");
        assert!(uds_pingpong(Command::new("true"), 0, 0).is_err());
    }

    #[test]
    fn echo_rejects_a_partial_message() {
        let (listener, sock) = bind_temp_listener().unwrap();
        let path = sock.path().to_path_buf();
        let echo = std::thread::spawn(move || uds_echo(&path));
        let (mut s, _) = listener.accept().unwrap();
        s.write_all(&[1u8; PINGPONG_MSG_BYTES]).unwrap();
        let mut back = [0u8; PINGPONG_MSG_BYTES];
        s.read_exact(&mut back).unwrap();
        assert_eq!(back, [1u8; PINGPONG_MSG_BYTES]);
        s.write_all(&[2u8; 5]).unwrap();
        drop(s);
        let e = echo.join().unwrap().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::UnexpectedEof);
    }
}
