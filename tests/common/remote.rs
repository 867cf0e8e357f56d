//! Helpers for remote-engine tests: token files, a node listening on loopback TCP, clients.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvnode::protocol::frame::{
    decode_response, encode_request, FrameHeader, HEADER_BYTES, VERSION,
};
use kvnode::protocol::{Request, Response};
use kvnode::transport::tcp::handshake::{client_handshake, ClientOffer, FrameRange, FABRIC_TCP};

use kvnode::client::{RemoteClient, RemoteOptions};
use kvnode::transport::tcp::auth::Token;

use super::{NodeProc, TestDir};

/// A node listening for remote engines on 127.0.0.1 (a free port), with a token.
pub struct RemoteNode {
    /// The node process (its Unix socket works as usual).
    pub node: NodeProc,
    /// `tcp://127.0.0.1:PORT`.
    pub url: String,
    /// The client token's file.
    pub token_file: PathBuf,
    /// The admin token's file.
    pub admin_file: PathBuf,
    _tokens: TestDir,
}

/// Writes a fresh token file (mode 0600) through the CLI, as an operator would.
pub fn new_token(dir: &TestDir, name: &str) -> PathBuf {
    let path = dir.join(name);
    let out = super::kvnode_until_exit(dir, &["token", "generate", path.to_str().unwrap()]);
    assert!(!out.failed(), "token generate: {}", out.stderr);
    path
}

/// The `tcp` address the node reports in its status (`transports.tcp`).
pub fn listen_url(node: &NodeProc) -> String {
    let st = node.status();
    let addr = st["transports"]["tcp"]
        .as_str()
        .unwrap_or_else(|| panic!("no transports.tcp in {st:#}"));
    format!("tcp://{addr}")
}

impl RemoteNode {
    /// Starts a node listening on 127.0.0.1 with a client and an admin token, plus `extra`
    /// flags.
    pub fn start(tag: &str, extra: &[&str]) -> RemoteNode {
        RemoteNode::start_with_config(tag, None, extra)
    }

    /// [`RemoteNode::start`] with a configuration file holding `toml`.
    pub fn start_with_config(tag: &str, toml: Option<&str>, extra: &[&str]) -> RemoteNode {
        let tokens = TestDir::new(&format!("{tag}-tokens"));
        let token_file = new_token(&tokens, "client.token");
        let admin_file = new_token(&tokens, "admin.token");
        let mut args = vec![
            "--listen",
            "tcp://127.0.0.1:0",
            "--auth-token-file",
            token_file.to_str().unwrap(),
            "--admin-token-file",
            admin_file.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let node = match toml {
            Some(t) => NodeProc::start_with_config(tag, t, &args),
            None => NodeProc::start(tag, &args),
        };
        let url = listen_url(&node);
        RemoteNode {
            node,
            url,
            token_file,
            admin_file,
            _tokens: tokens,
        }
    }

    /// A client proving the client token.
    pub fn client(&self) -> RemoteClient {
        self.client_with(&self.token_file)
    }

    /// A client proving the token in `file`.
    pub fn client_with(&self, file: &std::path::Path) -> RemoteClient {
        let token = Token::from_file(file).expect("token");
        RemoteClient::connect_remote(&self.url, Some(&token), &options()).expect("connect")
    }
}

/// Client options with generous deadlines (a loaded 2-core machine).
pub fn options() -> RemoteOptions {
    RemoteOptions {
        name: "kvnode-test".into(),
        connect_timeout: Duration::from_secs(20),
        reply_timeout: Some(Duration::from_secs(60)),
        ..RemoteOptions::default()
    }
}

/// A raw authenticated connection (the test plays a remote engine byte by byte).
pub fn raw_connect(rn: &RemoteNode) -> TcpStream {
    let addr = kvnode::config::parse_tcp_url(&rn.url).unwrap();
    let s = TcpStream::connect(addr).unwrap();
    let token = Token::from_file(&rn.token_file).unwrap();
    let offer = ClientOffer {
        frames: FrameRange {
            min: VERSION,
            max: VERSION,
        },
        fabrics: FABRIC_TCP,
    };
    client_handshake(
        &s,
        Some(&token),
        "raw",
        &offer,
        Instant::now() + Duration::from_secs(20),
    )
    .unwrap();
    s
}

/// Reads one response frame (its header and payload; a trailer stays in the stream).
pub fn read_reply(s: &mut TcpStream) -> (FrameHeader, Response) {
    let mut h = [0u8; HEADER_BYTES];
    s.read_exact(&mut h).unwrap();
    let h = FrameHeader::decode(&h).unwrap();
    let mut p = rkyv::util::AlignedVec::<16>::new();
    p.resize(h.payload_len as usize, 0);
    s.read_exact(&mut p).unwrap();
    (h, decode_response(&p).unwrap())
}

/// Sends `req` as request `id` and reads its response (no trailer).
pub fn raw_call(s: &mut TcpStream, id: u64, req: &Request) -> Response {
    s.write_all(&encode_request(id, req).unwrap()).unwrap();
    let (h, r) = read_reply(s);
    assert_eq!(h.request_id, id);
    r
}
