//! Runs the real moor-hostpath binary on a temp unix socket.

#![allow(dead_code)]

use moor_csi::v1::{
    controller_client::ControllerClient, identity_client::IdentityClient, node_client::NodeClient,
    volume_capability, ProbeRequest, VolumeCapability,
};
use moor_hostpath::calllog::{Call, CallLog};
use moor_hostpath::faults::{self, Command};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

pub struct HostPath {
    pub dir: tempfile::TempDir,
    pub endpoint: String,
    pub admin: PathBuf,
    pub calls: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
    channel: Channel,
}

pub use moor_hostpath::mounts::can_mount;

impl HostPath {
    /// Starts a plugin with extra arguments (mounting for real when root).
    pub async fn start(extra: &[&str]) -> HostPath {
        let dir = tempfile::tempdir().unwrap();
        let endpoint = format!("unix://{}", dir.path().join("csi.sock").display());
        // Other nodes the tests publish to, "in the cloud" beside this one.
        let registry = dir.path().join("nodes");
        std::fs::create_dir_all(&registry).unwrap();
        for other in ["n1", "n2", "n3"] {
            std::fs::write(registry.join(other), b"").unwrap();
        }
        let mut args: Vec<String> = vec![
            format!("--endpoint={endpoint}"),
            "--node-id=node-1".into(),
            format!("--state-dir={}", dir.path().join("state").display()),
            format!("--node-registry={}", registry.display()),
        ];
        if !can_mount() {
            args.push("--no-mount".into());
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut hp = HostPath {
            admin: dir.path().join("state/admin.sock"),
            calls: dir.path().join("state/calls.jsonl"),
            channel: moor_csi::channel(&endpoint).unwrap(),
            endpoint,
            dir,
            args,
            child: None,
        };
        hp.spawn().await;
        hp
    }

    async fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("plugin.log"))
            .unwrap();
        self.child = Some(
            std::process::Command::new(env!("CARGO_BIN_EXE_moor-hostpath"))
                .args(&self.args)
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("run moor-hostpath"),
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if self.identity().probe(ProbeRequest {}).await.is_ok() {
                return;
            }
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
                panic!("moor-hostpath exited with {status}: {}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "moor-hostpath did not answer Probe: {}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("plugin.log")).unwrap_or_default()
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }

    /// Waits for the process to exit by itself; its exit code.
    pub async fn exited(&mut self, within: Duration) -> Option<i32> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
                self.child = None;
                return status.code();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        None
    }

    pub fn identity(&self) -> IdentityClient<Channel> {
        IdentityClient::new(self.channel.clone())
    }
    pub fn controller(&self) -> ControllerClient<Channel> {
        ControllerClient::new(self.channel.clone())
    }
    pub fn group(&self) -> moor_csi::v1::group_controller_client::GroupControllerClient<Channel> {
        moor_csi::v1::group_controller_client::GroupControllerClient::new(self.channel.clone())
    }

    pub fn node(&self) -> NodeClient<Channel> {
        NodeClient::new(self.channel.clone())
    }

    pub fn calls(&self) -> Vec<Call> {
        CallLog::read(&self.calls).unwrap_or_default()
    }

    pub async fn fault(&self, cmd: Command) {
        faults::send(&self.admin, &cmd)
            .await
            .expect("fault command accepted");
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }
}

impl Drop for HostPath {
    fn drop(&mut self) {
        self.kill();
        // Leave no mounts behind in the temp dir.
        if let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") {
            let root = self.dir.path().to_string_lossy().to_string();
            let mut points: Vec<&str> = info
                .lines()
                .filter_map(|l| l.split(' ').nth(4))
                .filter(|p| p.starts_with(&root))
                .collect();
            points.sort_by_key(|p| std::cmp::Reverse(p.len()));
            for p in points {
                let _ = rustix_unmount(p);
            }
        }
    }
}

fn rustix_unmount(p: &str) -> std::io::Result<()> {
    let status = std::process::Command::new("umount").arg(p).status()?;
    if status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other("umount failed"))
    }
}

pub fn cap(mode: volume_capability::access_mode::Mode, block: bool) -> VolumeCapability {
    VolumeCapability {
        access_type: Some(if block {
            volume_capability::AccessType::Block(volume_capability::BlockVolume {})
        } else {
            volume_capability::AccessType::Mount(volume_capability::MountVolume::default())
        }),
        access_mode: Some(volume_capability::AccessMode { mode: mode as i32 }),
    }
}

pub fn sw() -> VolumeCapability {
    cap(
        volume_capability::access_mode::Mode::SingleNodeWriter,
        false,
    )
}

pub fn snmw() -> VolumeCapability {
    cap(
        volume_capability::access_mode::Mode::SingleNodeMultiWriter,
        false,
    )
}

pub fn mnmw() -> VolumeCapability {
    cap(
        volume_capability::access_mode::Mode::MultiNodeMultiWriter,
        false,
    )
}

/// Counts the mountinfo entries whose mount point is `path`.
pub fn mount_count(path: &std::path::Path) -> usize {
    let want = path.to_string_lossy();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.split(' ').nth(4) == Some(want.as_ref()))
        .count()
}
