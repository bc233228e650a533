#!/usr/bin/env python3
"""What each store revision of a benchmark's publish phase wrote.

    moor-bench --claims 300 --nodes 1 --attach 20 --scale 0 --store etcd --keep ...
    python3 bench/revisions.py /tmp/moor-bench-XXXXXX

Starts etcd on the kept run's data directory (ports 23998-23999), reads its whole
history under /moor/ (`etcdctl watch --rev=1 -w json`), and takes the publish phase as
the revisions from the first `pub-*` allocation's creation to the last one before the
first of them is stopped. Prints:

- the revisions by what they carried (kind:new/upd/del per kind, in one transaction),
  so that writes alone and writes sharing a transaction are told apart;
- the object writes per kind by the fields they changed, which do not depend on how
  the group commit happened to batch them.

Needs etcd and etcdctl on the PATH. The revision count per claim depends on timing
(group commit); the object writes do not.
"""

import base64
import collections
import json
import os
import subprocess
import sys
import time

URL = "http://127.0.0.1:23999"


def history(data_dir):
    etcd = subprocess.Popen(
        ["etcd", "--data-dir", data_dir, "--listen-client-urls", URL,
         "--advertise-client-urls", URL, "--listen-peer-urls", "http://127.0.0.1:23998"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            ok = subprocess.run(["etcdctl", "--endpoints", URL, "endpoint", "health"],
                                env=dict(os.environ, ETCDCTL_API="3"),
                                capture_output=True).returncode == 0
            if ok:
                break
            time.sleep(0.1)
        # A watch never ends by itself: it is cut once the history stopped coming.
        out = subprocess.run(
            ["timeout", "60", "etcdctl", "--endpoints", URL, "watch", "--rev=1",
             "--prefix", "/moor/", "-w", "json"],
            env=dict(os.environ, ETCDCTL_API="3"), capture_output=True, text=True).stdout
    finally:
        etcd.terminate()
        etcd.wait()
    for line in out.splitlines():
        try:
            batch = json.loads(line)
        except ValueError:
            continue
        for e in batch.get("Events", []):
            yield e


def flat(o, p=""):
    if isinstance(o, dict):
        out = {}
        for k, v in o.items():
            out.update(flat(v, f"{p}.{k}" if p else k))
        return out
    return {p: json.dumps(o, sort_keys=True)}


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    events = list(history(os.path.join(sys.argv[1], "etcd")))
    lo = hi = None
    for e in events:
        kv = e["kv"]
        key = base64.b64decode(kv["key"]).decode(errors="replace")
        if key.startswith("/moor/allocations/default/pub-"):
            lo = lo or kv["mod_revision"]
            value = base64.b64decode(kv.get("value", "")).decode(errors="replace")
            if hi is None and '"stop"' in value:
                hi = kv["mod_revision"] - 1
    if lo is None or hi is None:
        sys.exit("no publish phase found (pub-* allocations created, then stopped)")
    revisions = collections.defaultdict(set)
    writes = collections.Counter()
    last = {}
    claims = set()
    for e in events:
        kv = e["kv"]
        key = base64.b64decode(kv["key"]).decode(errors="replace")
        kind = key.split("/")[2]
        rev = kv.get("mod_revision", 0)
        deleted = e.get("type") == "DELETE" or "value" not in kv
        value = None if deleted else json.loads(base64.b64decode(kv["value"]))
        if lo <= rev <= hi:
            op = "del" if deleted else ("new" if kv.get("version") == 1 else "upd")
            revisions[rev].add(f"{kind}:{op}")
            if kind == "claims" and op == "new":
                claims.add(key)
            if op == "upd" and key in last:
                a, b = flat(last[key]), flat(value)
                changed = sorted(f for f in set(a) | set(b) if a.get(f) != b.get(f)
                                 and "time" not in f.lower())
                writes[(kind, ",".join(changed))] += 1
            elif op != "upd":
                writes[(kind, op)] += 1
        if deleted:
            last.pop(key, None)
        else:
            last[key] = value
    n = max(len(claims), 1)
    print(f"publish phase: revisions {lo}-{hi}, {len(claims)} claims made, "
          f"{len(revisions)} revisions ({len(revisions) / n:.2f} per claim)")
    print("\nrevisions by what they carried:")
    for what, count in collections.Counter(
            " + ".join(sorted(s)) for s in revisions.values()).most_common():
        print(f"{count:7d}  {what}")
    print("\nobject writes by kind and the fields they changed (per claim):")
    for (kind, what), count in sorted(writes.items()):
        print(f"{count / n:7.2f}  {kind}: {what[:160]}")


if __name__ == "__main__":
    main()
