//! The volumes: a list that filters and pages over every volume, and a volume's page
//! with its picture (attachment on a node → stage → publish per allocation).

use std::collections::BTreeMap;

use moor::api::{Namespace, Volume};

use super::html::{bytes, Href, Html};
use super::pages::*;
use super::rows::*;
use super::state::Catalog;

/// `/volumes`: the table, filtered by namespace, plugin, phase, label and name.
pub fn list(c: &Catalog, q: Option<&str>) -> Page {
    let f = Filter::parse(q);
    let mut page = Page::new("Volumes", vec!["Volume".into()]);
    let h = &mut page.body;
    h.raw("<h1>Volumes</h1>");
    filter_form(
        h,
        "/volumes",
        &f,
        &["namespace", "plugin", "phase", "label", "name"],
    );
    let (rows, total, more) = page_of(&c.volumes, &f, |v| {
        (f.namespace.is_empty() || v.namespace.as_str() == f.namespace)
            && (f.plugin.is_empty() || v.plugin.as_str() == f.plugin)
            && (f.phase.is_empty() || v.phase.eq_ignore_ascii_case(&f.phase))
            && (f.name.is_empty() || v.name.as_str().contains(f.name.as_str()))
            && f.labels_match(&v.labels)
    });
    h.head(&[
        "Namespace",
        "Name",
        "Plugin",
        "Phase",
        "Capacity",
        "Claims",
        "Waiting on",
    ]);
    for v in &rows {
        h.raw("<tr>")
            .cell(&v.namespace)
            .cell_link(&volume_href(&v.namespace, &v.name), &v.name)
            .cell(&v.plugin)
            .cell_phase(&v.phase)
            .cell(v.capacity.map(bytes).unwrap_or_else(|| "-".into()))
            .cell(v.claims.to_string())
            .cell(v.waiting.as_ref().map_or("-", |w| &w.step))
            .raw("</tr>");
    }
    h.raw("</tbody></table>");
    pager(h, "/volumes", &f, &rows, total, more);
    let mut cli = String::from("moorctl volume status");
    if f.namespace.is_empty() {
        cli.push_str(" -A");
    } else {
        cli.push_str(&format!(" -n {}", f.namespace));
    }
    h.cli(&cli);
    page
}

/// The topics a volume's page follows.
fn topics(ns: &Namespace, name: &str) -> Vec<String> {
    vec![
        format!("k:{}", Volume::key_for(ns, name)),
        vol(ns, name),
        about("Volume", ns, name),
    ]
}

/// `/volumes/NS/NAME`.
pub async fn detail(c: &Catalog, ns: Namespace, name: &str) -> anyhow::Result<Page> {
    let key = Volume::key_for(&ns, name);
    let Some(volume) = c.store.try_get(&key).await? else {
        return Ok(Page::not_found("Volume", name, topics(&ns, name)));
    };
    // Events about the volume and about its claims and attachments, as `moorctl
    // describe volume` shows them; the page follows each.
    let about_topics: Vec<String> = std::iter::once(about("Volume", &ns, name))
        .chain(
            c.claims
                .by(&vol(&ns, name))
                .iter()
                .map(|r| about("Claim", &ns, &r.name)),
        )
        .chain(
            c.attachments
                .by(&vol(&ns, name))
                .iter()
                .map(|r| about("Attachment", &ns, &r.name)),
        )
        .collect();
    // `topics` has the volume's own already.
    let mut page = Page::new(
        format!("Volume {ns}/{name}"),
        topics(&ns, name)
            .into_iter()
            .chain(about_topics[1..].iter().cloned())
            .collect(),
    );
    let h = &mut page.body;
    let row = VolumeRow::project(volume.clone());
    h.raw("<h1>Volume ")
        .text(name)
        .raw(" <span class=\"ns\">")
        .text(&ns)
        .raw("</span></h1><dl class=\"facts\">");
    if row.deleting {
        fact(h, "Phase", format!("{} (deleting)", row.phase));
    } else {
        fact(h, "Phase", &row.phase);
    }
    fact(h, "Plugin", &row.plugin);
    fact(
        h,
        "Capacity",
        row.capacity.map(bytes).unwrap_or_else(|| "-".into()),
    );
    fact(
        h,
        "External id",
        volume
            .status
            .provisioning
            .external_id
            .as_ref()
            .map_or("-", |e| e.as_str()),
    );
    fact(h, "Schedulable", if row.schedulable { "yes" } else { "no" });
    let labels: Vec<String> = row.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    fact(h, "Labels", labels.join(", "));
    h.raw("</dl>");
    if let Some(w) = &row.waiting {
        waiting_box(h, w);
    }
    picture(h, c, &ns, name);
    claims(h, c, &ns, name);
    snapshots(h, c, &ns, name);
    timeline_of(h, c, &about_topics);
    h.raw("<h2>Stored</h2>");
    stored(h, &volume);
    h.cli(&format!(
        "moorctl volume status {name} -n {ns}; moorctl describe volume {name} -n {ns}"
    ));
    Ok(page)
}

pub fn fact(h: &mut Html, name: &'static str, value: impl AsRef<str>) {
    let value = value.as_ref();
    h.raw("<dt>")
        .raw(name)
        .raw("</dt><dd>")
        .text(if value.is_empty() { "-" } else { value })
        .raw("</dd>");
}

/// Where the volume is: per node, its attachment, then each claim's stage and publish.
fn picture(h: &mut Html, c: &Catalog, ns: &Namespace, name: &str) {
    let topic = vol(ns, name);
    let mut nodes: BTreeMap<String, (Option<std::sync::Arc<AttachmentRow>>, Vec<_>)> =
        BTreeMap::new();
    for a in c.attachments.by(&topic) {
        let at = a.node.to_string();
        nodes.entry(at).or_default().0 = Some(a);
    }
    for m in c.mounts.by(&topic) {
        nodes.entry(m.node.to_string()).or_default().1.push(m);
    }
    h.raw("<h2>Where it is</h2>");
    if nodes.is_empty() {
        h.raw("<p class=\"empty\" id=\"picture\">Not attached or mounted anywhere.</p>");
        return;
    }
    h.raw("<div class=\"picture\" id=\"picture\">");
    for (node_name, (attachment, mounts)) in nodes {
        h.raw("<div class=\"node-lane\"><div class=\"box volume\">")
            .text(name)
            .raw("</div><span class=\"arrow\">→</span><div class=\"box attachment\" data-node=\"")
            .text(&node_name)
            .raw("\" data-state=\"");
        let state = match &attachment {
            Some(a) if a.uncertain => format!("{} (uncertain)", a.phase),
            Some(a) if a.detach => format!("{} (detaching)", a.phase),
            Some(a) => a.phase.to_string(),
            None => "no ControllerPublish".into(),
        };
        h.text(&state)
            .raw("\">on ")
            .link(&Href::to("/nodes").seg(&node_name), &node_name)
            .raw("<br><span class=\"state\">")
            .text(&state)
            .raw("</span>");
        if let Some(w) = attachment.as_ref().and_then(|a| a.waiting.as_deref()) {
            h.raw("<br><span class=\"error\">")
                .text(&w.step)
                .raw(": ")
                .text(&w.message)
                .raw("</span>");
        }
        h.raw("</div><div class=\"mounts\">");
        for m in mounts {
            let stage = match (m.staged, m.stage_uncertain) {
                (_, true) => "stage uncertain",
                (true, _) => "staged",
                _ if !m.stages => "no stage",
                _ => "not staged",
            };
            let publish = match (m.published, m.publish_uncertain) {
                (_, true) => "publish uncertain",
                (true, _) => "published",
                _ => "not published",
            };
            h.raw("<div class=\"mount\" data-allocation=\"")
                .text(&m.allocation)
                .raw("\" data-state=\"")
                .text(m.state())
                .raw("\"><span class=\"arrow\">→</span><span class=\"box stage\">")
                .text(stage)
                .raw("</span><span class=\"arrow\">→</span><span class=\"box publish\">")
                .text(publish)
                .raw(" for ")
                .link(&alloc_href(&m.namespace, &m.allocation), &m.allocation)
                .raw("<br><code>")
                .text(&m.target_path)
                .raw("</code>");
            if let Some((used, total)) = m.usage {
                h.raw("<br>")
                    .text(used.map(bytes).unwrap_or_else(|| "?".into()))
                    .raw(" used of ")
                    .text(total.map(bytes).unwrap_or_else(|| "?".into()));
            }
            h.raw("</span>");
            if let Some(w) = &m.waiting {
                h.raw("<span class=\"error\">")
                    .text(&w.step)
                    .raw(": ")
                    .text(&w.message)
                    .raw("</span>");
            }
            if let Some(a) = &m.abnormal {
                h.raw("<span class=\"error\">abnormal: ")
                    .text(a)
                    .raw("</span>");
            }
            h.raw("</div>");
        }
        h.raw("</div></div>");
    }
    h.raw("</div>");
}

fn claims(h: &mut Html, c: &Catalog, ns: &Namespace, name: &str) {
    let claims = c.claims.by(&vol(ns, name));
    h.raw("<h2>Claims</h2>");
    if claims.is_empty() {
        h.raw("<p class=\"empty\">No claims.</p>");
        return;
    }
    h.head(&[
        "Claim",
        "Node",
        "Allocation",
        "Mode",
        "Phase",
        "Release",
        "Waiting on",
        "Last error",
    ]);
    for r in claims {
        h.raw("<tr>")
            .cell(&r.name)
            .cell_link(&Href::to("/nodes").seg(&r.node), &r.node)
            .cell_link(&alloc_href(&r.namespace, &r.allocation), &r.allocation)
            .cell(&r.mode)
            .cell_phase(&r.phase)
            .cell(if r.release { "releasing" } else { "-" })
            .cell(r.waiting.as_ref().map_or("-", |w| &w.step))
            .cell(r.waiting.as_ref().map_or("-", |w| &w.message))
            .raw("</tr>");
    }
    h.raw("</tbody></table>");
}

fn snapshots(h: &mut Html, c: &Catalog, ns: &Namespace, name: &str) {
    let snaps = c.snapshots.by(&vol(ns, name));
    if snaps.is_empty() {
        return;
    }
    h.raw("<h2>Snapshots</h2>");
    h.head(&["Snapshot", "Phase", "Size", "Cut"]);
    for s in snaps {
        h.raw("<tr>")
            .cell(&s.name)
            .cell_phase(&s.phase)
            .cell(s.size.map(bytes).unwrap_or_else(|| "-".into()))
            .cell(super::html::ago(s.created))
            .raw("</tr>");
    }
    h.raw("</tbody></table>");
}
