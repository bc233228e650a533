//! What a test does on the rig and reads from it: volumes, allocations and their
//! claims and mounts, the plugins' faults and call logs, the engine endpoint.

use std::time::Duration;

use moor::api::*;
use moor_hostpath::calllog::{Call, CallLog};
use moor_hostpath::faults::Command;

use super::{Rig, NODE, PLUGIN};

impl Rig {
    /// Calls `VolumeDriver.VERB` on node `node`'s engine endpoint ([`RigConfig::engine`])
    /// as Docker does (a POST of JSON over its unix socket); the status and the JSON
    /// answer.
    pub async fn engine(
        &self,
        node: &str,
        verb: &str,
        body: serde_json::Value,
    ) -> (u16, serde_json::Value) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let sock = self.node(node).dir.join("engine.sock");
        let mut s = tokio::net::UnixStream::connect(&sock)
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}", sock.display()));
        let body = body.to_string();
        let req = format!(
            "POST /VolumeDriver.{verb} HTTP/1.1\r\nHost: plugin\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await.expect("send the request");
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.expect("read the answer");
        let text = String::from_utf8_lossy(&out);
        let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok());
        let status = status.unwrap_or_else(|| panic!("no status in {text:?}"));
        let rest = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(rest)
        } else {
            rest.to_string()
        };
        let value = serde_json::from_str(&rest)
            .unwrap_or_else(|e| panic!("{verb}: not JSON ({e}): {rest:?}"));
        (status, value)
    }

    /// A CSI client of the rig's plugin, for what a test does behind moor's back.
    pub fn csi(&self) -> moor::csi::client::Csi {
        let sock = self.dir.path().join("csi.sock");
        let channel = moor::csi::channel(&format!("unix://{}", sock.display())).expect("a channel");
        let policy = moor::csi::policy::Policy {
            tries: 1,
            per_try_timeout: Duration::from_secs(3),
            ..Default::default()
        };
        moor::csi::client::Csi::new(channel, policy)
    }

    /// Volume `name` as stored now.
    pub async fn get_volume(&self, name: &str) -> Option<Volume> {
        let key = Volume::key_for(&Namespace::default_ns(), name);
        self.store.try_get(&key).await.ok().flatten()
    }

    /// Sets a fault on `n1`'s plugin (the controller service's).
    pub async fn fault(&self, cmd: Command) {
        self.fault_on(NODE, cmd).await
    }

    /// Sets a fault on node `name`'s plugin.
    pub async fn fault_on(&self, name: &str, cmd: Command) {
        let admin = self.node(name).plugin_dir.join("admin.sock");
        moor_hostpath::faults::send(&admin, &cmd)
            .await
            .expect("fault command");
    }

    /// Fails the next `times` calls of `rpc` with `code`.
    pub async fn fail(&self, rpc: &str, code: &str, times: u32) {
        self.fault(Command::Fail {
            rpc: rpc.into(),
            code: code.into(),
            times,
        })
        .await;
    }

    /// Every call `n1`'s plugin saw, in the order they ended.
    pub fn calls(&self) -> Vec<Call> {
        self.calls_on(NODE)
    }

    /// Every call node `name`'s plugin saw, in the order they ended.
    pub fn calls_on(&self, name: &str) -> Vec<Call> {
        CallLog::read(&self.node(name).plugin_dir.join("calls.jsonl")).unwrap_or_default()
    }

    /// The calls of the volume lifecycle `n1`'s plugin saw (not the identity,
    /// capability and survey calls), as `RPC` or `RPC:Code` when not OK, in order.
    pub fn steps(&self) -> Vec<String> {
        self.steps_on(NODE)
    }

    /// [`Rig::steps`] of node `name`'s plugin.
    pub fn steps_on(&self, name: &str) -> Vec<String> {
        const LIFECYCLE: [&str; 12] = [
            "ControllerExpandVolume",
            "CreateSnapshot",
            "DeleteSnapshot",
            "CreateVolume",
            "DeleteVolume",
            "ControllerPublishVolume",
            "ControllerUnpublishVolume",
            "NodeStageVolume",
            "NodeUnstageVolume",
            "NodePublishVolume",
            "NodeUnpublishVolume",
            "NodeExpandVolume",
        ];
        self.calls_on(name)
            .into_iter()
            .filter(|c| LIFECYCLE.contains(&c.rpc.as_str()))
            .map(|c| {
                if c.ok() {
                    c.rpc
                } else {
                    format!("{}:{}", c.rpc, c.code)
                }
            })
            .collect()
    }

    /// Waits up to 30 s for `cond`; on timeout fails with `what` and the calls so far.
    pub async fn wait<F, Fut>(&self, what: &str, mut cond: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !cond().await {
            if tokio::time::Instant::now() > deadline {
                let calls: Vec<(&str, Vec<String>)> = self
                    .nodes
                    .iter()
                    .map(|n| (n.name.as_str(), self.steps_on(&n.name)))
                    .collect();
                panic!("timed out waiting for {what}; calls: {calls:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Creates a volume the provisioner makes, in `mode`, and waits until it is.
    pub async fn volume(&self, name: &str, mode: AccessMode) {
        let v = Volume::new(
            &Namespace::default_ns(),
            Name::new(name).expect("volume name"),
            VolumeSpec {
                plugin_id: PluginId::new(PLUGIN).expect("plugin id"),
                capacity_min: Some(Size(1 << 20)),
                capabilities: vec![VolumeCapability {
                    access_mode: mode,
                    attachment_mode: AttachmentMode::FileSystem,
                }],
                ..Default::default()
            },
        );
        self.store.create(&v).await.expect("create the volume");
        let key = Volume::key_for(&Namespace::default_ns(), name);
        self.wait(&format!("volume {name} to be created"), || async {
            self.store
                .try_get(&key)
                .await
                .ok()
                .flatten()
                .is_some_and(|v| v.status.provisioning.external_id.is_some())
        })
        .await;
    }

    /// Runs allocation `name` on `n1` with `volume` (as `data`).
    pub async fn run(&self, name: &str, volume: &str) {
        self.run_on(name, NODE, volume).await
    }

    /// Runs allocation `name` on node `node` with `volume` (as `data`).
    pub async fn run_on(&self, name: &str, node: &str, volume: &str) {
        let volume = VolumeId::new(volume).expect("volume id");
        self.run_request(name, node, |r| r.volume = volume).await;
    }

    /// Runs allocation `name` on the rig's node with a volume made from a template of
    /// the rig's plugin (ephemeral, 1 MiB at least), as its `data` request.
    pub async fn run_templated(&self, name: &str) {
        self.run_request(name, NODE, |r| {
            r.template = Some(Box::new(VolumeTemplate {
                plugin_id: PluginId::new(PLUGIN).expect("plugin id"),
                capacity_min: Some(Size(1 << 20)),
                ..Default::default()
            }))
        })
        .await;
    }

    /// Runs allocation `name` on the rig's node with one request, `data`, as `fill`
    /// makes it.
    async fn run_request(&self, name: &str, node: &str, fill: impl FnOnce(&mut VolumeRequest)) {
        let mut request = VolumeRequest {
            name: Name::new("data").expect("request name"),
            ..Default::default()
        };
        fill(&mut request);
        let a = Allocation::new(
            &Namespace::default_ns(),
            Name::new(name).expect("allocation name"),
            AllocationSpec {
                node: NodeName::new(node).expect("node name"),
                volumes: vec![request],
                ..Default::default()
            },
        );
        moor::workload::create_or_adopt(&self.store, &a, moor::workload::IfEnded::Refuse, false)
            .await
            .expect("create the allocation");
    }

    /// Edits volume `name`'s spec (read, changed, written back guarded, again on a
    /// conflict).
    pub async fn edit_volume(&self, name: &str, mut edit: impl FnMut(&mut VolumeSpec)) {
        let key = Volume::key_for(&Namespace::default_ns(), name);
        self.store
            .modify_spec(&key, |spec| {
                edit(spec);
                true
            })
            .await
            .expect("edit the volume");
    }

    /// Stops allocation `name` (its desired status).
    pub async fn stop(&self, name: &str) {
        let key = Allocation::key_for(&Namespace::default_ns(), name);
        moor::workload::end(&self.store, &key, moor::workload::End::Stop)
            .await
            .expect("stop the allocation");
    }

    /// Allocation `alloc`'s claim of its `data` volume, on `n1`.
    pub async fn claim(&self, alloc: &str) -> Option<Claim> {
        self.claim_on(NODE, alloc).await
    }

    /// Allocation `alloc`'s claim of its `data` volume, on node `node`.
    pub async fn claim_on(&self, node: &str, alloc: &str) -> Option<Claim> {
        let key = claim_key(node, alloc);
        self.store.try_get(&key).await.ok().flatten()
    }

    /// The Mount of allocation `alloc`'s claim on `n1`, as the agent wrote it.
    pub async fn mount(&self, alloc: &str) -> Option<Mount> {
        self.mount_on(NODE, alloc).await
    }

    /// The Mount of allocation `alloc`'s claim on node `node`.
    pub async fn mount_on(&self, node: &str, alloc: &str) -> Option<Mount> {
        let claim = claim_key(node, alloc);
        self.store
            .try_get(&Mount::key_for(&claim))
            .await
            .ok()
            .flatten()
    }

    /// Waits until allocation `alloc`'s claim on `n1` is in `phase`.
    pub async fn wait_claim(&self, alloc: &str, phase: ClaimPhase) {
        self.wait_claim_on(NODE, alloc, phase).await
    }

    /// Waits until allocation `alloc`'s claim on node `node` is in `phase`.
    pub async fn wait_claim_on(&self, node: &str, alloc: &str, phase: ClaimPhase) {
        self.wait(
            &format!("claim {alloc}.data on {node} to be {phase:?}"),
            || async {
                self.claim_on(node, alloc)
                    .await
                    .is_some_and(|c| c.status.phase == phase)
            },
        )
        .await;
    }
}

/// The key of allocation `alloc`'s claim of its `data` volume on `node`.
fn claim_key(node: &str, alloc: &str) -> ObjectKey<ClaimSpec> {
    Claim::key_for(
        &NodeName::new(node).expect("node name"),
        &Namespace::default_ns(),
        format!("{alloc}.data"),
    )
}

/// A chunked HTTP body, joined.
fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}
