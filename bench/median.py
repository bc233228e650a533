#!/usr/bin/env python3
"""The median of several moor-bench JSON files, per figure, with each run's value.

    python3 bench/median.py run1.json run2.json run3.json
"""
import json
import statistics
import sys

def batched(r, ops):
    """The ceiling's ops/s for guarded transactions of `ops` operations."""
    return next(b["ops_per_s"] for b in r["ceiling"]["batched_cas_ops_per_s"] if b["ops_per_txn"] == ops)


FIGURES = [
    ("ceiling: CAS updates/s", lambda r: r["ceiling"]["cas_updates_per_s"], "{:.0f}"),
    ("ceiling: guarded txn of 8 ops, ops/s", lambda r: batched(r, 8), "{:.0f}"),
    ("ceiling: guarded txn of 64 ops, ops/s", lambda r: batched(r, 64), "{:.0f}"),
    ("claims/s published", lambda r: r["claims_per_s_publish"], "{:.0f}"),
    ("claims/s released", lambda r: r["claims_per_s_release"], "{:.0f}"),
    ("published per 1,000 CAS/s", lambda r: 1000 * r["claims_per_s_publish"] / r["ceiling"]["cas_updates_per_s"], "{:.1f}"),
    ("released per 1,000 CAS/s", lambda r: 1000 * r["claims_per_s_release"] / r["ceiling"]["cas_updates_per_s"], "{:.1f}"),
    ("store writes per claim published", lambda r: r["etcd_writes_per_claim_publish"], "{:.1f}"),
    ("store writes per claim released", lambda r: r["etcd_writes_per_claim_release"], "{:.1f}"),
    ("node journal commits per claim published", lambda r: r.get("journal_per_claim_publish", {}).get("commits", 0), "{:.2f}"),
    ("node journal fdatasyncs per claim published", lambda r: r.get("journal_per_claim_publish", {}).get("syncs", 0), "{:.2f}"),
    ("node journal commits per claim released", lambda r: r.get("journal_per_claim_release", {}).get("commits", 0), "{:.2f}"),
    ("node journal fdatasyncs per claim released", lambda r: r.get("journal_per_claim_release", {}).get("syncs", 0), "{:.2f}"),
    ("CPU ms per claim published: store", lambda r: r["cpu_ms_per_claim_publish"]["store"], "{:.2f}"),
    ("CPU ms per claim published: controller", lambda r: r["cpu_ms_per_claim_publish"]["controller"], "{:.2f}"),
    ("CPU ms per claim published: agents", lambda r: r["cpu_ms_per_claim_publish"]["agents"], "{:.2f}"),
    ("CPU ms per claim published: plugins", lambda r: r["cpu_ms_per_claim_publish"]["plugins"], "{:.2f}"),
    ("reaction idle p50 ms", lambda r: r["reaction_idle_ms"]["p50_ms"], "{:.1f}"),
    ("reaction idle p99 ms", lambda r: r["reaction_idle_ms"]["p99_ms"], "{:.1f}"),
    ("reaction burst p50 ms", lambda r: r["reaction_burst_ms"]["p50_ms"], "{:.0f}"),
    ("reaction burst p99 ms", lambda r: r["reaction_burst_ms"]["p99_ms"], "{:.0f}"),
    ("attach only: attaches/s", lambda r: r["attach"]["attaches_per_s"], "{:.0f}"),
    ("attach only: detaches/s", lambda r: r["attach"]["detaches_per_s"], "{:.0f}"),
    ("attach only: claims published/s (whole path)", lambda r: r["attach"]["published_per_s"], "{:.0f}"),
    ("CPU ms per claim, whole path: store", lambda r: r["attach"]["cpu_ms_per_claim_published"]["store"], "{:.2f}"),
    ("CPU ms per claim, whole path: controller", lambda r: r["attach"]["cpu_ms_per_claim_published"]["controller"], "{:.2f}"),
    ("CPU ms per claim, whole path: agents", lambda r: r["attach"]["cpu_ms_per_claim_published"]["agents"], "{:.2f}"),
    ("CPU ms per claim, whole path: plugins", lambda r: r["attach"]["cpu_ms_per_claim_published"]["plugins"], "{:.2f}"),
    ("CPU ms per claim, whole path: all", lambda r: sum(r["attach"]["cpu_ms_per_claim_published"][k] for k in ("store", "controller", "agents", "plugins")), "{:.2f}"),
    ("attach only: single attach p50 ms", lambda r: r["attach"]["single_attach_ms"]["p50_ms"], "{:.1f}"),
    ("attach only: NodePublish per attachment during the attach", lambda r: r["attach"]["node_publishes_during_attach"], "{:.2f}"),
    ("ControllerPublish per attachment (metrics)", lambda r: r["attach"]["controller_publish_calls_per_attachment"], "{:.3f}"),
    ("CPU ms per attach: store", lambda r: r["attach"]["cpu_ms_per_claim_attach"]["store"], "{:.2f}"),
    ("CPU ms per attach: controller", lambda r: r["attach"]["cpu_ms_per_claim_attach"]["controller"], "{:.2f}"),
    ("CPU ms per attach: agents", lambda r: r["attach"]["cpu_ms_per_claim_attach"]["agents"], "{:.2f}"),
    ("CPU ms per attach: plugins", lambda r: r["attach"]["cpu_ms_per_claim_attach"]["plugins"], "{:.2f}"),
    ("CPU ms per detach: store", lambda r: r["attach"]["cpu_ms_per_claim_detach"]["store"], "{:.2f}"),
    ("CPU ms per detach: controller", lambda r: r["attach"]["cpu_ms_per_claim_detach"]["controller"], "{:.2f}"),
    ("CPU ms per detach: agents", lambda r: r["attach"]["cpu_ms_per_claim_detach"]["agents"], "{:.2f}"),
    ("CPU ms per detach: plugins", lambda r: r["attach"]["cpu_ms_per_claim_detach"]["plugins"], "{:.2f}"),
    ("restart: controller acts again after s", lambda r: r["restart"]["controller_back_s"], "{:.2f}"),
    ("restart: CSI publish calls repeated", lambda r: r["restart"]["repeated_calls"], "{:.0f}"),
    ("scale: stored bytes per claim's objects", lambda r: r["scale"]["stored_bytes_per_set"], "{:.0f}"),
]
REQUESTS = [
    ("publish", lambda r: r["store_requests_per_claim_publish"]),
    ("release", lambda r: r["store_requests_per_claim_release"]),
    ("attach", lambda r: r["attach"]["store_requests_per_attach"]),
    ("detach", lambda r: r["attach"]["store_requests_per_detach"]),
]
SCALE = [
    ("controller", "serving_s", "{:.1f}"),
    ("controller", "serving_rss_mib", "{:.0f}"),
    ("controller", "synced_s", "{:.1f}"),
    ("controller", "rss_mib", "{:.0f}"),
    ("controller", "peak_rss_mib", "{:.0f}"),
    ("controller", "cpu_s", "{:.1f}"),
    ("controller_agent", "synced_s", "{:.1f}"),
    ("controller_agent", "rss_mib", "{:.0f}"),
    ("controller_agent", "peak_rss_mib", "{:.0f}"),
    ("controller_agent", "cpu_s", "{:.1f}"),
    ("node_agent", "synced_s", "{:.2f}"),
    ("node_agent", "rss_mib", "{:.0f}"),
    ("node_agent", "peak_rss_mib", "{:.0f}"),
    ("node_agent", "cpu_s", "{:.2f}"),
]


def rows(runs):
    """(name, format, getter) for every figure all of `runs` carry the inputs of."""
    out = list(FIGURES)
    for phase, get in REQUESTS:
        methods = set()
        for r in runs:
            try:
                methods |= set(get(r))
            except (KeyError, TypeError):
                pass
        for m in sorted(methods):
            out.append((f"store requests per claim, {phase}: {m}",
                        lambda r, g=get, m=m: g(r).get(m, 0.0), "{:.2f}"))
    for who, field, fmt in SCALE:
        out.append((f"scale.{who}.{field}", lambda r, w=who, f=field: r["scale"][w][f], fmt))
    if runs and all(r.get("scale") for r in runs):
        sizes = sorted(set.intersection(*[set(r["scale"]["node_agent_by_cluster_claims"]) for r in runs]), key=int)
        for n in sizes:
            for field, fmt in [("synced_s", "{:.2f}"), ("rss_mib", "{:.0f}")]:
                out.append((f"scale.node_agent at {n} claims stored: {field}",
                            lambda r, n=n, f=field: r["scale"]["node_agent_by_cluster_claims"][n][f], fmt))
    return out


def values(runs, get):
    """Each run's value of a figure, or None when a run lacks it."""
    try:
        return [get(r) for r in runs]
    except (KeyError, TypeError, IndexError, StopIteration):
        return None


def load(path):
    """A moor-bench JSON file's first store's run."""
    return json.load(open(path))[0]


def main(paths):
    runs = [load(p) for p in paths]
    table = rows(runs)
    width = max(len(name) for name, _, _ in table)
    for name, get, fmt in table:
        got = values(runs, get)
        if got is None:
            continue
        each = ", ".join(fmt.format(v) for v in got)
        print(f"{name:<{width}}  {fmt.format(statistics.median(got)):>8}   ({each})")


if __name__ == "__main__":
    main(sys.argv[1:])
