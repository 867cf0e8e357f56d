//! The requests waiting for one handler thread of the LMCache frontend: a FIFO per client
//! connection, the connections served in turn (round robin), bounded in requests and in bytes
//! per handler and per connection.
//!
//! One connection's requests run in the order they arrived (a connection always maps to the same
//! handler, which runs one request at a time); a connection with many queued requests gets one
//! request run per turn, so another connection sharing the handler waits for at most one of its
//! requests per request of its own, however long the flood.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// Requests waiting for one handler thread at most, all connections together.
pub const HANDLER_QUEUE: usize = 4096;

/// What a queued item holds in bytes (estimated: frames plus bookkeeping).
pub trait QueuedBytes {
    /// Estimated bytes held while queued.
    fn queued_bytes(&self) -> usize;
}

/// Why [`Turns::push`] refused an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// [`HANDLER_QUEUE`] requests are waiting for the handler.
    Full,
    /// The item alone is larger than a connection's queue budget.
    TooLarge,
    /// The connection's queued bytes would pass its budget.
    ClientBytes,
    /// The handler's queued bytes would pass its budget.
    HandlerBytes,
    /// The bytes queued for all handlers together would pass the node-wide budget.
    NodeBytes,
}

impl Refusal {
    /// The budget that refused, as named in the configuration.
    pub fn budget(self) -> &'static str {
        match self {
            Refusal::Full => "the handler queue length (4096 requests)",
            Refusal::TooLarge | Refusal::ClientBytes => "lmcache.queued_bytes_per_client",
            Refusal::HandlerBytes => "lmcache.queued_bytes_per_handler",
            Refusal::NodeBytes => "lmcache.queued_bytes_total",
        }
    }
}

struct ClientQueue<T> {
    items: VecDeque<T>,
    bytes: usize,
}

/// The queue of one handler. Invariant: `turns` lists every connection with queued items
/// exactly once and no other; `bytes`/`len` are the sums over the connections' queues;
/// `bytes <= per_handler`, every connection's `bytes <= per_client`, `len <= HANDLER_QUEUE`;
/// `running` is the connection of the item last popped until [`Turns::finish`].
pub struct Turns<T> {
    clients: HashMap<Arc<[u8]>, ClientQueue<T>>,
    running: Option<Arc<[u8]>>,
    turns: VecDeque<Arc<[u8]>>,
    len: usize,
    bytes: usize,
    per_client: usize,
    per_handler: usize,
}

impl<T: QueuedBytes> Turns<T> {
    /// An empty queue with byte budgets per connection and for the whole handler.
    pub fn new(per_client: usize, per_handler: usize) -> Turns<T> {
        Turns {
            clients: HashMap::new(),
            running: None,
            turns: VecDeque::new(),
            len: 0,
            bytes: 0,
            per_client,
            per_handler,
        }
    }

    /// Queues `item` of connection `client` behind its earlier ones, or gives it back with the
    /// reason it does not fit.
    pub fn push(&mut self, client: &Arc<[u8]>, item: T) -> Result<(), (T, Refusal)> {
        let size = item.queued_bytes();
        let mine = self.clients.get(client).map_or(0, |q| q.bytes);
        let refusal = if size > self.per_client {
            Some(Refusal::TooLarge)
        } else if self.len >= HANDLER_QUEUE {
            Some(Refusal::Full)
        } else if mine + size > self.per_client {
            Some(Refusal::ClientBytes)
        } else if self.bytes + size > self.per_handler {
            Some(Refusal::HandlerBytes)
        } else {
            None
        };
        if let Some(r) = refusal {
            return Err((item, r));
        }
        let q = self.clients.entry(client.clone()).or_insert_with(|| {
            self.turns.push_back(client.clone());
            ClientQueue {
                items: VecDeque::new(),
                bytes: 0,
            }
        });
        q.items.push_back(item);
        q.bytes += size;
        self.len += 1;
        self.bytes += size;
        Ok(())
    }

    /// The oldest item of the connection whose turn it is; that connection then goes to the
    /// back of the line if it has more. The handler runs it until [`Turns::finish`].
    pub fn pop(&mut self) -> Option<T> {
        let client = self.turns.pop_front()?;
        self.running = Some(client.clone());
        let q = self
            .clients
            .get_mut(&client)
            .expect("listed connections have items");
        let item = q.items.pop_front().expect("listed connections have items");
        let size = item.queued_bytes();
        q.bytes -= size;
        self.bytes -= size;
        self.len -= 1;
        if q.items.is_empty() {
            self.clients.remove(&client);
        } else {
            self.turns.push_back(client);
        }
        Some(item)
    }

    /// The handler finished the item last popped (its reply is queued).
    pub fn finish(&mut self) {
        self.running = None;
    }

    /// Whether connection `client` has nothing queued and nothing running: a request of it run
    /// elsewhere now cannot overtake one of its earlier requests.
    pub fn idle_for(&self, client: &[u8]) -> bool {
        self.running.as_deref() != Some(client) && !self.clients.contains_key(client)
    }

    /// Items waiting.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Estimated bytes waiting.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Connections with items waiting.
    pub fn clients(&self) -> usize {
        self.clients.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Item(u32, usize);

    impl QueuedBytes for Item {
        fn queued_bytes(&self) -> usize {
            self.1
        }
    }

    fn id(b: u8) -> Arc<[u8]> {
        Arc::from(&[b][..])
    }

    #[test]
    fn connections_are_served_in_turn_each_in_order() {
        let mut t = Turns::new(1 << 20, 1 << 20);
        for i in 0..100 {
            t.push(&id(1), Item(i, 10)).ok().unwrap();
        }
        t.push(&id(2), Item(1000, 10)).ok().unwrap();
        t.push(&id(2), Item(1001, 10)).ok().unwrap();
        let order: Vec<u32> = std::iter::from_fn(|| t.pop().map(|i| i.0))
            .take(6)
            .collect();
        assert_eq!(order, [0, 1000, 1, 1001, 2, 3]);
        assert_eq!(t.len(), 96);
        assert_eq!(t.clients(), 1);
        while t.pop().is_some() {}
        assert!(t.is_empty());
        assert_eq!(t.bytes(), 0);
        assert_eq!(t.clients(), 0);
    }

    #[test]
    fn byte_budgets_per_connection_and_per_handler() {
        let mut t = Turns::new(100, 250);
        assert_eq!(
            t.push(&id(1), Item(0, 101)).err().unwrap().1,
            Refusal::TooLarge
        );
        t.push(&id(1), Item(1, 60)).ok().unwrap();
        assert_eq!(
            t.push(&id(1), Item(2, 60)).err().unwrap().1,
            Refusal::ClientBytes
        );
        t.push(&id(2), Item(3, 100)).ok().unwrap();
        t.push(&id(3), Item(4, 80)).ok().unwrap();
        assert_eq!(
            t.push(&id(4), Item(5, 20)).err().unwrap().1,
            Refusal::HandlerBytes
        );
        assert_eq!(t.bytes(), 240);
        t.pop();
        t.push(&id(1), Item(6, 60)).ok().unwrap();
        assert_eq!(t.bytes(), 240);
    }

    #[test]
    fn a_connection_is_idle_only_with_nothing_queued_or_running() {
        let mut t = Turns::new(1 << 20, 1 << 20);
        assert!(t.idle_for(&id(1)));
        t.push(&id(1), Item(0, 10)).ok().unwrap();
        t.push(&id(1), Item(1, 10)).ok().unwrap();
        assert!(!t.idle_for(&id(1)));
        assert!(t.idle_for(&id(2)));
        t.pop();
        assert!(!t.idle_for(&id(1)), "one still queued");
        t.finish();
        t.pop();
        assert!(!t.idle_for(&id(1)), "running");
        t.push(&id(2), Item(2, 10)).ok().unwrap();
        t.finish();
        assert!(t.idle_for(&id(1)));
        assert!(!t.idle_for(&id(2)));
    }

    #[test]
    fn the_request_count_is_bounded_too() {
        let mut t = Turns::new(usize::MAX, usize::MAX);
        for i in 0..HANDLER_QUEUE {
            t.push(&id((i % 7) as u8), Item(i as u32, 0)).ok().unwrap();
        }
        assert_eq!(t.push(&id(9), Item(0, 0)).err().unwrap().1, Refusal::Full);
    }
}
