"""The worker side of strata.vllm.offload: vLLM's offloaded chunks as requests of one strata KV
space, kept in its host and disk tiers.

Geometry. vLLM hands the worker one ``(num_blocks, block_bytes)`` int8 view per layer
(``CanonicalKVCaches``). In the strata space, vLLM layer ``i`` is strata tensor ``i`` (layer
``i // 2``, K for even ``i``, V for odd) and a strata *token* is ``gcd(block_bytes, page)``
bytes, so one vLLM block of one layer is ``tokens_per_block`` tokens. Chunk ``c`` (
``blocks_per_chunk`` blocks) is one request of ``tokens_per_chunk`` tokens, admitted when ``c``
is first stored (``_slots``: chunk id -> (request, slot)); sub-block ``k`` of a chunk is tokens
``k * tokens_per_block..`` of its request in every tensor.

Transfers are asynchronous, as vLLM's ``OffloadingWorker`` contract has them: ``submit_store``
and ``submit_load`` queue a job and return; one transfer thread runs the jobs in submission
order; ``get_finished`` reports each finished job once; ``wait`` blocks until the jobs named no
longer touch vLLM's blocks. A job's copies are one ``strata_kv_copy_tokens`` call (the backend's
block-copy kernel) on the worker's own strata stream, never a host-side index copy:

- store: (CUDA: after the compute queued before the submit, an event on torch's current stream)
  admit the chunks' requests, copy the blocks in, wait for the copies, report (vLLM may reuse
  the blocks, load the chunks or resume the request from here on), then spill the requests to
  the host tier (the tier store moves the coldest objects on to disk when host memory is full;
  a full tier leaves them on the device, intact: ``spills_failed``).
- load: make the requests resident (a prefetched one already is), copy them out into vLLM's
  blocks, wait for the copies, spill them again (their clean host copy makes that free),
  report; vLLM schedules the request only after ``get_finished`` reported its load.
- tick (each ``get_finished``: one engine step): advance strata's step clock, hint the chunks of
  requests the scheduler just preempted to strata's lookahead, send prefetched chunks not loaded
  within ``prefetch_steps`` steps back to host.

On the CPU, vLLM's forward has finished when the submit comes (stores are submitted at the start
of the next step), and the forward running meanwhile touches no block a job reads or writes:
vLLM fences a block with a store in flight before reusing it (``wait``), and schedules a loading
request only after its load finished.
"""

import ctypes
import math
import queue
import threading
import time

import numpy as np  # imported with the worker, inside vLLM (which needs numpy)

import strata
from strata import Status
from strata._lib import error
import strata.kv

from .elastic import _env_int, log

# engine_id -> the worker of that engine in this process (strata.vllm.offload.stats()).
_WORKERS = {}

# numpy's view of strata_kv_token_copy_t: a job's copies are filled in one vectorised pass.
_TOKEN_COPY = np.dtype(
    {
        "names": [name for name, _ in strata.kv.TokenCopy._fields_],
        "formats": [np.dtype(ctype) for _, ctype in strata.kv.TokenCopy._fields_],
        "offsets": [getattr(strata.kv.TokenCopy, name).offset for name, _ in strata.kv.TokenCopy._fields_],
        "itemsize": ctypes.sizeof(strata.kv.TokenCopy),
    }
)

class _Job:
    """One submitted transfer."""

    __slots__ = ("job_id", "store", "chunks", "blocks", "skip", "compute", "released",
                 "error", "start", "seconds")

    def __init__(self, job_id, store, chunks, gpu_spec, bpc, compute):
        self.job_id = job_id
        self.store = store
        self.chunks = [int(c) for c in chunks]
        self.blocks = [int(b) for b in gpu_spec.block_ids]
        # The first block's place inside its chunk (a load may start mid-chunk).
        self.skip = int(gpu_spec.block_indices[0]) % bpc
        self.compute = compute  # CUDA: the compute queued before the submit; None on the CPU
        self.released = threading.Event()  # reported; it no longer touches vLLM's blocks
        self.error = None
        self.start = self.seconds = 0.0


class _Tick:
    """One engine step: the step clock and the chunks hinted since the last one."""

    __slots__ = ("step", "hinted")

    def __init__(self, step, hinted):
        self.step, self.hinted = step, hinted


class StrataOffloadWorker:
    """vLLM ``OffloadingWorker`` (duck-typed: vLLM calls these four methods) on a strata KV
    space."""

    def __init__(self, kv_caches, spec):
        import torch

        if len(kv_caches.group_data_refs) != 1:
            raise error(
                Status.UNSUPPORTED,
                f"strata.vllm.offload: {len(kv_caches.group_data_refs)} KV cache groups; one "
                "is supported"
            )
        src = [t.tensor for t in kv_caches.tensors]
        bpc = spec.blocks_per_chunk
        block_bytes = spec.layer_chunk_bytes // bpc
        widths = {t.shape[1] * t.element_size() for t in src}
        if len(src) != spec.layers or widths != {block_bytes}:
            raise error(
                Status.UNSUPPORTED,
                f"strata.vllm.offload: the worker sees {len(src)} KV tensors of "
                f"{sorted(widths)} B per block, the scheduler planned {spec.layers} of "
                f"{block_bytes} B"
            )
        self._torch = torch
        self.blocks_per_chunk = bpc
        self.block_bytes = block_bytes
        token = math.gcd(block_bytes, spec.page)
        self.tokens_per_block = block_bytes // token
        self.tokens_per_chunk = bpc * self.tokens_per_block
        self._cuda = src[0].device.type == "cuda"
        # Where vLLM block b of layer i starts: base[i] + b * stride[i] (bytes).
        self._base = np.array([t.data_ptr() for t in src], dtype=np.uint64)
        self._stride = np.array([t.stride(0) * t.element_size() for t in src], dtype=np.uint64)
        self._layers = len(src)
        self.space = strata.kv.KvSpace(
            layers=math.ceil(len(src) / 2),
            kv_heads=1,
            head_dim=token,
            dtype="int8",
            max_requests=spec.num_chunks,
            max_tokens=self.tokens_per_chunk,
            device=spec.device,
            durability="backed",
            host_bytes=spec.host_bytes,
            disk_bytes=spec.disk_bytes,
            disk_dir=spec.disk_dir,
        )
        try:
            ours = self.space.tensor(0, "k").dlpack_device_type == 2  # kDLCUDA
            if ours != self._cuda:
                raise error(
                    Status.UNSUPPORTED,
                    f"strata.vllm.offload: strata's KV memory is {'CUDA' if ours else 'host'} "
                    f"memory, vLLM's KV is on {src[0].device} (strata's backend and vLLM's "
                    "device must agree)",
                )
            self.stream = strata.Stream(spec.device)
        except BaseException:
            self.space.close()
            raise
        from vllm.v1.kv_offload.base import TransferResult

        self._result = TransferResult
        self._engine_id = spec.config.engine_id
        self._slots = {}  # chunk id -> (strata request, slot); the transfer thread's
        self._prefetched = {}  # hinted chunk id -> step of the hint; the transfer thread's
        self._hinted = []  # chunk ids hinted since the last get_finished (engine thread)
        self._jobs = {}  # job id -> _Job, submitted and not reported yet (engine thread)
        self._finished = []  # _Jobs the transfer thread finished, not reported yet
        self._failure = None  # a tick's error, raised by the next get_finished
        self._lock = threading.Lock()
        self._queue = queue.SimpleQueue()
        self.prefetch_steps = spec.prefetch_steps
        self._step = 0
        self._last_log = None
        self.counts = {
            "stored_chunks": 0,
            "loaded_chunks": 0,
            "hinted_chunks": 0,
            "prefetches_dropped": 0,
            "spills_failed": 0,  # stored chunks a full tier left on the device
            "jobs_submitted": 0,
            "jobs_reported": 0,
            "most_jobs_in_flight": 0,
            # engine steps after which a submitted store was still in flight (not reported)
            "steps_with_stores_in_flight": 0,
        }
        self._thread = threading.Thread(
            target=self._run, name=f"strata-offload-{self._engine_id}", daemon=True
        )
        self._thread.start()
        log.info(
            "strata.vllm.offload: %d layers, chunks of %d blocks (%d B per layer), %d chunks "
            "in %.1f MiB host + %.1f MiB disk",
            len(src),
            bpc,
            spec.layer_chunk_bytes,
            spec.num_chunks,
            spec.host_bytes / 2**20,
            spec.disk_bytes / 2**20,
        )

    # ---- vLLM's OffloadingWorker (the engine's thread) ---------------------------------------

    def submit_store(self, job_id, src_spec, dst_spec):
        return self._submit(_Job(job_id, True, dst_spec.block_ids, src_spec,
                                 self.blocks_per_chunk, self._compute_event()))

    def submit_load(self, job_id, src_spec, dst_spec):
        return self._submit(_Job(job_id, False, src_spec.block_ids, dst_spec,
                                 self.blocks_per_chunk, self._compute_event()))

    def get_finished(self):
        """The jobs finished since the last call, each reported once; one engine step. A job
        that failed raises its error here (vLLM has no use for a failed transfer)."""
        self._step += 1
        hinted, self._hinted = self._hinted, []
        self._queue.put(_Tick(self._step, hinted))
        with self._lock:
            done, self._finished = self._finished, []
            failure, self._failure = self._failure, None
        for job in done:
            del self._jobs[job.job_id]
        self.counts["jobs_reported"] += len(done)
        if any(j.store for j in self._jobs.values()):
            self.counts["steps_with_stores_in_flight"] += 1
        failed = next((j for j in done if j.error is not None), None)
        if failed is not None:
            raise failed.error
        if failure is not None:
            raise failure
        self._maybe_log()
        return [
            self._result(
                job_id=j.job_id,
                success=True,
                transfer_size=len(j.blocks) * self.block_bytes * self._layers,
                transfer_time=j.seconds,
            )
            for j in done
        ]

    def wait(self, job_ids):
        """Blocks until the jobs named no longer touch vLLM's blocks (a store's copies of them
        completed; its spill to the host tier may still run)."""
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is not None:
                job.released.wait()
                if job.error is not None:
                    raise job.error

    def flush(self):
        """Blocks until everything queued so far (jobs, ticks) ran; their results still go to
        the next get_finished."""
        ran = threading.Event()
        self._queue.put(ran)
        ran.wait()

    def shutdown(self):
        """Finishes the jobs queued, then releases the chunks, the stream and the space."""
        if _WORKERS.get(self._engine_id) is self:
            del _WORKERS[self._engine_id]
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        for r, _ in self._slots.values():
            r.release()
        self._slots.clear()
        self.stream.close()
        self.space.close()

    # ---- hints from the scheduler (on the connector metadata: offload.install_hint_channel) -

    def hint(self, chunks):
        """Chunks of requests the scheduler preempted: hinted to strata's lookahead at the next
        get_finished (after this step's stores were submitted)."""
        self._hinted.extend(chunks)

    # ---- submission ----------------------------------------------------------------------

    def _compute_event(self):
        """CUDA: an event after the work queued so far on torch's current stream (the forward
        that wrote a store's blocks, or last read a load's); the transfer thread waits for it.
        None on the CPU, where that work has finished when the submit comes."""
        if not self._cuda:
            return None
        ev = self._torch.cuda.Event()
        ev.record(self._torch.cuda.current_stream())
        return ev

    def _submit(self, job):
        self._jobs[job.job_id] = job
        self.counts["jobs_submitted"] += 1
        self.counts["most_jobs_in_flight"] = max(
            self.counts["most_jobs_in_flight"], len(self._jobs)
        )
        self._queue.put(job)
        return True

    # ---- the transfer thread -------------------------------------------------------------

    def _run(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):  # flush()
                item.set()
                continue
            if isinstance(item, _Tick):
                try:
                    self._tick(item)
                except BaseException as e:  # raised by the next get_finished
                    with self._lock:
                        self._failure = self._failure or e
                continue
            item.start = time.perf_counter()
            try:
                if item.compute is not None:
                    item.compute.synchronize()
                (self._store if item.store else self._load)(item)
            except strata.OutOfMemory as e:
                if not item.released.is_set():
                    item.error = e
                else:  # a spill after the report: the chunks stay on the device, intact
                    self.counts["spills_failed"] += 1
                    log.warning("strata.vllm.offload: chunks stay on the device: %s", e)
            except BaseException as e:
                if not item.released.is_set():
                    item.error = e
                else:
                    with self._lock:
                        self._failure = self._failure or e
            self._report(item)

    def _report(self, job):
        """Hands ``job`` to the next get_finished (once) and releases vLLM's blocks."""
        if job.released.is_set():
            return
        job.seconds = time.perf_counter() - job.start
        job.released.set()
        with self._lock:
            self._finished.append(job)

    def _store(self, job):
        requests = [self._fresh(c) for c in job.chunks]
        self._copy("in", job, requests)
        self.counts["stored_chunks"] += len(requests)
        # Reported now: vLLM may reuse the blocks, and load the chunks (later jobs run after
        # this spill) or let the request resume; the spill to the host tier follows.
        self._report(job)
        for r in requests:
            r.spill("host")

    def _load(self, job):
        missing = [c for c in job.chunks if c not in self._slots]
        if missing:
            raise error(
                Status.INVALID_STATE,
                f"strata.vllm.offload: load of chunks {missing} that were never stored"
            )
        requests = [self._slots[c][0] for c in job.chunks]
        self.space.make_resident(requests, self.stream)
        for c in job.chunks:
            self._prefetched.pop(c, None)
        self._copy("out", job, requests)
        for r in requests:
            r.spill("host")
        self.counts["loaded_chunks"] += len(requests)

    def _copy(self, direction, job, requests):
        """Every layer of the job's blocks to or from its chunks' requests, in one call on the
        worker's stream, and waits for it: logical block ``j`` sits in chunk ``(j + skip) //
        bpc`` at sub-block ``(j + skip) % bpc``."""
        bpc, tpb = self.blocks_per_chunk, self.tokens_per_block
        logical = np.arange(len(job.blocks), dtype=np.int64) + job.skip
        handles = np.array([r.handle for r in requests], dtype=np.uint64)[logical // bpc]
        first = ((logical % bpc) * tpb).astype(np.uint32)
        blocks = np.array(job.blocks, dtype=np.uint64)
        layers = np.arange(self._layers, dtype=np.uint32)
        plan = np.zeros((self._layers, len(blocks)), dtype=_TOKEN_COPY)
        plan["request"] = handles[None, :]
        plan["layer"] = (layers // 2)[:, None]
        plan["kind"] = (layers % 2).astype(np.int32)[:, None]
        plan["first_token"] = first[None, :]
        plan["address"] = self._base[:, None] + blocks[None, :] * self._stride[:, None]
        copies = (strata.kv.TokenCopy * plan.size).from_buffer(plan)
        self.space.copy_tokens(direction, tpb, copies, self.stream)
        self.stream.synchronize()

    def _tick(self, tick):
        self.space.advance(tick.step)
        hinted = list(dict.fromkeys(c for c in tick.hinted if c in self._slots))
        if hinted:
            self.space.hint([[self._slots[c][0] for c in hinted]], self.stream)
            self.counts["hinted_chunks"] += len(hinted)
            self._prefetched.update((c, tick.step) for c in hinted)
        self._drop_stale_prefetches(tick.step)

    def _drop_stale_prefetches(self, step):
        """Hinted chunks not loaded within ``prefetch_steps`` steps go back to the host tier
        (their clean copy is still there: nothing is copied), so device memory holds only
        chunks about to load."""
        stale = [c for c, s in self._prefetched.items() if s + self.prefetch_steps < step]
        for c in stale:
            del self._prefetched[c]
            self._slots[c][0].spill("host")
        self.counts["prefetches_dropped"] += len(stale)

    def _fresh(self, chunk):
        """An empty request for ``chunk`` (the previous contents of a reused chunk id are stale:
        vLLM evicted them)."""
        old = self._slots.pop(chunk, None)
        self._prefetched.pop(chunk, None)
        if old is not None:
            old[0].release()
        r = self.space.admit()
        try:
            r.append(self.tokens_per_chunk)
            slot = r.slot
        except BaseException:
            r.release()
            raise
        self._slots[chunk] = (r, slot)
        return r

    # ---- operator view -------------------------------------------------------------------

    def stats(self):
        """Chunks stored, loaded and hinted, jobs, with the space's tier occupancy and bytes
        moved."""
        s = self.space.stats()
        out = dict(self.counts)
        out["chunks_held"] = len(self._slots)
        out["jobs_in_flight"] = len(self._jobs)
        for key in (
            "host_used_bytes",
            "host_capacity_bytes",
            "disk_used_bytes",
            "disk_capacity_bytes",
            "bytes_to_device",
            "bytes_from_device",
            "disk_read_bytes",
            "disk_write_bytes",
            "spills",
            "clean_spills",
            "restores",
            "prefetch_hits",
            "prefetch_misses",
            "blocks_resident",
        ):
            out[key] = s[key]
        return out

    def _maybe_log(self):
        interval = _env_int("STRATA_VLLM_LOG_INTERVAL", 10)
        now = time.monotonic()
        if interval == 0 or (self._last_log is not None and now - self._last_log < interval):
            return
        self._last_log = now
        s = self.stats()
        log.info(
            "strata KV offload: %d chunks held, %d stored, %d loaded, %d hinted, %d prefetch "
            "hits, %d jobs in flight; host %.1f/%.1f MiB, disk %.1f/%.1f MiB",
            s["chunks_held"],
            s["stored_chunks"],
            s["loaded_chunks"],
            s["hinted_chunks"],
            s["prefetch_hits"],
            s["jobs_in_flight"],
            s["host_used_bytes"] / 2**20,
            s["host_capacity_bytes"] / 2**20,
            s["disk_used_bytes"] / 2**20,
            s["disk_capacity_bytes"] / 2**20,
        )
