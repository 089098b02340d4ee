"""KV limits changeable from outside the engine: every engine's KV space publishes its figures
in a control folder, and a limit written there caps the KV bytes the engine maps. The engine
reads it within ``POLL_S`` seconds, idle or not (strata.vllm's trimmer thread), unmaps free
groups down to it at once, and from then on maps no group beyond it: vLLM queues and preempts
as on a smaller device. Groups in use stay mapped until their blocks fall free.

Folder: ``STRATA_VLLM_CONTROL_DIR`` (default ``<temp dir>/strata-vllm-<uid>``; empty: no folder,
limits only through ``strata.vllm.set_limit`` and ``STRATA_VLLM_KV_LIMIT``). For the engine
whose process is P and whose KV space is labelled L (the ``engine`` label of the metrics):

  P-L.json   the engine's figures (pid, label, virtual, mapped and limit bytes, groups), kept
             current by the engine and removed when it shuts down
  P-L.limit  the limit, written by the operator: a size (``1048576``, ``512MiB``, ``1.5GiB``,
             ``2GB``) or ``none``

    python -m strata.vllm.control list [--json]
    python -m strata.vllm.control limit P-L SIZE|none

Another program may write the ``.limit`` file itself (write a temporary file, then rename it).
A limit below one group is raised to one group (the null block's group stays mapped); an
unreadable limit file is logged and ignored (the previous limit holds).

``strata limit PID SIZE`` (README, "Operators") caps everything strata holds on a device for a
whole process instead, and what does not fit fails as out of memory; for a vLLM engine's KV this
control is the better one, since its limit reaches vLLM's scheduler, which queues and preempts.
"""

import argparse
import atexit
import json
import math
import os
import re
import sys
import tempfile
import threading

POLL_S = 0.5  # how often the trimmer thread reads the limits and refreshes the figures

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


class ControlError(ValueError):
    """A bad size, or an engine the control folder does not know."""


def parse_limit(text):
    """A size in bytes (``512MiB``, ``1.5GiB``, ``2GB``, ``1048576``), or None for ``none``."""
    t = str(text).strip()
    if t.lower() == "none":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-zA-Z]*)", t)
    unit = _UNITS.get(m.group(2).lower()) if m else None
    if unit is None:
        raise ControlError(
            f"strata.vllm: KV limit {text!r}: expected bytes, a size such as 512MiB or 2GB, "
            "or none"
        )
    n = float(m.group(1)) * unit
    if not math.isfinite(n):
        raise ControlError(f"strata.vllm: KV limit {text!r} is not a finite size")
    return int(n)


def folder():
    """The control folder, or None when STRATA_VLLM_CONTROL_DIR is set empty."""
    value = os.environ.get("STRATA_VLLM_CONTROL_DIR")
    if value is None:
        return os.path.join(tempfile.gettempdir(), f"strata-vllm-{os.getuid()}")
    return value or None


class Endpoint:
    """One engine's two files. ``publish`` and ``read_limit`` run on the trimmer thread."""

    def __init__(self, directory, label):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.name = f"{os.getpid()}-{label}"
        self.status_path = os.path.join(directory, self.name + ".json")
        self.limit_path = os.path.join(directory, self.name + ".limit")
        self._seen = None  # (mtime_ns, size) of the limit file last read
        self._published = None
        self._lock = threading.Lock()  # no figures written after the files were removed
        self._removed = False
        atexit.register(self.remove)  # an engine never shut down leaves no files either

    def publish(self, figures):
        with self._lock:
            if self._removed or figures == self._published:
                return
            _write_atomically(self.status_path, json.dumps(figures))
            self._published = figures

    def read_limit(self):
        """(changed, limit): whether the limit file changed since the last call, and the limit
        it holds (None: none). A removed file reads as no limit."""
        try:
            st = os.stat(self.limit_path)
        except FileNotFoundError:
            changed, self._seen = self._seen is not None, None
            return changed, None
        key = (st.st_mtime_ns, st.st_size)
        if key == self._seen:
            return False, None
        self._seen = key
        with open(self.limit_path) as f:
            return True, parse_limit(f.read())

    def remove(self):
        with self._lock:
            self._removed = True
            for path in (self.status_path, self.limit_path):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass


def _write_atomically(path, text):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def engines(directory=None):
    """The figures every live engine published in ``directory`` (default: folder()), by name;
    files left by processes that are gone are removed."""
    directory = directory or folder()
    out = {}
    if directory is None or not os.path.isdir(directory):
        return out
    for entry in sorted(os.listdir(directory)):
        if not entry.endswith(".json"):
            continue
        path = os.path.join(directory, entry)
        try:
            with open(path) as f:
                figures = json.load(f)
        except (OSError, ValueError):
            continue  # being replaced, or not ours
        if not _alive(int(figures.get("pid", -1))):
            for stale in (path, path[: -len(".json")] + ".limit"):
                try:
                    os.unlink(stale)
                except FileNotFoundError:
                    pass
            continue
        out[entry[: -len(".json")]] = figures
    return out


def write_limit(name, limit_text, directory=None):
    """Sets engine ``name``'s limit (``P-L``, as ``list`` shows it) to ``limit_text``."""
    directory = directory or folder()
    parse_limit(limit_text)  # refuse a bad size here, not in the engine's log
    if name not in engines(directory):
        known = ", ".join(engines(directory)) or "none"
        raise ControlError(
            f"strata.vllm: no live engine {name!r} in {directory} (engines: {known})"
        )
    _write_atomically(os.path.join(directory, name + ".limit"), str(limit_text).strip() + "\n")


def _mib(n):
    return "none" if n is None else f"{n / 2**20:.1f} MiB"


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m strata.vllm.control",
        description="Lists strata.vllm engines and sets their KV limits (STRATA_VLLM_CONTROL_DIR).",
    )
    ap.add_argument("--dir", help="the control folder (default: STRATA_VLLM_CONTROL_DIR's)")
    sub = ap.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="live engines and their KV figures")
    ls.add_argument("--json", action="store_true", help="one JSON object, by engine name")
    lim = sub.add_parser("limit", help="set an engine's KV limit")
    lim.add_argument("engine", help="P-L, as list shows it")
    lim.add_argument("size", help="bytes, a size such as 512MiB or 2GB, or none")
    args = ap.parse_args(argv)
    directory = args.dir or folder()
    if directory is None:
        print("strata.vllm: STRATA_VLLM_CONTROL_DIR is empty: no control folder", file=sys.stderr)
        return 2
    try:
        if args.command == "limit":
            write_limit(args.engine, args.size, directory)
            return 0
        found = engines(directory)
    except ControlError as e:
        print(e, file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(found))
        return 0
    print(f"{'engine':<16} {'mapped':>12} {'limit':>12} {'virtual':>12}")
    for name, f in found.items():
        print(
            f"{name:<16} {_mib(f['mapped_bytes']):>12} {_mib(f['limit_bytes']):>12} "
            f"{_mib(f['virtual_bytes']):>12}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
