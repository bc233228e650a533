#!/usr/bin/env bash
# A 3-member etcd cluster on loopback, in the background, for trying failover by hand.
#
#   deploy/etcd/cluster3.sh start DIR [BASE_PORT]   # members on BASE_PORT, +10, +20 (client)
#   deploy/etcd/cluster3.sh stop DIR
#
# `start` waits until the cluster is healthy (at most CLUSTER3_WAIT seconds, 60 by
# default; at once an error naming the member that exited) and prints the endpoints for
# MOOR_ENDPOINTS / --etcd; a start that fails stops the members it started. Each member
# logs to DIR/mN.log; pids are in DIR/mN.pid.
set -euo pipefail
CMD=${1:?start|stop}
DIR=${2:?data directory}
BASE=${3:-2379}
# etcd and etcdctl refuse a setting given both by a variable and a flag (ETCD_NAME,
# ETCDCTL_ENDPOINTS set in the caller's shell): the flags below decide.
unset $(compgen -e | grep -E '^ETCD(CTL)?_' || true)

endpoints() {
    local out=""
    for i in 1 2 3; do out+="${out:+,}http://127.0.0.1:$((BASE + (i - 1) * 10))"; done
    echo "$out"
}

case "$CMD" in
start)
    mkdir -p "$DIR"
    cluster=""
    for i in 1 2 3; do
        cluster+="${cluster:+,}m$i=http://127.0.0.1:$((BASE + (i - 1) * 10 + 1))"
    done
    for i in 1 2 3; do
        client=$((BASE + (i - 1) * 10))
        peer=$((client + 1))
        etcd --name "m$i" --data-dir "$DIR/m$i" \
            --listen-client-urls "http://127.0.0.1:$client" --advertise-client-urls "http://127.0.0.1:$client" \
            --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
            --initial-cluster "$cluster" --initial-cluster-state new --initial-cluster-token moor \
            --auto-compaction-mode periodic --auto-compaction-retention 1h \
            >"$DIR/m$i.log" 2>&1 &
        echo $! >"$DIR/m$i.pid"
    done
    # Healthy within WAIT seconds (a bootstrap takes about 3 s on an idle machine), or
    # at once a clear failure when a member has exited (a port taken is the usual cause).
    deadline=$((SECONDS + ${CLUSTER3_WAIT:-60}))
    while [ "$SECONDS" -lt "$deadline" ]; do
        for i in 1 2 3; do
            if ! kill -0 "$(cat "$DIR/m$i.pid")" 2>/dev/null; then
                echo "member m$i exited: $(grep -E ' [CF] \||"level":"fatal"' "$DIR/m$i.log" | tail -1)" >&2
                echo "see $DIR/m$i.log" >&2
                bash "$0" stop "$DIR"
                exit 1
            fi
        done
        if ETCDCTL_API=3 etcdctl --dial-timeout 1s --command-timeout 2s \
            --endpoints "$(endpoints)" endpoint health >/dev/null 2>&1; then
            echo "$(endpoints)"
            exit 0
        fi
        sleep 0.2
    done
    echo "the cluster did not become healthy within ${CLUSTER3_WAIT:-60}s; see $DIR/m*.log" >&2
    bash "$0" stop "$DIR"
    exit 1
    ;;
stop)
    # One member after another, each SIGKILLed if it has not ended 10 s after SIGTERM:
    # stopped all at once, the leader spends ~9 s trying to hand its leadership over.
    for i in 1 2 3; do
        [ -f "$DIR/m$i.pid" ] || continue
        pid=$(cat "$DIR/m$i.pid")
        rm -f "$DIR/m$i.pid"
        kill "$pid" 2>/dev/null || continue
        for _ in $(seq 1 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$pid" 2>/dev/null || true
    done
    ;;
*)
    echo "usage: $0 start|stop DIR [BASE_PORT]" >&2
    exit 2
    ;;
esac
