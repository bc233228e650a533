//! `moord check` against a real etcd.

#[path = "../../tests/common/mod.rs"]
mod common;

use common::{fixtures::volume, Etcd};
use std::process::Command;

#[tokio::test]
async fn check_counts_objects_and_names_malformed_keys() {
    let etcd = Etcd::start().await;
    let store = etcd.store("/moor/").await;
    store.create(&volume("a")).await.unwrap();
    store.create(&volume("b")).await.unwrap();
    let run = || {
        Command::new(env!("CARGO_BIN_EXE_moord"))
            .args(["check", "--etcd", &etcd.client_url])
            .output()
            .expect("run moord")
    };
    let out = run();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(
        stdout.contains("Volume              2 objects      0 malformed"),
        "{stdout}"
    );

    let mut raw = etcd.raw_client().await;
    raw.put("/moor/claims/n1/default/c1", "garbage", None)
        .await
        .unwrap();
    let out = run();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("malformed value at claims/n1/default/c1"),
        "{stdout}"
    );
}

#[test]
fn check_without_etcd_fails_clearly() {
    let out = Command::new(env!("CARGO_BIN_EXE_moord"))
        .args(["check", "--etcd", "http://127.0.0.1:1"])
        .output()
        .expect("run moord");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("etcd is unavailable") && stderr.contains("127.0.0.1:1"),
        "{stderr}"
    );
}
