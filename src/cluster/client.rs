//! A client of the whole cluster, for remote engines with no node of their own: each request
//! goes straight to the member that owns each chunk (the same placement the nodes use), all
//! owners of a request in parallel; membership is re-read from etcd every second and after a
//! failed call, and a chunk the owner lacks is asked of the member that owned it before the
//! last change (a moved key: the hand-off may still be in flight).
//!
//! Every call goes over the remote-engine protocol with the cluster's token; the engine's
//! registration is made on each member the first time a request goes there. A member that
//! cannot be reached is a miss (skipped for a second), never an error.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::members::{Descriptor, View};
use super::placement::placement_key;
use crate::client::{RemoteClient, RemoteOptions};
use crate::config::ClusterConfig;
use crate::error::{Error, ErrorKind, Result};
use crate::protocol::{ChunkRange, RegisterRequest};
use crate::transport::tcp::auth::Token;

/// How often the view is re-read from etcd (also at once after a failed call; a failed read
/// waits this long too before the next try).
pub const VIEW_REFRESH: Duration = Duration::from_secs(1);

/// How long a member that could not be reached is skipped (its chunks are misses at once).
pub const MEMBER_DOWN_BACKOFF: Duration = Duration::from_secs(1);

/// One member's connection, with the registrations made on it.
struct MemberConn {
    endpoint: String,
    client: RemoteClient,
    registered: Vec<u64>,
}

/// A blocking client of a cluster. Invariant: `conns` holds at most one connection per live
/// member (taken out while a call runs on it); each registered the instances in its
/// `registered` with the requests in `registrations`.
pub struct ClusterClient {
    cfg: ClusterConfig,
    token: Option<Token>,
    opts: RemoteOptions,
    rt: tokio::runtime::Runtime,
    view: Arc<View>,
    previous: Option<Arc<View>>,
    read_at: Instant,
    conns: HashMap<String, MemberConn>,
    down: HashMap<String, Instant>,
    registrations: HashMap<u64, RegisterRequest>,
}

/// Which chunks of a request each member is asked for: member id -> request indices, in order.
type Plan = BTreeMap<String, Vec<usize>>;

/// A call run on one member: its connection, its sub-range, the request indices of its chunks.
type MemberCall<'c, T> = dyn Fn(&mut RemoteClient, &ChunkRange, &[usize]) -> Result<T> + Sync + 'c;

/// One member's share of a fan-out, as its thread gets it.
struct Work<'a> {
    id: String,
    idx: Vec<usize>,
    conn: Option<MemberConn>,
    endpoint: Option<String>,
    register: Option<&'a RegisterRequest>,
}

/// What a thread hands back: the member, its chunk indices, its connection when still usable,
/// and the result.
type Done<T> = (String, Vec<usize>, Option<MemberConn>, Result<T>);

/// Takes the share out of its cell (once).
fn take_share<'a>(cell: &std::sync::Mutex<Option<Work<'a>>>) -> Option<Work<'a>> {
    cell.lock().ok().and_then(|mut g| g.take())
}

/// Connects (when `w` has no connection yet), registers the instance when needed, then runs
/// `call` with `w`'s sub-range and chunk indices.
fn run_one<T>(
    mut w: Work<'_>,
    range: &ChunkRange,
    token: Option<&Token>,
    opts: &RemoteOptions,
    call: &MemberCall<'_, T>,
) -> Done<T> {
    let conn = match w.conn.take() {
        Some(c) => Ok(c),
        None => match &w.endpoint {
            None => Err(Error::new(
                ErrorKind::Io,
                format!("member {} left the cluster", w.id),
            )),
            Some(ep) => RemoteClient::connect_remote(ep, token, opts).map(|client| MemberConn {
                endpoint: ep.clone(),
                client,
                registered: Vec::new(),
            }),
        },
    };
    let mut conn = match conn {
        Ok(c) => c,
        Err(e) => return (w.id, w.idx, None, Err(e)),
    };
    if let Some(req) = w.register {
        if !conn.registered.contains(&req.instance_id) {
            if let Err(e) = conn.client.register(req) {
                return (w.id, w.idx, None, Err(e));
            }
            conn.registered.push(req.instance_id);
        }
    }
    let sub = ClusterClient::sub(range, &w.idx);
    let r = call(&mut conn.client, &sub, &w.idx);
    let keep = r.is_ok().then_some(conn);
    (w.id, w.idx, keep, r)
}

impl ClusterClient {
    /// Connects to the cluster `name` through the etcd endpoints `etcd`, proving `token` to its
    /// members (connections and replies bounded by `opts`). Fails when etcd cannot be read or
    /// lists no member.
    pub fn connect(
        etcd: &[String],
        name: &str,
        token: Option<Token>,
        opts: RemoteOptions,
    ) -> Result<ClusterClient> {
        let cfg = ClusterConfig {
            etcd: etcd.to_vec(),
            name: name.to_owned(),
            etcd_timeout_ms: opts.connect_timeout.as_millis().clamp(1, 60_000) as u64,
            ..ClusterConfig::default()
        };
        for e in etcd {
            crate::config::etcd_endpoint(e)?;
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::internal(format!("cannot start a runtime: {e}")))?;
        let mut c = ClusterClient {
            cfg,
            token,
            opts,
            rt,
            view: Arc::new(View::default()),
            previous: None,
            read_at: Instant::now(),
            conns: HashMap::new(),
            down: HashMap::new(),
            registrations: HashMap::new(),
        };
        c.refresh()?;
        if c.view.members.is_empty() {
            return Err(Error::new(
                ErrorKind::Io,
                format!("cluster {name:?} has no member in etcd"),
            ));
        }
        Ok(c)
    }

    /// Re-reads the members from etcd.
    pub fn refresh(&mut self) -> Result<()> {
        // A failed read waits its turn too: an unreachable etcd costs one try per second.
        self.read_at = Instant::now();
        let cfg = &self.cfg;
        let found: Vec<Descriptor> = self
            .rt
            .block_on(async {
                let mut client = super::etcd::connect(cfg).await?;
                let (found, _) = super::etcd::read_members(
                    &mut client,
                    &cfg.members_prefix(),
                    cfg.etcd_timeout(),
                )
                .await?;
                Ok::<_, String>(found.into_iter().map(|(_, d)| d).collect())
            })
            .map_err(|e| Error::new(ErrorKind::Io, e))?;
        let view = View::build(found, "", 0);
        self.conns.retain(|id, c| {
            view.get(id)
                .is_some_and(|m| m.desc.endpoints[0] == c.endpoint)
        });
        let changed = self.view.members.len() != view.members.len()
            || self
                .view
                .members
                .iter()
                .zip(&view.members)
                .any(|(a, b)| a.desc.node_id != b.desc.node_id || a.desc.lease != b.desc.lease);
        if changed {
            self.previous = Some(std::mem::replace(&mut self.view, Arc::new(view)));
        }
        Ok(())
    }

    fn maybe_refresh(&mut self) {
        if self.read_at.elapsed() >= VIEW_REFRESH {
            if let Err(e) = self.refresh() {
                tracing::debug!(error = %e, "cluster view not refreshed; keeping the last one");
            }
        }
    }

    /// The members as last read (ids, endpoints, capacity).
    pub fn members(&self) -> Vec<Descriptor> {
        self.view.members.iter().map(|m| m.desc.clone()).collect()
    }

    /// Registers the engine's context: made on each member the first time a request goes
    /// there, and on one member at once, whose answer (the object size) is returned.
    pub fn register(&mut self, req: &RegisterRequest) -> Result<u64> {
        self.registrations.insert(req.instance_id, req.clone());
        let first = self
            .view
            .members
            .first()
            .ok_or_else(|| Error::new(ErrorKind::Io, "the cluster has no member in etcd"))?
            .desc
            .node_id
            .clone();
        let plan: Plan = [(first, Vec::new())].into_iter().collect();
        let empty = ChunkRange {
            model: req.model.clone(),
            world_size: req.world_size,
            worker_id: Some(0),
            cache_salt: String::new(),
            first_chunk: 0,
            chunk_hashes: Vec::new(),
        };
        self.fan_out(Some(req.instance_id), &empty, plan, &|c, _, _| {
            c.object_bytes()
        })
        .pop()
        .map_or_else(|| Err(Error::internal("no member answered")), |(_, r)| r)
    }

    /// Member id per chunk of `range` under `view`.
    fn plan(view: &View, range: &ChunkRange, chunks: &[usize]) -> Plan {
        let mut plan = Plan::new();
        for &i in chunks {
            let key = placement_key(&range.model, &range.cache_salt, &range.chunk_hashes[i]);
            if let Some(o) = view.owner(key) {
                plan.entry(o.desc.node_id.clone()).or_default().push(i);
            }
        }
        plan
    }

    fn sub(range: &ChunkRange, idx: &[usize]) -> ChunkRange {
        ChunkRange {
            first_chunk: 0,
            chunk_hashes: idx.iter().map(|&i| range.chunk_hashes[i]).collect(),
            ..range.clone()
        }
    }

    /// Runs `call` on each member of `plan` with its chunks: one call per member, all in
    /// parallel, each on its own connection (made in its thread when missing, with the
    /// instance registered when `instance` is given). A member skipped for a recent failure,
    /// or whose call fails, is marked down for [`MEMBER_DOWN_BACKOFF`], its connection dropped
    /// and the view re-read. Returns each member's chunk indices with its result.
    fn fan_out<T: Send>(
        &mut self,
        instance: Option<u64>,
        range: &ChunkRange,
        plan: Plan,
        call: &MemberCall<'_, T>,
    ) -> Vec<(Vec<usize>, Result<T>)> {
        let now = Instant::now();
        self.down.retain(|_, until| *until > now);
        let mut out = Vec::new();
        let mut work = Vec::new();
        for (id, idx) in plan {
            if self.down.contains_key(&id) {
                let e = Error::new(
                    ErrorKind::Io,
                    format!("member {id} was unreachable a moment ago"),
                );
                out.push((idx, Err(e)));
                continue;
            }
            work.push(Work {
                conn: self.conns.remove(&id),
                endpoint: self.view.get(&id).map(|m| m.desc.endpoints[0].clone()),
                register: instance.and_then(|i| self.registrations.get(&i)),
                id,
                idx,
            });
        }
        let token = self.token.as_ref();
        let opts = &self.opts;
        // Each share in a cell, so a share whose thread cannot be made runs here instead.
        let cells: Vec<std::sync::Mutex<Option<Work<'_>>>> = work
            .into_iter()
            .map(|w| std::sync::Mutex::new(Some(w)))
            .collect();
        let done: Vec<Done<T>> = std::thread::scope(|s| {
            let mut handles = Vec::new();
            let mut inline = Vec::new();
            for cell in &cells {
                let spawned = std::thread::Builder::new()
                    .name("kvnode-cluster-call".into())
                    .spawn_scoped(s, move || {
                        take_share(cell).map(|w| run_one(w, range, token, opts, call))
                    });
                match spawned {
                    Ok(h) => handles.push(h),
                    Err(_) => inline
                        .extend(take_share(cell).map(|w| run_one(w, range, token, opts, call))),
                }
            }
            handles
                .into_iter()
                .filter_map(|h| h.join().ok().flatten())
                .chain(inline)
                .collect()
        });
        let mut failed = false;
        for (id, idx, conn, r) in done {
            match (&r, conn) {
                (Ok(_), Some(c)) => {
                    self.conns.insert(id, c);
                }
                (Err(e), _) => {
                    tracing::info!(member = %id, error = %e, "cluster call failed: a miss");
                    self.down.insert(id, Instant::now() + MEMBER_DOWN_BACKOFF);
                    failed = true;
                }
                _ => {}
            }
            out.push((idx, r));
        }
        if failed {
            let _ = self.refresh();
        }
        out
    }

    /// Stores `chunks` (one per hash of `range`, each the layout's object size) on their owners,
    /// all owners in parallel. Returns how many chunks were sent (the rest were cached already,
    /// or their owner could not be reached: those are not stored, never an error). A member
    /// that fails is retried once under a fresh view (its chunks may have a new owner).
    pub fn store(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
        chunks: &[&[u8]],
    ) -> Result<usize> {
        if chunks.len() != range.chunk_hashes.len() {
            return Err(Error::invalid(format!(
                "{} chunks for {} hashes",
                chunks.len(),
                range.chunk_hashes.len()
            )));
        }
        self.maybe_refresh();
        let all: Vec<usize> = (0..chunks.len()).collect();
        let mut plan = Self::plan(&self.view, range, &all);
        let mut sent = 0;
        for _attempt in 0..2 {
            let store = |c: &mut RemoteClient, sub: &ChunkRange, idx: &[usize]| {
                let data: Vec<&[u8]> = idx.iter().map(|&i| chunks[i]).collect();
                c.store(instance_id, sub, &data)
            };
            let mut retry = Vec::new();
            for (idx, r) in self.fan_out(Some(instance_id), range, plan, &store) {
                match r {
                    Ok(n) => sent += n,
                    Err(e) if e.kind == ErrorKind::Io => retry.extend(idx),
                    Err(e) => return Err(e.context("storing in the cluster")),
                }
            }
            if retry.is_empty() {
                break;
            }
            plan = Self::plan(&self.view, range, &retry);
        }
        Ok(sent)
    }

    /// Retrieves every chunk of `range` from its owner (all owners in parallel); a chunk its
    /// owner lacks is asked of the member that owned it before the last membership change, when
    /// that is another member. `None` when any chunk is missing everywhere asked.
    pub fn retrieve(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
    ) -> Result<Option<Vec<Vec<u8>>>> {
        self.maybe_refresh();
        let n = range.chunk_hashes.len();
        let mut out: Vec<Option<Vec<u8>>> = vec![None; n];
        let all: Vec<usize> = (0..n).collect();
        let plan = Self::plan(&self.view, range, &all);
        let missing = self.retrieve_plan(instance_id, range, plan, &mut out);
        if !missing.is_empty() {
            if let Some(prev) = self.previous.clone() {
                // Only chunks whose previous owner is another live member.
                let now = Self::plan(&self.view, range, &missing);
                let owner_now: HashMap<usize, &String> = now
                    .iter()
                    .flat_map(|(id, idx)| idx.iter().map(move |&i| (i, id)))
                    .collect();
                let plan: Plan = Self::plan(&prev, range, &missing)
                    .into_iter()
                    .filter(|(id, _)| self.view.get(id).is_some())
                    .map(|(id, idx)| {
                        let moved: Vec<usize> = idx
                            .into_iter()
                            .filter(|i| owner_now.get(i).is_some_and(|o| **o != id))
                            .collect();
                        (id, moved)
                    })
                    .filter(|(_, idx)| !idx.is_empty())
                    .collect();
                if !plan.is_empty() {
                    self.retrieve_plan(instance_id, range, plan, &mut out);
                }
            }
        }
        Ok(out.into_iter().collect())
    }

    /// Runs `plan` (one retrieve per member, in parallel), filling `out`; returns the indices
    /// still missing (a member that fails is a miss, never an error).
    fn retrieve_plan(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
        plan: Plan,
        out: &mut [Option<Vec<u8>>],
    ) -> Vec<usize> {
        let retrieve =
            |c: &mut RemoteClient, sub: &ChunkRange, _: &[usize]| c.retrieve(instance_id, sub);
        let mut missing = Vec::new();
        for (idx, r) in self.fan_out(Some(instance_id), range, plan, &retrieve) {
            match r {
                Ok(Some(bufs)) => {
                    for (i, b) in idx.into_iter().zip(bufs) {
                        out[i] = Some(b);
                    }
                }
                Ok(None) | Err(_) => missing.extend(idx),
            }
        }
        missing.sort_unstable();
        missing
    }

    /// How many leading chunks of `range` the cluster holds: each owner is asked for its
    /// chunks once, all in parallel (one round per member concerned). A count only: the
    /// owners' lookup locks are released at once (a retrieve takes its own).
    pub fn lookup(&mut self, request_id: &str, range: &ChunkRange) -> Result<u32> {
        self.maybe_refresh();
        let all: Vec<usize> = (0..range.chunk_hashes.len()).collect();
        let mut lookup_range = range.clone();
        lookup_range.worker_id = None;
        let plan = Self::plan(&self.view, &lookup_range, &all);
        let lookup = |c: &mut RemoteClient, sub: &ChunkRange, _: &[usize]| {
            let held = c.lookup(request_id, sub, 1)?;
            if held > 0 {
                c.end_session(request_id)?;
            }
            Ok(held)
        };
        let mut first_gap = range.chunk_hashes.len();
        for (idx, r) in self.fan_out(None, &lookup_range, plan, &lookup) {
            let held = r.map_or(0, |h| h as usize);
            if let Some(&gap) = idx.get(held) {
                first_gap = first_gap.min(gap);
            }
        }
        Ok(first_gap as u32)
    }
}
