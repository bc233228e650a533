//! A TCP fault proxy between one moor process and etcd: the harness's partition.
//!
//! Each proxy listens on its own loopback port and forwards every connection to the
//! upstream address. [`Proxy::cut`] partitions: bytes stop moving both ways on every
//! connection, open or new, as when packets are dropped. Nothing is refused or reset,
//! so the process sees requests that hang, not errors. [`Proxy::heal`] lets the held
//! bytes through again (a partition healed before TCP gave up); connections the
//! process closed meanwhile then close.
//!
//! The proxies run on a runtime of their own, on its own threads: a test that blocks
//! its thread (a `moorctl` run, a SIGSTOP) never stalls the traffic they carry.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::OnceLock;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("fault-proxy")
            .enable_all()
            .build()
            .expect("the proxies' runtime")
    })
}

/// One proxy; dropped, it stops accepting and its connections end.
pub struct Proxy {
    addr: SocketAddr,
    cut: Switch,
    task: tokio::task::JoinHandle<()>,
}

/// Cuts and heals one proxy; cheap to clone and usable from any thread.
#[derive(Clone)]
pub struct Switch(std::sync::Arc<watch::Sender<bool>>);

impl Switch {
    pub fn cut(&self) {
        self.0.send_replace(true);
    }

    pub fn heal(&self) {
        self.0.send_replace(false);
    }

    pub fn is_cut(&self) -> bool {
        *self.0.borrow()
    }
}

impl Proxy {
    /// A proxy to `upstream` (`host:port`, or a URL `http://host:port`).
    pub fn start(upstream: &str) -> Proxy {
        let upstream = upstream
            .trim_start_matches("http://")
            .trim_start_matches("https://")
            .to_string();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("proxy address");
        let (cut, cut_rx) = watch::channel(false);
        let task = runtime().spawn(async move {
            let listener = TcpListener::from_std(listener).expect("tokio listener");
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let (upstream, cut) = (upstream.clone(), cut_rx.clone());
                conns.spawn(async move { forward(client, &upstream, cut).await });
                while conns.try_join_next().is_some() {}
            }
        });
        Proxy {
            addr,
            cut: Switch(std::sync::Arc::new(cut)),
            task,
        }
    }

    /// The URL a moor process is given as its etcd endpoint.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Partitions: no byte moves either way until [`Proxy::heal`].
    pub fn cut(&self) {
        self.cut.cut();
    }

    pub fn heal(&self) {
        self.cut.heal();
    }

    pub fn is_cut(&self) -> bool {
        self.cut.is_cut()
    }

    /// A handle that cuts and heals this proxy from anywhere.
    pub fn switch(&self) -> Switch {
        self.cut.clone()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Waits while the partition holds.
async fn passable(cut: &mut watch::Receiver<bool>) {
    let _ = cut.wait_for(|c| !*c).await;
}

async fn forward(client: TcpStream, upstream: &str, mut cut: watch::Receiver<bool>) {
    // A connection made during a partition hangs before it reaches etcd.
    passable(&mut cut).await;
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let up = pump(cr, sw, cut.clone());
    let down = pump(sr, cw, cut);
    // Either side closing ends the connection.
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}

/// Copies `from` to `to`, holding whatever it has while the partition holds.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut cut: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        passable(&mut cut).await;
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // Read before the cut, delivered after it heals: dropped packets are sent again.
        passable(&mut cut).await;
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
