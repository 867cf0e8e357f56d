//! A client of the whole cluster, for remote engines with no node of their own: each request
//! goes straight to the member that owns each chunk (the same placement the nodes use), all
//! owners of a request in parallel; membership is re-read from etcd every second and after a
//! failed call, and a chunk the owner lacks is asked of the member that owned it before the
//! last change (a moved key: the hand-off may still be in flight).
//!
//! Every call goes over the remote-engine protocol with the cluster's token; the engine's
//! registration is made on each member the first time a request goes there.

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

/// How often the view is re-read from etcd (also at once after a failed call).
pub const VIEW_REFRESH: Duration = Duration::from_secs(1);

/// One member's connection, with the registrations made on it.
struct MemberConn {
    endpoint: String,
    client: RemoteClient,
    registered: Vec<u64>,
}

/// A blocking client of a cluster. Invariant: `conns` holds at most one connection per live
/// member; every connection registered the instances in `registrations` it was used for.
pub struct ClusterClient {
    cfg: ClusterConfig,
    token: Option<Token>,
    opts: RemoteOptions,
    rt: tokio::runtime::Runtime,
    view: Arc<View>,
    previous: Option<Arc<View>>,
    read_at: Instant,
    conns: HashMap<String, MemberConn>,
    registrations: HashMap<u64, RegisterRequest>,
}

/// Which chunks of a request each member is asked for: member id -> request indices, in order.
type Plan = BTreeMap<String, Vec<usize>>;

impl ClusterClient {
    /// Connects to the cluster `name` through the etcd endpoints `etcd`, proving `token` to its
    /// members. Fails when etcd cannot be read or lists no member.
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
        let ids: Vec<&str> = view
            .members
            .iter()
            .map(|m| m.desc.node_id.as_str())
            .collect();
        self.conns.retain(|id, c| {
            view.get(id)
                .is_some_and(|m| m.desc.endpoints[0] == c.endpoint)
                && ids.contains(&id.as_str())
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
        self.read_at = Instant::now();
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
    /// there. The layout (object size) is checked on the first member at once.
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
        let c = self.conn(&first, Some(req.instance_id))?;
        c.client.object_bytes()
    }

    /// The connection to member `id`, made (and the instance registered) when missing.
    fn conn(&mut self, id: &str, instance: Option<u64>) -> Result<&mut MemberConn> {
        if !self.conns.contains_key(id) {
            let m = self.view.get(id).ok_or_else(|| {
                Error::new(ErrorKind::Io, format!("member {id} left the cluster"))
            })?;
            let endpoint = m.desc.endpoints[0].clone();
            let client = RemoteClient::connect_remote(&endpoint, self.token.as_ref(), &self.opts)?;
            self.conns.insert(
                id.to_owned(),
                MemberConn {
                    endpoint,
                    client,
                    registered: Vec::new(),
                },
            );
        }
        let c = self.conns.get_mut(id).expect("inserted above");
        if let Some(inst) = instance {
            if !c.registered.contains(&inst) {
                let req = self.registrations.get(&inst).ok_or_else(|| {
                    Error::invalid(format!(
                        "instance {inst} was not registered with this client"
                    ))
                })?;
                c.client.register(req)?;
                c.registered.push(inst);
            }
        }
        Ok(c)
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

    /// Forgets the connection to `id` after a failed call and re-reads the view.
    fn failed(&mut self, id: &str, e: &Error) {
        tracing::info!(member = id, error = %e, "cluster call failed; re-reading the members");
        self.conns.remove(id);
        let _ = self.refresh();
    }

    /// Stores `chunks` (one per hash of `range`, each the layout's object size) on their owners.
    /// Returns how many chunks were sent (the rest were cached already). A member that fails is
    /// retried once under a fresh view.
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
        let mut sent = 0;
        let mut pending = Self::plan(&self.view, range, &all);
        for attempt in 0..2 {
            let mut retry = Vec::new();
            for (id, idx) in std::mem::take(&mut pending) {
                let sub = Self::sub(range, &idx);
                let data: Vec<&[u8]> = idx.iter().map(|&i| chunks[i]).collect();
                let r = self
                    .conn(&id, Some(instance_id))
                    .and_then(|c| c.client.store(instance_id, &sub, &data));
                match r {
                    Ok(n) => sent += n,
                    Err(e) if attempt == 0 && e.kind == ErrorKind::Io => {
                        self.failed(&id, &e);
                        retry.extend(idx);
                    }
                    Err(e) => return Err(e.context(format!("storing on member {id}"))),
                }
            }
            if retry.is_empty() {
                break;
            }
            pending = Self::plan(&self.view, range, &retry);
        }
        Ok(sent)
    }

    /// Retrieves every chunk of `range` from its owner (all owners in parallel); a chunk its
    /// owner lacks is asked of the member that owned it before the last membership change.
    /// `None` when any chunk is missing everywhere asked.
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
        let missing = self.retrieve_plan(instance_id, range, plan, &mut out)?;
        if !missing.is_empty() {
            if let Some(prev) = self.previous.clone() {
                let plan = Self::plan(&prev, range, &missing);
                let plan: Plan = plan
                    .into_iter()
                    .filter(|(id, _)| self.view.get(id).is_some())
                    .collect();
                self.retrieve_plan(instance_id, range, plan, &mut out)?;
            }
        }
        Ok(out.into_iter().collect())
    }

    /// Runs `call` on each member of `plan` with its chunks (one call per member, all in
    /// parallel on their own connections); connections whose call failed are dropped and the
    /// view re-read. Returns each member's chunk indices with its result.
    fn fan_out<T: Send>(
        &mut self,
        instance: Option<u64>,
        range: &ChunkRange,
        plan: Plan,
        call: impl Fn(&mut RemoteClient, &ChunkRange) -> Result<T> + Sync,
    ) -> Vec<(Vec<usize>, Result<T>)> {
        let mut work = Vec::new();
        for (id, idx) in plan {
            let conn = match self.conn(&id, instance) {
                Ok(_) => self.conns.remove(&id),
                Err(e) => {
                    self.failed(&id, &e);
                    None
                }
            };
            work.push((id, idx, conn));
        }
        let call = &call;
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = work
                .into_iter()
                .map(|(id, idx, conn)| {
                    let sub = Self::sub(range, &idx);
                    s.spawn(move || match conn {
                        None => {
                            let e = Error::new(ErrorKind::Io, format!("member {id} unreachable"));
                            (id, idx, None, Err(e))
                        }
                        Some(mut c) => {
                            let r = call(&mut c.client, &sub);
                            (id, idx, Some(c), r)
                        }
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a cluster call thread panicked"))
                .collect()
        });
        let mut out = Vec::new();
        for (id, idx, conn, r) in results {
            match (&r, conn) {
                (Ok(_), Some(c)) => {
                    self.conns.insert(id, c);
                }
                (Err(e), _) => self.failed(&id, e),
                _ => {}
            }
            out.push((idx, r));
        }
        out
    }

    /// Runs `plan` (one retrieve per member, in parallel), filling `out`; returns the indices
    /// still missing (a member that fails is a miss, never an error).
    fn retrieve_plan(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
        plan: Plan,
        out: &mut [Option<Vec<u8>>],
    ) -> Result<Vec<usize>> {
        let results = self.fan_out(Some(instance_id), range, plan, |c, sub| {
            c.retrieve(instance_id, sub)
        });
        let mut missing = Vec::new();
        for (idx, r) in results {
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
        Ok(missing)
    }

    /// How many leading chunks of `range` the cluster holds: each owner is asked for its
    /// chunks once, all in parallel (one round per member concerned). The owners keep the
    /// locks of their hits in session `request_id` until its retrieve or the session's expiry.
    pub fn lookup(&mut self, request_id: &str, range: &ChunkRange) -> Result<u32> {
        self.maybe_refresh();
        let all: Vec<usize> = (0..range.chunk_hashes.len()).collect();
        let mut lookup_range = range.clone();
        lookup_range.worker_id = None;
        let plan = Self::plan(&self.view, &lookup_range, &all);
        let results = self.fan_out(None, &lookup_range, plan, |c, sub| {
            c.lookup(request_id, sub, 1)
        });
        let mut first_gap = range.chunk_hashes.len();
        for (idx, r) in results {
            let held = r.map_or(0, |h| h as usize);
            if let Some(&gap) = idx.get(held) {
                first_gap = first_gap.min(gap);
            }
        }
        Ok(first_gap as u32)
    }
}
