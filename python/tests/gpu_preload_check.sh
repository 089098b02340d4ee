#!/usr/bin/env bash
# A tiny PyTorch workload under LD_PRELOAD=libstrata_preload.so on a real GPU (`.ci/gpu-run
# preload` runs it with the carried shim). The shim serves PyTorch's cudaMalloc/cudaFree (and the
# driver's cuMemAlloc routes); the check compares what strata holds (strata_preload_stats, read
# from inside the preloaded process) with torch.cuda.memory_reserved(), checks the results of
# the work, and counts the shim's log lines (STRATA_PRELOAD_LOG=1).
#
#   STRATA_PRELOAD_LIB=.../libstrata_preload.so python/tests/gpu_preload_check.sh
#
# Prints PASS/FAIL/INFO lines; exits 0 when all passed, 1 on a FAIL, 77 without PyTorch + CUDA.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
shim=${STRATA_PRELOAD_LIB:-$root/target/release/libstrata_preload.so}
python=${PYTHON:-python3}

if ! "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "SKIP preload: PyTorch with a CUDA device is not available here"
  exit 77
fi
[ -f "$shim" ] || { echo "FAIL preload: no shim at $shim"; exit 1; }

workload=$(mktemp --suffix=.py)
shimlog=$(mktemp)
trap 'rm -f "$workload" "$shimlog"' EXIT
cat >"$workload" <<'EOF'
import ctypes, json, sys
import torch

class Stats(ctypes.Structure):  # StrataPreloadStats (ffi/preload/src/lib.rs)
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "live_allocations", "allocs", "frees", "allocated_bytes", "reserved_bytes",
        "peak_reserved_bytes")]

shim = ctypes.CDLL(sys.argv[1])  # the already-preloaded library: same handle
shim.strata_preload_stats.argtypes = [ctypes.c_int, ctypes.POINTER(Stats)]
shim.strata_preload_owns.argtypes = [ctypes.c_uint64]

def stats():
    s = Stats()
    rc = shim.strata_preload_stats(0, ctypes.byref(s))
    return {n: getattr(s, n) for n, _ in Stats._fields_} if rc == 0 else None

out = {}
torch.manual_seed(0)
a = torch.randn(2048, 2048, device="cuda")
b = torch.randn(2048, 2048, device="cuda")
c = a @ b
big = torch.empty(300 << 20, dtype=torch.uint8, device="cuda")
big.fill_(7)
torch.cuda.synchronize()
ref = a.double().cpu() @ b.double().cpu()
out["matmul_rel_err"] = float((c.double().cpu() - ref).norm() / ref.norm())
out["fill_ok"] = bool((big[::4096] == 7).all())
out["initialized"] = shim.strata_preload_initialized()
out["owns_tensor"] = shim.strata_preload_owns(a.data_ptr())
out["mem_get_info"] = list(torch.cuda.mem_get_info())
out["reserved_1"] = torch.cuda.memory_reserved()
out["strata_1"] = stats()
del big
torch.cuda.synchronize()
torch.cuda.empty_cache()
out["reserved_2"] = torch.cuda.memory_reserved()
out["strata_2"] = stats()
print("RESULT " + json.dumps(out), flush=True)
EOF

echo "INFO shim $shim, backend ${STRATA_BACKEND:-auto}"
result=$(LD_PRELOAD="$shim" STRATA_PRELOAD_LOG=1 "$python" "$workload" "$shim" 2>"$shimlog")
rc=$?
echo "INFO workload exit $rc; shim log: $(wc -l <"$shimlog") lines, $(grep -c '(strata)' "$shimlog") served by strata, $(grep -c -- '-> real' "$shimlog") passed to the real driver"
echo "---- shim log (first 40 and last 20 lines)"
head -n 40 "$shimlog"; echo "..."; tail -n 20 "$shimlog"
echo "----"
line=$(printf '%s\n' "$result" | grep '^RESULT ' | tail -n 1)
if [ $rc -ne 0 ] || [ -z "$line" ]; then
  echo "FAIL preload workload: exit $rc, no result (stderr tail above)"
  exit 1
fi
echo "INFO ${line#RESULT }"
"$python" - "${line#RESULT }" <<'EOF'
import json, sys
r = json.loads(sys.argv[1])
fails = 0
def check(name, ok, detail):
    global fails
    print(("PASS" if ok else "FAIL") + f" preload {name}: {detail}")
    fails += 0 if ok else 1
s1, s2 = r["strata_1"], r["strata_2"]
check("results", r["matmul_rel_err"] < 1e-4 and r["fill_ok"],
      f"matmul rel err {r['matmul_rel_err']:.1e}, fill ok {r['fill_ok']}")
check("shim serves", r["initialized"] == 1 and s1 is not None and s1["live_allocations"] > 0,
      f"initialized {r['initialized']}, stats {s1}")
check("tensor owned by strata", r["owns_tensor"] == 1, f"strata_preload_owns = {r['owns_tensor']}")
if s1 and s2:
    MiB = 1 << 20
    # Every segment PyTorch reserves is one cudaMalloc the shim served: strata's live bytes cover
    # torch's reserved bytes (other libraries' own allocations may add to them)...
    check("strata covers torch reserved", s1["allocated_bytes"] >= r["reserved_1"],
          f"strata allocated {s1['allocated_bytes'] / MiB:.1f} MiB, reserved (mapped) "
          f"{s1['reserved_bytes'] / MiB:.1f} MiB; torch reserved {r['reserved_1'] / MiB:.1f} MiB")
    # ...and what empty_cache gives back is what strata frees.
    d_torch = r["reserved_1"] - r["reserved_2"]
    d_strata = s1["allocated_bytes"] - s2["allocated_bytes"]
    check("empty_cache frees through strata", d_torch > 0 and d_strata == d_torch,
          f"torch reserved -{d_torch / MiB:.1f} MiB, strata allocated -{d_strata / MiB:.1f} MiB, "
          f"frees {s1['frees']} -> {s2['frees']}")
free, total = r["mem_get_info"]
check("cuMemGetInfo through the shim", 0 < free <= total,
      f"free {free / (1 << 30):.1f} GiB of {total / (1 << 30):.1f} GiB")
sys.exit(1 if fails else 0)
EOF
