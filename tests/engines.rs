//! Real container engines ask moor for volumes (issue 38): Podman through the
//! volume-plugin endpoint of a node's agent (a real etcd, `moord controller`, agents,
//! moor-hostpath), its containers writing and reading a CSI volume; the plugins' call
//! logs are checked against the invariants. Podman runs with its own storage under the
//! test's directory, runc and cgroupfs (../shared/CONTAINERS.md: this machine kind's
//! recipe), and an image made from busybox.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::{Cluster, PluginOpts};
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
        common::need("podman");
        common::need("runc");
        let root = c.dir.path().join("podman");
        std::fs::create_dir_all(&root).unwrap();
        let conf = root.join("containers.conf");
        std::fs::write(
            &conf,
            format!(
                "[engine]\nvolume_plugin_timeout = {timeout_s}\n\n[engine.volume_plugins]\nmoor = \"{}\"\n",
                c.node(node).dir.join("moor.sock").display()
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
        for c in ["sh", "cat", "echo", "ls", "sleep", "true"] {
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

async fn start() -> Cluster {
    let opts = PluginOpts {
        agent_args: vec!["--volume-plugin={dir}/moor.sock".into()],
        ..PluginOpts::default()
    };
    let c = Cluster::start(1, 2, opts).await;
    c.wait_nodes_healthy().await;
    let sock = c.node("n1").dir.join("moor.sock");
    c.wait("the endpoint's socket", T, || async { sock.exists() })
        .await;
    c
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
        c.store
            .list(&KeyScope::<ClaimSpec>::all())
            .await
            .unwrap()
            .items
            .iter()
            .all(|cl| cl.status.phase == ClaimPhase::Released)
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
    assert_eq!(n1.count("NodePublishVolume", "OK"), 2);
    assert_eq!(n1.count("NodeUnpublishVolume", "OK"), 2);
    c.check_calls(true);
}
