//! `moord dev`: moor on one machine in one process: the embedded store on a loopback
//! port, the controller, an agent for node `local`, and moor-hostpath as a child on a
//! unix socket in the data directory. Everything lives in the data directory and
//! survives a restart.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use moor::api::{Node, NodeName};
use moor_embedded::EmbeddedStore;
use tokio_util::sync::CancellationToken;

/// The node name the dev agent uses.
pub const NODE: &str = "local";
/// The plugin id the dev agent hosts.
pub const PLUGIN: &str = "hostpath.moor.dev";

/// Flags of `moord dev`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Where the store, the plugin's volumes, the agent's state and the mounts live.
    #[arg(long, default_value = ".moor-dev")]
    pub data_dir: PathBuf,
    /// The embedded store's address (what moorctl's --endpoints points at).
    #[arg(long, default_value = "127.0.0.1:2379")]
    pub listen: String,
    /// Serve the store on a non-loopback address without TLS.
    #[arg(long)]
    pub insecure_listen: bool,
    /// TLS for the store's clients (--cert, --key, --client-ca); moord dev's own
    /// controller and agent then reach it on a second, loopback-only listener.
    #[command(flatten)]
    pub tls: moor_embedded::TlsArgs,
    /// The moor-hostpath binary (default: next to moord).
    #[arg(long)]
    pub hostpath_bin: Option<PathBuf>,
    /// Bind-mount for real (default: when running as root).
    #[arg(long)]
    pub mount: Option<bool>,
    /// Serve the controller's /metrics and /healthz here.
    #[arg(long)]
    pub http: Option<std::net::SocketAddr>,
    /// Serve the web console here (loopback; when the port is taken, another one is
    /// picked and printed).
    #[arg(long, default_value = "127.0.0.1:8480")]
    pub console: std::net::SocketAddr,
    /// Serve the Docker volume-plugin protocol on this socket (as `moord agent
    /// --volume-plugin`, repeatable, `[ENGINE=]PATH`): docker=/run/docker/plugins/moor.sock.
    #[arg(long, value_name = "[ENGINE=]PATH")]
    pub volume_plugin: Vec<String>,
}

#[derive(Parser)]
struct ControllerArgv {
    #[command(flatten)]
    args: crate::controller::Args,
}

#[derive(Parser)]
struct AgentArgv {
    #[command(flatten)]
    args: crate::agent::Args,
}

fn hostpath_bin(args: &Args) -> anyhow::Result<PathBuf> {
    if let Some(bin) = &args.hostpath_bin {
        return Ok(bin.clone());
    }
    let exe = std::env::current_exe().context("locating moord")?;
    let bin = exe.with_file_name("moor-hostpath");
    if !bin.exists() {
        anyhow::bail!(
            "{} is missing: build it with `cargo build --workspace --bins`, or pass --hostpath-bin",
            bin.display()
        );
    }
    Ok(bin)
}

fn absolute(dir: &Path) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    dir.canonicalize()
        .with_context(|| format!("resolving {}", dir.display()))
}

/// Runs everything until `shutdown`.
pub async fn run(args: Args, shutdown: CancellationToken) -> anyhow::Result<()> {
    let dir = absolute(&args.data_dir)?;
    let bin = hostpath_bin(&args)?;
    let root = std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false);
    let mount = args.mount.unwrap_or(root);

    let store = EmbeddedStore::open(&dir.join("store"), 100_000)
        .with_context(|| format!("opening the store in {}", dir.join("store").display()))?;
    let tls = args.tls.config()?;
    let listener =
        match moor_embedded::bind(&args.listen, args.insecure_listen, tls.is_some()).await {
            Err(moor_embedded::ListenError::Bind(addr, e))
                if e.kind() == std::io::ErrorKind::AddrInUse =>
            {
                return Err(
                    anyhow::Error::new(moor_embedded::ListenError::Bind(addr, e)).context(
                        "the address is in use (another etcd, or moord dev, there?); use --listen",
                    ),
                );
            }
            other => other?,
        };
    let store_stop = CancellationToken::new();
    let (url, store_task) = match tls {
        None => (
            format!("http://{}", listener.local_addr()?),
            tokio::spawn(moor_embedded::serve(
                store,
                listener,
                None,
                store_stop.clone(),
            )),
        ),
        Some(tls) => {
            tracing::info!(addr = %listener.local_addr()?, "serving the store with TLS");
            let own = moor_embedded::bind("127.0.0.1:0", false, false).await?;
            let url = format!("http://{}", own.local_addr()?);
            tokio::spawn(moor_embedded::serve_also(
                store.clone(),
                listener,
                Some(tls),
                store_stop.clone(),
            ));
            (
                url,
                tokio::spawn(moor_embedded::serve(store, own, None, store_stop.clone())),
            )
        }
    };

    let socket = dir.join("csi.sock");
    let plugin_stop = shutdown.child_token();
    let plugin_task = tokio::spawn(supervise_plugin(
        bin,
        socket.clone(),
        dir.join("plugin"),
        mount,
        plugin_stop.clone(),
    ));

    let mut controller = vec![
        "controller",
        "--etcd",
        &url,
        "--identity",
        "dev",
        "--leader-ttl",
        "5s",
    ];
    let http = args.http.map(|a| a.to_string());
    if let Some(http) = &http {
        controller.extend(["--http", http]);
    }
    let controller = ControllerArgv::try_parse_from(controller)?.args;
    let plugin = format!(
        "id={PLUGIN},type=monolith,endpoint=unix://{},mount-dir={}",
        socket.display(),
        dir.join("mnt").display()
    );
    let agent_dir = dir.join("agent").display().to_string();
    let mut agent_argv = vec![
        "agent".to_string(),
        "--node".into(),
        NODE.into(),
        "--etcd".into(),
        url.clone(),
        "--data-dir".into(),
        agent_dir,
        "--plugin".into(),
        plugin,
        "--leader-ttl".into(),
        "5s".into(),
    ];
    for flag in &args.volume_plugin {
        agent_argv.push(format!("--volume-plugin={flag}"));
    }
    let agent = AgentArgv::try_parse_from(agent_argv)?.args;

    let daemons = shutdown.child_token();
    let controller_task = tokio::spawn(crate::controller::run(controller, daemons.clone()));
    let agent_task = tokio::spawn(crate::agent::run(agent, daemons.clone()));
    let (console_url, console_task) = start_console(&args, &url, daemons.clone()).await?;

    // Ready once the store answers and every volume-plugin socket is bound.
    let sockets: Vec<(String, std::path::PathBuf)> = args
        .volume_plugin
        .iter()
        .filter_map(|f| crate::agent::volume_plugin::engine_socket(f).ok())
        .collect();
    let ready = async {
        wait_ready(&url, &shutdown).await?;
        for (_, path) in &sockets {
            wait_socket(path).await?;
        }
        anyhow::Ok(())
    };
    tokio::select! {
        r = ready => match r {
            Ok(()) => {
                eprintln!("\nmoor dev is ready (data in {}; bind mounts {}).", dir.display(), if mount { "on" } else { "off: not root" });
                eprintln!("  store (etcd API): {url}");
                eprintln!("  console: {console_url}");
                eprintln!("  node {NODE}, plugin {PLUGIN}");
                for (engine, path) in &sockets {
                    eprintln!("  volume-plugin endpoint for {engine}: {}", path.display());
                }
                if !sockets.is_empty() {
                    eprintln!("    (Docker finds a plugin NAME only at /run/docker/plugins/NAME.sock or through");
                    eprintln!("    /etc/docker/plugins/NAME.spec holding unix://PATH; Podman through containers.conf)");
                }
                eprintln!("  try:  export MOOR_ENDPOINTS={url}");
                eprintln!("        moorctl apply -f deploy/examples/quickstart.yaml");
                eprintln!(
                    "        moorctl alloc run web-1 --node local --volume data=web-data -- sh -c 'ls $MOOR_VOLUME_DATA'"
                );
                eprintln!("        moorctl get claims -w\n");
            }
            Err(e) => tracing::warn!(error = format!("{e:#}"), "moor dev did not become ready"),
        },
        _ = shutdown.cancelled() => {}
    }
    shutdown.cancelled().await;
    // Daemons first (they resign their leases and close their watches), then the
    // plugin, then the store.
    let (c, a, _) = tokio::join!(controller_task, agent_task, console_task);
    // Their last events, while the store still runs.
    moor::runtime::events::flush(crate::common::EVENT_GRACE).await;
    for (what, r) in [("controller", c), ("agent", a)] {
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(error = format!("{e:#}"), "{what} failed"),
            Err(e) => tracing::error!(error = %e, "{what} panicked"),
        }
    }
    plugin_stop.cancel();
    let _ = plugin_task.await;
    store_stop.cancel();
    store_task.await??;
    Ok(())
}

/// Waits (up to 30 s) until `path` is a bound unix socket.
/// Binds the console (loopback only: `moord dev` never serves it elsewhere) and starts
/// it on the store at `url`; returns its URL.
async fn start_console(
    args: &Args,
    url: &str,
    shutdown: CancellationToken,
) -> anyhow::Result<(String, tokio::task::JoinHandle<()>)> {
    anyhow::ensure!(
        args.console.ip().is_loopback(),
        "moord dev serves the console on loopback only (use `moord console` with TLS for {})",
        args.console
    );
    let listener = match tokio::net::TcpListener::bind(args.console).await {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            tokio::net::TcpListener::bind((args.console.ip(), 0)).await?
        }
        Err(e) => {
            return Err(e).with_context(|| format!("binding the console to {}", args.console))
        }
    };
    let console_url = format!("http://{}/", listener.local_addr()?);
    let store =
        moor::store::Store::connect(&[url.to_string()], moor::store::DEFAULT_PREFIX).await?;
    let listen = crate::console::ListenArgs {
        listen: listener.local_addr()?,
        tls_cert: None,
        tls_key: None,
        client_ca: None,
        token_file: None,
        people: None,
        allow_hosts: Vec::new(),
    };
    let task = tokio::spawn(async move {
        if let Err(e) = crate::console::serve(listener, &listen, store, shutdown).await {
            tracing::error!(error = format!("{e:#}"), "console failed");
        }
    });
    Ok((console_url, task))
}

async fn wait_socket(path: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the volume-plugin socket {} did not appear within 30 s",
            path.display()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Ready when the agent's Node reports the plugin healthy.
async fn wait_ready(url: &str, shutdown: &CancellationToken) -> anyhow::Result<()> {
    let store =
        moor::store::Store::connect(&[url.to_string()], moor::store::DEFAULT_PREFIX).await?;
    let node = NodeName::new(NODE)?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !shutdown.is_cancelled() {
        if let Ok(Some(n)) = store.try_get(&Node::key_for(&node)).await {
            if n.status.plugins.values().any(|p| p.healthy) {
                return Ok(());
            }
        }
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!("node {NODE} has no healthy plugin after 60 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Runs moor-hostpath, restarting it (after a second) if it exits, until `stop`.
async fn supervise_plugin(
    bin: PathBuf,
    socket: PathBuf,
    state: PathBuf,
    mount: bool,
    stop: CancellationToken,
) {
    loop {
        let mut cmd = tokio::process::Command::new(&bin);
        cmd.arg("--endpoint")
            .arg(format!("unix://{}", socket.display()))
            .args(["--node-id", NODE, "--mode", "monolith"])
            .arg("--state-dir")
            .arg(&state)
            .kill_on_drop(true);
        if !mount {
            cmd.arg("--no-mount");
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(bin = %bin.display(), error = %e, "cannot start moor-hostpath");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(5)) => continue,
                }
            }
        };
        tokio::select! {
            status = child.wait() => {
                tracing::warn!(status = ?status.ok(), "moor-hostpath exited; restarting in 1 s");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
            _ = stop.cancelled() => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                return;
            }
        }
    }
}
