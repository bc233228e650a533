//! Test scaffolding shared by the integration tests: a real etcd process on free
//! loopback ports with a temporary data directory, stopped when dropped.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use moor::store::Store;

pub mod dev;
pub mod members;
pub mod proxy;

/// Which server speaks the etcd API to a test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `etcd` from the etcd-server package.
    Etcd,
    /// moor's embedded store, as the `moor-store` process.
    Embedded,
}

/// Runs each named `async fn NAME(backend: Backend)` as two tests, `etcd::NAME` and
/// `embedded::NAME`: what works on one server must work on the other.
#[macro_export]
macro_rules! both_stores {
    ($($name:ident),* $(,)?) => {
        mod etcd {
            $(#[tokio::test]
            async fn $name() {
                super::$name($crate::common::Backend::Etcd).await
            })*
        }
        mod embedded {
            $(#[tokio::test]
            async fn $name() {
                super::$name($crate::common::Backend::Embedded).await
            })*
        }
    };
}

/// A real etcd-API server (etcd, or moor-store) owned by one test.
pub struct Etcd {
    pub backend: Backend,
    /// The client URL (comma-separated URLs for an external cluster: as `--etcd` and
    /// `--endpoints` take them).
    pub client_url: String,
    /// Each endpoint.
    pub endpoints: Vec<String>,
    peer_url: String,
    data_dir: tempfile::TempDir,
    child: Option<Child>,
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    l.local_addr().expect("local addr").port()
}

impl Etcd {
    /// Starts etcd and waits until it answers.
    pub async fn start() -> Etcd {
        Etcd::start_on(Backend::Etcd).await
    }

    /// Starts the given server and waits until it answers.
    pub async fn start_on(backend: Backend) -> Etcd {
        let mut last_error = String::new();
        for _ in 0..3 {
            let client_url = format!("http://127.0.0.1:{}", free_port());
            let mut etcd = Etcd {
                backend,
                endpoints: vec![client_url.clone()],
                client_url,
                peer_url: format!("http://127.0.0.1:{}", free_port()),
                data_dir: tempfile::tempdir().expect("temp dir"),
                child: None,
            };
            match etcd.spawn().await {
                Ok(()) => return etcd,
                Err(e) => last_error = e,
            }
        }
        panic!("etcd did not start: {last_error}");
    }

    /// A cluster this harness did not start (such as [`members::Members`]): nothing to
    /// kill, pause or restart.
    pub fn external(endpoints: Vec<String>) -> Etcd {
        Etcd {
            backend: Backend::Etcd,
            client_url: endpoints.join(","),
            endpoints,
            peer_url: String::new(),
            data_dir: tempfile::tempdir().expect("temp dir"),
            child: None,
        }
    }

    fn log_path(&self) -> PathBuf {
        self.data_dir.path().join("etcd.log")
    }

    async fn spawn(&mut self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .map_err(|e| e.to_string())?;
        let mut cmd = match self.backend {
            Backend::Etcd => self.etcd_command(),
            Backend::Embedded => self.embedded_command(),
        };
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .map_err(|e| {
                format!(
                    "cannot run {:?} (is etcd-server installed?): {e}",
                    cmd.get_program()
                )
            })?;
        self.child = Some(child);
        self.wait_ready().await
    }

    fn embedded_command(&self) -> Command {
        let mut cmd = Command::new(bin("moor-store"));
        cmd.arg("--listen")
            .arg(self.client_url.trim_start_matches("http://"))
            .arg("--data-dir")
            .arg(self.data_dir.path().join("data"));
        cmd
    }

    fn etcd_command(&self) -> Command {
        let mut cmd = Command::new(need("etcd"));
        cmd.arg("--name=test")
            .arg(format!(
                "--data-dir={}",
                self.data_dir.path().join("data").display()
            ))
            .arg(format!("--listen-client-urls={}", self.client_url))
            .arg(format!("--advertise-client-urls={}", self.client_url))
            .arg(format!("--listen-peer-urls={}", self.peer_url))
            .arg(format!("--initial-advertise-peer-urls={}", self.peer_url))
            .arg(format!("--initial-cluster=test={}", self.peer_url));
        cmd
    }

    async fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
                return Err(format!("etcd exited with {status}: {}", tail(&log)));
            }
            if let Ok(mut client) = etcd_client::Client::connect([&self.client_url], None).await {
                if client.get("health-check", None).await.is_ok() {
                    return Ok(());
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.kill();
        Err("etcd did not answer within 30 s".into())
    }

    /// Kills etcd with SIGKILL, as a crash would.
    /// Pauses (SIGSTOP) or resumes (SIGCONT) the server: its clients' requests wait.
    pub fn pause(&self, paused: bool) {
        if let Some(child) = &self.child {
            let signal = if paused { "-STOP" } else { "-CONT" };
            let ok = std::process::Command::new("kill")
                .args([signal, &child.id().to_string()])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "kill {signal} the server");
        }
    }

    /// The server's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts etcd again on the same ports and data.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await.expect("etcd restarts");
    }

    /// Saves a snapshot of the server's data to `file` (`etcdctl snapshot save`).
    pub fn snapshot_save(&self, file: &Path) {
        let out = Command::new(need("etcdctl"))
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", self.client_url))
            .args(["snapshot", "save"])
            .arg(file)
            .output()
            .expect("run etcdctl");
        assert!(
            out.status.success(),
            "etcdctl snapshot save: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Stops etcd, restores `file` into a fresh data dir as etcd's documentation says
    /// (`etcdctl snapshot restore`, the same member name and peer URL), and starts etcd
    /// on it on the same ports. Debian's etcd 3.4 restores without moving revisions
    /// forward: the restored server's revision is the snapshot's.
    pub async fn restore(&mut self, file: &Path) {
        assert_eq!(self.backend, Backend::Etcd, "only etcd restores snapshots");
        self.kill();
        let data = self.data_dir.path().join("data");
        std::fs::rename(&data, self.data_dir.path().join("data.before-restore"))
            .expect("move the old data dir aside");
        let out = Command::new(need("etcdctl"))
            .env("ETCDCTL_API", "3")
            .args(["snapshot", "restore"])
            .arg(file)
            .arg(format!("--data-dir={}", data.display()))
            .arg("--name=test")
            .arg(format!("--initial-cluster=test={}", self.peer_url))
            .arg(format!("--initial-advertise-peer-urls={}", self.peer_url))
            .output()
            .expect("run etcdctl");
        assert!(
            out.status.success(),
            "etcdctl snapshot restore: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.spawn()
            .await
            .expect("etcd starts on the restored data");
    }

    /// A store on this etcd under a prefix.
    pub async fn store(&self, prefix: &str) -> Store {
        Store::connect(&self.endpoints, prefix)
            .await
            .expect("connect to etcd")
    }

    /// A raw client, for writing what moor never would (garbage values).
    pub async fn raw_client(&self) -> etcd_client::Client {
        etcd_client::Client::connect([&self.client_url], None)
            .await
            .expect("connect to etcd")
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

fn tail(s: &str) -> &str {
    let start = s.len().saturating_sub(2000);
    let start = (start..s.len())
        .find(|i| s.is_char_boundary(*i))
        .unwrap_or(s.len());
    &s[start..]
}

/// A typed key from its whole text (`volumes/default/v1`), as a test names an object.
#[allow(dead_code)]
pub fn key<S: moor::api::Spec>(key: &str) -> moor::api::ObjectKey<S> {
    moor::api::ObjectKey::parse(key).unwrap_or_else(|e| panic!("{e}"))
}

/// `cmd`, an external program a test runs, checked to be installed: a missing one fails
/// the test with the one command that installs it (a test never skips for want of it).
pub fn need(cmd: &'static str) -> &'static str {
    let package = match cmd {
        "etcd" => "etcd-server",
        "etcdctl" => "etcd-client",
        "busybox" => "busybox-static",
        "dockerd" => "docker.io",
        "systemd-analyze" => "systemd",
        other => other,
    };
    let found = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(cmd).is_file()));
    assert!(
        found,
        "{cmd} is not installed; install it with `sudo apt-get install -y {package}` \
         (or run the tests with `bash tests/run.sh`, which installs what they need)"
    );
    cmd
}

/// Where cargo put the workspace's binaries; builds them if a partial test run did not.
pub fn bin(name: &str) -> PathBuf {
    static BUILD: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target dir")
        .to_path_buf();
    let path = dir.join(name);
    // Cargo rebuilds only this package's binaries for its tests: make sure the other
    // packages' binaries are current too (a no-op when they are), once per process.
    static BUILT: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    let _g = BUILD.lock().unwrap_or_else(|p| p.into_inner());
    BUILT.get_or_init(|| {
        let status = std::process::Command::new(env!("CARGO"))
            .args([
                "build",
                "-p",
                "moor-controllers",
                "-p",
                "moor-hostpath",
                "-p",
                "moorctl",
                "-p",
                "moor-embedded",
                "--bins",
            ])
            .status()
            .expect("run cargo build");
        assert!(status.success(), "building the workspace binaries");
    });
    path
}

/// Waits for `cond` to hold, polling, or panics with `what` after `timeout`.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if cond().await {
            return;
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// GETs `path` from a daemon's HTTP server at `addr`; returns the whole answer.
pub async fn http_get(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// The value of the sample `series` (name and labels, as exposed) in a metrics page.
pub fn metric(page: &str, series: &str) -> Option<f64> {
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

/// Counts the puts under `prefix` (a full key prefix), by key, from now on, through a
/// watch of its own (etcd's count of writes, whatever wrote them).
pub async fn count_puts(
    url: &str,
    prefix: &str,
) -> std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, usize>>> {
    use etcd_client::{EventType, WatchOptions};
    let counts: std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, usize>>> =
        Default::default();
    let mut client = etcd_client::Client::connect([url], None).await.unwrap();
    let mut stream = client
        .watch(prefix, Some(WatchOptions::new().with_prefix()))
        .await
        .unwrap();
    let c = counts.clone();
    tokio::spawn(async move {
        while let Ok(Some(resp)) = stream.message().await {
            for e in resp.events() {
                if let (EventType::Put, Some(kv)) = (e.event_type(), e.kv()) {
                    let key = String::from_utf8_lossy(kv.key()).into_owned();
                    *c.lock().unwrap().entry(key).or_default() += 1;
                }
            }
        }
    });
    counts
}

/// Every leaf of moorctl's command tree, read from its own `--help` (the "Commands:"
/// section of each command, recursively), so a verb added later is found here too.
pub fn moorctl_verbs() -> Vec<Vec<String>> {
    fn walk(path: Vec<String>, out: &mut Vec<Vec<String>>) {
        let help = Command::new(bin("moorctl"))
            .args(&path)
            .arg("--help")
            .output()
            .expect("moorctl --help");
        let text = String::from_utf8_lossy(&help.stdout).into_owned();
        let subs: Vec<String> = text
            .split("\nCommands:\n")
            .nth(1)
            .map(|rest| {
                rest.lines()
                    .take_while(|l| !l.trim().is_empty())
                    .filter_map(|l| l.split_whitespace().next().map(String::from))
                    .filter(|c| c != "help")
                    .collect()
            })
            .unwrap_or_default();
        if subs.is_empty() {
            out.push(path.clone());
        }
        for sub in subs {
            let mut p = path.clone();
            p.push(sub);
            walk(p, out);
        }
    }
    let mut out = Vec::new();
    walk(Vec::new(), &mut out);
    out
}

pub mod fixtures {
    use moor::api::*;

    pub fn volume(name: &str) -> Volume {
        let spec = VolumeSpec {
            plugin_id: PluginId::new("hostpath.moor.dev").unwrap(),
            capacity_min: Some(Size(1 << 30)),
            capabilities: vec![VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::FileSystem,
            }],
            ..Default::default()
        };
        Volume::new(&Namespace::default_ns(), Name::new(name).unwrap(), spec)
    }
}

/// POSTs `body` (raw bytes) to `path` over the unix socket, with `content_type` if
/// any (Docker sends none); returns the status and the body as JSON.
pub async fn post_raw(
    sock: &std::path::Path,
    path: &str,
    content_type: Option<&str>,
    body: &[u8],
) -> (u16, serde_json::Value) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::UnixStream::connect(sock)
        .await
        .expect("connect to the endpoint");
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: plugin\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(ct) = content_type {
        head.push_str(&format!("Content-Type: {ct}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).await.unwrap();
    // A server may answer (and close) before it has read an oversized body.
    let _ = s.write_all(body).await;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    let text = String::from_utf8_lossy(&out);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    let value =
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {body:?}"));
    (status, value)
}

pub fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&after[..n]);
        rest = &after[n + 2..];
    }
    out
}

/// The mount points at or below `dir` (this process's mount namespace), sorted.
pub fn mounts_below(dir: &Path) -> Vec<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut points: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(PathBuf::from)
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort();
    points
}

/// Unmounts (lazily, deepest first) every mount at or below `dir`: what a test's
/// plugins made and did not undo, so that the directory goes and nothing accumulates
/// on the machine, pass or fail.
pub fn unmount_below(dir: &Path) {
    for m in mounts_below(dir).iter().rev() {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(m)
            .status();
    }
}
