//! Stuck I/O without real hangs: a write-behind batch or a load runs on a worker thread whose
//! I/O parks in [`super::engine::SimEngine`] at a chosen point, and stays parked while the
//! simulator runs other steps (syncs, other batches, loads, evictions, fault changes) until a
//! later step releases it (completed, or failed with EIO). The simulator waits for the worker
//! to park or finish before it goes on, and for it to finish after a release, so only one
//! thread ever runs at a time: runs stay a pure function of their seed.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

use super::engine::{mark_stallable_thread, Release, StallArm, StallAt, WorkerEvent};
use super::node::Node;
use crate::storage::{Layout, StorageKey};

/// The operation the worker runs.
#[derive(Debug, Clone)]
pub enum Job {
    /// `L2Tier::persist` of these keys (at most one batch).
    Persist(Vec<StorageKey>),
    /// `L2Tier::load` of these keys.
    Load {
        /// Keys to load.
        keys: Vec<StorageKey>,
        /// Extra locks per loaded object.
        extra: u32,
        /// The layout asked for.
        expected: Option<Layout>,
    },
}

/// What the operation returned.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// Objects written.
    Persisted(u64),
    /// Per key, the lease of the locks taken (`1 + extra` each).
    Loaded(Vec<Option<u64>>),
}

/// A worker whose I/O is parked. Invariant: its thread does nothing until released.
pub struct Stuck {
    /// Key numbers of the job (for the trace and to keep other steps off them).
    pub ids: Vec<u32>,
    /// The job.
    pub job: Job,
    /// Where its I/O is parked.
    pub at: StallAt,
    release: Sender<Release>,
    events: Receiver<WorkerEvent>,
    handle: JoinHandle<Outcome>,
}

/// How [`start`] went.
pub enum Started {
    /// The I/O parked; release it in a later step.
    Parked(Stuck),
    /// The operation finished without reaching the I/O to park on.
    Finished(Job, Outcome),
}

/// Runs `job` on a worker thread that parks at `at`; returns once it parked or finished.
pub fn start(node: &Node, ids: Vec<u32>, job: Job, at: StallAt) -> Result<Started, String> {
    let (ev_tx, ev_rx) = channel();
    let (rel_tx, rel_rx) = channel();
    *node.disk.stall.lock() = Some(StallArm {
        at,
        seen_payload: false,
        events: ev_tx.clone(),
        release: rel_rx,
    });
    let tier = node.tier.clone().expect("the tier is open");
    let (storage, namespaces) = (node.storage.clone(), node.namespaces.clone());
    let j = job.clone();
    let handle = std::thread::Builder::new()
        .name("kvnode-l2sim-stuck".into())
        .spawn(move || {
            mark_stallable_thread();
            let out = match j {
                Job::Persist(keys) => {
                    Outcome::Persisted(tier.persist(&storage, &namespaces, &keys))
                }
                Job::Load {
                    keys,
                    extra,
                    expected,
                } => Outcome::Loaded(tier.load(&storage, &keys, extra, expected.as_ref())),
            };
            drop(tier);
            let _ = ev_tx.send(WorkerEvent::Finished);
            out
        })
        .map_err(|e| format!("no worker thread: {e}"))?;
    match ev_rx.recv() {
        Ok(WorkerEvent::Parked) => Ok(Started::Parked(Stuck {
            ids,
            job,
            at,
            release: rel_tx,
            events: ev_rx,
            handle,
        })),
        Ok(WorkerEvent::Finished) | Err(_) => {
            node.disk.stall.lock().take();
            let out = join(handle)?;
            Ok(Started::Finished(job, out))
        }
    }
}

impl Stuck {
    /// Releases the parked I/O and waits for the operation to return.
    pub fn release(self, how: Release) -> Result<(Job, Outcome), String> {
        let _ = self.release.send(how);
        while let Ok(ev) = self.events.recv() {
            if ev == WorkerEvent::Finished {
                break;
            }
        }
        Ok((self.job, join(self.handle)?))
    }
}

fn join(h: JoinHandle<Outcome>) -> Result<Outcome, String> {
    h.join().map_err(|p| {
        let what = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        format!("the tier panicked on the stuck-I/O worker: {what}")
    })
}
