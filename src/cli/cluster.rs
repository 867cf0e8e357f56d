//! Cluster flags shared by `serve` and `lmcache-server`, and `kvnode cluster status`.

use std::path::PathBuf;

use kvnode::cluster::members::Descriptor;
use kvnode::config::{ClusterConfig, NodeConfig};

/// Membership in a cluster of nodes on etcd.
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct ClusterArgs {
    /// Join a cluster through etcd at URL (http://HOST:PORT; repeat or separate with commas for
    /// several etcd members). Needs --cluster and a --listen address for the peers
    /// [default: none, unless the config file sets cluster.etcd].
    #[arg(long, value_delimiter = ',', value_name = "URL")]
    etcd: Vec<String>,
    /// The cluster's name: nodes of one name share their caches [default: the config file's
    /// cluster.name].
    #[arg(long, value_name = "NAME")]
    cluster: Option<String>,
    /// This node's id in the cluster [default: <hostname>-<listen port>].
    #[arg(long, value_name = "ID")]
    node_id: Option<String>,
    /// The address peers reach this node at, tcp://HOST:PORT [default: the --listen address;
    /// on 0.0.0.0, this host's address towards etcd].
    #[arg(long, value_name = "URL")]
    advertise: Option<String>,
    /// Token file this node proves to its peers [default: its own --auth-token-file].
    #[arg(long, value_name = "FILE")]
    peer_token_file: Option<PathBuf>,
}

impl ClusterArgs {
    /// Applies the flags given on top of `cfg`.
    pub(crate) fn apply(&self, cfg: &mut ClusterConfig) -> Result<(), String> {
        if !self.etcd.is_empty() {
            cfg.etcd = self.etcd.clone();
        }
        if let Some(v) = &self.cluster {
            cfg.name = v.clone();
        }
        if let Some(v) = &self.node_id {
            cfg.node_id = v.clone();
        }
        if let Some(v) = &self.advertise {
            cfg.advertise = v.clone();
        }
        if let Some(v) = &self.peer_token_file {
            cfg.peer_token_file = Some(v.clone());
        }
        if cfg.enabled() && cfg.name.is_empty() {
            return Err(
                "--etcd needs --cluster NAME (nodes of one name share their caches)".into(),
            );
        }
        Ok(())
    }
}

/// The remote listener's flags for `lmcache-server` (`serve` has its own, with more).
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct ListenArgs {
    /// Listen for remote engines and cluster peers at tcp://ADDR:PORT (port 0 picks one)
    /// [default: off, unless the config file sets remote.listen].
    #[arg(long, value_name = "URL")]
    listen: Option<String>,
    /// File with the token remote engines and peers must prove.
    #[arg(long, value_name = "FILE")]
    auth_token_file: Option<PathBuf>,
}

impl ListenArgs {
    /// Applies the flags given on top of `cfg`.
    pub(crate) fn apply(&self, cfg: &mut NodeConfig) {
        if let Some(v) = &self.listen {
            cfg.remote.listen = v.clone();
        }
        if let Some(v) = &self.auth_token_file {
            cfg.remote.auth_token_file = Some(v.clone());
        }
    }
}

/// `kvnode cluster ...`.
#[derive(clap::Subcommand, Debug)]
pub(crate) enum ClusterCommand {
    /// List the members of a cluster as etcd has them: id, endpoint, capacity, usage.
    Status {
        /// etcd endpoint(s), http://HOST:PORT.
        #[arg(long, value_delimiter = ',', value_name = "URL", required = true)]
        etcd: Vec<String>,
        /// The cluster's name.
        #[arg(long, value_name = "NAME")]
        cluster: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Seconds to wait for etcd.
        #[arg(long, default_value = "5", value_parser = super::timeout_arg)]
        timeout: std::time::Duration,
    },
}

pub(crate) fn cluster(cmd: ClusterCommand) -> Result<(), String> {
    match cmd {
        ClusterCommand::Status {
            etcd,
            cluster,
            json,
            timeout,
        } => status(etcd, cluster, json, timeout),
    }
}

fn status(
    etcd: Vec<String>,
    cluster: String,
    json: bool,
    timeout: std::time::Duration,
) -> Result<(), String> {
    let cfg = ClusterConfig {
        etcd,
        name: cluster,
        etcd_timeout_ms: timeout.as_millis() as u64,
        ..ClusterConfig::default()
    };
    // Only what a status needs: endpoints and name.
    for e in &cfg.etcd {
        kvnode::config::etcd_endpoint(e).map_err(|e| e.to_string())?;
    }
    if cfg.name.is_empty() {
        return Err("--cluster NAME is empty".into());
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))?;
    let members: Vec<Descriptor> = rt.block_on(async {
        let mut client = kvnode::cluster::etcd::connect(&cfg).await?;
        let (found, _) =
            kvnode::cluster::etcd::read_members(&mut client, &cfg.members_prefix(), timeout)
                .await?;
        Ok::<_, String>(found.into_iter().map(|(_, d)| d).collect())
    })?;
    if json {
        let v = serde_json::json!({
            "cluster": cfg.name,
            "members": members,
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    println!("cluster {}: {} member(s)", cfg.name, members.len());
    println!(
        "{:<24} {:<28} {:>12} {:>12} {:>9} {:>8}",
        "NODE", "ENDPOINT", "CAPACITY", "USED", "OBJECTS", "LMCACHE"
    );
    for m in &members {
        println!(
            "{:<24} {:<28} {:>12} {:>12} {:>9} {:>8}",
            m.node_id,
            m.endpoints.first().map(String::as_str).unwrap_or("-"),
            kvnode_hw::human_bytes(m.capacity_bytes),
            kvnode_hw::human_bytes(m.used_bytes),
            m.objects,
            if m.lmcache { "yes" } else { "no" },
        );
    }
    Ok(())
}
