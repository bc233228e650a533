//! Least privilege on a real etcd with TLS, client-certificate auth and the roles of
//! deploy/etcd/roles.sh: each identity is refused what is not its own (other nodes'
//! keys, volumes and their secrets, other writers' events and leases, the controller's
//! election, keys outside the prefix) and granted what it needs: the whole lifecycle of
//! a claim runs with every process under its own certificate, its secrets sealed at
//! rest with the cluster's key file and the node's derived key.

mod common;
#[path = "common/secure.rs"]
mod secure;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{bin, fixtures::volume, free_port, wait_for};
use moor::api::*;
use moor::store::{EtcdAuth, Store};
use secure::{denied, deploy, run, write_private, Proc, Secure};

const T: Duration = Duration::from_secs(60);

#[tokio::test]
async fn each_identity_is_granted_its_own_keys_and_refused_the_rest() {
    let s = Secure::start().await;
    // Agent n1: its own node's keys and events yes, another node's no.
    let mut n1 = s.raw("moor-agent-n1").await;
    for key in [
        "/moor/nodes/n1",
        "/moor/mounts/n1/default/web-1.data",
        "/moor/events/node/n1/default/e1",
    ] {
        n1.put(key, "{}", None)
            .await
            .unwrap_or_else(|e| panic!("agent n1 may write {key}: {e}"));
    }
    // n1 hosts the hostpath controller plugin: it campaigns in that election only.
    n1.put("/moor/leaders/plugin.hostpath.moor.dev", "n1", None)
        .await
        .expect("agent n1 may write its plugin's election key");
    n1.delete("/moor/leaders/plugin.hostpath.moor.dev", None)
        .await
        .unwrap();
    // ...and writes that plugin's capacity report, not its Plugin object (issue 26).
    n1.put("/moor/capacities/hostpath.moor.dev", "[]", None)
        .await
        .expect("agent n1 may write its plugin's capacity report");
    for key in [
        "/moor/plugins/hostpath.moor.dev",
        "/moor/capacities/other.example.com",
        "/moor/nodes/n2",
        "/moor/mounts/n2/default/web-1.data",
        "/moor/claims/n1/default/c",
        "/moor/nodes/n1x",
        "/moor/leaders/controller",
        "/moor/leaders/plugin.other.example.com",
        "/moor/leaders/plugin.hostpath.moor.devx",
        "/moor/events/controller/default/e",
        "/moor/events/node/n2/default/e",
        "/moor/events/node/n1x/default/e",
        "/moor/events/default/e",
        "/other/key",
    ] {
        let e = n1.put(key, "{}", None).await.expect_err(key);
        assert!(denied(&e), "{key}: {e}");
    }
    // Node confinement of reads: n2 hosts no controller plugin and reads only its own
    // Node, claims, mounts and events, and the plugins.
    let mut n2 = s.raw("moor-agent-n2").await;
    for key in [
        "/moor/nodes/n2",
        "/moor/claims/n2/default/c",
        "/moor/mounts/n2/default/c",
        "/moor/plugins/hostpath.moor.dev",
        "/moor/events/node/n2/default/e",
    ] {
        n2.get(key, None)
            .await
            .unwrap_or_else(|e| panic!("agent n2 may read {key}: {e}"));
    }
    for key in [
        "/moor/volumes/default/v",
        "/moor/allocations/default/a",
        "/moor/claims/n1/default/c",
        "/moor/mounts/n1/default/web-1.data",
        "/moor/nodes/n1",
        "/moor/attachments/default/v/n2",
        "/moor/leaders/controller",
        "/moor/events/node/n1/default/e1",
        "/moor/events/controller/default/e",
        "/other/key",
    ] {
        let e = n2.get(key, None).await.expect_err(key);
        assert!(denied(&e), "{key}: {e}");
    }
    // Secrets: n1 reads its plugin's (read only), not another plugin's; n2, which
    // leads no controller plugin, none at all.
    let mine = "/moor/secrets/hostpath.moor.dev/default/db";
    n1.get(mine, None)
        .await
        .unwrap_or_else(|e| panic!("agent n1 may read {mine}: {e}"));
    let e = n1
        .put(mine, "{}", None)
        .await
        .expect_err("n1 writes a Secret");
    assert!(denied(&e), "{e}");
    for key in [
        "/moor/secrets/other.example.com/default/db",
        "/moor/secrets/hostpath.moor.devx/default/db",
    ] {
        let e = n1.get(key, None).await.expect_err(key);
        assert!(denied(&e), "{key}: {e}");
    }
    let e = n2.get(mine, None).await.expect_err("n2 reads a Secret");
    assert!(denied(&e), "{e}");
    for prefix in [
        "/moor/volumes/",
        "/moor/events/",
        "/moor/claims/",
        "/moor/secrets/",
    ] {
        let e = n2
            .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
            .await
            .expect_err(prefix);
        assert!(denied(&e), "{prefix}: {e}");
    }
    // Ownership records (issue 77): n1, which leads the plugin, writes its plugin's
    // and no other plugin's; n2 none at all.
    let record = "/moor/owners/hostpath.moor.dev/volume.00";
    n1.put(record, "{}", None)
        .await
        .unwrap_or_else(|e| panic!("agent n1 may write {record}: {e}"));
    for key in [
        "/moor/owners/other.example.com/volume.00",
        "/moor/owners/hostpath.moor.devx/volume.00",
    ] {
        let e = n1.put(key, "{}", None).await.expect_err(key);
        assert!(denied(&e), "{key}: {e}");
    }
    let e = n2
        .put(record, "{}", None)
        .await
        .expect_err("n2 writes an ownership record");
    assert!(denied(&e), "{e}");
    n1.delete(record, None)
        .await
        .expect("n1 removes its record");
    // Attachments, volumes, snapshots and groups (issue 77): the controller writes
    // them; n1, which leads the plugin, reads them and writes its plugin's reports on
    // them, not another plugin's (so it can neither publish another plugin's volume to
    // a node of its choosing, nor say one is attached or cut, nor mark one deleted,
    // rewrite its spec, drop its finalizers or make a group's members); n2 none of it.
    for (object, report) in [
        (
            "attachments/default/v/n2",
            "attachment-reports/PLUGIN/default/v/n2",
        ),
        ("volumes/default/v", "volume-reports/PLUGIN/default/v"),
        ("snapshots/default/s", "snapshot-reports/PLUGIN/default/s"),
        (
            "groupsnapshots/default/g",
            "groupsnapshot-reports/PLUGIN/default/g",
        ),
    ] {
        let object = format!("/moor/{object}");
        n1.get(object.clone(), None)
            .await
            .unwrap_or_else(|e| panic!("agent n1 may read {object}: {e}"));
        let put = n1.put(object.clone(), "{}", None).await;
        let delete = n1.delete(object.clone(), None).await;
        for refused in [put.map(|_| ()), delete.map(|_| ())] {
            let e = refused.expect_err(&object);
            assert!(denied(&e), "{object}: {e}");
        }
        let mine = format!("/moor/{}", report.replace("PLUGIN", "hostpath.moor.dev"));
        n1.put(mine.clone(), "{}", None)
            .await
            .unwrap_or_else(|e| panic!("agent n1 may write {mine}: {e}"));
        n1.delete(mine.clone(), None)
            .await
            .expect("n1 removes its report");
        for other in ["other.example.com", "hostpath.moor.devx"] {
            let key = format!("/moor/{}", report.replace("PLUGIN", other));
            let e = n1.put(key.clone(), "{}", None).await.expect_err(&key);
            assert!(denied(&e), "{key}: {e}");
        }
        let e = n2.put(mine.clone(), "{}", None).await.expect_err(&mine);
        assert!(denied(&e), "n2 writes {mine}: {e}");
    }
    // Namespace a's edit identity (issue 77): a's requests, nothing of b's, no fact.
    let a = s.store("moor-edit-a", None).await;
    let mut a = a.client();
    for key in [
        "/moor/volumes/a/v",
        "/moor/allocations/a/x",
        "/moor/snapshots/a/s",
        "/moor/snapshotschedules/a/s",
        "/moor/leases/a/x",
        "/moor/secrets/hostpath.moor.dev/a/db",
    ] {
        a.put(key, "{}", None)
            .await
            .unwrap_or_else(|e| panic!("moor-edit-a may write {key}: {e}"));
        a.delete(key, None).await.unwrap();
    }
    for key in [
        "/moor/volumes/b/v",
        "/moor/allocations/b/x",
        "/moor/secrets/hostpath.moor.dev/b/db",
        "/moor/secrets/other.example.com/a/db",
        "/moor/claims/n1/a/x.data",
        "/moor/mounts/n1/a/x.data",
        "/moor/attachments/a/v/n1",
        "/moor/owners/hostpath.moor.dev/volume.00",
        "/moor/events/controller/a/e",
        "/moor/volumeclasses/c",
    ] {
        let e = a.put(key, "{}", None).await.expect_err(key);
        assert!(denied(&e), "{key}: {e}");
    }
    a.get(
        "/moor/events/controller/a/",
        Some(etcd_client::GetOptions::new().with_prefix()),
    )
    .await
    .expect("moor-edit-a reads the controller's events about a");
    for prefix in ["/moor/volumes/", "/moor/claims/", "/moor/secrets/"] {
        let e = a
            .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
            .await
            .expect_err(prefix);
        assert!(denied(&e), "{prefix}: {e}");
    }
    // Events cannot be erased by another writer, nor their lease revoked.
    let controller = s.store("moor-controller", None).await;
    let mut c = controller.client();
    let lease = c.lease_grant(600, None).await.unwrap().id();
    c.put(
        "/moor/events/controller/default/e",
        "{}",
        Some(etcd_client::PutOptions::new().with_lease(lease)),
    )
    .await
    .unwrap();
    let e = n1
        .delete(
            "/moor/events/",
            Some(etcd_client::DeleteOptions::new().with_prefix()),
        )
        .await
        .expect_err("delete all events");
    assert!(denied(&e), "{e}");
    let e = n1
        .lease_revoke(lease)
        .await
        .expect_err("revoke the controller's lease");
    assert!(denied(&e), "{e}");
    assert_eq!(
        c.get("/moor/events/controller/default/e", None)
            .await
            .unwrap()
            .kvs()
            .len(),
        1
    );
    n1.delete("/moor/nodes/n1", None).await.unwrap();
    let e = n1
        .delete("/moor/nodes/n2", None)
        .await
        .expect_err("delete n2");
    assert!(denied(&e), "{e}");

    // moorctl: one line saying what was refused and what to do.
    controller.create(&volume("v1")).await.unwrap();
    let out = s.moorctl(
        "moor-agent-n2",
        None,
        &["volume", "detach", "v1", "--node", "n1"],
    );
    assert!(!out.status.success(), "an agent must not edit volumes");
    // It names the identity and what it lacked, never etcd's bare words.
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains(&format!(
            "moorctl: etcd at {} refused identity moor-agent-n2 a ",
            s.url
        )) && said.contains(" /moor/")
            && said.contains("its etcd role does not grant it; ask an operator"),
        "{out:?}"
    );
    let out = Command::new(bin("moorctl"))
        .env("MOOR_ENDPOINTS", &s.url)
        .env_remove("MOOR_CACERT")
        .args(["get", "volumes"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim_end(),
        format!(
            "moorctl: cannot reach etcd at {}: etcd's certificate is not signed by a CA \
             moorctl trusts; give the CA that signed it with --cacert or MOOR_CACERT",
            s.url
        ),
        "{out:?}"
    );
    let out = s.moorctl(
        "moor-agent-n1",
        None,
        &["get", "volumes", "--user", "bob:wrong", "-v"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with(&format!(
            "moorctl: etcd at {} refused: wrong user name or password; check --user",
            s.url
        )) && stderr.contains("  root: "),
        "{out:?}"
    );
    // moord check takes the same TLS flags; it reads everything, and reports the `{}`
    // values written above as malformed (exit 1).
    let check = s
        .cmd("moord", "moor-controller", None)
        .args(["check", "--etcd", &s.url])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&check.stdout);
    assert!(
        check.status.code() == Some(1)
            && stdout.contains("Volume              1 objects")
            && stdout.contains("malformed value at events/node/n1/default/e1"),
        "{check:?}"
    );
    // Without a client certificate etcd refuses the connection.
    let anonymous = EtcdAuth {
        cert: None,
        key: None,
        ..s.auth("root", None)
    };
    let refused = match anonymous
        .connect(std::slice::from_ref(&s.url), "/moor/")
        .await
    {
        Err(_) => true,
        Ok(st) => st
            .try_get(&common::key::<NodeSpec>("nodes/n1"))
            .await
            .is_err(),
    };
    assert!(refused, "a client without a certificate was served");
}

/// Waits (with a deadline) until claim `name` on n2 is Published.
async fn published_on_n2(store: &Store, name: &str, what: &str) {
    let key = Claim::key_for(
        &NodeName::new("n2").unwrap(),
        &Namespace::default_ns(),
        name,
    );
    wait_for(what, T, || {
        let (store, key) = (store.clone(), key.clone());
        async move {
            store
                .try_get(&key)
                .await
                .ok()
                .flatten()
                .is_some_and(|c| c.status.phase == ClaimPhase::Published)
        }
    })
    .await;
}

/// The raw value stored at `key`, read as root.
async fn raw_value(raw: &mut etcd_client::Client, key: &str) -> String {
    let resp = raw.get(key, None).await.unwrap();
    resp.kvs()
        .first()
        .map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
        .unwrap_or_default()
}

#[tokio::test]
async fn the_whole_lifecycle_runs_under_each_identity_s_certificate_with_secrets_sealed() {
    let s = Secure::start().await;
    let keys = Some(s.cluster_keys.as_path());
    let _controller = s.controller("controller", &[]);
    let mut procs = Vec::new();
    // n1's survey unpublishes attachments it does not know (issue 40: with the
    // volume's secrets, opened).
    let survey = ["--survey-interval=1s", "--unpublish-unknown-attachments"].map(String::from);
    for (node, mode, user_keys, extra) in [
        ("n1", "monolith", s.cluster_keys.clone(), &survey[..]),
        ("n2", "node", s.n2_keys.clone(), &[][..]),
    ] {
        procs.extend(s.node_with(node, mode, &user_keys, extra));
    }
    let manifest = s.tmp.path().join("app.yaml");
    let volume = |name: &str| {
        format!(
            "apiVersion: moor/v1\nkind: Volume\nmetadata: {{name: {name}}}\nspec:\n  plugin_id: hostpath.moor.dev\n  capacity_min: 1MiB\n  secrets: {{token: s3cret}}\n  capabilities:\n    - {{access_mode: single-node-writer, attachment_mode: file-system}}\n---\n"
        )
    };
    std::fs::write(
        &manifest,
        volume("v1") + &volume("vx") + "\
         apiVersion: moor/v1\nkind: Allocation\nmetadata: {name: a1}\nspec:\n  node: n2\n  volumes:\n    - {name: data, volume: v1}\n---\n\
         apiVersion: moor/v1\nkind: Secret\nmetadata: {name: db}\nspec:\n  plugin_id: hostpath.moor.dev\n  secrets: {dbpass: by-reference}\n---\n\
         apiVersion: moor/v1\nkind: Volume\nmetadata: {name: vr}\nspec:\n  plugin_id: hostpath.moor.dev\n  capacity_min: 1MiB\n  secret_refs: {controller: db, node_stage: db, node_publish: db}\n  capabilities:\n    - {access_mode: single-node-writer, attachment_mode: file-system}\n---\n\
         apiVersion: moor/v1\nkind: Allocation\nmetadata: {name: ar}\nspec:\n  node: n2\n  volumes:\n    - {name: data, volume: vr}\n",
    )
    .unwrap();
    let out = s.moorctl(
        "moor-controller",
        keys,
        &["apply", "-f", manifest.to_str().unwrap()],
    );
    assert!(out.status.success(), "{out:?}");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("unencrypted"),
        "{out:?}"
    );

    let store = s.store("moor-controller", keys).await;
    let claim_key = Claim::key_for(
        &NodeName::new("n2").unwrap(),
        &Namespace::default_ns(),
        "a1.data",
    );
    published_on_n2(
        &store,
        "a1.data",
        "the claim published on n2 under the agents' own roles",
    )
    .await;
    // At rest: sealed, with the key's id; nowhere in plain text.
    let mut root = s.raw("root").await;
    for key in [
        "/moor/volumes/default/v1",
        "/moor/claims/n2/default/a1.data",
    ] {
        let value = raw_value(&mut root, key).await;
        assert!(value.contains("moor:sealed:v1:k1:"), "{key}: {value}");
        assert!(!value.contains("s3cret"), "{key}: {value}");
    }
    // n2's agent opened its claim's secrets with its node key: the plugin got them.
    let calls = moor_hostpath::calllog::CallLog::read(&s.tmp.path().join("n2/plugin/calls.jsonl"))
        .unwrap_or_default();
    let publish = calls
        .iter()
        .find(|c| {
            c.rpc == "NodePublishVolume"
                && c.code == "OK"
                && c.target_path
                    .as_deref()
                    .is_some_and(|p| p.contains("/a1/v1/"))
        })
        .expect("a1's NodePublishVolume on n2");
    assert_eq!(publish.secret_keys, ["token"], "{publish:?}");
    // The controller-plugin agent n1 opened the volume's for CreateVolume and
    // ControllerPublish.
    let calls = moor_hostpath::calllog::CallLog::read(&s.tmp.path().join("n1/plugin/calls.jsonl"))
        .unwrap_or_default();
    assert!(
        calls
            .iter()
            .any(|c| c.rpc == "CreateVolume" && c.secret_keys == ["token"])
            && calls
                .iter()
                .any(|c| c.rpc == "ControllerPublishVolume" && c.secret_keys == ["token"]),
        "{calls:?}"
    );

    // Secrets by reference, under the same grants: n1 (leading the plugin) read the
    // Secret for CreateVolume and ControllerPublish; n2, which may not read Secrets,
    // got its copy in its claim, sealed with its own key.
    published_on_n2(
        &store,
        "ar.data",
        "ar published on n2 with a Secret by reference",
    )
    .await;
    for key in [
        "/moor/secrets/hostpath.moor.dev/default/db",
        "/moor/claims/n2/default/ar.data",
    ] {
        let value = raw_value(&mut root, key).await;
        assert!(value.contains("moor:sealed:v1:k1:"), "{key}: {value}");
        assert!(!value.contains("by-reference"), "{key}: {value}");
    }
    let vr_id = store
        .get(&Volume::key_for(&Namespace::default_ns(), "vr"))
        .await
        .unwrap()
        .status
        .provisioning
        .external_id
        .unwrap()
        .to_string();
    let with_db = |file: &str, rpc: &str| {
        moor_hostpath::calllog::CallLog::read(&s.tmp.path().join(file))
            .unwrap_or_default()
            .iter()
            .any(|c| {
                c.rpc == rpc
                    && c.code == "OK"
                    && c.volume_id.as_deref() == Some(vr_id.as_str())
                    && c.secret_keys == ["dbpass"]
            })
    };
    assert!(with_db("n1/plugin/calls.jsonl", "ControllerPublishVolume"));
    assert!(with_db("n2/plugin/calls.jsonl", "NodePublishVolume"));

    // vx published to n2 behind moor's back: n1's survey finds the attachment it does
    // not hold and unpublishes it with vx's secrets, opened with the cluster's key.
    let vx_key = Volume::key_for(&Namespace::default_ns(), "vx");
    wait_for("vx created", T, || {
        let (store, key) = (store.clone(), vx_key.clone());
        async move {
            store
                .try_get(&key)
                .await
                .ok()
                .flatten()
                .is_some_and(|v| v.status.provisioning.external_id.is_some())
        }
    })
    .await;
    let vx = store.get(&vx_key).await.unwrap();
    let vx_id = vx.status.provisioning.external_id.unwrap().to_string();
    let channel = moor::csi::channel(&format!(
        "unix://{}",
        s.tmp.path().join("n1/csi.sock").display()
    ))
    .unwrap();
    moor::csi::v1::controller_client::ControllerClient::new(channel)
        .controller_publish_volume(moor::csi::v1::ControllerPublishVolumeRequest {
            volume_id: vx_id.clone(),
            node_id: "csi-n2".into(),
            volume_capability: Some(moor::csi::convert::capability(
                VolumeCapability {
                    access_mode: AccessMode::SingleNodeWriter,
                    attachment_mode: AttachmentMode::FileSystem,
                },
                &Default::default(),
            )),
            secrets: [("token".to_string(), "s3cret".to_string())].into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let n1_calls = s.tmp.path().join("n1/plugin/calls.jsonl");
    let unpublished = |calls: &[moor_hostpath::calllog::Call]| {
        calls
            .iter()
            .filter(|c| {
                c.rpc == "ControllerUnpublishVolume"
                    && c.volume_id.as_deref() == Some(vx_id.as_str())
            })
            .map(|c| c.secret_keys.clone())
            .collect::<Vec<_>>()
    };
    wait_for("the survey's unpublish of vx", T, || {
        let calls = moor_hostpath::calllog::CallLog::read(&n1_calls).unwrap_or_default();
        let made = !unpublished(&calls).is_empty();
        async move { made }
    })
    .await;
    let calls = moor_hostpath::calllog::CallLog::read(&n1_calls).unwrap_or_default();
    assert!(
        unpublished(&calls).iter().all(|keys| keys == &["token"]),
        "{:?}",
        unpublished(&calls)
    );

    // moorctl shows secrets only to a key holder.
    let out = s.moorctl(
        "moor-controller",
        keys,
        &["get", "volume", "v1", "-o", "yaml"],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("[redacted]") && !text.contains("s3cret"),
        "{out:?}"
    );
    let out = s.moorctl(
        "moor-controller",
        keys,
        &["get", "volume", "v1", "-o", "yaml", "--show-secrets"],
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("s3cret"),
        "{out:?}"
    );
    let out = s.moorctl(
        "moor-controller",
        None,
        &["get", "volume", "v1", "-o", "yaml", "--show-secrets"],
    );
    assert!(
        !out.status.success()
            && String::from_utf8_lossy(&out.stderr)
                .contains("encrypted with key \"k1\", which this moorctl does not hold"),
        "{out:?}"
    );
    let out = s.moorctl(
        "moor-controller",
        None,
        &["get", "volume", "v1", "-o", "yaml"],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !text.contains("moor:sealed"),
        "{out:?}"
    );

    // Events, each writer under its own prefix, merged by moorctl.
    for prefix in ["/moor/events/controller/", "/moor/events/node/n2/"] {
        let n = root
            .get(
                prefix,
                Some(
                    etcd_client::GetOptions::new()
                        .with_prefix()
                        .with_count_only(),
                ),
            )
            .await
            .unwrap()
            .count();
        assert!(n > 0, "no events under {prefix}");
    }
    let out = s.moorctl("moor-controller", None, &["events"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        // Agent n2's and the controller's.
        text.contains("Mount volume") && text.contains("Claim published"),
        "{out:?}"
    );

    // Issue 26, item 5: any node may write an event about any object, with terminal
    // escapes in it. Claim a1.data is on n2: n1's event about it is not shown by
    // describe, n2's is, with its source; nothing moorctl prints carries a raw escape.
    // (n1 hosts the volume's controller plugin, so it may speak about v1 itself.)
    // Issue 49, item 8: naming its own Node or plugin as the related object does not
    // pass n1's event about n2's claim through (each named object is judged).
    let own_node = serde_json::json!({"kind": "Node", "namespace": "", "name": "n1"});
    let own_plugin =
        serde_json::json!({"kind": "Plugin", "namespace": "", "name": "hostpath.moor.dev"});
    for (node, reason, related) in [
        ("n1", "Spoofed", serde_json::Value::Null),
        ("n1", "Spoofed", own_node),
        ("n1", "Spoofed", own_plugin),
        ("n2", "Noted", serde_json::Value::Null),
    ] {
        let name = format!("e-{node}-{}", related["kind"].as_str().unwrap_or("none"));
        let event = serde_json::json!({
            "apiVersion": "moor/v1", "kind": "Event",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"reason": reason, "type": "Warning",
                     "message": "\u{1b}[2J\u{1b}]0;owned\u{7}\u{202e}gnirts",
                     "object": {"kind": "Claim", "namespace": "default", "name": "a1.data"},
                     "related": related,
                     "source": format!("agent/{node}"), "time": "2026-11-24T00:00:00Z"}
        });
        s.raw(&format!("moor-agent-{node}"))
            .await
            .put(
                format!("/moor/events/node/{node}/default/{name}"),
                event.to_string(),
                None,
            )
            .await
            .unwrap();
    }
    let raw_escape = |b: &[u8]| {
        let t = String::from_utf8_lossy(b);
        t.contains('\u{1b}') || t.contains('\u{7}') || t.contains('\u{202e}')
    };
    let out = s.moorctl("moor-controller", None, &["describe", "claim", "a1.data"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        text.contains("Noted") && text.contains("agent/n2") && !text.contains("Spoofed"),
        "{text}"
    );
    assert!(
        text.contains("written by nodes their object is not on"),
        "{text}"
    );
    // Issue 37, item 5: one rule for every view: `events` and `events --for` hide it
    // too and say so, show every event's SOURCE, and show it on request.
    for args in [
        &["events"][..],
        &["events", "--for", "claim/a1.data"][..],
        &["describe", "volume", "v1"][..],
    ] {
        let out = s.moorctl("moor-controller", None, args);
        let text = String::from_utf8_lossy(&out.stdout);
        let all = String::from_utf8_lossy(&out.stderr).into_owned() + &text;
        assert!(out.status.success(), "{args:?}: {out:?}");
        assert!(
            text.contains("SOURCE") && text.contains("Noted") && text.contains("agent/n2"),
            "{args:?}: {all}"
        );
        assert!(!text.contains("Spoofed"), "{args:?}: {all}");
        assert!(all.contains("not shown: --all-sources"), "{args:?}: {all}");
        let mut with_all = args.to_vec();
        with_all.push("--all-sources");
        let out = s.moorctl("moor-controller", None, &with_all);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("Spoofed") && text.contains("agent/n1"),
            "{with_all:?}: {text}"
        );
    }
    assert!(text.contains("\\u{1b}[2J"), "{text}");
    assert!(!raw_escape(&out.stdout), "{text}");
    for format in ["json", "yaml", "wide"] {
        let out = s.moorctl("moor-controller", None, &["get", "events", "-o", format]);
        assert!(out.status.success(), "{out:?}");
        assert!(!raw_escape(&out.stdout), "{format}: {out:?}");
        if format == "json" {
            let v: serde_json::Value = serde_json::from_slice(&out.stdout)
                .unwrap_or_else(|e| panic!("-o json is not JSON: {e}"));
            assert!(v.to_string().contains("\\u001b[2J") || v.to_string().contains("owned"));
        }
    }

    // Plain text written by a process without the key is read, and rewritten sealed.
    let v2 = s.tmp.path().join("v2.yaml");
    std::fs::write(
        &v2,
        "apiVersion: moor/v1\nkind: Volume\nmetadata: {name: v2}\nspec:\n  plugin_id: hostpath.moor.dev\n  capacity_min: 1MiB\n  secrets: {token: plain0ld}\n  capabilities:\n    - {access_mode: single-node-writer, attachment_mode: file-system}\n",
    )
    .unwrap();
    // Issue 26, item 6: the controller said in etcd that this cluster seals secrets,
    // so a moorctl without the key file refuses to put them in etcd's history in clear,
    // unless told to.
    let out = s.moorctl(
        "moor-controller",
        None,
        &["apply", "-f", v2.to_str().unwrap()],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        err.contains("seals secrets at rest") && err.contains("--allow-plaintext-secrets"),
        "{err}"
    );
    assert_eq!(raw_value(&mut root, "/moor/volumes/default/v2").await, "");
    // Issue 37, item 2: a refusal found before writing refuses the whole file; the
    // allocation before the refused volume is not created either.
    let both = s.tmp.path().join("both.yaml");
    std::fs::write(
        &both,
        format!(
            "apiVersion: moor/v1\nkind: Allocation\nmetadata: {{name: a-refused}}\nspec:\n  node: n2\n  volumes:\n    - {{name: data, volume: v2}}\n---\n{}",
            std::fs::read_to_string(&v2).unwrap()
        ),
    )
    .unwrap();
    let out = s.moorctl(
        "moor-controller",
        None,
        &["apply", "-f", both.to_str().unwrap()],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        err.contains("nothing applied: 1 of 2 documents refused"),
        "{err}"
    );
    assert_eq!(
        raw_value(&mut root, "/moor/allocations/default/a-refused").await,
        ""
    );
    let out = s.moorctl(
        "moor-controller",
        None,
        &[
            "apply",
            "-f",
            v2.to_str().unwrap(),
            "--allow-plaintext-secrets",
        ],
    );
    assert!(
        out.status.success()
            && String::from_utf8_lossy(&out.stderr).contains("written unencrypted")
            && String::from_utf8_lossy(&out.stderr).contains("history"),
        "{out:?}"
    );
    wait_for("v2's secrets sealed by the controller", T, || {
        let root = root.clone();
        async move {
            let mut root = root;
            let v = raw_value(&mut root, "/moor/volumes/default/v2").await;
            v.contains("moor:sealed:v1:k1:") && !v.contains("plain0ld")
        }
    })
    .await;

    // Issue 26, item 7: garbage over the published claim does not stall its release:
    // its writer, the controller, writes its own state over it.
    root.put("/moor/claims/n2/default/a1.data", "\u{1b}garbage", None)
        .await
        .unwrap();
    // Release: the node secrets leave the claim.
    let out = s.moorctl("moor-controller", keys, &["alloc", "stop", "a1"]);
    assert!(out.status.success(), "{out:?}");
    wait_for("the claim released and its secrets gone", T, || {
        let (store, key) = (store.clone(), claim_key.clone());
        async move {
            match store.try_get(&key).await {
                Ok(None) => true,
                Ok(Some(c)) => {
                    c.status.phase == ClaimPhase::Released && c.spec.node_secrets.is_empty()
                }
                Err(_) => false,
            }
        }
    })
    .await;
    drop(procs);
}

#[tokio::test]
async fn the_embedded_store_serves_tls_beyond_loopback_and_requires_client_certificates() {
    let tmp = tempfile::tempdir().unwrap();
    let certs = tmp.path().join("certs");
    common::need("openssl");
    run(Command::new("bash")
        .arg(deploy("certs.sh"))
        .arg(&certs)
        .arg("n1"));
    let port = free_port();
    let plain = Command::new(bin("moor-store"))
        .args(["--listen", &format!("0.0.0.0:{port}"), "--data-dir"])
        .arg(tmp.path().join("refused"))
        .output()
        .unwrap();
    assert!(
        !plain.status.success()
            && String::from_utf8_lossy(&plain.stderr).contains("--cert and --key"),
        "{plain:?}"
    );
    let _store = Proc(
        Command::new(bin("moor-store"))
            .args(["--listen", &format!("0.0.0.0:{port}"), "--data-dir"])
            .arg(tmp.path().join("data"))
            .arg("--cert")
            .arg(certs.join("server.pem"))
            .arg("--key")
            .arg(certs.join("server-key.pem"))
            .arg("--client-ca")
            .arg(certs.join("ca.pem"))
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let url = format!("https://127.0.0.1:{port}");
    let auth = EtcdAuth {
        cacert: Some(certs.join("ca.pem")),
        cert: Some(certs.join("moor-controller.pem")),
        key: Some(certs.join("moor-controller-key.pem")),
        user: None,
        encryption_key_file: None,
    };
    wait_for("moor-store with TLS", Duration::from_secs(30), || {
        let (auth, url) = (auth.clone(), url.clone());
        async move {
            match auth.connect(std::slice::from_ref(&url), "/moor/").await {
                Ok(s) => s.create(&volume("v1")).await.is_ok(),
                Err(_) => false,
            }
        }
    })
    .await;
    // No client certificate, or no TLS: refused.
    let anonymous = EtcdAuth {
        cert: None,
        key: None,
        ..auth.clone()
    };
    let refused = match anonymous
        .connect(std::slice::from_ref(&url), "/moor/")
        .await
    {
        Err(_) => true,
        Ok(s) => s
            .try_get(&common::key::<VolumeSpec>("volumes/default/v1"))
            .await
            .is_err(),
    };
    assert!(refused, "a client without a certificate was served");
    let plain_url = format!("http://127.0.0.1:{port}");
    let refused = match Store::connect(std::slice::from_ref(&plain_url), "/moor/").await {
        Err(_) => true,
        Ok(s) => s
            .try_get(&common::key::<VolumeSpec>("volumes/default/v1"))
            .await
            .is_err(),
    };
    assert!(refused, "a plain-text client was served");
}

/// The holder named in an election key, as `root` reads it.
async fn election_holder(s: &Secure, name: &str) -> Option<String> {
    let mut raw = s.raw("root").await;
    let resp = raw.get(format!("/moor/leaders/{name}"), None).await.ok()?;
    resp.kvs()
        .first()
        .map(|kv| moor::runtime::leader::LeaderRecord::parse(kv.value()).holder)
}

/// Issue 26, item 1: etcd 3.4 checks no permission on LeaseKeepAlive and lists every
/// lease to any user, so node n2's certificate could keep a dead controller's election
/// lease and a dead node's lease alive: no controller led, and the node stayed healthy.
/// Liveness now rests on records only their holders may write.
#[tokio::test]
async fn a_node_identity_keeping_leases_alive_stalls_neither_the_election_nor_node_health() {
    let s = Secure::start().await;
    let controller = |id: &str| s.controller(id, &["--identity", id]);
    let c1 = controller("c1");
    wait_for("c1 leads", T, || async {
        election_holder(&s, "controller").await.as_deref() == Some("c1")
    })
    .await;
    let n1 = s.node("n1", "monolith", &s.cluster_keys);
    let root = s.store("root", None).await;
    let n1_key = Node::key_for(&NodeName::new("n1").unwrap());
    wait_for("n1 registered", T, || {
        let (root, key) = (root.clone(), n1_key.clone());
        async move { root.try_get(&key).await.ok().flatten().is_some() }
    })
    .await;
    let _c2 = controller("c2");

    // The leases the attack is about: c1's election key's and n1's Node's.
    let mut raw = s.raw("root").await;
    let mut targets = Vec::new();
    for key in ["/moor/leaders/controller", "/moor/nodes/n1"] {
        let resp = raw.get(key, None).await.unwrap();
        let lease = resp.kvs().first().map(|kv| kv.lease()).unwrap_or(0);
        assert!(lease != 0, "{key} is bound to a lease");
        targets.push(lease);
    }

    // The attacker: n2's certificate keeps every lease it can list alive (one that
    // expired between the list and its keep-alive is skipped).
    let mut attacker = s.raw("moor-agent-n2").await;
    let leases: Vec<i64> = attacker
        .leases()
        .await
        .expect("etcd 3.4 lists leases to any user")
        .leases()
        .iter()
        .map(|l| l.id())
        .collect();
    for t in &targets {
        assert!(
            leases.contains(t),
            "lease {t:x} is listed to n2: {leases:?}"
        );
    }
    let mut keepers = Vec::new();
    for id in &leases {
        if let Ok(pair) = attacker.lease_keep_alive(*id).await {
            keepers.push(pair);
        }
    }
    let keeping = tokio::spawn(async move {
        loop {
            for (k, _) in keepers.iter_mut() {
                let _ = k.keep_alive().await;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });

    drop(c1);
    drop(n1);
    wait_for(
        "c2 leads although c1's lease is kept alive",
        Duration::from_secs(30),
        || async { election_holder(&s, "controller").await.as_deref() == Some("c2") },
    )
    .await;
    wait_for(
        "n1's Node is removed although its lease is kept alive",
        Duration::from_secs(30),
        || {
            let (root, key) = (root.clone(), n1_key.clone());
            async move { matches!(root.try_get(&key).await, Ok(None)) }
        },
    )
    .await;
    // The attack was live throughout: both leases outlived their holders.
    for t in &targets {
        let ttl = raw.lease_time_to_live(*t, None).await.unwrap().ttl();
        assert!(ttl > 0, "lease {t:x} was kept alive (ttl {ttl})");
    }
    keeping.abort();
}

/// Issue 26, items 2, 4 and 7: what a node writes is untrusted input, and garbage over
/// a live key is repaired by the key's writer.
#[tokio::test]
async fn what_a_node_writes_is_capped_and_garbage_is_repaired_by_its_writer() {
    use serde_json::json;
    let s = Secure::start().await;
    let _controller = s.controller("controller", &[]);
    let _n1 = s.node("n1", "monolith", &s.cluster_keys);
    let n2_procs = s.node("n2", "node", &s.n2_keys);
    let root = s.store("root", None).await;
    let plugin_key = Plugin::key_for(&PluginId::new("hostpath.moor.dev").unwrap());
    let plugins = || {
        let root = root.clone();
        async move {
            root.list::<PluginSpec>(&KeyScope::all())
                .await
                .map(|l| (l.items, l.malformed.len()))
                .unwrap_or_default()
        }
    };
    wait_for("both nodes' instances of the plugin", T, || async {
        plugins()
            .await
            .0
            .iter()
            .any(|p| p.status.nodes_healthy == 2)
    })
    .await;
    let log = s.tmp.path().join("controller.log");
    let log_before = std::fs::metadata(&log).unwrap().len();

    // Item 2: n2 writes its own Node with 7,000 plugin ids (about 800 KB), then one
    // with 40 (under 64 KiB, over the count cap), while its agent is stopped.
    let agent_pid = n2_procs[1].0.id().to_string();
    run(Command::new("kill").args(["-STOP", &agent_pid]));
    let mut n2 = s.raw("moor-agent-n2").await;
    let node_with = |ids: Vec<String>| {
        let plugins: serde_json::Map<String, serde_json::Value> = ids
            .into_iter()
            .map(|id| (id, json!({"plugin_type": "node", "healthy": true})))
            .collect();
        json!({"apiVersion": "moor/v1", "kind": "Node", "metadata": {"name": "n2", "generation": 1},
               "spec": {}, "status": {"plugins": plugins}})
        .to_string()
    };
    for count in [7000, 40] {
        let ids = (0..count).map(|i| format!("p{i}.example.com")).collect();
        n2.put("/moor/nodes/n2", node_with(ids), None)
            .await
            .unwrap();
    }
    wait_for("a Warning that n2's Node is refused", T, || async {
        root.list::<EventSpec>(&KeyScope::all())
            .await
            .is_ok_and(|l| {
                l.items
                    .iter()
                    .any(|e| e.spec.reason == "Node refused" && e.spec.object.name.as_str() == "n2")
            })
    })
    .await;
    // A valid Node that lists a plugin its agent does not run.
    n2.put(
        "/moor/nodes/n2",
        node_with(vec!["hostpath.moor.dev".into(), "x.example.com".into()]),
        None,
    )
    .await
    .unwrap();
    wait_for("the listed plugin x.example.com", T, || async {
        plugins()
            .await
            .0
            .iter()
            .any(|p| p.metadata.name.as_str() == "x.example.com")
    })
    .await;
    run(Command::new("kill").args(["-CONT", &agent_pid]));
    // The agent finds its Node changed and registers again, without x.example.com:
    // the live node no longer lists it, so its instance and the Plugin go.
    wait_for("only the hostpath plugin, with both nodes", T, || async {
        let (items, malformed) = plugins().await;
        malformed == 0
            && items.len() == 1
            && items[0].status.nodes_healthy == 2
            && items[0].status.instances.len() == 2
    })
    .await;

    // Item 4: n2 writes garbage of 1.4 MB that a decoder quotes in its error, ten
    // times, then a small one with terminal escapes. The controller logs each value
    // once, cut and escaped.
    let big = json!({"apiVersion": "moor/v1", "kind": "Mount", "metadata": {"name": "junk"},
                     "spec": "A".repeat(1_400_000)})
    .to_string();
    for _ in 0..10 {
        n2.put("/moor/mounts/n2/default/junk", big.clone(), None)
            .await
            .unwrap();
    }
    n2.put(
        "/moor/mounts/n2/default/sentinel",
        "\u{1b}[2J\u{202e}not json",
        None,
    )
    .await
    .unwrap();
    wait_for("the controller logs the last garbage", T, || async {
        std::fs::read_to_string(&log).is_ok_and(|t| t.contains("mounts/n2/default/sentinel"))
    })
    .await;
    let text = std::fs::read(&log).unwrap();
    let grown = text.len() as u64 - log_before;
    assert!(
        grown < 256 << 10,
        "controller.log grew by {grown} bytes for 14 MB of garbage"
    );
    assert!(
        !text.contains(&0x1b),
        "a raw ESC reached the controller's log"
    );
    let text = String::from_utf8_lossy(&text);
    assert_eq!(
        text.matches("mounts/n2/default/sentinel").count(),
        1,
        "one revision, one line"
    );

    // Item 7: garbage over n1's Node and over the Plugin; their writers repair them.
    let mut raw = s.raw("root").await;
    raw.put("/moor/nodes/n1", "garbage", None).await.unwrap();
    raw.put("/moor/plugins/hostpath.moor.dev", "{\"kind\": 5}", None)
        .await
        .unwrap();
    let n1_key = Node::key_for(&NodeName::new("n1").unwrap());
    wait_for("n1's agent rewrites its own Node", T, || {
        let (root, key) = (root.clone(), n1_key.clone());
        async move { matches!(root.try_get(&key).await, Ok(Some(_))) }
    })
    .await;
    wait_for("the controller rewrites the Plugin", T, || {
        let (root, key) = (root.clone(), plugin_key.clone());
        async move {
            matches!(root.try_get(&key).await, Ok(Some(p)) if p.status.nodes_healthy == 2)
        }
    })
    .await;
}

/// Issue 26, item 3: node n2 filled a 64 MiB etcd quota through its own mounts/
/// prefix; every write in the cluster then failed and moorctl said "cannot reach etcd
/// ... is the quorum up?". Now the alarm is reported by `moord check`, the controller's
/// metric and log, and moorctl names it.
#[tokio::test]
async fn a_full_etcd_is_reported_as_such() {
    let s = Secure::start_with(&["--quota-backend-bytes=67108864"]).await;
    let keys = Some(s.cluster_keys.as_path());
    let http = free_port();
    let _controller = s.controller("controller", &[&format!("--http=127.0.0.1:{http}")]);
    let mut n2 = s.raw("moor-agent-n2").await;
    let value = "x".repeat(1_400_000);
    let mut full = false;
    for i in 0..100 {
        match n2
            .put(
                format!("/moor/mounts/n2/default/fill{i}"),
                value.clone(),
                None,
            )
            .await
        {
            Ok(_) => {}
            Err(e) => {
                assert!(e.to_string().contains("space exceeded"), "{e}");
                full = true;
                break;
            }
        }
    }
    assert!(full, "100 writes of 1.4 MB did not fill a 64 MiB quota");

    // moord check names the alarm and fails.
    let out = s
        .cmd("moord", "moor-controller", keys)
        .args(["check", "--etcd", &s.url])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("etcd alarm:  NOSPACE"), "{text}");

    // moorctl says what is wrong instead of "cannot reach etcd".
    let manifest = s.tmp.path().join("v.yaml");
    std::fs::write(
        &manifest,
        "apiVersion: moor/v1\nkind: Volume\nmetadata: {name: v1}\nspec:\n  plugin_id: hostpath.moor.dev\n  capabilities:\n    - {access_mode: single-node-writer, attachment_mode: file-system}\n",
    )
    .unwrap();
    let out = s.moorctl(
        "moor-controller",
        keys,
        &[
            "apply",
            "-f",
            manifest.to_str().unwrap(),
            "--retry-for",
            "1s",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("out of space"), "{err}");
    assert!(!err.contains("cannot reach"), "{err}");

    // The controller's gauge.
    wait_for("the controller's NOSPACE gauge", T, || async {
        let body = http_get(http, "/metrics").await;
        body.contains("moor_etcd_alarms{alarm=\"NOSPACE\"} 1")
    })
    .await;
}

/// A plain HTTP GET on loopback, the body or "" on any failure.
async fn http_get(port: u16, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut conn) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return String::new();
    };
    let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    if conn.write_all(req.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut body = Vec::new();
    let _ = conn.read_to_end(&mut body).await;
    String::from_utf8_lossy(&body).into_owned()
}

/// CPU seconds a process has used so far (user + system), from /proc.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let hz = run(Command::new("getconf").arg("CLK_TCK"))
        .trim()
        .parse::<f64>()
        .unwrap_or(100.0);
    // utime and stime are fields 14 and 15 of stat: 12 and 13 after the name.
    (ticks(11) + ticks(12)) / hz
}

/// Issue 37, item 1: under exactly roles.sh's grants, every read and watch of every
/// identity is within its grants. Two agents host one controller plugin; the standby
/// watched its election key with a prefix watch that etcd cancelled (its role grants
/// that key alone), campaigned again at once and spun at half a core, and never
/// reached the "unrenewed for its TTL" rule: with leases kept alive by another node, it
/// never took over. Now an idle cluster costs a few percent of a core per process, no
/// log holds a refusal, and the standby leads within its TTL of the leader's death
/// while another node identity keeps every lease alive.
#[tokio::test]
async fn under_the_deploy_roles_an_idle_cluster_is_quiet_and_the_plugin_standby_takes_over() {
    let s = Secure::start_nodes(
        &["n1", "n2", "n3"],
        "n1=hostpath.moor.dev n3=hostpath.moor.dev",
        "",
        &[],
    )
    .await;
    let keys = Some(s.cluster_keys.as_path());
    let controller = s.controller("controller", &[]);
    let n1 = s.node("n1", "monolith", &s.cluster_keys);
    let n2 = s.node("n2", "node", &s.n2_keys);
    let n3 = s.node("n3", "monolith", &s.cluster_keys);
    let election = "plugin.hostpath.moor.dev";
    wait_for("a plugin agent leads", T, || async {
        election_holder(&s, election).await.is_some()
    })
    .await;

    // Some work first, so every informer and reconciler has something to hold.
    let manifest = s.tmp.path().join("app.yaml");
    std::fs::write(
        &manifest,
        "apiVersion: moor/v1\nkind: Volume\nmetadata: {name: v1}\nspec:\n  plugin_id: hostpath.moor.dev\n  capacity_min: 1MiB\n  capabilities:\n    - {access_mode: single-node-writer, attachment_mode: file-system}\n---\n\
         apiVersion: moor/v1\nkind: Allocation\nmetadata: {name: a1}\nspec:\n  node: n2\n  volumes:\n    - {name: data, volume: v1}\n",
    )
    .unwrap();
    let out = s.moorctl(
        "moor-controller",
        keys,
        &["apply", "-f", manifest.to_str().unwrap()],
    );
    assert!(out.status.success(), "{out:?}");
    let store = s.store("moor-controller", keys).await;
    published_on_n2(&store, "a1.data", "the claim published on n2").await;

    // Idle for 30 s: every moor process under a few percent of a core.
    let mut procs: Vec<(String, u32)> = vec![("controller".into(), controller.0.id())];
    for (node, p) in [("n1", &n1), ("n2", &n2), ("n3", &n3)] {
        procs.push((format!("plugin-{node}"), p[0].0.id()));
        procs.push((format!("agent-{node}"), p[1].0.id()));
    }
    procs.push(("etcd".into(), s._etcd.0.id()));
    let before: Vec<f64> = procs.iter().map(|(_, pid)| cpu_seconds(*pid)).collect();
    let started = std::time::Instant::now();
    tokio::time::sleep(Duration::from_secs(30)).await;
    let secs = started.elapsed().as_secs_f64();
    let mut report = String::new();
    let mut busy = Vec::new();
    for ((name, pid), b) in procs.iter().zip(&before) {
        let share = (cpu_seconds(*pid) - b) / secs * 100.0;
        report.push_str(&format!("{name} {share:.1}%  "));
        if share > 5.0 {
            busy.push(name.clone());
        }
    }
    eprintln!("idle CPU over {secs:.0} s: {report}");
    assert!(busy.is_empty(), "busy while idle: {busy:?} ({report})");
    // Nothing any identity asked for was refused.
    for name in ["controller", "agent-n1", "agent-n2", "agent-n3"] {
        let log = std::fs::read_to_string(s.tmp.path().join(format!("{name}.log"))).unwrap();
        let lower = log.to_lowercase();
        assert!(
            !lower.contains("permission denied") && !lower.contains("permissiondenied"),
            "{name} was refused something:\n{log}"
        );
    }

    // The attacker: n2's certificate keeps every lease alive, the plugin leader's too.
    let mut attacker = s.raw("moor-agent-n2").await;
    let mut keepers = Vec::new();
    for l in attacker.leases().await.unwrap().leases() {
        if let Ok(pair) = attacker.lease_keep_alive(l.id()).await {
            keepers.push(pair);
        }
    }
    assert!(!keepers.is_empty(), "no lease to keep alive");
    let keeping = tokio::spawn(async move {
        loop {
            for (k, _) in keepers.iter_mut() {
                let _ = k.keep_alive().await;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });

    // Kill the leading agent; the standby leads within its TTL (3 s) and a margin.
    let leader = election_holder(&s, election).await.unwrap();
    let (standby, dead) = match leader.as_str() {
        "agent@n1" => ("agent@n3", n1),
        "agent@n3" => ("agent@n1", n3),
        other => panic!("unexpected plugin leader {other}"),
    };
    let mut root = s.raw("root").await;
    let resp = root
        .get(format!("/moor/leaders/{election}"), None)
        .await
        .unwrap();
    let lease = resp.kvs().first().map(|kv| kv.lease()).unwrap_or(0);
    assert!(lease != 0, "the election key is bound to a lease");
    let killed = std::time::Instant::now();
    drop(dead);
    wait_for("the standby leads", T, || async {
        election_holder(&s, election).await.as_deref() == Some(standby)
    })
    .await;
    let took = killed.elapsed();
    assert!(
        took < Duration::from_secs(3 + 5),
        "the standby led {took:?} after the leader died (TTL 3 s)"
    );
    eprintln!("{standby} led {took:?} after {leader} was killed");
    // The attack was live: the dead leader's lease outlived it.
    let ttl = root.lease_time_to_live(lease, None).await.unwrap().ttl();
    assert!(ttl > 0, "lease {lease:x} was kept alive (ttl {ttl})");

    // And acts for the plugin: a new volume is created.
    std::fs::write(
        &manifest,
        "apiVersion: moor/v1\nkind: Volume\nmetadata: {name: v2}\nspec:\n  plugin_id: hostpath.moor.dev\n  capacity_min: 1MiB\n  capabilities:\n    - {access_mode: single-node-writer, attachment_mode: file-system}\n",
    )
    .unwrap();
    let out = s.moorctl(
        "moor-controller",
        keys,
        &["apply", "-f", manifest.to_str().unwrap()],
    );
    assert!(out.status.success(), "{out:?}");
    let v2 = Volume::key_for(&Namespace::default_ns(), "v2");
    wait_for("the standby creates v2", T, || {
        let (store, key) = (store.clone(), v2.clone());
        async move {
            store
                .try_get(&key)
                .await
                .ok()
                .flatten()
                .is_some_and(|v| v.status.provisioning.phase == VolumePhase::Ready)
        }
    })
    .await;
    keeping.abort();
}

/// Issue 38, item 4: under roles.sh's grants, an agent named in VOLUME_PLUGINS serves
/// the volume-plugin endpoint (a volume created, mounted and unmounted through it); an
/// agent that is not refuses at start and says why.
#[tokio::test]
async fn the_volume_plugin_endpoint_runs_under_its_grants_and_refuses_without_them() {
    let s = Secure::start_nodes(&["n1", "n2", "n3"], "n1=hostpath.moor.dev", "n2", &[]).await;
    let _controller = s.controller("controller", &[]);
    let _n1 = s.node("n1", "monolith", &s.cluster_keys);
    let sock = |n: &str| s.tmp.path().join(format!("{n}-moor.sock"));
    let n2_keys = s.n2_keys.clone();
    let _n2 = s.node_with(
        "n2",
        "node",
        &n2_keys,
        &[
            format!("--volume-plugin={}", sock("n2").display()),
            "--volume-plugin-namespace=engines".into(),
        ],
    );
    // Issue 49, item 9: an engine-serving node writes the engines' namespace only. With
    // plain etcdctl-like calls under its identity, it cannot write an allocation, nor
    // delete a volume, nor touch another node's claim, outside it.
    let mut n2_raw = s.raw("moor-agent-n2").await;
    for key in [
        "/moor/allocations/default/probe",
        "/moor/volumes/default/probe",
        "/moor/claims/n1/default/probe",
    ] {
        let put = n2_raw.put(key, "{}", None).await;
        assert!(
            put.as_ref()
                .is_err_and(|e| e.to_string().contains("permission denied")),
            "{key}: {put:?}"
        );
        let del = n2_raw.delete(key, None).await;
        assert!(
            del.as_ref()
                .is_err_and(|e| e.to_string().contains("permission denied")),
            "{key}: {del:?}"
        );
    }
    n2_raw
        .put("/moor/allocations/engines/.probe", "x", None)
        .await
        .expect("its own namespace");
    n2_raw
        .delete("/moor/allocations/engines/.probe", None)
        .await
        .unwrap();
    // n3 is not in VOLUME_PLUGINS: its endpoint may not write allocations.
    let n3_keys = s.tmp.path().join("n3.keys");
    let text = run(Command::new(bin("moord"))
        .args(["keys", "node", "--node", "n3", "--encryption-key-file"])
        .arg(&s.cluster_keys));
    write_private(&n3_keys, &text);
    let mut n3 = s.node_with(
        "n3",
        "node",
        &n3_keys,
        &[format!("--volume-plugin={}", sock("n3").display())],
    );
    let n3_log = s.tmp.path().join("agent-n3.log");
    let deadline = std::time::Instant::now() + T;
    while n3[1].0.try_wait().ok().flatten().is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "n3's agent did not refuse to start"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = std::fs::read_to_string(&n3_log).unwrap();
    assert!(
        log.contains("--volume-plugin: this agent's etcd identity cannot")
            && log.contains("VOLUME_PLUGINS"),
        "{log}"
    );
    assert!(!sock("n3").exists(), "n3 served without its grants");

    // n2 serves under its grants.
    wait_for("n2's endpoint", T, || async { sock("n2").exists() }).await;
    let call = |verb: &'static str, body: serde_json::Value| {
        let path = sock("n2");
        async move {
            common::post_raw(
                &path,
                &format!("/VolumeDriver.{verb}"),
                None,
                body.to_string().as_bytes(),
            )
            .await
        }
    };
    let (status, v) = call(
        "Create",
        serde_json::json!({"Name": "ev", "Opts": {"size": "1MiB"}}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let (status, v) = call("Mount", serde_json::json!({"Name": "ev", "ID": "c1"})).await;
    assert_eq!(status, 200, "{v}");
    assert!(
        v["Mountpoint"].as_str().is_some_and(|p| !p.is_empty()),
        "{v}"
    );
    let (status, v) = call("Unmount", serde_json::json!({"Name": "ev", "ID": "c1"})).await;
    assert_eq!(status, 200, "{v}");
    let log = std::fs::read_to_string(s.tmp.path().join("agent-n2.log")).unwrap();
    assert!(!log.to_lowercase().contains("permission denied"), "{log}");
}

/// Issue 55, item 3: the console under its own identity (roles.sh's moor-console) lists
/// every kind it shows and serves them, logs no refusal, and that identity may write
/// nothing and read no Secret, lease record or election.
#[tokio::test]
async fn the_console_reads_with_an_identity_of_its_own_and_nothing_more() {
    let s = Secure::start().await;
    let admin = s.store("moor-controller", Some(&s.cluster_keys)).await;
    admin.create(&volume("seen-by-console")).await.unwrap();
    let port = free_port();
    let mut cmd = s.cmd("moord", "moor-console", None);
    cmd.args(["console", "--etcd", &s.url])
        .arg(format!("--listen=127.0.0.1:{port}"));
    let _console = s.spawn(cmd, "console");
    let addr = format!("127.0.0.1:{port}");
    let log = || std::fs::read_to_string(s.tmp.path().join("console.log")).unwrap_or_default();
    let listed = tokio::time::timeout(T, async {
        loop {
            if tokio::net::TcpStream::connect(&addr).await.is_ok()
                && common::http_get(&addr, "/healthz")
                    .await
                    .starts_with("HTTP/1.1 200")
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        listed.is_ok(),
        "the console did not list every kind it shows: {}",
        log()
    );
    let page = common::http_get(&addr, "/volumes").await;
    assert!(page.contains("seen-by-console"), "{page}");
    assert!(!log().contains("permission denied"), "{}", log());

    let mut raw = s.raw("moor-console").await;
    for key in [
        "/moor/volumes/default/x",
        "/moor/nodes/n1",
        "/moor/events/node/n1/default/e1",
    ] {
        let e = raw.put(key, "{}", None).await.unwrap_err();
        assert!(denied(&e), "the console wrote {key}: {e}");
    }
    for prefix in ["/moor/secrets/", "/moor/leaders/", "/moor/declarations/"] {
        let e = raw
            .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
            .await
            .unwrap_err();
        assert!(denied(&e), "the console read {prefix}: {e}");
    }
}

/// moorctl's stderr.
fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test]
async fn people_have_their_role_s_access_and_a_refusal_names_who_and_what_it_lacked() {
    let s = Secure::start().await;
    let admin = s.store("moor-controller", Some(&s.cluster_keys)).await;
    let in_ns = |ns: &str, name: &str| {
        let mut v = volume(name);
        v.metadata.namespace = Namespace::new(ns).unwrap();
        v
    };
    admin.create(&in_ns("a", "va")).await.unwrap();
    admin.create(&in_ns("b", "vb")).await.unwrap();
    let refusal = |who: &str, access: &str, what: &str| {
        format!(
            "moorctl: etcd at {} refused identity {who} {access} {what}; its etcd role does \
             not grant it; ask an operator for a role that does (deploy/etcd/roles.sh), or use \
             an identity that has one (--cert, --key)",
            s.url
        )
    };

    // ann views namespace a: she reads it, nothing of b, and writes nothing.
    let out = s.moorctl("ann", None, &["get", "volumes", "-n", "a"]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("va"),
        "{out:?}"
    );
    let out = s.moorctl("ann", None, &["get", "volumes", "-n", "b"]);
    assert!(!out.status.success(), "{out:?}");
    assert_eq!(
        stderr(&out).trim_end(),
        refusal("ann", "a read of", "keys below /moor/volumes/b/"),
        "{out:?}"
    );
    let out = s.moorctl("ann", None, &["get", "volumes", "-A"]);
    assert!(
        stderr(&out).contains(&refusal("ann", "a read of", "keys below /moor/volumes/")),
        "{out:?}"
    );
    let out = s.moorctl("ann", None, &["delete", "volume", "va", "-n", "a"]);
    assert!(!out.status.success(), "{out:?}");
    assert!(
        stderr(&out).contains("refused identity ann a write of /moor/volumes/a/va"),
        "{out:?}"
    );
    let out = s.moorctl("ann", None, &["get", "secrets", "-n", "a"]);
    assert!(
        stderr(&out).contains("refused identity ann a read of keys below /moor/secrets/"),
        "a viewer reads no Secret: {out:?}"
    );

    // bo edits namespace a: he writes its requests, not b's, and no cluster object.
    let manifest = s.tmp.path().join("bo.yaml");
    let write = |ns: &str, name: &str| {
        std::fs::write(
            &manifest,
            format!(
                "kind: Volume\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  \
                 plugin_id: hostpath.moor.dev\n  capacity_min: 1Mi\n  capabilities:\n  - \
                 {{access_mode: single-node-writer, attachment_mode: file-system}}\n"
            ),
        )
        .unwrap();
        s.moorctl("bo", None, &["apply", "-f", manifest.to_str().unwrap()])
    };
    let out = write("a", "made-by-bo");
    assert!(out.status.success(), "{out:?}");
    admin
        .get(&Volume::key_for(
            &Namespace::new("a").unwrap(),
            Name::new("made-by-bo").unwrap(),
        ))
        .await
        .unwrap();
    let out = write("b", "made-by-bo");
    assert!(!out.status.success(), "{out:?}");
    assert!(stderr(&out).contains("refused identity bo a "), "{out:?}");
    assert!(
        admin
            .try_get(&Volume::key_for(
                &Namespace::new("b").unwrap(),
                Name::new("made-by-bo").unwrap()
            ))
            .await
            .unwrap()
            .is_none(),
        "nothing written in b"
    );
    let out = s.moorctl("bo", None, &["node", "cordon", "n1"]);
    assert!(!out.status.success(), "{out:?}");
    assert!(stderr(&out).contains("refused identity bo a "), "{out:?}");
    assert!(admin
        .list(&KeyScope::<CordonSpec>::all())
        .await
        .unwrap()
        .items
        .is_empty());

    // cy operates the cluster: every namespace, cordons.
    let out = s.moorctl("cy", None, &["get", "volumes", "-A"]);
    assert!(out.status.success(), "{out:?}");
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(listed.contains("va") && listed.contains("vb"), "{out:?}");
    let out = s.moorctl("cy", None, &["node", "cordon", "n1"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        admin
            .list(&KeyScope::<CordonSpec>::all())
            .await
            .unwrap()
            .items
            .len(),
        1
    );

    // On-boarding a new person on the running cluster: certs.sh and roles.sh run again
    // keep what they made (the CA, the users, their grants) and add dee.
    let people = format!("{} dee=view:b", secure::PEOPLE);
    run(Command::new("bash")
        .arg(deploy("certs.sh"))
        .arg(&s.certs)
        .args(["n1", "n2"])
        .env("NAMESPACE_WRITERS", "a")
        .env("PEOPLE", &people));
    run(Command::new("bash")
        .arg(deploy("roles.sh"))
        .args(["n1", "n2"])
        .env("CONTROLLER_PLUGINS", "n1=hostpath.moor.dev")
        .env("VOLUME_PLUGINS", "")
        .env("NAMESPACE_WRITERS", "a")
        .env("PEOPLE", &people)
        .env("SECRET_PLUGINS", "hostpath.moor.dev")
        .env("ENDPOINT", &s.url)
        .env("CERTS", &s.certs));
    let out = s.moorctl("dee", None, &["get", "volumes", "-n", "b"]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("vb"),
        "{out:?}"
    );
    // The first people keep working with their old certificates.
    let out = s.moorctl("ann", None, &["get", "volumes", "-n", "a"]);
    assert!(out.status.success(), "{out:?}");
    let out = s.moorctl("dee", None, &["get", "volumes", "-n", "a"]);
    assert!(
        stderr(&out).contains(&refusal("dee", "a read of", "keys below /moor/volumes/a/")),
        "{out:?}"
    );
    // A malformed entry is refused before anything is made.
    let bad = Command::new("bash")
        .arg(deploy("roles.sh"))
        .env("PEOPLE", "eve=admin:a")
        .env("ENDPOINT", &s.url)
        .env("CERTS", &s.certs)
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("PEOPLE: eve=admin:a: the role is view, edit or operator"),
        "{bad:?}"
    );
}

#[tokio::test]
async fn a_person_runs_a_workload_in_their_namespace_and_their_viewer_follows_it() {
    let s = Secure::start().await;
    let _controller = s.controller("controller", &[]);
    let _n1 = s.node("n1", "monolith", &s.cluster_keys);
    // Bo (edit:a) makes a volume in his namespace and runs a workload on it.
    let manifest = s.tmp.path().join("wv.yaml");
    std::fs::write(
        &manifest,
        "kind: Volume\nmetadata: {name: wv, namespace: a}\nspec:\n  plugin_id: \
         hostpath.moor.dev\n  capacity_min: 1Mi\n  capabilities:\n  - {access_mode: \
         single-node-writer, attachment_mode: file-system}\n",
    )
    .unwrap();
    let out = s.moorctl("bo", None, &["apply", "-f", manifest.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let stop = s.tmp.path().join("stop-job");
    let said = s.tmp.path().join("job.out");
    // Ended (killed) by the guard whatever the outcome. It writes nothing into the
    // volume: this harness runs moor-hostpath with --no-mount (a plain directory),
    // which a file left in it keeps from being unpublished.
    let mut runner = Proc(
        s.cmd("moorctl", "bo", None)
            .args(["alloc", "run", "job", "-n", "a", "--node", "n1", "--volume"])
            .args(["data=wv", "--timeout", "2m", "--", "sh", "-c"])
            .arg(format!(
                "test -d \"$MOOR_VOLUME_DATA\" && echo by-bo && \
                 while [ ! -e {} ]; do sleep 0.1; done",
                stop.display()
            ))
            .stdout(std::fs::File::create(&said).unwrap())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let admin = s.store("moor-controller", None).await;
    let claim = Claim::key_for(
        &NodeName::new("n1").unwrap(),
        &Namespace::new("a").unwrap(),
        "job.data",
    );
    wait_for("bo's claim published", T, || async {
        admin
            .try_get(&claim)
            .await
            .ok()
            .flatten()
            .is_some_and(|c| c.status.phase == ClaimPhase::Published)
    })
    .await;

    // Ann (view:a) follows it: the claim, its events and the volume's page.
    let out = s.moorctl("ann", None, &["get", "claims", "-n", "a"]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("job.data"),
        "{out:?}"
    );
    let out = s.moorctl("ann", None, &["describe", "volume", "wv", "-n", "a"]);
    assert!(out.status.success(), "{out:?}");
    let page = String::from_utf8_lossy(&out.stdout);
    assert!(
        page.contains("Claims:") && page.contains("job.data"),
        "{page}"
    );
    let out = s.moorctl("ann", None, &["events", "-n", "a"]);
    assert!(out.status.success(), "{out:?}");
    let events = String::from_utf8_lossy(&out.stdout);
    assert!(events.contains("job.data"), "{events}");
    // She may not run one: refused before anything is written, naming her.
    let out = s
        .cmd("moorctl", "ann", None)
        .args([
            "alloc", "run", "hers", "-n", "a", "--node", "n1", "--volume",
        ])
        .args(["data=wv", "--", "true"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{out:?}");
    assert!(
        stderr(&out).contains("refused identity ann a write of /moor/"),
        "{out:?}"
    );
    let hers = Allocation::key_for(&Namespace::new("a").unwrap(), Name::new("hers").unwrap());
    assert!(admin.try_get(&hers).await.unwrap().is_none());
    // Nor read another namespace's progress.
    let out = s.moorctl("ann", None, &["get", "claims", "-n", "default"]);
    assert!(
        stderr(&out).contains("refused identity ann a read of keys below /moor/claims/"),
        "{out:?}"
    );
    // Ann follows the claim and the namespace's events as they change (a watch per
    // node, and the controller's, under her role).
    let follow = |args: &[&str], file: &str| {
        Proc(
            s.cmd("moorctl", "ann", None)
                .args(args)
                .stdout(std::fs::File::create(s.tmp.path().join(file)).unwrap())
                .stderr(std::fs::File::create(s.tmp.path().join(format!("{file}.err"))).unwrap())
                .spawn()
                .unwrap(),
        )
    };
    let _claims_w = follow(&["get", "claims", "-n", "a", "-w"], "claims-w");
    let _events_w = follow(&["events", "-n", "a", "-w"], "events-w");
    let printed = |file: &str| std::fs::read_to_string(s.tmp.path().join(file)).unwrap_or_default();
    wait_for("ann's watches list the claim", T, || async {
        printed("claims-w").contains("job.data") && printed("events-w").contains("job.data")
    })
    .await;
    let (claims_before, events_before) = (printed("claims-w"), printed("events-w"));
    // Bo's workload ends as he asked: its output, exit 0, its claim released.
    std::fs::write(&stop, "").unwrap();
    wait_for("bo's alloc run to end", T, || {
        let ended = runner.0.try_wait().unwrap();
        async move { ended.is_some() }
    })
    .await;
    let status = runner.0.wait().unwrap();
    assert!(status.success(), "bo's alloc run: {status:?}");
    let out = std::fs::read_to_string(&said).unwrap();
    assert!(out.contains("by-bo"), "{out}");
    // Her watches saw the release: the claim's new phase and new events about it.
    let released = || {
        let (claims, events) = (printed("claims-w"), printed("events-w"));
        claims.len() > claims_before.len()
            && claims[claims_before.len()..].contains("released")
            && events.len() > events_before.len()
            && events[events_before.len()..].contains("job.data")
    };
    let deadline = std::time::Instant::now() + T;
    while !released() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        released(),
        "ann's watches did not follow the release:\n--- get claims -w\n{}\n--- events -w\n{}",
        printed("claims-w"),
        printed("events-w")
    );
    for file in ["claims-w.err", "events-w.err"] {
        assert!(
            !printed(file).contains("refused"),
            "{file}: {}",
            printed(file)
        );
    }
}

/// What a verb reaches, which decides who may run it: a namespace's requests (read or
/// written), its Secrets, or the cluster's objects (read or written).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reach {
    Read,
    Write,
    Secrets,
    ClusterRead,
    ClusterWrite,
}

/// Whether `role` (secure::PEOPLE: ann views a, bo edits a, cy operates) may do what
/// `reach` names in namespace `ns`.
fn granted(person: &str, reach: Reach, ns: &str) -> bool {
    match (person, reach) {
        ("cy", _) => true,
        (_, Reach::ClusterRead) => true,
        (_, Reach::ClusterWrite) => false,
        ("ann", Reach::Read) => ns == "a",
        ("ann", _) => false,
        ("bo", _) => ns == "a",
        _ => unreachable!("{person}"),
    }
}

/// One run of a verb: its arguments in namespace `ns` on objects named `name` (which
/// the case's fixture made), what it reaches, and whether it must exit 0 when allowed
/// (a verb that waits for a node or controller, none of which runs here, only must not
/// be refused). `Some(vec![])` for a verb that never talks to the store; `None` for a
/// verb with no entry, which fails the test.
fn verb_cases(verb: &[String], ns: &str, name: &str, files: &CaseFiles) -> Option<Vec<VerbCase>> {
    use Reach::*;
    // `-n NS` right after the verb's words (before a `--`), for the verbs that take
    // one: the cluster's verbs and those reading a manifest's own namespace do not.
    let case = |args: &[&str], reach, exits_0| {
        let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let words = verb.len().max(1);
        let takes_n = !matches!(verb[0].as_str(), "apply" | "plugin" | "node" | "version")
            && verb.join(" ") != "alloc plan";
        if takes_n {
            args.splice(words..words, ["-n".to_string(), ns.to_string()]);
        }
        VerbCase {
            args,
            reach,
            exits_0,
            fixture: Fixture::Plain,
        }
    };
    let t = "1s";
    let cases = match verb.join(" ").as_str() {
        "validate" | "completion" => vec![],
        "apply" => vec![case(&["apply", "-f", &files.new], Write, true)],
        "get" => vec![
            case(&["get", "volumes"], Read, true),
            case(&["get", "volume", name], Read, true),
            case(&["get", "allocations"], Read, true),
            case(&["get", "claims"], Read, true),
            case(&["get", "mounts"], Read, true),
            case(&["get", "attachments"], Read, true),
            case(&["get", "snapshots"], Read, true),
            case(&["get", "events"], Read, true),
            case(&["get", "quotas"], Read, true),
            case(&["get", "secrets"], Secrets, true),
            case(&["get", "nodes"], ClusterRead, true),
            case(&["get", "plugins"], ClusterRead, true),
            case(&["get", "cordons"], ClusterRead, true),
        ],
        "describe" => vec![
            case(&["describe", "volume", name], Read, true),
            case(&["describe", "allocation", name], Read, true),
        ],
        "delete" => vec![
            case(&["delete", "allocation", name], Write, true),
            case(&["delete", "volume", name], Write, true),
        ],
        "alloc run" => vec![case(
            &[
                "alloc",
                "run",
                name,
                "--node",
                "n1",
                "--timeout",
                t,
                "--",
                "true",
            ],
            Write,
            false,
        )],
        "alloc plan" => vec![case(&["alloc", "plan", "-f", &files.plan], Read, false)],
        "alloc paths" => vec![case(&["alloc", "paths", name], Read, false)],
        "alloc stop" => vec![case(&["alloc", "stop", name], Write, true)],
        "volume detach" => vec![case(
            &["volume", "detach", name, "--node", "n1"],
            ClusterWrite,
            true,
        )],
        "volume status" => vec![case(&["volume", "status"], Read, true)],
        "volume pause" => vec![case(&["volume", "pause", name], Write, true)],
        "volume activate" => vec![VerbCase {
            fixture: Fixture::Paused,
            ..case(&["volume", "activate", name], Write, true)
        }],
        "volume drain" => vec![case(
            &["volume", "drain", name, "--timeout", t],
            Write,
            true,
        )],
        "volume own" => vec![VerbCase {
            fixture: Fixture::Registered,
            ..case(&["volume", "own", name], ClusterWrite, false)
        }],
        "volume deregister" => vec![case(&["volume", "deregister", name], ClusterWrite, true)],
        "volume share" => vec![VerbCase {
            fixture: Fixture::Registered,
            ..case(
                &["volume", "share", name, "--with", "c"],
                ClusterWrite,
                false,
            )
        }],
        "volume unshare" => vec![VerbCase {
            fixture: Fixture::Registered,
            ..case(
                &["volume", "unshare", name, "--with", "c"],
                ClusterWrite,
                false,
            )
        }],
        "volume snapshot create" => vec![case(
            &["volume", "snapshot", "create", name, &format!("{name}-s")],
            Write,
            true,
        )],
        "volume snapshot import" => vec![case(
            &[
                "volume",
                "snapshot",
                "import",
                &format!("{name}-i"),
                "--source-volume",
                name,
                "--snapshot-id",
                "x",
            ],
            Write,
            true,
        )],
        "volume snapshot delete" => vec![VerbCase {
            fixture: Fixture::Snapshot,
            ..case(&["volume", "snapshot", "delete", name], Write, true)
        }],
        "volume snapshot list" => vec![case(&["volume", "snapshot", "list"], Read, true)],
        "plugin status" => vec![case(&["plugin", "status"], ClusterRead, true)],
        "plugin deregister" => vec![VerbCase {
            fixture: Fixture::Instance,
            ..case(
                &["plugin", "deregister", "hostpath.moor.dev", "--node", name],
                ClusterWrite,
                true,
            )
        }],
        "node cordon" => vec![case(&["node", "cordon", name], ClusterWrite, true)],
        "node uncordon" => vec![VerbCase {
            fixture: Fixture::Cordoned,
            ..case(&["node", "uncordon", name], ClusterWrite, true)
        }],
        "node drain" => vec![case(
            &["node", "drain", name, "--timeout", t],
            ClusterWrite,
            true,
        )],
        "mount adopt" => vec![case(
            &["mount", "adopt", name, "--node", "n1", "--timeout", t],
            ClusterWrite,
            false,
        )],
        "mount release" => vec![case(
            &["mount", "release", name, "--node", "n1", "--timeout", t],
            ClusterWrite,
            false,
        )],
        "events" => vec![case(&["events"], Read, true)],
        "wait" => vec![case(
            &[
                "wait",
                &format!("volume/{name}"),
                "--for",
                "phase=pending",
                "--timeout",
                t,
            ],
            Read,
            true,
        )],
        "version" => vec![case(&["version"], ClusterRead, false)],
        _ => return None,
    };
    Some(cases)
}

#[derive(Debug)]
struct VerbCase {
    args: Vec<String>,
    reach: Reach,
    exits_0: bool,
    fixture: Fixture,
}

/// What a case's objects are, beyond its volume and allocation NAME.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fixture {
    Plain,
    /// A snapshot NAME of the volume.
    Snapshot,
    /// The volume paused.
    Paused,
    /// The volume a registration of the plugin volume `ext-NAME`.
    Registered,
    /// Node NAME cordoned.
    Cordoned,
    /// The plugin's instance on node NAME, a node gone (no Node object).
    Instance,
}

/// A case's manifests: `new` a volume and an allocation NAME-new (which no fixture
/// makes), `plan` the allocation NAME alone.
struct CaseFiles {
    new: String,
    plan: String,
}

/// A manifest of volume `name` in `ns` (of `source`: its size, or the plugin volume it
/// registers) and allocation `name` claiming it on n1 (not with `volume_only`).
fn case_manifest(ns: &str, name: &str, source: &str, volume: bool, alloc: bool) -> String {
    let mut docs = Vec::new();
    if volume {
        docs.push(format!(
            "kind: Volume\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  plugin_id: \
             hostpath.moor.dev\n  {source}\n  capabilities:\n  - {{access_mode: \
             single-node-writer, attachment_mode: file-system}}\n"
        ));
    }
    if alloc {
        docs.push(format!(
            "kind: Allocation\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  node: n1\n  \
             volumes:\n  - {{name: data, volume: {name}, access_mode: single-node-writer, \
             attachment_mode: file-system}}\n"
        ));
    }
    docs.join("---\n")
}

/// Every leaf of moorctl's command tree, run by each person in their namespace and in
/// another, each on objects of its own: what the person's role grants is not refused
/// (and exits 0 where nothing else is needed), what it does not grant is refused
/// naming the person, and a refused verb writes nothing (etcd's revision is where it
/// was before the verb). So a grant missing from roles.sh, or one too many, or a verb
/// of several writes that makes some before one is refused, fails here.
#[tokio::test]
async fn every_verb_is_granted_or_refused_to_each_role_as_its_grants_say_and_a_refusal_writes_nothing(
) {
    let s = Secure::start().await;
    let mut raw = s.raw("root").await;
    // The cluster's nodes and the plugin, as their agents would have registered them.
    let root = s.store("root", None).await;
    for node in ["n1", "n2"] {
        let mut n = Node::new(
            &Namespace::default(),
            Name::new(node).unwrap(),
            NodeSpec::default(),
        );
        n.status.plugins.insert(
            PluginId::new("hostpath.moor.dev").unwrap(),
            NodePluginStatus {
                plugin_type: PluginType::Monolith,
                ..Default::default()
            },
        );
        root.create(&n).await.unwrap();
    }
    root.create(&Plugin::new(
        &Namespace::default(),
        Name::new("hostpath.moor.dev").unwrap(),
        PluginSpec::default(),
    ))
    .await
    .unwrap();
    let mut missing = Vec::new();
    let mut wrong = Vec::new();
    let mut id = 0;
    for verb in common::moorctl_verbs() {
        for person in ["ann", "bo", "cy"] {
            for ns in ["a", "b"] {
                id += 1;
                let name = format!("c{id}");
                let manifest = s.tmp.path().join(format!("{name}.yaml"));
                let files = CaseFiles {
                    new: s
                        .tmp
                        .path()
                        .join(format!("{name}-new.yaml"))
                        .display()
                        .to_string(),
                    plan: s
                        .tmp
                        .path()
                        .join(format!("{name}-plan.yaml"))
                        .display()
                        .to_string(),
                };
                let new = format!("{name}-new");
                std::fs::write(
                    &files.new,
                    case_manifest(ns, &new, "capacity_min: 1Mi", true, true),
                )
                .unwrap();
                std::fs::write(&files.plan, case_manifest(ns, &name, "", false, true)).unwrap();
                let Some(cases) = verb_cases(&verb, ns, &name, &files) else {
                    missing.push(verb.join(" "));
                    break;
                };
                for case in cases {
                    // The case's own objects, made by root (its verb may delete them).
                    let source = match case.fixture {
                        Fixture::Registered => format!("external_id: ext-{name}"),
                        _ => "capacity_min: 1Mi".to_string(),
                    };
                    std::fs::write(&manifest, case_manifest(ns, &name, &source, true, true))
                        .unwrap();
                    let out = s.moorctl("root", None, &["apply", "-f", manifest.to_str().unwrap()]);
                    assert!(out.status.success(), "{out:?}");
                    if case.fixture == Fixture::Paused {
                        let out = s.moorctl("root", None, &["volume", "pause", &name, "-n", ns]);
                        assert!(out.status.success(), "{out:?}");
                    }
                    if case.fixture == Fixture::Cordoned {
                        let out = s.moorctl("root", None, &["node", "cordon", &name]);
                        assert!(out.status.success(), "{out:?}");
                    }
                    if case.fixture == Fixture::Instance {
                        let key = Plugin::key_for(&PluginId::new("hostpath.moor.dev").unwrap());
                        let mut p = root.get(&key).await.unwrap();
                        p.status.instances.insert(
                            NodeName::new(&name).unwrap(),
                            PluginInstance {
                                plugin_type: PluginType::Monolith,
                                node_uid: format!("uid-{name}"),
                                ..Default::default()
                            },
                        );
                        root.replace_status(&p).await.unwrap();
                    }
                    if case.fixture == Fixture::Snapshot {
                        let out = s.moorctl(
                            "root",
                            None,
                            &["volume", "snapshot", "create", &name, &name, "-n", ns],
                        );
                        assert!(out.status.success(), "{out:?}");
                    }
                    if case.reach == Reach::ClusterRead && ns == "b" {
                        continue;
                    }
                    let before = revision(&mut raw).await;
                    let args: Vec<&str> = case.args.iter().map(String::as_str).collect();
                    let out = s.moorctl(person, None, &args);
                    let err = stderr(&out);
                    let refused = err.contains(&format!("refused identity {person} "));
                    let expect = granted(person, case.reach, ns);
                    let what = format!("{person} `moorctl {}` ({:?})", args.join(" "), case.reach);
                    if expect && (refused || err.contains("permission denied")) {
                        wrong.push(format!("{what}: refused, should be granted: {err}"));
                    } else if expect && case.exits_0 && !out.status.success() {
                        wrong.push(format!("{what}: granted but failed: {err}"));
                    } else if !expect && !refused {
                        wrong.push(format!("{what}: granted, should be refused: {out:?}"));
                    } else if !expect && revision(&mut raw).await != before {
                        wrong.push(format!("{what}: refused after writing: {err}"));
                    }
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "verbs with no entry in verb_cases: {missing:?}"
    );
    assert!(
        wrong.is_empty(),
        "{} wrong:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}

/// etcd's current revision: it moves with every write.
async fn revision(raw: &mut etcd_client::Client) -> i64 {
    raw.get("/moor/", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision()
}

/// Volumes of 10 MiB named `prefix-1` .. `prefix-N` in namespace a, one manifest.
fn volumes_manifest(prefix: &str, n: usize) -> String {
    (1..=n)
        .map(|i| {
            format!(
                "kind: Volume\nmetadata: {{name: {prefix}-{i}, namespace: a}}\nspec:\n  plugin_id: \
                 hostpath.moor.dev\n  capacity_min: 10Mi\n  capabilities:\n  - {{access_mode: \
                 single-node-writer, attachment_mode: file-system}}\n"
            )
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

/// Waits until volume `name` of `ns` waits on a quota (its condition QuotaExceeded)
/// with a message containing `why`.
async fn waits_on_quota(store: &Store, ns: &Namespace, name: &str, why: &str) {
    let what = format!("volume {name} waits on a quota, saying {why:?}");
    wait_for(&what, T, || async {
        store
            .try_get(&Volume::key_for(ns, name))
            .await
            .ok()
            .flatten()
            .is_some_and(|v| {
                v.status
                    .provisioning
                    .meta
                    .conditions
                    .iter()
                    .any(|c| c.reason == "QuotaExceeded" && c.message.contains(why))
            })
    })
    .await;
}

/// The CreateVolume calls moor-hostpath of node `node` logged.
fn create_volume_calls(s: &Secure, node: &str) -> usize {
    std::fs::read_to_string(s.tmp.path().join(node).join("plugin/calls.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("\"CreateVolume\""))
        .count()
}

/// A namespace's quota, set by its operator, holds under concurrent creates by two of
/// the namespace's writers: the controller charges volumes in order until the limit,
/// the rest wait with the quota and its usage named and are never created (counted in
/// the plugin's own call log and in every version of the quota etcd kept), a deleted
/// volume frees its charge for a waiting one, and an allocation past the count waits
/// to be admitted. The namespace's people read the usage and may not write the quota.
#[tokio::test]
async fn a_quota_holds_under_concurrent_creates_and_its_usage_is_the_controller_s_alone() {
    let s = Secure::start().await;
    let _controller = s.controller("controller", &[]);
    let _n1 = s.node("n1", "monolith", &s.cluster_keys);
    let admin = s.store("moor-controller", None).await;
    let a = Namespace::new("a").unwrap();
    let quota_yaml = s.tmp.path().join("quota.yaml");
    std::fs::write(
        &quota_yaml,
        "kind: Quota\nmetadata: {name: team, namespace: a}\nspec:\n  volumes: 5\n  capacity: \
         30Mi\n  allocations: 1\n",
    )
    .unwrap();
    // Bo (edit:a) may not set his own namespace's quota; Cy (operator) does.
    let out = s.moorctl("bo", None, &["apply", "-f", quota_yaml.to_str().unwrap()]);
    assert!(
        stderr(&out).contains("refused identity bo a write of /moor/quotas/a/team"),
        "{out:?}"
    );
    let out = s.moorctl("cy", None, &["apply", "-f", quota_yaml.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let quota_key = Quota::key_for(&a, "team");

    // Two writers of namespace a create four volumes each at once.
    let writers: Vec<_> = [("bo", "by-bo"), ("moor-edit-a", "by-team")]
        .into_iter()
        .map(|(who, prefix)| {
            let file = s.tmp.path().join(format!("{prefix}.yaml"));
            std::fs::write(&file, volumes_manifest(prefix, 4)).unwrap();
            s.cmd("moorctl", who, None)
                .args(["apply", "-f", file.to_str().unwrap()])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for w in writers {
        let out = w.wait_with_output().unwrap();
        assert!(out.status.success(), "{out:?}");
    }
    let names: Vec<String> = ["by-bo", "by-team"]
        .iter()
        .flat_map(|p| (1..=4).map(move |i| format!("{p}-{i}")))
        .collect();
    // Three fit (30 MiB); five wait, saying which quota and how much is used.
    let volumes = || async {
        let mut out = Vec::new();
        for n in &names {
            if let Some(v) = admin
                .try_get(&Volume::key_for(&a, n.as_str()))
                .await
                .unwrap()
            {
                out.push(v);
            }
        }
        out
    };
    wait_for(
        "three volumes made and five waiting on the quota",
        T,
        || async {
            let vs = volumes().await;
            let ready = vs
                .iter()
                .filter(|v| v.status.provisioning.phase == VolumePhase::Ready)
                .count();
            let waiting = vs
                .iter()
                .filter(|v| {
                    v.status.provisioning.meta.conditions.iter().any(|c| {
                        c.reason == "QuotaExceeded"
                            && c.message
                                .starts_with("quota team: capacity 30.0 MiB of 30.0 MiB used")
                    })
                })
                .count();
            ready == 3 && waiting == 5
        },
    )
    .await;
    let q = admin.get(&quota_key).await.unwrap();
    assert_eq!(q.status.used.volumes, 3, "{:?}", q.status);
    assert_eq!(q.status.used.capacity, Size(30 << 20));
    assert_eq!(q.status.waiting_count, 5);
    assert_eq!(
        create_volume_calls(&s, "n1"),
        3,
        "CreateVolume only for what was charged"
    );

    // Ann (view:a) reads the usage.
    let out = s.moorctl("ann", None, &["get", "quota", "-n", "a"]);
    assert!(out.status.success(), "{out:?}");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("3/5") && table.contains("30.0 MiB/30.0 MiB") && table.contains(" 5 "),
        "{table}"
    );

    // The console, under its own identity, shows the usage on its overview.
    let port = free_port();
    let mut cmd = s.cmd("moord", "moor-console", None);
    cmd.args(["console", "--etcd", &s.url])
        .arg(format!("--listen=127.0.0.1:{port}"));
    let _console = s.spawn(cmd, "console");
    let addr = format!("127.0.0.1:{port}");
    wait_for("the console shows the quota's usage", T, || async {
        if tokio::net::TcpStream::connect(&addr).await.is_err() {
            return false;
        }
        let page = common::http_get(&addr, "/").await;
        page.contains("<td>team</td><td>3/5</td><td>30.0 MiB/30.0 MiB</td>")
    })
    .await;

    // A made volume deleted: its charge goes to the oldest waiting one, which is made.
    let made: Vec<String> = volumes()
        .await
        .iter()
        .filter(|v| v.status.provisioning.phase == VolumePhase::Ready)
        .map(|v| v.metadata.name.to_string())
        .collect();
    let out = s.moorctl("bo", None, &["delete", "volume", &made[0], "-n", "a"]);
    assert!(out.status.success(), "{out:?}");
    wait_for("a waiting volume made in the freed room", T, || async {
        let vs = volumes().await;
        vs.len() == 7
            && vs
                .iter()
                .filter(|v| v.status.provisioning.phase == VolumePhase::Ready)
                .count()
                == 3
    })
    .await;
    assert_eq!(create_volume_calls(&s, "n1"), 4);

    // One allocation is admitted; a second waits for the quota.
    let ready: Vec<String> = volumes()
        .await
        .iter()
        .filter(|v| v.status.provisioning.phase == VolumePhase::Ready)
        .map(|v| v.metadata.name.to_string())
        .collect();
    let allocs = s.tmp.path().join("allocs.yaml");
    std::fs::write(
        &allocs,
        format!(
            "kind: Allocation\nmetadata: {{name: first, namespace: a}}\nspec:\n  node: n1\n  \
             volumes:\n  - {{name: data, volume: {}, access_mode: single-node-writer, \
             attachment_mode: file-system}}\n",
            ready[0]
        ),
    )
    .unwrap();
    let out = s.moorctl("bo", None, &["apply", "-f", allocs.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let claim_of =
        |alloc: &str| Claim::key_for(&NodeName::new("n1").unwrap(), &a, format!("{alloc}.data"));
    wait_for("the first allocation's claim published", T, || async {
        admin
            .try_get(&claim_of("first"))
            .await
            .ok()
            .flatten()
            .is_some_and(|c| c.status.phase == ClaimPhase::Published)
    })
    .await;
    std::fs::write(
        &allocs,
        format!(
            "kind: Allocation\nmetadata: {{name: second, namespace: a}}\nspec:\n  node: n1\n  \
             volumes:\n  - {{name: data, volume: {}, access_mode: single-node-writer, \
             attachment_mode: file-system}}\n",
            ready[1]
        ),
    )
    .unwrap();
    let out = s.moorctl("bo", None, &["apply", "-f", allocs.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    wait_for(
        "the second allocation's claim waits on the quota",
        T,
        || async {
            admin
                .try_get(&claim_of("second"))
                .await
                .ok()
                .flatten()
                .is_some_and(|c| {
                    c.status.phase == ClaimPhase::Pending
                        && c.status.reason.as_deref().is_some_and(|r| {
                            r == "allocation second: quota team: allocations 1 of 1 used"
                        })
                })
        },
    )
    .await;
    // The first ends: its charge goes, and the second is admitted.
    let out = s.moorctl("bo", None, &["alloc", "stop", "first", "-n", "a"]);
    assert!(out.status.success(), "{out:?}");
    wait_for(
        "the second allocation admitted once the first ended",
        T,
        || async {
            admin
                .try_get(&claim_of("second"))
                .await
                .ok()
                .flatten()
                .is_some_and(|c| c.status.phase == ClaimPhase::Published)
        },
    )
    .await;

    // A claim of a volume the quota keeps from being made waits for the quota, named
    // (not for the volume's creation).
    let waiting_volume = volumes()
        .await
        .into_iter()
        .find(|v| v.status.provisioning.phase != VolumePhase::Ready)
        .expect("a volume still waiting")
        .metadata
        .name
        .to_string();
    std::fs::write(
        &allocs,
        format!(
            "kind: Allocation\nmetadata: {{name: third, namespace: a}}\nspec:\n  node: n1\n  \
             volumes:\n  - {{name: data, volume: {waiting_volume}, access_mode: \
             single-node-writer, attachment_mode: file-system}}\n"
        ),
    )
    .unwrap();
    let out = s.moorctl("bo", None, &["apply", "-f", allocs.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let want = format!("volume {waiting_volume}: quota team: capacity 30.0 MiB of 30.0 MiB used");
    wait_for("a claim of a waiting volume says the quota", T, || async {
        admin
            .try_get(&claim_of("third"))
            .await
            .ok()
            .flatten()
            .is_some_and(|c| {
                c.status
                    .reason
                    .as_deref()
                    .is_some_and(|r| r.starts_with(&want))
            })
    })
    .await;

    // A quota that is not a valid Quota (an operator's bad write) lets nothing more be
    // made in its namespace, saying so.
    let mut root = s.raw("root").await;
    root.put("/moor/quotas/a/broken", "{not a quota", None)
        .await
        .unwrap();
    let broken = s.tmp.path().join("broken.yaml");
    std::fs::write(&broken, volumes_manifest("broken", 1)).unwrap();
    let out = s.moorctl("cy", None, &["apply", "-f", broken.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    waits_on_quota(&admin, &a, "broken-1", "is not a valid Quota").await;
    root.delete("/moor/quotas/a/broken", None).await.unwrap();
    assert_eq!(create_volume_calls(&s, "n1"), 4);

    // An agent whose etcd role does not let it read quotas (an older roles.sh) makes
    // nothing, and says why.
    run(Command::new(common::need("etcdctl"))
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={}", s.url))
        .arg(format!("--cacert={}", s.certs.join("ca.pem").display()))
        .arg(format!("--cert={}", s.certs.join("root.pem").display()))
        .arg(format!("--key={}", s.certs.join("root-key.pem").display()))
        .args([
            "role",
            "revoke-permission",
            "moor-agent-n1",
            "/moor/quotas/",
            "--prefix",
        ]));
    let unseen = s.tmp.path().join("unseen.yaml");
    std::fs::write(&unseen, volumes_manifest("unseen", 1)).unwrap();
    let out = s.moorctl("cy", None, &["apply", "-f", unseen.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    waits_on_quota(
        &admin,
        &a,
        "unseen-1",
        "does not let it read the namespace's quotas",
    )
    .await;
    assert_eq!(
        create_volume_calls(&s, "n1"),
        4,
        "nothing made past an unseen quota"
    );

    // No version of the quota etcd kept ever charged past a limit.
    let mut raw = s.raw("root").await;
    let now = revision(&mut raw).await;
    let mut versions = 0;
    for rev in 1..=now {
        let got = raw
            .get(
                format!("/moor/{}", quota_key.as_str()),
                Some(etcd_client::GetOptions::new().with_revision(rev)),
            )
            .await
            .unwrap();
        let Some(kv) = got.kvs().first() else {
            continue;
        };
        if kv.mod_revision() != rev {
            continue;
        }
        versions += 1;
        let v: serde_json::Value = serde_json::from_slice(kv.value()).unwrap();
        let used = |f: &str| v["status"]["used"][f].as_u64().unwrap_or(0);
        assert!(
            used("volumes") <= 5 && used("capacity") <= 30 << 20 && used("allocations") <= 1,
            "version at revision {rev} charged past a limit: {v}"
        );
    }
    assert!(versions >= 3, "the quota's versions were read: {versions}");
}

/// `GET path` from the console on `port` with `token`: the status code and the body.
async fn console_get_as(port: u16, path: &str, token: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("the console listens");
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n\
         Connection: close\r\n\r\n"
    );
    conn.write_all(req.as_bytes()).await.unwrap();
    let mut body = Vec::new();
    conn.read_to_end(&mut body).await.unwrap();
    let text = String::from_utf8_lossy(&body).into_owned();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, text)
}

/// The console serves people (`--people`, `--token-file` lines `TOKEN NAME`): each sees
/// in its pages exactly the namespaces their etcd role reads (checked against etcd
/// with their own certificate), the cluster's nodes and plugins, and nothing of
/// another namespace, not even by its address; anyone else is refused.
#[tokio::test]
async fn the_console_shows_each_person_what_their_etcd_role_reads() {
    let s = Secure::start().await;
    let admin = s.store("moor-controller", Some(&s.cluster_keys)).await;
    for ns in ["a", "b"] {
        let mut v = volume(&format!("vol-in-{ns}"));
        v.metadata.namespace = Namespace::new(ns).unwrap();
        admin.create(&v).await.unwrap();
    }
    let people = s.tmp.path().join("people");
    std::fs::write(&people, format!("# who sees what\n{}\n", secure::PEOPLE)).unwrap();
    let tokens = s.tmp.path().join("tokens");
    let token = |who: &str| format!("{who}-token-0123456789abcdef");
    std::fs::write(
        &tokens,
        format!(
            "{} ann\n{} bo\n{} cy\n",
            token("ann"),
            token("bo"),
            token("cy")
        ),
    )
    .unwrap();
    let port = free_port();
    let mut cmd = s.cmd("moord", "moor-console", None);
    cmd.args(["console", "--etcd", &s.url])
        .arg(format!("--listen=127.0.0.1:{port}"))
        .arg(format!("--token-file={}", tokens.display()))
        .arg(format!("--people={}", people.display()));
    let _console = s.spawn(cmd, "console");
    wait_for("the console lists the volumes", T, || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
            && console_get_as(port, "/volumes", &token("cy"))
                .await
                .1
                .contains("vol-in-b")
    })
    .await;
    for who in ["ann", "bo", "cy"] {
        let (code, page) = console_get_as(port, "/volumes", &token(who)).await;
        assert_eq!(code, 200, "{who}: {page}");
        let (_, overview) = console_get_as(port, "/", &token(who)).await;
        for ns in ["a", "b"] {
            // What etcd lets this person read, with their own certificate.
            let reads = s
                .moorctl(who, None, &["get", "volumes", "-n", ns])
                .status
                .success();
            let name = format!("vol-in-{ns}");
            assert_eq!(
                page.contains(&name),
                reads,
                "{who} reads namespace {ns} in etcd: {reads}; the console's /volumes: {page}"
            );
            let (code, _) =
                console_get_as(port, &format!("/volumes/{ns}/{name}"), &token(who)).await;
            assert_eq!(
                code == 200,
                reads,
                "{who}: /volumes/{ns}/{name} answered {code}"
            );
        }
        let count = if who == "cy" { 2 } else { 1 };
        assert!(
            overview.contains(&format!("Volumes <span>{count}</span>")),
            "{who}'s overview counts {count} volumes: {overview}"
        );
    }
    // Nobody else: no token, or one the file does not hold.
    let (code, _) = console_get_as(port, "/volumes", "not-a-token-0123456789").await;
    assert_eq!(code, 401);
}
