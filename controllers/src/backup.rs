//! `moord backup check FILE`: what an etcd snapshot (`etcdctl snapshot save`) holds for
//! moor, before anyone restores it.
//!
//! Expected flow:
//! 1. `etcdctl snapshot status FILE` gives its revision, key count and size; a file
//!    it cannot read (truncated, not a snapshot) is refused here with etcdctl's reason.
//! 2. The snapshot is restored into a temporary directory (`etcdctl snapshot
//!    restore`) and served by a temporary `etcd` on free loopback ports: nothing in
//!    Rust reads etcd's database format, and the live cluster is never touched. It
//!    serves TLS with client certificates from a throwaway CA (openssl), and the check
//!    connects with one whose CN is `root`: a snapshot of a cluster with
//!    authentication on (roles.sh) keeps it on, and etcd takes a client
//!    certificate's CN as the user.
//! 3. Every kind is listed through the store as the processes would read it: objects
//!    and malformed values per kind, and each object's secrets: in clear, sealed with a
//!    key the given key file holds, or sealed with one it does not (those would stay
//!    unreadable after a restore).
//! 4. The history the snapshot keeps (every revision since its last compaction) is
//!    read through a watch from the oldest kept revision: a secret written in clear and
//!    sealed or removed since is still in the file, and is counted.
//! 5. The temporary etcd is stopped and its directory removed.
//!
//! Exit code 0 when every value reads and every sealed secret opens with the key file
//! given (or none was given); 1 otherwise; 2 when the file is not a snapshot.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use moor::api::*;
use moor::store::{Keyring, Store};

/// Check an etcd snapshot file (read-only: restored into a temporary etcd).
#[derive(Debug, clap::Args)]
pub struct BackupCheck {
    /// The snapshot, as `etcdctl snapshot save` wrote it.
    pub file: PathBuf,
    /// Key prefix moor uses.
    #[arg(long, default_value = moor::store::DEFAULT_PREFIX)]
    pub prefix: String,
    /// The cluster's key file (`moord keys new`): checks that the snapshot's sealed
    /// secrets open with it.
    #[arg(long, env = "MOOR_ENCRYPTION_KEY_FILE")]
    pub encryption_key_file: Option<PathBuf>,
}

/// `moord backup ...`.
#[derive(Debug, clap::Subcommand)]
pub enum Backup {
    /// Say what an etcd snapshot holds: revision, objects and malformed values per kind,
    /// and whether its sealed secrets open with a key file.
    Check(BackupCheck),
}

impl Backup {
    /// Runs the verb; its exit code.
    pub async fn run(self) -> anyhow::Result<i32> {
        match self {
            Backup::Check(c) => c.run().await,
        }
    }
}

/// What `etcdctl snapshot status -w json` says.
#[derive(Debug, serde::Deserialize)]
struct Status {
    revision: i64,
    #[serde(rename = "totalKey")]
    total_key: u64,
    #[serde(rename = "totalSize")]
    total_size: u64,
}

/// The secrets of the snapshot's objects, by how they are stored.
#[derive(Debug, Default)]
struct Secrets {
    plain: usize,
    held: BTreeSet<String>,
    sealed_held: usize,
    unheld: BTreeSet<String>,
    sealed_unheld: usize,
}

/// A temporary etcd serving a restored snapshot; stopped and removed on drop.
struct Scratch {
    child: Option<Child>,
    dir: PathBuf,
    url: String,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Drops the operator's `PREFIX*` variables from `cmd`'s environment: etcd and etcdctl
/// refuse a setting given both by a variable and by a flag (ETCDCTL_ENDPOINTS set in a
/// shell, say), and this scratch server's settings are all flags.
fn without_settings(cmd: &mut Command, prefix: &str) {
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with(prefix) {
            cmd.env_remove(name);
        }
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Runs etcdctl (API v3) with `args`; its stdout, or its stderr as the error.
fn etcdctl(args: &[&std::ffi::OsStr]) -> anyhow::Result<String> {
    let mut cmd = Command::new("etcdctl");
    without_settings(&mut cmd, "ETCDCTL_");
    let out = cmd
        .env("ETCDCTL_API", "3")
        .args(args)
        .output()
        .context("running etcdctl (Debian: apt-get install etcd-client)")?;
    if !out.status.success() {
        anyhow::bail!("{}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Restores `file` into a temporary directory and serves it.
async fn serve(file: &Path) -> anyhow::Result<Scratch> {
    let dir = std::env::temp_dir().join(format!(
        "moord-backup-check-{}-{:08x}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos())
    ));
    std::fs::create_dir(&dir).with_context(|| format!("making {}", dir.display()))?;
    let mut scratch = Scratch {
        child: None,
        dir: dir.clone(),
        url: String::new(),
    };
    let data = dir.join("data");
    let (client, peer) = (free_port()?, free_port()?);
    let peer_url = format!("http://127.0.0.1:{peer}");
    etcdctl(&[
        "snapshot".as_ref(),
        "restore".as_ref(),
        file.as_os_str(),
        "--data-dir".as_ref(),
        data.as_os_str(),
        "--name".as_ref(),
        "check".as_ref(),
        "--initial-cluster".as_ref(),
        format!("check={peer_url}").as_ref(),
        "--initial-advertise-peer-urls".as_ref(),
        peer_url.as_ref(),
    ])
    .context("restoring the snapshot into a temporary directory")?;
    throwaway_tls(&dir)?;
    let url = format!("https://127.0.0.1:{client}");
    let log = std::fs::File::create(dir.join("etcd.log"))?;
    let mut etcd = Command::new("etcd");
    without_settings(&mut etcd, "ETCD_");
    let child = etcd
        .arg("--name=check")
        .arg(format!("--cert-file={}", dir.join("server.pem").display()))
        .arg(format!(
            "--key-file={}",
            dir.join("server-key.pem").display()
        ))
        .arg(format!(
            "--trusted-ca-file={}",
            dir.join("ca.pem").display()
        ))
        .arg("--client-cert-auth")
        .arg(format!("--data-dir={}", data.display()))
        .arg(format!("--listen-client-urls={url}"))
        .arg(format!("--advertise-client-urls={url}"))
        .arg(format!("--listen-peer-urls={peer_url}"))
        .arg(format!("--initial-advertise-peer-urls={peer_url}"))
        .arg(format!("--initial-cluster=check={peer_url}"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("starting a temporary etcd (Debian: apt-get install etcd-server)")?;
    scratch.child = Some(child);
    scratch.url = url;
    Ok(scratch)
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate with CN `root`,
/// in `dir`, for the temporary etcd alone (removed with it).
fn throwaway_tls(dir: &Path) -> anyhow::Result<()> {
    let openssl = |args: &[&str]| -> anyhow::Result<()> {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .context("running openssl (Debian: apt-get install openssl)")?;
        if !out.status.success() {
            anyhow::bail!(
                "openssl {}: {}",
                args.first().unwrap_or(&""),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    };
    let days = "2";
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca-key.pem",
        "-out",
        "ca.pem",
        "-days",
        days,
        "-subj",
        "/CN=moord-backup-check",
    ])?;
    for (name, cn, usage) in [
        (
            "server",
            "etcd",
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n",
        ),
        ("root", "root", "extendedKeyUsage=clientAuth\n"),
    ] {
        let (key, csr, ext, cert) = (
            format!("{name}-key.pem"),
            format!("{name}.csr"),
            format!("{name}.ext"),
            format!("{name}.pem"),
        );
        openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &format!("/CN={cn}"),
        ])?;
        std::fs::write(dir.join(&ext), usage.replace("\\n", "\n"))?;
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-out",
            &cert,
            "-days",
            days,
            "-extfile",
            &ext,
        ])?;
    }
    Ok(())
}

/// The values in the snapshot's history (every revision it keeps) below `prefix`
/// holding secrets in clear: a field named `secrets` or `*_secrets` that is a
/// non-empty map (sealed ones are strings). Read through a watch of every key from the
/// oldest kept revision: each revision up to `current` is a change of some key, so the
/// replay ends with an event at `current`.
async fn history_in_clear(
    client: &mut etcd_client::Client,
    prefix: &str,
    current: i64,
) -> anyhow::Result<usize> {
    fn plain(v: &serde_json::Value) -> usize {
        match v {
            serde_json::Value::Object(map) => map
                .iter()
                .map(|(k, v)| {
                    let named = k == "secrets" || k.ends_with("_secrets");
                    if named && v.as_object().is_some_and(|m| !m.is_empty()) {
                        1
                    } else {
                        plain(v)
                    }
                })
                .sum(),
            serde_json::Value::Array(items) => items.iter().map(plain).sum(),
            _ => 0,
        }
    }
    let mut start = 1;
    'replay: loop {
        let opts = etcd_client::WatchOptions::new()
            .with_from_key()
            .with_start_revision(start);
        let mut stream = client.watch(vec![0u8], Some(opts)).await?;
        let mut found = 0;
        let mut seen = 0;
        while seen < current {
            let Some(resp) = stream.message().await? else {
                anyhow::bail!("the temporary etcd ended the history's watch");
            };
            if resp.compact_revision() > start {
                // Older revisions are gone from the file: from the oldest kept.
                start = resp.compact_revision();
                continue 'replay;
            }
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                seen = seen.max(kv.mod_revision());
                if ev.event_type() == etcd_client::EventType::Put
                    && kv.key().starts_with(prefix.as_bytes())
                {
                    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(kv.value()) {
                        found += plain(&v);
                    }
                }
            }
        }
        return Ok(found);
    }
}

/// Lists kind `S` (`moord check`'s audit) and adds its objects' secrets to `secrets`.
async fn audit<S: Spec>(
    store: &Store,
    secrets: &mut Secrets,
    bad: &mut usize,
) -> anyhow::Result<()> {
    for obj in crate::check::audit::<S>(store, bad).await? {
        let mut spec = obj.spec;
        for field in spec.secret_fields() {
            if let Some(text) = field.secrets.sealed() {
                // Kept sealed: no key held opens it.
                secrets.sealed_unheld += 1;
                secrets
                    .unheld
                    .insert(sealed_key_id(text).unwrap_or("?").to_string());
                continue;
            }
            match field.secrets.stored_as() {
                Some(StoredAs::Key(id)) => {
                    secrets.sealed_held += 1;
                    secrets.held.insert(id.clone());
                }
                Some(StoredAs::Plain) if !field.secrets.is_empty() => secrets.plain += 1,
                _ => {}
            }
        }
    }
    Ok(())
}

impl BackupCheck {
    async fn run(self) -> anyhow::Result<i32> {
        let keyring = match &self.encryption_key_file {
            Some(path) => Some(Keyring::load(path)?),
            None => None,
        };
        let status = etcdctl(&[
            "snapshot".as_ref(),
            "status".as_ref(),
            self.file.as_os_str(),
            "-w".as_ref(),
            "json".as_ref(),
        ])
        .map_err(|e| {
            anyhow::anyhow!(
                "{} is not an etcd snapshot etcdctl can read: {e}",
                self.file.display()
            )
        })?;
        let status: Status = serde_json::from_str(status.trim())
            .with_context(|| format!("etcdctl snapshot status said {status:?}"))?;
        println!(
            "snapshot {}: revision {}, {} keys, {} bytes",
            self.file.display(),
            status.revision,
            status.total_key,
            status.total_size
        );
        let scratch = serve(&self.file).await?;
        let read = |f: &str| std::fs::read(scratch.dir.join(f));
        let tls = etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(read("ca.pem")?))
            .identity(etcd_client::Identity::from_pem(
                read("root.pem")?,
                read("root-key.pem")?,
            ));
        let client = etcd_client::Client::connect(
            [scratch.url.as_str()],
            Some(etcd_client::ConnectOptions::new().with_tls(tls)),
        )
        .await
        .context("connecting to the temporary etcd")?;
        let mut history = client.clone();
        let mut store = Store::new(client, &self.prefix);
        if let Some(k) = keyring {
            store = store.with_keyring(k);
        }
        // The temporary etcd answers once it has loaded the snapshot.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while let Err(e) = store.list::<NodeSpec>(&KeyScope::all()).await {
            if tokio::time::Instant::now() >= deadline {
                return Err(anyhow::anyhow!(e).context("the temporary etcd did not answer"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut bad = 0;
        let mut secrets = Secrets::default();
        for &kind in Kind::ALL {
            moor::with_spec!(kind, S => audit::<S>(&store, &mut secrets, &mut bad).await?);
        }
        let ids = |s: &BTreeSet<String>| s.iter().cloned().collect::<Vec<_>>().join(", ");
        println!(
            "secrets: {} in clear, {} sealed with a key the key file holds{}, {} sealed with a key it does not hold{}",
            secrets.plain,
            secrets.sealed_held,
            if secrets.held.is_empty() {
                String::new()
            } else {
                format!(" ({})", ids(&secrets.held))
            },
            secrets.sealed_unheld,
            if secrets.unheld.is_empty() {
                String::new()
            } else {
                format!(" ({})", ids(&secrets.unheld))
            },
        );
        let in_history = tokio::time::timeout(
            Duration::from_secs(60),
            history_in_clear(&mut history, &self.prefix, status.revision),
        )
        .await
        .map_err(|_| anyhow::anyhow!("reading the snapshot's history took over 60 s"))?
        .context("reading the snapshot's history")?;
        let now_plain = secrets.plain;
        println!(
            "history: {in_history} value(s) with secrets in clear in the revisions the snapshot keeps{}",
            if in_history > now_plain {
                " (more than now: a secret sealed or removed since is still in the file; compact and defragment before sharing it)"
            } else {
                ""
            }
        );
        if secrets.sealed_unheld > 0 {
            match &self.encryption_key_file {
                Some(path) => println!(
                    "  {} does not hold key(s) {}: those secrets stay sealed after a restore with it",
                    path.display(),
                    ids(&secrets.unheld)
                ),
                None => println!(
                    "  give the cluster's key file (--encryption-key-file) to check that it opens them"
                ),
            }
            if self.encryption_key_file.is_some() {
                bad += 1;
            }
        }
        drop(scratch);
        Ok(if bad > 0 { 1 } else { 0 })
    }
}
