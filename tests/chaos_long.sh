#!/usr/bin/env bash
# The randomized fault suite's long mode: SEEDS scripts of OPS operations each, PARALLEL
# at a time, each its own cluster; prints one Markdown table row per seed (seed,
# operations, CSI calls, failed calls, kills, partitions, pauses, full disks, duration,
# verdict) and keeps every run's
# output in the log directory. The binaries are copied first, so rebuilding the tree
# while it runs does not change what runs.
#
#   bash tests/chaos_long.sh [FIRST_SEED=1001] [SEEDS=20] [OPS=1000] [PARALLEL=4]
#
# A failing seed replays with MOOR_CHAOS_SEED=N MOOR_CHAOS_OPS=OPS (the same script; the
# processes' timing still varies); its cluster directory is kept and named in its log.
set -euo pipefail
cd "$(dirname "$0")/.."
first=${1:-1001} seeds=${2:-20} ops=${3:-1000} parallel=${4:-4}
. deploy/needs.sh
need protoc protobuf-compiler
need etcd etcd-server
need etcdctl etcd-client
cargo build -p moor-controllers -p moor-hostpath -p moorctl -p moor-embedded --bins
exe=$(cargo test --test chaos --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "chaos" and m.get("executable"):
        print(m["executable"])')
dir=$(mktemp -d /tmp/moor-chaos-long.XXXXXX)
mkdir -p "$dir/bin/deps"
cp target/debug/moord target/debug/moorctl target/debug/moor-hostpath target/debug/moor-store "$dir/bin/"
cp "$exe" "$dir/bin/deps/chaos"
echo "logs in $dir ($(git rev-parse --short HEAD), $ops ops per seed, $parallel at a time)" >&2

run_one() {
    local seed=$1 start rc
    start=$(date +%s)
    rc=0
    MOOR_CHAOS_SEED=$seed MOOR_CHAOS_OPS=$ops timeout 3600 "$dir/bin/deps/chaos" --nocapture \
        >"$dir/seed$seed.log" 2>&1 || rc=$?
    echo "$seed $rc $(($(date +%s) - start))" >>"$dir/done"
}
for ((i = 0; i < seeds; i++)); do
    while (($(jobs -rp | wc -l) >= parallel)); do sleep 2; done
    run_one $((first + i)) &
done
wait
echo "| seed | operations | CSI calls | failed calls | kills | partitions | pauses | full disks | duration | verdict |"
echo "|---|---|---|---|---|---|---|---|---|---|"
sort -n "$dir/done" | while read -r seed rc secs; do
    summary=$(grep -E '^chaos: [0-9]+ ops' "$dir/seed$seed.log" | tail -1 || true)
    read -r lines calls failed kills parts pauses disks < <(echo "$summary" |
        sed -E 's/^chaos: ([0-9]+) ops, ([0-9]+) calls, ([0-9]+) failed .*, ([0-9]+) kills, ([0-9]+) partitions, ([0-9]+) pauses, ([0-9]+) full disks.*/\1 \2 \3 \4 \5 \6 \7/;t;s/.*/- - - - - - -/')
    verdict=passed
    if [ "$rc" != 0 ]; then
        verdict="FAILED: $(grep -m1 -E 'invariant [0-9]|no every|no everything|panicked at' "$dir/seed$seed.log" | cut -c1-120 || true)"
    fi
    echo "| $seed | $lines | $calls | $failed | $kills | $parts | $pauses | $disks | ${secs} s | $verdict |"
done
