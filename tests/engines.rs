//! Real container engines ask moor for volumes (issue 38): Podman and Docker through
//! the volume-plugin endpoint of a node's agent (a real etcd, `moord controller`, agents,
//! moor-hostpath), its containers writing and reading a CSI volume; the plugins' call
//! logs are checked against the invariants. Podman runs with its own storage under the
//! test's directory, runc and cgroupfs; Docker is a dockerd of the test's own (its
//! socket, data and exec roots, no network) finding the endpoint by a spec file in
//! /etc/docker/plugins (../shared/CONTAINERS.md: this machine kind's recipes); both
//! run an image made from busybox.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::Cluster;
use moor::api::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

/// Podman with its storage, configuration and the moor endpoint of node `node`.
struct Podman {
    root: PathBuf,
    conf: PathBuf,
}

impl Podman {
    fn new(c: &Cluster, node: &str, timeout_s: u64) -> Podman {
        Podman::on_socket(c, node, timeout_s, "moor.sock")
    }

    /// Podman whose `moor` driver is the endpoint socket `socket` of node `node`.
    fn on_socket(c: &Cluster, node: &str, timeout_s: u64, socket: &str) -> Podman {
        common::need("podman");
        common::need("runc");
        let root = c.dir.path().join(format!("podman-{node}"));
        std::fs::create_dir_all(&root).unwrap();
        let conf = root.join("containers.conf");
        std::fs::write(
            &conf,
            format!(
                "[engine]\nvolume_plugin_timeout = {timeout_s}\nruntime = \"runc\"\ncgroup_manager = \"cgroupfs\"\n\n[engine.volume_plugins]\nmoor = \"{}\"\n",
                c.node(node).dir.join(socket).display()
            ),
        )
        .unwrap();
        let p = Podman { root, conf };
        p.import_busybox();
        p
    }

    fn cmd(&self) -> Command {
        let mut cmd = Command::new("podman");
        cmd.env("CONTAINERS_CONF", &self.conf)
            .arg("--root")
            .arg(self.root.join("storage"))
            .arg("--runroot")
            .arg(self.root.join("run"))
            .args(["--runtime", "runc", "--cgroup-manager", "cgroupfs"]);
        cmd
    }

    fn run(&self, args: &[&str]) -> Output {
        let out = self.cmd().args(args).output().expect("run podman");
        eprintln!(
            "$ podman {}\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(out.status.success(), "podman {args:?} failed");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A container of the busybox image with volume `volume` at /data.
    fn container(&self, volume: &str, script: &str) -> Output {
        self.run(&[
            "run",
            "--rm",
            "--network",
            "none",
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=1024:1024",
            "-v",
            &format!("{volume}:/data"),
            "localhost/bb",
            "sh",
            "-c",
            script,
        ])
    }

    fn import_busybox(&self) {
        let busybox = Path::new(common::need("busybox"));
        let rootfs = self.root.join("rootfs");
        let bin = rootfs.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let which = Command::new("sh")
            .args(["-c", "command -v busybox"])
            .output()
            .unwrap();
        let path = String::from_utf8_lossy(&which.stdout).trim().to_string();
        let path = if path.is_empty() {
            busybox.to_path_buf()
        } else {
            PathBuf::from(path)
        };
        std::fs::copy(&path, bin.join("busybox")).unwrap();
        for c in ["sh", "cat", "echo", "ls", "mv", "sleep", "true"] {
            std::os::unix::fs::symlink("busybox", bin.join(c)).unwrap();
        }
        let tar = self.root.join("bb.tar");
        let ok = Command::new("tar")
            .arg("-C")
            .arg(&rootfs)
            .arg("-cf")
            .arg(&tar)
            .arg(".")
            .status()
            .unwrap()
            .success();
        assert!(ok, "tar the image");
        self.ok(&["import", tar.to_str().unwrap(), "localhost/bb"]);
    }
}

/// Makes the busybox root file system under `root` and tars it to `root/bb.tar`.
fn busybox_tar(root: &Path) -> PathBuf {
    let rootfs = root.join("rootfs");
    let bin = rootfs.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let which = Command::new("sh")
        .args(["-c", "command -v busybox"])
        .output()
        .unwrap();
    let path = PathBuf::from(String::from_utf8_lossy(&which.stdout).trim());
    assert!(path.is_file(), "busybox: {}", common::need("busybox"));
    std::fs::copy(&path, bin.join("busybox")).unwrap();
    for c in ["sh", "cat", "echo", "ls", "mv", "sleep", "true"] {
        std::os::unix::fs::symlink("busybox", bin.join(c)).unwrap();
    }
    let tar = root.join("bb.tar");
    let ok = Command::new("tar")
        .arg("-C")
        .arg(&rootfs)
        .arg("-cf")
        .arg(&tar)
        .arg(".")
        .status()
        .unwrap()
        .success();
    assert!(ok, "tar the image");
    tar
}

/// A dockerd of the test's own, and the name under which it finds node `node`'s
/// endpoint (a spec file in /etc/docker/plugins, removed on drop).
struct Docker {
    dir: PathBuf,
    spec: PathBuf,
    driver: String,
    daemon: std::process::Child,
    /// The bridge of the daemon's default network, when it has one (deleted on drop).
    bridge: Option<String>,
}

impl Docker {
    async fn start(c: &Cluster, node: &str) -> Docker {
        Docker::start_as(c, node, None, None).await
    }

    /// A dockerd finding node `node`'s endpoint under the name `driver` (one of the
    /// test's own by default), with a default network on the bridge `bridge` (none by
    /// default; made here, with an address of its own).
    async fn start_as(
        c: &Cluster,
        node: &str,
        driver: Option<&str>,
        bridge: Option<(&str, &str)>,
    ) -> Docker {
        common::need("dockerd");
        // Short paths: containerd's sockets live under the exec root. One name per
        // daemon, not per test process: the tests of this file run in parallel, and two
        // of them sharing a directory removed each other's socket.
        static DAEMONS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = DAEMONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tag = format!("{}-{n}", std::process::id());
        let dir = PathBuf::from(format!("/tmp/moor-docker-{tag}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let bridge = bridge.map(|(name, cidr)| {
            let _ = Command::new("ip").args(["link", "del", name]).status();
            for args in [
                vec!["link", "add", "name", name, "type", "bridge"],
                vec!["addr", "add", cidr, "dev", name],
                vec!["link", "set", name, "up"],
            ] {
                let ok = Command::new("ip").args(&args).status().unwrap().success();
                assert!(ok, "ip {args:?}");
            }
            name.to_string()
        });
        std::fs::write(dir.join("bridge"), bridge.as_deref().unwrap_or("none")).unwrap();
        let daemon = Docker::daemon(&dir);
        let driver = driver.map_or_else(|| format!("moor-test-{tag}"), str::to_string);
        std::fs::create_dir_all("/etc/docker/plugins").unwrap();
        let spec = PathBuf::from(format!("/etc/docker/plugins/{driver}.spec"));
        std::fs::write(
            &spec,
            format!("unix://{}\n", c.node(node).dir.join("moor.sock").display()),
        )
        .unwrap();
        let d = Docker {
            dir,
            spec,
            driver,
            daemon,
            bridge,
        };
        d.answers(c).await;
        let tar = busybox_tar(&d.dir);
        d.ok(&["import", tar.to_str().unwrap(), "bb:1"]);
        d
    }

    /// Starts a dockerd on `dir`'s root, exec root, socket and bridge (`dir/bridge`;
    /// its log appended to).
    fn daemon(dir: &Path) -> std::process::Child {
        let bridge = std::fs::read_to_string(dir.join("bridge")).unwrap();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("dockerd.log"))
            .unwrap();
        Command::new("dockerd")
            .args([
                "--iptables=false",
                "--ip6tables=false",
                "--storage-driver=vfs",
            ])
            .arg(format!("--bridge={bridge}"))
            .arg(format!("--data-root={}", dir.join("root").display()))
            .arg(format!("--exec-root={}", dir.join("exec").display()))
            .arg(format!("-H=unix://{}", dir.join("docker.sock").display()))
            .arg(format!("--pidfile={}", dir.join("docker.pid").display()))
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start dockerd")
    }

    /// Stops dockerd as a shutdown does (SIGTERM: it stops its containers, which
    /// Unmount), waiting up to 60 s.
    fn stop_daemon(&mut self) {
        assert!(
            self.terminate(Duration::from_secs(60)),
            "dockerd did not stop within 60 s"
        );
    }

    /// SIGTERM to dockerd, then whether it exited within `within`.
    fn terminate(&mut self, within: Duration) -> bool {
        let _ = Command::new("kill")
            .arg(self.daemon.id().to_string())
            .status();
        let deadline = std::time::Instant::now() + within;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.daemon.try_wait() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }

    /// Starts dockerd again on the same directories, as a boot does, and waits until it
    /// answers.
    async fn start_daemon(&mut self, c: &Cluster) {
        self.daemon = Docker::daemon(&self.dir);
        self.answers(c).await;
    }

    /// Waits until dockerd answers `docker info`.
    async fn answers(&self, c: &Cluster) {
        c.wait("dockerd answers", T, || async {
            self.cmd()
                .arg("info")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .await;
    }

    fn cmd(&self) -> Command {
        let mut cmd = Command::new("docker");
        cmd.env(
            "DOCKER_HOST",
            format!("unix://{}", self.dir.join("docker.sock").display()),
        );
        cmd
    }

    fn run(&self, args: &[&str]) -> Output {
        let out = self.cmd().args(args).output().expect("run docker");
        eprintln!(
            "$ docker {}\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(out.status.success(), "docker {args:?} failed");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn container(&self, volume: &str, script: &str) -> Output {
        self.run(&[
            "run",
            "--rm",
            "--network",
            "none",
            "--volume-driver",
            &self.driver,
            "-v",
            &format!("{volume}:/data"),
            "bb:1",
            "sh",
            "-c",
            script,
        ])
    }
}

impl Drop for Docker {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.spec);
        self.terminate(Duration::from_secs(20));
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
        if let Some(bridge) = &self.bridge {
            let _ = Command::new("ip").args(["link", "del", bridge]).status();
        }
        // vfs layers are plain directories; a failed removal leaves them to /tmp's
        // cleaning.
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn start() -> Cluster {
    Cluster::start_volume_plugin(&[]).await
}

async fn start_with(more: &[&str]) -> Cluster {
    Cluster::start_volume_plugin(more).await
}

async fn volume(c: &Cluster, name: &str) -> Option<Volume> {
    c.store
        .try_get(&Volume::key_for(&Namespace::default_ns(), name))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn podman_containers_write_and_read_a_moor_volume() {
    let c = start().await;
    let p = Podman::new(&c, "n1", 120);
    // volume create makes a moor Volume through CreateVolume.
    p.ok(&[
        "volume",
        "create",
        "--driver",
        "moor",
        "-o",
        "size=16MiB",
        "web",
    ]);
    let web = volume(&c, "web").await.expect("a moor Volume");
    assert_eq!(web.spec.capacity_min, Some(Size(16 << 20)));
    c.volume_ready("web").await;
    // A container writes into it; a second, after the first ended, reads it back.
    let out = p.container("web", "echo kept > /data/hello");
    assert!(out.status.success(), "{out:?}");
    let out = p.container("web", "cat /data/hello");
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "kept");
    // volume ls and inspect show moor's state.
    let ls = p.ok(&["volume", "ls"]);
    assert!(ls.contains("moor") && ls.contains("web"), "{ls}");
    let inspect = p.ok(&["volume", "inspect", "web"]);
    assert!(
        inspect.contains("\"phase\": \"Ready\"") && inspect.contains("hostpath.moor.dev"),
        "{inspect}"
    );
    // Every claim released once the containers ended.
    c.wait("every claim released", T, || async {
        c.all_claims_released().await
    })
    .await;
    // volume rm deletes it through DeleteVolume.
    p.ok(&["volume", "rm", "web"]);
    c.wait("web deleted", T, || async {
        volume(&c, "web").await.is_none()
    })
    .await;
    let n1 = c.node("n1");
    assert_eq!(n1.count("CreateVolume", "OK"), 1);
    assert_eq!(n1.count("DeleteVolume", "OK"), 1);
    // The second container started within the engine's hold's linger after the
    // first ended is answered from the publish in place (one NodePublish), or, on a
    // slow machine, published again: each publish undone.
    let publishes = n1.count("NodePublishVolume", "OK");
    assert!((1..=2).contains(&publishes), "{publishes} NodePublish");
    assert_eq!(n1.count("NodeUnpublishVolume", "OK"), publishes);
    c.check_calls(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_containers_write_and_read_a_moor_volume() {
    let c = start().await;
    let d = Docker::start(&c, "n1").await;
    d.ok(&[
        "volume",
        "create",
        "-d",
        &d.driver,
        "-o",
        "size=8MiB",
        "dvol",
    ]);
    let dvol = volume(&c, "dvol").await.expect("a moor Volume");
    assert_eq!(dvol.spec.capacity_min, Some(Size(8 << 20)));
    let out = d.container("dvol", "echo kept > /data/hello");
    assert!(out.status.success(), "{out:?}");
    let out = d.container("dvol", "cat /data/hello");
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "kept");
    let ls = d.ok(&["volume", "ls"]);
    assert!(ls.contains(&d.driver) && ls.contains("dvol"), "{ls}");
    let inspect = d.ok(&["volume", "inspect", "dvol"]);
    assert!(
        inspect.contains("\"phase\": \"Ready\"") && inspect.contains("\"Scope\": \"global\""),
        "{inspect}"
    );
    c.wait("every claim released", T, || async {
        c.all_claims_released().await
    })
    .await;
    d.ok(&["volume", "rm", "dvol"]);
    c.wait("dvol deleted", T, || async {
        volume(&c, "dvol").await.is_none()
    })
    .await;
    let n1 = c.node("n1");
    assert_eq!(n1.count("CreateVolume", "OK"), 1);
    assert_eq!(n1.count("DeleteVolume", "OK"), 1);
    // The second container started within the engine's hold's linger after the
    // first ended is answered from the publish in place (one NodePublish), or, on a
    // slow machine, published again: each publish undone.
    let publishes = n1.count("NodePublishVolume", "OK");
    assert!((1..=2).contains(&publishes), "{publishes} NodePublish");
    assert_eq!(n1.count("NodeUnpublishVolume", "OK"), publishes);
    c.check_calls(true);
}

/// Podman waits 5 s per volume-plugin call by default. A Mount that outlasts it (a
/// slow ControllerPublish) fails the container's start; the endpoint sees Podman hang
/// up, ends the allocation it made and says so, the claim is released, and a second
/// start of the same container works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mount_slower_than_podman_waits_fails_the_start_and_leaves_nothing_claimed() {
    let c = start_with(&[
        "--volume-plugin-orphan-interval=1s",
        "--volume-plugin-orphan-grace=12s",
    ])
    .await;
    let p = Podman::new(&c, "n1", 5);
    p.ok(&["volume", "create", "--driver", "moor", "slow"]);
    c.volume_ready("slow").await;
    c.node("n1")
        .fault(moor_hostpath::faults::Command::Latency {
            rpc: "ControllerPublishVolume".into(),
            ms: 8_000,
        })
        .await;
    let args = [
        "--network",
        "none",
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=1024:1024",
        "-v",
        "slow:/data",
        "localhost/bb",
        "sh",
        "-c",
        "echo started > /data/f",
    ];
    let mut create = vec!["create", "--name", "c1"];
    create.extend(args);
    p.ok(&create);
    let out = p.run(&["start", "-a", "c1"]);
    assert!(
        !out.status.success(),
        "the start outlasted Podman's 5 s and failed"
    );
    c.node("n1")
        .fault(moor_hostpath::faults::Command::Latency {
            rpc: "ControllerPublishVolume".into(),
            ms: 0,
        })
        .await;
    // Podman hung up on the slow Mount: its allocation is ended (issue 49, item 5)
    // and the claim released, with a log line saying why.
    c.wait("the claim of a caller that gave up released", T, || {
        c.all_claims_released()
    })
    .await;
    let log = c.node("n1").agent.log_text();
    assert!(
        log.contains("its caller hung up before the answer"),
        "{log}"
    );
    // The same container starts again, now at the plugin's speed.
    let out = p.run(&["start", "-a", "c1"]);
    assert!(out.status.success(), "the second start works");
    p.ok(&["rm", "c1"]);
    c.wait("every claim released", T, || c.all_claims_released())
        .await;
    c.check_calls(true);
}

/// The published path of the one Published claim of volume `v`, from its Mount.
async fn published_path(c: &Cluster, v: &str) -> Option<PathBuf> {
    for cl in c
        .store
        .list(&KeyScope::<ClaimSpec>::all())
        .await
        .unwrap()
        .items
    {
        if cl.spec.volume.as_str() != v || cl.status.phase != ClaimPhase::Published {
            continue;
        }
        let m = c
            .store
            .try_get(&Mount::key_for(&cl.object_key()))
            .await
            .unwrap()?;
        return Some(PathBuf::from(&m.spec.target_path));
    }
    None
}

/// A container writes through an agent restart (SIGKILL): nothing is unpublished or
/// detached while it runs, it keeps writing, and its stop releases the volume. Another
/// container on the same node shares the single-node-writer volume meanwhile; one on
/// another node is refused, the holder named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_podman_container_writes_through_an_agent_restart() {
    let mut c = start().await;
    let p = Podman::new(&c, "n1", 120);
    p.ok(&["volume", "create", "--driver", "moor", "live"]);
    c.volume_ready("live").await;
    p.ok(&[
        "run",
        "-d",
        "--name",
        "w",
        "--network",
        "none",
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=1024:1024",
        "-v",
        "live:/data",
        "localhost/bb",
        "sh",
        "-c",
        // Written aside and renamed: a read never meets the truncated file (it read
        // 0 between `>`'s truncation and the write on a loaded machine).
        "i=0; while :; do i=$((i+1)); echo $i > /data/count.new; mv /data/count.new /data/count; sleep 0.2; done",
    ]);
    c.wait("the container writes", T, || async {
        published_path(&c, "live")
            .await
            .is_some_and(|p| p.join("count").exists())
    })
    .await;
    let path = published_path(&c, "live").await.unwrap();
    let count = || {
        std::fs::read_to_string(path.join("count"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    // moor's access rules: a second writer on the same node shares a
    // single-node-writer volume; a writer on another node is refused, the holder named.
    let out = p.container("live", "cat /data/count");
    assert!(out.status.success(), "{out:?}");
    let p2 = Podman::new(&c, "n2", 120);
    p2.ok(&["volume", "create", "--driver", "moor", "live"]);
    let out = p2.container("live", "true");
    assert!(!out.status.success(), "a writer on n2 ran");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("on node n1"),
        "{out:?}"
    );
    // The agent dies and comes back while the container writes.
    c.node_mut("n1").agent.kill();
    let before = count();
    c.node_mut("n1").agent.restart();
    let sock = c.node("n1").dir.join("moor.sock");
    c.wait("the endpoint is back", T, || async {
        tokio::net::UnixStream::connect(&sock).await.is_ok()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        count() > before,
        "the container kept writing ({} then {})",
        before,
        count()
    );
    let n1 = c.node("n1");
    assert_eq!(
        n1.count("NodeUnpublishVolume", "OK"),
        0,
        "unpublished under a live container"
    );
    assert_eq!(
        n1.count("ControllerUnpublishVolume", "OK"),
        0,
        "detached under a live container"
    );
    // Its stop releases the volume (Unmount, then the usual release).
    p.ok(&["stop", "-t", "1", "w"]);
    p.ok(&["rm", "w"]);
    c.wait("every claim released", T, || c.all_claims_released())
        .await;
    c.check_calls(true);
}

/// Issue 49, item 6: `podman volume prune -f` (after `podman volume reload`) deleted
/// moor volumes Docker had written, one of them referenced by a stopped Docker
/// container that then failed to start. Each engine now has a socket of its own, and
/// an engine's Remove deletes only what that engine made: Docker writes, Podman prunes,
/// the data is still there and the Docker container starts; `docker volume rm` of an
/// unused Docker-made volume still deletes it, and a protected volume is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn podman_pruning_never_deletes_what_docker_made() {
    let c = start_with(&["--volume-plugin=podman={dir}/podman.sock"]).await;
    let d = Docker::start(&c, "n1").await;
    let p = Podman::on_socket(&c, "n1", 120, "podman.sock");
    for v in ["written", "referenced"] {
        d.ok(&["volume", "create", "-d", &d.driver, "-o", "size=8MiB", v]);
    }
    let out = d.container("written", "echo kept > /data/hello");
    assert!(out.status.success(), "{out:?}");
    d.ok(&[
        "create",
        "--name",
        "stopped",
        "--network",
        "none",
        "--volume-driver",
        &d.driver,
        "-v",
        "referenced:/data",
        "bb:1",
        "sh",
        "-c",
        "ls /data",
    ]);
    c.wait("every claim released", T, || c.all_claims_released())
        .await;
    // Podman sees moor's volumes and prunes every one it thinks unused.
    p.ok(&["volume", "reload"]);
    let ls = p.ok(&["volume", "ls"]);
    assert!(ls.contains("written") && ls.contains("referenced"), "{ls}");
    p.run(&["volume", "prune", "-f"]);
    for v in ["written", "referenced"] {
        assert!(
            volume(&c, v).await.is_some(),
            "{v} was deleted by Podman's prune"
        );
    }
    let out = d.container("written", "cat /data/hello");
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "kept");
    d.ok(&["start", "-a", "stopped"]);
    d.ok(&["rm", "stopped"]);
    // Issue 51, item 4: after `podman volume reload` (the README's step; the prune
    // above made Podman forget the volumes, and a `podman run -v NAME` of a volume it
    // does not know makes an empty local one), a Podman container reads what Docker
    // wrote; Docker lists a volume Podman made at once (it asks List each time).
    p.ok(&["volume", "reload"]);
    let out = p.container("written", "cat /data/hello");
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "kept");
    p.ok(&["volume", "create", "--driver", "moor", "podmanmade"]);
    let ls = d.ok(&["volume", "ls"]);
    assert!(ls.contains("podmanmade"), "{ls}");
    // A `:ro` container beside a running writer on the same node shares the volume.
    d.ok(&[
        "run",
        "-d",
        "--name",
        "writer",
        "--network",
        "none",
        "-v",
        "written:/data",
        "bb:1",
        "sh",
        "-c",
        "exec sleep 600",
    ]);
    let out = d.run(&[
        "run",
        "--rm",
        "--network",
        "none",
        "-v",
        "written:/data:ro",
        "bb:1",
        "cat",
        "/data/hello",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "kept");
    d.ok(&["rm", "-f", "writer"]);
    p.ok(&["volume", "rm", "podmanmade"]);
    c.wait("every claim released", T, || c.all_claims_released())
        .await;
    // A protected volume: refused by Docker too, until lifted.
    let key = Volume::key_for(&Namespace::default_ns(), "referenced");
    c.store
        .modify_spec(&key, |s: &mut VolumeSpec| {
            s.deletion_protection = true;
            true
        })
        .await
        .unwrap();
    let out = d.run(&["volume", "rm", "referenced"]);
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("protected"),
        "{out:?}"
    );
    c.store
        .modify_spec(&key, |s: &mut VolumeSpec| {
            s.deletion_protection = false;
            true
        })
        .await
        .unwrap();
    // Docker removes what Docker made.
    for v in ["written", "referenced"] {
        d.ok(&["volume", "rm", v]);
        c.wait(&format!("{v} deleted"), T, || async {
            volume(&c, v).await.is_none()
        })
        .await;
    }
    c.check_calls(true);
}

/// Issue 51, item 3: the boot order, as far as a machine without systemd as PID 1 goes.
/// A `--restart=always` container writes to a moor volume; then a shutdown: dockerd
/// stops (its container stops and Unmounts), then the agent. At boot the socket is
/// bound first, as deploy/systemd/moor-agent.socket does (`systemd-socket-activate`,
/// which starts the agent at the first call and passes it the socket), then dockerd
/// starts and restarts the container: its Mount reaches the socket before the agent
/// runs, starts it, and is answered; the container runs again with its data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_boot_a_restart_policy_container_starts_behind_the_activated_socket() {
    common::need("systemd-socket-activate");
    let mut c = start().await;
    let mut d = Docker::start(&c, "n1").await;
    d.ok(&["volume", "create", "-d", &d.driver, "bootvol"]);
    d.ok(&[
        "run",
        "-d",
        "--name",
        "svc",
        "--restart=always",
        "--network",
        "none",
        "-v",
        "bootvol:/data",
        "bb:1",
        "sh",
        "-c",
        "echo up >> /data/boots; exec sleep 600",
    ]);
    let boots = |d: &Docker| lines_in(d.cmd(), "svc", "/data/boots");
    c.wait("the container wrote once", T, || async { boots(&d) == 1 })
        .await;

    // Shutdown: the engine first (its container Unmounts), then the agent.
    d.stop_daemon();
    let sock = c.node("n1").dir.join("moor.sock");
    c.node_mut("n1").agent.stop();
    assert!(
        !sock.exists(),
        "the agent removes the socket it bound itself"
    );
    // Boot: the socket is bound before the engine starts; the agent is not running.
    let sock_arg = sock.to_str().unwrap().to_string();
    c.node_mut("n1")
        .agent
        .wrap(&["systemd-socket-activate", "-l", &sock_arg]);
    c.wait("the activated socket is bound", T, || async {
        sock.exists()
    })
    .await;
    d.start_daemon(&c).await;
    c.wait("the container runs again with its data", T, || async {
        boots(&d) == 2
    })
    .await;
    let log = c.node("n1").agent.log_text();
    assert!(
        log.contains("socket activation: sockets passed by the service manager")
            && log.contains("activated=true"),
        "{log}"
    );

    d.ok(&["rm", "-f", "svc"]);
    c.wait("every claim released", T, || c.all_claims_released())
        .await;
    c.check_calls(true);
}

/// How many lines `file` has in container `container`, read with `exec` through
/// `engine` (a docker or podman command); 0 while it cannot be read.
fn lines_in(mut engine: Command, container: &str, file: &str) -> usize {
    engine
        .args(["exec", container, "cat", file])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().count())
        .unwrap_or(0)
}

/// deploy/engines' Compose files, as a person runs them.
fn compose_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/engines")
        .join(name)
}

/// Runs a Compose command (`program` with `args`), its environment set by `env`,
/// asserting it succeeds.
fn compose_ok(mut cmd: Command, args: &[&str]) {
    let out = cmd.args(args).output().expect("run compose");
    eprintln!(
        "$ compose {}\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "compose {args:?} failed");
}

/// Issue 51, item 5: docker-compose 1.29 (Debian's) with deploy/engines/compose.test.yaml:
/// up makes the moor volume (CreateVolume) and the service writes; down keeps it; up
/// again reads what the first wrote; down -v removes it, and moor deletes it
/// (DeleteVolume: Docker's Create made it), right after the container ended (the hold's
/// linger is waited out by Remove, not refused as in use).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_compose_up_down_and_down_v() {
    common::need("docker-compose");
    let c = start().await;
    let d = Docker::start(&c, "n1").await;
    let file = compose_file("compose.test.yaml");
    let compose = |args: &[&str]| {
        let mut cmd = Command::new("docker-compose");
        cmd.env(
            "DOCKER_HOST",
            format!("unix://{}", d.dir.join("docker.sock").display()),
        )
        .env("IMAGE", "bb:1")
        .env("MOOR_DRIVER", &d.driver)
        .args(["-p", "demo", "-f", file.to_str().unwrap()]);
        compose_ok(cmd, args);
    };
    let boots = || lines_in(d.cmd(), "demo_app_1", "/data/boots");
    compose(&["up", "-d"]);
    c.wait("the service wrote", T, || async { boots() == 1 })
        .await;
    assert!(volume(&c, "demo_notes").await.is_some(), "a moor Volume");
    compose(&["down"]);
    assert!(volume(&c, "demo_notes").await.is_some(), "down keeps it");
    compose(&["up", "-d"]);
    c.wait("the service read back and wrote again", T, || async {
        boots() == 2
    })
    .await;
    compose(&["down", "-v"]);
    c.wait("down -v deleted it", T, || async {
        volume(&c, "demo_notes").await.is_none()
    })
    .await;
    let n1 = c.node("n1");
    assert_eq!(n1.count("CreateVolume", "OK"), 1);
    assert_eq!(n1.count("DeleteVolume", "OK"), 1);
    c.wait("every claim released", T, || c.all_claims_released())
        .await;
    c.check_calls(true);
}

/// Issue 51, item 5: podman-compose 1.0.3 (Debian's) ignores a volume's `driver:` and
/// makes a local volume of that name, silently (this test shows it, so a later
/// podman-compose that honours it is noticed); deploy/engines/compose.podman.yaml names
/// a volume made first with `podman volume create --driver moor` as external: up
/// writes, down keeps it, up reads back, and `podman volume rm` deletes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn podman_compose_on_a_moor_volume_made_first() {
    common::need("podman-compose");
    let c = start().await;
    let p = Podman::new(&c, "n1", 120);
    let compose = |file: &str, args: &[&str]| {
        let mut cmd = Command::new("podman-compose");
        cmd.env("CONTAINERS_CONF", &p.conf)
            .env("IMAGE", "localhost/bb")
            .arg(format!(
                "--podman-args=--root {} --runroot {}",
                p.root.join("storage").display(),
                p.root.join("run").display()
            ))
            .args(["-p", "demo", "-f", compose_file(file).to_str().unwrap()]);
        compose_ok(cmd, args);
    };
    // What Debian's podman-compose does with `driver: moor`: a local volume.
    compose("compose.test.yaml", &["up", "-d"]);
    let ls = p.ok(&["volume", "ls", "--format", "{{.Driver}} {{.Name}}"]);
    assert!(ls.contains("local demo_notes"), "{ls}");
    assert!(volume(&c, "demo_notes").await.is_none());
    compose("compose.test.yaml", &["down", "-v"]);

    // The documented way: the moor volume first, external in the file.
    p.ok(&[
        "volume",
        "create",
        "--driver",
        "moor",
        "-o",
        "size=8MiB",
        "notes",
    ]);
    let boots = || lines_in(p.cmd(), "demo_app_1", "/data/boots");
    compose("compose.podman.yaml", &["up", "-d"]);
    c.wait("the service wrote", T, || async { boots() == 1 })
        .await;
    compose("compose.podman.yaml", &["down"]);
    compose("compose.podman.yaml", &["up", "-d"]);
    c.wait("the service read back and wrote again", T, || async {
        boots() == 2
    })
    .await;
    compose("compose.podman.yaml", &["down", "-v"]);
    assert!(
        volume(&c, "notes").await.is_some(),
        "an external volume stays"
    );
    c.wait("every claim released", T, || c.all_claims_released())
        .await;
    p.ok(&["volume", "rm", "notes"]);
    c.wait("notes deleted", T, || async {
        volume(&c, "notes").await.is_none()
    })
    .await;
    c.check_calls(true);
}

/// Issue 51, item 2, through the engines themselves: with etcd paused, then stopped,
/// a `docker run` and a `podman run` (with the README's `volume_plugin_timeout = 120`)
/// of a moor volume fail within the endpoint's store patience (5 s per call), saying
/// that etcd did not answer, and leave no container behind; with the agent's process
/// stopped they fail as the README says (Docker after about 15 s, Podman at once) and,
/// once it is back, the same starts work. Nothing is left claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_starts_fail_in_bounds_without_the_store_or_the_agent() {
    let mut c = start().await;
    let p = Podman::new(&c, "n1", 120);
    let d = Docker::start(&c, "n1").await;
    p.ok(&["volume", "create", "--driver", "moor", "pv"]);
    d.ok(&["volume", "create", "--driver", &d.driver, "dv"]);
    c.volume_ready("pv").await;
    c.volume_ready("dv").await;
    // Each kind of engine start, timed: it fails, within `bound`, saying `why`.
    let fails = |what: &str, bound: Duration, why: &str, out: Output, took: Duration| {
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{what}: the start worked");
        assert!(
            took < bound,
            "{what}: failed after {took:?}, not within {bound:?}"
        );
        assert!(err.contains(why), "{what}: {err:?} does not say {why:?}");
        eprintln!("{what}: failed after {took:?}");
    };
    let timed = |f: &dyn Fn() -> Output| {
        let t = std::time::Instant::now();
        let out = f();
        (out, t.elapsed())
    };
    // Docker calls Get, then Mount: two calls of 5 s at most, and its own work.
    let store_bound = Duration::from_secs(14);
    for how in ["paused", "stopped"] {
        match how {
            "paused" => c.etcd.pause(true),
            _ => c.etcd.kill(),
        }
        // The first call waits 5 s; the next, 1 s while the store stays silent.
        let why = "moor's store: etcd";
        let (out, took) = timed(&|| p.container("pv", "true"));
        fails(&format!("podman, etcd {how}"), store_bound, why, out, took);
        let (out, took) = timed(&|| d.container("dv", "true"));
        fails(&format!("docker, etcd {how}"), store_bound, why, out, took);
        match how {
            "paused" => c.etcd.pause(false),
            _ => c.etcd.restart().await,
        }
    }
    let stopped = c.node_mut("n1").agent.pid();
    c.node_mut("n1").agent.stop();
    assert!(stopped.is_some());
    let (out, took) = timed(&|| d.container("dv", "true"));
    // Docker retries a plugin's socket for 15 s per call (Create, then Get).
    fails(
        "docker, agent stopped",
        Duration::from_secs(40),
        "moor.sock: connect",
        out,
        took,
    );
    let (out, took) = timed(&|| p.container("pv", "true"));
    fails(
        "podman, agent stopped",
        store_bound,
        "volume plugin moor (needed by volume pv) missing",
        out,
        took,
    );
    c.node_mut("n1").agent.restart();
    let sock = c.volume_plugin_socket("n1");
    c.wait("the endpoint is back", T, || async {
        tokio::net::UnixStream::connect(&sock).await.is_ok()
    })
    .await;
    // Nothing was left behind by the failed starts: no container, no claim, and the
    // same starts now work.
    for (engine, mut cmd) in [("podman", p.cmd()), ("docker", d.cmd())] {
        let out = cmd.args(["ps", "-aq"]).output().unwrap();
        let left = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert!(
            out.status.success() && left.is_empty(),
            "{engine} left containers: {left:?}"
        );
    }
    c.wait("nothing left claimed", T, || c.all_claims_released())
        .await;
    let out = p.container("pv", "echo p > /data/f && cat /data/f");
    assert!(out.status.success(), "{out:?}");
    let out = d.container("dv", "echo d > /data/f && cat /data/f");
    assert!(out.status.success(), "{out:?}");
    c.wait("every claim released", T, || c.all_claims_released())
        .await;
    c.check_calls(true);
}

/// Issue 51, item 5: the README's engine block, each line run as written through `sh
/// -c`. Docker finds the plugin by the name `moor` (a spec file in /etc/docker/plugins,
/// as the README says) and runs on its own defaults (a default network, the image
/// `busybox`); Podman reads deploy/engines/containers.conf, as the README says; both are the
/// test's own, reached through DOCKER_HOST, CONTAINERS_CONF and CONTAINERS_STORAGE_CONF.
/// What Docker's container wrote, Podman's reads; `docker volume rm` deletes the volume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readmes_engine_commands_work_as_written() {
    // One socket per engine, as the README's agent command has.
    let c = start_with(&["--volume-plugin=podman={dir}/podman.sock"]).await;
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let at = readme
        .find("runs behind `-v`:")
        .expect("the README's engine block");
    let lines: Vec<&str> = readme[at..]
        .lines()
        .skip(1)
        // Blank lines and the marker tests/docs.rs reads (this test runs the block).
        .skip_while(|l| l.trim().is_empty() || l.starts_with("<!-- docs:"))
        .take_while(|l| l.starts_with("    "))
        .map(str::trim)
        .collect();
    for engine in ["docker ", "podman "] {
        assert!(
            lines.iter().any(|l| l.starts_with(engine)),
            "no {engine}command in {lines:?}"
        );
    }
    // The name `moor` is the machine's: a live one (an agent serving this machine's
    // Docker) is not taken over; one left by a killed run of this test is.
    for taken in [
        "/run/docker/plugins/moor.sock",
        "/etc/docker/plugins/moor.spec",
    ] {
        let target = std::fs::read_to_string(taken).unwrap_or_default();
        let live = Path::new(taken).extension().is_some_and(|e| e == "sock")
            && Path::new(taken).exists()
            || Path::new(target.trim().trim_start_matches("unix://")).exists();
        assert!(
            !live,
            "{taken} is in use on this machine: the test needs the name moor"
        );
    }
    let pid = std::process::id();
    let (bridge, cidr) = (
        format!("mbr{}", pid % 100_000),
        format!("10.213.{}.1/24", pid % 250),
    );
    let d = Docker::start_as(&c, "n1", Some("moor"), Some((&bridge, &cidr))).await;
    let tar = busybox_tar(&d.dir.join("image"));
    d.ok(&["import", tar.to_str().unwrap(), "busybox"]);
    // Podman: deploy/engines/containers.conf as shipped, its socket the test's, and
    // what this machine kind needs (../shared/CONTAINERS.md), with storage of its own.
    let p = c.dir.path().join("podman-readme");
    std::fs::create_dir_all(&p).unwrap();
    let shipped = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/engines/containers.conf"),
    )
    .unwrap();
    let socket = c.node("n1").dir.join("podman.sock");
    assert!(shipped.contains("\"/run/podman/moor.sock\"") && shipped.contains("[engine]\n"));
    let conf = p.join("containers.conf");
    std::fs::write(
        &conf,
        format!(
            "[containers]\nnetns = \"none\"\ndefault_ulimits = [\"nofile=1024:1024\", \"nproc=1024:1024\"]\n\n{}",
            shipped
                .replace("\"/run/podman/moor.sock\"", &format!("\"{}\"", socket.display()))
                .replacen(
                    "[engine]\n",
                    "[engine]\nruntime = \"runc\"\ncgroup_manager = \"cgroupfs\"\n",
                    1
                )
        ),
    )
    .unwrap();
    let storage = p.join("storage.conf");
    std::fs::write(
        &storage,
        format!(
            "[storage]\ndriver = \"vfs\"\ngraphroot = \"{}\"\nrunroot = \"{}\"\n",
            p.join("storage").display(),
            p.join("run").display()
        ),
    )
    .unwrap();
    let sh = |line: &str| {
        let out = Command::new("sh")
            .arg("-c")
            .arg(line)
            .env(
                "DOCKER_HOST",
                format!("unix://{}", d.dir.join("docker.sock").display()),
            )
            .env("CONTAINERS_CONF", &conf)
            .env("CONTAINERS_STORAGE_CONF", &storage)
            .output()
            .unwrap();
        eprintln!(
            "$ {line}\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    };
    let imported = sh(&format!("podman import {} busybox", tar.display()));
    assert!(imported.status.success());
    let mut outputs = Vec::new();
    for line in &lines {
        let out = sh(line);
        assert!(out.status.success(), "the README's `{line}` failed");
        outputs.push(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    // Podman's `cat /data/hello` printed the date Docker's container wrote.
    let read = lines
        .iter()
        .position(|l| l.starts_with("podman run") && l.contains("cat /data/hello"))
        .expect("the README's podman run reads /data/hello");
    assert!(
        outputs[read].trim().len() >= 20,
        "podman read {:?}",
        outputs[read]
    );
    if lines
        .iter()
        .any(|l| l.starts_with("docker volume rm pgdata"))
    {
        c.wait("pgdata deleted", T, || async {
            volume(&c, "pgdata").await.is_none()
        })
        .await;
    }
    c.wait("every claim released", T, || c.all_claims_released())
        .await;
    c.check_calls(true);
}

/// Issue 54, part 1 left this untested: `moorctl node drain --stop` never stops a
/// container's hold under the live container; it names it as an engine's hold, times
/// out with the claim still published and the container still writing, and returns
/// once the container is stopped by its engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_reports_a_live_container_s_hold_and_never_releases_it() {
    let c = start().await;
    let p = Podman::new(&c, "n1", 120);
    p.ok(&["volume", "create", "--driver", "moor", "held"]);
    c.volume_ready("held").await;
    p.ok(&[
        "run",
        "-d",
        "--name",
        "h",
        "--network",
        "none",
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=1024:1024",
        "-v",
        "held:/data",
        "localhost/bb",
        "sh",
        "-c",
        "while :; do date > /data/now.new; mv /data/now.new /data/now; sleep 0.2; done",
    ]);
    c.wait("the container writes", T, || async {
        published_path(&c, "held")
            .await
            .is_some_and(|p| p.join("now").exists())
    })
    .await;
    let (ok, out) = c.moorctl(&["node", "drain", "n1", "--stop", "--timeout", "3s"]);
    assert!(!ok, "a drain under a live container times out: {out}");
    assert!(
        out.contains("'s container hold") && out.contains("not stopped under a live container"),
        "{out}"
    );
    assert!(
        out.contains("timed out: node n1 still holds volumes"),
        "{out}"
    );
    let running = p.ok(&["ps", "--format", "{{.Names}}"]);
    assert!(running.lines().any(|l| l.trim() == "h"), "{running}");
    assert!(
        c.store
            .list(&KeyScope::<ClaimSpec>::all())
            .await
            .unwrap()
            .items
            .iter()
            .any(|k| k.status.phase == ClaimPhase::Published),
        "the container's claim stays published"
    );
    // Stopped by its engine: the drain completes.
    p.ok(&["stop", "-t", "1", "h"]);
    let (ok, out) = c.moorctl(&["node", "drain", "n1", "--timeout", "60s"]);
    assert!(ok && out.contains("drained"), "{out}");
    let (ok, out) = c.moorctl(&["node", "uncordon", "n1"]);
    assert!(ok, "{out}");
    p.ok(&["rm", "h"]);
    c.check_calls(true);
}
