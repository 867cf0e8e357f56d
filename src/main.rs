//! The `kvnode` command: `serve`, `lmcache-server`, `status`, `ping`, `token` (each in `cli/`).
//! Exit status: 0 success, 1 failure, 3 authentication failed (remote commands).

mod cli;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvnode::config::default_socket_path;

#[derive(Parser)]
#[command(
    name = "kvnode",
    version,
    about = "KV-cache storage node for LLM inference engines"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the node (embedded defaults; flags override the optional TOML config).
    Serve(cli::serve::ServeArgs),
    /// Print the node's status report (counters only: cheap at any size; `memcheck` shows the
    /// outcome of the last MEMCHECK). `status` waits up to 60 s by default (`--timeout`), then
    /// gives up.
    Status {
        /// Node socket.
        #[arg(long, default_value_os_t = default_socket_path())]
        socket: PathBuf,
        /// Print the raw JSON object.
        #[arg(long)]
        json: bool,
        /// Seconds to wait for the node to take the connection, and then for its report.
        #[arg(long, value_parser = cli::timeout_arg, value_name = "SECS", default_value = "60")]
        timeout: std::time::Duration,
        #[command(flatten)]
        remote: cli::remote::RemoteArgs,
    },
    /// Serve LMCache clients (drop-in for `python -m lmcache.v1.multiprocess.server`).
    LmcacheServer(cli::lmcache::LmcacheArgs),
    /// Check that the node answers (gives up after 10 s by default, `--timeout`).
    Ping {
        /// Node socket.
        #[arg(long, default_value_os_t = default_socket_path())]
        socket: PathBuf,
        /// Seconds to wait for the node to take the connection, and then for its answer.
        #[arg(long, value_parser = cli::timeout_arg, value_name = "SECS", default_value = "10")]
        timeout: std::time::Duration,
        #[command(flatten)]
        remote: cli::remote::RemoteArgs,
    },
    /// Tokens that authenticate remote engines (`serve --auth-token-file`).
    #[command(subcommand)]
    Token(cli::remote::TokenCommand),
    /// A cluster of nodes on etcd (`kvnode cluster status`).
    #[command(subcommand)]
    Cluster(cli::cluster::ClusterCommand),
    /// GPUs as the client library sees them (`kvnode gpu probe`).
    #[command(subcommand)]
    Gpu(cli::gpu::GpuCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r: Result<(), cli::CliError> = match cli.command {
        Command::Serve(a) => cli::serve::serve(a).map_err(Into::into),
        Command::LmcacheServer(a) => cli::lmcache::lmcache_server(a).map_err(Into::into),
        Command::Status {
            remote:
                cli::remote::RemoteArgs {
                    remote: Some(url),
                    token_file,
                },
            json,
            timeout,
            ..
        } => cli::remote::status(&url, token_file.as_deref(), json, timeout),
        Command::Status {
            socket,
            json,
            timeout,
            ..
        } => cli::inspect::status(socket, json, timeout).map_err(Into::into),
        Command::Ping {
            remote:
                cli::remote::RemoteArgs {
                    remote: Some(url),
                    token_file,
                },
            timeout,
            ..
        } => cli::remote::ping(&url, token_file.as_deref(), timeout),
        Command::Ping {
            socket, timeout, ..
        } => cli::inspect::ping(socket, timeout).map_err(Into::into),
        Command::Token(t) => cli::remote::token(t).map_err(Into::into),
        Command::Gpu(g) => cli::gpu::gpu(g),
        Command::Cluster(c) => cli::cluster::cluster(c).map_err(Into::into),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvnode: {}", e.message);
            ExitCode::from(e.code)
        }
    }
}
