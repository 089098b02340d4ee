"""The process's trimmer thread (strata.vllm.elastic): it unmaps KV groups whose trim delay is
over and applies limits set from outside, with no engine step needed. It touches an engine's
block pool only under that engine's ``engine_lock``."""

import logging
import threading
import time

from . import control

log = logging.getLogger("vllm.strata")


def trim(kv, force=False, blocking=True):
    """Runs ``kv``'s trim under its engine lock (without waiting for it unless ``blocking``: a
    busy engine is not idle). Returns the number of groups unmapped."""
    if not kv.engine_lock.acquire(blocking=blocking):
        return 0
    try:
        fn = kv.trim
        return 0 if kv.closed or fn is None else fn(force)
    finally:
        kv.engine_lock.release()


class Trimmer:
    """One daemon thread per process: sleeps until the earliest trim delay asked for is over,
    then trims every open space (each under its engine lock; a space with groups still waiting
    asks again); with a control folder it also wakes every POLL_S seconds to read the limits
    and publish the figures there."""

    def __init__(self, spaces):
        self._spaces = spaces  # () -> the open ElasticKv instances of this process
        self._cv = threading.Condition()
        self._due = None  # the earliest monotonic time a trim was asked for
        self._next_poll = None  # the next control-folder poll (None: no polling)
        self._thread = None

    def wake(self, at):
        with self._cv:
            if self._due is None or at < self._due:
                self._due = at
                self._start()

    def start_polling(self):
        with self._cv:
            if self._next_poll is None:
                self._next_poll = time.monotonic() + control.POLL_S
                self._start()

    def _start(self):
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="strata-vllm-trim", daemon=True)
            self._thread.start()
        self._cv.notify()

    def _run(self):
        while True:
            with self._cv:
                while True:
                    now = time.monotonic()
                    times = [t for t in (self._due, self._next_poll) if t is not None]
                    if times and min(times) <= now:
                        break
                    self._cv.wait(min(times) - now if times else None)
                trim_now = self._due is not None and self._due <= now
                poll_now = self._next_poll is not None and self._next_poll <= now
                if trim_now:
                    self._due = None
                if poll_now:
                    self._next_poll = now + control.POLL_S
            for kv in self._spaces():
                try:
                    if poll_now:
                        kv.poll_control()
                    if trim_now:
                        trim(kv)
                except Exception:  # noqa: BLE001 - the thread must outlive one engine's failure
                    log.exception("strata.vllm: trimming KV space %s failed", kv.label)
