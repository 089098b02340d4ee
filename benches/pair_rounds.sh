#!/usr/bin/env bash
# Wall-clock time of the cached allocate + free pair, builds alternated: ROUNDS rounds (order
# reversed every other round), each build one process of PAIRS pairs of SIZE bytes per round;
# prints every run, then each build's best (the least disturbed by other load) and median.
#
#   benches/pair_rounds.sh SIZE LABEL=COMMAND...
#   benches/pair_rounds.sh 256 old=/tmp/old/cached_pair new=target/release/examples/cached_pair
#   benches/pair_rounds.sh 256 "old=/tmp/malloc_free_pair /tmp/old/libstrata.so" \
#       "new=/tmp/malloc_free_pair target/release/libstrata.so"
#
# COMMAND is the `cached_pair` example of strata-allocator or ffi/benches/c/malloc_free_pair.c
# (with its library), given SIZE and PAIRS. ROUNDS (default 15) and PAIRS (default 2000000)
# from the environment. Host backend (STRATA_BACKEND unset); the load average is printed.
set -euo pipefail
size=$1
shift
rounds=${ROUNDS:-15}
pairs=${PAIRS:-2000000}
labels=()
cmds=()
for arg in "$@"; do
    labels+=("${arg%%=*}")
    cmds+=("${arg#*=}")
done
n=${#labels[@]}
out=$(mktemp)
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for ((r = 1; r <= rounds; r++)); do
    line="round $r:"
    for ((k = 0; k < n; k++)); do
        i=$(( r % 2 == 1 ? k : n - 1 - k ))
        # shellcheck disable=SC2086
        ns=$(${cmds[$i]} "$size" "$pairs" | sed -n 's/.*: \([0-9.]*\) ns per pair/\1/p')
        echo "${labels[$i]} $ns" >>"$out"
        line+=" ${labels[$i]} $ns"
    done
    echo "$line"
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
for l in "${labels[@]}"; do
    awk -v l="$l" '$1 == l { print $2 }' "$out" | sort -g |
        awk -v l="$l" -v s="$size" '{ v[NR] = $1 } END {
            m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
            printf "%s, %s B: best %.2f ns, median %.2f ns per pair (%d runs)\n", l, s, v[1], m, NR }'
done
rm -f "$out"
