#!/usr/bin/env bash
# Profile every process during the publish phase of the bench, for one build.
#
#   bash bench/profile-publish.sh BIN_DIR OUT_DIR [moor-bench args...]
#
# PHASE=releasing profiles the release phase instead (the 5 s from its start);
# CALLGRAPH=none records without call graphs (a flat profile, read in seconds).
#
# BIN_DIR holds moord, moor-hostpath and moor-store built with line tables
# (CARGO_PROFILE_RELEASE_DEBUG=line-tables-only CARGO_TARGET_DIR=target/prof cargo build
# --release --workspace --bins). Runs the working tree's moor-bench with --claims 2000
# --nodes 4 and small other phases, attaches `perf record -a` for 5 s once the harness
# prints "publishing", and keeps the process list (OUT_DIR/ps.txt) to tell the agents,
# the controller, the plugins and etcd apart in `perf script -F pid,ip,sym -G`.
set -euo pipefail
bin=$1
out=$2
shift 2
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/target/release/moor-bench" --bin-dir "$bin" --claims 2000 --nodes 4 --attach 100 \
    --scale 0 --reaction-samples 10 --single-attaches 1 --store etcd \
    --json "$out/bench.json" "$@" >"$out/bench.log" 2>&1 &
bench=$!
phase=${PHASE:-publishing}
until grep -q "$phase" "$out/bench.log"; do
    kill -0 "$bench" 2>/dev/null || { echo "moor-bench ended before $phase; see $out/bench.log" >&2; exit 1; }
    sleep 0.05
done
ps -eo pid,args | grep -E "moord|moor-hostpath|etcd --name" | grep -v grep >"$out/ps.txt" || true
graph=(--call-graph dwarf,8192)
[ "${CALLGRAPH:-dwarf}" = none ] && graph=()
perf record -a -F 249 "${graph[@]}" -o "$out/perf.data" -- sleep 5 >"$out/perf.log" 2>&1
wait "$bench"
echo "profile in $out/perf.data, processes in $out/ps.txt, figures in $out/bench.log"
