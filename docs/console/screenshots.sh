#!/usr/bin/env bash
# Takes the console's screenshots in docs/console/ (overview.png, volume.png): starts
# `moord dev` in a temporary directory, makes the quickstart's volume, publishes it for a
# workload that sleeps, has a second claim wait on a NodeStage that fails, and
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
    jobs -p | xargs -r kill 2>/dev/null || true
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
"$BIN/moorctl" wait claim/web-1.data --for phase=published --timeout 60s
# A second volume whose NodeStage keeps failing: a fault moor-hostpath injects on
# its admin socket (the overview's waiting list then has a claim to show).
python3 - "$TMP/dev/plugin/admin.sock" <<'PY'
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall((json.dumps({"op": "fail", "rpc": "NodeStageVolume", "code": "Unavailable", "times": 1000}) + "\n").encode())
print("fault:", s.recv(4096).decode().strip())
PY
sed 's/web-data/logs/' deploy/examples/quickstart.yaml >"$TMP/logs.yaml"
"$BIN/moorctl" apply -f "$TMP/logs.yaml"
"$BIN/moorctl" wait volume/logs --for phase=ready --timeout 60s
"$BIN/moorctl" alloc run collector-1 --node local --volume data=logs -- sleep 60 &
sleep 3
shot() {
    chromium --headless --no-sandbox --disable-gpu --disable-background-networking \
        --disable-component-update --disable-sync --no-first-run \
        --user-data-dir="$TMP/chromium" --hide-scrollbars --window-size=1280,"$3" \
        --screenshot="$2" "$1" 2>/dev/null
    echo "wrote $2"
}
shot "${CONSOLE}" docs/console/overview.png 720
shot "${CONSOLE}volumes/default/web-data" docs/console/volume.png 900
