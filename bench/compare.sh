#!/usr/bin/env bash
# Measure the working tree against a baseline commit in the same hour.
#
#   bash bench/compare.sh REV [moor-bench args...]
#
# Builds REV in a git worktree of its own (kept under target/compare/, reused by later
# runs of the same commit) and the working tree, then runs moor-bench on each build's
# binaries alternately, RUNS times each (default 3), base first, with the same
# arguments, and prints a Markdown table of each figure's medians and their ratio
# (bench/compare.py). Every run measures its own store ceiling, so each column carries
# the ceiling of the same hour. Nothing else may run meanwhile: every figure is
# CPU-bound on 2 cores.
#
#   RUNS=3                 runs per build
#   HARNESS=work|own       work (default): the working tree's moor-bench drives both
#                          builds (`--bin-dir`), so both run the same phases and report
#                          the same figures; own: each build's own moor-bench
#   COMPARE_OUT=DIR        where the JSON files and the table go (default: a new
#                          target/compare/run-DATE directory, kept)
#
# Example (the attach path, as issue 39 measures it):
#   bash bench/compare.sh 5345f6d --claims 100 --nodes 1 --attach 5000 --scale 0 --store etcd
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

if [ $# -lt 1 ]; then
    sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
rev=$1
shift
sha=$(git rev-parse --verify "$rev^{commit}")
short=$(git rev-parse --short "$sha")
runs=${RUNS:-3}
harness=${HARNESS:-work}
case "$harness" in work | own) ;; *) echo "HARNESS must be work or own, not '$harness'" >&2; exit 2 ;; esac
case "$runs" in '' | *[!0-9]* | 0) echo "RUNS must be a positive integer, not '$runs'" >&2; exit 2 ;; esac

compare=$root/target/compare
base_src=$compare/src-$short
out=${COMPARE_OUT:-$compare/run-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$compare" "$out"

if [ ! -d "$base_src" ]; then
    git worktree prune
    git worktree add --detach "$base_src" "$sha" >/dev/null
fi
echo "building the baseline $short in $base_src" >&2
(cd "$base_src" && CARGO_TARGET_DIR=$compare/target-$short cargo build --release --workspace --bins -q)
echo "building the working tree" >&2
cargo build --release --workspace --bins -q

base_bin=$compare/target-$short/release
work_bin=$root/target/release
work_label="working tree ($(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!target' || echo '+changes'))"

base_json=""
work_json=""
for i in $(seq 1 "$runs"); do
    for side in base work; do
        if [ "$side" = base ]; then bin=$base_bin; else bin=$work_bin; fi
        bench=$bin/moor-bench
        if [ "$harness" = work ]; then bench=$work_bin/moor-bench; fi
        json=$out/$side-$i.json
        echo "$(date -u +%H:%M:%S) run $i of $runs: $side" >&2
        "$bench" --bin-dir "$bin" --json "$json" "$@" >"$out/$side-$i.log" 2>&1 || {
            echo "moor-bench failed on $side (run $i): see $out/$side-$i.log" >&2
            tail -n 20 "$out/$side-$i.log" >&2
            exit 1
        }
        if [ "$side" = base ]; then base_json+="$json,"; else work_json+="$json,"; fi
    done
done

{
    echo "moor-bench $*; $runs runs each, alternately, $harness harness, $(date -u +%Y-%m-%d), $(nproc) cores"
    echo
    python3 "$root/bench/compare.py" "$short" "$work_label" "$base_json" "$work_json"
} | tee "$out/table.md"
echo "runs and table kept in $out" >&2
