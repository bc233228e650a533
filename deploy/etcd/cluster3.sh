#!/usr/bin/env bash
# A 3-member etcd cluster on loopback, in the background, for trying failover by hand.
#
#   deploy/etcd/cluster3.sh start DIR [BASE_PORT]   # members on BASE_PORT, +10, +20 (client)
#   deploy/etcd/cluster3.sh stop DIR
#
# `start` waits until the cluster is healthy and prints the endpoints for
# MOOR_ENDPOINTS / --etcd. Each member logs to DIR/mN.log; pids are in DIR/mN.pid.
set -euo pipefail
CMD=${1:?start|stop}
DIR=${2:?data directory}
BASE=${3:-2379}

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
    for _ in $(seq 1 150); do
        if ETCDCTL_API=3 etcdctl --endpoints "$(endpoints)" endpoint health >/dev/null 2>&1; then
            echo "$(endpoints)"
            exit 0
        fi
        sleep 0.2
    done
    echo "the cluster did not become healthy; see $DIR/m*.log" >&2
    exit 1
    ;;
stop)
    for i in 1 2 3; do
        if [ -f "$DIR/m$i.pid" ]; then
            kill "$(cat "$DIR/m$i.pid")" 2>/dev/null || true
            rm -f "$DIR/m$i.pid"
        fi
    done
    ;;
*)
    echo "usage: $0 start|stop DIR [BASE_PORT]" >&2
    exit 2
    ;;
esac
