//! `moorctl alloc plan -f ALLOC.yaml [--node NODE] [-o json]`: which nodes could take an
//! allocation now, and for each that cannot, the rule that keeps each request out (like
//! `nomad job plan`). Decided by [`moor::admission::plan`], the rules the controller
//! admits with, over the objects as stored now; nothing is written.

use std::collections::BTreeMap;
use std::sync::Arc;

use moor::admission::{self, RequestFit, Verdict};
use moor::api::*;
use serde::Serialize;

use crate::{parse_ns, Ctx, Refused};

/// `moorctl alloc plan`.
#[derive(Debug, clap::Args)]
pub struct Plan {
    /// The Allocation manifest (YAML or JSON; `-` for stdin). Its node, if any, is
    /// ignored unless --node names it.
    #[arg(short = 'f', long = "filename")]
    pub file: String,
    /// Only this node.
    #[arg(long)]
    pub node: Option<String>,
    /// `json` for schedulers.
    #[arg(short = 'o', long, value_parser = ["table", "json"], default_value = "table")]
    pub output: String,
}

/// One node's answer.
#[derive(Debug, Serialize)]
struct NodeFit {
    node: String,
    fits: bool,
    requests: Vec<RequestOut>,
}

#[derive(Debug, Serialize)]
struct RequestOut {
    name: String,
    volume: String,
    admitted: bool,
    /// `wait` (not decidable yet: a volume being created, a node not registered) or
    /// `deny` (a rule refuses it).
    #[serde(skip_serializing_if = "Option::is_none")]
    verdict: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
}

impl From<RequestFit> for RequestOut {
    fn from(f: RequestFit) -> Self {
        let (verdict, reason) = match f.refused {
            None => (None, None),
            Some(Verdict::Wait(r)) => (Some("wait"), Some(printable(&r))),
            Some(Verdict::Deny(r)) => (Some("deny"), Some(printable(&r))),
        };
        RequestOut {
            name: f.request.to_string(),
            volume: f.volume,
            admitted: verdict.is_none(),
            verdict,
            reason,
        }
    }
}

impl Plan {
    /// Exit 0 when at least one node fits, 1 otherwise.
    pub async fn run(self, ctx: &Ctx) -> anyhow::Result<i32> {
        let text = crate::apply::read_input(&self.file)?;
        let mut alloc = None;
        for doc in parse_manifests(&text) {
            // The whole chain: an invalid document names each field and why.
            let doc =
                doc.map_err(|e| Refused(format!("{}: {:#}", self.file, anyhow::Error::new(e))));
            match doc? {
                AnyObject::Allocation(a) if alloc.is_none() => alloc = Some(*a),
                _ => {
                    return Err(Refused(format!("{}: plan takes one Allocation", self.file)).into())
                }
            }
        }
        let mut alloc =
            alloc.ok_or_else(|| Refused(format!("{}: no Allocation in it", self.file)))?;
        let ns = parse_ns(alloc.metadata.namespace.as_str())?;
        let nodes: Vec<Node> = match &self.node {
            Some(n) => {
                let name = NodeName::new(n).map_err(|e| anyhow::anyhow!("node {n:?}: {e}"))?;
                // An unregistered node is answered too: nothing fits there yet.
                let found = ctx.store.try_get(&Node::key_for(&name)).await?;
                vec![found.unwrap_or_else(|| {
                    let mut n = Node::new(
                        &Namespace::default(),
                        Name::new(name.as_str()).unwrap_or_default(),
                        NodeSpec {},
                    );
                    n.metadata.uid = Default::default();
                    n
                })]
            }
            None => ctx.store.list::<NodeSpec>(&KeyScope::all()).await?.items,
        };
        // The allocation's namespace only: a person's role reads no other.
        let in_ns = |what| anyhow::anyhow!("{what} are not keyed by namespace");
        let volumes: BTreeMap<VolumeId, Volume> = ctx
            .store
            .list::<VolumeSpec>(&KeyScope::namespace(&ns).ok_or_else(|| in_ns("volumes"))?)
            .await?
            .items
            .into_iter()
            .filter_map(|v| Some((VolumeId::new(v.metadata.name.as_str()).ok()?, v)))
            .collect();
        // Holders being released make a request wait, not fail: what tells them.
        let allocations: BTreeMap<String, Allocation> = ctx
            .store
            .list::<AllocationSpec>(&KeyScope::namespace(&ns).ok_or_else(|| in_ns("allocations"))?)
            .await?
            .items
            .into_iter()
            .map(|a| (a.metadata.name.to_string(), a))
            .collect();
        let mut claims_by_node: BTreeMap<NodeName, Vec<Arc<Claim>>> = BTreeMap::new();
        // Every namespace's claims on a node count against it (its volume limit); an
        // identity that reads only its own namespace's plans with those.
        let (claims, whole) = crate::kind::typed_readable::<ClaimSpec>(ctx, &ns).await?;
        if !whole {
            eprintln!(
                "warning: this identity reads only namespace {ns}'s claims: other \
                 namespaces' claims on a node (its volume limit) are not counted"
            );
        }
        for c in claims {
            claims_by_node
                .entry(c.spec.node.clone())
                .or_default()
                .push(Arc::new(c));
        }
        // The capacity reports of the plugins templates would make volumes with.
        let mut capacities: BTreeMap<PluginId, Vec<CapacityEntry>> = BTreeMap::new();
        for tpl in alloc
            .spec
            .volumes
            .iter()
            .filter_map(|r| r.template.as_deref())
        {
            if !capacities.contains_key(&tpl.plugin_id) {
                if let Some(report) = ctx.store.capacity(&tpl.plugin_id).await? {
                    capacities.insert(tpl.plugin_id.clone(), report);
                }
            }
        }
        let cordons: BTreeMap<String, Cordon> = ctx
            .store
            .list::<CordonSpec>(&KeyScope::all())
            .await?
            .items
            .into_iter()
            .map(|c| (c.metadata.name.to_string(), c))
            .collect();
        let mut out = Vec::new();
        for node in &nodes {
            let name = NodeName::new(node.metadata.name.as_str())?;
            alloc.spec.node = name.clone();
            let registered = !node.metadata.uid.is_empty();
            let mut fits = admission::plan(
                &alloc,
                registered.then_some(node),
                |v| volumes.get(v),
                || claims_by_node.get(&name).cloned().unwrap_or_default(),
                |r| {
                    let holder = claims_by_node.get(&r.node).and_then(|on_node| {
                        on_node
                            .iter()
                            .find(|c| c.metadata.namespace == ns && c.metadata.name == r.claim)
                    });
                    admission::holder_ending(
                        holder.map(|c| &**c),
                        allocations.get(r.allocation.as_str()),
                    )
                },
                |p| capacities.get(p).map(Vec::as_slice),
            );
            // A cordoned node takes no new claim, whatever else would fit.
            if let Err(v) = admission::cordoned(cordons.get(name.as_str())) {
                for f in &mut fits {
                    f.refused = Some(v.clone());
                }
            }
            out.push(NodeFit {
                node: name.to_string(),
                fits: fits.iter().all(|f| f.refused.is_none()),
                requests: fits.into_iter().map(RequestOut::from).collect(),
            });
        }
        let any = out.iter().any(|n| n.fits);
        if self.output == "json" {
            outln!(
                "{}",
                crate::out::json_safe(&serde_json::to_string_pretty(&out)?)
            );
        } else {
            let rows: Vec<Vec<String>> = out
                .iter()
                .map(|n| {
                    let why: Vec<String> = n
                        .requests
                        .iter()
                        .filter_map(|r| Some(format!("{}: {}", r.name, r.reason.as_ref()?)))
                        .collect();
                    vec![
                        printable(&n.node),
                        if n.fits { "yes" } else { "no" }.to_string(),
                        if why.is_empty() {
                            "-".to_string()
                        } else {
                            why.join("; ")
                        },
                    ]
                })
                .collect();
            out!(
                "{}",
                crate::table::render(&["NODE", "FITS", "WHY NOT"], &rows)
            );
            if out.is_empty() {
                outln!("(no node is registered)");
            }
        }
        Ok(if any { 0 } else { 1 })
    }
}
