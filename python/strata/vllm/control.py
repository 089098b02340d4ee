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

The folder is created mode 0700, and refused (by engines, which then run without it, and by
the CLI, exit status 2) when it is a link, another user owns it, or it is group- or
world-writable. Only regular files are read, opened without following links and without
blocking (a FIFO), and checked with fstat; files are written through a new temporary file
(O_EXCL, O_NOFOLLOW, random name) renamed into place, so a planted link is never written
through. ``list`` skips engine files that no engine wrote (not JSON objects, no valid pid, a pid
other than the file name's, missing figures) with a warning; ``limit`` refuses them (exit 2).

``strata limit PID SIZE`` (README, "Operators") caps everything strata holds on a device for a
whole process instead, and what does not fit fails as out of memory; for a vLLM engine's KV this
control is the better one, since its limit reaches vLLM's scheduler, which queues and preempts.
"""

import argparse
import atexit
import contextlib
import errno
import json
import logging
import math
import os
import re
import stat
import sys
import tempfile
import threading

POLL_S = 0.5  # how often the trimmer thread reads the limits and refreshes the figures
_MAX_FILE = 1 << 16  # the most bytes read from a control file (figures and limits are small)
_PID_MAX = 2**31 - 1
_FIELDS = ("pid", "label", "virtual_bytes", "mapped_bytes", "limit_bytes")

log = logging.getLogger("vllm.strata")

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
    """A bad size, an engine the control folder does not know, a file no engine wrote (not a
    regular file, a link, malformed figures), or a folder other users could write."""


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


def check_folder(directory, create=False):
    """Checks the control folder (with ``create``, makes it first, mode 0700): a directory, not
    a link, owned by this user and neither group- nor world-writable, so no other user can plant
    or replace files in it. Raises ControlError otherwise, FileNotFoundError when it is missing
    (and not created)."""
    if create:
        os.makedirs(os.path.dirname(os.path.abspath(directory)), exist_ok=True)
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise ControlError(f"strata.vllm: control folder {directory} is not a directory (a link?): refused")
    if st.st_uid != os.geteuid():
        raise ControlError(
            f"strata.vllm: control folder {directory} is owned by uid {st.st_uid}, not this user "
            f"({os.geteuid()}): refused"
        )
    if st.st_mode & 0o022:
        raise ControlError(
            f"strata.vllm: control folder {directory} is group- or world-writable "
            f"(mode {stat.S_IMODE(st.st_mode):o}): refused"
        )


def _read(path):
    """The text of the regular file ``path``, opened without following a link and without
    blocking (a FIFO), checked with fstat; at most ``_MAX_FILE`` bytes. Raises
    FileNotFoundError when it is missing, ControlError for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        what = "a symbolic link (not followed)" if e.errno == errno.ELOOP else e.strerror
        raise ControlError(f"strata.vllm: {path}: {what}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ControlError(f"strata.vllm: {path} is not a regular file")
        chunks, size = [], 0
        while size <= _MAX_FILE:
            chunk = os.read(fd, _MAX_FILE + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > _MAX_FILE:
        raise ControlError(f"strata.vllm: {path} is larger than {_MAX_FILE} bytes")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        raise ControlError(f"strata.vllm: {path} is not UTF-8 text") from None


def _write_atomically(path, text):
    """Writes ``text`` to ``path`` through a new temporary file beside it (a random name, created
    with O_EXCL and O_NOFOLLOW, mode 0600: a planted link is never written through), renamed
    over ``path`` (which replaces a link there, never follows it). Raises ControlError, with
    the temporary file removed, when that fails (``path`` is a directory, say)."""
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise ControlError(f"strata.vllm: cannot write {path}: {e.strerror or e}") from None
        raise


class Endpoint:
    """One engine's two files. ``publish`` and ``read_limit`` run on the trimmer thread. Raises
    ControlError when the folder is refused (``check_folder``)."""

    def __init__(self, directory, label):
        check_folder(directory, create=True)
        self.name = f"{os.getpid()}-{label}"
        self.status_path = os.path.join(directory, self.name + ".json")
        self.limit_path = os.path.join(directory, self.name + ".limit")
        self._seen = None  # (inode, mtime_ns, size, mode) of the limit file last read
        self._published = None
        self._publish_error = None  # the last failure logged (each logged once)
        self._lock = threading.Lock()  # no figures written after the files were removed
        self._removed = False
        atexit.register(self.remove)  # an engine never shut down leaves no files either

    def publish(self, figures):
        """Writes the figures (when they changed); a failure is logged, once."""
        with self._lock:
            if self._removed or figures == self._published:
                return
            try:
                _write_atomically(self.status_path, json.dumps(figures))
            except ControlError as e:
                if str(e) != self._publish_error:
                    log.error("%s", e)
                    self._publish_error = str(e)
                return
            self._published = figures

    def read_limit(self):
        """(changed, limit): whether the limit file changed since the last call, and the limit
        it holds (None: none). A removed file reads as no limit. Raises ControlError, once per
        change of the file, for a bad size or a file that is not a regular one (a link, a
        FIFO, a directory: never followed or waited on)."""
        try:
            st = os.lstat(self.limit_path)
        except FileNotFoundError:
            changed, self._seen = self._seen is not None, None
            return changed, None
        key = (st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode)
        if key == self._seen:
            return False, None
        self._seen = key
        try:
            text = _read(self.limit_path)
        except FileNotFoundError:
            return False, None  # removed meanwhile: the next call says so
        return True, parse_limit(text)

    def remove(self):
        with self._lock:
            self._removed = True
            for path in (self.status_path, self.limit_path):
                with contextlib.suppress(OSError):
                    os.unlink(path)


def _figures(name, text):
    """The figures in engine file ``name``.json, checked to be what an engine writes. Raises
    ControlError saying what is wrong."""
    try:
        figures = json.loads(text, parse_constant=_refuse_constant)
    except ValueError as e:
        raise ControlError(f"not JSON ({e})") from None
    if not isinstance(figures, dict):
        raise ControlError(f"not a JSON object but {type(figures).__name__}")
    missing = [k for k in _FIELDS if k not in figures]
    if missing:
        raise ControlError(f"no {', '.join(missing)}")
    pid = figures["pid"]
    if type(pid) is not int or not 0 < pid <= _PID_MAX:
        raise ControlError(f"pid {pid!r} is not a process id")
    if name.split("-", 1)[0] != str(pid):
        raise ControlError(f"pid {pid} is not the one in the file name")
    for key in ("virtual_bytes", "mapped_bytes", "limit_bytes"):
        value = figures[key]
        if not (value is None and key == "limit_bytes") and (type(value) is not int or value < 0):
            raise ControlError(f"{key} {value!r} is not a byte count")
    return figures


def _refuse_constant(name):
    raise ValueError(f"{name} is not a number here")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def engines(directory=None, on_skip=None):
    """The figures every live engine published in ``directory`` (default: folder()), by name;
    files left by processes that are gone are removed. Files no engine could have written (not
    regular files, links, malformed figures) are skipped: ``on_skip(name, reason)`` is called
    for each (default: a logged warning). Raises ControlError when the folder is refused
    (``check_folder``)."""
    directory = directory or folder()
    out = {}
    if directory is None:
        return out
    try:
        check_folder(directory)
    except FileNotFoundError:
        return out
    on_skip = on_skip or (lambda name, why: log.warning("strata.vllm: %s.json skipped: %s", name, why))
    for entry in sorted(os.listdir(directory)):
        if not entry.endswith(".json"):
            continue
        name, path = entry[: -len(".json")], os.path.join(directory, entry)
        try:
            figures = _figures(name, _read(path))
        except FileNotFoundError:
            continue  # removed meanwhile (its engine shut down)
        except ControlError as e:
            on_skip(name, str(e))
            continue
        if not _alive(figures["pid"]):
            for stale in (path, os.path.join(directory, name + ".limit")):
                with contextlib.suppress(OSError):
                    os.unlink(stale)
            continue
        out[name] = figures
    return out


def write_limit(name, limit_text, directory=None):
    """Sets engine ``name``'s limit (``P-L``, as ``list`` shows it) to ``limit_text``. Raises
    ControlError for a bad size, an engine that is not live or whose file is malformed, a
    refused folder, or a limit path that cannot be written (a directory, say)."""
    directory = directory or folder()
    parse_limit(limit_text)  # refuse a bad size here, not in the engine's log
    skipped = {}
    found = engines(directory, on_skip=skipped.__setitem__)
    if name in skipped:
        raise ControlError(f"strata.vllm: {name}.json in {directory} is not an engine's file: {skipped[name]}")
    if name not in found:
        known = ", ".join(found) or "none"
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
    def skipped(name, why):
        print(f"strata.vllm: {name}.json skipped: {why}", file=sys.stderr)

    try:
        if args.command == "limit":
            write_limit(args.engine, args.size, directory)
            return 0
        found = engines(directory, on_skip=skipped)
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
