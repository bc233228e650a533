//! A 3-member etcd cluster whose members can be partitioned from one another: each
//! member runs in a network namespace of its own, linked to each other member and to
//! the test's namespace by a veth pair (no bridge, no forwarding). [`Members::isolate`]
//! drops, with iptables inside the member's namespace, every packet between it and the
//! other two members: a real partition (nothing is refused), while clients still reach
//! it. Needs root (`ip netns`, iptables); [`Members::start`] says so otherwise.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Runs a command, panicking with its output if it fails.
fn run(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("run {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A /32 route to `to` through `dev`, from `src`, in namespace `ns` (the test's own
/// when `None`).
fn route(ns: Option<&str>, to: &str, dev: &str, src: &str) {
    let to = format!("{to}/32");
    let mut args = vec!["ip"];
    if let Some(ns) = ns {
        args.extend(["-n", ns]);
    }
    args.extend(["route", "add", &to, "dev", dev, "src", src]);
    run(&args);
}

pub struct Members {
    /// A short tag unique to this cluster (interface and namespace names).
    tag: String,
    /// The /16 this cluster's addresses come from: 10.X.
    net: u8,
    dir: PathBuf,
    children: Vec<Option<Child>>,
}

impl Members {
    /// Member `i`'s (0-2) namespace.
    fn ns(&self, i: usize) -> String {
        format!("{}m{i}", self.tag)
    }

    /// Member `i`'s address, on its own loopback: what its peers and clients dial.
    pub fn ip(&self, i: usize) -> String {
        format!("10.{}.0.{}", self.net, 11 + i)
    }

    pub fn client_urls(&self) -> Vec<String> {
        (0..3)
            .map(|i| format!("http://{}:2379", self.ip(i)))
            .collect()
    }

    /// Starts the three members and waits until the cluster answers a write.
    pub async fn start(dir: &Path) -> Members {
        // Unique enough among the tests of this machine: the pid and the clock.
        let seed = std::process::id() as u64
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or_default();
        let net = 100 + (seed % 150) as u8;
        let tag = format!("mo{}", 10_000 + (seed / 150) % 90_000);
        let mut m = Members {
            tag,
            net,
            dir: dir.to_path_buf(),
            children: vec![None, None, None],
        };
        m.wire();
        let cluster: Vec<String> = (0..3)
            .map(|i| format!("m{i}=http://{}:2380", m.ip(i)))
            .collect();
        for i in 0..3 {
            let log = std::fs::File::create(dir.join(format!("m{i}.log"))).expect("member log");
            let ip = m.ip(i);
            let child = Command::new("ip")
                .args(["netns", "exec", &m.ns(i), crate::common::need("etcd")])
                .arg(format!("--name=m{i}"))
                .arg(format!(
                    "--data-dir={}",
                    dir.join(format!("m{i}")).display()
                ))
                .arg(format!("--listen-peer-urls=http://{ip}:2380"))
                .arg(format!("--initial-advertise-peer-urls=http://{ip}:2380"))
                .arg(format!("--listen-client-urls=http://{ip}:2379"))
                .arg(format!("--advertise-client-urls=http://{ip}:2379"))
                .arg(format!("--initial-cluster={}", cluster.join(",")))
                .arg(format!("--initial-cluster-token={}", m.tag))
                .arg("--initial-cluster-state=new")
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("start an etcd member");
            m.children[i] = Some(child);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(mut c) = etcd_client::Client::connect(m.client_urls(), None).await {
                if c.put("members-ready", "1", None).await.is_ok() {
                    return m;
                }
            }
            assert!(
                Instant::now() < deadline,
                "the 3 members did not form a cluster; logs in {}",
                dir.display()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Namespaces, links and routes: member i has its address on its loopback and a
    /// veth to every other member and to the test's namespace, with /32 routes.
    fn wire(&self) {
        for i in 0..3 {
            run(&["ip", "netns", "add", &self.ns(i)]);
            let ns = self.ns(i);
            run(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
            run(&[
                "ip",
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/32", self.ip(i)),
                "dev",
                "lo",
            ]);
        }
        // Member ↔ member.
        for (a, b) in [(0, 1), (0, 2), (1, 2)] {
            let (ia, ib) = (format!("{}{a}{b}", self.tag), format!("{}{b}{a}", self.tag));
            run(&[
                "ip", "link", "add", &ia, "type", "veth", "peer", "name", &ib,
            ]);
            run(&["ip", "link", "set", &ia, "netns", &self.ns(a)]);
            run(&["ip", "link", "set", &ib, "netns", &self.ns(b)]);
            for (i, dev, other) in [(a, &ia, b), (b, &ib, a)] {
                let ns = self.ns(i);
                run(&["ip", "-n", &ns, "link", "set", dev, "up"]);
                route(Some(&ns), &self.ip(other), dev, &self.ip(i));
            }
        }
        // Test namespace ↔ member: the test side is 10.X.1.1.
        let host = format!("10.{}.1.1", self.net);
        for i in 0..3 {
            let (h, n) = (format!("{}h{i}", self.tag), format!("{}n{i}", self.tag));
            run(&["ip", "link", "add", &h, "type", "veth", "peer", "name", &n]);
            run(&["ip", "link", "set", &n, "netns", &self.ns(i)]);
            run(&["ip", "link", "set", &h, "up"]);
            if i == 0 {
                run(&["ip", "addr", "add", &format!("{host}/32"), "dev", &h]);
            }
            let ns = self.ns(i);
            run(&["ip", "-n", &ns, "link", "set", &n, "up"]);
            route(None, &self.ip(i), &h, &host);
            route(Some(&ns), &host, &n, &self.ip(i));
        }
    }

    /// Drops every packet between member `i` and the other two (clients still reach
    /// it): it loses the quorum, or the others lose their leader if it led.
    pub fn isolate(&self, i: usize) {
        let ns = self.ns(i);
        for other in (0..3).filter(|o| *o != i) {
            let ip = self.ip(other);
            run(&[
                "ip", "netns", "exec", &ns, "iptables", "-A", "INPUT", "-s", &ip, "-j", "DROP",
            ]);
            run(&[
                "ip", "netns", "exec", &ns, "iptables", "-A", "OUTPUT", "-d", &ip, "-j", "DROP",
            ]);
        }
    }

    /// Lifts [`Members::isolate`].
    pub fn rejoin(&self, i: usize) {
        let ns = self.ns(i);
        run(&["ip", "netns", "exec", &ns, "iptables", "-F"]);
    }

    /// The index of the member that leads now, as the members report it.
    pub async fn leader(&self) -> Option<usize> {
        for (i, url) in self.client_urls().iter().enumerate() {
            let Ok(mut c) = etcd_client::Client::connect([url], None).await else {
                continue;
            };
            if let Ok(s) = c.status().await {
                if s.leader() != 0 && s.header().map(|h| h.member_id()) == Some(s.leader()) {
                    return Some(i);
                }
            }
        }
        None
    }
}

impl Drop for Members {
    fn drop(&mut self) {
        for c in self.children.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // `ip netns exec` leaves etcd as its child's image (exec): killing the child
        // killed etcd. The links go with their namespaces.
        for i in 0..3 {
            let _ = Command::new("ip")
                .args(["netns", "del", &self.ns(i)])
                .status();
        }
        for i in 0..3 {
            let _ = Command::new("ip")
                .args(["link", "del", &format!("{}h{i}", self.tag)])
                .status();
        }
    }
}
