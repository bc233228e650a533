#!/usr/bin/env bash
# Takes the console's screenshots in docs/console/ (overview.png, volume.png): starts
# `moord dev` in a temporary directory, makes the quickstart's volume, publishes it for a
# workload that sleeps, has a second claim wait on a volume that fails to stage, and
# photographs the pages with headless Chromium. Not part of the tests; run it after a
# change to the pages:
#
#   cargo build --workspace --bins && bash docs/console/screenshots.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
. deploy/needs.sh
need chromium chromium
BIN=${MOOR_BIN:-target/debug}
TMP=$(mktemp -d /tmp/moor-shots.XXXXXX)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$BIN/moord" dev --data-dir "$TMP/dev" --listen "127.0.0.1:$PORT" --console 127.0.0.1:0 >"$TMP/moord.log" 2>&1 &
DEV=$!
cleanup() {
    kill "$DEV" 2>/dev/null || true
    wait "$DEV" 2>/dev/null || true
    rm -rf "$TMP"
}
trap cleanup EXIT
export MOOR_ENDPOINTS=http://127.0.0.1:$PORT
for _ in $(seq 1 300); do
    if "$BIN/moorctl" plugin status hostpath.moor.dev 2>/dev/null | grep -q 'Nodes Healthy *= 1'; then break; fi
    sleep 0.2
done
CONSOLE=$(sed -n 's/^  console: //p' "$TMP/moord.log" | tail -n 1)
"$BIN/moorctl" apply -f deploy/examples/quickstart.yaml
"$BIN/moorctl" wait volume/web-data --for phase=ready --timeout 60s
"$BIN/moorctl" alloc run web-1 -f deploy/examples/web-1.yaml -- sleep 60 &
# A volume whose stage keeps failing: its fs type is one mkfs does not know.
cat >"$TMP/stuck.yaml" <<'YAML'
apiVersion: moor/v1
kind: Volume
metadata: {name: logs}
spec:
  plugin_id: hostpath.moor.dev
  capacity_min: 64MiB
  capabilities:
    - {access_mode: single-node-writer, attachment_mode: file-system}
  mount_options: {fs_type: no-such-fs}
---
apiVersion: moor/v1
kind: Allocation
metadata: {name: collector-1}
spec:
  node: local
  volumes:
    - {name: logs, volume: logs}
YAML
"$BIN/moorctl" apply -f "$TMP/stuck.yaml"
"$BIN/moorctl" wait claim/web-1.data --for phase=published --timeout 60s
sleep 3
shot() {
    chromium --headless --no-sandbox --disable-gpu --disable-background-networking \
        --disable-component-update --disable-sync --no-first-run \
        --user-data-dir="$TMP/chromium" --hide-scrollbars --window-size=1280,"$3" \
        --screenshot="$2" "$1" 2>/dev/null
    echo "wrote $2"
}
shot "${CONSOLE}" docs/console/overview.png 1000
shot "${CONSOLE}volumes/default/web-data" docs/console/volume.png 900
