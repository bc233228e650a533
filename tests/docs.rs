//! The operator's pages are executable (issue 78, item 5): every code block of the pages
//! in [`PAGES`] runs, in page order as a reader would run it, against a real cluster, or
//! carries a marker saying why it does not, and the test lists those.
//!
//! A block is an indented code block (four spaces past its paragraph or list item) or a
//! fenced one. Just before it, an HTML comment at the paragraph's indentation may say
//! what to do with it (invisible on a rendered page):
//! - `<!-- docs: skip REASON -->`: not run; the reason is listed.
//! - `<!-- docs: elsewhere FILE -->`: run as written by FILE (a test or CI's script):
//!   every command line of the block must appear in FILE.
//! - `<!-- docs: output -->`: what the run block before it prints: each line must appear
//!   in that output, in order (spaces collapsed, the block's names replaced as in its
//!   script; a line `...` marks lines left out).
//! - `<!-- docs: on-etcd -->`: run against a plain etcd started by the test rather than
//!   `moord dev`'s store.
//! - `<!-- docs: own-etcd -->`: the block starts its own etcd.
//!
//! Without a marker, a block whose first line is `kind: ...` is a manifest and goes to
//! `moorctl apply -f -`; any other block is a bash script (`-e -o pipefail`), run in a
//! scratch directory holding `deploy/` and `target/debug/` (the test's binaries, also
//! first on PATH), with MOOR_ENDPOINTS and ETCDCTL_ENDPOINTS naming the store, in a
//! process group of its own that is killed when the script ends (what it started with
//! `&`). The pages' machine-wide names are replaced by the test's own ([`places`]): a
//! page's `127.0.0.1:2379` is the store the block runs against, its other ports free
//! ones, its /etc, /var/lib and /tmp paths directories below the scratch directory.
//! Each must succeed within [`BLOCK_BOUND`].

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::dev::Dev;
use common::{bin, free_port, wait_for, Etcd};

/// The pages whose blocks are run: an operator's guide page joins this list.
const PAGES: &[&str] = &["README.md", "deploy/README.md", "UPGRADING.md"];

/// How long one block may take (a first `alloc run` publishes a volume).
const BLOCK_BOUND: Duration = Duration::from_secs(180);

#[derive(Debug, Clone, PartialEq)]
enum Marker {
    Skip(String),
    Elsewhere(String),
    Output,
    OnEtcd,
    OwnEtcd,
}

#[derive(Debug)]
struct Block {
    page: String,
    /// The line of the page the block starts on (1-based).
    line: usize,
    text: String,
    marker: Option<Marker>,
}

fn marker(comment: &str) -> Result<Marker, String> {
    let body = comment
        .trim()
        .strip_prefix("<!-- docs:")
        .and_then(|b| b.strip_suffix("-->"))
        .ok_or("a docs marker is one line: <!-- docs: WHAT -->")?
        .trim();
    let (word, rest) = body.split_once(' ').unwrap_or((body, ""));
    let rest = rest.trim().to_string();
    match word {
        "skip" if !rest.is_empty() => Ok(Marker::Skip(rest)),
        "skip" => Err("a skip marker says why".into()),
        "elsewhere" if !rest.is_empty() => Ok(Marker::Elsewhere(rest)),
        "elsewhere" => Err("an elsewhere marker names the file that runs the block".into()),
        "output" => Ok(Marker::Output),
        "on-etcd" => Ok(Marker::OnEtcd),
        "own-etcd" => Ok(Marker::OwnEtcd),
        other => Err(format!("unknown docs marker {other:?}")),
    }
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// The code blocks of a markdown page with their markers, or what is wrong with them
/// (a marker that no block follows, one that does not parse).
fn blocks(page: &str, text: &str) -> Result<Vec<Block>, Vec<String>> {
    let mut found = Vec::new();
    let mut errors = Vec::new();
    // The indentation of the paragraph or list item's content the lines belong to.
    let mut base = 0;
    let mut prev_blank = true;
    let mut pending: Option<(usize, Marker)> = None;
    let mut lines = text.lines().enumerate().peekable();
    while let Some((i, line)) = lines.next() {
        let trimmed = line.trim();
        if trimmed.is_empty() {
            prev_blank = true;
            continue;
        }
        let at = indent(line);
        let fence = trimmed.starts_with("```");
        if fence || (prev_blank && at >= base + 4) {
            let mut body = Vec::new();
            if fence {
                for (_, l) in lines.by_ref() {
                    if l.trim().starts_with("```") {
                        break;
                    }
                    body.push(l.get(at..).unwrap_or(l.trim_start()).to_string());
                }
            } else {
                let cut = base + 4;
                body.push(line[cut..].to_string());
                while let Some((_, l)) = lines.peek() {
                    if l.trim().is_empty() {
                        body.push(String::new());
                    } else if indent(l) >= cut {
                        body.push(l[cut..].to_string());
                    } else {
                        break;
                    }
                    lines.next();
                }
                while body.last().is_some_and(|l| l.is_empty()) {
                    body.pop();
                }
            }
            found.push(Block {
                page: page.to_string(),
                line: i + 1,
                text: body.join("\n") + "\n",
                marker: pending.take().map(|(_, m)| m),
            });
            prev_blank = false;
            continue;
        }
        if let Some((at_line, _)) = pending.take() {
            errors.push(format!(
                "{page}:{at_line}: a docs marker with no code block after it"
            ));
        }
        if trimmed.starts_with("<!-- docs:") {
            match marker(trimmed) {
                Ok(m) => pending = Some((i + 1, m)),
                Err(e) => errors.push(format!("{page}:{}: {e}", i + 1)),
            }
        } else if let Some(rest) = trimmed.strip_prefix("- ").or(trimmed.strip_prefix("* ")) {
            base = at + (trimmed.len() - rest.len());
        } else if at == 0 {
            base = 0;
        }
        prev_blank = false;
    }
    if let Some((at_line, _)) = pending {
        errors.push(format!(
            "{page}:{at_line}: a docs marker with no code block after it"
        ));
    }
    if errors.is_empty() {
        Ok(found)
    } else {
        Err(errors)
    }
}

/// Spaces collapsed: a page's aligned columns match the output's.
fn collapsed(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Each line of `shown` that is not `...` appears, in order, in `out`.
fn shows(shown: &str, out: &str) -> Result<(), String> {
    let out = collapsed(out);
    let mut from = 0;
    for line in shown.lines().map(collapsed).filter(|l| !l.is_empty()) {
        if line == "..." {
            continue;
        }
        match out[from..].find(&line) {
            Some(at) => from += at + line.len(),
            None => return Err(format!("the page shows {line:?}, which is not printed")),
        }
    }
    Ok(())
}

/// The command lines of a shell block: comments and trailing comments dropped.
fn command_lines(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.split(" #").next().unwrap_or(l).trim().to_string())
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect()
}

fn is_manifest(text: &str) -> bool {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .is_some_and(|l| l.starts_with("kind:"))
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Where the test's binaries are (`target/debug` to a page).
fn bin_dir() -> PathBuf {
    bin("moorctl").parent().unwrap().to_path_buf()
}

/// Pairs of a page's name and the test's own.
type Names = Vec<(String, String)>;

/// The page's machine-wide names and the test's own for one block: `store` is the
/// address of the etcd the block runs against (or a free port, for a block that
/// starts its own).
fn places(scratch: &Path, store: &str) -> Names {
    let port = || format!("127.0.0.1:{}", free_port());
    let under = |p: &str| scratch.join(p).to_string_lossy().into_owned();
    vec![
        ("127.0.0.1:2379".into(), store.to_string()),
        ("127.0.0.1:2380".into(), port()),
        ("127.0.0.1:9090".into(), port()),
        ("/etc/moor".into(), under("etc/moor")),
        ("/var/lib/etcd".into(), under("var/lib/etcd")),
        ("/tmp/moor".into(), under("tmp/moor")),
    ]
}

/// Runs `script` with bash in `scratch`, in a process group killed when it ends.
/// A block that starts its own etcd (`own`) runs as in a newcomer's shell: no
/// MOOR_ENDPOINTS or ETCDCTL_ENDPOINTS (its commands name their endpoints, or their
/// moorctl configuration does).
fn run_script(
    scratch: &Path,
    script: &str,
    store: &str,
    stdin: Option<&str>,
    own: bool,
) -> (bool, String) {
    use std::io::Write;
    use std::os::unix::process::CommandExt;
    let log = scratch.join("block.log");
    let out = std::fs::File::create(&log).unwrap();
    let path = format!(
        "{}:{}",
        bin_dir().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let endpoint = format!("http://{store}");
    let mut cmd = Command::new("bash");
    cmd.args(["-e", "-o", "pipefail", "-c", script])
        .current_dir(scratch)
        .env("PATH", path);
    if own {
        cmd.env_remove("MOOR_ENDPOINTS")
            .env_remove("ETCDCTL_ENDPOINTS");
    } else {
        cmd.env("MOOR_ENDPOINTS", &endpoint)
            .env("ETCDCTL_ENDPOINTS", &endpoint);
    }
    let mut child = cmd
        .env("ETCDCTL_API", "3")
        .env_remove("KEEP")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .process_group(0)
        .spawn()
        .expect("bash runs");
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().unwrap();
        pipe.write_all(input.as_bytes()).unwrap();
    }
    let deadline = Instant::now() + BLOCK_BOUND;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // What the block started in the background goes with it.
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", child.id())])
        .stderr(Stdio::null())
        .status();
    let _ = child.wait();
    let mut text = std::fs::read_to_string(&log).unwrap_or_default();
    if status.is_none() {
        text += &format!("\n(still running after {BLOCK_BOUND:?}: killed)");
    }
    (status.is_some_and(|s| s.success()), text)
}

/// The scratch directory a reader's shell would be in: the repository's `deploy/` and
/// the test's binaries as `target/debug/`, nothing the blocks write lands in the tree.
fn scratch_dir(tmp: &Path) -> PathBuf {
    let scratch = tmp.join("reader");
    std::fs::create_dir_all(scratch.join("target")).unwrap();
    std::os::unix::fs::symlink(root().join("deploy"), scratch.join("deploy")).unwrap();
    std::os::unix::fs::symlink(bin_dir(), scratch.join("target/debug")).unwrap();
    scratch
}

struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        common::unmount_below(&self.0);
    }
}

#[test]
fn the_marker_grammar_finds_blocks_in_lists_and_fences_and_refuses_strays() {
    let page = "Text.\n\n    echo top\n\n- item\n  more\n\n  <!-- docs: skip needs X -->\n\n      kind: Volume\n      spec: {}\n\n<!-- docs: output -->\n\n```\nhello\n```\n";
    let found = blocks("p.md", page).unwrap();
    let summary: Vec<(usize, &str, Option<Marker>)> = found
        .iter()
        .map(|b| (b.line, b.text.as_str(), b.marker.clone()))
        .collect();
    assert_eq!(
        summary,
        vec![
            (3, "echo top\n", None),
            (
                10,
                "kind: Volume\nspec: {}\n",
                Some(Marker::Skip("needs X".into()))
            ),
            (15, "hello\n", Some(Marker::Output)),
        ]
    );
    let errors = blocks(
        "p.md",
        "<!-- docs: skip -->\n\n    x\n\n<!-- docs: output -->\n\nText.\n",
    )
    .unwrap_err();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors[0].contains("says why"), "{errors:?}");
    assert!(errors[1].contains("no code block"), "{errors:?}");
    assert!(shows("a  b\n...\nc\n", "x a b y\nz c").is_ok());
    assert!(shows("c\na b\n", "a b c").is_err());
}

#[tokio::test]
async fn every_block_of_the_operator_s_pages_runs_or_says_why_not() {
    let mut all = Vec::new();
    let mut errors = Vec::new();
    for page in PAGES {
        let text = std::fs::read_to_string(root().join(page)).unwrap();
        match blocks(page, &text) {
            Ok(b) => all.extend(b),
            Err(e) => errors.extend(e),
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    assert!(all.iter().any(|b| b.marker.is_none()), "no block to run");

    let tmp = tempfile::tempdir().unwrap();
    // Dropped after moord dev and etcd, pass or fail: what the blocks mounted goes.
    let _unmount = Unmount(tmp.path().to_path_buf());
    let scratch = scratch_dir(tmp.path());
    let port = free_port();
    let dev_store = format!("127.0.0.1:{port}");
    let _dev = Dev::start(&tmp.path().join("dev"), port);
    wait_for(
        "moord dev's plugin on node local",
        Duration::from_secs(90),
        || {
            let scratch = scratch.clone();
            let store = dev_store.clone();
            async move {
                let (_, out) = run_script(&scratch, "moorctl plugin status", &store, None, false);
                out.contains("1/1")
            }
        },
    )
    .await;
    let mut etcd: Option<Etcd> = None;

    let mut not_run = Vec::new();
    let mut ran = 0;
    // The last block run: where, what it printed, the names it ran with.
    let mut last: Option<(String, String, Names)> = None;
    let mut failures = Vec::new();
    for b in &all {
        let at = format!("{}:{}", b.page, b.line);
        match &b.marker {
            Some(Marker::Skip(why)) => not_run.push(format!("{at}: {why}")),
            Some(Marker::Elsewhere(file)) => {
                let runner = std::fs::read_to_string(root().join(file))
                    .unwrap_or_else(|e| panic!("{at}: the marker names {file}: {e}"));
                for line in command_lines(&b.text) {
                    if !runner.contains(&line) {
                        failures.push(format!("{at}: {file} does not run {line:?}"));
                    }
                }
                not_run.push(format!("{at}: run as written by {file}"));
            }
            Some(Marker::Output) => match &last {
                Some((from, out, names)) => {
                    let shown = names
                        .iter()
                        .fold(b.text.clone(), |t, (from, to)| t.replace(from, to));
                    if let Err(e) = shows(&shown, out) {
                        failures.push(format!("{at} (output of {from}): {e}\n--- printed\n{out}"));
                    }
                }
                None => failures.push(format!("{at}: an output block with no run block before it")),
            },
            marker => {
                let store = match marker {
                    Some(Marker::OnEtcd) => {
                        if etcd.is_none() {
                            etcd = Some(Etcd::start().await);
                        }
                        etcd.as_ref()
                            .unwrap()
                            .client_url
                            .trim_start_matches("http://")
                            .to_string()
                    }
                    Some(Marker::OwnEtcd) => format!("127.0.0.1:{}", free_port()),
                    _ => dev_store.clone(),
                };
                let names = places(&scratch, &store);
                let own = matches!(marker, Some(Marker::OwnEtcd));
                let (ok, out) = if is_manifest(&b.text) {
                    run_script(&scratch, "moorctl apply -f -", &store, Some(&b.text), own)
                } else {
                    let script = names
                        .iter()
                        .fold(b.text.clone(), |t, (from, to)| t.replace(from, to));
                    run_script(&scratch, &script, &store, None, own)
                };
                ran += 1;
                if !ok {
                    failures.push(format!("{at} failed:\n{}\n--- printed\n{out}", b.text));
                }
                last = Some((at, out, names));
            }
        }
    }
    println!(
        "{ran} blocks ran; {} not run here:\n{}",
        not_run.len(),
        not_run.join("\n")
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
