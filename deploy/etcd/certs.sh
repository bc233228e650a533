#!/usr/bin/env bash
# TLS material for etcd and moor: a CA, a server certificate for etcd, and one client
# certificate per etcd user (its CN is the user name etcd authenticates with when it
# runs with --client-cert-auth).
#
#   deploy/etcd/certs.sh DIR NODE...
#
# Writes DIR/ca.pem, DIR/server.pem (+ -key), and client certificates for root,
# moor-controller, moor-console and moor-agent-NODE for each NODE, moor-edit-NS for
# each namespace in NAMESPACE_WRITERS, and NAME for each person in PEOPLE (entries
# NAME=ROLE[:NS,...], as roles.sh takes them). SERVER_SANS (default
# IP:127.0.0.1,DNS:localhost) names the server; add your hosts for a real cluster.
# Each person also gets DIR/NAME.env, their moorctl's configuration (moorctl reads
# MOOR_CONFIG, or ~/.config/moor/moorctl.env): ENDPOINT (default
# https://127.0.0.1:2379), ca.pem and their pair beside it, and the first namespace
# of their entry; hand them the four files.
set -euo pipefail
DIR=${1:?directory}
shift
SANS=${SERVER_SANS:-IP:127.0.0.1,DNS:localhost}
DAYS=${DAYS:-825}
mkdir -p "$DIR"
cd "$DIR"

# Run again on the same DIR, it keeps the CA and every certificate there and issues
# only the missing ones (a new node, namespace or person).
if [ ! -e ca.pem ]; then
    openssl req -x509 -newkey rsa:2048 -nodes -keyout ca-key.pem -out ca.pem -days "$DAYS" \
        -subj "/CN=moor-etcd-ca" -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi

issue() { # NAME CN EXTENSIONS
    [ -e "$1.pem" ] && return 0
    openssl req -newkey rsa:2048 -nodes -keyout "$1-key.pem" -out "$1.csr" -subj "/CN=$2" 2>/dev/null
    printf '%s\n' "$3" >"$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial \
        -out "$1.pem" -days "$DAYS" -extfile "$1.ext" 2>/dev/null
    rm -f "$1.csr" "$1.ext"
}

issue server etcd "subjectAltName=$SANS
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth"
edit=()
for ns in ${NAMESPACE_WRITERS:-}; do
    edit+=("moor-edit-$ns")
done
declare -A person=()
declare -A home=()
for entry in ${PEOPLE:-}; do
    person[${entry%%=*}]=1
    # The first namespace named (none for an operator).
    case "$entry" in
    *:*) namespaces=${entry#*:}; home[${entry%%=*}]=${home[${entry%%=*}]:-${namespaces%%,*}} ;;
    esac
done
for user in root moor-controller moor-console "${@/#/moor-agent-}" "${edit[@]}" "${!person[@]}"; do
    issue "$user" "$user" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
done
chmod 600 ./*-key.pem
# A person's moorctl configuration, kept if it exists (edit it freely).
for name in "${!person[@]}"; do
    [ -e "$name.env" ] && continue
    {
        echo "# moorctl's configuration for $name (deploy/etcd/certs.sh): MOOR_CONFIG=$name.env,"
        echo "# or this file as ~/.config/moor/moorctl.env beside ca.pem, $name.pem, $name-key.pem."
        echo "MOOR_ENDPOINTS=${ENDPOINT:-https://127.0.0.1:2379}"
        echo "MOOR_CACERT=ca.pem"
        echo "MOOR_CERT=$name.pem"
        echo "MOOR_KEY=$name-key.pem"
        if [ -n "${home[$name]:-}" ]; then
            echo "MOOR_NAMESPACE=${home[$name]}"
        fi
    } > "$name.env"
done
echo "certificates in $DIR"
