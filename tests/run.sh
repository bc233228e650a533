#!/usr/bin/env bash
# The test command: installs what the tests need and a fresh machine lacks, then runs
# every crate's tests, and (without arguments) builds the docs with every intra-doc link
# checked. Arguments go to cargo test (e.g. `bash tests/run.sh --test chaos`).
#
#   protoc   (protobuf-compiler)  the build compiles proto/csi.proto and etcd-client's protos
#   etcd     (etcd-server)        the tests start real etcd processes
#   etcdctl  (etcd-client)        tests drive the embedded store and the TLS roles with it
#   openssl  (openssl)            the TLS test makes its certificates with deploy/etcd/certs.sh
#   promtool (prometheus)         deploy/prometheus's rules are checked and unit-tested, and a
#                                 real Prometheus scrapes moor (tests/prometheus.rs)
#   time     (time)               GNU time: moorctl's tests read a command's peak memory
#   podman, runc, busybox, dockerd (podman, runc, busybox-static, docker.io)
#                                 tests/engines.rs runs real containers on moor volumes
#   docker-compose, podman-compose, systemd-socket-activate (docker-compose,
#                                 podman-compose, systemd): tests/engines.rs runs
#                                 deploy/engines' Compose files and boots an engine
#                                 behind the agent's activated socket
#   ip, iptables (iproute2, iptables)
#                                 tests/faults.rs partitions an etcd member in its own
#                                 network namespace
#   systemd-analyze (systemd)     tests/deploy.rs lints deploy/systemd's units
#   git      (git)                tests/upgrade.rs builds the last release from the clone's
#                                 history (a shallow clone is deepened first)
set -euo pipefail
cd "$(dirname "$0")/.."
. deploy/needs.sh
need protoc protobuf-compiler
need etcd etcd-server
need etcdctl etcd-client
need openssl openssl
need promtool prometheus
need /usr/bin/time time
need podman podman
need runc runc
need busybox busybox-static
need dockerd docker.io
need docker-compose docker-compose
need podman-compose podman-compose
need systemd-socket-activate systemd
need ip iproute2
need iptables iptables
need systemd-analyze systemd
need git git
# tests/console.rs drives the web console in headless Chromium through chromedriver.
need chromium chromium
need chromedriver chromium-driver
# tests/upgrade.rs needs the release it upgrades from in this clone's history.
if [ "$(git rev-parse --is-shallow-repository 2>/dev/null)" = "true" ]; then
  git fetch --unshallow --quiet || echo "tests/run.sh: cannot deepen this shallow clone; tests/upgrade.rs will say what it lacks" >&2
fi
# Every test binary runs, whatever fails first: one failure must not hide another.
status=0
cargo test --workspace --no-fail-fast "$@" || status=$?
# The whole suite (no arguments) also checks that the docs cannot drift silently: every
# intra-doc link resolves, private items included.
if [ $# -eq 0 ]; then
  RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --document-private-items \
    --quiet || status=1
fi
exit $status
