//! The `kvnode` command: `serve`, `lmcache-server`, `status`, `ping` (each in `cli/`).

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
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Serve(a) => cli::serve::serve(a),
        Command::LmcacheServer(a) => cli::lmcache::lmcache_server(a),
        Command::Status {
            socket,
            json,
            timeout,
        } => cli::inspect::status(socket, json, timeout),
        Command::Ping { socket, timeout } => cli::inspect::ping(socket, timeout),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvnode: {e}");
            ExitCode::FAILURE
        }
    }
}
