#!/usr/bin/env bash
# Instructions per cached allocate + free pair, counted with callgrind (repeatable whatever the
# machine's load). Each size runs twice, with PAIRS_LO and PAIRS_HI pairs after one warm-up
# pair; the difference of the two totals over the difference of the pair counts is the cost of
# one pair (start-up, warm-up and exit cancel out).
#
#   benches/callgrind_pairs.sh rust target/release/examples/cached_pair [SIZES...]
#   benches/callgrind_pairs.sh c    DRIVER target/release/libstrata.so [SIZES...]
#
# `rust`: the `cached_pair` example of strata-allocator (CachingAllocator from Rust);
# `c`: ffi/benches/c/malloc_free_pair.c built with `cc -O2 ... -ldl`, given libstrata.so.
# Sizes default to 256 4096 65536 2097152 8388608. Host backend with a 1 GiB device, under
# benches/callgrind_shim.c (valgrind cannot hold the 1 TiB arena; the shim trims reservations
# the pair never touches). Needs valgrind and cc.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
shim=$(mktemp -d)/callgrind_shim.so
cc -O2 -shared -fPIC -o "$shim" "$here/callgrind_shim.c" -ldl
kind=$1
shift
case $kind in
rust) cmd=("$1"); shift ;;
c) cmd=("$1" "$2"); shift 2 ;;
*) echo "usage: $0 rust BIN [SIZES...] | c DRIVER LIB [SIZES...]" >&2; exit 2 ;;
esac
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(256 4096 65536 2097152 8388608)
lo=${PAIRS_LO:-20000}
hi=${PAIRS_HI:-220000}
count() {
    STRATA_HOST_DEVICES=1GiB LD_PRELOAD=$shim valgrind --tool=callgrind --callgrind-out-file=/dev/null "${cmd[@]}" "$1" "$2" 2>&1 |
        sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}
for size in "${sizes[@]}"; do
    a=$(count "$size" "$lo")
    b=$(count "$size" "$hi")
    awk -v s="$size" -v a="$a" -v b="$b" -v lo="$lo" -v hi="$hi" \
        'BEGIN { printf "%s B: %.1f instructions per pair\n", s, (b - a) / (hi - lo) }'
done
