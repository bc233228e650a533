# Sourced by deploy/quickstart.sh, tests/run.sh and .ci/run: installs the Debian/Ubuntu
# package that provides a missing command, saying what it runs first.
#
#   need protoc protobuf-compiler
#
# Nothing is installed when the command is already on PATH. Installing needs root or
# sudo; without either it stops with the command to run by hand.

_needs_updated=""

need() {
    local cmd=$1 pkg=$2 sudo=""
    if command -v "$cmd" >/dev/null 2>&1; then
        return 0
    fi
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1; then
            sudo="sudo"
        else
            echo "$cmd is missing and this user cannot install it; as root run:" >&2
            echo "    apt-get update && apt-get install -y $pkg" >&2
            exit 1
        fi
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "$cmd is missing; install the package that provides it ($pkg on Debian/Ubuntu)" >&2
        exit 1
    fi
    local apt="${sudo:+$sudo }apt-get"
    if [ -z "$_needs_updated" ]; then
        echo "# $cmd is missing: $apt update"
        DEBIAN_FRONTEND=noninteractive $apt update -qq
        _needs_updated=1
    fi
    echo "# installing $pkg (for $cmd): $apt install -y $pkg"
    DEBIAN_FRONTEND=noninteractive $apt install -y -qq "$pkg" >/dev/null
}
