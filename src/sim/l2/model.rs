//! The reference model: every version of every key the simulated engine stored, what the tier
//! claims to hold (and which of those claims a successful sync made durable), and the bounds
//! set by CLEARs. A load is judged against it: the bytes must be exactly those of a version of
//! that key, under the layout asked for, and not one stored before an acknowledged CLEAR.

use std::collections::BTreeMap;

use super::node::L1Object;
use super::payload::{checksum, describe, nth_layout, payload, SIZES};
use crate::storage::Layout;

/// One stored version of a key. Invariant: its layout is used by no other version of the key
/// (so a layout names a version), and `checksum` is that of `payload(key, v, len)`.
#[derive(Debug, Clone)]
pub struct Version {
    /// Global version number (increasing over the run).
    pub v: u64,
    /// The layout it was committed under.
    pub layout: Layout,
    /// xxh3 of its payload.
    pub checksum: u64,
}

impl Version {
    /// Payload length in bytes.
    pub fn bytes(&self) -> u64 {
        self.layout.object_bytes()
    }

    /// Layout fingerprint.
    pub fn fp(&self) -> u64 {
        self.layout.fingerprint()
    }
}

/// One key of the simulated engine. Invariant: `versions` ascend by `v`.
#[derive(Debug, Clone)]
pub struct KeyState {
    /// Its chunk hash (derived from the key's number).
    pub chunk_hash: [u8; 32],
    /// Every version made, oldest first.
    pub versions: Vec<Version>,
    /// The newest version stored into L1 (`None` before the first store).
    pub latest: Option<u64>,
    /// Versions made per size class (the next layout index of the class).
    per_class: [u64; SIZES.len()],
}

/// What the tier held of a key at the end of the last step. Invariant: `v` is a version of the
/// key; `(seq, offset)` name the slot header write the copy came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    /// The version held.
    pub v: u64,
    /// Sequence number of its slot header.
    pub seq: u64,
    /// File offset of its slot header.
    pub offset: u64,
    /// A successful sync returned since this very copy was written: acknowledged durable.
    pub synced: bool,
    /// Found at start-up rather than written by this run, and not durable before the restart:
    /// a sync acknowledges nothing about it (its payload may have been lost or overwritten
    /// before the restart; the tier only finds out when it loads it and the checksum fails).
    pub inherited: bool,
}

/// The model. Invariant: version numbers are never reused; `cleared_below` only grows.
pub struct Model {
    /// The keys, by number.
    pub keys: Vec<KeyState>,
    next_version: u64,
    /// Versions below this were made before an acknowledged CLEAR: never served again.
    pub cleared_below: u64,
    /// Versions below this were made before a CLEAR that failed to write its new format id:
    /// not served before the next restart (after it they may come back).
    pub soft_cleared_below: u64,
    /// What the tier holds, by key number.
    pub claims: BTreeMap<u32, Claim>,
}

fn chunk_hash(key: u32) -> [u8; 32] {
    let mut h = [0u8; 32];
    for (i, c) in h.chunks_mut(16).enumerate() {
        let x =
            xxhash_rust::xxh3::xxh3_128(&[key.to_le_bytes(), (i as u32).to_le_bytes()].concat());
        c.copy_from_slice(&x.to_le_bytes());
    }
    h
}

impl Model {
    /// A model of `keys` keys, none stored yet.
    pub fn new(keys: usize) -> Model {
        Model {
            keys: (0..keys as u32)
                .map(|k| KeyState {
                    chunk_hash: chunk_hash(k),
                    versions: Vec::new(),
                    latest: None,
                    per_class: [0; SIZES.len()],
                })
                .collect(),
            next_version: 1,
            cleared_below: 0,
            soft_cleared_below: 0,
            claims: BTreeMap::new(),
        }
    }

    /// Makes a new version of `key` in size class `class` (not stored yet); returns it and
    /// its payload.
    pub fn new_version(&mut self, key: u32, class: usize) -> (Version, Vec<u8>) {
        let v = self.next_version;
        self.next_version += 1;
        let k = &mut self.keys[key as usize];
        let layout = nth_layout(class, k.per_class[class]);
        k.per_class[class] += 1;
        let bytes = payload(key, v, layout.object_bytes());
        let ver = Version {
            v,
            layout,
            checksum: checksum(&bytes),
        };
        k.versions.push(ver.clone());
        (ver, bytes)
    }

    /// Version `v` of `key`.
    pub fn version(&self, key: u32, v: u64) -> &Version {
        let vs = &self.keys[key as usize].versions;
        let i = vs
            .binary_search_by_key(&v, |x| x.v)
            .expect("a version of the key");
        &vs[i]
    }

    /// The version of `key` committed under layout `fp` with length `len`, if any.
    pub fn by_layout(&self, key: u32, len: u64, fp: u64) -> Option<&Version> {
        self.keys[key as usize]
            .versions
            .iter()
            .find(|x| x.fp() == fp && x.bytes() == len)
    }

    /// The next version number (every version made so far is below it).
    pub fn next_version(&self) -> u64 {
        self.next_version
    }

    /// A CLEAR returned: `acknowledged` when its new format id is durable. Either way the
    /// tier holds nothing any more.
    pub fn on_clear(&mut self, acknowledged: bool) {
        if acknowledged {
            self.cleared_below = self.next_version;
        }
        self.soft_cleared_below = self.next_version;
        self.claims.clear();
        // The engine stores new versions from now on (a version made before the CLEAR is
        // never stored again, so "served after the CLEAR" always means "kept across it").
        for k in &mut self.keys {
            k.latest = None;
        }
    }

    /// The tier was opened again: a failed CLEAR's objects may come back now.
    pub fn on_reopen(&mut self) {
        self.soft_cleared_below = self.cleared_below;
    }

    /// Claims a successful sync made durable: every claim held now on a copy this run wrote.
    pub fn mark_synced(&mut self) {
        for c in self.claims.values_mut().filter(|c| !c.inherited) {
            c.synced = true;
        }
    }

    /// The claims acknowledged durable, by key.
    pub fn durable(&self) -> Vec<(u32, Claim)> {
        self.claims
            .iter()
            .filter(|(_, c)| c.synced)
            .map(|(k, c)| (*k, *c))
            .collect()
    }

    /// Judges the object `o` published in L1 for `key` (`expected`: the layout the load
    /// asked for); returns its version.
    pub fn check_served(
        &self,
        key: u32,
        expected: Option<u64>,
        o: &L1Object,
    ) -> Result<u64, String> {
        let (len, fp, sum) = (o.len, o.layout, o.checksum);
        let says = match o.head {
            Some((k, v, l)) => format!("the bytes are those of key {k} version {v} ({l} bytes)"),
            None => "the bytes are not a simulated payload".to_string(),
        };
        let Some(ver) = self.by_layout(key, len, fp) else {
            return Err(format!(
                "key {key} was served as {len} bytes under layout {fp:#x}, which none of its \
                 versions has; {says}"
            ));
        };
        if sum != ver.checksum {
            return Err(format!(
                "key {key} was served under the layout of its version {} but {says}",
                ver.v
            ));
        }
        if let Some(e) = expected.filter(|e| *e != fp) {
            return Err(format!(
                "key {key} was loaded under layout {e:#x} but served version {} of layout {fp:#x}",
                ver.v
            ));
        }
        if ver.v < self.cleared_below {
            return Err(format!(
                "key {key} version {} was served, but a CLEAR acknowledged after it was \
                 stored (versions below {} are gone for good)",
                ver.v, self.cleared_below
            ));
        }
        if ver.v < self.soft_cleared_below {
            return Err(format!(
                "key {key} version {} was served after a CLEAR emptied the tier (before any \
                 restart)",
                ver.v
            ));
        }
        Ok(ver.v)
    }
}

/// What [`describe`] makes of `bytes` (re-exported for the checks).
pub fn head_of(bytes: &[u8]) -> Option<(u64, u64, u64)> {
    describe(bytes)
}
