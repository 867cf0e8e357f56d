//! Pre-shared tokens for the TCP listener: loading a token file with ssh-like permission checks,
//! generating one, deriving the key, and the two MACs of the handshake
//! ([`super::handshake`]).
//!
//! The token itself never leaves this module: [`Token`] keeps only the key derived from it
//! (`K = blake3::derive_key(KEY_CONTEXT, token)`), the raw bytes are overwritten as soon as the key
//! exists, and the key is overwritten when the `Token` is dropped (best effort: the compiler is
//! told the zeroed buffer is observed, there is no `unsafe` volatile write outside `hw/`).
//! MACs are compared as [`blake3::Hash`], whose `==` is constant time.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use crate::error::{Error, ErrorKind, Result};

/// The shortest accepted token, in bytes after trimming trailing whitespace (a generated token is
/// 64 hex characters: 256 bits).
pub const TOKEN_MIN_BYTES: usize = 32;
/// The longest accepted token file, in bytes (the file is read with this bound, never more).
pub const TOKEN_MAX_BYTES: usize = 4096;
/// Random bytes in a generated token (written hex-encoded, so the file holds twice as many
/// characters plus a newline).
pub const GENERATED_TOKEN_BYTES: usize = 32;
/// The `blake3::derive_key` context that turns token bytes into the MAC key. Changing it changes
/// every MAC: it is part of the wire format (handshake version 1).
pub const KEY_CONTEXT: &str = "kvnode tcp token v1";
/// Domain-separation label of the client's MAC.
pub const CLIENT_LABEL: &[u8] = b"kvnode-auth/v1/client";
/// Domain-separation label of the node's MAC.
pub const SERVER_LABEL: &[u8] = b"kvnode-auth/v1/server";

/// A loaded token. Invariant: holds only the derived 32-byte key (never the token bytes), which
/// is overwritten on drop; `Debug` prints nothing secret; it is deliberately not `Clone`.
pub struct Token {
    key: [u8; 32],
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl Drop for Token {
    fn drop(&mut self) {
        wipe(&mut self.key);
    }
}

/// Overwrites `buf` with zeros and tells the optimizer the zeros are observed (so the writes are
/// not removed as dead stores).
fn wipe(buf: &mut [u8]) {
    buf.fill(0);
    std::hint::black_box(&*buf);
}

/// Length of `bytes` without trailing ASCII whitespace (spaces, tabs, CR, LF...).
fn trimmed_len(bytes: &[u8]) -> usize {
    bytes
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(0, |i| i + 1)
}

impl Token {
    /// A token from its bytes, used as given (no trimming). Errors (`InvalidRequest`) when it is
    /// shorter than [`TOKEN_MIN_BYTES`] or longer than [`TOKEN_MAX_BYTES`]. The caller's buffer is
    /// not modified; wipe it yourself if it matters.
    pub fn from_bytes(bytes: &[u8]) -> Result<Token> {
        if bytes.len() < TOKEN_MIN_BYTES {
            return Err(Error::invalid(format!(
                "the token is {} bytes; at least {TOKEN_MIN_BYTES} are required (`kvnode token generate FILE` writes a good one)",
                bytes.len()
            )));
        }
        if bytes.len() > TOKEN_MAX_BYTES {
            return Err(Error::invalid(format!(
                "the token is {} bytes; at most {TOKEN_MAX_BYTES} are accepted",
                bytes.len()
            )));
        }
        Ok(Token {
            key: blake3::derive_key(KEY_CONTEXT, bytes),
        })
    }

    /// Loads the token in `path`: trailing whitespace is trimmed, the rest must be
    /// [`TOKEN_MIN_BYTES`]..=[`TOKEN_MAX_BYTES`] bytes (`InvalidRequest` otherwise). Like ssh, the
    /// file must be a regular file owned by this process's effective uid and neither readable nor
    /// writable by group or others (`PermissionDenied`, naming the path, the owner or the mode).
    /// The checks use the opened file (`fstat`), so a swapped path cannot slip past them.
    pub fn from_file(path: &Path) -> Result<Token> {
        let shown = path.display();
        // O_NONBLOCK: a FIFO planted at the path must not hang the node at open (it is then
        // refused as not a regular file); regular files ignore the flag.
        let mut f = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| {
                Error::new(
                    if e.kind() == std::io::ErrorKind::PermissionDenied {
                        ErrorKind::PermissionDenied
                    } else {
                        ErrorKind::Io
                    },
                    format!("cannot open token file {shown}: {e}"),
                )
            })?;
        let meta = f.metadata().map_err(|e| {
            Error::new(
                ErrorKind::Io,
                format!("cannot stat token file {shown}: {e}"),
            )
        })?;
        if !meta.is_file() {
            return Err(Error::invalid(format!(
                "token file {shown} is not a regular file"
            )));
        }
        let euid = rustix::process::geteuid().as_raw();
        if meta.uid() != euid {
            return Err(Error::denied(format!(
                "token file {shown} is owned by uid {}, not by this process's uid {euid}; refusing to use it",
                meta.uid()
            )));
        }
        let mode = meta.mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(Error::denied(format!(
                "token file {shown} has mode {mode:04o}: it must not be readable or writable by group or others (chmod 600 {shown})"
            )));
        }
        // A fixed buffer (no reallocation leaves copies behind), one byte larger than the limit
        // so an oversized file is detected without reading it whole.
        let mut buf = [0u8; TOKEN_MAX_BYTES + 1];
        let mut n = 0;
        let read = loop {
            if n == buf.len() {
                break Ok(());
            }
            match f.read(&mut buf[n..]) {
                Ok(0) => break Ok(()),
                Ok(k) => n += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
        };
        let result = match read {
            Err(e) => Err(Error::new(
                ErrorKind::Io,
                format!("cannot read token file {shown}: {e}"),
            )),
            Ok(()) if n > TOKEN_MAX_BYTES => Err(Error::invalid(format!(
                "token file {shown} is larger than {TOKEN_MAX_BYTES} bytes"
            ))),
            Ok(()) => Token::from_bytes(&buf[..trimmed_len(&buf[..n])])
                .map_err(|e| e.context(format!("token file {shown}"))),
        };
        wipe(&mut buf);
        result
    }

    /// Whether `other` was derived from the same token (compared in constant time).
    pub fn same_as(&self, other: &Token) -> bool {
        blake3::Hash::from(self.key) == blake3::Hash::from(other.key)
    }

    /// The client's proof: `keyed_hash(K, CLIENT_LABEL || transcript || fabric_le)`.
    pub fn client_mac(&self, transcript: &[u8; 32], fabric: u16) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(CLIENT_LABEL);
        h.update(transcript);
        h.update(&fabric.to_le_bytes());
        h.finalize()
    }

    /// The node's proof: `keyed_hash(K, SERVER_LABEL || transcript || mac_c || fabric_le ||
    /// role)`; it binds the node's answer to the client's proof, the fabric and the granted role.
    pub fn server_mac(
        &self,
        transcript: &[u8; 32],
        mac_c: &[u8; 32],
        fabric: u16,
        role: u8,
    ) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(SERVER_LABEL);
        h.update(transcript);
        h.update(mac_c);
        h.update(&fabric.to_le_bytes());
        h.update(&[role]);
        h.finalize()
    }
}

/// The handshake transcript `T = blake3(ClientHello bytes || ServerHello bytes)`, both exactly as
/// they crossed the wire: both MACs cover it, so both nonces and every negotiated field are bound.
pub fn transcript(client_hello: &[u8], server_hello: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(client_hello);
    h.update(server_hello);
    *h.finalize().as_bytes()
}

/// Fills `buf` from the kernel's random source (`/dev/urandom`, the same source as the node's
/// other keys; no fallback: a nonce or a token must be unpredictable or not exist).
pub fn os_random(buf: &mut [u8]) -> std::io::Result<()> {
    File::open("/dev/urandom")?.read_exact(buf)
}

/// Writes a new token file at `path`: [`GENERATED_TOKEN_BYTES`] random bytes, hex-encoded, and a
/// newline, in a file created exclusively (`O_EXCL`, never following or replacing anything that
/// exists) with mode 0600. Errors name the path; an existing file is refused (`InvalidRequest`)
/// and left untouched; a partly written file is removed.
pub fn generate_token_file(path: &Path) -> Result<()> {
    let shown = path.display();
    let mut raw = [0u8; GENERATED_TOKEN_BYTES];
    os_random(&mut raw).map_err(|e| {
        Error::new(
            ErrorKind::Io,
            format!("cannot read random bytes for token file {shown}: {e}"),
        )
    })?;
    let mut text = [0u8; 2 * GENERATED_TOKEN_BYTES + 1];
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for (i, b) in raw.iter().enumerate() {
        text[2 * i] = HEX[usize::from(b >> 4)];
        text[2 * i + 1] = HEX[usize::from(b & 0xf)];
    }
    text[2 * GENERATED_TOKEN_BYTES] = b'\n';
    wipe(&mut raw);
    let created = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path);
    let mut f = match created {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            wipe(&mut text);
            return Err(Error::invalid(format!(
                "token file {shown} already exists; refusing to overwrite it"
            )));
        }
        Err(e) => {
            wipe(&mut text);
            return Err(Error::new(
                ErrorKind::Io,
                format!("cannot create token file {shown}: {e}"),
            ));
        }
    };
    // Exactly 0600 whatever the umask left.
    let written = f
        .set_permissions(std::fs::Permissions::from_mode(0o600))
        .and_then(|()| f.write_all(&text))
        .and_then(|()| f.sync_all());
    wipe(&mut text);
    if let Err(e) = written {
        drop(f);
        let _ = std::fs::remove_file(path);
        return Err(Error::new(
            ErrorKind::Io,
            format!("cannot write token file {shown}: {e}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A fresh private directory under the system temp dir, removed on drop.
    struct Dir(PathBuf);
    impl Dir {
        fn new() -> Dir {
            static N: AtomicU32 = AtomicU32::new(0);
            let p = std::env::temp_dir().join(format!(
                "kvnode-auth-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn write_mode(path: &Path, bytes: &[u8], mode: u32) {
        std::fs::write(path, bytes).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    const T32: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn same_key(a: &Token, b: &Token) -> bool {
        assert_eq!(
            a.same_as(b),
            a.client_mac(&[7; 32], 1) == b.client_mac(&[7; 32], 1)
        );
        a.same_as(b)
    }

    #[test]
    fn trailing_newline_and_spaces_are_trimmed() {
        let d = Dir::new();
        let p = d.0.join("t");
        write_mode(&p, b"0123456789abcdef0123456789abcdef \t\r\n\n", 0o600);
        let t = Token::from_file(&p).unwrap();
        assert!(same_key(&t, &Token::from_bytes(T32).unwrap()));
        // Leading whitespace is part of the token.
        write_mode(&p, b" 0123456789abcdef0123456789abcdef\n", 0o600);
        assert!(!same_key(
            &Token::from_file(&p).unwrap(),
            &Token::from_bytes(T32).unwrap()
        ));
    }

    #[test]
    fn group_or_other_access_is_refused_naming_path_and_mode() {
        let d = Dir::new();
        let p = d.0.join("t");
        for mode in [0o644, 0o640, 0o604, 0o620, 0o602, 0o660] {
            write_mode(&p, T32, mode);
            let e = Token::from_file(&p).unwrap_err();
            assert_eq!(e.kind, ErrorKind::PermissionDenied, "{mode:o}");
            assert!(e.to_string().contains(&p.display().to_string()), "{e}");
            assert!(e.to_string().contains(&format!("{mode:04o}")), "{e}");
        }
        write_mode(&p, T32, 0o400);
        Token::from_file(&p).unwrap();
    }

    #[test]
    fn a_file_owned_by_another_uid_is_refused() {
        let d = Dir::new();
        let p = d.0.join("t");
        write_mode(&p, T32, 0o600);
        let euid = rustix::process::geteuid().as_raw();
        if euid == 0 {
            std::os::unix::fs::chown(&p, Some(65534), None).unwrap();
            let e = Token::from_file(&p).unwrap_err();
            assert_eq!(e.kind, ErrorKind::PermissionDenied);
            assert!(e.to_string().contains("owned by uid 65534"), "{e}");
        } else {
            // Not root: a root-owned file is another uid's file.
            let e = Token::from_file(Path::new("/etc/hostname")).unwrap_err();
            assert_eq!(e.kind, ErrorKind::PermissionDenied, "{e}");
        }
    }

    #[test]
    fn short_long_missing_and_directory_are_refused() {
        let d = Dir::new();
        let p = d.0.join("t");
        write_mode(&p, b"0123456789abcdef0123456789abcde\n", 0o600);
        let e = Token::from_file(&p).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
        assert!(e.to_string().contains("31 bytes"), "{e}");
        assert!(e.to_string().contains(&p.display().to_string()), "{e}");
        write_mode(&p, &vec![b'a'; TOKEN_MAX_BYTES + 1], 0o600);
        let e = Token::from_file(&p).unwrap_err();
        assert!(e.to_string().contains("larger than 4096"), "{e}");
        write_mode(&p, &vec![b'a'; TOKEN_MAX_BYTES], 0o600);
        Token::from_file(&p).unwrap();
        let e = Token::from_file(&d.0.join("missing")).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Io);
        assert!(e.to_string().contains("missing"), "{e}");
        std::fs::set_permissions(&d.0, std::fs::Permissions::from_mode(0o700)).unwrap();
        let e = Token::from_file(&d.0).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        // A FIFO is refused at once, not waited on.
        let fifo = d.0.join("fifo");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let e = Token::from_file(&fifo).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        assert!(Token::from_bytes(&T32[..31]).is_err());
    }

    #[test]
    fn generate_writes_0600_hex_and_refuses_to_overwrite() {
        let d = Dir::new();
        let p = d.0.join("new-token");
        generate_token_file(&p).unwrap();
        let meta = std::fs::metadata(&p).unwrap();
        assert_eq!(meta.mode() & 0o7777, 0o600);
        let text = std::fs::read_to_string(&p).unwrap();
        assert_eq!(text.len(), 2 * GENERATED_TOKEN_BYTES + 1);
        assert!(text.ends_with('\n'));
        assert!(text.trim_end().bytes().all(|b| b.is_ascii_hexdigit()));
        let t = Token::from_file(&p).unwrap();
        assert!(same_key(
            &t,
            &Token::from_bytes(text.trim_end().as_bytes()).unwrap()
        ));
        let e = generate_token_file(&p).unwrap_err();
        assert!(e.to_string().contains("already exists"), "{e}");
        assert!(e.to_string().contains(&p.display().to_string()), "{e}");
        assert_eq!(std::fs::read_to_string(&p).unwrap(), text, "left untouched");
        // Two generated tokens differ.
        let q = d.0.join("other");
        generate_token_file(&q).unwrap();
        assert_ne!(std::fs::read_to_string(&q).unwrap(), text);
        // A dangling symlink is not followed.
        let l = d.0.join("link");
        std::os::unix::fs::symlink(d.0.join("target"), &l).unwrap();
        assert!(generate_token_file(&l).is_err());
        assert!(!d.0.join("target").exists());
    }

    #[test]
    fn debug_prints_nothing_secret() {
        let t = Token::from_bytes(T32).unwrap();
        let s = format!("{t:?}");
        assert_eq!(s, "Token(<redacted>)");
    }

    #[test]
    fn key_derivation_is_pinned() {
        // K = blake3::derive_key("kvnode tcp token v1", token): part of the wire format.
        let t = Token::from_bytes(T32).unwrap();
        let k = blake3::derive_key(KEY_CONTEXT, T32);
        assert_eq!(t.key, k);
        assert_eq!(
            blake3::Hash::from(k).to_hex().as_str(),
            "f9eb1343175ee92268988d07ee1aeb5c3d0eaf3ed6020db6726c5027266d7322"
        );
    }
}
