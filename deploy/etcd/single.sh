#!/usr/bin/env bash
# One etcd member on loopback, in the foreground (Ctrl-C stops it).
#
#   deploy/etcd/single.sh [DATA_DIR] [CLIENT_PORT]
#
# moor's default endpoint is http://127.0.0.1:2379. Auto-compaction keeps an hour of
# history, enough for watchers that reconnect; moor never deletes large ranges at once.
set -euo pipefail
DATA=${1:-/var/lib/moor-etcd}
PORT=${2:-2379}
PEER=$((PORT + 1))
exec etcd --name moor-1 --data-dir "$DATA" \
    --listen-client-urls "http://127.0.0.1:$PORT" --advertise-client-urls "http://127.0.0.1:$PORT" \
    --listen-peer-urls "http://127.0.0.1:$PEER" --initial-advertise-peer-urls "http://127.0.0.1:$PEER" \
    --initial-cluster "moor-1=http://127.0.0.1:$PEER" \
    --auto-compaction-mode periodic --auto-compaction-retention 1h
