//! Who sent an LMCache request: one ZMQ connection (one LMCache `MessageQueueClient`, i.e.
//! one vLLM scheduler or one worker rank), and the peer's user when it is known.

use std::fmt;
use std::sync::Arc;

/// One client connection of the LMCache frontend. Invariant: two requests carry equal
/// `ClientId`s exactly when they came over the same connection (the ROUTER gives every
/// connection its own routing id while it is connected; a peer that sets its own routing id
/// cannot take one that is in use) from the same user. The `stamp` is not part of the
/// identity: it orders the request against connection opens and closes (see `disconnect`).
#[derive(Clone)]
pub struct ClientId {
    identity: Arc<[u8]>,
    uid: Option<u32>,
    stamp: u64,
}

impl PartialEq for ClientId {
    fn eq(&self, other: &ClientId) -> bool {
        self.identity == other.identity && self.uid == other.uid
    }
}

impl Eq for ClientId {}

impl std::hash::Hash for ClientId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.identity.hash(state);
        self.uid.hash(state);
    }
}

impl ClientId {
    /// The client with ZMQ routing id `identity` whose peer is user `uid` (`None`: not
    /// resolved).
    pub fn new(identity: &[u8], uid: Option<u32>) -> ClientId {
        ClientId {
            identity: identity.into(),
            uid,
            stamp: 0,
        }
    }

    /// Like [`ClientId::new`], sharing the routing id the server already holds.
    pub fn from_shared(identity: Arc<[u8]>, uid: Option<u32>) -> ClientId {
        ClientId {
            identity,
            uid,
            stamp: 0,
        }
    }

    /// The same client, for a request the server received when the frontend's connection
    /// stamp was `stamp` (`LmFrontend::connection_stamp`; 0, the default: unknown, taken as
    /// older than every connection notice).
    pub fn with_stamp(mut self, stamp: u64) -> ClientId {
        self.stamp = stamp;
        self
    }

    /// The connection stamp the request was received at (see [`ClientId::with_stamp`]).
    pub fn stamp(&self) -> u64 {
        self.stamp
    }

    /// The ZMQ routing id.
    pub fn identity(&self) -> &[u8] {
        &self.identity
    }

    /// The peer's uid, when resolved.
    pub fn uid(&self) -> Option<u32> {
        self.uid
    }

    /// Whether both clients are known to run as the same user: the trust domain within which
    /// a worker may take over the lookup locks of another connection's session, and a
    /// restarted engine process may re-register an instance. An unidentified (remote) client
    /// is nobody's same user, not even another unidentified one's.
    pub fn same_user(&self, other: &ClientId) -> bool {
        match (self.uid, other.uid) {
            (Some(a), Some(b)) => a == b,
            _ => false,
        }
    }

    /// A printable tag unique to the client (uid and hex routing id), used to scope the
    /// names of its lookup sessions on the node.
    pub fn tag(&self) -> String {
        let mut s = match self.uid {
            Some(u) => format!("u{u}."),
            None => "u-.".to_owned(),
        };
        for b in self.identity.iter() {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }

    /// Estimated heap bytes of one copy of the id (for byte budgets).
    pub fn bytes(&self) -> usize {
        self.identity.len() + 16
    }
}

impl fmt::Debug for ClientId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.tag())
    }
}

impl fmt::Display for ClientId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.tag())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_tags_and_users() {
        let a = ClientId::new(&[0, 1, 2, 3, 4], Some(1000));
        let b = ClientId::new(&[0, 1, 2, 3, 5], Some(1000));
        let c = ClientId::new(&[0, 1, 2, 3, 4], Some(1001));
        assert_ne!(a, b);
        assert_ne!(
            a, c,
            "the same routing id of another user is another client"
        );
        assert_eq!(a.tag(), "u1000.0001020304");
        assert!(a.same_user(&b));
        assert!(!a.same_user(&c));
        assert!(
            !ClientId::new(&[7], None).same_user(&c),
            "an unknown user is nobody's"
        );
        let r = ClientId::new(&[8], None);
        assert!(!r.same_user(&r.clone()), "not even another unknown one's");
    }
}
