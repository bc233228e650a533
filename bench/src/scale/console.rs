//! Step 5: `moord console` starting on the scaled store: until it has listed every
//! kind it shows, its memory then and after serving pages, and the server's time per
//! page (its `Server-Timing`) and the wall time, for the pages that scan the most.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use tokio::process::Command;

use crate::cluster::{free_port, Bins, Proc};

/// The console at scale.
#[derive(Debug, Serialize, Default, Clone)]
pub struct ConsoleRun {
    /// From start until /healthz answers 200 (every kind listed).
    pub ready_s: f64,
    /// RSS then, and after the pages below were served (and its peak).
    pub ready_rss_mib: f64,
    pub served_rss_mib: f64,
    pub peak_rss_mib: f64,
    /// Per page: the median over its fetches.
    pub pages: BTreeMap<String, PageTime>,
}

/// One page's figures.
#[derive(Debug, Serialize, Default, Clone)]
pub struct PageTime {
    /// The server's time to write it (median), ms.
    pub server_ms: f64,
    /// Request to last byte on loopback (median), ms.
    pub wall_ms: f64,
    pub bytes: usize,
}

/// How many times each page is fetched.
const FETCHES: usize = 7;

/// GETs `path`; the status line, the server's time and the body.
async fn get(port: u16, path: &str) -> anyhow::Result<(String, f64, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut buf)).await??;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").context("no end of headers")?;
    let server = head
        .lines()
        .find_map(|l| l.strip_prefix("server-timing: render;dur="))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(f64::NAN);
    let status = head.lines().next().unwrap_or("").to_string();
    Ok((status, server, body.to_string()))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The first `/volumes/NS/NAME` link of a page.
fn first_volume(page: &str) -> Option<String> {
    let at = page.find("href=\"/volumes/")? + "href=\"".len();
    let rest = &page[at..];
    Some(rest[..rest.find('"')?].to_string())
}

/// Runs the console on the store at `url` and measures it.
pub async fn measure(
    bins: &Bins,
    url: &str,
    dir: &Path,
    claims: usize,
    long: Duration,
) -> anyhow::Result<Option<ConsoleRun>> {
    let port = free_port();
    let started = Instant::now();
    let mut cmd = Command::new(bins.dir.join("moord"));
    cmd.args(["console", "--etcd", url])
        .arg(format!("--listen=127.0.0.1:{port}"));
    let mut proc = Proc::spawn("console", &mut cmd, &dir.join("console.log"))?;
    loop {
        if let Ok((status, _, _)) = get(port, "/healthz").await {
            if status.contains(" 200 ") {
                break;
            }
        }
        // A build from before `moord console` (a baseline of bench/compare.sh): the
        // step is skipped, not waited for.
        if proc.exited() {
            crate::step("scale: this build has no console; skipped");
            return Ok(None);
        }
        anyhow::ensure!(
            started.elapsed() < long,
            "the console did not list the store in {long:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ready_s = started.elapsed().as_secs_f64();
    let (ready_rss_mib, _) = proc.memory_mib();
    let (_, _, first) = get(port, "/volumes").await?;
    let volume = first_volume(&first).context("no volume on the first page")?;
    let name = volume.rsplit('/').next().unwrap_or("").to_string();
    let pages: Vec<(&str, String)> = vec![
        ("overview (counts, everything waiting)", "/".into()),
        ("volumes, first page", "/volumes".into()),
        (
            "volumes, a page halfway in",
            format!(
                "/volumes?after=volumes%2Fdefault%2F{}",
                super::volume_name(claims / 2)
            ),
        ),
        (
            "volumes, filtered by name (one match)",
            format!("/volumes?name={name}"),
        ),
        (
            "volumes, filtered by label (no match)",
            "/volumes?label=app%3Dnone".into(),
        ),
        ("a volume's page", volume.clone()),
        ("allocations, first page", "/allocations".into()),
        ("a node's page", "/nodes/sn0000".into()),
    ];
    let mut out = BTreeMap::new();
    for (what, path) in pages {
        let mut server = Vec::new();
        let mut wall = Vec::new();
        let mut bytes = 0;
        for i in 0..FETCHES {
            // A parameter no page reads, so that each fetch is written, not served
            // from the console's render cache.
            let sep = if path.contains('?') { '&' } else { '?' };
            let fetched = format!("{path}{sep}fetch={i}");
            let t = Instant::now();
            let (status, ms, body) = get(port, &fetched).await?;
            anyhow::ensure!(status.contains(" 200 "), "GET {fetched}: {status}");
            wall.push(t.elapsed().as_secs_f64() * 1000.0);
            server.push(ms);
            bytes = body.len();
        }
        out.insert(
            what.to_string(),
            PageTime {
                server_ms: median(server),
                wall_ms: median(wall),
                bytes,
            },
        );
    }
    let (served_rss_mib, peak_rss_mib) = proc.memory_mib();
    proc.terminate().await;
    Ok(Some(ConsoleRun {
        ready_s,
        ready_rss_mib,
        served_rss_mib,
        peak_rss_mib,
        pages: out,
    }))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_first_volume_link_is_found() {
        let page = "<a href=\"/nodes/x\">x</a><a href=\"/volumes/default/sc-1\">sc-1</a>";
        assert_eq!(
            super::first_volume(page).as_deref(),
            Some("/volumes/default/sc-1")
        );
        assert_eq!(super::median(vec![3.0, 1.0, 2.0]), 2.0);
    }
}
