//! Who may open the console: loopback by default; any other address only with TLS and
//! an access rule (client certificates signed by a CA, or a bearer token from a
//! file), checked before the console starts.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;
use tokio_rustls::server::TlsStream;

use super::state::{Scope, SCOPE};

/// The console's listening flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ListenArgs {
    /// Where to serve the console. Any address but loopback needs --tls-cert,
    /// --tls-key and an access rule (--client-ca or --token-file).
    #[arg(long, default_value = "127.0.0.1:8480")]
    pub listen: SocketAddr,
    /// Serve HTTPS with this certificate chain (PEM).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Admit only browsers presenting a client certificate signed by this CA (PEM).
    #[arg(long, requires = "tls_cert")]
    pub client_ca: Option<PathBuf>,
    /// Admit only requests carrying the token this file holds (its first line): as
    /// `Authorization: Bearer TOKEN`, or once as `?token=TOKEN`, which sets a cookie.
    /// With --people: a line `TOKEN NAME` per person.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Serve people, each shown only what their role reads (issue 79): entries
    /// `NAME=ROLE[:NS,...]` as roles.sh's PEOPLE takes them (`view:NS`, `edit:NS`: those
    /// namespaces' objects and the cluster's nodes, plugins and cordons; `operator`:
    /// everything), one or more per line, `#` comments. Each person is named by their
    /// token (--token-file lines `TOKEN NAME`); anyone else is refused.
    #[arg(long, requires = "token_file")]
    pub people: Option<PathBuf>,
    /// A name browsers reach the console by (repeatable), matched against each
    /// request's Host. By default: `localhost` with the console's port on loopback, the
    /// certificate's DNS names with TLS. An address (IP literal) is always accepted: no
    /// page of another name can send it.
    #[arg(long = "allow-host", value_name = "NAME")]
    pub allow_hosts: Vec<String>,
}

impl ListenArgs {
    /// Refuses an address the flags do not protect.
    pub fn check(&self) -> anyhow::Result<()> {
        if self.listen.ip().is_loopback() {
            return Ok(());
        }
        if self.tls_cert.is_none() {
            bail!(
                "refusing to serve the console on {} without TLS: give --tls-cert and --tls-key \
                 and an access rule (--client-ca or --token-file), or listen on loopback",
                self.listen
            );
        }
        if self.client_ca.is_none() && self.token_file.is_none() {
            bail!(
                "refusing to serve the console on {} without an access rule: give --client-ca \
                 (client certificates) or --token-file",
                self.listen
            );
        }
        Ok(())
    }

    /// The tokens the console admits and what each may see, if it asks for one.
    pub fn tokens(&self) -> anyhow::Result<Option<Arc<Tokens>>> {
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the token file {}", path.display()))?;
        let Some(people_file) = &self.people else {
            let token = text.lines().next().unwrap_or("").trim();
            if token.len() < 16 {
                bail!(
                    "the token in {} is shorter than 16 characters",
                    path.display()
                );
            }
            return Ok(Some(Arc::new(Tokens(vec![(token.into(), Scope::All)]))));
        };
        let people = std::fs::read_to_string(people_file)
            .with_context(|| format!("reading the people file {}", people_file.display()))?;
        let people = parse_people(&people)
            .with_context(|| format!("the people file {}", people_file.display()))?;
        let mut tokens = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = format!("{}:{}", path.display(), i + 1);
            let (token, name) = line
                .split_once(char::is_whitespace)
                .map(|(t, n)| (t, n.trim()))
                .with_context(|| format!("{at}: with --people, each line is TOKEN NAME"))?;
            if token.len() < 16 {
                bail!("{at}: the token is shorter than 16 characters");
            }
            let scope = people
                .get(name)
                .with_context(|| format!("{at}: {name} is not in the people file"))?;
            tokens.push((token.into(), scope.clone()));
        }
        if tokens.is_empty() {
            bail!("{}: no token", path.display());
        }
        Ok(Some(Arc::new(Tokens(tokens))))
    }

    /// The TLS configuration, if the console serves HTTPS.
    pub fn tls(&self) -> anyhow::Result<Option<Arc<rustls::ServerConfig>>> {
        let (Some(cert), Some(key_file)) = (&self.tls_cert, &self.tls_key) else {
            return Ok(None);
        };
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let chain = CertificateDer::pem_file_iter(cert)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .with_context(|| format!("reading certificates from {}", cert.display()))?;
        let key = PrivateKeyDer::from_pem_file(key_file)
            .with_context(|| format!("reading the private key {}", key_file.display()))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .context("TLS versions")?;
        let builder = match &self.client_ca {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in CertificateDer::pem_file_iter(ca)
                    .with_context(|| format!("reading {}", ca.display()))?
                {
                    roots
                        .add(c.with_context(|| format!("reading {}", ca.display()))?)
                        .with_context(|| format!("a CA certificate in {}", ca.display()))?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    roots.into(),
                    provider,
                )
                .build()
                .context("client certificate verifier")?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_single_cert(chain, key).with_context(|| {
            format!(
                "the key {} does not fit {}",
                key_file.display(),
                cert.display()
            )
        })?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Some(Arc::new(config)))
    }
}

/// The Host names the console answers (DNS rebinding: a page of the attacker's name,
/// resolved to the console's address, reaches it in the victim's browser with the
/// attacker's name as Host, which is refused).
#[derive(Debug, Clone)]
pub struct Hosts {
    /// Names accepted with any port (lowercase, no trailing dot).
    names: Vec<String>,
    /// `localhost` is accepted with this port, on a loopback console.
    localhost_port: Option<u16>,
}

/// A Host header's name (lowercase, without a trailing dot) and port.
fn split_host(host: &str) -> (String, Option<u16>) {
    let (name, port) = if let Some(rest) = host.strip_prefix('[') {
        match rest.split_once(']') {
            Some((ip, after)) => (ip, after.strip_prefix(':')),
            None => (rest, None),
        }
    } else {
        match host.rsplit_once(':') {
            Some((n, p)) if !n.contains(':') => (n, Some(p)),
            _ => (host, None),
        }
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    (name, port.and_then(|p| p.parse().ok()))
}

impl Hosts {
    /// What a console bound to `addr` answers, given its flags and certificate.
    pub fn new(args: &ListenArgs, addr: SocketAddr) -> anyhow::Result<Hosts> {
        let mut names: Vec<String> = args
            .allow_hosts
            .iter()
            .map(|h| h.trim_end_matches('.').to_ascii_lowercase())
            .collect();
        if names.is_empty() {
            if let Some(cert) = &args.tls_cert {
                names = certificate_names(cert)?;
            }
        }
        Ok(Hosts {
            names,
            localhost_port: addr.ip().is_loopback().then_some(addr.port()),
        })
    }

    /// Whether a request with this Host (none: not a browser's) is answered.
    pub fn admits(&self, host: Option<&str>) -> bool {
        let Some(host) = host else {
            return true;
        };
        let (name, port) = split_host(host);
        if name.parse::<std::net::IpAddr>().is_ok() {
            return true;
        }
        if name == "localhost" && self.localhost_port.is_some() && port == self.localhost_port {
            return true;
        }
        self.names.contains(&name)
    }
}

/// The DNS names of the certificate chain's first certificate.
fn certificate_names(cert: &std::path::Path) -> anyhow::Result<Vec<String>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let Some(first) = CertificateDer::pem_file_iter(cert)
        .with_context(|| format!("reading certificates from {}", cert.display()))?
        .next()
    else {
        bail!("no certificate in {}", cert.display());
    };
    let first = first.with_context(|| format!("reading certificates from {}", cert.display()))?;
    let parsed = webpki::EndEntityCert::try_from(&first)
        .map_err(|e| anyhow::anyhow!("the certificate in {} ({e:?})", cert.display()))?;
    Ok(parsed
        .valid_dns_names()
        .map(|n| n.trim_end_matches('.').to_ascii_lowercase())
        .collect())
}

/// Answers only requests whose Host is one of [`Hosts`]: 421 otherwise.
pub async fn check_host(State(hosts): State<Arc<Hosts>>, request: Request, next: Next) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .map(|v| v.to_str().unwrap_or("\u{0}"));
    if hosts.admits(host) {
        return next.run(request).await;
    }
    (
        StatusCode::MISDIRECTED_REQUEST,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        "moor console: this console does not answer that Host name (open it by an address, localhost with its port, or a name given with --allow-host)\n",
    )
        .into_response()
}

/// A TLS listener for axum: handshakes run beside the accept loop (a slow client
/// holds up nobody), each bounded in time.
pub struct TlsListener {
    local: SocketAddr,
    rx: tokio::sync::mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
}

/// How long a TLS handshake may take.
const HANDSHAKE: Duration = Duration::from_secs(10);

impl TlsListener {
    pub fn new(listener: TcpListener, config: Arc<rustls::ServerConfig>) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        tokio::spawn(async move {
            loop {
                let (tcp, peer) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::debug!(error = %e, "console: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                if tx.is_closed() {
                    return;
                }
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "console: TLS handshake failed")
                        }
                        Err(_) => tracing::debug!(%peer, "console: TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { local, rx })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accept loop never ends while the listener lives.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

/// The cookie a `?token=` visit sets.
const COOKIE: &str = "moor_console_token";

/// The tokens the console admits, each with what its holder may see.
pub struct Tokens(Vec<(Arc<str>, Scope)>);

impl Tokens {
    /// What the holder of `given` may see, if it is a token (each compared in time
    /// that does not depend on where they differ).
    fn scope(&self, given: &str) -> Option<Scope> {
        let mut found = None;
        for (token, scope) in &self.0 {
            if same(given, token) && found.is_none() {
                found = Some(scope.clone());
            }
        }
        found
    }
}

/// The people of a `--people` file: each name's scope (the union of its entries').
pub fn parse_people(text: &str) -> anyhow::Result<std::collections::HashMap<String, Scope>> {
    let mut people: std::collections::HashMap<String, Scope> = Default::default();
    for entry in text
        .lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .flat_map(str::split_whitespace)
    {
        let Some((name, role)) = entry.split_once('=') else {
            bail!("{entry}: not NAME=ROLE[:NS,...]");
        };
        let (role, namespaces) = match role.split_once(':') {
            Some((r, ns)) => (r, ns.split(',').filter(|n| !n.is_empty()).collect()),
            None => (role, Vec::new()),
        };
        let scope = match (role, namespaces.is_empty()) {
            ("operator", true) => Scope::All,
            ("view" | "edit", false) => {
                for ns in &namespaces {
                    moor::api::Namespace::new(*ns)
                        .map_err(|e| anyhow::anyhow!("{entry}: namespace {ns:?}: {e}"))?;
                }
                Scope::Namespaces(namespaces.iter().map(|n| n.to_string()).collect())
            }
            ("operator", false) => bail!("{entry}: operator takes no namespaces"),
            ("view" | "edit", true) => bail!("{entry}: {role} needs namespaces (:NS,...)"),
            _ => bail!("{entry}: the role is view, edit or operator"),
        };
        let merged = match (people.remove(name), scope) {
            (Some(Scope::All), _) | (_, Scope::All) => Scope::All,
            (Some(Scope::Namespaces(mut a)), Scope::Namespaces(b)) => {
                a.extend(b);
                Scope::Namespaces(a)
            }
            (None, s) => s,
        };
        people.insert(name.to_string(), merged);
    }
    Ok(people)
}

/// Admits a request carrying the token (header or cookie); a `?token=` visit with the
/// right token gets the cookie and is sent on without it in its address.
pub async fn require_token(
    State(tokens): State<Arc<Tokens>>,
    request: Request,
    next: Next,
) -> Response {
    let headers = request.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let cookie = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| c.trim().strip_prefix(COOKIE)?.strip_prefix('='));
    // Served within the holder's scope: every table read of the request sees only it.
    if let Some(scope) = bearer.or(cookie).and_then(|t| tokens.scope(t)) {
        return SCOPE.scope(scope, next.run(request)).await;
    }
    let uri = request.uri();
    let params = super::html::query(uri.query());
    if let Some((_, given)) = params.iter().find(|(k, _)| k == "token") {
        if tokens.scope(given).is_some() {
            let rest: Vec<String> = params
                .iter()
                .filter(|(k, _)| k != "token")
                .map(|(k, v)| format!("{}={}", super::html::encode(k), super::html::encode(v)))
                .collect();
            let to = if rest.is_empty() {
                uri.path().to_string()
            } else {
                format!("{}?{}", uri.path(), rest.join("&"))
            };
            return (
                StatusCode::SEE_OTHER,
                [
                    (header::LOCATION, to),
                    (
                        header::SET_COOKIE,
                        format!("{COOKIE}={given}; Path=/; HttpOnly; Secure; SameSite=Strict"),
                    ),
                ],
            )
                .into_response();
        }
    }
    (
        StatusCode::UNAUTHORIZED,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        "moor console: open it with ?token=TOKEN (the console's --token-file), or send Authorization: Bearer TOKEN\n",
    )
        .into_response()
}

/// Compares in time that does not depend on where they differ.
fn same(given: &str, token: &str) -> bool {
    let (a, b) = (given.as_bytes(), token.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn people_are_read_as_roles_sh_takes_them_and_bad_entries_refused() {
        let p =
            parse_people("ann=view:a # a comment\nbo=edit:a,b ann=view:c\ncy=operator").unwrap();
        let ns = |list: &[&str]| Scope::Namespaces(list.iter().map(|s| s.to_string()).collect());
        assert_eq!(p["ann"], ns(&["a", "c"]));
        assert_eq!(p["bo"], ns(&["a", "b"]));
        assert_eq!(p["cy"], Scope::All);
        for bad in [
            "eve=admin:a",
            "eve=view",
            "eve=operator:a",
            "eve",
            "eve=view:A/b",
        ] {
            assert!(parse_people(bad).is_err(), "{bad}");
        }
        let tokens = Tokens(vec![("t".repeat(16).into(), ns(&["a"]))]);
        assert_eq!(tokens.scope(&"t".repeat(16)), Some(ns(&["a"])));
        assert_eq!(tokens.scope(&"t".repeat(15)), None);
    }

    #[test]
    fn a_namespace_scope_shows_its_keys_topics_and_the_cluster_s_only() {
        let s = Scope::Namespaces(["a".to_string()].into());
        for (key, shown) in [
            ("volumes/a/v", true),
            ("volumes/b/v", false),
            ("claims/n1/a/c.data", true),
            ("claims/n1/b/c.data", false),
            ("mounts/n1/b/c.data", false),
            ("events/controller/a/e1", true),
            ("events/node/n1/b/e1", false),
            ("events/node/n1/a/e1", true),
            ("attachments/b/v/n1", false),
            ("quotas/a/q", true),
            ("nodes/n1", true),
            ("plugins/p", true),
            ("secrets/p/a/s", false),
            ("leases/a/x", false),
        ] {
            assert_eq!(s.shows_key(key), shown, "{key}");
        }
        for (topic, shown) in [
            ("v:a/v", true),
            ("v:b/v", false),
            ("a:b/x", false),
            ("o:Volume/b/v", false),
            ("o:Node//n1", true),
            ("n:n1", true),
            ("Volume", true),
            ("volumes/b/v", false),
        ] {
            assert_eq!(s.shows_topic(topic), shown, "{topic}");
        }
        assert!(Scope::All.shows_key("secrets/p/b/s"));
    }
    use clap::Parser;

    #[derive(Parser)]
    struct Argv {
        #[command(flatten)]
        listen: ListenArgs,
    }

    fn args(argv: &[&str]) -> ListenArgs {
        Argv::try_parse_from(std::iter::once("console").chain(argv.iter().copied()))
            .unwrap()
            .listen
    }

    #[test]
    fn only_loopback_is_served_without_tls_and_an_access_rule() {
        assert!(args(&[]).check().is_ok());
        assert!(args(&["--listen", "[::1]:9000"]).check().is_ok());
        let e = args(&["--listen", "0.0.0.0:8480"]).check().unwrap_err();
        assert!(e.to_string().contains("without TLS"), "{e}");
        let e = args(&["--listen", "10.0.0.1:8480", "--token-file", "t"])
            .check()
            .unwrap_err();
        assert!(e.to_string().contains("without TLS"), "{e}");
        let e = args(&[
            "--listen",
            "10.0.0.1:8480",
            "--tls-cert",
            "c",
            "--tls-key",
            "k",
        ])
        .check()
        .unwrap_err();
        assert!(e.to_string().contains("access rule"), "{e}");
        assert!(args(&[
            "--listen",
            "10.0.0.1:8480",
            "--tls-cert",
            "c",
            "--tls-key",
            "k",
            "--token-file",
            "t"
        ])
        .check()
        .is_ok());
    }

    #[test]
    fn only_the_console_s_own_host_names_are_answered() {
        let loopback: SocketAddr = "127.0.0.1:8480".parse().unwrap();
        let hosts = Hosts::new(&args(&[]), loopback).unwrap();
        for ok in [
            None,
            Some("127.0.0.1:8480"),
            Some("127.0.0.1"),
            Some("[::1]:8480"),
            Some("localhost:8480"),
            Some("LOCALHOST.:8480"),
        ] {
            assert!(hosts.admits(ok), "{ok:?} refused");
        }
        for bad in [
            Some("evil.example:8480"),
            Some("evil.example"),
            Some("localhost"),
            Some("localhost:80"),
            Some("localhost.evil.example:8480"),
            Some(""),
        ] {
            assert!(!hosts.admits(bad), "{bad:?} answered");
        }
        let named = Hosts::new(&args(&["--allow-host", "Console.Example."]), loopback).unwrap();
        assert!(named.admits(Some("console.example:443")));
        assert!(named.admits(Some("console.example")));
        assert!(!named.admits(Some("other.example")));
        // Off loopback, localhost is not the console's name.
        let off = Hosts::new(&args(&[]), "10.0.0.1:8480".parse().unwrap()).unwrap();
        assert!(!off.admits(Some("localhost:8480")));
        assert!(off.admits(Some("10.0.0.1:8480")));
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(same("0123456789abcdef", "0123456789abcdef"));
        assert!(!same("0123456789abcdeg", "0123456789abcdef"));
        assert!(!same("0123456789abcde", "0123456789abcdef"));
    }
}
