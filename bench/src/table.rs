//! The report's table: every figure of every run side by side, with the store's
//! ceiling of the same run, as printed after the JSON.

use super::*;

/// Requests by method, `Range 1.20 · Txn 3.40`, or `-` when the store gave none.
fn requests_cell(by_method: &BTreeMap<String, f64>) -> String {
    if by_method.is_empty() {
        return "-".into();
    }
    by_method
        .iter()
        .map(|(m, v)| format!("{m} {v:.2}"))
        .collect::<Vec<_>>()
        .join(" · ")
}

pub(super) fn table(runs: &[Run]) -> String {
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    let mut row = |name: &str, f: &dyn Fn(&Run) -> String| {
        rows.push((name.to_string(), runs.iter().map(f).collect()));
    };
    row("store version", &|r| r.store_version.clone());
    row("claims / nodes", &|r| format!("{} / {}", r.claims, r.nodes));
    row("ceiling: CAS updates/s (16 writers)", &|r| {
        format!("{:.0}", r.ceiling.cas_updates_per_s)
    });
    row("ceiling: guarded txn ops/s (8 · 32 · 64 per txn)", &|r| {
        r.ceiling
            .batched_cas_ops_per_s
            .iter()
            .map(|b| format!("{:.0}", b.ops_per_s))
            .collect::<Vec<_>>()
            .join(" · ")
    });
    row("ceiling: put->watch p50/p99", &|r| {
        r.ceiling.put_watch_ms.cell()
    });
    row("volumes created/s", &|r| {
        format!("{:.0}", r.volumes_created_per_s)
    });
    row("claims/s published", &|r| {
        format!("{:.0} ({:.1} s)", r.claims_per_s_publish, r.publish_s)
    });
    row("claims/s released", &|r| {
        format!("{:.0} ({:.1} s)", r.claims_per_s_release, r.release_s)
    });
    row("store writes per claim (publish / release)", &|r| {
        format!(
            "{:.1} / {:.1}",
            r.etcd_writes_per_claim_publish, r.etcd_writes_per_claim_release
        )
    });
    row("write rate (publish / release), writes/s", &|r| {
        format!("{:.0} / {:.0}", r.write_rate_publish, r.write_rate_release)
    });
    row("write_rate_ceiling_ratio", &|r| {
        format!("{:.2}", r.write_rate_ceiling_ratio)
    });
    row("CPU during publish", &|r| r.cpu_publish.cell());
    row("CPU during release", &|r| r.cpu_release.cell());
    row("CPU ms per claim (publish / release)", &|r| {
        format!(
            "{} / {}",
            r.cpu_ms_per_claim_publish.ms_cell(),
            r.cpu_ms_per_claim_release.ms_cell()
        )
    });
    row("store requests per claim, publish", &|r| {
        requests_cell(&r.store_requests_per_claim_publish)
    });
    row("store requests per claim, release", &|r| {
        requests_cell(&r.store_requests_per_claim_release)
    });
    let journal = |j: crate::cluster::JournalPerClaim| format!("{:.2} / {:.2}", j.commits, j.syncs);
    row(
        "node journal commits / fdatasyncs per claim, publish",
        &|r| journal(r.journal_per_claim_publish),
    );
    row(
        "node journal commits / fdatasyncs per claim, release",
        &|r| journal(r.journal_per_claim_release),
    );
    row("reaction: stop -> NodeUnpublish, idle", &|r| {
        r.reaction_idle_ms.cell()
    });
    row("reaction: stop -> NodeUnpublish, burst", &|r| {
        r.reaction_burst_ms.cell()
    });
    row("attach only: attaches/s", &|r| {
        format!(
            "{:.0} ({} in {:.1} s)",
            r.attach.attaches_per_s, r.attach.volumes, r.attach.attach_s
        )
    });
    row("attach only: detaches/s", &|r| {
        format!(
            "{:.0} ({:.1} s)",
            r.attach.detaches_per_s, r.attach.detach_s
        )
    });
    row(
        "attach only: claims published/s (attached, staged, published)",
        &|r| {
            format!(
                "{:.0} ({:.1} s; CPU ms per claim {})",
                r.attach.published_per_s,
                r.attach.published_s,
                r.attach.cpu_ms_per_claim_published.ms_cell()
            )
        },
    );
    row("CPU during attach", &|r| r.attach.cpu_attach.cell());
    row("CPU during detach", &|r| r.attach.cpu_detach.cell());
    row("attach only: single attach, idle", &|r| {
        r.attach.single_attach_ms.cell()
    });
    row("CPU ms per attachment (attach / detach)", &|r| {
        format!(
            "{} / {}",
            r.attach.cpu_ms_per_claim_attach.ms_cell(),
            r.attach.cpu_ms_per_claim_detach.ms_cell()
        )
    });
    row("store requests per attach", &|r| {
        requests_cell(&r.attach.store_requests_per_attach)
    });
    row("store requests per detach", &|r| {
        requests_cell(&r.attach.store_requests_per_detach)
    });
    row("NodePublish per attachment during the attach", &|r| {
        format!("{:.2}", r.attach.node_publishes_during_attach)
    });
    row("ControllerPublish calls per attachment", &|r| {
        let log = r
            .attach
            .controller_publish_calls_per_attachment_plugin_log
            .map_or("no plugin log".to_string(), |v| {
                format!("plugin log {v:.3}")
            });
        format!(
            "{:.3} (agents' metrics; {log})",
            r.attach.controller_publish_calls_per_attachment
        )
    });
    row("restart: controller acts again after", &|r| {
        format!("{:.2} s", r.restart.controller_back_s)
    });
    row("restart: claims published in total", &|r| {
        format!("{} in {:.1} s", r.restart.claims, r.restart.total_s)
    });
    row("restart: CSI publish calls repeated", &|r| {
        r.restart.repeated_calls.to_string()
    });
    row("scale: claims / nodes stored", &|r| {
        sc(r, |s| {
            format!(
                "{} / {} ({} keys seeded at {:.0}/s)",
                s.claims, s.nodes, s.seeded_keys, s.seed_keys_per_s
            )
        })
    });
    row("scale: stored bytes per claim's objects", &|r| {
        sc(r, |s| {
            let kinds: Vec<String> = s
                .stored_bytes_by_kind
                .iter()
                .map(|(k, b)| format!("{k} {b}"))
                .collect();
            format!("{} ({})", s.stored_bytes_per_set, kinds.join(", "))
        })
    });
    row("scale: list every claim", &|r| {
        sc(r, |s| format!("{:.2} s", s.list_claims_s))
    });
    row(
        "scale: controller start -> serving (listed, no change due)",
        &|r| sc(r, |s| s.controller.serving_cell()),
    );
    row("scale: controller start -> synced", &|r| {
        sc(r, |s| s.controller.cell())
    });
    row("scale: controller writes while syncing", &|r| {
        sc(r, |s| s.controller.writes.to_string())
    });
    row("scale: plugin controller agent start -> synced", &|r| {
        sc(r, |s| {
            format!("{} ({} claims)", s.controller_agent.cell(), s.agent_claims)
        })
    });
    row("scale: its writes / CSI calls while syncing", &|r| {
        sc(r, |s| {
            format!(
                "{} / {}",
                s.controller_agent.writes, s.controller_agent.csi_calls
            )
        })
    });
    row("scale: node-only agent start -> synced", &|r| {
        sc(r, |s| {
            s.node_agent_by_cluster_claims
                .iter()
                .map(|(n, a)| format!("{n} stored: {}", a.cell()))
                .collect::<Vec<_>>()
                .join("; ")
        })
    });
    row("scale: its writes / CSI calls while syncing", &|r| {
        sc(r, |s| {
            format!("{} / {}", s.node_agent.writes, s.node_agent.csi_calls)
        })
    });
    row("scale: console start -> listed", &|r| {
        sc(r, |s| {
            s.console.as_ref().map_or_else(
                || "-".to_string(),
                |c| {
                    format!(
                        "{:.1} s, RSS {:.0} MiB; {:.0} MiB after its pages (peak {:.0})",
                        c.ready_s, c.ready_rss_mib, c.served_rss_mib, c.peak_rss_mib
                    )
                },
            )
        })
    });
    row("scale: console server time per page (median)", &|r| {
        sc(r, |s| {
            s.console.as_ref().map_or_else(
                || "-".to_string(),
                |c| {
                    c.pages
                        .iter()
                        .map(|(what, p)| format!("{what} {:.1} ms", p.server_ms))
                        .collect::<Vec<_>>()
                        .join("; ")
                },
            )
        })
    });
    let ch = |r: &Run, f: &dyn Fn(&crate::churn::ChurnRun) -> String| {
        r.churn.as_ref().map_or_else(|| "-".to_string(), f)
    };
    row("churn: cycles (wave, retention)", &|r| {
        ch(r, &|c| {
            format!("{} ({}, {} s)", c.cycles, c.wave, c.retention_s)
        })
    });
    row("churn: cycles per s", &|r| {
        ch(r, &|c| format!("{:.0}", c.cycles_per_s))
    });
    row("churn: ended-work keys before / max / after", &|r| {
        ch(r, &|c| {
            format!(
                "{} / {} / {}",
                c.work_keys_before, c.work_keys_max, c.work_keys_after
            )
        })
    });
    row("churn: all keys before / after (events expire)", &|r| {
        ch(r, &|c| {
            format!("{} / {}", c.all_keys_before, c.all_keys_after)
        })
    });
    row(
        "churn: dbSizeInUse after compaction, before / after",
        &|r| {
            ch(r, &|c| {
                format!(
                    "{:.1} / {:.1} MiB",
                    c.db_in_use_before as f64 / 1048576.0,
                    c.db_in_use_after as f64 / 1048576.0
                )
            })
        },
    );
    row("churn: event keys per cycle (each lives 1 h)", &|r| {
        ch(r, &|c| format!("{:.1}", c.events_per_cycle))
    });
    row("churn: keys / dbSizeInUse once the events expired", &|r| {
        ch(r, &|c| {
            format!(
                "{} / {:.1} MiB",
                c.all_keys_after_events,
                c.db_in_use_after_events as f64 / 1048576.0
            )
        })
    });
    let width = rows.iter().map(|(n, _)| n.len()).max().unwrap_or(0);
    let col = rows
        .iter()
        .flat_map(|(_, v)| v.iter().map(String::len))
        .max()
        .unwrap_or(0)
        .max(10);
    let mut out = format!("{:width$}", "");
    for r in runs {
        out.push_str(&format!("  {:col$}", r.store));
    }
    out.push('\n');
    for (name, values) in rows {
        out.push_str(&format!("{name:width$}"));
        for v in values {
            out.push_str(&format!("  {v:col$}"));
        }
        out.push('\n');
    }
    out
}

/// A scale figure, or `-` when the scale phase did not run.
pub(super) fn sc(r: &Run, f: impl Fn(&scale::ScaleRun) -> String) -> String {
    r.scale.as_ref().map_or_else(|| "-".to_string(), f)
}
