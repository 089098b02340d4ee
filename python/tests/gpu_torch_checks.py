"""PyTorch on a real GPU through libstrata.so: the checks the project still owes.

Run on a CUDA machine (`.ci/gpu-run torch` does it with the carried library):

    STRATA_LIB=.../libstrata.so PYTHONPATH=python python3 python/tests/gpu_torch_checks.py [--quick]

One line per check, `PASS name: detail` or `FAIL name: detail`, `INFO` for figures that are
reported, not asserted (timings). Exit status: 0 when every check passed, 1 on any FAIL, 77 when
PyTorch or a CUDA device is missing (nothing was checked). Not a unittest module on purpose (the
`test*.py` discovery of `python/tests` skips it); it imports torch only inside functions, so
`python3 -m py_compile` works without torch.

Checks: the MemPool route (tensors, matmul, a training step equal to one without strata,
torch.cuda.memory_stats, sleep/wake bit for bit and pages really returned, a CUDA graph captured
and replayed inside the pool), the global route (use_globally, in a subprocess: it must come
before any CUDA allocation), and a timing of an allocation-heavy loop, strata vs PyTorch's
caching allocator, as ratios.
"""

import json
import os
import subprocess
import sys
import time
import traceback

# Deterministic cuBLAS (torch.use_deterministic_algorithms) needs this before cuBLAS starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), ""))  # python/ (the strata package)

QUICK = "--quick" in sys.argv
MIB = 1 << 20
results = []


def report(status, name, detail=""):
    results.append((status, name))
    print(f"{status} {name}: {detail}", flush=True)


def check(name, fn):
    """Runs fn(); it returns a detail string (PASS) or raises (FAIL, with the traceback's tail)."""
    try:
        detail = fn()
        report("PASS", name, detail or "ok")
    except Exception as e:  # noqa: BLE001 (every failure is reported, none stops the run)
        tail = "".join(traceback.format_exception(e)[-3:]).strip().replace("\n", " | ")
        report("FAIL", name, tail)


def torch_or_none():
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


# ---- MemPool route -------------------------------------------------------------------------


def in_pool(torch, mp, ptr):
    """Whether `ptr` lies in a segment of MemPool `mp` (MemPool.snapshot where this PyTorch has
    it, else the device snapshot's segments tagged with the pool's id)."""
    if hasattr(mp, "snapshot"):
        segments = mp.snapshot()
    else:
        segments = [
            s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == mp.id
        ]
    return any(s["address"] <= ptr < s["address"] + s["total_size"] for s in segments)


def tensors_and_matmul(torch, strata):
    before = strata.stats(0)["live_allocations"]
    with strata.torch.pool("gpu_check_tensors"):
        a = torch.randn(1024, 1024, device="cuda", dtype=torch.float64)
        b = torch.randn(1024, 1024, device="cuda", dtype=torch.float64)
        c = a @ b
    torch.cuda.synchronize()
    ref = a.cpu() @ b.cpu()
    err = ((c.cpu() - ref).norm() / ref.norm()).item()
    assert err < 1e-12, f"relative error {err}"
    tag = strata.tag_stats("gpu_check_tensors")
    assert tag["allocated_bytes"] >= 3 * a.nbytes, f"tag holds {tag['allocated_bytes']} B"
    assert strata.stats(0)["live_allocations"] > before, "no strata allocation went live"
    assert in_pool(torch, strata.torch.mem_pool("gpu_check_tensors"), a.data_ptr()), (
        "tensor not inside the strata pool's segments"
    )
    return f"fp64 matmul rel err {err:.1e}; tag allocated {tag['allocated_bytes'] // MIB} MiB"


def train(torch, steps, pool_tag=None):
    """A small MLP trained `steps` steps from a fixed seed; returns (losses, params)."""
    import contextlib  # noqa: PLC0415

    import strata.torch as st  # noqa: PLC0415

    torch.manual_seed(1234)
    ctx = st.pool(pool_tag) if pool_tag else contextlib.nullcontext()
    with ctx:
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 10)
        ).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(64, 256, device="cuda")
        y = torch.randint(0, 10, (64,), device="cuda")
        losses = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach().clone())
    torch.cuda.synchronize()
    return [v.cpu() for v in losses], [p.detach().cpu().clone() for p in model.parameters()]


def training_equal(torch, strata):
    torch.use_deterministic_algorithms(True)
    try:
        steps = 3 if QUICK else 10
        ref_losses, ref_params = train(torch, steps)
        losses, params = train(torch, steps, pool_tag="gpu_check_train")
    finally:
        torch.use_deterministic_algorithms(False)
    assert strata.tag_stats("gpu_check_train")["allocs"] > 0, "the pool served nothing"
    diff = max(float((a - b).abs().max()) for a, b in zip(params, ref_params))
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), (
        f"losses differ: {[float(v) for v in losses]} vs {[float(v) for v in ref_losses]}"
    )
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params)), f"params differ by {diff}"
    return f"{steps} AdamW steps: losses and parameters bit-equal (final loss {float(losses[-1]):.4f})"


def memory_stats_sanity(torch, strata):
    torch.cuda.synchronize()
    s0 = torch.cuda.memory_stats()
    a0 = torch.cuda.memory_allocated()
    with strata.torch.pool("gpu_check_stats"):
        t = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    a1 = torch.cuda.memory_allocated()
    r1 = torch.cuda.memory_reserved()
    s1 = torch.cuda.memory_stats()
    assert a1 - a0 == t.nbytes, f"memory_allocated grew {a1 - a0}, tensor is {t.nbytes}"
    assert r1 >= a1, f"reserved {r1} < allocated {a1}"
    assert s1["num_alloc_retries"] == s0.get("num_alloc_retries", 0), "allocation retries"
    tag = strata.tag_stats("gpu_check_stats")
    assert tag["allocated_bytes"] >= t.nbytes, f"strata tag holds {tag['allocated_bytes']}"
    del t
    a2 = torch.cuda.memory_allocated()
    assert a2 == a0, f"allocated after free {a2} != {a0}"
    return (
        f"allocated +{(a1 - a0) // MIB} MiB then back; reserved {r1 // MIB} MiB; "
        f"strata tag {tag['allocated_bytes'] // MIB} MiB"
    )


SLEPT = {}


def sleep_returned():
    assert SLEPT, "the sleep/wake check did not get that far"
    got, want = SLEPT["returned"], SLEPT["bytes"]
    assert got >= 0.9 * want, f"driver free grew {got // MIB} MiB of {want // MIB} MiB slept"
    return f"driver free +{got // MIB} MiB while {want // MIB} MiB slept"


def sleep_wake(torch, strata):
    n = 256 * MIB // 8
    with strata.torch.pool("gpu_check_sleep"):
        t = torch.randint(-(2**62), 2**62, (n,), dtype=torch.int64, device="cuda")
        z = torch.randint(-(2**62), 2**62, (n,), dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    copy = t.cpu()
    ptr = t.data_ptr()
    free0 = torch.cuda.mem_get_info()[0]
    strata.sleep("gpu_check_sleep", keep_host_copy=True)
    asleep = strata.tag_stats("gpu_check_sleep")
    free1 = torch.cuda.mem_get_info()[0]
    SLEPT["returned"], SLEPT["bytes"] = free1 - free0, 2 * t.nbytes
    SLEPT["z"] = z
    strata.wake("gpu_check_sleep")
    torch.cuda.synchronize()
    assert asleep["asleep"], "tag not reported asleep"
    assert t.data_ptr() == ptr
    assert torch.equal(t.cpu(), copy), "contents changed across sleep/wake"
    t.add_(1)  # still usable
    torch.cuda.synchronize()
    return (
        "512 MiB slept, same address, bit-equal after wake; "
        f"host copy {asleep['host_copy_bytes'] // MIB} MiB"
    )


def sleep_without_copy_zeroes(torch, strata):
    """Documented: a tag that slept without host copies wakes with zeros."""
    assert "z" in SLEPT, "the sleep/wake check did not get that far"
    z = SLEPT.pop("z")
    strata.sleep("gpu_check_sleep", keep_host_copy=False)
    strata.wake("gpu_check_sleep")
    torch.cuda.synchronize()
    nz = int(z.count_nonzero())
    assert nz == 0, f"{nz} non-zero elements after a sleep without host copy"
    return f"{z.nbytes // MIB} MiB read back as zeros"


def cuda_graph(torch, strata):
    import strata.torch as st  # noqa: PLC0415

    mp = st.mem_pool("gpu_check_graph")
    with st.pool("gpu_check_graph"):
        w = torch.randn(512, 512, device="cuda")
        static_in = torch.randn(64, 512, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                (static_in @ w).relu_()
        torch.cuda.current_stream().wait_stream(side)
    # Captured into the strata MemPool: allocations made during capture come from strata.
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=mp.id):
        static_out = (static_in @ w).relu() + 1
    outs = []
    for i in range(3):
        x = torch.randn(64, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
        static_in.copy_(x)
        g.replay()
        torch.cuda.synchronize()
        ref = (x @ w).relu() + 1
        assert torch.allclose(static_out, ref, rtol=1e-5, atol=1e-5), f"replay {i} differs"
        outs.append(static_out.clone())
    assert in_pool(torch, mp, static_out.data_ptr()), "the graph's output is not in the strata pool"
    return "captured with pool=strata MemPool, 3 replays match eager"


# ---- global route (subprocess) ---------------------------------------------------------------

GLOBAL_CHILD = r"""
import json, os, sys, time
import strata, strata.torch
alloc = strata.torch.use_globally()
import torch
a = torch.randn(2048, 2048, device="cuda")
b = a @ a
m = torch.nn.Linear(512, 512).cuda()
x = torch.randn(32, 512, device="cuda", requires_grad=True)
m(x).sum().backward()
torch.cuda.synchronize()
ok = bool(torch.allclose(b.cpu(), a.cpu() @ a.cpu(), rtol=1e-3, atol=1e-2)) and x.grad is not None
st = strata.stats(0)
del a, b
torch.cuda.synchronize()
iters = int(sys.argv[1])
sizes = [int(s) for s in sys.argv[2].split(",")]
def loop():
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for i in range(iters):
        t = torch.empty(sizes[i % len(sizes)], dtype=torch.uint8, device="cuda")
        del t
    torch.cuda.synchronize(); return time.perf_counter() - t0
loop()
times = sorted(loop() for _ in range(3))
print("RESULT " + json.dumps({"ok": ok, "live": st["live_allocations"], "allocs": st["allocs"],
      "hooks": list(getattr(alloc, "strata_hooks", ())), "loop_s": times[1]}))
"""


def alloc_sizes():
    # Allocation-heavy mix: small (binned) and large (page-mapped), deterministic.
    return [512, 4096, 65536, 1 * MIB, 3 * MIB + 17, 8 * MIB, 24 * MIB, 2000, 200 * 1024]


def global_route(torch, strata, timings):
    iters = 2000 if QUICK else 20000
    sizes = ",".join(str(s) for s in alloc_sizes())
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-c", GLOBAL_CHILD, str(iters), sizes],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"child exit {proc.returncode}: {proc.stderr.strip()[-1500:]}"
    )
    r = json.loads(lines[-1][len("RESULT ") :])
    assert r["ok"], "results on the global route differ from the CPU"
    assert r["live"] > 0 and r["allocs"] > 0, f"strata served nothing: {r}"
    timings["global (strata direct)"] = r["loop_s"]
    return f"matmul + backward ok; strata live {r['live']}, allocs {r['allocs']}; hooks {r['hooks']}"


def timing(torch, strata, timings):
    iters = 2000 if QUICK else 20000
    sizes = alloc_sizes()

    def loop():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(iters):
            t = torch.empty(sizes[i % len(sizes)], dtype=torch.uint8, device="cuda")
            del t
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def median(fn):
        fn()
        return sorted(fn() for _ in range(3))[1]

    timings["pytorch caching allocator"] = median(loop)
    with strata.torch.pool("gpu_check_timing"):
        timings["MemPool route (strata behind the cache)"] = median(loop)
    base = timings["pytorch caching allocator"]
    for k, v in timings.items():
        print(f"INFO timing {k}: {v * 1e6 / iters:.2f} us/op, {v / base:.2f}x PyTorch", flush=True)
    return f"{iters} alloc+free of {len(sizes)} sizes; ratios reported above, not asserted"


def main():
    torch = torch_or_none()
    if torch is None:
        print("SKIP all: PyTorch with a CUDA device is not available here", flush=True)
        return 77
    import strata  # noqa: PLC0415
    import strata.torch  # noqa: PLC0415,F401

    print(
        f"INFO torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"{torch.cuda.get_device_name(0)}; strata {strata.version()} from {strata.library_path()}",
        flush=True,
    )
    if os.environ.get("STRATA_BACKEND") == "host":
        print("INFO STRATA_BACKEND=host: strata would emulate the device; set cuda", flush=True)
    timings = {}
    # The global route first: its child process must not inherit a started CUDA context (it
    # does not: a fresh interpreter), and its timing joins the table below.
    check("global route (use_globally, subprocess)", lambda: global_route(torch, strata, timings))
    hooks = strata.torch.allocator().strata_hooks
    print(f"INFO CUDAPluggableAllocator hooks set: {list(hooks)}", flush=True)
    check("mempool tensors + matmul", lambda: tensors_and_matmul(torch, strata))
    check("mempool training step == default allocator", lambda: training_equal(torch, strata))
    check("memory_stats sanity", lambda: memory_stats_sanity(torch, strata))
    check("sleep/wake bit for bit", lambda: sleep_wake(torch, strata))
    check("sleep returns the pages to the driver", sleep_returned)
    check("sleep without host copy wakes zeroed", lambda: sleep_without_copy_zeroes(torch, strata))
    check("cuda graph capture + replay in the pool", lambda: cuda_graph(torch, strata))
    check("allocation timing (reported)", lambda: timing(torch, strata, timings))
    failed = [n for s, n in results if s == "FAIL"]
    print(
        f"SUMMARY {len(results) - len(failed)} passed, {len(failed)} failed"
        + (f": {', '.join(failed)}" if failed else ""),
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
