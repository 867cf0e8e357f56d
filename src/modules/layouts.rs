//! Layout references per `(model, world_size)`: what LOOKUP and the L2 tier check objects
//! against while some instance of that pair is registered.

use std::collections::HashMap;

use parking_lot::Mutex;

use crate::storage::Layout;

/// Reference-counted layouts per `(model, world_size)`, as LMCache's `LayoutDescRegistry`.
/// Invariant: an entry exists iff at least one live instance of that pair holds a reference.
#[derive(Default)]
pub struct LayoutRegistry {
    inner: Mutex<HashMap<(String, u32), (Layout, usize)>>,
}

impl LayoutRegistry {
    pub(super) fn acquire(&self, model: &str, world_size: u32, layout: &Layout) {
        let mut m = self.inner.lock();
        m.entry((model.to_owned(), world_size))
            .and_modify(|e| e.1 += 1)
            .or_insert_with(|| (layout.clone(), 1));
    }

    pub(super) fn release(&self, model: &str, world_size: u32) {
        let mut m = self.inner.lock();
        let key = (model.to_owned(), world_size);
        if let Some(e) = m.get_mut(&key) {
            e.1 -= 1;
            if e.1 == 0 {
                m.remove(&key);
            }
        }
    }

    /// The layout registered for `(model, world_size)`, if any instance holds it.
    pub fn get(&self, model: &str, world_size: u32) -> Option<Layout> {
        self.inner
            .lock()
            .get(&(model.to_owned(), world_size))
            .map(|e| e.0.clone())
    }

    /// Number of distinct registered layouts.
    pub fn len(&self) -> usize {
        self.inner.lock().len()
    }

    /// Whether no layout is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
