//! `--etcd URL --cluster NAME --token-file FILE`: the workloads through a cluster of nodes.
//!
//! Members come from etcd. Engines are remote clients of each member (`--instances` per
//! member, each its own connection). Three phases, each with every member's engines at once:
//! 1. **store**: each member's engines store prefixes of their own (the member keeps its copy
//!    and pushes the chunks other members own to them);
//! 2. **cross-node retrieve**: each member's engines retrieve the prefixes stored through the
//!    *next* member: the member brings the chunks it lacks in from their owners before it
//!    answers (peer fetch), then sends them to its engines;
//! 3. **local retrieve**: the same again, now served from each member's own pool.
//!
//! Every retrieved chunk is checked byte for byte (a miss is counted, never verified as
//! corrupt). Beside the load, in the same run, the raw TCP stream between this host and a raw
//! peer on the first member's host (half before, half after) is the limit one hop reaches; a
//! cross-node retrieve makes two hops (owner -> member -> engine). Per-member and total GB/s,
//! peer-fetched vs local objects (from the members' `cluster` status counters), JSON.

use std::time::{Duration, Instant};

use kvnode::client::{ChunkRangeBuilder, RemoteClient, RemoteOptions};
use kvnode::cluster::ClusterClient;
use kvnode::protocol::{ChunkRange, RegisterRequest};
use kvnode::transport::tcp::auth::Token;
use serde_json::{json, Value};

use crate::payload::Payload;
use crate::peerbuf::Pages;
use crate::rawtcp::Streams;
use crate::remote::Peer;
use crate::workload::LayoutSpec;

/// Chunks per prefix.
const PREFIX_CHUNKS: usize = 8;

/// One member as the bench uses it.
struct Member {
    id: String,
    endpoint: String,
}

/// What one phase measured on one member.
#[derive(Default, Clone)]
struct Phase {
    bytes: u64,
    secs: f64,
    chunks: u64,
    misses: u64,
    corrupt: u64,
}

impl Phase {
    fn gbps(&self) -> f64 {
        self.bytes as f64 / self.secs.max(1e-9) / 1e9
    }

    fn add(&mut self, o: &Phase) {
        self.bytes += o.bytes;
        self.secs = self.secs.max(o.secs);
        self.chunks += o.chunks;
        self.misses += o.misses;
        self.corrupt += o.corrupt;
    }
}

fn options() -> RemoteOptions {
    RemoteOptions {
        name: "kvnode-bench cluster".into(),
        connect_timeout: Duration::from_secs(10),
        reply_timeout: Some(Duration::from_secs(120)),
        fabric: kvnode::client::FabricChoice::Tcp,
        ..RemoteOptions::default()
    }
}

/// The prefixes engine `e` of member `m` stores (the run nonce keeps runs apart).
fn prefixes(layout: &LayoutSpec, nonce: u64, m: usize, e: usize, count: usize) -> Vec<ChunkRange> {
    (0..count)
        .map(|p| {
            // Every (member, engine, prefix) its own tokens: all 64 bits of the seed mixed in.
            let seed = crate::payload::splitmix64(
                nonce
                    ^ crate::payload::splitmix64(
                        ((m as u64) << 40) ^ ((e as u64) << 20) ^ p as u64,
                    ),
            );
            let tokens: Vec<u32> = (0..PREFIX_CHUNKS as u64 * u64::from(layout.chunk_tokens))
                .map(|t| crate::payload::splitmix64(seed ^ t) as u32)
                .collect();
            ChunkRangeBuilder::worker(&format!("bench-{}", layout.name), 1, 0)
                .tokens(&tokens, layout.chunk_tokens)
        })
        .collect()
}

fn register(c: &mut RemoteClient, layout: &LayoutSpec, id: u64) -> Result<usize, String> {
    let reply = c
        .register(&RegisterRequest {
            instance_id: id,
            model: format!("bench-{}", layout.name),
            world_size: 1,
            block_size: 16,
            num_layers: layout.layers,
            hidden_dim: layout.hidden,
            dtype: layout.dtype.clone(),
            use_mla: false,
            physical_slots: None,
        })
        .map_err(|e| format!("register: {e}"))?;
    if reply.chunk_tokens != layout.chunk_tokens {
        return Err(format!(
            "the member's chunk size is {} tokens, the preset's {} (start the nodes with \
             --chunk-size {})",
            reply.chunk_tokens, layout.chunk_tokens, layout.chunk_tokens
        ));
    }
    usize::try_from(reply.object_bytes).map_err(|e| e.to_string())
}

/// Runs `work(member, engine)` for every engine of every member at once; returns each
/// member's phase (summed over its engines; time = the slowest engine's).
fn phase(
    members: &[Member],
    engines: usize,
    work: &(dyn Fn(usize, usize) -> Result<Phase, String> + Sync),
) -> Result<Vec<Phase>, String> {
    let results: Vec<Vec<Result<Phase, String>>> = std::thread::scope(|s| {
        let handles: Vec<Vec<_>> = (0..members.len())
            .map(|m| (0..engines).map(|e| s.spawn(move || work(m, e))).collect())
            .collect();
        handles
            .into_iter()
            .map(|hs| {
                hs.into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err("an engine panicked".into()))
                    })
                    .collect()
            })
            .collect()
    });
    results
        .into_iter()
        .map(|rs| {
            let mut p = Phase::default();
            for r in rs {
                p.add(&r?);
            }
            Ok(p)
        })
        .collect()
}

/// The `cluster` status part of a member (its counters), when it shows one to this token.
fn cluster_status(endpoint: &str, token: Option<&Token>) -> Option<Value> {
    let mut c = RemoteClient::connect_remote(endpoint, token, &options()).ok()?;
    let v = c.status().ok()?;
    let part = v.get("cluster")?.clone();
    (!part.is_null()).then_some(part)
}

fn counter(v: &Option<Value>, key: &str) -> u64 {
    v.as_ref().and_then(|v| v[key].as_u64()).unwrap_or(0)
}

/// Runs the cluster bench. Returns whether every retrieved chunk verified.
pub fn run(args: &crate::Args) -> Result<bool, String> {
    let etcd = args.etcd.clone();
    let name = args.cluster.clone().ok_or("--etcd needs --cluster NAME")?;
    let token = args
        .token_file
        .as_deref()
        .map(Token::from_file)
        .transpose()
        .map_err(|e| e.to_string())?;
    let layout = crate::layout(args)?;
    // The token is read once more for the discovery client (tokens are not copied in memory).
    let discovery_token = args
        .token_file
        .as_deref()
        .map(Token::from_file)
        .transpose()
        .map_err(|e| e.to_string())?;
    let cc = ClusterClient::connect(&etcd, &name, discovery_token, options())
        .map_err(|e| format!("cluster {name}: {e}"))?;
    let members: Vec<Member> = cc
        .members()
        .into_iter()
        .map(|d| Member {
            id: d.node_id,
            endpoint: d.endpoints[0].clone(),
        })
        .collect();
    if members.len() < 2 {
        return Err(format!(
            "cluster {name} has {} member(s): cross-node figures need at least 2",
            members.len()
        ));
    }
    let engines = args.instances.max(1) as usize;
    let per_engine = args.ops.unwrap_or(4).max(1) as usize;
    let nonce = args.run_nonce.unwrap_or_else(crate::random_nonce);
    println!(
        "cluster {name}: {} members, {engines} engine(s) each, {per_engine} prefix(es) of \
         {PREFIX_CHUNKS} chunks per engine, {} ({} bytes per chunk)",
        members.len(),
        layout.name,
        layout.chunk_bytes()
    );
    // The raw TCP stream to a peer on the first member's host: half before the load.
    let peer = Peer::find(args.raw_peer_addr.as_deref(), &members[0].endpoint)?;
    let mut streams = Streams::default();
    let half = Duration::from_secs_f64(args.raw_secs.max(0.2) / 2.0);
    let pages = Pages::Thp;
    streams.sample(peer.addr(), layout.chunk_bytes(), half, pages)?;
    let admin = args
        .admin_token_file
        .as_deref()
        .map(Token::from_file)
        .transpose()
        .map_err(|e| e.to_string())?;
    let counters = || -> Vec<Option<Value>> {
        members
            .iter()
            .map(|m| cluster_status(&m.endpoint, admin.as_ref()))
            .collect()
    };
    let before = counters();
    let ids = |m: usize, e: usize| 0x5eed_0000_0000 + (m as u64) * 1000 + e as u64;
    // 1. Stores.
    let stored = phase(&members, engines, &|m, e| {
        let mut c = RemoteClient::connect_remote(&members[m].endpoint, token.as_ref(), &options())
            .map_err(|x| format!("{}: {x}", members[m].id))?;
        let len = register(&mut c, &layout, ids(m, e))?;
        let payload = Payload::new(len);
        let mut p = Phase::default();
        let ranges = prefixes(&layout, nonce, m, e, per_engine);
        let mut bufs = vec![vec![0u8; len]; PREFIX_CHUNKS];
        let t = Instant::now();
        for r in &ranges {
            for (b, h) in bufs.iter_mut().zip(&r.chunk_hashes) {
                payload.fill(h, b);
            }
            let refs: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
            let sent = c
                .store(ids(m, e), r, &refs)
                .map_err(|x| format!("store on {}: {x}", members[m].id))?;
            p.bytes += (sent * len) as u64;
            p.chunks += sent as u64;
        }
        p.secs = t.elapsed().as_secs_f64();
        Ok(p)
    })?;
    // Pushes land in the background: wait until every member's queue is empty (when the
    // members show their counters to this token), else give them a moment.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let parts = counters();
        let busy = parts
            .iter()
            .any(|p| counter(p, "push_queue_bytes") > 0 || counter(p, "push_in_flight") > 0);
        if parts.iter().all(Option::is_none) {
            std::thread::sleep(Duration::from_secs(2));
            break;
        }
        if !busy || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // 2. and 3. Retrieves of the next member's prefixes: cold (peer fetch), then warm.
    let n = members.len();
    let retrieve = |m: usize, e: usize| -> Result<Phase, String> {
        let src = (m + 1) % n;
        let mut c = RemoteClient::connect_remote(&members[m].endpoint, token.as_ref(), &options())
            .map_err(|x| format!("{}: {x}", members[m].id))?;
        let id = ids(m, e) + 500;
        let len = register(&mut c, &layout, id)?;
        let payload = Payload::new(len);
        let mut p = Phase::default();
        let ranges = prefixes(&layout, nonce, src, e, per_engine);
        let mut bufs = vec![vec![0u8; len]; PREFIX_CHUNKS];
        let t = Instant::now();
        for r in &ranges {
            let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            let hit = c
                .retrieve_into(id, r, None, &mut outs)
                .map_err(|x| format!("retrieve on {}: {x}", members[m].id))?;
            if !hit {
                p.misses += PREFIX_CHUNKS as u64;
                continue;
            }
            p.bytes += (PREFIX_CHUNKS * len) as u64;
            p.chunks += PREFIX_CHUNKS as u64;
            if !args.no_verify {
                for (b, h) in bufs.iter().zip(&r.chunk_hashes) {
                    if !payload.check(h, b) {
                        p.corrupt += 1;
                    }
                }
            }
        }
        p.secs = t.elapsed().as_secs_f64();
        Ok(p)
    };
    let cold = phase(&members, engines, &retrieve)?;
    let mid = counters();
    let warm = phase(&members, engines, &retrieve)?;
    let after = counters();
    streams.sample(peer.addr(), layout.chunk_bytes(), half, pages)?;
    let raw = streams.finish(peer.addr(), layout.chunk_bytes());
    let mut total = [Phase::default(), Phase::default(), Phase::default()];
    let mut rows = Vec::new();
    for (i, m) in members.iter().enumerate() {
        total[0].add(&stored[i]);
        total[1].add(&cold[i]);
        total[2].add(&warm[i]);
        let fetched_cold = counter(&mid[i], "fetched_objects")
            .saturating_sub(counter(&before[i], "fetched_objects"));
        let fetched_warm = counter(&after[i], "fetched_objects")
            .saturating_sub(counter(&mid[i], "fetched_objects"));
        rows.push(json!({
            "node_id": m.id,
            "endpoint": m.endpoint,
            "store_gbps": stored[i].gbps(),
            "cross_retrieve_gbps": cold[i].gbps(),
            "local_retrieve_gbps": warm[i].gbps(),
            "peer_fetched_objects": fetched_cold + fetched_warm,
            "cold_chunks": cold[i].chunks,
            "warm_chunks": warm[i].chunks,
            "misses": cold[i].misses + warm[i].misses,
            "counters_visible": after[i].is_some(),
        }));
    }
    let sum = |ph: &[Phase]| ph.iter().map(Phase::gbps).sum::<f64>();
    let peer_hits: u64 = rows
        .iter()
        .map(|r| r["peer_fetched_objects"].as_u64().unwrap_or(0))
        .sum();
    let retrieved = total[1].chunks + total[2].chunks;
    // Hits are split only when every member's counters were read at every sample.
    let counted = admin.is_some()
        && [&before, &mid, &after]
            .iter()
            .all(|v| v.iter().all(Option::is_some));
    let corrupt = total[1].corrupt + total[2].corrupt;
    let verified = !args.no_verify && corrupt == 0;
    let recv = raw.recv.gbps;
    let j = json!({
        "mode": "cluster",
        "cluster": name,
        "members": rows,
        "layout": layout,
        "engines_per_member": engines,
        "prefixes_per_engine": per_engine,
        "chunks_per_prefix": PREFIX_CHUNKS,
        "total_store_gbps": sum(&stored),
        "total_cross_retrieve_gbps": sum(&cold),
        "total_local_retrieve_gbps": sum(&warm),
        "peer_hits": if counted { json!(peer_hits) } else { Value::Null },
        "local_hits": if counted { json!(retrieved.saturating_sub(peer_hits)) } else { Value::Null },
        "misses": total[1].misses + total[2].misses,
        "raw_tcp": raw,
        "raw_tcp_recv_gbps": recv,
        "cross_retrieve_vs_raw": if recv > 0.0 { cold.iter().map(Phase::gbps).fold(0.0, f64::max) / recv } else { 0.0 },
        "local_retrieve_vs_raw": if recv > 0.0 { warm.iter().map(Phase::gbps).fold(0.0, f64::max) / recv } else { 0.0 },
        "verified": verified,
        "corrupt_chunks": corrupt,
    });
    println!(
        "{:<20} {:>12} {:>16} {:>16} {:>12}",
        "MEMBER", "STORE GB/s", "CROSS-NODE GB/s", "LOCAL GB/s", "PEER OBJS"
    );
    for r in j["members"].as_array().into_iter().flatten() {
        println!(
            "{:<20} {:>12.3} {:>16.3} {:>16.3} {:>12}",
            r["node_id"].as_str().unwrap_or("?"),
            r["store_gbps"].as_f64().unwrap_or(0.0),
            r["cross_retrieve_gbps"].as_f64().unwrap_or(0.0),
            r["local_retrieve_gbps"].as_f64().unwrap_or(0.0),
            r["peer_fetched_objects"],
        );
    }
    println!(
        "total: store {:.3} GB/s, cross-node retrieve {:.3} GB/s, local retrieve {:.3} GB/s; \
         raw TCP stream {:.3} GB/s (one hop); misses {}; {}",
        j["total_store_gbps"].as_f64().unwrap_or(0.0),
        j["total_cross_retrieve_gbps"].as_f64().unwrap_or(0.0),
        j["total_local_retrieve_gbps"].as_f64().unwrap_or(0.0),
        recv,
        j["misses"],
        if verified {
            "every chunk verified"
        } else if args.no_verify {
            "not verified (--no-verify)"
        } else {
            "CORRUPT CHUNKS"
        }
    );
    if let Some(path) = &args.json {
        std::fs::write(
            path,
            serde_json::to_string_pretty(&j).map_err(|e| e.to_string())?,
        )
        .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(verified || args.no_verify)
}
