#!/usr/bin/env bash
# How long a volume-plugin Mount takes on moor-hostpath, idle, with each engine:
# starts `moord dev --volume-plugin`, a dockerd of its own, and Podman with its own
# storage; runs N containers (default 20) per engine on one moor volume each, and
# prints the p50 and p90 of the endpoint's Mount and Unmount (its own log: "answered",
# elapsed_ms) and of the whole `run --rm` as the engine's client saw it.
#
#   bash bench/engines_mount.sh [N]
#
# Needs root, moord built (cargo build --workspace --bins), podman, runc, docker.io and
# busybox-static (../shared/CONTAINERS.md's recipes).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-20}
W=$(mktemp -d /tmp/moor-engines.XXXX)
PORT=$((20000 + RANDOM % 20000))
cleanup() {
    [ -f "$W/docker.pid" ] && kill "$(cat "$W/docker.pid")" 2>/dev/null || true
    [ -n "${DEV:-}" ] && kill "$DEV" 2>/dev/null || true
    rm -f "/etc/docker/plugins/moor-bench-$$.spec"
    sleep 2
    rm -rf "$W" 2>/dev/null || true
}
trap cleanup EXIT
target/debug/moord dev --data-dir "$W/dev" --listen "127.0.0.1:$PORT" \
    --volume-plugin "$W/moor.sock" >"$W/dev.log" 2>&1 &
DEV=$!
for _ in $(seq 60); do grep -q "is ready" "$W/dev.log" && break; sleep 1; done
mkdir -p "$W/rootfs/bin" && cp "$(command -v busybox)" "$W/rootfs/bin/"
for c in sh true; do ln -s busybox "$W/rootfs/bin/$c"; done
tar -C "$W/rootfs" -cf "$W/bb.tar" .

percentiles() { sort -n | awk '{a[NR]=$1} END {printf "p50 %d ms, p90 %d ms (n=%d)\n", a[int((NR+1)/2)], a[int(NR*0.9+0.5)], NR}'; }
mounts_since() { tail -n +"$1" "$W/dev.log" | grep 'volume-plugin request answered' | grep "verb=$2" | sed 's/.*elapsed_ms=\([0-9]*\).*/\1/'; }
client_runs() { for _ in $(seq "$N"); do s=$(date +%s%N); "$@" >/dev/null; echo $(( ($(date +%s%N) - s) / 1000000 )); done; }

# Podman.
cat >"$W/containers.conf" <<CONF
[engine]
volume_plugin_timeout = 120
[engine.volume_plugins]
moor = "$W/moor.sock"
CONF
P="podman --root $W/podman/storage --runroot $W/podman/run --runtime runc --cgroup-manager cgroupfs"
export CONTAINERS_CONF="$W/containers.conf"
$P import "$W/bb.tar" localhost/bb >/dev/null
$P volume create --driver moor pvol >/dev/null
from=$(($(wc -l <"$W/dev.log") + 1))
client=$(client_runs $P run --rm --network none --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 -v pvol:/data localhost/bb true | percentiles)
echo "podman: Mount $(mounts_since "$from" Mount | percentiles); Unmount $(mounts_since "$from" Unmount | percentiles); run --rm $client"
$P volume rm pvol >/dev/null

# Docker.
dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver=vfs \
    --data-root "$W/docker/root" --exec-root "$W/dx" -H "unix://$W/docker.sock" \
    --pidfile "$W/docker.pid" >"$W/dockerd.log" 2>&1 &
export DOCKER_HOST="unix://$W/docker.sock"
for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
mkdir -p /etc/docker/plugins && echo "unix://$W/moor.sock" >"/etc/docker/plugins/moor-bench-$$.spec"
docker import "$W/bb.tar" bb:1 >/dev/null
docker volume create -d "moor-bench-$$" dvol >/dev/null
from=$(($(wc -l <"$W/dev.log") + 1))
client=$(client_runs docker run --rm --network none --volume-driver "moor-bench-$$" -v dvol:/data bb:1 true | percentiles)
echo "docker: Mount $(mounts_since "$from" Mount | percentiles); Unmount $(mounts_since "$from" Unmount | percentiles); run --rm $client"
docker volume rm dvol >/dev/null
