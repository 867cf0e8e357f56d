//! The raw `O_DIRECT` baseline of `kvnode-bench l2` (what fio would measure): sequential writes
//! of whole objects to a scratch file, then sequential reads of them, through one
//! [`kvnode_hw::BlockEngine`] from a small pool of reused buffers; plus reading another process's
//! CPU time from `/proc`.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvnode_hw::{BlockEngine, BlockIo, EngineKind, PagePreference, PoolOptions, SharedPool};
use serde::Serialize;

/// Bytes of buffers the raw baseline keeps in its pool at most (fewer buffers for big objects).
const RING_BYTES: u64 = 256 << 20;

/// One engine's raw figures. Rates are 1e9 bytes per second; CPU is this process's user +
/// system time (engine threads and io_uring workers included) per 1e9 bytes moved.
#[derive(Debug, Clone, Serialize)]
pub struct RawResult {
    /// `uring` or `pread`.
    pub engine: String,
    /// io_uring queue depth (unused by pread).
    pub queue_depth: u32,
    /// I/Os per `write_batch` / `read_batch` call.
    pub batch_ios: usize,
    /// Distinct pool buffers the I/Os cycle through.
    pub ring_buffers: u64,
    /// Bytes per I/O (one object).
    pub io_bytes: u64,
    /// Bytes written, then read.
    pub bytes: u64,
    /// Sequential write rate (without the final fdatasync).
    pub write_gbps: f64,
    /// Sequential read rate.
    pub read_gbps: f64,
    /// Seconds of the write pass.
    pub write_s: f64,
    /// Seconds of the fdatasync after it.
    pub sync_s: f64,
    /// Seconds of the read pass.
    pub read_s: f64,
    /// CPU seconds per GB written.
    pub write_cpu_s_per_gb: f64,
    /// CPU seconds per GB read.
    pub read_cpu_s_per_gb: f64,
}

/// `len` deterministic pseudo-random bytes (xorshift64 from `seed`, which must not be 0).
pub fn pseudo_random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let mut x = seed;
    for w in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes()[..w.len()]);
    }
    out
}

/// Rate in 1e9 bytes per second (0 for an empty interval).
pub fn gbps(bytes: u64, d: Duration) -> f64 {
    if d.is_zero() {
        0.0
    } else {
        bytes as f64 / d.as_secs_f64() / 1e9
    }
}

/// CPU seconds per 1e9 bytes (0 when nothing moved).
pub fn cpu_per_gb(cpu_s: f64, bytes: u64) -> f64 {
    if bytes == 0 {
        0.0
    } else {
        cpu_s / (bytes as f64 / 1e9)
    }
}

fn cpu_now() -> f64 {
    kvnode_hw::process_cpu_seconds().unwrap_or(0.0)
}

/// A scratch file on the disk under test, opened `O_DIRECT`, with a small pool of reused
/// buffers and one block engine: the raw device path every node figure is compared with.
/// The file is removed (and the pool's registration released) on drop.
pub struct RawFile {
    engine: Box<dyn BlockEngine>,
    pool: Arc<SharedPool>,
    path: std::path::PathBuf,
    kind: EngineKind,
    object_bytes: u64,
    objects: u64,
    /// Distinct pool buffers the I/Os cycle through (>= 1).
    ring: u64,
}

impl RawFile {
    /// Creates `name` in `dir` with room for `objects` objects of `object_bytes`, preallocated
    /// like the node's data file, and fills the buffers with a non-zero pattern (so nothing on
    /// the way can shortcut zero blocks). Buffers: `max_batch`, but at most `ring_bytes`.
    #[allow(clippy::too_many_arguments)]
    pub fn create(
        dir: &Path,
        name: &str,
        kind: EngineKind,
        object_bytes: u64,
        objects: u64,
        max_batch: usize,
        ring_bytes: u64,
        queue_depth: u32,
    ) -> Result<RawFile, String> {
        let ring = (ring_bytes / object_bytes).clamp(1, max_batch.max(1) as u64);
        let pool = SharedPool::create(&PoolOptions {
            bytes: ring * object_bytes,
            prefer: PagePreference::Huge2M,
            prefault: true,
            name: "kvnode-bench-raw".into(),
            posix_shm_name: None,
            segment_bind_mount: false,
            cancel: None,
        })
        .map_err(|e| format!("raw baseline pool: {e}"))?;
        let pattern = pseudo_random_bytes(object_bytes as usize, 0x2545_F491_4F6C_DD1D);
        for i in 0..ring {
            pool.region()
                .write_at(i * object_bytes, &pattern)
                .map_err(|e| e.to_string())?;
        }
        let path = dir.join(name);
        let _ = std::fs::remove_file(&path);
        let file = kvnode_hw::open_direct(&path, objects * object_bytes)
            .map_err(|e| format!("opening {}: {e}", path.display()))?;
        let pool = Arc::new(pool);
        let engine = kvnode_hw::open_engine(Some(kind), pool.clone(), file, queue_depth)
            .map_err(|e| format!("{kind} engine: {e}"))?;
        Ok(RawFile {
            engine,
            pool,
            path,
            kind,
            object_bytes,
            objects,
            ring,
        })
    }

    /// I/Os per call: no buffer is used twice within one batch.
    pub fn max_batch(&self) -> usize {
        self.ring as usize
    }

    /// Writes (or reads) objects `[first, first + count)` in order, `batch` I/Os per engine call
    /// (clamped to [`RawFile::max_batch`]); returns the time it took.
    pub fn pass(
        &self,
        write: bool,
        first: u64,
        count: u64,
        batch: usize,
    ) -> Result<Duration, String> {
        self.pass_then(write, first, count, batch, false)
    }

    /// [`RawFile::pass`]; with `checksum`, reads also compute the node's payload checksum of
    /// each object as its read completes (the work a node's L2 load must do before serving it).
    pub fn pass_then(
        &self,
        write: bool,
        first: u64,
        count: u64,
        batch: usize,
        checksum: bool,
    ) -> Result<Duration, String> {
        let end = (first + count).min(self.objects);
        let batch = batch.clamp(1, self.max_batch());
        let mut ios = Vec::with_capacity(batch);
        let mut next = first;
        let t0 = Instant::now();
        while next < end {
            ios.clear();
            while ios.len() < batch && next < end {
                ios.push(BlockIo {
                    pool_offset: (next % self.ring) * self.object_bytes,
                    file_offset: next * self.object_bytes,
                    len: self.object_bytes,
                });
                next += 1;
            }
            let results = if write {
                self.engine.write_batch(&ios)
            } else if checksum {
                let pool = &self.pool;
                self.engine.read_batch_then(&ios, &|j| {
                    let io = &ios[j];
                    let sum = pool.region().with_bytes(
                        io.pool_offset,
                        io.len,
                        kvnode::l2::format::payload_checksum,
                    );
                    std::hint::black_box(sum.ok());
                })
            } else {
                self.engine.read_batch(&ios)
            };
            for (io, r) in ios.iter().zip(results) {
                if let Err(e) = r {
                    return Err(format!(
                        "raw {} {} at file offset {}: {e}",
                        self.kind,
                        if write { "write" } else { "read" },
                        io.file_offset
                    ));
                }
            }
        }
        Ok(t0.elapsed())
    }

    /// `fdatasync` of the file; returns the time it took.
    pub fn sync(&self) -> Result<Duration, String> {
        let t = Instant::now();
        self.engine
            .sync()
            .map_err(|e| format!("raw fdatasync: {e}"))?;
        Ok(t.elapsed())
    }
}

impl Drop for RawFile {
    fn drop(&mut self) {
        // Unpin the buffers now: left to the kernel's asynchronous ring teardown, the hugepages
        // stay pinned for a while and the node started next would not get its pool on them.
        self.engine.release();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Writes `total` bytes as objects of `object_bytes` to a fresh scratch file in `dir`
/// (preallocated like the node's data file), reads them back, and removes the file. Reads come
/// from the device: the file is opened `O_DIRECT` and every block was written first (reads of
/// never-written preallocated blocks would not touch the device).
pub fn raw_baseline(
    dir: &Path,
    kind: EngineKind,
    object_bytes: u64,
    total: u64,
    batch: usize,
    queue_depth: u32,
) -> Result<RawResult, String> {
    let objects = total / object_bytes;
    let raw = RawFile::create(
        dir,
        &format!("raw-{kind}.dat"),
        kind,
        object_bytes,
        objects,
        batch,
        RING_BYTES,
        queue_depth,
    )?;
    let batch_ios = raw.max_batch();
    let bytes = objects * object_bytes;
    let c0 = cpu_now();
    let write = raw.pass(true, 0, objects, batch_ios)?;
    let c1 = cpu_now();
    let sync = raw.sync()?;
    let c2 = cpu_now();
    let read = raw.pass(false, 0, objects, batch_ios)?;
    let c3 = cpu_now();
    Ok(RawResult {
        engine: kind.as_str().into(),
        queue_depth,
        batch_ios,
        ring_buffers: raw.ring,
        io_bytes: object_bytes,
        bytes,
        write_gbps: gbps(bytes, write),
        read_gbps: gbps(bytes, read),
        write_s: write.as_secs_f64(),
        sync_s: sync.as_secs_f64(),
        read_s: read.as_secs_f64(),
        write_cpu_s_per_gb: cpu_per_gb(c1 - c0, bytes),
        read_cpu_s_per_gb: cpu_per_gb(c3 - c2, bytes),
    })
}

/// Clock ticks per second of `/proc/<pid>/stat` times (`getconf CLK_TCK`, 100 if unknown).
pub fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|t| *t > 0.0)
        .unwrap_or(100.0)
}

/// User + system CPU seconds of process `pid` (all its threads), from `/proc/<pid>/stat`;
/// resolution one clock tick (`ticks` per second). `None` if the process is gone.
pub fn process_cpu_seconds_of(pid: u32, ticks: f64) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses: fields resume after the
    // last ')'. There, index 0 is field 3 (state); utime and stime are fields 14 and 15.
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) as f64 / ticks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_cpu_time_is_readable() {
        let ticks = clock_ticks();
        assert!(ticks > 0.0);
        let me = process_cpu_seconds_of(std::process::id(), ticks).unwrap();
        assert!(me >= 0.0);
        assert!(process_cpu_seconds_of(u32::MAX, ticks).is_none());
    }

    #[test]
    fn raw_baseline_small() {
        let dir = std::env::temp_dir().join(format!("kvnode-bench-raw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for kind in [EngineKind::Pread, EngineKind::Uring] {
            match raw_baseline(&dir, kind, 256 << 10, 4 << 20, 8, 8) {
                Ok(r) => {
                    assert_eq!(r.bytes, 4 << 20);
                    assert_eq!(r.batch_ios, 8);
                    assert!(r.write_gbps > 0.0 && r.read_gbps > 0.0, "{r:?}");
                }
                // Some file systems (tmpfs) refuse O_DIRECT; io_uring may be disabled.
                Err(e) => eprintln!("raw baseline {kind} unavailable here: {e}"),
            }
        }
        assert!(
            std::fs::read_dir(&dir).unwrap().next().is_none(),
            "scratch file left"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
