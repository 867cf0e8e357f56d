//! The LMCache segment's backing, seen from a client: `kvnode lmcache-server` reports in
//! status (`pool_backing`) what a client mapping `/dev/shm/<name>` by name really gets
//! (its own `/proc/self/smaps`); as root the segment is on huge pages (a hugetlbfs or huge
//! tmpfs file bind-mounted at the name); a node killed with its mount in place leaves it to the
//! next node of that name, which removes exactly that mount; and nothing stays mounted after a
//! clean stop. Without root (or hugepages) the node falls back to 4 KiB pages with a warning.
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

/// Serialises this file's tests: each changes the host's hugepage reservation.
static HOST: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn read_nr_hugepages() -> Option<u64> {
    std::fs::read_to_string(NR_HUGEPAGES)
        .ok()
        .and_then(|t| t.trim().parse::<u64>().ok())
}

/// Raises `nr_hugepages` by some pages for the test (holding [`HOST`]) and takes exactly those
/// off again on drop (relative, so another process's change meanwhile is kept).
struct HugepageReservation {
    added: u64,
    _host: std::sync::MutexGuard<'static, ()>,
}

impl HugepageReservation {
    fn raise(more: u64) -> HugepageReservation {
        let host = HOST.lock().unwrap_or_else(|p| p.into_inner());
        let added = match read_nr_hugepages() {
            Some(old)
                if more > 0 && std::fs::write(NR_HUGEPAGES, (old + more).to_string()).is_ok() =>
            {
                read_nr_hugepages().unwrap_or(old).saturating_sub(old)
            }
            _ => 0,
        };
        HugepageReservation { added, _host: host }
    }
}

impl Drop for HugepageReservation {
    fn drop(&mut self) {
        if self.added == 0 {
            return;
        }
        if let Some(now) = read_nr_hugepages() {
            let back = now.saturating_sub(self.added);
            if let Err(e) = std::fs::write(NR_HUGEPAGES, back.to_string()) {
                eprintln!("could not lower {NR_HUGEPAGES} back to {back}: {e}");
            }
        }
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

impl Node {
    /// Starts a node serving `seg`, in `dir`, optionally as another user (`setpriv`).
    fn start(seg: &SegmentName, dir: &std::path::Path, as_user: Option<u32>) -> Node {
        std::fs::create_dir_all(dir).unwrap();
        let socket = dir.join("native.sock");
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = dir.join(format!("node-{n}.log"));
        let bin = env!("CARGO_BIN_EXE_kvnode");
        let mut cmd = match as_user {
            Some(uid) => {
                let mut c = Command::new("setpriv");
                c.args(setpriv_args(uid)).arg(bin);
                c
            }
            None => Command::new(bin),
        };
        let child = cmd
            .args(["lmcache-server", "--host", "127.0.0.1", "--port"])
            .arg(free_port().to_string())
            .args(["--chunk-size", "16", "--l1-size-gb", "0.0625", "--shm-name"])
            .arg(&seg.shm_arg)
            .args(["--supported-transfer-mode", "engine_driven"])
            .arg("--socket")
            .arg(&socket)
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

/// As root (with hugepages reserved for the test), status says hugepages and a client mapping
/// the name gets them; a clean stop leaves no mount and no file. Without root it falls back to
/// 4 KiB pages (or /dev/shm's THP) with a warning, and status still agrees with the client.
#[test]
fn status_reports_what_a_client_mapping_the_segment_by_name_gets() {
    let _reserve = HugepageReservation::raise(if is_root() { EXTRA_HUGEPAGES } else { 0 });
    let seg = SegmentName::new("status");
    let dir = std::env::temp_dir().join(format!("kvnode-seg-{}-status", std::process::id()));
    let node = Node::start(&seg, &dir, None);
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
    let first = Node::start(&seg, &dir, None);
    let (old_client, _) = client_pages(&seg.shm_arg);
    old_client
        .region()
        .write_at(0, b"before the crash")
        .unwrap();
    first.kill();
    let mounted = !mounts_at(&seg.path).is_empty();
    assert_eq!(mounted, is_root(), "a root node's mount outlives a SIGKILL");

    let second = Node::start(&seg, &dir, None);
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

/// A node that cannot mount (not root) falls back: 4 KiB pages of /dev/shm (or THP if
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
    let node = Node::start(&seg, &dir, as_user);
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
