//! The page frame, the overview, and what every page shares: the waiting box, the
//! events timeline, an object's stored form (redacted) and filtering and paging.

use std::sync::Arc;

use super::html::{ago, until, Href, Html};
use super::rows::*;
use super::state::{Catalog, Table};

/// A rendered page, before its frame.
pub struct Page {
    pub title: String,
    /// What changes refresh it (see [`super::state::Change::wakes`]).
    pub topics: Vec<String>,
    pub body: Html,
    pub found: bool,
}

impl Page {
    pub fn new(title: impl Into<String>, topics: Vec<String>) -> Page {
        Page {
            title: title.into(),
            topics,
            body: Html::default(),
            found: true,
        }
    }

    /// The page of an object that does not exist (now: it may come, and the page
    /// follows it).
    pub fn not_found(kind: &'static str, name: &str, topics: Vec<String>) -> Page {
        let mut page = Page::new(format!("{kind} {name}"), topics);
        page.found = false;
        page.body
            .raw("<h1>")
            .raw(kind)
            .raw(" ")
            .text(name)
            .raw("</h1><p class=\"empty\">Not found.</p>");
        page
    }

    /// The page written: what a response is made of, and what the render cache keeps.
    pub fn written(self) -> Written {
        Written {
            title: self.title,
            topics: self.topics,
            body: self.body.into_string(),
            found: self.found,
        }
    }
}

/// A page written: its body's markup, and what its frame needs.
pub struct Written {
    pub title: String,
    pub topics: Vec<String>,
    pub body: String,
    pub found: bool,
}

impl Written {
    /// The whole document: the frame around the body.
    pub fn document(&self) -> String {
        let mut h = Html::default();
        h.raw("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">")
            .raw("<meta name=\"viewport\" content=\"width=device-width\"><title>")
            .text(&self.title)
            .raw(" · moor</title><link rel=\"stylesheet\" href=\"/static/console.css\">")
            .raw("<script src=\"/static/console.js\" defer></script></head><body data-live=\"")
            .text(self.topics.join(","))
            .raw("\"><header><a class=\"brand\" href=\"/\">moor</a><nav>")
            .raw("<a href=\"/\">Overview</a><a href=\"/volumes\">Volumes</a>")
            .raw("<a href=\"/allocations\">Allocations</a><a href=\"/nodes\">Nodes</a>")
            .raw("<a href=\"/plugins\">Plugins</a></nav>")
            .raw("<span id=\"live\" class=\"live off\" title=\"live updates\">connecting</span></header><main>");
        let mut out = h.into_string();
        out.push_str(&self.body);
        out.push_str("</main></body></html>");
        out
    }
}

/// A waiting object's box: its step, since when, its last error and its next retry.
pub fn waiting_box(h: &mut Html, w: &Waiting) {
    h.raw("<div class=\"waiting\"><b>Waiting on ")
        .text(&w.step)
        .raw("</b> since ")
        .text(ago(w.since))
        .raw(", ")
        .show(w.attempts)
        .raw(" attempts; ");
    if w.final_answer {
        h.raw("the plugin's answer was final: no retry.");
    } else {
        h.raw("next retry ").text(until(w.next_retry)).raw(".");
    }
    h.raw("<pre class=\"error\">")
        .lines(&w.message)
        .raw("</pre></div>");
}

/// A row of the overview's waiting list.
struct Waiter {
    kind: &'static str,
    href: Href,
    name: String,
    waiting: Waiting,
}

fn waiters<R: Row>(
    table: &Table<R>,
    out: &mut Vec<Waiter>,
    of: impl Fn(&R) -> Option<(&Waiting, Href, String)>,
) {
    table.scan(None, |r| {
        if let Some((w, href, name)) = of(r) {
            out.push(Waiter {
                kind: R::KIND,
                href,
                name,
                waiting: w.clone(),
            });
        }
        true
    });
}

/// Everything waiting, newest first.
fn everything_waiting(c: &Catalog) -> Vec<Waiter> {
    let mut all = Vec::new();
    waiters(&c.volumes, &mut all, |v| {
        let w = v.waiting.as_deref()?;
        Some((w, volume_href(&v.namespace, &v.name), v.id()))
    });
    waiters(&c.claims, &mut all, |r| {
        let w = r.waiting.as_deref()?;
        Some((
            w,
            volume_href(&r.namespace, &r.volume),
            format!("{}/{} on {} ({})", r.namespace, r.name, r.node, r.volume),
        ))
    });
    waiters(&c.allocations, &mut all, |r| {
        let w = r.waiting.as_deref()?;
        Some((
            w,
            alloc_href(&r.namespace, &r.name),
            format!("{}/{}", r.namespace, r.name),
        ))
    });
    waiters(&c.attachments, &mut all, |r| {
        let w = r.waiting.as_deref()?;
        Some((
            w,
            volume_href(&r.namespace, &r.volume),
            format!("{}/{} on {}", r.namespace, r.volume, r.node),
        ))
    });
    waiters(&c.mounts, &mut all, |r| {
        let w = r.waiting.as_deref()?;
        Some((
            w,
            volume_href(&r.namespace, &r.volume),
            format!(
                "{}/{} on {} for {}",
                r.namespace, r.volume, r.node, r.allocation
            ),
        ))
    });
    waiters(&c.snapshots, &mut all, |r| {
        let w = r.waiting.as_deref()?;
        Some((
            w,
            volume_href(&r.namespace, &r.volume),
            format!("{}/{}", r.namespace, r.name),
        ))
    });
    all.sort_by_key(|w| std::cmp::Reverse(w.waiting.since));
    all
}

/// How many rows the overview's waiting list shows.
const WAITING_SHOWN: usize = 100;

/// The overview: plugins, nodes, counts by phase, and everything waiting.
pub fn overview(c: &Catalog) -> Page {
    let mut page = Page::new("Overview", vec!["*".into()]);
    let h = &mut page.body;
    h.raw("<h1>Overview</h1>");
    if !c.ready() {
        h.raw("<p class=\"empty\">Reading the store…</p>");
    }
    h.raw("<h2>Plugins</h2>");
    plugins_table(h, c);
    h.raw("<h2>Nodes</h2>");
    nodes_table(h, c);
    h.raw("<h2>Volumes and claims</h2><div class=\"counts\">");
    counts(h, "Volumes", &c.volumes, |v| &v.phase);
    counts(h, "Claims", &c.claims, |r| &r.phase);
    counts(h, "Allocations", &c.allocations, |r| &r.phase);
    h.raw("</div>");
    if c.quotas.len() > 0 {
        h.raw("<h2 id=\"quotas\">Quotas</h2>");
        quotas_table(h, c);
    }
    let waiting = everything_waiting(c);
    h.raw("<h2 id=\"waiting\">Waiting (")
        .show(waiting.len())
        .raw(")</h2>");
    if waiting.is_empty() {
        h.raw("<p class=\"empty\">Nothing is waiting.</p>");
    } else {
        h.head(&[
            "Kind",
            "Object",
            "Step",
            "Since",
            "Attempts",
            "Last error",
            "Next retry",
        ]);
        for w in waiting.iter().take(WAITING_SHOWN) {
            h.raw("<tr class=\"waiter\">")
                .cell(w.kind)
                .cell_link(&w.href, &w.name)
                .cell(&w.waiting.step)
                .cell(ago(w.waiting.since))
                .cell(w.waiting.attempts.to_string())
                .raw("<td class=\"error\">")
                .lines(&w.waiting.message)
                .raw("</td>")
                .cell(&if w.waiting.final_answer {
                    "final".into()
                } else {
                    until(w.waiting.next_retry)
                })
                .raw("</tr>");
        }
        h.raw("</tbody></table>");
        if waiting.len() > WAITING_SHOWN {
            h.raw("<p>… and ")
                .show(waiting.len() - WAITING_SHOWN)
                .raw(" older.</p>");
        }
    }
    h.cli("moorctl plugin status; moorctl volume status; moorctl get claims");
    page
}

/// The counts of a kind by phase.
fn counts<R: Row>(h: &mut Html, title: &'static str, table: &Table<R>, phase: fn(&R) -> &str) {
    let mut by: std::collections::BTreeMap<String, usize> = Default::default();
    table.scan(None, |r| {
        *by.entry(phase(r).to_string()).or_default() += 1;
        true
    });
    h.raw("<div class=\"count\"><h3>")
        .raw(title)
        .raw(" <span>")
        .show(table.len())
        .raw("</span></h3><ul>");
    for (phase, n) in by {
        h.raw("<li><span class=\"phase ")
            .text(phase.to_ascii_lowercase())
            .raw("\">")
            .text(&phase)
            .raw("</span> ")
            .show(n)
            .raw("</li>");
    }
    h.raw("</ul></div>");
}

/// The quotas, with what each charged against its limits and how many objects wait.
pub fn quotas_table(h: &mut Html, c: &Catalog) {
    fn of(used: u64, limit: Option<u64>) -> String {
        limit.map_or("-".into(), |l| format!("{used}/{l}"))
    }
    h.head(&[
        "Namespace",
        "Quota",
        "Volumes",
        "Capacity",
        "Classes",
        "Allocations",
        "Snapshots",
        "Waiting",
    ]);
    c.quotas.scan(None, |q| {
        let (spec, used) = (&q.obj.spec, &q.obj.status.used);
        let classes: Vec<String> = spec
            .classes
            .iter()
            .map(|(class, limit)| {
                let u = used.classes.get(class).copied().unwrap_or_default();
                format!("{class} {u}/{limit}")
            })
            .collect();
        h.raw("<tr>")
            .cell(q.obj.metadata.namespace.as_str())
            .cell(q.obj.metadata.name.as_str())
            .cell(of(used.volumes, spec.volumes))
            .cell(
                spec.capacity
                    .map_or("-".into(), |l| format!("{}/{l}", used.capacity)),
            )
            .cell(if classes.is_empty() {
                "-".into()
            } else {
                classes.join(", ")
            })
            .cell(of(used.allocations, spec.allocations))
            .cell(of(used.snapshots, spec.snapshots))
            .cell(q.obj.status.waiting_count.to_string())
            .raw("</tr>");
        true
    });
    h.raw("</tbody></table>");
}

/// The plugins, with their healthy and expected controllers and nodes.
pub fn plugins_table(h: &mut Html, c: &Catalog) {
    if c.plugins.len() == 0 {
        h.raw("<p class=\"empty\">No plugin has registered.</p>");
        return;
    }
    h.head(&["Plugin", "Controllers", "Nodes", "Provider", "Version"]);
    c.plugins.scan(None, |p| {
        let s = &p.obj.status;
        h.raw("<tr>")
            .cell_link(
                &Href::to("/plugins").seg(&p.obj.metadata.name),
                &p.obj.metadata.name,
            )
            .cell(format!(
                "{}/{}",
                s.controllers_healthy, s.controllers_expected
            ))
            .cell(format!("{}/{}", s.nodes_healthy, s.nodes_expected))
            .cell(&s.provider)
            .cell(&s.version)
            .raw("</tr>");
        true
    });
    h.raw("</tbody></table>");
}

/// A node's health in a word, and its plugins' in a line.
pub fn node_health(n: &moor::api::Node) -> (&'static str, String) {
    let plugins = &n.status.plugins;
    let healthy = plugins.values().filter(|p| p.healthy).count();
    let word = if plugins.is_empty() {
        "no plugins"
    } else if healthy == plugins.len() {
        "healthy"
    } else {
        "unhealthy"
    };
    (word, format!("{healthy}/{} plugins healthy", plugins.len()))
}

/// The nodes, with their health and cordon.
pub fn nodes_table(h: &mut Html, c: &Catalog) {
    if c.nodes.len() == 0 {
        h.raw("<p class=\"empty\">No node has registered.</p>");
        return;
    }
    h.head(&[
        "Node",
        "Health",
        "Plugins",
        "Last seen",
        "Cordon",
        "Mounts",
        "Attachments",
    ]);
    c.nodes.scan(None, |n| {
        let name = n.obj.metadata.name.to_string();
        let (word, line) = node_health(&n.obj);
        // Its agent's last renewal as this console saw it (issue 78, item 7: a
        // plugin's `last_seen` changes only with its report, so it counted from
        // registration).
        let seen = Some(n.seen);
        h.raw("<tr>")
            .cell_link(&Href::to("/nodes").seg(&name), &name)
            .cell_phase(word)
            .cell(&line)
            .cell(ago(seen))
            .cell(cordon_word(c, &name))
            .cell(c.mounts.count_by(&node(&name)).to_string())
            .cell(c.attachments.count_by(&node(&name)).to_string())
            .raw("</tr>");
        true
    });
    h.raw("</tbody></table>");
}

/// A node's cordon in words (`-` when it has none).
pub fn cordon_word(c: &Catalog, name: &str) -> String {
    c.cordons
        .by(&node(name))
        .first()
        .map(|k| {
            let what = if k.obj.spec.drain {
                "draining"
            } else {
                "cordoned"
            };
            if k.obj.spec.reason.is_empty() {
                what.to_string()
            } else {
                format!("{what}: {}", k.obj.spec.reason)
            }
        })
        .unwrap_or_else(|| "-".into())
}

/// The events about an object, newest first, as a timeline.
pub fn timeline(h: &mut Html, c: &Catalog, about_topic: &str) {
    timeline_of(h, c, &[about_topic.to_string()])
}

/// The events about any of several objects (each about-topic, [`super::rows::about`]),
/// each once, newest first, as one timeline.
pub fn timeline_of(h: &mut Html, c: &Catalog, about_topics: &[String]) {
    let mut events: Vec<Arc<EventRow>> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for topic in about_topics {
        for e in c.events.by(topic) {
            if seen.insert(e.key.clone()) {
                events.push(e);
            }
        }
    }
    // A node's word about objects that are not on it is not shown (moorctl's rule).
    let all = events.len();
    events.retain(|e| {
        moor::api::event_shown(
            c,
            &e.source,
            std::iter::once(&e.object)
                .chain(&e.related)
                .map(|o| (o.kind.as_str(), o.namespace.as_str(), o.name.as_str())),
        )
    });
    let hidden = all - events.len();
    events.sort_by_key(|e| std::cmp::Reverse(e.time));
    h.raw("<h2>Events</h2>");
    if events.is_empty() {
        h.raw("<p class=\"empty\">No events.</p>");
        if hidden > 0 {
            h.raw("<p class=\"empty\">")
                .show(hidden)
                .raw(" event(s) written by nodes their objects are not on, not shown (<code>moorctl events --all-sources</code> shows them).</p>");
        }
        return;
    }
    h.raw("<ol class=\"timeline\">");
    for e in events.iter().take(50) {
        h.raw(if e.warning {
            "<li class=\"warning\">"
        } else {
            "<li>"
        })
        .raw("<time>")
        .text(ago(e.time))
        .raw("</time> <b>")
        .text(&e.reason)
        .raw("</b> ");
        if e.count > 1 {
            h.raw("(×").show(e.count).raw(") ");
        }
        h.text(&e.message)
            .raw(" <span class=\"source\">")
            .text(&e.source)
            .raw("</span></li>");
    }
    h.raw("</ol>");
    if hidden > 0 {
        h.raw("<p class=\"empty\">")
            .show(hidden)
            .raw(" event(s) written by nodes their objects are not on, not shown (<code>moorctl events --all-sources</code> shows them).</p>");
    }
}

/// An object as stored, redacted (secrets and mount flags never reach a page).
pub fn stored<S: moor::api::Spec>(h: &mut Html, obj: &moor::api::Object<S>) {
    let mut v = serde_json::to_value(obj).unwrap_or_default();
    moor::api::redact_json(&mut v);
    for part in ["spec", "status"] {
        if let Some(p) = v.get(part) {
            h.raw("<details><summary>")
                .raw(part)
                .raw("</summary><pre>")
                .lines(serde_json::to_string_pretty(p).unwrap_or_default())
                .raw("</pre></details>");
        }
    }
}

pub fn volume_href(ns: &moor::api::Namespace, name: impl AsRef<str>) -> Href {
    Href::to("/volumes").seg(ns).seg(name)
}

pub fn alloc_href(ns: &moor::api::Namespace, name: impl AsRef<str>) -> Href {
    Href::to("/allocations").seg(ns).seg(name)
}

/// A list's filter and page: `?namespace=&plugin=&phase=&label=k=v&name=&after=`.
#[derive(Debug, Default, Clone)]
pub struct Filter {
    pub namespace: String,
    pub plugin: String,
    pub node: String,
    pub phase: String,
    pub label: String,
    pub name: String,
    pub after: String,
    pub before: String,
}

impl Filter {
    pub fn parse(q: Option<&str>) -> Filter {
        let mut f = Filter::default();
        for (k, v) in super::html::query(q) {
            let slot = match k.as_str() {
                "namespace" => &mut f.namespace,
                "plugin" => &mut f.plugin,
                "node" => &mut f.node,
                "phase" => &mut f.phase,
                "label" => &mut f.label,
                "name" => &mut f.name,
                "after" => &mut f.after,
                "before" => &mut f.before,
                _ => continue,
            };
            *slot = v.trim().to_string();
        }
        f
    }

    /// Whether `labels` hold the label rule (`k=v`, or `k` for any value).
    pub fn labels_match(&self, labels: &std::collections::BTreeMap<String, String>) -> bool {
        if self.label.is_empty() {
            return true;
        }
        match self.label.split_once('=') {
            Some((k, v)) => labels.get(k.trim()).is_some_and(|x| x == v.trim()),
            None => labels.contains_key(&self.label),
        }
    }

    /// The link to this filter's page after `after` (or before `before`).
    pub fn href(&self, base: &'static str, after: &str, before: &str) -> Href {
        Href::to(base)
            .param("namespace", &self.namespace)
            .param("plugin", &self.plugin)
            .param("node", &self.node)
            .param("phase", &self.phase)
            .param("label", &self.label)
            .param("name", &self.name)
            .param("after", after)
            .param("before", before)
    }
}

/// How many rows a list page shows.
pub const PAGE_ROWS: usize = 50;

/// One page of a table's rows that `keep` holds for, after `f.after` (or before
/// `f.before`), and how many rows match in all.
pub fn page_of<R: Row>(
    table: &Table<R>,
    f: &Filter,
    keep: impl Fn(&R) -> bool,
) -> (Vec<Arc<R>>, usize, bool) {
    let mut rows = Vec::with_capacity(PAGE_ROWS + 1);
    if f.before.is_empty() {
        let after = (!f.after.is_empty()).then_some(f.after.as_str());
        table.scan(after, |r| {
            if keep(r) {
                rows.push(r.clone());
            }
            rows.len() <= PAGE_ROWS
        });
    } else {
        table.scan_back(&f.before, |r| {
            if keep(r) {
                rows.push(r.clone());
            }
            rows.len() <= PAGE_ROWS
        });
        rows.reverse();
    }
    let more = rows.len() > PAGE_ROWS;
    if more {
        if f.before.is_empty() {
            rows.pop();
        } else {
            rows.remove(0);
        }
    }
    let mut total = 0;
    table.scan(None, |r| {
        total += usize::from(keep(r));
        true
    });
    (rows, total, more)
}

/// The pager under a list: previous and next pages.
pub fn pager<R: Row>(
    h: &mut Html,
    base: &'static str,
    f: &Filter,
    rows: &[Arc<R>],
    total: usize,
    more: bool,
) {
    h.raw("<p class=\"pager\">").show(total).raw(" match. ");
    let first = rows.first().map(|r| r.key().to_string());
    let last = rows.last().map(|r| r.key().to_string());
    let backwards = !f.before.is_empty();
    let has_prev = if backwards { more } else { !f.after.is_empty() };
    let has_next = if backwards { true } else { more };
    if let (true, Some(first)) = (has_prev, &first) {
        h.link(&f.href(base, "", first), "← previous").raw(" ");
    }
    if let (true, Some(last)) = (has_next, &last) {
        h.link(&f.href(base, last, ""), "next →");
    }
    h.raw("</p>");
}

/// The filter form above a list, with the fields `fields` names.
pub fn filter_form(h: &mut Html, base: &'static str, f: &Filter, fields: &[&'static str]) {
    h.raw("<form class=\"filter\" method=\"get\" action=\"")
        .raw(base)
        .raw("\">");
    for &field in fields {
        let value = match field {
            "namespace" => &f.namespace,
            "plugin" => &f.plugin,
            "node" => &f.node,
            "phase" => &f.phase,
            "label" => &f.label,
            _ => &f.name,
        };
        h.raw("<label>")
            .raw(field)
            .raw(" <input name=\"")
            .raw(field)
            .raw("\" value=\"")
            .text(value)
            .raw("\"></label>");
    }
    h.raw("<button>Filter</button></form>");
}
