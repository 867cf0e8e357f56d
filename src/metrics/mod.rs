//! Prometheus metrics: `GET /metrics` in the Prometheus text exposition format (0.0.4), for
//! `kvnode serve --metrics-addr HOST:PORT` and `kvnode lmcache-server --prometheus-port P`.
//!
//! The top layer: it reads the node (`modules`, `storage`, `l2`) and the LMCache frontend
//! (`lmcache::server::LmProbe`); nothing below imports it. Counting on the request path lives
//! with the counters (`op_stats` tables in the node's counters and the LMCache server's
//! stats: relaxed atomics only); this module only reads them when scraped ([`collector`]), and
//! answers over a tiny bounded HTTP responder ([`http`]).

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;

use prometheus_client::registry::Registry;

pub mod collector;
pub mod http;
pub mod names;

pub use self::collector::NodeCollector;
pub use self::http::HttpServer;

/// The port LMCache serves Prometheus metrics on by default (`--prometheus-port`).
pub const LMCACHE_DEFAULT_PROMETHEUS_PORT: u16 = 9090;

/// How a metrics address was chosen, which decides what a taken port means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddrChoice {
    /// The operator named it (`--metrics-addr`, `--prometheus-port`): failing to bind it is
    /// an error that stops the node from starting.
    Explicit,
    /// A default (`lmcache-server`'s port 9090): failing to bind it is logged, and the node
    /// runs without metrics.
    Default,
}

/// Binds the metrics listener on `addr` before the node starts (so a busy explicit port fails
/// at once, before the pool is built). `Ok(None)`: the default address is taken (warned; no
/// metrics). `flag` names the option for the error.
pub fn bind(
    addr: SocketAddr,
    choice: AddrChoice,
    flag: &str,
) -> Result<Option<TcpListener>, String> {
    match TcpListener::bind(addr) {
        Ok(l) => Ok(Some(l)),
        Err(e) if choice == AddrChoice::Default => {
            tracing::warn!(
                %addr,
                error = %e,
                "cannot serve Prometheus metrics on the default port; running without metrics \
                 (give --prometheus-port to choose a port, then a taken port is an error, or \
                 --disable-metrics to silence this)"
            );
            Ok(None)
        }
        Err(e) => Err(format!("{flag}: cannot serve metrics on {addr}: {e}")),
    }
}

/// Serves `GET /metrics` on `listener` from `collector` until [`HttpServer::shutdown`]; logs
/// the address (useful with port 0).
pub fn serve(listener: TcpListener, collector: NodeCollector) -> std::io::Result<HttpServer> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(collector));
    let registry = Arc::new(registry);
    let render: http::Render = Arc::new(move || (render(&registry), CONTENT_TYPE));
    let server = HttpServer::start(listener, render)?;
    tracing::info!(addr = %server.local_addr(), "Prometheus metrics at http://{}/metrics", server.local_addr());
    Ok(server)
}

/// Content type of the exposition.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// The exposition of `registry` (an encoding error, which writing to a `String` cannot cause,
/// yields what was written so far).
pub fn render(registry: &Registry) -> String {
    let mut out = String::with_capacity(64 << 10);
    if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut out, registry) {
        tracing::warn!(error = %e, "metrics encoding failed");
    }
    out
}

#[cfg(test)]
mod tests;
