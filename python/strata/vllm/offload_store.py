"""The worker side of strata.vllm.offload: vLLM's offloaded chunks as requests of one strata KV
space, kept in its host and disk tiers.

Geometry. vLLM hands the worker one ``(num_blocks, page_bytes)`` int8 view per layer
(``CanonicalKVCaches``). A chunk is ``blocks_per_chunk`` blocks; in the strata space, vLLM layer
``i`` is strata tensor ``i`` (layer ``i // 2``, K for even ``i``, V for odd), a strata *token* is
one strata page of one tensor, and chunk ``c`` is one request of ``layer_chunk_bytes / page``
tokens, admitted when ``c`` is first stored (``_slots``: chunk id -> (request, slot)). Seen as
rows of ``page_bytes``, sub-block ``k`` of the request in slot ``s`` is row
``s * blocks_per_chunk + k`` of every strata tensor.

Transfers run when submitted and complete before the call returns (the engine's next
``get_finished`` reports them): a store copies the blocks in, waits for the copies, and spills
the requests to the host tier; a load makes the requests resident (a prefetched one already
is), copies them out and spills them again (their clean host copy makes that free).
"""

import math
import time

import strata
from strata import Status
from strata._lib import error
import strata.kv

from .elastic import _env_int, log
from .offload import _WORKERS


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
        self.src = [t.tensor for t in kv_caches.tensors]
        page_bytes = {t.shape[1] for t in self.src}
        bpc = spec.blocks_per_chunk
        if len(self.src) != spec.layers or page_bytes != {spec.layer_chunk_bytes // bpc}:
            raise error(
                Status.UNSUPPORTED,
                f"strata.vllm.offload: the worker sees {len(self.src)} KV tensors of "
                f"{sorted(page_bytes)} B per block, the scheduler planned {spec.layers} of "
                f"{spec.layer_chunk_bytes // bpc} B"
            )
        self.blocks_per_chunk = bpc
        self.page_bytes = spec.layer_chunk_bytes // bpc
        self.tokens_per_chunk = spec.layer_chunk_bytes // spec.page
        device = self.src[0].device
        self._cuda = device.type == "cuda"
        self._torch = torch
        self.space = strata.kv.KvSpace(
            layers=math.ceil(len(self.src) / 2),
            kv_heads=1,
            head_dim=spec.page,
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
            self.rows = [self._rows_of(i, spec.num_chunks) for i in range(len(self.src))]
            if self.rows[0].device.type != device.type:
                raise error(
                    Status.UNSUPPORTED,
                    f"strata.vllm.offload: strata's KV tensors are {self.rows[0].device.type} "
                    f"tensors, vLLM's are on {device} (strata's backend and vLLM's device must "
                    "agree)",
                )
        except BaseException:
            self.rows = []
            self.space.close()
            raise
        from vllm.v1.kv_offload.base import TransferResult

        self._result = TransferResult
        self._engine_id = spec.config.engine_id
        self._slots = {}  # chunk id -> (strata request, slot)
        self._done = []  # TransferResults not reported yet
        self._hinted = []  # chunk ids to hint at the next get_finished
        self._prefetched = {}  # hinted chunk id -> step of the hint, until loaded or dropped
        self.prefetch_steps = spec.prefetch_steps
        self._step = 0
        self._last_log = None
        self.counts = {
            "stored_chunks": 0,
            "loaded_chunks": 0,
            "hinted_chunks": 0,
            "prefetches_dropped": 0,
        }
        log.info(
            "strata.vllm.offload: %d layers, chunks of %d blocks (%d B per layer), %d chunks "
            "in %.1f MiB host + %.1f MiB disk",
            len(self.src),
            bpc,
            spec.layer_chunk_bytes,
            spec.num_chunks,
            spec.host_bytes / 2**20,
            spec.disk_bytes / 2**20,
        )

    def _rows_of(self, index, num_chunks):
        t = self._torch.from_dlpack(self.space.tensor(index // 2, "k" if index % 2 == 0 else "v"))
        # .view fails (rather than copying) if the tensor is not one contiguous run.
        return t.view(-1).view(num_chunks * self.blocks_per_chunk, self.page_bytes)

    # ---- vLLM's OffloadingWorker ---------------------------------------------------------

    def submit_store(self, job_id, src_spec, dst_spec):
        start = time.perf_counter()
        chunks = [int(c) for c in dst_spec.block_ids]
        requests = [self._fresh(c) for c in chunks]
        gpu, rows = self._pairs(src_spec, chunks)
        for src, dst in zip(self.src, self.rows):
            dst.index_copy_(0, rows, src.index_select(0, gpu))
        self._synchronize()
        for r in requests:
            r.spill("host")
        self.counts["stored_chunks"] += len(chunks)
        self._finish(job_id, len(gpu), start)
        return True

    def submit_load(self, job_id, src_spec, dst_spec):
        start = time.perf_counter()
        chunks = [int(c) for c in src_spec.block_ids]
        missing = [c for c in chunks if c not in self._slots]
        if missing:
            raise error(
                Status.INVALID_STATE,
                f"strata.vllm.offload: load of chunks {missing} that were never stored"
            )
        requests = [self._slots[c][0] for c in chunks]
        self.space.make_resident(requests, self._stream())
        for c in chunks:
            self._prefetched.pop(c, None)
        gpu, rows = self._pairs(dst_spec, chunks)
        for src, dst in zip(self.src, self.rows):
            src.index_copy_(0, gpu, dst.index_select(0, rows))
        self._synchronize()
        for r in requests:
            r.spill("host")
        self.counts["loaded_chunks"] += len(chunks)
        self._finish(job_id, len(gpu), start)
        return True

    def get_finished(self):
        self._step += 1
        self.space.advance(self._step)
        if self._hinted:
            hinted, self._hinted = self._hinted, []
            hinted = [c for c in hinted if c in self._slots]
            if hinted:
                self.space.hint([[self._slots[c][0] for c in hinted]], self._stream())
                self.counts["hinted_chunks"] += len(hinted)
                self._prefetched.update((c, self._step) for c in hinted)
        self._drop_stale_prefetches()
        done, self._done = self._done, []
        self._maybe_log()
        return done

    def wait(self, job_ids):
        """Every submitted transfer has completed already."""

    def shutdown(self):
        if _WORKERS.get(self._engine_id) is self:
            del _WORKERS[self._engine_id]
        self.rows = []
        for r, _ in self._slots.values():
            r.release()
        self._slots.clear()
        self.space.close()

    # ---- the scheduler's side (same process) ---------------------------------------------

    def hint(self, chunks):
        """Chunks of requests the scheduler preempted: hinted to strata's lookahead at the next
        get_finished (after this step's stores were submitted)."""
        self._hinted.extend(chunks)

    # ---- helpers -------------------------------------------------------------------------

    def _drop_stale_prefetches(self):
        """Hinted chunks not loaded within ``prefetch_steps`` steps go back to the host tier
        (their clean copy is still there: nothing is copied), so device memory holds only
        chunks about to load."""
        stale = [c for c, s in self._prefetched.items() if s + self.prefetch_steps < self._step]
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

    def _pairs(self, gpu_spec, chunks):
        """(vLLM block ids, strata rows) of a transfer: logical block ``j`` of the group sits
        in chunk ``(j + skip) // bpc`` at sub-block ``(j + skip) % bpc``, where ``skip`` is the
        first block's offset inside its chunk."""
        torch = self._torch
        bpc = self.blocks_per_chunk
        skip = int(gpu_spec.block_indices[0]) % bpc
        gpu = torch.as_tensor(gpu_spec.block_ids, dtype=torch.long)
        logical = torch.arange(len(gpu), dtype=torch.long) + skip
        slots = torch.as_tensor([self._slots[c][1] for c in chunks], dtype=torch.long)
        rows = slots[logical // bpc] * bpc + logical % bpc
        device = self.src[0].device
        return gpu.to(device), rows.to(device)

    def _stream(self):
        return self._torch.cuda.current_stream() if self._cuda else None

    def _synchronize(self):
        if self._cuda:
            self._torch.cuda.current_stream().synchronize()

    def _finish(self, job_id, blocks, start):
        self._done.append(
            self._result(
                job_id=job_id,
                success=True,
                transfer_size=blocks * self.page_bytes * len(self.src),
                transfer_time=time.perf_counter() - start,
            )
        )

    # ---- operator view -------------------------------------------------------------------

    def stats(self):
        """Chunks stored, loaded and hinted, with the space's tier occupancy and bytes moved."""
        s = self.space.stats()
        out = dict(self.counts)
        out["chunks_held"] = len(self._slots)
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
            "hits; host %.1f/%.1f MiB, disk %.1f/%.1f MiB",
            s["chunks_held"],
            s["stored_chunks"],
            s["loaded_chunks"],
            s["hinted_chunks"],
            s["prefetch_hits"],
            s["host_used_bytes"] / 2**20,
            s["host_capacity_bytes"] / 2**20,
            s["disk_used_bytes"] / 2**20,
            s["disk_capacity_bytes"] / 2**20,
        )
