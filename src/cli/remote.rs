//! Remote commands: `kvnode ping --remote`, `kvnode status --remote`, `kvnode token generate`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvnode::client::{FabricChoice, RemoteClient, RemoteOptions};
use kvnode::error::ErrorKind;
use kvnode::transport::tcp::auth::{generate_token_file, Token};

use super::{CliError, EXIT_AUTH_FAILED};

/// Where a remote node is and how to prove the token.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct RemoteArgs {
    /// A node on another host, `tcp://HOST:PORT` (instead of --socket).
    #[arg(long, value_name = "URL")]
    pub(crate) remote: Option<String>,
    /// File holding the node's token (with --remote).
    #[arg(long, value_name = "FILE", requires = "remote")]
    pub(crate) token_file: Option<PathBuf>,
}

/// `kvnode token ...`.
#[derive(clap::Subcommand, Debug)]
pub(crate) enum TokenCommand {
    /// Write a new random token (32 bytes, hex) to FILE, readable by its owner only; refuses to
    /// overwrite an existing file.
    Generate {
        /// Where to write it.
        file: PathBuf,
    },
}

pub(crate) fn token(cmd: TokenCommand) -> Result<(), String> {
    match cmd {
        TokenCommand::Generate { file } => {
            generate_token_file(&file).map_err(|e| e.to_string())?;
            println!("wrote a new token to {}", file.display());
            Ok(())
        }
    }
}

/// Connects and authenticates; an authentication failure exits with [`EXIT_AUTH_FAILED`].
fn connect(
    url: &str,
    token_file: Option<&Path>,
    timeout: Duration,
) -> Result<RemoteClient, CliError> {
    let token = token_file
        .map(Token::from_file)
        .transpose()
        .map_err(|e| e.to_string())?;
    let opts = RemoteOptions {
        name: "kvnode-cli".into(),
        connect_timeout: timeout,
        reply_timeout: Some(timeout),
        // Control requests only: no queue pair for a ping or a status.
        fabric: FabricChoice::Tcp,
        ..RemoteOptions::default()
    };
    RemoteClient::connect_remote(url, token.as_ref(), &opts).map_err(|e| CliError {
        code: if e.kind == ErrorKind::PermissionDenied {
            EXIT_AUTH_FAILED
        } else {
            1
        },
        message: match token_file {
            Some(f) if e.kind == ErrorKind::PermissionDenied => {
                format!("{e} (token from {})", f.display())
            }
            _ => e.to_string(),
        },
    })
}

pub(crate) fn ping(
    url: &str,
    token_file: Option<&Path>,
    timeout: Duration,
) -> Result<(), CliError> {
    let t = Instant::now();
    let mut c = connect(url, token_file, timeout)?;
    let connected = t.elapsed();
    let t = Instant::now();
    c.noop().map_err(|e| e.to_string())?;
    println!(
        "pong from {url} in {} us via {} (connect and authenticate {} us)",
        t.elapsed().as_micros(),
        c.transport().negotiated().fabric.as_str(),
        connected.as_micros()
    );
    Ok(())
}

pub(crate) fn status(
    url: &str,
    token_file: Option<&Path>,
    json: bool,
    timeout: Duration,
) -> Result<(), CliError> {
    let mut c = connect(url, token_file, timeout)?;
    let text = c.status_json().map_err(|e| e.to_string())?;
    if json {
        println!("{text}");
        return Ok(());
    }
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    super::inspect::print_status(&v, url);
    Ok(())
}
