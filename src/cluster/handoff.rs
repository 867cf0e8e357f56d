//! Hand-off to joining members: when a member appears in the view (a new node, or one that
//! comes back after its lease expired), every node pushes it the chunks it holds that the
//! newcomer now owns, so a join receives its share of what is already cached, not only of new
//! stores. Rendezvous placement makes that share about `1/n` of each node's objects, and no
//! other key moves.
//!
//! The scan runs on the pusher thread, bounded: at most [`MAX_HANDOFF_OBJECTS`] objects per
//! join, and the pushes go through the same byte-bounded queue as stores' (beyond it they are
//! dropped and counted). Objects whose layout this node no longer knows (see
//! [`LayoutCache`]) are skipped: nothing can register them on the peer.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;

use parking_lot::Mutex;

use super::members::View;
use super::push::PushItem;
use super::ClusterNode;
use crate::modules::NodeContext;
use crate::storage::{Layout, NamespaceId};

/// Objects one hand-off scan looks at most (its result list: 64 bytes each).
pub const MAX_HANDOFF_OBJECTS: usize = 262_144;

/// Layouts seen most (the cache forgets the oldest beyond it).
pub const MAX_CACHED_LAYOUTS: usize = 256;

/// The full layouts behind the fingerprints objects carry, learned from the stores this node
/// published (an object outlives the registration of the engine that stored it).
#[derive(Default)]
pub struct LayoutCache {
    inner: Mutex<(HashMap<u64, Layout>, Vec<u64>)>,
}

impl LayoutCache {
    /// Remembers `layout`.
    pub fn learn(&self, layout: &Layout) {
        let fp = layout.fingerprint();
        let mut g = self.inner.lock();
        if g.0.contains_key(&fp) {
            return;
        }
        if g.1.len() >= MAX_CACHED_LAYOUTS {
            let old = g.1.remove(0);
            g.0.remove(&old);
        }
        g.0.insert(fp, layout.clone());
        g.1.push(fp);
    }

    /// The layout of fingerprint `fp`, if seen.
    pub fn get(&self, fp: u64) -> Option<Layout> {
        self.inner.lock().0.get(&fp).cloned()
    }
}

/// The members of `view` other than this node, each as (id, lease): a member that rejoined
/// (after a partition, or a restart) has a new lease and counts as joined again.
pub fn remote_members(view: &View) -> HashSet<(String, i64)> {
    view.members
        .iter()
        .filter(|m| !m.local)
        .map(|m| (m.desc.node_id.clone(), m.desc.lease))
        .collect()
}

impl ClusterNode {
    /// Queues pushes of the objects the members in `joined` now own: one index shard at a
    /// time (copied out under its lock, placed after), at most [`MAX_HANDOFF_OBJECTS`] looked
    /// at in all.
    pub(super) fn hand_off(&self, ctx: &NodeContext, view: &View, joined: &HashSet<String>) {
        if joined.is_empty() || !self.cfg.push {
            return;
        }
        let mut names: HashMap<NamespaceId, Option<(String, String)>> = HashMap::new();
        let (mut queued, mut skipped, mut seen) = (0u64, 0u64, 0usize);
        for shard in 0..ctx.storage.index_shards() {
            if seen >= MAX_HANDOFF_OBJECTS || self.stopping() {
                break;
            }
            let objects = ctx
                .storage
                .scan_ready_shard(shard, MAX_HANDOFF_OBJECTS - seen);
            seen += objects.len();
            for (k, len, fp) in objects {
                let name = names
                    .entry(k.namespace)
                    .or_insert_with(|| ctx.namespaces.name(k.namespace));
                let Some((model, salt)) = name.as_ref() else {
                    continue;
                };
                let key = super::placement::placement_key(model, salt, &k.chunk_hash);
                let Some(owner) = view.owner(key).filter(|o| joined.contains(&o.desc.node_id))
                else {
                    continue;
                };
                let Some(layout) = self.layouts.get(fp).filter(|l| l.object_bytes() == len) else {
                    skipped += 1;
                    continue;
                };
                let item = PushItem {
                    owner: owner.desc.node_id.clone(),
                    endpoint: owner.desc.endpoints[0].clone(),
                    model: model.clone(),
                    salt: salt.clone(),
                    world_size: k.kv_rank >> 24,
                    rank: (k.kv_rank >> 16) & 0xff,
                    layout,
                    key: k,
                    attempts: 0,
                };
                if self.pushes.offer(item) {
                    queued += 1;
                } else {
                    self.counters.push_dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.counters
            .handoff_queued
            .fetch_add(queued, Ordering::Relaxed);
        self.counters
            .handoff_skipped
            .fetch_add(skipped, Ordering::Relaxed);
        if queued + skipped > 0 {
            tracing::info!(joined = ?joined, queued, skipped, "handing chunks off to joining members");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::Dtype;

    #[test]
    fn the_layout_cache_is_bounded_and_forgets_the_oldest() {
        let c = LayoutCache::default();
        let layouts: Vec<Layout> = (1..=(MAX_CACHED_LAYOUTS as u32 + 1))
            .map(|h| Layout::engine_driven(1, 16, h, Dtype::Float32, false).unwrap())
            .collect();
        for l in &layouts {
            c.learn(l);
            c.learn(l); // twice: no duplicate
        }
        assert!(c.get(layouts[0].fingerprint()).is_none(), "the oldest went");
        for l in &layouts[1..] {
            assert_eq!(c.get(l.fingerprint()).unwrap().shape, l.shape);
        }
    }
}
