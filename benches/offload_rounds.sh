#!/usr/bin/env bash
# bench_offload (python -m strata.examples.bench_offload) of several checkouts side by side:
# ROUNDS rounds (default 3, order reversed every other round), each checkout one process per
# round running its configurations once (--rounds 1; within it, lookahead off and on alternate
# as the bench orders them). Prints the load average and every run's table, labelled.
#
#   benches/offload_rounds.sh LABEL=CHECKOUT... -- BENCH_OFFLOAD_ARGS...
#   STRATA_HOST_LINK=1GB,10us benches/offload_rounds.sh before=/tmp/old after=. -- --layers 8 --only disk
#
# CHECKOUT is a source tree with `python/` and a release `target/release/libstrata.so`. The
# environment of BENCHMARKS.md's tiered-offload section is set here (host backend, 64 KiB
# pages, one torch thread); PYTHON (default: python3) runs the bench.
set -euo pipefail
rounds=${ROUNDS:-3}
python=${PYTHON:-python3}
labels=()
dirs=()
while [[ $# -gt 0 && $1 != -- ]]; do
    labels+=("${1%%=*}")
    dirs+=("$(cd "${1#*=}" && pwd)")
    shift
done
[[ $# -gt 0 ]] && shift
n=${#labels[@]}
export OMP_NUM_THREADS=1 STRATA_BACKEND=host STRATA_HOST_GRANULARITY=64KiB
for ((r = 1; r <= rounds; r++)); do
    for ((k = 0; k < n; k++)); do
        i=$(( r % 2 == 1 ? k : n - 1 - k ))
        echo "== round $r, ${labels[$i]} (load average $(cut -d' ' -f1-3 /proc/loadavg))"
        STRATA_LIB="${dirs[$i]}/target/release/libstrata.so" PYTHONPATH="${dirs[$i]}/python" \
            "$python" -m strata.examples.bench_offload --rounds 1 "$@" | grep '^|' | grep -v '^|---'
    done
done
