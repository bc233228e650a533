#![allow(dead_code)]

//! A real etcd with TLS, client-certificate auth and deploy/etcd/roles.sh's roles, and
//! moor's processes under each identity's certificate: what tests/security.rs checks
//! the grants with and tests/hostile.rs runs adversaries on.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use moor::store::{EtcdAuth, Store};

use crate::common::{self, bin, free_port, wait_for};

pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("command runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// Writes a key file readable by its owner only (moor refuses any other).
pub fn write_private(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

pub fn deploy(script: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/etcd")
        .join(script)
}

pub fn denied(e: &etcd_client::Error) -> bool {
    e.to_string().contains("permission denied")
}

/// The people roles.sh and certs.sh make: a viewer and an editor of namespace `a`, and
/// an operator.
pub const PEOPLE: &str = "ann=view:a bo=edit:a cy=operator";

/// A TLS etcd with auth on and roles for nodes n1 and n2 (n1 hosts the hostpath
/// controller plugin), the cluster's key file and n2's.
pub struct Secure {
    pub tmp: tempfile::TempDir,
    pub certs: PathBuf,
    pub url: String,
    pub cluster_keys: PathBuf,
    pub n2_keys: PathBuf,
    pub _etcd: Proc,
}

impl Secure {
    pub async fn start() -> Secure {
        Secure::start_with(&[]).await
    }

    /// [`Secure::start`] with more etcd flags (a quota).
    pub async fn start_with(etcd_flags: &[&str]) -> Secure {
        Secure::start_nodes(&["n1", "n2"], "n1=hostpath.moor.dev", "", etcd_flags).await
    }

    /// A TLS etcd with auth on and roles.sh's roles for `nodes`, the hostpath
    /// controller plugin hosted as `controller_plugins` says (NODE=PLUGIN pairs).
    pub async fn start_nodes(
        nodes: &[&str],
        controller_plugins: &str,
        volume_plugins: &str,
        etcd_flags: &[&str],
    ) -> Secure {
        let tmp = tempfile::tempdir().unwrap();
        let certs = tmp.path().join("certs");
        common::need("openssl");
        run(Command::new("bash")
            .arg(deploy("certs.sh"))
            .arg(&certs)
            .args(nodes)
            .env("NAMESPACE_WRITERS", "a")
            .env("PEOPLE", PEOPLE));
        let (client, peer) = (free_port(), free_port());
        let url = format!("https://127.0.0.1:{client}");
        let log = std::fs::File::create(tmp.path().join("etcd.log")).unwrap();
        let etcd = Proc(
            Command::new(common::need("etcd"))
                .args(["--name", "secure", "--data-dir"])
                .arg(tmp.path().join("data"))
                .arg(format!("--listen-client-urls={url}"))
                .arg(format!("--advertise-client-urls={url}"))
                .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
                .arg(format!(
                    "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
                ))
                .arg(format!("--initial-cluster=secure=http://127.0.0.1:{peer}"))
                .arg(format!(
                    "--cert-file={}",
                    certs.join("server.pem").display()
                ))
                .arg(format!(
                    "--key-file={}",
                    certs.join("server-key.pem").display()
                ))
                .arg(format!(
                    "--trusted-ca-file={}",
                    certs.join("ca.pem").display()
                ))
                .arg("--client-cert-auth")
                .args(etcd_flags)
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap(),
        );
        let health = || {
            Command::new(common::need("etcdctl"))
                .env("ETCDCTL_API", "3")
                .arg(format!("--endpoints={url}"))
                .arg(format!("--cacert={}", certs.join("ca.pem").display()))
                .arg(format!("--cert={}", certs.join("root.pem").display()))
                .arg(format!("--key={}", certs.join("root-key.pem").display()))
                .args(["endpoint", "health"])
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false)
        };
        wait_for("etcd with TLS", Duration::from_secs(30), || async {
            health()
        })
        .await;
        run(Command::new("bash")
            .arg(deploy("roles.sh"))
            .args(nodes)
            .env("CONTROLLER_PLUGINS", controller_plugins)
            .env("VOLUME_PLUGINS", volume_plugins)
            .env("NAMESPACE_WRITERS", "a")
            .env("PEOPLE", PEOPLE)
            .env("SECRET_PLUGINS", "hostpath.moor.dev")
            .env("ENDPOINT", &url)
            .env("CERTS", &certs));
        let cluster_keys = tmp.path().join("cluster.keys");
        let text = run(Command::new(bin("moord")).args(["keys", "new", "--id", "k1"]));
        write_private(&cluster_keys, &text);
        let n2_keys = tmp.path().join("n2.keys");
        let text = run(Command::new(bin("moord"))
            .args(["keys", "node", "--node", "n2", "--encryption-key-file"])
            .arg(&cluster_keys));
        write_private(&n2_keys, &text);
        Secure {
            tmp,
            certs,
            url,
            cluster_keys,
            n2_keys,
            _etcd: etcd,
        }
    }

    pub fn auth(&self, user: &str, keys: Option<&Path>) -> EtcdAuth {
        EtcdAuth {
            cacert: Some(self.certs.join("ca.pem")),
            cert: Some(self.certs.join(format!("{user}.pem"))),
            key: Some(self.certs.join(format!("{user}-key.pem"))),
            user: None,
            encryption_key_file: keys.map(Path::to_path_buf),
        }
    }

    pub async fn store(&self, user: &str, keys: Option<&Path>) -> Store {
        self.auth(user, keys)
            .connect(std::slice::from_ref(&self.url), "/moor/")
            .await
            .unwrap()
    }

    pub async fn raw(&self, user: &str) -> etcd_client::Client {
        self.store(user, None).await.client()
    }

    /// A moor command (moorctl, moord) under `user`'s certificate and `keys`.
    pub fn cmd(&self, program: &str, user: &str, keys: Option<&Path>) -> Command {
        let mut cmd = Command::new(bin(program));
        cmd.env("MOOR_ENDPOINTS", &self.url)
            .env("MOOR_CACERT", self.certs.join("ca.pem"))
            .env("MOOR_CERT", self.certs.join(format!("{user}.pem")))
            .env("MOOR_KEY", self.certs.join(format!("{user}-key.pem")))
            .env_remove("MOOR_ENCRYPTION_KEY_FILE");
        if let Some(k) = keys {
            cmd.env("MOOR_ENCRYPTION_KEY_FILE", k);
        }
        cmd
    }

    pub fn moorctl(&self, user: &str, keys: Option<&Path>, args: &[&str]) -> Output {
        self.cmd("moorctl", user, keys).args(args).output().unwrap()
    }

    /// Starts moor-hostpath in `mode` and node `node`'s agent under its own
    /// certificate and `keys`, with 3 s TTLs.
    pub fn node(&self, node: &str, mode: &str, keys: &Path) -> [Proc; 2] {
        self.node_with(node, mode, keys, &[])
    }

    /// [`Secure::node`] with more agent flags.
    pub fn node_with(&self, node: &str, mode: &str, keys: &Path, extra: &[String]) -> [Proc; 2] {
        let dir = self.tmp.path().join(node);
        std::fs::create_dir_all(dir.join("mnt")).unwrap();
        let sock = dir.join("csi.sock");
        let mut plugin = Command::new(bin("moor-hostpath"));
        plugin
            .arg(format!("--endpoint=unix://{}", sock.display()))
            .arg(format!("--node-id=csi-{node}"))
            .arg(format!("--state-dir={}", dir.join("plugin").display()))
            .arg(format!("--mode={mode}"))
            .arg(format!(
                "--node-registry={}",
                self.tmp.path().join("hostpath-nodes").display()
            ))
            .arg("--no-mount");
        let plugin = self.spawn(plugin, &format!("plugin-{node}"));
        let mut agent = self.cmd("moord", &format!("moor-agent-{node}"), Some(keys));
        agent
            .args(["agent", "--node", node, "--etcd", &self.url])
            .arg(format!("--data-dir={}", dir.join("agent").display()))
            .arg(format!(
                "--plugin=id=hostpath.moor.dev,type={mode},endpoint=unix://{},mount-dir={}",
                sock.display(),
                dir.join("mnt").display()
            ))
            .args([
                "--fingerprint-interval=1s",
                "--node-ttl=3s",
                "--leader-ttl=3s",
            ])
            .args(extra);
        [plugin, self.spawn(agent, &format!("agent-{node}"))]
    }

    /// Starts `moord controller` under its certificate with the cluster's key file and
    /// a 3 s leader TTL, its output in `name`.log.
    pub fn controller(&self, name: &str, extra: &[&str]) -> Proc {
        let mut c = self.cmd("moord", "moor-controller", Some(&self.cluster_keys));
        c.args(["controller", "--etcd", &self.url, "--leader-ttl", "3s"])
            .args(extra);
        self.spawn(c, name)
    }

    /// Starts a long-running moord or moor-hostpath, its output in `name`.log.
    pub fn spawn(&self, mut cmd: Command, name: &str) -> Proc {
        let log = std::fs::File::create(self.tmp.path().join(format!("{name}.log"))).unwrap();
        Proc(cmd.stdout(Stdio::null()).stderr(log).spawn().unwrap())
    }
}
