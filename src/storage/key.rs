//! Object keys: LMCache's `ObjectKey` (public, validated) and the compact interned key the index uses.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use parking_lot::RwLock;

use crate::clock::Clock;

use crate::error::{Error, Result};
use crate::hashing::ChunkHash;

/// Longest accepted `cache_salt` (LMCache: 128 characters).
pub const MAX_SALT_CHARS: usize = 128;
/// Longest accepted model name (kvnode's own limit; LMCache has none).
pub const MAX_MODEL_NAME_BYTES: usize = 256;
/// Default limit on `(model, cache_salt)` namespaces held at once (`limits.max_namespaces`).
pub const MAX_NAMESPACES: usize = 4096;
/// Largest world size a `kv_rank` can encode (8 bits).
pub const MAX_WORLD_SIZE: u32 = 255;

/// Packs LMCache's `kv_rank`: `(world_size << 24) | (global_rank << 16) | (local_world_size << 8) | local_rank`,
/// with `local_world_size = world_size` and `local_rank = global_rank = worker_id` as the MP server does.
/// Invariant: `worker_id < world_size <= 255`, checked by [`validate_rank`].
pub fn pack_kv_rank(world_size: u32, worker_id: u32) -> u32 {
    (world_size << 24) | (worker_id << 16) | (world_size << 8) | worker_id
}

/// Checks that a `(world_size, worker_id)` pair fits the `kv_rank` packing.
pub fn validate_rank(world_size: u32, worker_id: u32) -> Result<()> {
    if world_size == 0 || world_size > MAX_WORLD_SIZE {
        return Err(Error::invalid(format!(
            "world_size {world_size} outside 1..={MAX_WORLD_SIZE}"
        )));
    }
    if worker_id >= world_size {
        return Err(Error::invalid(format!(
            "worker_id {worker_id} not below world_size {world_size}"
        )));
    }
    Ok(())
}

/// Checks LMCache's model-name rule: non-empty, no `@` (it separates key fields in L2 names).
pub fn validate_model_name(model: &str) -> Result<()> {
    if model.is_empty() || model.len() > MAX_MODEL_NAME_BYTES {
        return Err(Error::invalid(format!(
            "model name must be 1..={MAX_MODEL_NAME_BYTES} bytes, got {}",
            model.len()
        )));
    }
    if model.contains('@') {
        return Err(Error::invalid(format!("model name {model:?} contains '@'")));
    }
    Ok(())
}

/// Checks LMCache's salt rule: at most 128 characters, none of `@ / \ NUL`.
pub fn validate_salt(salt: &str) -> Result<()> {
    if salt.chars().count() > MAX_SALT_CHARS {
        return Err(Error::invalid(format!(
            "cache_salt longer than {MAX_SALT_CHARS} characters"
        )));
    }
    if salt.chars().any(|c| matches!(c, '@' | '/' | '\\' | '\0')) {
        return Err(Error::invalid(format!(
            "cache_salt {salt:?} contains one of '@', '/', '\\', NUL"
        )));
    }
    Ok(())
}

/// LMCache's `ObjectKey`. Invariant (after [`ObjectKey::new`]): model and salt pass validation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ObjectKey {
    /// Rolling chunk digest.
    pub chunk_hash: ChunkHash,
    /// Model name.
    pub model: String,
    /// Packed rank, see [`pack_kv_rank`].
    pub kv_rank: u32,
    /// Object group (hybrid models); 0 for the engine-driven path.
    pub object_group: u32,
    /// Per-tenant isolation salt.
    pub cache_salt: String,
}

impl ObjectKey {
    /// Builds a validated key.
    pub fn new(
        chunk_hash: ChunkHash,
        model: &str,
        kv_rank: u32,
        object_group: u32,
        cache_salt: &str,
    ) -> Result<ObjectKey> {
        validate_model_name(model)?;
        validate_salt(cache_salt)?;
        Ok(ObjectKey {
            chunk_hash,
            model: model.to_owned(),
            kv_rank,
            object_group,
            cache_salt: cache_salt.to_owned(),
        })
    }
}

/// Interned id of a `(model, cache_salt)` pair. Invariant: issued by one [`Namespaces`] table
/// and never reused for a different pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NamespaceId(pub u64);

/// The index key: an [`ObjectKey`] with model and salt interned. `Copy`, 48 bytes, hashed from
/// the (already uniformly random) chunk digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct StorageKey {
    /// Rolling chunk digest.
    pub chunk_hash: ChunkHash,
    /// Packed rank.
    pub kv_rank: u32,
    /// Object group.
    pub object_group: u32,
    /// Interned `(model, cache_salt)`.
    pub namespace: NamespaceId,
}

impl StorageKey {
    /// A 64-bit fingerprint for shard selection and hashing: digest bits mixed with the other fields.
    pub fn fingerprint(&self) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.chunk_hash[..8]);
        let h = u64::from_le_bytes(b);
        let extra = (u64::from(self.kv_rank) << 32)
            ^ (u64::from(self.object_group) << 16)
            ^ self.namespace.0;
        (h ^ extra.wrapping_mul(0x9E37_79B9_7F4A_7C15)).rotate_left(17)
    }
}

/// Interning table for `(model, cache_salt)` pairs. Invariants: an id is never issued twice
/// (64-bit ids only grow, so a key that outlives its namespace can never alias another one); at most
/// `limit` namespaces are interned at once; a namespace is dropped only by [`Namespaces::reclaim`],
/// when nothing uses it and no request named it within the grace.
pub struct Namespaces {
    inner: RwLock<NamespaceTable>,
    clock: OnceLock<Clock>,
    limit: AtomicUsize,
    reclaim_wanted: AtomicBool,
    reclaimed: AtomicU64,
}

impl Default for Namespaces {
    fn default() -> Self {
        Namespaces {
            inner: RwLock::default(),
            clock: OnceLock::new(),
            limit: AtomicUsize::new(MAX_NAMESPACES),
            reclaim_wanted: AtomicBool::new(false),
            reclaimed: AtomicU64::new(0),
        }
    }
}

struct NamespaceEntry {
    id: NamespaceId,
    /// Clock time of the last intern (a request about to store under it).
    last_used_ms: AtomicU64,
}

#[derive(Default)]
struct NamespaceTable {
    /// model -> salt -> entry (nested so lookups borrow `&str` without allocating).
    ids: HashMap<String, HashMap<String, NamespaceEntry>>,
    names: HashMap<u64, (String, String)>,
    next_id: u64,
}

impl Namespaces {
    /// Sets the clock that stamps interns and the most namespaces held at once (called once,
    /// when the node's context is built; before that, stamps are 0).
    pub fn configure(&self, clock: &Clock, limit: usize) {
        let _ = self.clock.set(clock.clone());
        self.limit.store(limit, Ordering::Relaxed);
    }

    fn now_ms(&self) -> u64 {
        self.clock.get().map_or(0, Clock::now_ms)
    }

    /// The id of `(model, salt)`, interning it on first use (for a request that will store
    /// under it). Validates both names; refused when `limit` namespaces are held (a reclaim is
    /// then requested).
    pub fn intern(&self, model: &str, salt: &str) -> Result<NamespaceId> {
        self.intern_with(model, salt, true)
    }

    /// [`Namespaces::intern`] without the limit, for objects found on disk at start-up: they
    /// exist already, so refusing their namespace would only lose them. (While more than the
    /// limit are held, new namespaces are refused until reclaims bring the count down.)
    pub fn intern_recovered(&self, model: &str, salt: &str) -> Result<NamespaceId> {
        self.intern_with(model, salt, false)
    }

    fn intern_with(&self, model: &str, salt: &str, bounded: bool) -> Result<NamespaceId> {
        let now = self.now_ms();
        {
            let t = self.inner.read();
            if let Some(e) = t.ids.get(model).and_then(|m| m.get(salt)) {
                e.last_used_ms.fetch_max(now, Ordering::Relaxed);
                return Ok(e.id);
            }
        }
        validate_model_name(model)?;
        validate_salt(salt)?;
        let mut t = self.inner.write();
        if let Some(e) = t.ids.get(model).and_then(|m| m.get(salt)) {
            e.last_used_ms.fetch_max(now, Ordering::Relaxed);
            return Ok(e.id);
        }
        let limit = self.limit.load(Ordering::Relaxed);
        if bounded && t.names.len() >= limit {
            self.reclaim_wanted.store(true, Ordering::Relaxed);
            return Err(Error::limit(format!(
                "{limit} distinct (model, cache_salt) pairs are in use (the limit); \
                 ({model:?}, {salt:?}) is refused until some are no longer used"
            )));
        }
        let id = NamespaceId(t.next_id);
        t.next_id += 1;
        t.names.insert(id.0, (model.to_owned(), salt.to_owned()));
        t.ids.entry(model.to_owned()).or_default().insert(
            salt.to_owned(),
            NamespaceEntry {
                id,
                last_used_ms: AtomicU64::new(now),
            },
        );
        Ok(id)
    }

    /// The id of `(model, salt)` if interned (lookups and retrieves: an unknown namespace holds
    /// nothing, so it is a miss, never an insertion).
    pub fn lookup(&self, model: &str, salt: &str) -> Option<NamespaceId> {
        let t = self.inner.read();
        t.ids.get(model).and_then(|m| m.get(salt)).map(|e| e.id)
    }

    /// Number of interned namespaces.
    pub fn len(&self) -> usize {
        self.inner.read().names.len()
    }

    /// Whether no namespace is interned.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Namespaces reclaimed since start-up.
    pub fn reclaimed(&self) -> u64 {
        self.reclaimed.load(Ordering::Relaxed)
    }

    /// The most namespaces held at once.
    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// Whether an intern was refused at the limit since the last call (the maintenance thread
    /// then reclaims soon).
    pub fn take_reclaim_wanted(&self) -> bool {
        self.reclaim_wanted.swap(false, Ordering::Relaxed)
    }

    /// The `(model, salt)` behind an id (`None` once reclaimed).
    pub fn name(&self, id: NamespaceId) -> Option<(String, String)> {
        self.inner.read().names.get(&id.0).cloned()
    }

    /// Drops every namespace that is not in `in_use` and was not interned within `grace_ms` of
    /// `now_ms` (a request between its intern and its store). `in_use` must list everything
    /// that holds an id (objects in every tier, instances, sessions), gathered before this call.
    /// Returns how many were dropped.
    pub fn reclaim(&self, in_use: &HashSet<NamespaceId>, now_ms: u64, grace_ms: u64) -> usize {
        let cutoff = now_ms.saturating_sub(grace_ms);
        let mut t = self.inner.write();
        let mut dropped = Vec::new();
        for salts in t.ids.values_mut() {
            salts.retain(|_, e| {
                let keep =
                    in_use.contains(&e.id) || e.last_used_ms.load(Ordering::Relaxed) >= cutoff;
                if !keep {
                    dropped.push(e.id);
                }
                keep
            });
        }
        t.ids.retain(|_, m| !m.is_empty());
        for id in &dropped {
            t.names.remove(&id.0);
        }
        self.reclaimed
            .fetch_add(dropped.len() as u64, Ordering::Relaxed);
        dropped.len()
    }

    /// Converts a public key into the index key.
    pub fn storage_key(&self, key: &ObjectKey) -> Result<StorageKey> {
        Ok(StorageKey {
            chunk_hash: key.chunk_hash,
            kv_rank: key.kv_rank,
            object_group: key.object_group,
            namespace: self.intern(&key.model, &key.cache_salt)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_rank_packing_matches_lmcache() {
        assert_eq!(pack_kv_rank(1, 0), 0x0100_0100);
        assert_eq!(pack_kv_rank(1, 0), 16_777_472);
        assert_eq!(pack_kv_rank(4, 2), 0x0402_0402);
        assert_eq!(pack_kv_rank(4, 2), 67_240_962);
        assert!(validate_rank(4, 4).is_err());
        assert!(validate_rank(0, 0).is_err());
        assert!(validate_rank(256, 0).is_err());
        assert!(validate_rank(255, 254).is_ok());
    }

    #[test]
    fn key_validation_rules() {
        let h = [7u8; 32];
        assert!(ObjectKey::new(h, "llama", 1, 0, "").is_ok());
        assert!(ObjectKey::new(h, "ll@ma", 1, 0, "").is_err());
        assert!(ObjectKey::new(h, "", 1, 0, "").is_err());
        for bad in ["a@b", "a/b", "a\\b", "a\0b"] {
            assert!(ObjectKey::new(h, "m", 1, 0, bad).is_err(), "{bad:?}");
        }
        assert!(ObjectKey::new(h, "m", 1, 0, &"s".repeat(128)).is_ok());
        assert!(ObjectKey::new(h, "m", 1, 0, &"s".repeat(129)).is_err());
    }

    #[test]
    fn interning_is_stable_and_salt_isolates() {
        let ns = Namespaces::default();
        let a = ns.intern("m", "").unwrap();
        let b = ns.intern("m", "tenant").unwrap();
        assert_ne!(a, b);
        assert_eq!(ns.intern("m", "").unwrap(), a);
        assert_eq!(ns.name(b).unwrap(), ("m".to_owned(), "tenant".to_owned()));
        assert!(ns.intern("bad@model", "").is_err());
    }
}
