//! Allocations, nodes and plugins: a list and a page each, in the volumes' shape.

use moor::api::{Allocation, Namespace, Node, NodeName, Plugin, PluginId};

use super::html::{ago, Href};
use super::pages::*;
use super::rows::*;
use super::state::Catalog;
use super::volumes::fact;

/// `/allocations`, filtered by namespace, node, phase and name.
pub fn allocations(c: &Catalog, q: Option<&str>) -> Page {
    let f = Filter::parse(q);
    let mut page = Page::new("Allocations", vec!["Allocation".into()]);
    let h = &mut page.body;
    h.raw("<h1>Allocations</h1>");
    filter_form(
        h,
        "/allocations",
        &f,
        &["namespace", "node", "phase", "name"],
    );
    let (rows, total, more) = page_of(&c.allocations, &f, |a| {
        (f.namespace.is_empty() || a.namespace.as_str() == f.namespace)
            && (f.node.is_empty() || a.node.as_str() == f.node)
            && (f.phase.is_empty() || a.phase.eq_ignore_ascii_case(&f.phase))
            && (f.name.is_empty() || a.name.as_str().contains(f.name.as_str()))
    });
    h.head(&[
        "Namespace",
        "Name",
        "Node",
        "Client",
        "Phase",
        "Volumes",
        "Waiting on",
    ]);
    for a in &rows {
        h.raw("<tr>")
            .cell(&a.namespace)
            .cell_link(&alloc_href(&a.namespace, &a.name), &a.name)
            .cell_link(&Href::to("/nodes").seg(&a.node), &a.node)
            .cell(&a.client)
            .cell_phase(&a.phase)
            .cell(a.requests.len().to_string())
            .cell(a.waiting.as_ref().map_or("-", |w| &w.step))
            .raw("</tr>");
    }
    h.raw("</tbody></table>");
    pager(h, "/allocations", &f, &rows, total, more);
    h.cli("moorctl get allocations -A");
    page
}

/// `/allocations/NS/NAME`: requests, target paths, client status and exit.
pub async fn allocation(c: &Catalog, ns: Namespace, name: &str) -> anyhow::Result<Page> {
    let topics = vec![
        format!("k:{}", Allocation::key_for(&ns, name)),
        alloc(&ns, name),
        about("Allocation", &ns, name),
    ];
    let Some(obj) = c.store.try_get(&Allocation::key_for(&ns, name)).await? else {
        return Ok(Page::not_found("Allocation", name, topics));
    };
    let row = AllocationRow::project(obj.clone());
    let mut page = Page::new(format!("Allocation {ns}/{name}"), topics);
    let h = &mut page.body;
    h.raw("<h1>Allocation ")
        .text(name)
        .raw(" <span class=\"ns\">")
        .text(&ns)
        .raw("</span></h1><dl class=\"facts\">");
    fact(h, "Node", &row.node);
    fact(h, "Desired", &row.desired);
    fact(h, "Client status", &row.client);
    fact(h, "Exit", row.exit.as_deref().unwrap_or("-"));
    fact(h, "Phase", &row.phase);
    fact(h, "Lost", if row.lost { "yes" } else { "no" });
    h.raw("</dl>");
    if let Some(w) = &row.waiting {
        waiting_box(h, w);
    }
    let mounts = c.mounts.by(&alloc(&ns, name));
    let claims = c.claims.by(&alloc(&ns, name));
    h.raw("<h2>Requests</h2>");
    h.head(&[
        "Request",
        "Volume",
        "Read-only",
        "Claim",
        "Stage",
        "Publish",
        "Target path",
    ]);
    for r in row.requests.iter() {
        let claim = claims.iter().find(|c| c.request == r.name);
        let mount = claim.and_then(|cl| mounts.iter().find(|m| m.claim == cl.name));
        let how = match (r.template, r.per_alloc) {
            (true, _) => " (from a template)",
            (_, true) => " (per allocation)",
            _ => "",
        };
        h.raw("<tr>")
            .cell(&r.name)
            .raw("<td>")
            .link(&volume_href(&ns, &r.volume), &r.volume)
            .raw(how)
            .raw("</td>")
            .cell(if r.read_only { "yes" } else { "no" });
        match claim {
            Some(cl) => h.cell_phase(&cl.phase),
            None => h.cell("-"),
        };
        match mount {
            Some(m) => h
                .cell(if m.staged { "staged" } else { "-" })
                .cell(if m.published { "published" } else { "-" })
                .raw("<td><code>")
                .text(&m.target_path)
                .raw("</code></td>"),
            None => h.cell("-").cell("-").cell("-"),
        };
        h.raw("</tr>");
    }
    h.raw("</tbody></table>");
    timeline(h, c, &about("Allocation", &ns, name));
    h.raw("<h2>Stored</h2>");
    stored(h, &obj);
    h.cli(&format!(
        "moorctl describe allocation {name} -n {ns}; moorctl alloc paths {name} -n {ns}"
    ));
    Ok(page)
}

/// `/nodes`.
pub fn nodes(c: &Catalog) -> Page {
    let mut page = Page::new("Nodes", vec!["Node".into(), "Cordon".into()]);
    page.body.raw("<h1>Nodes</h1>");
    nodes_table(&mut page.body, c);
    page.body.cli("moorctl get nodes");
    page
}

/// How many of a node's rows its page lists.
const NODE_ROWS: usize = 100;

/// `/nodes/NAME`: its plugins, cordon, attachments, mounts and allocations.
pub fn node_page(c: &Catalog, name: &str) -> Page {
    let topics = vec![node(name), about("Node", &Namespace::default(), name)];
    let Some(n) = NodeName::new(name)
        .ok()
        .and_then(|n| c.nodes.get(Node::key_for(&n).as_str()))
    else {
        return Page::not_found("Node", name, topics);
    };
    let mut page = Page::new(format!("Node {name}"), topics);
    let h = &mut page.body;
    let (health, line) = node_health(&n.obj);
    h.raw("<h1>Node ")
        .text(name)
        .raw("</h1><dl class=\"facts\">");
    fact(h, "Health", format!("{health} ({line})"));
    fact(h, "Cordon", cordon_word(c, name));
    if let Some(l) = &n.obj.status.liveness {
        fact(
            h,
            "Liveness",
            format!("ttl {} ms, {} renewals", l.ttl_ms, l.renewals),
        );
    }
    h.raw("</dl><h2>Plugins</h2>");
    h.head(&[
        "Plugin",
        "Type",
        "Healthy",
        "Message",
        "Version",
        "Max volumes",
        "Report changed",
    ]);
    for (id, p) in &n.obj.status.plugins {
        h.raw("<tr>")
            .cell_link(&Href::to("/plugins").seg(id), id)
            .cell(word(&p.plugin_type))
            .cell_phase(if p.healthy { "healthy" } else { "unhealthy" })
            .cell(&p.health_message)
            .cell(&p.version)
            .cell(p.max_volumes_per_node.map_or("-".into(), |m| m.to_string()))
            .cell(ago(p.last_seen))
            .raw("</tr>");
    }
    h.raw("</tbody></table>");
    let here = node(name);
    h.raw("<h2>Attachments (")
        .show(c.attachments.count_by(&here))
        .raw(")</h2>");
    h.head(&["Volume", "Phase", "Waiting on"]);
    for a in c.attachments.by(&here).iter().take(NODE_ROWS) {
        h.raw("<tr>")
            .cell_link(
                &volume_href(&a.namespace, &a.volume),
                format!("{}/{}", a.namespace, a.volume),
            )
            .cell_phase(&a.phase)
            .cell(a.waiting.as_ref().map_or("-", |w| &w.step))
            .raw("</tr>");
    }
    h.raw("</tbody></table>");
    h.raw("<h2>Mounts (")
        .show(c.mounts.count_by(&here))
        .raw(")</h2>");
    h.head(&["Volume", "Allocation", "State", "Target path", "Waiting on"]);
    for m in c.mounts.by(&here).iter().take(NODE_ROWS) {
        h.raw("<tr>")
            .cell_link(
                &volume_href(&m.namespace, &m.volume),
                format!("{}/{}", m.namespace, m.volume),
            )
            .cell_link(&alloc_href(&m.namespace, &m.allocation), &m.allocation)
            .cell_phase(m.state())
            .raw("<td><code>")
            .text(&m.target_path)
            .raw("</code></td>")
            .cell(m.waiting.as_ref().map_or("-", |w| &w.step))
            .raw("</tr>");
    }
    h.raw("</tbody></table>");
    h.raw("<p>")
        .link(
            &Href::to("/allocations").param("node", name),
            "Allocations on this node",
        )
        .raw("</p>");
    timeline(h, c, &about("Node", &Namespace::default(), name));
    h.cli(&format!("moorctl describe node {name}"));
    page
}

/// `/plugins`.
pub fn plugins(c: &Catalog) -> Page {
    let mut page = Page::new("Plugins", vec!["Plugin".into()]);
    page.body.raw("<h1>Plugins</h1>");
    plugins_table(&mut page.body, c);
    page.body.cli("moorctl plugin status");
    page
}

/// `/plugins/ID`: its instances, and a link to its volumes.
pub fn plugin_page(c: &Catalog, id: &str) -> Page {
    let topics = vec![
        "Plugin".to_string(),
        about("Plugin", &Namespace::default(), id),
    ];
    let Some(p) = PluginId::new(id)
        .ok()
        .and_then(|i| c.plugins.get(Plugin::key_for(&i).as_str()))
    else {
        return Page::not_found("Plugin", id, topics);
    };
    let mut page = Page::new(format!("Plugin {id}"), topics);
    let h = &mut page.body;
    let s = &p.obj.status;
    h.raw("<h1>Plugin ")
        .text(id)
        .raw("</h1><dl class=\"facts\">");
    fact(h, "Provider", &s.provider);
    fact(h, "Version", &s.version);
    fact(
        h,
        "Controllers",
        format!(
            "{}/{} healthy",
            s.controllers_healthy, s.controllers_expected
        ),
    );
    fact(
        h,
        "Nodes",
        format!("{}/{} healthy", s.nodes_healthy, s.nodes_expected),
    );
    h.raw("</dl>");
    if let Some(w) = waiting(&s.meta) {
        waiting_box(h, &w);
    }
    h.raw("<h2>Instances</h2>");
    h.head(&["Node", "Type", "Healthy", "Message"]);
    for (node_name, i) in &s.instances {
        h.raw("<tr>")
            .cell_link(&Href::to("/nodes").seg(node_name), node_name)
            .cell(word(&i.plugin_type))
            .cell_phase(if i.healthy { "healthy" } else { "unhealthy" })
            .cell(&i.message)
            .raw("</tr>");
    }
    h.raw("</tbody></table><p>")
        .link(&Href::to("/volumes").param("plugin", id), "Its volumes")
        .raw("</p>");
    timeline(h, c, &about("Plugin", &Namespace::default(), id));
    h.cli(&format!("moorctl plugin status {id}"));
    page
}
