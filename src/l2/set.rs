//! [`L2Set`]: the L2 tier over one or more devices. Each device is an independent
//! [`L2Tier`] (its own data file, engines, index, write-behind queue and writer thread); an
//! object lives on the device its key hashes to, so devices add capacity and bandwidth without
//! sharing any lock. Devices receive keys in proportion to their sizes (weighted rendezvous
//! hashing), so a small device does not fill and evict while a big one has room.

use std::sync::Arc;

use kvnode_hw::{BlockEngine, SharedPool};
use serde::Serialize;

use super::iowatch::IoWatch;
use super::tier::{L2Status, L2Tier, OpenFailure, STAGING_BYTES};
use crate::config::{L2Config, WritePolicy};
use crate::error::Result;
use crate::storage::{Layout, Namespaces, StorageCore, StorageKey};

/// The device a key is written to, of devices with capacities `weights` (bytes; at least one
/// device): weighted rendezvous hashing, so each device receives keys in proportion to its
/// capacity, and adding a device moves only the keys that now belong to it (about
/// `new / total` of them). Uses only what a key is made of on disk (chunk hash, rank, group),
/// never the namespace id, which is assigned per run: a key maps to the same device after a
/// restart with the same devices.
fn device_for(key: &StorageKey, weights: &[u64]) -> usize {
    let mut b = [0u8; 8];
    b.copy_from_slice(&key.chunk_hash[16..24]);
    let k = u64::from_le_bytes(b)
        ^ u64::from(key.kv_rank).rotate_left(17)
        ^ u64::from(key.object_group).rotate_left(41);
    let mut best = (0usize, f64::NEG_INFINITY);
    for (d, &w) in weights.iter().enumerate() {
        // A uniform draw strictly inside (0, 1) per (key, device), so ln(u) < 0 and the
        // score -w / ln(u) is positive and finite; the largest score wins.
        let h = mix64(k ^ (d as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let score = -(w.max(1) as f64) / u.ln();
        if score > best.1 {
            best = (d, score);
        }
    }
    best.0
}

/// splitmix64's finalizer: a bijective mix of all 64 bits.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The STATUS `l2` object: totals over the devices (same fields as one device) and, with more
/// than one device, each device's own figures.
#[derive(Debug, Clone, Serialize)]
pub struct L2SetStatus {
    /// Totals; `path` lists the devices, comma-separated.
    #[serde(flatten)]
    pub total: L2Status,
    /// Per device, in `--l2-path` order (empty with a single device).
    pub devices: Vec<L2Status>,
    /// Devices left out at start-up because they failed (an I/O error reading or writing their
    /// superblocks or headers): path and error. The node runs without them.
    pub failed_devices: Vec<FailedDevice>,
}

/// A device left out at start-up. Invariant: it failed with an I/O error, not a refusal.
#[derive(Debug, Clone, Serialize)]
pub struct FailedDevice {
    /// The configured path.
    pub path: String,
    /// Why it failed.
    pub error: String,
}

/// The devices. Invariant: at least one; device `i` owns staging blocks
/// `[staging_base + i * STAGING_BYTES, +STAGING_BYTES)` of the pool; a key always maps to the
/// same device (by [`device_for`] over `weights`, one per tier).
pub struct L2Set {
    tiers: Vec<L2Tier>,
    failed: Vec<FailedDevice>,
    weights: Vec<u64>,
    /// The I/O workers that run loads and CLEAR's superblock writes for request threads.
    workers: super::loader::Workers,
}

impl L2Set {
    /// Pool bytes the set needs for staging headers.
    pub fn staging_bytes(cfg: &L2Config) -> u64 {
        STAGING_BYTES * cfg.paths.len().max(1) as u64
    }

    /// Opens (recovering) every device of `cfg.paths`; `staging_base` is the pool offset of
    /// [`L2Set::staging_bytes`] reserved for the set. A device that is refused (another
    /// program's data, in use, a size that does not fit) stops the start-up with the reason; a
    /// device that fails (I/O errors on its superblocks or headers) is left out, logged and
    /// listed in STATUS, and the node runs on the others — or, when every device failed, without
    /// L2 (`Ok(None)`): a broken disk never takes L1 down with it.
    pub fn open(
        cfg: &L2Config,
        pool: Arc<SharedPool>,
        staging_base: u64,
        namespaces: &Arc<Namespaces>,
    ) -> Result<Option<L2Set>> {
        Self::open_wrapped(cfg, pool, staging_base, namespaces, Arc::new(|e| e))
    }

    /// [`L2Set::open`] with each block engine passed through `wrap` (fault-injection tests).
    ///
    /// Each device is opened on a thread of its own, watched: a device call that runs past
    /// `l2.io_timeout_ms` (plus its bytes at 64 MiB/s) leaves that device out (listed in
    /// `failed_devices`) and the start-up goes on without it, however long a healthy recovery
    /// takes. The thread stays blocked in the kernel until the device answers, then drops what
    /// it opened.
    pub fn open_wrapped(
        cfg: &L2Config,
        pool: Arc<SharedPool>,
        staging_base: u64,
        namespaces: &Arc<Namespaces>,
        wrap: Wrap,
    ) -> Result<Option<L2Set>> {
        if cfg.paths.is_empty() {
            return Err(crate::error::Error::invalid(
                "an L2 tier needs at least one path",
            ));
        }
        let mut tiers = Vec::new();
        let mut failed = Vec::new();
        for (i, p) in cfg.paths.iter().enumerate() {
            let opened = open_device_watched(
                cfg,
                p,
                pool.clone(),
                staging_base + i as u64 * STAGING_BYTES,
                namespaces,
                &wrap,
            );
            match opened {
                Ok(t) => tiers.push(t),
                Err(OpenFailure::Refused(e)) => {
                    return Err(e.context(format!("L2 device {}", p.display())))
                }
                Err(OpenFailure::Failed(e)) => {
                    tracing::error!(
                        path = %p.display(),
                        error = %e,
                        "L2 device failed at start-up: the node runs without it"
                    );
                    failed.push(FailedDevice {
                        path: p.display().to_string(),
                        error: e.to_string(),
                    });
                }
            }
        }
        if tiers.is_empty() {
            tracing::error!("every L2 device failed at start-up: the node runs without L2");
            return Ok(None);
        }
        // One prefetch budget for the node, however many devices.
        let budget = tiers[0].prefetch_budget();
        for t in &tiers[1..] {
            t.share_prefetch_budget(&budget);
        }
        let weights = tiers.iter().map(L2Tier::bytes).collect();
        Ok(Some(L2Set {
            tiers,
            failed,
            weights,
            workers: super::loader::Workers::default(),
        }))
    }

    /// A set of already opened devices (tests).
    #[cfg(test)]
    pub(crate) fn from_tiers(tiers: Vec<L2Tier>) -> L2Set {
        let weights = tiers.iter().map(L2Tier::bytes).collect();
        L2Set {
            tiers,
            failed: Vec::new(),
            weights,
            workers: super::loader::Workers::default(),
        }
    }

    /// The I/O workers' queue (see [`super::loader`]).
    pub fn workers(&self) -> &super::loader::Workers {
        &self.workers
    }

    /// The longest `l2.io_timeout_ms` of the devices (they share one configuration).
    fn io_timeout(&self) -> std::time::Duration {
        self.tiers
            .iter()
            .map(L2Tier::io_timeout)
            .max()
            .unwrap_or_default()
    }

    /// The devices, in configuration order.
    pub fn tiers(&self) -> &[L2Tier] {
        &self.tiers
    }

    fn device_of(&self, key: &StorageKey) -> usize {
        device_for(key, &self.weights)
    }

    /// The write policy in force.
    pub fn policy(&self) -> WritePolicy {
        self.tiers[0].policy()
    }

    /// Whether `key` is readable from L2.
    pub fn contains(&self, key: &StorageKey) -> bool {
        self.holder_of(key).is_some()
    }

    /// Whether L2 holds `key` as the object of length `len` committed under layout fingerprint
    /// `layout` (see [`L2Tier::holds_as`]).
    pub fn holds_as(&self, key: &StorageKey, len: u64, layout: u64) -> bool {
        self.holder_of(key)
            .is_some_and(|d| self.tiers[d].holds_as(key, len, layout))
    }

    /// [`L2Set::holds_as`] for each of `keys` (all of length `len`, layout `layout`), taking
    /// each device's index lock once rather than once per key (the commit path).
    pub fn held_as(&self, keys: &[StorageKey], len: u64, layout: u64) -> Vec<bool> {
        if let [one] = self.tiers.as_slice() {
            return one.held_as(keys, len, layout);
        }
        keys.iter().map(|k| self.holds_as(k, len, layout)).collect()
    }

    /// The device holding `key`: the one it hashes to, else any other (after a restart with
    /// the paths in another order or count, objects stay where they were written and are
    /// still found; new writes go to the device the key hashes to now).
    fn holder_of(&self, key: &StorageKey) -> Option<usize> {
        let routed = self.device_of(key);
        if self.tiers[routed].contains(key) {
            return Some(routed);
        }
        (0..self.tiers.len()).find(|&d| d != routed && self.tiers[d].contains(key))
    }

    /// Queues committed keys for write-behind on their devices; returns the keys that did not
    /// fit (not to be written).
    pub fn enqueue(&self, keys: impl IntoIterator<Item = StorageKey>) -> Vec<StorageKey> {
        if let [one] = self.tiers.as_slice() {
            return one.queue.push(keys);
        }
        let mut per: Vec<Vec<StorageKey>> = vec![Vec::new(); self.tiers.len()];
        for k in keys {
            per[self.device_of(&k)].push(k);
        }
        let mut refused = Vec::new();
        for (t, keys) in self.tiers.iter().zip(per) {
            if !keys.is_empty() {
                refused.extend(t.queue.push(keys));
            }
        }
        refused
    }

    /// [`L2Tier::persist`] on each key's device; returns the number written.
    pub fn persist(
        &self,
        storage: &StorageCore,
        namespaces: &Namespaces,
        keys: &[StorageKey],
    ) -> u64 {
        self.split(keys)
            .into_iter()
            .zip(&self.tiers)
            .map(|(idx, t)| {
                let ks: Vec<StorageKey> = idx.iter().map(|&i| keys[i]).collect();
                if ks.is_empty() {
                    0
                } else {
                    t.persist(storage, namespaces, &ks)
                }
            })
            .sum()
    }

    /// [`L2Set::load_now`] run by an I/O worker when the workers run, waited for at most
    /// `l2.io_timeout_ms`: a device that does not answer costs this request misses (counted as
    /// `stalled`), never its thread; the worker releases what the load took when the device
    /// answers. Keys on a device already stuck miss at once.
    pub fn load(
        &self,
        storage: &StorageCore,
        keys: &[StorageKey],
        extra: u32,
        expected: Option<&Layout>,
    ) -> Vec<Option<u64>> {
        let usable = if self.tiers.iter().any(L2Tier::stuck) {
            keys.iter()
                .position(|k| {
                    let d = self.holder_of(k).unwrap_or_else(|| self.device_of(k));
                    self.tiers[d].stuck()
                })
                .unwrap_or(keys.len())
        } else {
            keys.len()
        };
        if usable < keys.len() {
            self.tiers[0].count_stalled((keys.len() - usable) as u64);
        }
        let mut out = vec![None; keys.len()];
        if usable == 0 {
            return out;
        }
        let keys_now = &keys[..usable];
        let reply = match self.workers.load(keys_now, extra, expected) {
            Ok(r) => r,
            Err(super::loader::NotQueued::NoWorkers) => {
                return self.load_now(storage, keys, extra, expected);
            }
            Err(super::loader::NotQueued::Full) => {
                self.tiers[0].count_stalled(usable as u64);
                return out;
            }
        };
        match reply.wait_until(std::time::Instant::now() + self.io_timeout()) {
            Some(leases) => {
                for (o, l) in out.iter_mut().zip(leases) {
                    *o = l;
                }
            }
            None => {
                tracing::warn!(
                    keys = usable,
                    timeout_ms = self.io_timeout().as_millis() as u64,
                    "L2 load not answered in time: served as misses"
                );
                self.tiers[0].count_stalled(usable as u64);
            }
        }
        out
    }

    /// [`L2Tier::load`] over the devices, side by side when the keys span several, on this
    /// thread; results in the order of `keys`.
    pub fn load_now(
        &self,
        storage: &StorageCore,
        keys: &[StorageKey],
        extra: u32,
        expected: Option<&Layout>,
    ) -> Vec<Option<u64>> {
        if let [one] = self.tiers.as_slice() {
            return one.load(storage, keys, extra, expected);
        }
        let parts = self.split_held(keys);
        let busy = parts.iter().filter(|p| !p.is_empty()).count();
        let run = |t: &L2Tier, idx: &[usize]| {
            let ks: Vec<StorageKey> = idx.iter().map(|&i| keys[i]).collect();
            t.load(storage, &ks, extra, expected)
        };
        let results: Vec<Vec<Option<u64>>> = if busy <= 1 {
            self.tiers
                .iter()
                .zip(&parts)
                .map(|(t, idx)| {
                    if idx.is_empty() {
                        Vec::new()
                    } else {
                        run(t, idx)
                    }
                })
                .collect()
        } else {
            std::thread::scope(|s| {
                let hs: Vec<_> = self
                    .tiers
                    .iter()
                    .zip(&parts)
                    .map(|(t, idx)| (!idx.is_empty()).then(|| s.spawn(move || run(t, idx))))
                    .collect();
                hs.into_iter()
                    .map(|h| {
                        h.map_or_else(Vec::new, |h| {
                            h.join().unwrap_or_else(|_| {
                                tracing::error!("L2 device load panicked (bug): treated as misses");
                                Vec::new()
                            })
                        })
                    })
                    .collect()
            })
        };
        let mut out = vec![None; keys.len()];
        for (idx, res) in parts.iter().zip(results) {
            for (&i, r) in idx.iter().zip(res) {
                out[i] = r;
            }
        }
        out
    }

    /// Indices of `keys` per device they are written to.
    fn split(&self, keys: &[StorageKey]) -> Vec<Vec<usize>> {
        let mut per: Vec<Vec<usize>> = vec![Vec::new(); self.tiers.len()];
        for (i, k) in keys.iter().enumerate() {
            per[self.device_of(k)].push(i);
        }
        per
    }

    /// Indices of `keys` per device they are read from (see [`L2Set::contains`]).
    fn split_held(&self, keys: &[StorageKey]) -> Vec<Vec<usize>> {
        let mut per: Vec<Vec<usize>> = vec![Vec::new(); self.tiers.len()];
        for (i, k) in keys.iter().enumerate() {
            per[self.holder_of(k).unwrap_or_else(|| self.device_of(k))].push(i);
        }
        per
    }

    /// CLEAR of L1 (`clear_l1`) and every device: in memory with all devices' gates held at
    /// once (each device's exclusive section runs the next device's, the innermost runs
    /// `clear_l1`), none of which waits for a device; then each device's new format id is
    /// written, by the I/O workers when they run, waited for at most `l2.io_timeout_ms`. An
    /// error means the CLEAR took effect in memory but is not durable yet on some device (its
    /// STATUS shows `format_pending`; the writer retries).
    pub fn clear_with<T>(&self, clear_l1: impl FnOnce() -> T) -> Result<(T, (u64, u64))> {
        fn nested<T>(tiers: &[L2Tier], clear_l1: Box<dyn FnOnce() -> T + '_>) -> (T, (u64, u64)) {
            match tiers {
                [] => (clear_l1(), (0, 0)),
                [first, rest @ ..] => {
                    let (inner, (r0, d0)) = first.clear_in_memory(|| nested(rest, clear_l1));
                    let (l1, (r, d)) = inner;
                    (l1, (r0 + r, d0 + d))
                }
            }
        }
        let (l1, counts) = nested(&self.tiers, Box::new(clear_l1));
        let deadline = std::time::Instant::now() + self.io_timeout();
        let mut replies = Vec::new();
        for (d, t) in self.tiers.iter().enumerate() {
            match self.workers.persist_format(d) {
                Ok(r) => replies.push((d, r)),
                // No workers (tests, shutdown): on this thread.
                Err(super::loader::NotQueued::NoWorkers) if !t.stuck() => t.persist_format()?,
                // Workers all busy, or the device stuck: not waited for (the writer retries).
                Err(_) => replies.push((d, super::loader::Reply::abandoned())),
            }
        }
        for (d, r) in replies {
            match r.wait_until(deadline) {
                Some(done) => done?,
                None => {
                    return Err(crate::error::Error::new(
                        crate::error::ErrorKind::Io,
                        format!(
                            "L2 device {} did not answer within {} ms: emptied in memory, but \
                             the CLEAR is not durable there yet (written when the device \
                             answers; a restart before that would bring the cleared objects \
                             back)",
                            self.tiers[d].status().path,
                            self.io_timeout().as_millis()
                        ),
                    ))
                }
            }
        }
        Ok((l1, counts))
    }

    /// Adds the namespace of every key any device holds to `out` (the namespace reclaimer
    /// keeps them).
    pub fn namespaces_in_use(
        &self,
        out: &mut std::collections::HashSet<crate::storage::NamespaceId>,
    ) {
        for t in &self.tiers {
            t.namespaces_in_use(out);
        }
    }

    /// Index invariant check of every device (part of MEMCHECK).
    pub fn check(&self) -> std::result::Result<(), String> {
        for (i, t) in self.tiers.iter().enumerate() {
            t.check().map_err(|e| format!("device {i}: {e}"))?;
        }
        Ok(())
    }

    /// Ends the writes of every device and records a clean stop where it can (see
    /// [`L2Tier::checkpoint`]); a device whose checkpoint fails is read slot by slot at the
    /// next start. Returns how many devices were checkpointed.
    pub fn checkpoint(&self, namespaces: &crate::storage::Namespaces) -> usize {
        // The devices side by side: each writes its own tables.
        let results: Vec<Result<_>> = std::thread::scope(|scope| {
            let running: Vec<_> = self
                .tiers
                .iter()
                .map(|t| scope.spawn(move || t.checkpoint(namespaces)))
                .collect();
            running
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(crate::error::Error::new(
                            crate::error::ErrorKind::Internal,
                            "the checkpoint thread panicked",
                        ))
                    })
                })
                .collect()
        });
        let mut done = 0;
        for (t, r) in self.tiers.iter().zip(results) {
            match r {
                Ok(_) => done += 1,
                Err(e) => tracing::warn!(
                    path = %t.status().path,
                    error = %e,
                    "L2 stopped without a checkpoint: the next start reads every slot header"
                ),
            }
        }
        done
    }

    /// A time allowance for [`L2Set::checkpoint`] on a slow device: its table and header
    /// writes at 64 MiB/s, the devices side by side.
    pub fn checkpoint_allowance(&self) -> std::time::Duration {
        let bytes = self
            .tiers
            .iter()
            .map(L2Tier::checkpoint_bytes)
            .max()
            .unwrap_or(0);
        std::time::Duration::from_secs_f64(bytes as f64 / super::iowatch::SLOWEST_RATE as f64)
    }

    /// Releases every device's pool registrations (shutdown).
    pub fn release(&self) {
        self.tiers.iter().for_each(L2Tier::release);
    }

    /// The STATUS object.
    pub fn status(&self) -> L2SetStatus {
        let devices: Vec<L2Status> = self.tiers.iter().map(L2Tier::status).collect();
        let mut total = devices[0].clone();
        for d in &devices[1..] {
            total.path = format!("{},{}", total.path, d.path);
            total.bytes += d.bytes;
            total.used_bytes += d.used_bytes;
            total.objects += d.objects;
            total.hits += d.hits;
            total.writes += d.writes;
            total.errors += d.errors;
            total.corrupt += d.corrupt;
            total.torn += d.torn;
            total.clean_start &= d.clean_start;
            total.startup_blocks_read += d.startup_blocks_read;
            total.startup_ms = total.startup_ms.max(d.startup_ms);
            total.recovery_ms = total.recovery_ms.max(d.recovery_ms);
            total.evictions += d.evictions;
            total.skipped += d.skipped;
            total.bytes_written += d.bytes_written;
            total.bytes_read += d.bytes_read;
            total.recovered += d.recovered;
            total.queued += d.queued;
            total.index_bytes += d.index_bytes;
            total.index_limit_bytes += d.index_limit_bytes;
            total.index_max_objects += d.index_max_objects;
            total.unindexed += d.unindexed;
            total.stalled += d.stalled;
            total.stuck_ms = total.stuck_ms.max(d.stuck_ms);
            total.stuck |= d.stuck;
            total.format_pending |= d.format_pending;
        }
        L2SetStatus {
            total,
            devices: if self.tiers.len() > 1 {
                devices
            } else {
                Vec::new()
            },
            failed_devices: self.failed.clone(),
        }
    }
}

/// What fault-injection tests wrap every block engine in (the identity in production).
pub type Wrap = Arc<dyn Fn(Box<dyn BlockEngine>) -> Box<dyn BlockEngine> + Send + Sync>;

/// How often the start-up looks at a device's calls in progress.
const OPEN_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// Opens one device on a thread of its own and waits for it while its device calls keep
/// answering (see [`L2Set::open_wrapped`]).
fn open_device_watched(
    cfg: &L2Config,
    path: &std::path::Path,
    pool: Arc<SharedPool>,
    staging_base: u64,
    namespaces: &Arc<Namespaces>,
    wrap: &Wrap,
) -> std::result::Result<L2Tier, OpenFailure> {
    let io = Arc::new(IoWatch::default());
    let timeout = std::time::Duration::from_millis(cfg.io_timeout_ms);
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = {
        let (cfg, path, namespaces, wrap, io) = (
            cfg.clone(),
            path.to_path_buf(),
            namespaces.clone(),
            wrap.clone(),
            io.clone(),
        );
        std::thread::Builder::new()
            .name("kvnode-l2-open".into())
            .spawn(move || {
                let opened =
                    L2Tier::open_watched(&cfg, &path, pool, staging_base, &namespaces, &*wrap, &io);
                // Nobody listens once the device was left out: what was opened is dropped.
                let _ = tx.send(opened);
            })
    };
    if let Err(e) = spawned {
        return Err(OpenFailure::Failed(crate::error::Error::new(
            crate::error::ErrorKind::Internal,
            format!("no thread to open {}: {e}", path.display()),
        )));
    }
    loop {
        match rx.recv_timeout(OPEN_POLL) {
            Ok(opened) => return opened,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(OpenFailure::Failed(crate::error::Error::new(
                    crate::error::ErrorKind::Internal,
                    format!("opening {} panicked", path.display()),
                )))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) if io.overdue(timeout) => {
                // The thread carries on once the device answers: from now on it reads and
                // writes nothing (the pool's staging area may serve clients by then).
                io.abandon();
                return Err(OpenFailure::Failed(crate::error::Error::new(
                    crate::error::ErrorKind::Io,
                    format!(
                        "{} did not answer a device call within {} ms (l2.io_timeout_ms) at \
                         start-up: left out (the call stays with the kernel until the device \
                         answers)",
                        path.display(),
                        timeout.as_millis()
                    ),
                )));
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::NamespaceId;

    fn key(i: u32, ns: u32) -> StorageKey {
        let mut h = [0u8; 32];
        h[16..20].copy_from_slice(&i.to_le_bytes());
        StorageKey {
            chunk_hash: h,
            kv_rank: 0,
            object_group: 0,
            namespace: NamespaceId(u64::from(ns)),
        }
    }

    fn spread(weights: &[u64], keys: u32) -> Vec<u32> {
        let mut used = vec![0u32; weights.len()];
        for i in 0..keys {
            used[device_for(&key(i, 0), weights)] += 1;
        }
        used
    }

    #[test]
    fn devices_ignore_the_per_run_namespace_id_and_spread_keys() {
        let w = [1u64 << 30; 4];
        for i in 0..1000 {
            assert_eq!(device_for(&key(i, 0), &w), device_for(&key(i, 7), &w));
        }
        // Equal devices: within 10 % of an even share each.
        for n in spread(&w, 40_000) {
            assert!((9_000..=11_000).contains(&n), "{n}");
        }
        assert_eq!(device_for(&key(9, 0), &[5]), 0);
    }

    #[test]
    fn devices_receive_keys_in_proportion_to_their_capacity() {
        let used = spread(&[1 << 30, 3 << 30], 40_000);
        assert!((9_000..=11_000).contains(&used[0]), "{used:?}");
        assert!((29_000..=31_000).contains(&used[1]), "{used:?}");
    }

    #[test]
    fn adding_a_device_moves_only_the_keys_it_takes() {
        let (three, four) = ([1u64 << 30; 3], [1u64 << 30; 4]);
        let mut moved = 0;
        for i in 0..40_000 {
            let (a, b) = (
                device_for(&key(i, 0), &three),
                device_for(&key(i, 0), &four),
            );
            if a != b {
                assert_eq!(b, 3, "a key only ever moves to the new device");
                moved += 1;
            }
        }
        // About a quarter of the keys (the new device's share), not most of them as `% n` would.
        assert!((9_000..=11_000).contains(&moved), "{moved}");
    }
}
