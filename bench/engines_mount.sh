#!/usr/bin/env bash
# What a moor volume costs a container start, against a `local` volume in the same run:
# starts `moord dev --volume-plugin` (moor-hostpath), a dockerd of its own and Podman
# with its own storage; per engine, runs N pairs of `run --rm -v VOL:/data IMG true`,
# alternating a moor volume and a local one, and prints
# - the endpoint's Mount answers split into first Mounts (the volume not yet published
#   for that engine on this node: the whole claim path) and re-mounts (answered from a
#   publish the engine already holds), and its Unmount answers, p50 and p90 of the
#   endpoint's own log ("volume-plugin request answered", elapsed_us);
# - the median `run --rm` of each kind as the engine's client saw it, and their ratio.
#
#   bash bench/engines_mount.sh [N]          # N pairs per engine, default 20
#   MOORD=target/debug/moord bash bench/engines_mount.sh
#
# Needs root, a release moord and moor-hostpath beside it (cargo build --release
# --workspace --bins; MOORD names another), podman, runc, docker.io and busybox-static (../shared/CONTAINERS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-20}
MOORD=${MOORD:-target/release/moord}
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
echo "moord: $MOORD ($("$MOORD" --version 2>&1 | head -1))"
"$MOORD" dev --data-dir "$W/dev" --listen "127.0.0.1:$PORT" \
    --hostpath-bin "$(dirname "$MOORD")/moor-hostpath" --volume-plugin "$W/moor.sock" >"$W/dev.log" 2>&1 &
DEV=$!
for _ in $(seq 600); do grep -q "is ready" "$W/dev.log" && [ -S "$W/moor.sock" ] && break; sleep 0.1; done
[ -S "$W/moor.sock" ] || { tail "$W/dev.log"; echo "moord dev did not start" >&2; exit 1; }
mkdir -p "$W/rootfs/bin" "$W/rootfs/data" && cp "$(command -v busybox)" "$W/rootfs/bin/"
for c in sh true; do ln -s busybox "$W/rootfs/bin/$c"; done
tar -C "$W/rootfs" -cf "$W/bb.tar" .

percentiles() { sort -n | awk '{a[NR]=$1} END {if (NR == 0) {print "none"} else {printf "p50 %.1f ms, p90 %.1f ms (n=%d)", a[int((NR+1)/2)]/1000, a[int(NR*0.9+0.5)]/1000, NR}}'; }
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
# elapsed_us, or elapsed_ms of a build before it (its Mounts all count as first).
answers_since() {
    tail -n +"$1" "$W/dev.log" | grep 'volume-plugin request answered' | grep "verb=$2" | grep ${3:--e} "${4:-verb=}" |
        sed -n -e 's/.*elapsed_us=\([0-9]*\).*/\1/p' -e 's/.*elapsed_ms=\([0-9]*\).*/\1000/p'
}
timed() { s=$(date +%s%N); "$@" >/dev/null; echo $(( ($(date +%s%N) - s) / 1000000 )); }
# N pairs, alternating which kind goes first; prints the medians and the ratio.
pairs() {
    local moor_vol=$1 local_vol=$2; shift 2
    : >"$W/moor.ms"; : >"$W/local.ms"
    for i in $(seq "$N"); do
        if [ $((i % 2)) = 0 ]; then
            timed "$@" -v "$moor_vol:/data" "${IMG[@]}" >>"$W/moor.ms"
            timed "$@" -v "$local_vol:/data" "${IMG[@]}" >>"$W/local.ms"
        else
            timed "$@" -v "$local_vol:/data" "${IMG[@]}" >>"$W/local.ms"
            timed "$@" -v "$moor_vol:/data" "${IMG[@]}" >>"$W/moor.ms"
        fi
    done
    m=$(median <"$W/moor.ms"); l=$(median <"$W/local.ms")
    echo "run --rm median: moor $m ms, local $l ms, ratio $(awk "BEGIN {printf \"%.2f\", $m / $l}")"
}
# N runs, each on a volume of its own made just before (not timed): every Mount's
# volume is not yet attached, staged or published on the node.
cold() {
    local create=$1; shift
    : >"$W/cold.ms"
    for i in $(seq "$N"); do
        $create "cold$i" >/dev/null
        timed "$@" -v "cold$i:/data" "${IMG[@]}" >>"$W/cold.ms"
    done
    echo "run --rm on a new volume each: median $(median <"$W/cold.ms") ms"
}
report() {
    echo "  first Mount $(answers_since "$1" Mount -v reused=true | percentiles)"
    echo "  re-mount    $(answers_since "$1" Mount -e reused=true | percentiles)"
    echo "  Unmount     $(answers_since "$1" Unmount | percentiles)"
}

# Podman.
cat >"$W/containers.conf" <<CONF
[engine]
volume_plugin_timeout = 120
[engine.volume_plugins]
moor = "$W/moor.sock"
CONF
P=(podman --root "$W/podman/storage" --runroot "$W/podman/run" --runtime runc --cgroup-manager cgroupfs)
export CONTAINERS_CONF="$W/containers.conf"
"${P[@]}" import "$W/bb.tar" localhost/bb >/dev/null
"${P[@]}" volume create --driver moor pvol >/dev/null
"${P[@]}" volume create plocal >/dev/null
IMG=(localhost/bb true)
"${P[@]}" run --rm --network none --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 -v pvol:/data "${IMG[@]}" # warm
from=$(($(wc -l <"$W/dev.log") + 1))
PRUN=("${P[@]}" run --rm --network none --ulimit nofile=1024:1024 --ulimit nproc=1024:1024)
echo "podman: $(pairs pvol plocal "${PRUN[@]}")"
echo "podman: $(cold "${P[*]} volume create --driver moor" "${PRUN[@]}")"
report "$from"
"${P[@]}" volume rm pvol plocal >/dev/null

# Docker.
dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver=vfs \
    --data-root "$W/docker/root" --exec-root "$W/dx" -H "unix://$W/docker.sock" \
    --pidfile "$W/docker.pid" >"$W/dockerd.log" 2>&1 &
export DOCKER_HOST="unix://$W/docker.sock"
for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
mkdir -p /etc/docker/plugins && echo "unix://$W/moor.sock" >"/etc/docker/plugins/moor-bench-$$.spec"
docker import "$W/bb.tar" bb:1 >/dev/null
docker volume create -d "moor-bench-$$" dvol >/dev/null
docker volume create dlocal >/dev/null
IMG=(bb:1 true)
docker run --rm --network none -v dvol:/data "${IMG[@]}" # warm
from=$(($(wc -l <"$W/dev.log") + 1))
echo "docker: $(pairs dvol dlocal docker run --rm --network none)"
echo "docker: $(cold "docker volume create -d moor-bench-$$" docker run --rm --network none)"
report "$from"
docker volume rm dvol dlocal >/dev/null
