//! The LMCache segment's backing, seen from a client: `kvnode lmcache-server` reports in
//! status (`pool_backing`) what a client mapping `/dev/shm/<name>` by name really gets
//! (its own `/proc/self/smaps`). With `--segment-bind-mount`, as root, the segment is on huge
//! pages (a hugetlbfs or huge tmpfs file bind-mounted at the name); a node killed with its
//! mount in place leaves it to the next node of that name, which removes exactly that mount;
//! nothing stays mounted after a clean stop; a node outside PID 1's mount namespace refuses the
//! opt-in, and a kernel that cannot make the mount falls back. Without the opt-in (or root, or
//! hugepages) the node makes no mount: /dev/shm's THP or 4 KiB pages with a warning.
//!
//! Every test restores what it changed on the host (the hugepage reservation, mounts at its own
//! segment names) in guards, also when it fails.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::lm::free_port;
use common::NodeStatus;

const POOL_BYTES: u64 = 64 << 20;
/// 2 MiB hugepages the tests reserve on top of what the host has (the 64 MiB pool needs 32).
const EXTRA_HUGEPAGES: u64 = 40;
const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

fn is_root() -> bool {
    kvnode_hw::effective_uid() == 0
}

/// Serialises this file's tests: each competes for the host's hugepages.
static HOST: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The file every kvnode test process locks (exclusive `flock`) around each read-modify-write
/// of `nr_hugepages` (hw/src/pool_tests.rs uses the same files): every change is relative (add
/// N, later take exactly the N added off), so concurrent test processes never drift the host's
/// value. The first one that can be opened is used (`/tmp` when `/run` is not writable).
const HUGEPAGES_LOCK_FILES: [&str; 2] = [
    "/run/kvnode-test-hugepages.lock",
    "/tmp/kvnode-test-hugepages.lock",
];

/// Runs `f` holding the cross-process hugepage lock (without it when no lock file can be
/// opened: then nr_hugepages is not writable either).
fn with_hugepages_lock<R>(f: impl FnOnce() -> R) -> R {
    let file = HUGEPAGES_LOCK_FILES.iter().find_map(|p| {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(p)
            .ok()
    });
    if let Some(file) = &file {
        // Bounded: another test process holds it only around one read-modify-write.
        if let Err(e) = kvnode_hw::lock_exclusive(file, std::time::Duration::from_secs(600)) {
            eprintln!("cannot lock the hugepage lock file: {e}");
        }
    }
    f()
}

fn read_nr_hugepages() -> Option<u64> {
    std::fs::read_to_string(NR_HUGEPAGES)
        .ok()
        .and_then(|t| t.trim().parse::<u64>().ok())
}

/// Raises `nr_hugepages` by some pages for the test (holding [`HOST`]) and takes exactly those
/// off again on drop (relative, under the cross-process lock, so another process's change
/// meanwhile is kept).
struct HugepageReservation {
    added: u64,
    _host: std::sync::MutexGuard<'static, ()>,
}

impl HugepageReservation {
    fn raise(more: u64) -> HugepageReservation {
        let host = HOST.lock().unwrap_or_else(|p| p.into_inner());
        let added = with_hugepages_lock(|| match read_nr_hugepages() {
            Some(old)
                if more > 0 && std::fs::write(NR_HUGEPAGES, (old + more).to_string()).is_ok() =>
            {
                read_nr_hugepages().unwrap_or(old).saturating_sub(old)
            }
            _ => 0,
        });
        HugepageReservation { added, _host: host }
    }
}

impl Drop for HugepageReservation {
    fn drop(&mut self) {
        if self.added == 0 {
            return;
        }
        with_hugepages_lock(|| {
            if let Some(now) = read_nr_hugepages() {
                let back = now.saturating_sub(self.added);
                if let Err(e) = std::fs::write(NR_HUGEPAGES, back.to_string()) {
                    eprintln!("could not lower {NR_HUGEPAGES} back to {back}: {e}");
                }
            }
        });
    }
}

/// The mounts whose mount point is `path` (from `/proc/self/mountinfo`).
fn mounts_at(path: &str) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.split(' ').nth(4) == Some(path))
        .map(str::to_owned)
        .collect()
}

/// A segment name of this test run; on drop, anything still mounted at its path is unmounted
/// and its files are removed (only reached when a test failed half-way).
struct SegmentName {
    shm_arg: String,
    path: String,
}

impl SegmentName {
    fn new(tag: &str) -> SegmentName {
        let shm_arg = format!("seg{}{tag}", std::process::id());
        let path = format!("/dev/shm/lmcache_l1_pool_{shm_arg}");
        SegmentName { shm_arg, path }
    }
}

impl Drop for SegmentName {
    fn drop(&mut self) {
        for _ in 0..8 {
            if mounts_at(&self.path).is_empty() {
                break;
            }
            let _ = Command::new("umount").args(["-l", &self.path]).status();
        }
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::remove_file(format!("{}.lock", self.path));
    }
}

/// A `kvnode lmcache-server` child, killed on drop (the segment guard cleans up after it).
struct Node {
    child: Child,
    socket: std::path::PathBuf,
    log: std::path::PathBuf,
    as_user: Option<u32>,
}

/// `setpriv` arguments that run a command as `uid` (its own group, no others).
fn setpriv_args(uid: u32) -> [String; 3] {
    [
        format!("--reuid={uid}"),
        format!("--regid={uid}"),
        "--clear-groups".into(),
    ]
}

/// How a test node is started.
#[derive(Default)]
struct Launch {
    /// Run as this user (`setpriv`).
    as_user: Option<u32>,
    /// Pass `--segment-bind-mount`.
    bind_mount: bool,
    /// Run in a new private mount namespace (`unshare -m`).
    unshare: bool,
    /// `LD_PRELOAD` this library.
    preload: Option<std::path::PathBuf>,
}

impl Launch {
    fn bind_mount() -> Launch {
        Launch {
            bind_mount: true,
            ..Launch::default()
        }
    }
}

impl Node {
    /// Starts a node serving `seg`, in `dir`, optionally as another user (`setpriv`).
    fn start(seg: &SegmentName, dir: &std::path::Path, as_user: Option<u32>) -> Node {
        Node::launch(
            seg,
            dir,
            Launch {
                as_user,
                ..Launch::default()
            },
        )
    }

    /// Starts a node serving `seg`, in `dir`, as `how` says.
    fn launch(seg: &SegmentName, dir: &std::path::Path, how: Launch) -> Node {
        let as_user = how.as_user;
        std::fs::create_dir_all(dir).unwrap();
        let socket = dir.join("native.sock");
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = dir.join(format!("node-{n}.log"));
        let bin = env!("CARGO_BIN_EXE_kvnode");
        let mut cmd = match (as_user, how.unshare) {
            (Some(uid), _) => {
                let mut c = Command::new("setpriv");
                c.args(setpriv_args(uid)).arg(bin);
                c
            }
            (None, true) => {
                // Without --fork, unshare execs the node: the child is the node itself.
                let mut c = Command::new("unshare");
                c.args(["--mount", "--propagation", "private"]).arg(bin);
                c
            }
            (None, false) => Command::new(bin),
        };
        if let Some(lib) = &how.preload {
            cmd.env("LD_PRELOAD", lib);
        }
        let child = cmd
            .args(["lmcache-server", "--host", "127.0.0.1", "--port"])
            .arg(free_port().to_string())
            .args(["--chunk-size", "16", "--l1-size-gb", "0.0625", "--shm-name"])
            .arg(&seg.shm_arg)
            .args(["--supported-transfer-mode", "engine_driven"])
            .arg("--socket")
            .arg(&socket)
            .args(how.bind_mount.then_some("--segment-bind-mount"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut node = Node {
            child,
            socket,
            log,
            as_user,
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        while node.try_status().is_none() {
            if let Ok(Some(st)) = node.child.try_wait() {
                panic!("lmcache-server exited ({st}): {}", node.log());
            }
            assert!(Instant::now() < deadline, "did not start: {}", node.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        node
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The node's status, asked as the node's own user (a client refuses a node of another
    /// user); `None` while it does not answer.
    fn try_status(&self) -> Option<serde_json::Value> {
        match self.as_user {
            None => kvnode::client::Client::connect(&self.socket)
                .ok()
                .map(|_| NodeStatus::of(&self.socket)),
            Some(uid) => {
                let out = Command::new("setpriv")
                    .args(setpriv_args(uid))
                    .arg(env!("CARGO_BIN_EXE_kvnode"))
                    .args(["status", "--json", "--socket"])
                    .arg(&self.socket)
                    .output()
                    .ok()?;
                if !out.status.success() {
                    return None;
                }
                serde_json::from_slice(&out.stdout).ok()
            }
        }
    }

    fn status(&self) -> serde_json::Value {
        self.try_status().expect("status")
    }

    /// SIGTERM, then waits (bounded) for the exit.
    fn stop(mut self) -> String {
        common::sigterm(&self.child);
        let st = common::wait_exit(&mut self.child, Duration::from_secs(60));
        assert!(
            st.is_some_and(|s| s.success()),
            "clean exit: {}",
            self.log()
        );
        self.log()
    }

    /// SIGKILL, then waits for the exit: the node dies without cleaning up.
    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a client mapping the segment by name sees in its own smaps, after touching every page.
#[derive(Debug)]
struct ClientPages {
    kernel_page_kb: u64,
    huge_kb: u64,
}

fn client_pages(name_arg: &str) -> (kvnode_hw::PoolMapping, ClientPages) {
    let name = format!("lmcache_l1_pool_{name_arg}");
    // shm_open by name (glibc: open("/dev/shm/<name>", O_NOFOLLOW)), as LMCache's SharedMemory.
    let m = kvnode_hw::PoolMapping::open_posix_shm(&name, POOL_BYTES).unwrap();
    let mut sum = 0u64;
    for off in (0..POOL_BYTES).step_by(4096) {
        let mut b = [0u8; 1];
        m.region().read_at(off, &mut b).unwrap();
        sum += u64::from(b[0]);
    }
    std::hint::black_box(sum);
    let head = format!("{:x}-", m.region().as_ptr() as usize);
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut found = false;
    let (mut kernel_page_kb, mut huge_kb) = (0, 0);
    for line in smaps.lines() {
        let first = line.split(' ').next().unwrap_or("");
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            found = line.starts_with(&head);
            continue;
        }
        if !found {
            continue;
        }
        let kb = |v: &str| -> u64 { v.trim().trim_end_matches("kB").trim().parse().unwrap() };
        if let Some((k, v)) = line.split_once(':') {
            match k {
                "KernelPageSize" => kernel_page_kb = kb(v),
                "ShmemPmdMapped" | "FilePmdMapped" | "Shared_Hugetlb" | "Private_Hugetlb" => {
                    huge_kb += kb(v)
                }
                _ => {}
            }
        }
    }
    (
        m,
        ClientPages {
            kernel_page_kb,
            huge_kb,
        },
    )
}

/// Asserts that status's `pool_backing` is what the client got.
fn assert_agrees(backing: &str, pages: &ClientPages, node: &Node) {
    let pool_kb = POOL_BYTES / 1024;
    match backing {
        "hugetlb-2m" => {
            assert_eq!(pages.kernel_page_kb, 2048, "{pages:?}");
            assert_eq!(pages.huge_kb, pool_kb, "{pages:?}");
        }
        "thp" => {
            assert_eq!(pages.kernel_page_kb, 4, "{pages:?}");
            assert!(pages.huge_kb * 2 >= pool_kb, "mostly huge: {pages:?}");
        }
        "4k" => {
            assert_eq!(pages.kernel_page_kb, 4, "{pages:?}");
            assert_eq!(pages.huge_kb, 0, "{pages:?}");
            let log = node.log();
            assert!(
                log.contains("WARN") && log.contains("4 KiB pages"),
                "the 4k fallback is warned about: {log}"
            );
        }
        other => panic!("unexpected pool_backing {other}"),
    }
}

/// The mode (octal, as `stat -c %a` prints it) of the placeholder file under the bind mount at
/// `path`, seen from a private mount namespace where that mount is removed; `None` when that
/// cannot be done.
fn placeholder_mode(path: &str) -> Option<String> {
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(r#"umount -l "$1" && stat -c %a "$1""#)
        .args(["sh", path])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// With `--segment-bind-mount`, as root (with hugepages reserved for the test), status says
/// hugepages and a client mapping
/// the name gets them; a clean stop leaves no mount and no file. Without root it falls back to
/// 4 KiB pages (or /dev/shm's THP) with a warning, and status still agrees with the client.
#[test]
fn status_reports_what_a_client_mapping_the_segment_by_name_gets() {
    let _reserve = HugepageReservation::raise(if is_root() { EXTRA_HUGEPAGES } else { 0 });
    let seg = SegmentName::new("status");
    let dir = std::env::temp_dir().join(format!("kvnode-seg-{}-status", std::process::id()));
    let node = Node::launch(&seg, &dir, Launch::bind_mount());
    let s = node.status();
    let backing = s["pool_backing"].as_str().unwrap().to_owned();
    let detail = s["pool_backing_detail"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    eprintln!("pool_backing {backing}: {detail}");
    let (client, pages) = client_pages(&seg.shm_arg);
    eprintln!("client: {pages:?}");
    assert_agrees(&backing, &pages, &node);
    if is_root() {
        assert_ne!(backing, "4k", "a root node gets huge pages: {detail}");
        if backing == "hugetlb-2m" {
            assert!(
                detail.contains("hugetlbfs") && detail.contains(&seg.path),
                "{detail}"
            );
            assert_eq!(mounts_at(&seg.path).len(), 1, "one bind mount");
            assert_eq!(
                placeholder_mode(&seg.path),
                Some("0".into()),
                "under the mount, the placeholder has mode 0000"
            );
        }
    }
    assert!(!detail.is_empty(), "status has pool_backing_detail: {s}");
    drop(client);
    node.stop();
    assert!(mounts_at(&seg.path).is_empty(), "unmounted at stop");
    assert!(
        std::fs::symlink_metadata(&seg.path).is_err(),
        "name removed"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A node killed with SIGKILL leaves its bind mount (holding its pages); the next node of the
/// same name removes that mount (and says so), serves a fresh segment that a client maps by
/// name, and leaves nothing behind at its own stop. A client of the dead node keeps its mapping.
#[test]
fn a_killed_nodes_mount_is_removed_by_the_next_node_of_its_name() {
    let _reserve = HugepageReservation::raise(if is_root() { 2 * EXTRA_HUGEPAGES } else { 0 });
    let seg = SegmentName::new("crash");
    let dir = std::env::temp_dir().join(format!("kvnode-seg-{}-crash", std::process::id()));
    let first = Node::launch(&seg, &dir, Launch::bind_mount());
    let (old_client, _) = client_pages(&seg.shm_arg);
    old_client
        .region()
        .write_at(0, b"before the crash")
        .unwrap();
    first.kill();
    let mounted = !mounts_at(&seg.path).is_empty();
    assert_eq!(mounted, is_root(), "a root node's mount outlives a SIGKILL");

    let second = Node::launch(&seg, &dir, Launch::bind_mount());
    if mounted {
        let log = second.log();
        assert!(
            log.contains("removed the bind mount a kvnode that died left"),
            "{log}"
        );
        assert_eq!(mounts_at(&seg.path).len(), 1, "only the new node's mount");
    }
    let s = second.status();
    let (client, pages) = client_pages(&seg.shm_arg);
    assert_agrees(s["pool_backing"].as_str().unwrap(), &pages, &second);
    let mut got = [0u8; 16];
    client.region().read_at(0, &mut got).unwrap();
    assert_eq!(got, [0u8; 16], "a fresh segment");
    old_client.region().read_at(0, &mut got).unwrap();
    assert_eq!(
        &got, b"before the crash",
        "the old client's mapping is intact"
    );
    drop((client, old_client));
    second.stop();
    assert!(mounts_at(&seg.path).is_empty());
    assert!(std::fs::symlink_metadata(&seg.path).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A node opted in to the bind mount that cannot mount (not root) falls back: 4 KiB pages of /dev/shm (or THP if
/// /dev/shm is mounted huge=) with a warning that names why, and status agrees with a client.
/// Run as `nobody` when the test runs as root; as is otherwise.
#[test]
fn without_root_the_segment_falls_back_with_a_warning() {
    let _host = HugepageReservation::raise(0);
    let seg = SegmentName::new("noroot");
    let dir = std::env::temp_dir().join(format!("kvnode-seg-{}-noroot", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let as_user = if is_root() {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let ok = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "true"])
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("skip: no setpriv to run the node without root");
            return;
        }
        Some(65534)
    } else {
        None
    };
    let node = Node::launch(
        &seg,
        &dir,
        Launch {
            as_user,
            bind_mount: true,
            ..Launch::default()
        },
    );
    let s = node.status();
    let backing = s["pool_backing"].as_str().unwrap().to_owned();
    let detail = s["pool_backing_detail"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(mounts_at(&seg.path).is_empty(), "no mount without root");
    let (client, pages) = client_pages(&seg.shm_arg);
    assert_agrees(&backing, &pages, &node);
    if backing == "4k" {
        assert!(
            detail.contains("needs root"),
            "the detail says why: {detail}"
        );
    }
    assert!(!detail.is_empty(), "status has pool_backing_detail: {s}");
    drop(client);
    node.stop();
    assert!(std::fs::symlink_metadata(&seg.path).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without `--segment-bind-mount` even a root node with hugepages free makes no mount (a client
/// in another mount namespace sharing /dev/shm must see the same file): /dev/shm's own pages,
/// THP when it is mounted huge=, else 4 KiB with a warning naming both ways to huge pages.
#[test]
fn without_the_opt_in_a_root_node_makes_no_mount() {
    let _reserve = HugepageReservation::raise(if is_root() { EXTRA_HUGEPAGES } else { 0 });
    let seg = SegmentName::new("default");
    let dir = std::env::temp_dir().join(format!("kvnode-seg-{}-default", std::process::id()));
    let node = Node::start(&seg, &dir, None);
    let s = node.status();
    let backing = s["pool_backing"].as_str().unwrap().to_owned();
    let detail = s["pool_backing_detail"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        mounts_at(&seg.path).is_empty(),
        "no bind mount without the opt-in: {backing} {detail}"
    );
    assert!(!backing.starts_with("hugetlb"), "{backing}: {detail}");
    let (client, pages) = client_pages(&seg.shm_arg);
    assert_agrees(&backing, &pages, &node);
    if backing == "4k" {
        let log = node.log();
        assert!(
            log.contains("--shm-huge") && log.contains("--segment-bind-mount"),
            "the warning names both ways to huge pages: {log}"
        );
    }
    drop(client);
    node.stop();
    assert!(std::fs::symlink_metadata(&seg.path).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A node opted in to the bind mount but running in a mount namespace of its own (as under
/// systemd's PrivateTmp, or `unshare -m`) refuses it with a warning saying why: its mount would
/// be invisible to clients outside, which would map an empty file. It serves /dev/shm's own
/// file, which a client of the host's namespace maps as status says.
#[test]
fn a_node_outside_pid1s_mount_namespace_refuses_the_bind_mount() {
    if !is_root() {
        eprintln!("skip: not root, so no mounts and no unshare");
        return;
    }
    let ok = Command::new("unshare")
        .args(["--mount", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skip: unshare --mount does not work here");
        return;
    }
    let _reserve = HugepageReservation::raise(EXTRA_HUGEPAGES);
    let seg = SegmentName::new("ns");
    let dir = std::env::temp_dir().join(format!("kvnode-seg-{}-ns", std::process::id()));
    let node = Node::launch(
        &seg,
        &dir,
        Launch {
            bind_mount: true,
            unshare: true,
            ..Launch::default()
        },
    );
    let log = node.log();
    assert!(
        log.contains("--segment-bind-mount refused") && log.contains("PID 1's mount namespace"),
        "{log}"
    );
    let node_mounts =
        std::fs::read_to_string(format!("/proc/{}/mountinfo", node.child.id())).unwrap();
    assert!(
        !node_mounts
            .lines()
            .any(|l| l.split(' ').nth(4) == Some(seg.path.as_str())),
        "no mount in the node's namespace either: {node_mounts}"
    );
    assert!(mounts_at(&seg.path).is_empty());
    let s = node.status();
    let backing = s["pool_backing"].as_str().unwrap().to_owned();
    assert!(!backing.starts_with("hugetlb"), "{s}");
    let (client, pages) = client_pages(&seg.shm_arg);
    assert_agrees(&backing, &pages, &node);
    drop(client);
    node.stop();
    assert!(std::fs::symlink_metadata(&seg.path).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

/// An `LD_PRELOAD` library making `syscall(SYS_open_tree, ...)` fail with `EINVAL`, as on
/// kernels before 6.15 (no bind mount of a detached mount's file).
const NO_OPEN_TREE_SHIM: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <sys/syscall.h>
#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
long syscall(long n, ...) {
    va_list ap;
    long a[6];
    va_start(ap, n);
    for (int i = 0; i < 6; i++) a[i] = va_arg(ap, long);
    va_end(ap);
    if (n == SYS_open_tree) { errno = EINVAL; return -1; }
    static long (*real)(long, ...);
    if (!real) real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    return real(n, a[0], a[1], a[2], a[3], a[4], a[5]);
}
"#;

/// On a kernel that cannot bind-mount the segment file (open_tree: EINVAL before Linux 6.15),
/// an opted-in root node still starts: each mount option's failure is warned about and the
/// chain goes on to /dev/shm's own pages; nothing of the failed options stays (no mount, the
/// segment is a plain 0600 file, no private hugepage file mapped), and status agrees with a
/// client.
#[test]
fn a_kernel_that_cannot_bind_mount_the_file_falls_back() {
    if !is_root() {
        eprintln!("skip: not root, so no mounts");
        return;
    }
    let dir = std::env::temp_dir().join(format!("kvnode-seg-{}-oldkernel", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("no_open_tree.c");
    let lib = dir.join("no_open_tree.so");
    std::fs::write(&src, NO_OPEN_TREE_SHIM).unwrap();
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .arg("-ldl")
        .status()
        .is_ok_and(|s| s.success());
    if !built {
        eprintln!("skip: no C compiler to build the LD_PRELOAD shim");
        return;
    }
    let _reserve = HugepageReservation::raise(EXTRA_HUGEPAGES);
    let seg = SegmentName::new("oldkernel");
    let node = Node::launch(
        &seg,
        &dir,
        Launch {
            bind_mount: true,
            preload: Some(lib),
            ..Launch::default()
        },
    );
    let log = node.log();
    assert!(
        log.contains("falling back") && log.contains("open_tree"),
        "each failed mount option is warned about: {log}"
    );
    assert!(mounts_at(&seg.path).is_empty(), "no mount left");
    let mode = std::fs::metadata(&seg.path).unwrap().permissions();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode) & 0o7777,
        0o600,
        "the segment is a plain file again"
    );
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", node.child.id())).unwrap();
    assert!(
        !maps.lines().any(|l| l.ends_with(" /segment")),
        "no private hugepage file stays mapped: {maps}"
    );
    let s = node.status();
    let backing = s["pool_backing"].as_str().unwrap().to_owned();
    assert!(!backing.starts_with("hugetlb"), "{s}");
    let (client, pages) = client_pages(&seg.shm_arg);
    assert_agrees(&backing, &pages, &node);
    drop(client);
    node.stop();
    assert!(std::fs::symlink_metadata(&seg.path).is_err());
    assert!(std::fs::symlink_metadata(format!("{}.lock", seg.path)).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}
