//! The node's link to its cluster, as the request handlers see it: a layer above the modules
//! (`crate::cluster`) implements it, so the modules never import the cluster.

use super::instances::Instance;
use crate::protocol::ChunkRange;
use crate::storage::StorageKey;

/// What the request path asks of the cluster. Implementations never fail a request: a peer
/// that cannot answer in time is a miss.
pub trait ClusterLink: Send + Sync {
    /// Before a LOOKUP or PREPARE_RETRIEVE of `range` is answered: brings the chunks this node
    /// lacks after its local prefix in from their owners (each owner asked once, all in
    /// parallel, within the peer deadline), published in this node's pool under the layout the
    /// node has registered for the model. Blocks the calling connection only.
    fn bring_in(&self, range: &ChunkRange);

    /// After a store of `inst` published `keys` in this node's pool: queues the chunks other
    /// members own for a background push (never blocks; a full queue drops the push, counted).
    fn published(&self, inst: &Instance, keys: &[StorageKey]);
}
