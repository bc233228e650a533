#!/usr/bin/env bash
# The newcomer's demo, start to finish: build moor, start `moord dev` (embedded store,
# controller, agent for node `local`, moor-hostpath), create a volume, ask where a
# workload could use it, run one that writes into it (`moorctl alloc run`: the volume is
# published, the command gets its path, its end releases it), run a second that reads
# the data back, then clean up.
#
#   bash deploy/quickstart.sh            # KEEP=1 leaves moord dev running afterwards
#
# MOOR_BIN (prebuilt binaries, skips the build), MOOR_DEV_DATA (data dir, default
# .moor-dev) and MOOR_DEV_LISTEN (store address, default 127.0.0.1:2379) override.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${MOOR_BIN:-target/debug}
DATA=${MOOR_DEV_DATA:-.moor-dev}
LISTEN=${MOOR_DEV_LISTEN:-127.0.0.1:2379}
if [ -z "${MOOR_BIN:-}" ]; then
    # The build compiles the CSI and etcd protocols: it needs protoc.
    . deploy/needs.sh
    need protoc protobuf-compiler
    echo "# building moor (cargo build --workspace --bins)"
    cargo build --quiet --workspace --bins
fi
export MOOR_ENDPOINTS="http://$LISTEN"
mkdir -p "$DATA"

echo "# starting moord dev (data in $DATA, logs in $DATA/moord.log)"
"$BIN/moord" dev --data-dir "$DATA" --listen "$LISTEN" >"$DATA/moord.log" 2>&1 &
DEV=$!
stop_dev() {
    kill "$DEV" 2>/dev/null || true
    wait "$DEV" 2>/dev/null || true
}
if [ "${KEEP:-}" != 1 ]; then trap stop_dev EXIT; fi

moorctl() {
    echo
    echo "\$ moorctl $(printf '%q ' "$@")"
    "$BIN/moorctl" "$@"
}

# Ready when the plugin reports a healthy node (moord dev prints the same on stderr).
for _ in $(seq 1 300); do
    status=$("$BIN/moorctl" plugin status hostpath.moor.dev 2>/dev/null || true)
    if grep -q 'Nodes Healthy *= 1' <<<"$status"; then
        break
    fi
    if ! kill -0 "$DEV" 2>/dev/null; then
        echo "moord dev exited:" >&2
        tail -n 20 "$DATA/moord.log" >&2
        exit 1
    fi
    sleep 0.2
done

moorctl plugin status
moorctl apply -f deploy/examples/quickstart.yaml
moorctl wait volume/web-data --for phase=ready --timeout 60s

# The web console moord dev serves (its URL is in moord.log): the volume is there.
CONSOLE=$(sed -n 's/^  console: //p' "$DATA/moord.log" | tail -n 1)
console_page() {
    local hostport=${CONSOLE#http://}
    hostport=${hostport%/}
    exec 3<>"/dev/tcp/${hostport%:*}/${hostport##*:}"
    printf 'GET %s HTTP/1.0\r\nHost: %s\r\n\r\n' "$1" "$hostport" >&3
    cat <&3
    exec 3<&-
}
if [ -n "$CONSOLE" ] && console_page /volumes/default/web-data | grep -q '<h1>Volume web-data'; then
    echo
    echo "# the web console shows it: ${CONSOLE}volumes/default/web-data"
else
    echo "# the web console (${CONSOLE:-not started}) does not show web-data; see $DATA/moord.log" >&2
    exit 1
fi
moorctl alloc plan -f deploy/examples/web-1.yaml
# A workload that writes into the volume: moorctl publishes it on node local, runs the
# command with MOOR_VOLUME_DATA set to its path, and releases it when the command ends.
moorctl alloc run web-1 -f deploy/examples/web-1.yaml -- \
    sh -c 'date > "$MOOR_VOLUME_DATA/hello" && echo "web-1 wrote $MOOR_VOLUME_DATA/hello"'
moorctl get allocations
# A second workload on the same volume, read-only, reads the data back.
moorctl alloc run web-2 --node local --volume data=web-data:ro -- \
    sh -c 'echo "web-2 read: $(cat "$MOOR_VOLUME_DATA/hello")"'
moorctl describe allocation web-2
moorctl events
moorctl delete allocation web-1
moorctl delete allocation web-2
moorctl wait claim/web-2.data --for delete --timeout 60s
moorctl delete volume web-data
moorctl wait volume/web-data --for delete --timeout 60s

if [ "${KEEP:-}" = 1 ]; then
    echo
    echo "# moord dev keeps running (pid $DEV); try: export MOOR_ENDPOINTS=$MOOR_ENDPOINTS"
fi
