//! The embedded store against the etcd API: the same script on a real etcd and on
//! moor-store must give the same answers (revisions, versions, errors, events), and
//! etcdctl must work against moor-store.

mod common;

use std::time::Duration;

use common::{wait_for, Backend, Etcd};
use etcd_client::{
    Compare, CompareOp, DeleteOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    TxnOpResponse, WatchOptions,
};

fn kv_line(kv: &etcd_client::KeyValue) -> String {
    format!(
        "{}={} c{} m{} v{} lease:{}",
        kv.key_str().unwrap_or("?"),
        kv.value_str().unwrap_or("?"),
        kv.create_revision(),
        kv.mod_revision(),
        kv.version(),
        kv.lease() != 0
    )
}

fn err_line(e: etcd_client::Error) -> String {
    match e {
        etcd_client::Error::GRpcStatus(s) => format!("error {:?}: {}", s.code(), s.message()),
        other => format!("error {other}"),
    }
}

/// A script of KV, txn, history, compaction, watch and lease calls; every answer is a
/// line of the transcript (lease ids and cluster ids differ by design, so they are left
/// out).
async fn transcript(backend: Backend) -> Vec<String> {
    let etcd = Etcd::start_on(backend).await;
    let mut c = etcd.raw_client().await;
    let mut t = Vec::new();
    let base = c.get("x", None).await.unwrap().header().unwrap().revision();
    let rel = |r: i64| r - base;
    t.push(format!("base revision is {}", base));

    for (k, v) in [("a", "1"), ("a", "2"), ("b", "1"), ("c", "1")] {
        let r = c
            .put(k, v, Some(PutOptions::new().with_prev_key()))
            .await
            .unwrap();
        t.push(format!(
            "put {k}: rev +{} prev {:?}",
            rel(r.header().unwrap().revision()),
            r.prev_key().map(kv_line)
        ));
    }
    let r = c.get("a", None).await.unwrap();
    t.push(format!(
        "get a: {:?}",
        r.kvs().iter().map(kv_line).collect::<Vec<_>>()
    ));
    let r = c
        .get("", Some(GetOptions::new().with_all_keys().with_limit(2)))
        .await
        .unwrap();
    t.push(format!(
        "all limit 2: {:?} more {} count {}",
        r.kvs().iter().map(kv_line).collect::<Vec<_>>(),
        r.more(),
        r.count()
    ));
    let r = c
        .get(
            "a",
            Some(
                GetOptions::new()
                    .with_range("c")
                    .with_keys_only()
                    .with_sort(
                        etcd_client::SortTarget::Mod,
                        etcd_client::SortOrder::Descend,
                    ),
            ),
        )
        .await
        .unwrap();
    t.push(format!(
        "a..c keys by mod desc: {:?}",
        r.kvs().iter().map(kv_line).collect::<Vec<_>>()
    ));
    let r = c
        .get("a", Some(GetOptions::new().with_revision(base + 1)))
        .await
        .unwrap();
    t.push(format!(
        "a at +1: {:?}",
        r.kvs().iter().map(kv_line).collect::<Vec<_>>()
    ));
    t.push(format!(
        "a at +99: {}",
        err_line(
            c.get("a", Some(GetOptions::new().with_revision(base + 99)))
                .await
                .unwrap_err()
        )
    ));

    // Transactions: compare on version, a missing key's value, mod revision; nested ops.
    let r = c
        .txn(
            Txn::new()
                .when([Compare::version("a", CompareOp::Equal, 2)])
                .and_then([
                    TxnOp::put("d", "1", None),
                    TxnOp::put("d2", "2", None),
                    TxnOp::get("d", None),
                    TxnOp::delete("b", Some(DeleteOptions::new().with_prev_key())),
                ])
                .or_else([TxnOp::get("a", None)]),
        )
        .await
        .unwrap();
    t.push(format!(
        "txn version(a)=2: succeeded {} rev +{}",
        r.succeeded(),
        rel(r.header().unwrap().revision())
    ));
    for op in r.op_responses() {
        t.push(match op {
            TxnOpResponse::Get(g) => format!(
                "  get {:?}",
                g.kvs().iter().map(kv_line).collect::<Vec<_>>()
            ),
            TxnOpResponse::Put(_) => "  put".into(),
            TxnOpResponse::Delete(d) => format!(
                "  deleted {} {:?}",
                d.deleted(),
                d.prev_kvs().iter().map(kv_line).collect::<Vec<_>>()
            ),
            TxnOpResponse::Txn(_) => "  txn".into(),
        });
    }
    for ops in [
        vec![TxnOp::put("p", "1", None), TxnOp::put("p", "2", None)],
        vec![TxnOp::put("p", "1", None), TxnOp::delete("p", None)],
    ] {
        let r = c.txn(Txn::new().and_then(ops)).await;
        t.push(format!(
            "txn with a duplicate key: {}",
            r.map(|_| "ok".to_string()).unwrap_or_else(err_line)
        ));
    }
    let r = c
        .txn(
            Txn::new()
                .when([Compare::value("missing", CompareOp::NotEqual, "x")])
                .and_then([TxnOp::put("e", "1", None)]),
        )
        .await
        .unwrap();
    t.push(format!(
        "txn value(missing)!=x: succeeded {} rev +{}",
        r.succeeded(),
        rel(r.header().unwrap().revision())
    ));
    let r = c
        .txn(
            Txn::new()
                .when([
                    Compare::mod_revision("missing", CompareOp::Equal, 0),
                    Compare::create_revision("a", CompareOp::Less, base + 2),
                ])
                .and_then([TxnOp::put("f", "1", None)]),
        )
        .await
        .unwrap();
    t.push(format!(
        "txn mod(missing)=0 && create(a)<+2: succeeded {} rev +{}",
        r.succeeded(),
        rel(r.header().unwrap().revision())
    ));
    let r = c.delete("zzz", None).await.unwrap();
    t.push(format!(
        "delete nothing: {} rev +{}",
        r.deleted(),
        rel(r.header().unwrap().revision())
    ));
    let r = c
        .delete(
            "d",
            Some(DeleteOptions::new().with_prefix().with_prev_key()),
        )
        .await
        .unwrap();
    t.push(format!(
        "delete d*: {} rev +{}",
        r.deleted(),
        rel(r.header().unwrap().revision())
    ));
    let r = c
        .put("ignored", "v", Some(PutOptions::new().with_ignore_value()))
        .await;
    t.push(format!(
        "put ignore_value on a missing key: {}",
        r.map(|_| "ok".to_string()).unwrap_or_else(err_line)
    ));

    // Watch from the start: every event, with previous values.
    let now = c.get("x", None).await.unwrap().header().unwrap().revision();
    let mut stream = c
        .watch(
            "",
            Some(
                WatchOptions::new()
                    .with_all_keys()
                    .with_prev_key()
                    .with_start_revision(base + 1),
            ),
        )
        .await
        .unwrap();
    let mut seen = 0;
    while seen < (now - base) {
        let resp = tokio::time::timeout(Duration::from_secs(10), stream.message())
            .await
            .expect("watch answers")
            .unwrap()
            .unwrap();
        for ev in resp.events() {
            let kv = ev.kv().unwrap();
            seen = rel(kv.mod_revision());
            t.push(format!(
                "watch {:?} {} at +{} prev {:?}",
                ev.event_type(),
                kv.key_str().unwrap(),
                rel(kv.mod_revision()),
                ev.prev_kv().map(kv_line)
            ));
        }
    }
    drop(stream);

    // Compaction: reads and watches below it fail the same way.
    c.compact(base + 3, None).await.unwrap();
    t.push(format!(
        "get at +2 after compact: {}",
        err_line(
            c.get("a", Some(GetOptions::new().with_revision(base + 2)))
                .await
                .unwrap_err()
        )
    ));
    t.push(format!(
        "compact again: {}",
        err_line(c.compact(base + 2, None).await.unwrap_err())
    ));
    let mut stream = c
        .watch("a", Some(WatchOptions::new().with_start_revision(base + 1)))
        .await
        .unwrap();
    loop {
        let resp = tokio::time::timeout(Duration::from_secs(30), stream.message())
            .await
            .expect("the watch answered within 30 s")
            .unwrap()
            .unwrap();
        if resp.canceled() {
            t.push(format!(
                "watch from +1: canceled, compact revision +{}",
                rel(resp.compact_revision())
            ));
            break;
        }
    }

    // Leases: the minimum TTL, an unknown lease, keys bound and revoked.
    let lease = c.lease_grant(1, None).await.unwrap();
    t.push(format!("grant ttl 1: ttl {}", lease.ttl()));
    t.push(format!(
        "put with lease 12345: {}",
        err_line(
            c.put("g", "1", Some(PutOptions::new().with_lease(12345)))
                .await
                .unwrap_err()
        )
    ));
    let lease = c.lease_grant(60, None).await.unwrap();
    c.put("h", "1", Some(PutOptions::new().with_lease(lease.id())))
        .await
        .unwrap();
    c.put("i", "1", Some(PutOptions::new().with_lease(lease.id())))
        .await
        .unwrap();
    let ttl = c
        .lease_time_to_live(
            lease.id(),
            Some(etcd_client::LeaseTimeToLiveOptions::new().with_keys()),
        )
        .await
        .unwrap();
    let mut keys: Vec<String> = ttl
        .keys()
        .iter()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .collect();
    keys.sort();
    t.push(format!("lease keys {keys:?} granted {}", ttl.granted_ttl()));
    let r = c.lease_revoke(lease.id()).await.unwrap();
    t.push(format!(
        "revoke: rev +{}",
        rel(r.header().unwrap().revision())
    ));
    let r = c
        .get("h", Some(GetOptions::new().with_range("j")))
        .await
        .unwrap();
    t.push(format!("h..j after revoke: {}", r.count()));
    t.push(format!(
        "revoke again: {}",
        err_line(c.lease_revoke(lease.id()).await.unwrap_err())
    ));
    let ttl = c.lease_time_to_live(lease.id(), None).await.unwrap();
    t.push(format!("ttl of a revoked lease: {}", ttl.ttl()));
    // etcd's --max-request-bytes (1.5 MiB by default), for a put and a txn.
    let big = "v".repeat(1_600_000);
    t.push(format!(
        "put of 1.6 MB: {}",
        err_line(c.put("big", big.as_str(), None).await.unwrap_err())
    ));
    let half = "v".repeat(800_000);
    let txn = etcd_client::Txn::new().and_then(vec![
        etcd_client::TxnOp::put("big1", half.as_str(), None),
        etcd_client::TxnOp::put("big2", half.as_str(), None),
    ]);
    t.push(format!(
        "txn of 1.6 MB: {}",
        err_line(c.txn(txn).await.unwrap_err())
    ));
    t
}

#[tokio::test]
async fn moor_store_answers_like_etcd() {
    let (etcd, embedded) = tokio::join!(transcript(Backend::Etcd), transcript(Backend::Embedded));
    for (i, (a, b)) in etcd.iter().zip(embedded.iter()).enumerate() {
        assert_eq!(
            a,
            b,
            "line {i} differs\netcd:\n{}\nmoor-store:\n{}",
            etcd.join("\n"),
            embedded.join("\n")
        );
    }
    assert_eq!(
        etcd.len(),
        embedded.len(),
        "etcd:\n{}\nmoor-store:\n{}",
        etcd.join("\n"),
        embedded.join("\n")
    );
}

async fn survives_a_restart(backend: Backend) {
    let mut etcd = Etcd::start_on(backend).await;
    let mut c = etcd.raw_client().await;
    c.put("k", "1", None).await.unwrap();
    let rev = c
        .put("k", "2", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    let lease = c.lease_grant(30, None).await.unwrap().id();
    c.put("leased", "1", Some(PutOptions::new().with_lease(lease)))
        .await
        .unwrap();
    etcd.kill();
    etcd.restart().await;
    let mut c = etcd.raw_client().await;
    let r = c.get("k", None).await.unwrap();
    assert_eq!(r.kvs()[0].value_str().unwrap(), "2");
    assert_eq!(r.kvs()[0].version(), 2);
    assert_eq!(r.header().unwrap().revision(), rev + 1);
    // History survives: a watch from before the restart replays it.
    let mut stream = c
        .watch("k", Some(WatchOptions::new().with_start_revision(rev - 1)))
        .await
        .unwrap();
    let mut values = Vec::new();
    while values.len() < 2 {
        let resp = stream.message().await.unwrap().unwrap();
        values.extend(
            resp.events()
                .iter()
                .map(|e| e.kv().unwrap().value_str().unwrap().to_string()),
        );
    }
    assert_eq!(values, ["1", "2"]);
    // The lease and its key survive, and the key still goes with the lease.
    assert_eq!(c.get("leased", None).await.unwrap().count(), 1);
    c.lease_revoke(lease).await.unwrap();
    assert_eq!(c.get("leased", None).await.unwrap().count(), 0);
}

async fn an_expired_lease_deletes_its_keys(backend: Backend) {
    let etcd = Etcd::start_on(backend).await;
    let mut c = etcd.raw_client().await;
    let lease = c.lease_grant(2, None).await.unwrap().id();
    c.put("gone", "1", Some(PutOptions::new().with_lease(lease)))
        .await
        .unwrap();
    let mut stream = c.watch("gone", None).await.unwrap();
    let deadline = Duration::from_secs(15);
    let deleted = tokio::time::timeout(deadline, async {
        loop {
            let resp = stream.message().await.unwrap().unwrap();
            if resp
                .events()
                .iter()
                .any(|e| e.event_type() == EventType::Delete)
            {
                return;
            }
        }
    })
    .await;
    assert!(
        deleted.is_ok(),
        "the key outlived its lease by {deadline:?}"
    );
    assert_eq!(c.get("gone", None).await.unwrap().count(), 0);
}

crate::both_stores!(survives_a_restart, an_expired_lease_deletes_its_keys);

fn etcdctl(url: &str, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(crate::common::need("etcdctl"))
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={url}"))
        .args(args)
        .output()
        .expect("etcdctl runs (package etcd-client)");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[tokio::test]
async fn etcdctl_gets_puts_watches_and_leases_against_moor_store() {
    let etcd = Etcd::start_on(Backend::Embedded).await;
    let url = etcd.client_url.clone();
    let mut watch = std::process::Command::new(crate::common::need("etcdctl"))
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={url}"))
        .args(["watch", "--prefix", "w/"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("etcdctl runs");
    assert_eq!(etcdctl(&url, &["put", "k", "v"]), (true, "OK\n".into()));
    assert_eq!(
        etcdctl(&url, &["get", "k", "--print-value-only"]),
        (true, "v\n".into())
    );
    let (ok, out) = etcdctl(&url, &["lease", "grant", "60"]);
    assert!(ok, "{out}");
    let id = out.split_whitespace().nth(1).expect("lease id").to_string();
    assert!(etcdctl(&url, &["put", "leased", "1", "--lease", &id]).0);
    let (ok, out) = etcdctl(&url, &["lease", "timetolive", &id, "--keys"]);
    assert!(ok && out.contains("leased"), "{out}");
    assert!(etcdctl(&url, &["lease", "revoke", &id]).0);
    assert_eq!(
        etcdctl(&url, &["get", "leased", "--print-value-only"]),
        (true, String::new())
    );
    assert_eq!(etcdctl(&url, &["del", "k"]), (true, "1\n".into()));
    // etcdctl dials `endpoint status` with the URL as the HTTP/2 authority, which
    // moor-store's HTTP/2 server refuses; without the scheme it works.
    let bare = url.trim_start_matches("http://");
    let (ok, out) = etcdctl(bare, &["endpoint", "status"]);
    assert!(ok, "{out}");
    // The watch sees a put made after it started (it may not have started yet: put
    // until it has).
    let mut stdout = watch.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        use std::io::Read;
        let mut seen = String::new();
        let mut buf = [0u8; 256];
        while !seen.contains("w/1") {
            match stdout.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => seen.push_str(&String::from_utf8_lossy(&buf[..n])),
            }
        }
        seen
    });
    wait_for(
        "etcdctl watch to print a put",
        Duration::from_secs(15),
        || {
            let url = url.clone();
            let done = reader.is_finished();
            async move {
                if !done {
                    etcdctl(&url, &["put", "w/1", "x"]);
                }
                done
            }
        },
    )
    .await;
    let _ = watch.kill();
    let _ = watch.wait();
    let seen = reader.join().unwrap();
    assert!(seen.contains("PUT") && seen.contains("w/1"), "{seen}");
}
