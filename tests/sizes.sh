#!/usr/bin/env bash
# The house's size counts, one way for every review: production files over 600 lines
# and functions over 80, in every workspace crate's src/. A file's production part is
# its lines before its first top-level `#[cfg(test)]` (a test module written in place
# is left out; tests in files of their own, *tests.rs, are not counted at all). A
# function is counted from its `fn` line to the line that closes its body, by brace
# depth (braces in strings and comments count too: close enough for a census).
#
#   bash tests/sizes.sh            # both lists and their totals
#   FILES=700 FNS=100 bash tests/sizes.sh
set -euo pipefail
cd "$(dirname "$0")/.."
files=${FILES:-600}
fns=${FNS:-80}
srcs=$(sed -n 's/^members *= *\[\(.*\)\]/\1/p' Cargo.toml | tr -d '" ' | tr ',' '\n' |
    sed 's|^\.$|src|; s|^\([^s].*\)$|\1/src|; s|^src/src$|src|')
list=$(for d in $srcs; do find "$d" -name '*.rs' ! -name '*tests.rs'; done | sort)

echo "# files over $files lines (production part)"
nf=0
for f in $list; do
    n=$(awk '/^#\[cfg\(test\)\]/ { exit } { n++ } END { print n+0 }' "$f")
    if [ "$n" -gt "$files" ]; then
        echo "$n $f"
        nf=$((nf + 1))
    fi
done | sort -rn
echo "# functions over $fns lines"
for f in $list; do
    awk -v max="$fns" -v file="$f" '
        /^#\[cfg\(test\)\]/ { exit }
        {
            if (!infn && $0 ~ /^[ \t]*(pub(\([a-z:]+\))? )?(const )?(async )?(unsafe )?fn [A-Za-z_][A-Za-z0-9_]*/) {
                infn = 1; start = NR; depth = 0; opened = 0
                name = $0; sub(/^.*fn /, "", name); sub(/[^A-Za-z0-9_].*$/, "", name)
            }
            if (infn) {
                line = $0
                o = gsub(/\{/, "{", line); c = gsub(/\}/, "}", line)
                depth += o - c
                if (o > 0) opened = 1
                if ((opened && depth <= 0) || (!opened && $0 ~ /;[ \t]*$/)) {
                    len = NR - start + 1
                    if (opened && len > max) printf "%d %s:%d %s\n", len, file, start, name
                    infn = 0
                }
            }
        }' "$f"
done | sort -rn
