#!/usr/bin/env bash
# etcd users and roles for moor, then auth on. Each agent may write only its own node's
# keys: its Node object and its Mounts (plus events); it reads the rest of moor's keys.
# The controller, and agents that host a controller plugin (CONTROLLER_PLUGIN_NODES:
# their provisioner and attacher write volumes and attachments), get more.
#
#   ENDPOINT=https://127.0.0.1:2379 CERTS=DIR deploy/etcd/roles.sh NODE...
#
# CERTS holds certs.sh's output (root's certificate does the setup). Users have no
# password: they authenticate by their certificate's CN (etcd --client-cert-auth).
# PREFIX (default /moor/) must match moord's and moorctl's --prefix.
set -euo pipefail
: "${ENDPOINT:?}" "${CERTS:?}"
PREFIX=${PREFIX:-/moor/}
ctl() {
    ETCDCTL_API=3 etcdctl --endpoints "$ENDPOINT" --cacert "$CERTS/ca.pem" \
        --cert "$CERTS/root.pem" --key "$CERTS/root-key.pem" "$@" >/dev/null
}

ctl user add root --no-password
ctl role add root
ctl user grant-role root root

ctl user add moor-controller --no-password
ctl role add moor-controller
ctl role grant-permission moor-controller readwrite "$PREFIX" --prefix
ctl user grant-role moor-controller moor-controller

for node in "$@"; do
    user="moor-agent-$node"
    ctl user add "$user" --no-password
    ctl role add "$user"
    ctl role grant-permission "$user" read "$PREFIX" --prefix
    ctl role grant-permission "$user" readwrite "${PREFIX}nodes/$node"
    ctl role grant-permission "$user" readwrite "${PREFIX}mounts/$node/" --prefix
    ctl role grant-permission "$user" readwrite "${PREFIX}events/" --prefix
    ctl user grant-role "$user" "$user"
done

for node in ${CONTROLLER_PLUGIN_NODES:-}; do
    user="moor-agent-$node"
    ctl role grant-permission "$user" readwrite "${PREFIX}volumes/" --prefix
    ctl role grant-permission "$user" readwrite "${PREFIX}attachments/" --prefix
    ctl role grant-permission "$user" readwrite "${PREFIX}leaders/plugin." --prefix
done

ctl auth enable
echo "auth enabled: root, moor-controller, moor-agent-{$*}"
