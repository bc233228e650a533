//! The web console (issue 55) in a real browser: headless Chromium through chromedriver
//! against a real cluster (etcd, the controller, an agent and moor-hostpath) and
//! `moord console`. Each test waits for what the page shows with a deadline.

#[path = "common/browser.rs"]
mod browser;
#[path = "common/cluster.rs"]
mod cluster;
mod common;

use std::time::{Duration, Instant};

use browser::Browser;
use cluster::{Cluster, PluginOpts, Proc};
use common::{bin, free_port};
use moor::api::*;
use moor_hostpath::faults::Command;

const T: Duration = Duration::from_secs(60);

/// `moord console` on the cluster's etcd, on a free loopback port; its address once
/// it has listed every kind.
async fn console(c: &Cluster) -> (Proc, String) {
    console_on(&c.etcd.client_url, c.dir.path()).await
}

/// `moord console` on the etcd at `url`, its log in `dir`.
async fn console_on(url: &str, dir: &std::path::Path) -> (Proc, String) {
    let port = free_port();
    let proc = Proc::start(
        "console",
        bin("moord"),
        vec![
            "console".into(),
            "--etcd".into(),
            url.to_string(),
            format!("--listen=127.0.0.1:{port}"),
        ],
        dir.join("console.log"),
    );
    let addr = format!("127.0.0.1:{port}");
    let started = Instant::now();
    loop {
        if tokio::net::TcpStream::connect(&addr).await.is_ok()
            && common::http_get(&addr, "/healthz")
                .await
                .starts_with("HTTP/1.1 200")
        {
            return (proc, addr);
        }
        assert!(
            started.elapsed() < T,
            "the console did not start: {}",
            proc.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A claim waiting on a failing NodeStage shows on the overview with its step and
/// error, live; its volume's picture turns from attached to published when the claim
/// publishes, without a reload; hostile text from the store renders as text.
#[tokio::test]
async fn the_console_shows_what_waits_and_follows_the_claim_live() {
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    let (_console, addr) = console(&c).await;
    let browser = Browser::start(1280, 900).await;
    browser.open(&format!("http://{addr}/")).await;
    browser
        .wait(
            "the live stream",
            T,
            "return document.getElementById('live').textContent === 'live';",
        )
        .await;
    browser.eval("window.__same_page = 42; return true;").await;

    // A volume, and an event about it whose message is hostile (labels
    // and names are validated; an event's text is whatever its writer said).
    let hostile = "<script>window.__pwned=1</script><img src=x onerror=\"window.__pwned=2\">\u{1b}[2J\u{202e}gnirts";
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    let mut event = Event::new(
        &Namespace::default_ns(),
        Name::new("hostile-1").unwrap(),
        EventSpec {
            reason: "Probe".into(),
            message: hostile.into(),
            object: ObjectRef {
                kind: "Volume".into(),
                namespace: Namespace::default_ns(),
                name: Name::new("v1").unwrap(),
            },
            source: "controller".into(),
            time: Some(Timestamp::now()),
            ..Default::default()
        },
    );
    event.metadata.namespace = Namespace::default_ns();
    c.apply(event).await;

    // NodeStage fails until told otherwise.
    let n1 = c.node("n1");
    n1.fault(Command::Fail {
        rpc: "NodeStageVolume".into(),
        code: "Unavailable".into(),
        times: 1_000_000,
    })
    .await;
    c.apply(c.allocation("a1", "n1", "v1", false)).await;
    // When the store first says the claim waits on NodeStage...
    let stored = Instant::now();
    let mut in_store = None;
    while in_store.is_none() {
        let claim = c.claim("a1", "n1").await;
        if claim
            .as_ref()
            .and_then(|cl| cl.status.meta.retry.as_ref())
            .is_some_and(|r| r.step == "NodeStageVolume")
        {
            in_store = Some(Instant::now());
        }
        assert!(stored.elapsed() < T, "the claim never waited on NodeStage");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // ...and when the overview, never reloaded, shows it with its step and error.
    let shown = browser
        .wait(
            "the overview to list the claim waiting on NodeStageVolume",
            T,
            "return Array.from(document.querySelectorAll('tr.waiter')).some(r => \
             r.innerText.includes('NodeStageVolume') && r.innerText.includes('injected fault'));",
        )
        .await;
    let latency = in_store.unwrap().elapsed();
    eprintln!(
        "console: the waiting claim showed {:?} after the store held it (browser polled every 25 ms; waited {shown:?} in all)",
        latency
    );
    assert_eq!(
        browser.eval("return window.__same_page;").await,
        42,
        "the overview reloaded"
    );

    // The volume's page: attached, the stage failing; then published, without a reload.
    browser
        .open(&format!("http://{addr}/volumes/default/v1"))
        .await;
    browser
        .wait(
            "the live stream",
            T,
            "return document.getElementById('live').textContent === 'live';",
        )
        .await;
    browser.eval("window.__same_page = 43; return true;").await;
    browser
        .wait(
            "the picture to show the attachment and the stage failing",
            T,
            "const a = document.querySelector('.attachment'); const m = document.querySelector('.mount'); \
             return !!a && !!m && m.dataset.state !== 'published' && m.innerText.includes('NodeStageVolume');",
        )
        .await;
    n1.fault(Command::Fail {
        rpc: "NodeStageVolume".into(),
        code: "Unavailable".into(),
        times: 0,
    })
    .await;
    let published = browser
        .wait(
            "the picture to turn published",
            T,
            "const m = document.querySelector('.mount'); return !!m && m.dataset.state === 'published';",
        )
        .await;
    eprintln!("console: the picture turned published {published:?} after the fault was lifted (NodeStage's next retry included)");
    // Its timeline holds what `moorctl describe volume` shows: the events about its
    // claims and attachments too (issue 78, item 7: only the volume's own, before).
    browser
        .wait(
            "the volume's timeline to show its claim's and its attachment's events",
            T,
            "const t = document.querySelector('ol.timeline'); \
             return !!t && t.innerText.includes('Claim published') && t.innerText.includes('Attach volume');",
        )
        .await;
    assert_eq!(
        browser.eval("return window.__same_page;").await,
        43,
        "the volume page reloaded"
    );

    // Hostile text is text: no script of the store's ran, none was added, the text
    // shows escaped.
    let text = browser.text().await;
    assert!(text.contains("<script>window.__pwned=1</script>"), "{text}");
    assert!(
        text.contains("\\u{202e}gnirts") && text.contains("\\u{1b}[2J"),
        "{text}"
    );
    assert!(
        !text.contains('\u{202e}') && !text.contains('\u{1b}'),
        "{text}"
    );
    assert_eq!(
        browser.eval("return window.__pwned === undefined;").await,
        true
    );
    assert_eq!(
        browser
            .eval("return document.querySelectorAll('script').length;")
            .await,
        1,
        "only the console's own script"
    );
    assert_eq!(
        browser
            .eval("return document.querySelectorAll('img').length;")
            .await,
        0
    );

    // The page renders: laid out with height, and not a blank image.
    let height = browser
        .eval("return document.querySelector('main').getBoundingClientRect().height;")
        .await;
    assert!(height.as_f64().unwrap_or(0.0) > 300.0, "{height}");
    let png = browser.screenshot().await;
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    // A blank 1280x900 page compresses to a few KiB; this one has text and boxes.
    assert!(
        png.len() > 20_000,
        "a blank screenshot ({} bytes)",
        png.len()
    );
}

/// The value of the first sample of `name` in a Prometheus page.
fn gauge(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            (series == name || series.starts_with(&format!("{name}{{")))
                .then(|| value.parse().ok())?
        })
        .unwrap_or_else(|| panic!("no {name} in etcd's metrics"))
}

/// 50 live pages cost etcd no more watchers than one: they share the console's.
#[tokio::test]
async fn fifty_live_clients_leave_etcds_watchers_as_one_does() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    let (_console, addr) = console(&c).await;
    let etcd = c.etcd.client_url.trim_start_matches("http://").to_string();
    let watchers = || async {
        let page = common::http_get(&etcd, "/metrics").await;
        (
            gauge(&page, "etcd_debugging_mvcc_watcher_total"),
            gauge(&page, "etcd_debugging_mvcc_watch_stream_total"),
        )
    };
    let open = |n: usize| {
        let addr = addr.clone();
        async move {
            let mut streams = Vec::new();
            for _ in 0..n {
                let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
                s.write_all(format!("GET /live?topics=Volume HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n").as_bytes())
                    .await
                    .unwrap();
                let mut buf = vec![0u8; 4096];
                let mut got = String::new();
                while !got.contains("event: hello") {
                    let n = s.read(&mut buf).await.unwrap();
                    assert!(n > 0, "the stream closed: {got}");
                    got.push_str(&String::from_utf8_lossy(&buf[..n]));
                }
                streams.push(s);
            }
            streams
        }
    };
    let mut one = open(1).await;
    // The cluster's own watchers settle first (a plugin's survey may come and go).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let with_one = watchers().await;
    let mut fifty = open(49).await;
    fifty.append(&mut one);
    let with_fifty = watchers().await;
    assert_eq!(
        with_one, with_fifty,
        "watchers and watch streams with 1 and 50 live clients"
    );

    // And every one of them is live: a change reaches all 50.
    c.apply(c.volume("v-live", AccessMode::SingleNodeWriter))
        .await;
    for (i, s) in fifty.iter_mut().enumerate() {
        let mut buf = vec![0u8; 4096];
        let mut got = String::new();
        let deadline = Instant::now() + T;
        while !got.contains("event: changed") {
            let left = deadline.saturating_duration_since(Instant::now());
            let n = tokio::time::timeout(left, s.read(&mut buf))
                .await
                .unwrap_or_else(|_| panic!("client {i} heard no change"))
                .unwrap();
            assert!(n > 0, "client {i}'s stream closed");
            got.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    }
    eprintln!(
        "etcd watchers, watch streams with 1 and with 50 live clients: {with_one:?} {with_fifty:?}"
    );
}

/// Issue 77, item 5: the console answered any Host, so a page of another name that
/// resolves to 127.0.0.1 (DNS rebinding) read it from the operator's browser. It
/// answers an address, `localhost` with its port, and nothing else unless told.
#[tokio::test]
async fn the_console_answers_only_its_own_host_names() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let etcd = common::Etcd::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let (_console, addr) = console_on(&etcd.client_url, tmp.path()).await;
    let port = addr.rsplit_once(':').unwrap().1.to_string();
    let answer = |host: String| {
        let addr = addr.clone();
        async move {
            let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
            let req = format!("GET /volumes HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
            s.write_all(req.as_bytes()).await.unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        }
    };
    for host in [format!("127.0.0.1:{port}"), format!("localhost:{port}")] {
        let out = answer(host.clone()).await;
        assert!(out.starts_with("HTTP/1.1 200"), "Host {host}: {out}");
    }
    for host in [
        format!("rebound.example:{port}"),
        "localhost".to_string(),
        format!("localhost.rebound.example:{port}"),
    ] {
        let out = answer(host.clone()).await;
        assert!(out.starts_with("HTTP/1.1 421"), "Host {host}: {out}");
        assert!(!out.contains("<h1>"), "Host {host} got a page: {out}");
    }
}

/// Issue 77, item 5: moorctl hid a node's events about objects that are not on it and
/// the console showed them (5 of 5 spoofs on another node's volume page). Both views
/// now judge with one rule (`moor::api::event_shown`): on v1's page, the event of n1,
/// which hosts v1's plugin's controller service, is shown; n2's is not, and the page
/// says one was hidden.
#[tokio::test]
async fn a_node_s_events_show_only_about_objects_on_it() {
    let etcd = common::Etcd::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let store = etcd.store(moor::store::DEFAULT_PREFIX).await;
    let plugin = PluginId::new(cluster::PLUGIN).unwrap();
    let mut vol = Volume::new(
        &Namespace::default_ns(),
        Name::new("v1").unwrap(),
        VolumeSpec {
            plugin_id: plugin.clone(),
            capacity_min: Some(Size(1 << 20)),
            capabilities: vec![VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::FileSystem,
            }],
            ..Default::default()
        },
    );
    vol = store.create(&vol).await.expect("v1");
    let mut n1 = Node::new(
        &Namespace::default(),
        Name::new("n1").unwrap(),
        NodeSpec::default(),
    );
    n1.status.plugins.insert(
        plugin,
        NodePluginStatus {
            plugin_type: PluginType::Monolith,
            ..Default::default()
        },
    );
    store.create(&n1).await.expect("n1");
    let about = ObjectRef {
        kind: "Volume".into(),
        namespace: vol.metadata.namespace.clone(),
        name: vol.metadata.name.clone(),
    };
    for (node, text) in [
        ("n1", "said by the plugin's controller node"),
        ("n2", "spoofed by another node"),
    ] {
        moor::runtime::events::Recorder::new(store.clone(), &format!("agent/{node}"))
            .record(
                about.clone(),
                EventType::Warning,
                "Volume note",
                text.into(),
                Default::default(),
            )
            .await;
    }
    assert!(moor::runtime::events::flush(T).await, "events written");
    let (_console, addr) = console_on(&etcd.client_url, tmp.path()).await;
    let started = Instant::now();
    let page = loop {
        let page = common::http_get(&addr, "/volumes/default/v1").await;
        if page.contains("said by the plugin") {
            break page;
        }
        assert!(started.elapsed() < T, "n1's event never shown: {page}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(!page.contains("spoofed by another node"), "{page}");
    assert!(page.contains("1 event(s) written by nodes"), "{page}");
    // The overview's "Last seen" of n1 is when the console last received its Node (an
    // agent rewrites it at each renewal), not its plugins' report time, which n1's
    // report lacks (issue 78, item 7: it counted from registration, or showed "-").
    let overview = common::http_get(&addr, "/").await;
    let row = overview
        .split("<tr>")
        .find(|r| r.contains("href=\"/nodes/n1\""))
        .unwrap_or_default();
    assert!(row.contains(" ago</td>"), "{row}\n{overview}");
}

/// `openssl s_client`'s exchange with the console at `port`: the answer to `request`.
fn over_tls(
    port: u16,
    ca: &std::path::Path,
    request: &str,
    client: Option<(&std::path::Path, &std::path::Path)>,
) -> String {
    use std::io::Write;
    let mut cmd = std::process::Command::new(common::need("openssl"));
    cmd.args(["s_client", "-quiet", "-verify_return_error", "-connect"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("-CAfile")
        .arg(ca);
    if let Some((cert, key)) = client {
        cmd.arg("-cert").arg(cert).arg("-key").arg(key);
    }
    let mut child = cmd
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(request.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Off loopback, the console refuses to start without TLS and an access rule; with
/// them it serves HTTPS, and only to a request with the token, or a browser with a
/// client certificate its CA signed.
#[tokio::test]
async fn off_loopback_the_console_needs_tls_and_an_access_rule() {
    let etcd = common::Etcd::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // Refused, and says why.
    for (flags, says) in [
        (vec![], "without TLS"),
        (
            vec!["--tls-cert=c.pem", "--tls-key=k.pem"],
            "without an access rule",
        ),
    ] {
        let out = std::process::Command::new(bin("moord"))
            .args(["console", "--etcd", &etcd.client_url, "--listen=0.0.0.0:0"])
            .args(flags)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(says), "{err}");
    }
    // A CA, the console's certificate for 127.0.0.1, and a client's.
    let sh = |script: &str| {
        let out = std::process::Command::new("bash")
            .arg("-c")
            .arg(script)
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    sh("openssl req -x509 -newkey rsa:2048 -nodes -keyout ca-key.pem -out ca.pem -days 1 -subj /CN=test-ca 2>/dev/null \
        && openssl req -newkey rsa:2048 -nodes -keyout key.pem -out csr.pem -subj /CN=console 2>/dev/null \
        && printf 'subjectAltName=IP:127.0.0.1\\n' > san.ext \
        && openssl x509 -req -in csr.pem -CA ca.pem -CAkey ca-key.pem -CAcreateserial -out cert.pem -days 1 -extfile san.ext 2>/dev/null \
        && openssl req -newkey rsa:2048 -nodes -keyout client-key.pem -out client.csr -subj /CN=operator 2>/dev/null \
        && printf 'basicConstraints=CA:FALSE\\nextendedKeyUsage=clientAuth\\n' > client.ext \
        && openssl x509 -req -in client.csr -CA ca.pem -CAkey ca-key.pem -CAcreateserial -out client.pem -days 1 -extfile client.ext 2>/dev/null \
        && echo 0123456789abcdef-console-token > token");
    let start = |rule: &str, port: u16| {
        Proc::start(
            &format!("console-{port}"),
            bin("moord"),
            vec![
                "console".into(),
                "--etcd".into(),
                etcd.client_url.clone(),
                format!("--listen=0.0.0.0:{port}"),
                format!("--tls-cert={}", dir.join("cert.pem").display()),
                format!("--tls-key={}", dir.join("key.pem").display()),
                rule.to_string(),
            ],
            dir.join(format!("console-{port}.log")),
        )
    };
    let ca = dir.join("ca.pem");
    let wait_up = |port: u16,
                   request: &'static str,
                   client: Option<(std::path::PathBuf, std::path::PathBuf)>| {
        let ca = ca.clone();
        async move {
            let started = Instant::now();
            loop {
                let answer = over_tls(
                    port,
                    &ca,
                    request,
                    client.as_ref().map(|(c, k)| (c.as_path(), k.as_path())),
                );
                if answer.contains("HTTP/1.0") || answer.contains("HTTP/1.1") {
                    return answer;
                }
                assert!(started.elapsed() < T, "no HTTPS answer: {answer}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };

    // A token file: refused without it, served with it.
    let port = free_port();
    let _token = start(
        &format!("--token-file={}", dir.join("token").display()),
        port,
    );
    let refused = wait_up(port, "GET /healthz HTTP/1.0\r\n\r\n", None).await;
    assert!(refused.contains(" 401 "), "{refused}");
    let served = wait_up(
        port,
        "GET /volumes HTTP/1.0\r\nAuthorization: Bearer 0123456789abcdef-console-token\r\n\r\n",
        None,
    )
    .await;
    assert!(
        served.contains(" 200 ") && served.contains("<h1>Volumes</h1>"),
        "{served}"
    );
    let visit = wait_up(
        port,
        "GET /volumes?token=0123456789abcdef-console-token HTTP/1.0\r\n\r\n",
        None,
    )
    .await;
    assert!(
        visit.contains(" 303 ") && visit.contains("moor_console_token="),
        "{visit}"
    );
    let wrong = wait_up(
        port,
        "GET /volumes HTTP/1.0\r\nAuthorization: Bearer 0123456789abcdef-console-tokeN\r\n\r\n",
        None,
    )
    .await;
    assert!(wrong.contains(" 401 "), "{wrong}");

    // Client certificates: no certificate, no page; the CA's client, served.
    let port = free_port();
    let _certs = start(&format!("--client-ca={}", ca.display()), port);
    let client = Some((dir.join("client.pem"), dir.join("client-key.pem")));
    let served = wait_up(port, "GET /nodes HTTP/1.0\r\n\r\n", client).await;
    assert!(
        served.contains(" 200 ") && served.contains("<h1>Nodes</h1>"),
        "{served}"
    );
    let refused = over_tls(port, &ca, "GET /nodes HTTP/1.0\r\n\r\n", None);
    assert!(
        !refused.contains(" 200 "),
        "served without a client certificate: {refused}"
    );
}

/// Secrets and mount flags never reach a page: a volume, a claim and an allocation
/// holding them are shown with `[redacted]` where moorctl prints it, and the values
/// appear nowhere, whole page or live fragment.
#[tokio::test]
async fn secrets_and_mount_flags_never_reach_a_page() {
    let etcd = common::Etcd::start().await;
    let store = etcd.store("/moor/").await;
    let tmp = tempfile::tempdir().unwrap();
    let secret = "hunter2-console-secret";
    let flag = "console-secret-flag";
    let mut v = common::fixtures::volume("guarded");
    v.spec.secrets = Rare::new(Secrets::new(
        [("password".to_string(), secret.to_string())].into(),
    ));
    v.spec.mount_options = Rare::new(MountOptions {
        fs_type: Some("ext4".into()),
        mount_flags: MountFlags::new(vec![flag.to_string()]),
        ..Default::default()
    });
    store.create(&v).await.unwrap();
    let mut a = Allocation::new(
        &Namespace::default_ns(),
        Name::new("holder").unwrap(),
        AllocationSpec {
            node: NodeName::new("n1").unwrap(),
            volumes: vec![VolumeRequest {
                name: Name::new("data").unwrap(),
                volume: VolumeId::new("guarded").unwrap(),
                mount_options: Some(MountOptions {
                    mount_flags: MountFlags::new(vec![flag.to_string()]),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        },
    );
    a = store.create(&a).await.unwrap();
    let (console, addr) = console_on(&etcd.client_url, tmp.path()).await;
    for path in [
        "/volumes/default/guarded",
        "/allocations/default/holder",
        "/volumes?name=guarded",
        "/",
    ] {
        let page = common::http_get(&addr, path).await;
        assert!(page.starts_with("HTTP/1.1 200"), "{path}: {page}");
        assert!(
            !page.contains(secret) && !page.contains(flag),
            "{path} shows a secret: {page}"
        );
    }
    let page = common::http_get(&addr, "/volumes/default/guarded").await;
    assert!(
        page.contains("[redacted]") && page.contains("ext4"),
        "{page}"
    );
    assert!(!console.log_text().contains(secret));
    drop(a);
}
