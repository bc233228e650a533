//! The live contract monitor: each plugin answer is checked against the spec's MUSTs
//! as it arrives (the rules are `moor::csi::contract`'s, run by the typed client this
//! monitor is given to, [`Monitor::for_plugin`], including the survey's whole
//! listing against the volumes moor expects; NodeGetInfo's rule, over the node's
//! previous answer and its journal, by the plugin supervisor) and a breach is reported
//! here. A breach raises a Warning "Plugin broke the CSI contract" on the object it
//! concerns, once per plugin, rule and object (the recorder aggregates repeats of the
//! same event anyway), and counts `moor_plugin_contract_violations_total{plugin,rule}`
//! once for each. It never changes what moor does: the caller goes on with the answer
//! as it would without the check.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};

use moor::api::{EventType, ObjectRef, PluginId};
use moor::csi::contract::{Breach, Rule};
use moor::runtime::events::Recorder;

/// How many (plugin, rule, object) breaches are remembered, and how many CreateVolume
/// answers: past it the memory starts again (a breach already warned may warn again).
const REMEMBERED: usize = 16_384;

/// The monitor of one agent: shared by its provisioner, attacher, snapshotter,
/// survey, node reconciler and plugin supervisor.
#[derive(Clone)]
pub struct Monitor {
    inner: Arc<Inner>,
}

struct Inner {
    recorder: Recorder,
    seen: Mutex<HashSet<(PluginId, Rule, String)>>,
    /// CreateVolume's answered id per (plugin, name): the same name must keep it.
    created: Mutex<BTreeMap<(PluginId, String), String>>,
}

impl Monitor {
    /// A monitor of `plugins` that records its Warnings with `recorder`; each plugin's
    /// count shows 0 for every rule until it breaks one.
    pub fn new<'a>(recorder: Recorder, plugins: impl IntoIterator<Item = &'a PluginId>) -> Monitor {
        for p in plugins {
            for rule in Rule::ALL {
                moor::runtime::metrics::contract_series(p.as_str(), rule.as_str());
            }
        }
        Monitor {
            inner: Arc::new(Inner {
                recorder,
                seen: Mutex::default(),
                created: Mutex::default(),
            }),
        }
    }

    /// Reports each of `breaches` by `plugin` about `object`.
    pub async fn report(
        &self,
        plugin: &PluginId,
        object: &ObjectRef,
        breaches: impl IntoIterator<Item = Breach>,
    ) {
        for b in breaches {
            let first = {
                let mut seen = self.inner.seen.lock().unwrap_or_else(|p| p.into_inner());
                if seen.len() >= REMEMBERED {
                    seen.clear();
                }
                seen.insert((plugin.clone(), b.rule, object_key(object)))
            };
            if !first {
                continue;
            }
            moor::runtime::metrics::contract_violation(plugin.as_str(), b.rule.as_str());
            tracing::warn!(plugin = %plugin, rule = %b.rule, object = %object_key(object), detail = %b.detail, "plugin broke the CSI contract");
            let details = crate::common::details([
                ("plugin_id", plugin.to_string()),
                ("rule", b.rule.as_str().to_string()),
            ]);
            self.inner
                .recorder
                .record(
                    object.clone(),
                    EventType::Warning,
                    "Plugin broke the CSI contract",
                    format!(
                        "plugin {plugin} broke rule {}: {} (moor goes on with the answer as given)",
                        b.rule, b.detail
                    ),
                    details,
                )
                .await;
        }
    }

    /// This monitor as the typed CSI client of `plugin` takes it
    /// ([`moor::csi::client::Csi::checked`]): what the client's checks find in that
    /// plugin's answers is reported here.
    pub fn for_plugin(&self, plugin: &PluginId) -> Arc<dyn moor::csi::contract::Monitor> {
        Arc::new(OfPlugin {
            monitor: self.clone(),
            plugin: plugin.clone(),
        })
    }

    /// The id CreateVolume answered before for `name` by `plugin`, when `id` differs
    /// from it; remembers `id` for the name otherwise.
    pub fn earlier_id(&self, plugin: &PluginId, name: &str, id: &str) -> Option<String> {
        let mut created = self.inner.created.lock().unwrap_or_else(|p| p.into_inner());
        let key = (plugin.clone(), name.to_string());
        match created.get(&key) {
            Some(earlier) => (earlier != id).then(|| earlier.clone()),
            None => {
                if created.len() >= REMEMBERED {
                    created.clear();
                }
                created.insert(key, id.to_string());
                None
            }
        }
    }

    /// Forgets the CreateVolume answer for `name` (the volume was deleted: a name
    /// created again may get another id).
    pub fn forget_created(&self, plugin: &PluginId, name: &str) {
        let mut created = self.inner.created.lock().unwrap_or_else(|p| p.into_inner());
        created.remove(&(plugin.clone(), name.to_string()));
    }
}

/// The monitor bound to one plugin, for its CSI client.
struct OfPlugin {
    monitor: Monitor,
    plugin: PluginId,
}

impl moor::csi::contract::Monitor for OfPlugin {
    fn report<'a>(
        &'a self,
        object: Option<&'a ObjectRef>,
        breaches: Vec<Breach>,
    ) -> futures::future::BoxFuture<'a, ()> {
        Box::pin(async move {
            match object {
                Some(o) => self.monitor.report(&self.plugin, o, breaches).await,
                None => {
                    let plugin = crate::common::plugin_ref(&self.plugin);
                    self.monitor.report(&self.plugin, &plugin, breaches).await
                }
            }
        })
    }

    fn earlier_id(&self, name: &str, id: &str) -> Option<String> {
        self.monitor.earlier_id(&self.plugin, name, id)
    }
}

fn object_key(o: &ObjectRef) -> String {
    format!("{}/{}/{}", o.kind, o.namespace, o.name)
}
