"""Record a workload's allocation trace for `strata bench replay`.

    python -m strata.trace record -o trace.csv.gz -- python train.py --its --args
    python -m strata.trace record --cuda -o snapshot.pickle -- python train.py
    python -m strata.trace convert profile.json -o trace.csv.gz

`record` runs the script in this process (as `python script.py` would) under:

- the PyTorch profiler with `profile_memory=True` (default, works on the CPU): every allocation
  and free of the device type that saw the most traffic (CUDA if any, else CPU), written as a
  plain CSV `op,id,bytes` (`.gz`: compressed), or, with `--chrome`, the profiler's own
  Chrome-trace JSON too;
- or, with `--cuda`, PyTorch's CUDA memory history (`torch.cuda.memory._record_memory_history`),
  dumped as its snapshot pickle (`torch.cuda.memory._dump_snapshot`).

`convert` turns a Chrome trace (`prof.export_chrome_trace`) into the CSV. All three formats
replay with `strata bench replay FILE`.

Without a CLI: wrap any code in `with strata.trace.recording("trace.csv.gz"): ...`.
"""

import argparse
import contextlib
import gzip
import json
import os
import runpy
import sys
import tempfile

__all__ = ["recording", "memory_events", "write_csv"]


def memory_events(chrome_trace):
    """(address, bytes, device type) of every `[memory]` event of a Chrome trace, in time
    order; bytes are negative for frees."""
    events = [
        e
        for e in chrome_trace.get("traceEvents", [])
        if e.get("name") == "[memory]" and "Addr" in e.get("args", {})
    ]
    events.sort(key=lambda e: e.get("ts", 0))
    return [
        (int(e["args"]["Addr"]), int(e["args"]["Bytes"]), int(e["args"].get("Device Type", 0)))
        for e in events
    ]


def _open_text(path, mode):
    if str(path).endswith(".gz"):
        return gzip.open(path, mode + "t", newline="")
    return open(path, mode, newline="")


def write_csv(events, path, device_type=None):
    """Writes `op,id,bytes` lines: one id per allocation (addresses are reused, ids are not).
    Frees of allocations made before the recording began are skipped. Returns (allocs, frees)."""
    if device_type is None:
        by_type = {}
        for _, nbytes, dtype in events:
            by_type[dtype] = by_type.get(dtype, 0) + abs(nbytes)
        device_type = max(by_type, key=by_type.get) if by_type else 0
    live = {}
    next_id = 0
    allocs = frees = 0
    with _open_text(path, "w") as out:
        out.write("op,id,bytes\n")
        for addr, nbytes, dtype in events:
            if dtype != device_type or nbytes == 0:
                continue
            if nbytes > 0:
                live[addr] = (next_id, nbytes)
                out.write(f"alloc,{next_id},{nbytes}\n")
                next_id += 1
                allocs += 1
            elif addr in live:
                ident, size = live.pop(addr)
                out.write(f"free,{ident},{size}\n")
                frees += 1
    return allocs, frees


@contextlib.contextmanager
def recording(path, chrome=None):
    """Records the allocations made inside the block with the PyTorch profiler and writes
    them to `path` as CSV (and the raw Chrome trace to `chrome`, when given)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, profile_memory=True) as prof:
        yield
    with tempfile.TemporaryDirectory() as tmp:
        raw = chrome or os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw) as f:
            events = memory_events(json.load(f))
    allocs, frees = write_csv(events, path)
    print(f"strata.trace: {allocs} allocations, {frees} frees -> {path}", file=sys.stderr)


@contextlib.contextmanager
def _cuda_history(path):
    import torch

    torch.cuda.memory._record_memory_history(max_entries=10_000_000)
    try:
        yield
    finally:
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        print(f"strata.trace: CUDA memory snapshot -> {path}", file=sys.stderr)


def _run_script(command):
    if command and os.path.basename(command[0]).startswith("python"):
        command = command[1:]
    if not command:
        raise SystemExit("strata.trace record: give the script after --")
    script = command[0]
    argv, sys.argv = sys.argv, list(command)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        if script == "-m" and len(command) > 1:
            sys.argv = command[1:]
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = argv


def main(args=None):
    parser = argparse.ArgumentParser(prog="python -m strata.trace", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="run a script and record its allocations")
    rec.add_argument("-o", "--output", default="trace.csv.gz")
    rec.add_argument("--chrome", help="also keep the profiler's Chrome trace here")
    rec.add_argument("--cuda", action="store_true",
                     help="record CUDA memory history into a snapshot pickle instead")
    rec.add_argument("command", nargs=argparse.REMAINDER)
    conv = sub.add_parser("convert", help="Chrome trace JSON -> CSV")
    conv.add_argument("input")
    conv.add_argument("-o", "--output", default="trace.csv.gz")
    ns = parser.parse_args(args)
    if ns.cmd == "convert":
        with _open_text(ns.input, "r") as f:
            events = memory_events(json.load(f))
        allocs, frees = write_csv(events, ns.output)
        print(f"strata.trace: {allocs} allocations, {frees} frees -> {ns.output}", file=sys.stderr)
        return 0
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    ctx = _cuda_history(ns.output) if ns.cuda else recording(ns.output, ns.chrome)
    with ctx:
        _run_script(command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
