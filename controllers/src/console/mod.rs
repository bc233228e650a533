//! `moord console`: a read-only web console over moor's desired and observed state.
//!
//! Expected flow:
//! 1. [`state::Catalog::spawn`] opens one watch per kind shown and keeps rows of what
//!    the pages show (never whole volumes, claims or allocations), sorted, with
//!    indexes of related objects.
//! 2. Each page is written on the server from those rows ([`pages`], [`volumes`],
//!    [`objects`]); a detail page also reads its one object from the store, and shows
//!    it redacted.
//! 3. A page opens `/live` (Server-Sent Events) with the topics it shows; when a
//!    change wakes them, the server says so and the page fetches its new body. Browsers
//!    share the console's watches: none opens its own, and nothing polls on a timer.
//!
//! # Layout
//! - `access`: who may connect: loopback, or TLS with client certificates or a token.
//! - `state`: the watches, the tables and the broadcast of changes.
//! - `rows`: what is kept of each kind.
//! - `html`: escaping and the writing of pages.
//! - `pages`: the frame, the overview, timelines, filtering and paging.
//! - `volumes`: the volume list and a volume's page with its picture.
//! - `objects`: allocations, nodes and plugins.
//!
//! The stylesheet and the script are controllers/assets/console.{css,js}, served as they
//! are (no build step).

mod access;
mod html;
mod objects;
mod pages;
mod rows;
mod state;
mod volumes;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures::Stream;
use moor::api::Namespace;
use tokio_util::sync::CancellationToken;

pub use access::ListenArgs;
use pages::{Page, Written};
use state::Catalog;
use std::collections::HashMap;

/// The kinds the console watches (its etcd role reads these, and nothing else: never
/// Secrets, leases or elections). [`state::Catalog::spawn`] follows exactly these.
pub const READS: [moor::api::Kind; 11] = {
    use moor::api::Kind::*;
    [
        Volume, Claim, Allocation, Attachment, Mount, Snapshot, Event, Node, Plugin, Cordon, Quota,
    ]
};

/// Flags of `moord console`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Where and for whom it listens.
    #[command(flatten)]
    pub listen: ListenArgs,
    /// etcd (an identity that reads what the console shows: deploy/etcd/roles.sh's
    /// moor-console).
    #[command(flatten)]
    pub etcd: crate::common::EtcdArgs,
}

/// Runs the console until `shutdown`.
pub async fn run(args: Args, shutdown: CancellationToken) -> anyhow::Result<()> {
    args.listen.check()?;
    let store = args.etcd.connect(Duration::from_secs(30)).await?;
    if let Some(addr) = args.etcd.http {
        let registry = Arc::new(prometheus_client::registry::Registry::default());
        let stop = shutdown.clone();
        tokio::spawn(async move {
            if let Err(e) = crate::common::serve_http(addr, registry, stop).await {
                tracing::error!(error = format!("{e:#}"), "console: /metrics server failed");
            }
        });
    }
    let listener = tokio::net::TcpListener::bind(args.listen.listen)
        .await
        .with_context(|| format!("binding the console to {}", args.listen.listen))?;
    serve(listener, &args.listen, store, shutdown).await
}

/// Serves the console on `listener` until `shutdown` (`moord dev` calls it too).
pub async fn serve(
    listener: tokio::net::TcpListener,
    listen: &ListenArgs,
    store: moor::store::Store,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let tls = listen.tls()?;
    let token = listen.tokens()?;
    if listen.people.is_some() {
        state::PEOPLE.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    let addr = listener.local_addr()?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    tracing::info!(url = %format!("{scheme}://{addr}/"), "serving the console");
    let catalog = Catalog::spawn(store, shutdown.clone());
    let app = Arc::new(App {
        catalog,
        shutdown: shutdown.clone(),
        renders: Default::default(),
    });
    let hosts = Arc::new(access::Hosts::new(listen, addr)?);
    let mut router = router(app);
    if let Some(token) = token {
        router = router.layer(axum::middleware::from_fn_with_state(
            token,
            access::require_token,
        ));
    }
    // Checked first (the outermost layer): a page of another name gets nothing.
    router = router.layer(axum::middleware::from_fn_with_state(
        hosts,
        access::check_host,
    ));
    let stop = async move { shutdown.cancelled().await };
    match tls {
        Some(config) => axum::serve(access::TlsListener::new(listener, config)?, router)
            .with_graceful_shutdown(stop)
            .await
            .context("serving the console"),
        None => axum::serve(listener, router)
            .with_graceful_shutdown(stop)
            .await
            .context("serving the console"),
    }
}

struct App {
    catalog: Arc<Catalog>,
    shutdown: CancellationToken,
    renders: std::sync::Mutex<HashMap<String, Arc<Cached>>>,
}

/// A page written from the tables, kept while the tables have not changed (and at most
/// [`CACHED_FOR`]): after one write, 50 live overviews refresh with one render.
struct Cached {
    version: u64,
    at: Instant,
    page: Written,
}

/// How long a cached page is served at most (its "3s ago" texts age).
const CACHED_FOR: Duration = Duration::from_secs(1);

/// How many pages the cache keeps before it starts again.
const CACHED_PAGES: usize = 256;

impl App {
    /// The page `key` (its path and query) names, from the cache or written by `write`.
    /// Writes are one at a time: browsers woken by one change wait for the first
    /// render and share it.
    fn cached(&self, key: String, write: impl FnOnce() -> Page) -> Arc<Cached> {
        // A page is one person's scope's: never served to another scope.
        let key = format!(
            "{}|{key}",
            state::Scope::current().map_or_else(|| "-".to_string(), |s| s.cache_key())
        );
        let version = self.catalog.version();
        let mut renders = self.renders.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = renders.get(&key) {
            if c.version == version && c.at.elapsed() < CACHED_FOR {
                return c.clone();
            }
        }
        let cached = Arc::new(Cached {
            version,
            at: Instant::now(),
            page: write().written(),
        });
        if renders.len() >= CACHED_PAGES {
            renders.clear();
        }
        renders.insert(key, cached.clone());
        cached
    }
}

type Shared = State<Arc<App>>;

/// Whether the request's person may see namespace `ns` (a detail page reads the store,
/// not the scoped tables).
fn shown(ns: &Namespace) -> bool {
    state::Scope::current().is_some_and(|s| s.shows_namespace(ns.as_str()))
}

fn router(app: Arc<App>) -> axum::Router {
    axum::Router::new()
        .route("/", get(|State(a): Shared, RawQuery(q): RawQuery, h: HeaderMap| async move {
            let t = Instant::now();
            let key = format!("/?{}", q.as_deref().unwrap_or(""));
            respond_written(&a.cached(key, || pages::overview(&a.catalog)).page, &h, t)
        }))
        .route("/volumes", get(|State(a): Shared, RawQuery(q): RawQuery, h: HeaderMap| async move {
            let t = Instant::now();
            let key = format!("/volumes?{}", q.as_deref().unwrap_or(""));
            respond_written(&a.cached(key, || volumes::list(&a.catalog, q.as_deref())).page, &h, t)
        }))
        .route("/volumes/{ns}/{name}", get(|State(a): Shared, Path((ns, name)): Path<(String, String)>, h: HeaderMap| async move {
            let t = Instant::now();
            match Namespace::new(&ns) {
                Ok(ns) if shown(&ns) => respond_read(volumes::detail(&a.catalog, ns, &name).await, &h, t),
                _ => respond(Page::not_found("Volume", &name, Vec::new()), &h, t),
            }
        }))
        .route("/allocations", get(|State(a): Shared, RawQuery(q): RawQuery, h: HeaderMap| async move {
            let t = Instant::now();
            let key = format!("/allocations?{}", q.as_deref().unwrap_or(""));
            respond_written(&a.cached(key, || objects::allocations(&a.catalog, q.as_deref())).page, &h, t)
        }))
        .route("/allocations/{ns}/{name}", get(|State(a): Shared, Path((ns, name)): Path<(String, String)>, h: HeaderMap| async move {
            let t = Instant::now();
            match Namespace::new(&ns) {
                Ok(ns) if shown(&ns) => respond_read(objects::allocation(&a.catalog, ns, &name).await, &h, t),
                _ => respond(Page::not_found("Allocation", &name, Vec::new()), &h, t),
            }
        }))
        .route("/nodes", get(|State(a): Shared, h: HeaderMap| async move {
            let t = Instant::now();
            respond(objects::nodes(&a.catalog), &h, t)
        }))
        .route("/nodes/{name}", get(|State(a): Shared, Path(name): Path<String>, h: HeaderMap| async move {
            let t = Instant::now();
            respond(objects::node_page(&a.catalog, &name), &h, t)
        }))
        .route("/plugins", get(|State(a): Shared, h: HeaderMap| async move {
            let t = Instant::now();
            respond(objects::plugins(&a.catalog), &h, t)
        }))
        .route("/plugins/{id}", get(|State(a): Shared, Path(id): Path<String>, h: HeaderMap| async move {
            let t = Instant::now();
            respond(objects::plugin_page(&a.catalog, &id), &h, t)
        }))
        .route("/live", get(live))
        .route("/healthz", get(|State(a): Shared| async move {
            if a.catalog.ready() {
                (StatusCode::OK, "ok\n")
            } else {
                (StatusCode::SERVICE_UNAVAILABLE, "reading the store\n")
            }
        }))
        .route("/static/console.css", get(|| async {
            asset("text/css; charset=utf-8", include_str!("../../assets/console.css"))
        }))
        .route("/static/console.js", get(|| async {
            asset("text/javascript; charset=utf-8", include_str!("../../assets/console.js"))
        }))
        .fallback(|request: Request| async move {
            let t = Instant::now();
            let mut page = Page::new("Not found", Vec::new());
            page.found = false;
            page.body.raw("<h1>Not found</h1><p class=\"empty\">No page at ")
                .text(request.uri().path())
                .raw(".</p>");
            respond(page, request.headers(), t)
        })
        .with_state(app)
}

/// The headers every page carries: nothing but the console's own script and style
/// runs, and nothing is cached.
fn secured(mut response: Response) -> Response {
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
             connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    secured(([(header::CONTENT_TYPE, content_type)], body).into_response())
}

/// The header the page's script sends to fetch only the body.
const FRAGMENT: &str = "x-moor-fragment";

/// A page as a response: the whole document, or only its body for the live script;
/// with the server's time to write it (`Server-Timing: render;dur=MS`).
fn respond(page: Page, headers: &HeaderMap, started: Instant) -> Response {
    respond_written(&page.written(), headers, started)
}

fn respond_written(page: &Written, headers: &HeaderMap, started: Instant) -> Response {
    let status = if page.found {
        StatusCode::OK
    } else {
        StatusCode::NOT_FOUND
    };
    let body = if headers.contains_key(FRAGMENT) {
        page.body.clone()
    } else {
        page.document()
    };
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    secured(
        (
            status,
            [
                (header::CONTENT_TYPE, "text/html; charset=utf-8".to_string()),
                (
                    header::HeaderName::from_static("server-timing"),
                    format!("render;dur={ms:.3}"),
                ),
            ],
            body,
        )
            .into_response(),
    )
}

/// A page that read the store: an error page when the read failed.
fn respond_read(page: anyhow::Result<Page>, headers: &HeaderMap, started: Instant) -> Response {
    match page {
        Ok(page) => respond(page, headers, started),
        Err(e) => {
            let mut page = Page::new("Store unavailable", Vec::new());
            page.body
                .raw("<h1>The store did not answer</h1><pre class=\"error\">")
                .lines(format!("{e:#}"))
                .raw("</pre>");
            let mut r = respond(page, headers, started);
            *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            r
        }
    }
}

/// How long a live stream gathers changes before it tells the page (one refresh for a
/// burst of writes).
const GATHER: Duration = Duration::from_millis(100);

/// `/live?topics=A,B`: an event each time something the page shows changed.
async fn live(
    State(app): Shared,
    RawQuery(q): RawQuery,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let topics: Vec<String> = html::query(q.as_deref())
        .into_iter()
        .find(|(k, _)| k == "topics")
        .map(|(_, v)| {
            v.split(',')
                .filter(|t| !t.is_empty())
                // Only what the person may see wakes their page.
                .filter(|t| state::Scope::current().is_some_and(|s| s.shows_topic(t)))
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    let rx = app.catalog.changes.subscribe();
    let stop = app.shutdown.clone();
    let hello =
        futures::stream::once(async { Ok(SseEvent::default().event("hello").data("live")) });
    let changes =
        futures::stream::unfold((rx, topics, stop), |(mut rx, topics, stop)| async move {
            use tokio::sync::broadcast::error::RecvError;
            loop {
                let woke = tokio::select! {
                    _ = stop.cancelled() => return None,
                    r = rx.recv() => match r {
                        Ok(change) => change.wakes(&topics),
                        Err(RecvError::Lagged(_)) => true,
                        Err(RecvError::Closed) => return None,
                    },
                };
                if !woke {
                    continue;
                }
                // The burst's other changes are read and dropped: one refresh covers them.
                tokio::time::sleep(GATHER).await;
                while !matches!(
                    rx.try_recv(),
                    Err(tokio::sync::broadcast::error::TryRecvError::Empty
                        | tokio::sync::broadcast::error::TryRecvError::Closed)
                ) {}
                let event = SseEvent::default().event("changed").data("changed");
                return Some((Ok(event), (rx, topics, stop)));
            }
        });
    Sse::new(futures::StreamExt::chain(hello, changes)).keep_alive(KeepAlive::default())
}
