//! Headless Chromium driven over WebDriver (Debian's chromium and chromium-driver):
//! chromedriver on a free loopback port, one session with a fresh profile, spoken to
//! over plain HTTP/1.1 with JSON bodies.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A browser session, closed (with its driver) when dropped.
pub struct Browser {
    driver: Child,
    addr: String,
    session: String,
    _profile: tempfile::TempDir,
}

/// How long one driver call may take (a page load included).
const CALL: Duration = Duration::from_secs(60);

/// One request to the driver; the answer's `value`, or its error as text.
async fn call(addr: &str, method: &str, path: &str, body: Option<&Value>) -> Result<Value, String> {
    tokio::time::timeout(CALL, call_once(addr, method, path, body))
        .await
        .unwrap_or_else(|_| Err(format!("{method} {path}: no answer in {CALL:?}")))
}

async fn call_once(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<Value, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect to chromedriver at {addr}: {e}"))?;
    let body = body.map(Value::to_string).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    // chromedriver keeps the connection open whatever the request says: the answer
    // ends where its Content-Length says.
    let mut out = Vec::new();
    let mut buf = [0u8; 16384];
    let (head, body) = loop {
        let n = s.read(&mut buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err(format!("{method} {path}: the driver closed the connection"));
        }
        out.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&out).to_string();
        let Some((head, rest)) = text.split_once("\r\n\r\n") else {
            continue;
        };
        let length = head.lines().find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse::<usize>().ok())?
        });
        match length {
            Some(len) if rest.len() >= len => break (head.to_string(), rest[..len].to_string()),
            Some(_) => continue,
            None => return Err(format!("{method} {path}: no Content-Length in {head}")),
        }
    };
    let v: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
    let value = v.get("value").cloned().unwrap_or(Value::Null);
    if head.starts_with("HTTP/1.1 200") {
        Ok(value)
    } else {
        Err(format!("{method} {path}: {head}: {value}"))
    }
}

impl Browser {
    /// Starts chromedriver and a headless Chromium session.
    pub async fn start(width: u32, height: u32) -> Browser {
        let driver_bin = crate::common::need("chromedriver");
        let chromium = crate::common::need("chromium");
        let port = crate::common::free_port();
        let profile = tempfile::tempdir().unwrap();
        let log = profile.path().join("chromedriver.log");
        // In a process group of its own, which the Chromium it starts joins: dropped,
        // the browser ends the whole group.
        use std::os::unix::process::CommandExt;
        let driver = Command::new(driver_bin)
            .process_group(0)
            .arg(format!("--port={port}"))
            .arg(format!("--log-path={}", log.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let addr = format!("127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match call(&addr, "GET", "/status", None).await {
                Ok(v) if v["ready"] == json!(true) => break,
                _ if Instant::now() > deadline => panic!("chromedriver did not start"),
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        let which = std::env::var_os("PATH")
            .and_then(|p| {
                std::env::split_paths(&p)
                    .map(|d| d.join(chromium))
                    .find(|f| f.is_file())
            })
            .unwrap();
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": which,
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-background-networking", "--disable-component-update",
                    "--disable-sync", "--no-first-run", "--disable-extensions",
                    format!("--user-data-dir={}", profile.path().join("profile").display()),
                    format!("--window-size={width},{height}"),
                ]
            }
        }}});
        let mut session = None;
        // A first start on a cold machine can take a while.
        for _ in 0..3 {
            match call(&addr, "POST", "/session", Some(&caps)).await {
                Ok(v) => {
                    session = v["sessionId"].as_str().map(str::to_string);
                    break;
                }
                Err(e) => eprintln!("chromium session: {e}"),
            }
        }
        let session = session.expect("a Chromium session");
        Browser {
            driver,
            addr,
            session,
            _profile: profile,
        }
    }

    async fn session(&self, method: &str, path: &str, body: Value) -> Result<Value, String> {
        let path = format!("/session/{}{path}", self.session);
        let body = (method == "POST").then_some(body);
        call(&self.addr, method, &path, body.as_ref()).await
    }

    /// Opens `url` and waits for it to load.
    pub async fn open(&self, url: &str) {
        self.session("POST", "/url", json!({ "url": url }))
            .await
            .unwrap_or_else(|e| panic!("open {url}: {e}"));
    }

    /// Runs `script` (a function body; `return` gives the answer) in the page.
    pub async fn eval(&self, script: &str) -> Value {
        self.session(
            "POST",
            "/execute/sync",
            json!({ "script": script, "args": [] }),
        )
        .await
        .unwrap_or_else(|e| panic!("script {script}: {e}"))
    }

    /// The page's visible text.
    pub async fn text(&self) -> String {
        self.eval("return document.body ? document.body.innerText : '';")
            .await
            .as_str()
            .unwrap_or("")
            .to_string()
    }

    /// Waits until `script` answers `true`, or panics with `what` (and the page's text).
    pub async fn wait(&self, what: &str, timeout: Duration, script: &str) -> Duration {
        let start = Instant::now();
        loop {
            if self.eval(script).await == json!(true) {
                return start.elapsed();
            }
            if start.elapsed() > timeout {
                panic!(
                    "timed out after {timeout:?} waiting for {what}; the page says:\n{}",
                    self.text().await
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// A PNG of the window.
    pub async fn screenshot(&self) -> Vec<u8> {
        use base64::Engine;
        let v = self
            .session("GET", "/screenshot", Value::Null)
            .await
            .unwrap();
        base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap_or(""))
            .unwrap()
    }
}

/// `DELETE /session/ID` with a bounded wait, without a runtime (a drop may run in a
/// panicking test): chromedriver then quits its Chromium.
fn delete_session(addr: &str, session: &str) -> std::io::Result<()> {
    use std::io::{Read, Write};
    let bound = Duration::from_secs(10);
    let mut s =
        std::net::TcpStream::connect_timeout(&addr.parse().map_err(std::io::Error::other)?, bound)?;
    s.set_read_timeout(Some(bound))?;
    s.set_write_timeout(Some(bound))?;
    write!(
        s,
        "DELETE /session/{session} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    )?;
    // The status line is enough: the session is closed before it is sent.
    let mut head = [0u8; 64];
    let _ = s.read(&mut head)?;
    Ok(())
}

impl Drop for Browser {
    /// Ends the session, then whatever is left of the driver's process group and of
    /// this profile's Chromium (a test leaves no browser running, pass or fail).
    fn drop(&mut self) {
        let _ = delete_session(&self.addr, &self.session);
        let group = format!("-{}", self.driver.id());
        let _ = Command::new("kill")
            .args(["-KILL", "--", &group])
            .stderr(Stdio::null())
            .status();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        let profile = self._profile.path().display().to_string();
        let _ = Command::new("pkill")
            .args(["-KILL", "-f", &profile])
            .status();
    }
}
