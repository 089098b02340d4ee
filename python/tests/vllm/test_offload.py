"""strata.vllm.offload against a real vLLM (the CPU build): run by .ci/run with .ci/vllm-env's
Python, beside test_vllm.py.

Skips without vLLM unless STRATA_REQUIRE_VLLM=1 (as .ci/run sets), where a missing vLLM fails.
The worker tests drive StrataOffloadWorker in this process with vLLM's own spec types; the
engine tests run run_offload.py in subprocesses, stock vLLM and vLLM with strata's offload,
under a KV budget that forces preemption.
"""

import json
import math
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run_engine import write_model  # noqa: E402
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
BLOCKS = 12  # vLLM KV blocks of 32 tokens: 8 requests of up to 242 tokens must preempt
MAX_TOKENS = 64
HOST_BYTES = 256 << 10  # four chunks: the rest moves on to the disk tier
DISK_BYTES = 16 << 20
SPARE_GROUPS = 2  # the elastic plugin's free groups kept mapped
HOLD_STORES = 8  # engine steps each store waits in the elastic run: in flight as blocks free

try:
    import vllm

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False
    if os.environ.get("STRATA_REQUIRE_VLLM") == "1":
        raise


def offload_key(n):
    """A chunk key as vLLM's OffloadingConnector makes them (a block hash and a group index)."""
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(n.to_bytes(32, "big"), 0)


def offloading_config(layers, block_bytes, blocks_per_chunk, **extra):
    """vLLM's OffloadingConfig for ``layers`` layers of ``block_bytes`` per block."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    import strata.vllm.offload as offload

    cfg = offload.kv_transfer_config(blocks_per_chunk=blocks_per_chunk, **extra)
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(32, tuple(f"layer{i}" for i in range(layers)), 0),),
        worker_kv_bytes_per_block=layers * block_bytes,
        enable_kv_cache_events=False,
        extra_config=cfg["kv_connector_extra_config"],
        engine_id="test-offload",
        model=OffloadingModelConfig("tiny", "float32"),
        cache=OffloadingCacheConfig(32, blocks_per_chunk),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
    )


@unittest.skipUnless(HAVE_VLLM, "vLLM is not installed (.ci/vllm-env installs it)")
class VersionGate(unittest.TestCase):
    def test_other_versions_are_refused(self):
        import strata.vllm.offload as offload

        offload.check()  # the installed vLLM
        for version in ("0.31.9", "0.33.0", "1.0.0"):
            with self.assertRaises(offload.UnsupportedVllm) as cm:
                offload.check(version)
            self.assertIn("'kv-offload' supports vLLM >=0.32.0,<0.33.0", str(cm.exception))
            self.assertIn(version, str(cm.exception))

    def test_vllm_building_the_spec_on_another_version_fails_loudly(self):
        import strata.vllm.offload as offload
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        config = offloading_config(2, 8192, 2, host_bytes=1 << 20)
        saved = vllm.__version__
        vllm.__version__ = "0.33.1"
        try:
            with self.assertRaises(offload.UnsupportedVllm):
                OffloadingSpecFactory.create_spec(config)
        finally:
            vllm.__version__ = saved


@unittest.skipUnless(HAVE_VLLM, "vLLM is not installed (.ci/vllm-env installs it)")
class Worker(unittest.TestCase):
    """The worker's data path, byte for byte, with strata's page size whatever it is."""

    LAYERS = 3  # odd: the last strata layer's V tensor is unused

    def setUp(self):
        import strata

        self.page = strata.stats(0)["page_size"]
        self.block = self.page // 2  # two vLLM blocks fill one strata page
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def worker(self, host_chunks, disk_chunks=0):
        import torch
        from vllm.v1.kv_offload.base import (
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
        )
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        chunk = 4 * self.page  # per chunk: 3 layers rounded up to 4 tensors of one page
        config = offloading_config(
            self.LAYERS,
            self.block,
            2,
            host_bytes=host_chunks * chunk,
            disk_bytes=disk_chunks * chunk,
            disk_dir=self.tmp.name if disk_chunks else None,
        )
        spec = OffloadingSpecFactory.create_spec(config)
        self.assertEqual(type(spec).__name__, "StrataOffloadingSpec")
        self.assertEqual(spec.num_chunks, host_chunks + disk_chunks)
        gen = torch.Generator().manual_seed(1)
        self.kv = [
            torch.randint(-128, 128, (16, self.block), dtype=torch.int8, generator=gen)
            for _ in range(self.LAYERS)
        ]
        caches = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(t, self.block) for t in self.kv],
            group_data_refs=[[CanonicalKVCacheRef(i, self.block) for i in range(self.LAYERS)]],
        )
        worker = spec.get_worker(caches)
        self.addCleanup(worker.shutdown)
        return spec, worker

    def store(self, worker, job, blocks, chunks, first=0):
        from vllm.v1.kv_offload.base import GPULoadStoreSpec
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        gpu = GPULoadStoreSpec(blocks, [len(blocks)], [first])
        self.assertTrue(worker.submit_store(job, gpu, CPULoadStoreSpec(chunks)))

    def load(self, worker, job, chunks, blocks, first=0):
        from vllm.v1.kv_offload.base import GPULoadStoreSpec
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        gpu = GPULoadStoreSpec(blocks, [len(blocks)], [first])
        self.assertTrue(worker.submit_load(job, CPULoadStoreSpec(chunks), gpu))

    def snapshot(self, blocks):
        return [t[blocks].clone() for t in self.kv]

    def assert_blocks(self, blocks, expected):
        import torch

        for t, e in zip(self.kv, expected):
            self.assertTrue(torch.equal(t[blocks], e))

    def reported(self, worker):
        """Waits for everything submitted, then the jobs get_finished reports (one step)."""
        worker.flush()
        return [(r.job_id, r.success) for r in worker.get_finished()]

    def test_blocks_come_back_byte_for_byte_through_the_host_tier(self):
        _, w = self.worker(host_chunks=8)
        stored = self.snapshot([2, 3, 4, 5])
        self.store(w, 1, [2, 3, 4, 5], [6, 1])
        self.assertEqual(self.reported(w), [(1, True)])
        s = w.stats()
        self.assertEqual(s["blocks_resident"], 0, "stored chunks stay on the device")
        self.assertGreater(s["host_used_bytes"], 0)
        for t in self.kv:
            t[2:6] = 0
        # into other blocks; the second half of chunk 6 first (a load that starts mid-chunk)
        self.load(w, 2, [6, 1], [9, 10, 11], first=1)
        self.load(w, 3, [6], [12, 13])
        self.assertEqual(self.reported(w), [(2, True), (3, True)])
        self.assert_blocks([9, 10, 11], [e[1:] for e in stored])
        self.assert_blocks([12, 13], [e[:2] for e in stored])
        self.assertEqual(w.stats()["blocks_resident"], 0, "loaded chunks stay on the device")

    def test_a_store_in_flight_does_not_block_the_engine_and_each_job_is_reported_once(self):
        import threading

        _, w = self.worker(host_chunks=8)
        stored = self.snapshot([0, 1, 2, 3])
        gate = threading.Event()
        real_store = w._store

        def held_store(job):  # the transfer thread's store, held until the gate opens
            gate.wait()
            real_store(job)

        w._store = held_store
        self.store(w, 1, [0, 1], [0])  # returns with the transfer queued
        self.store(w, 2, [2, 3], [1])
        for _ in range(5):  # engine steps run on while both stores are in flight
            self.assertEqual(w.get_finished(), [])
        s = w.stats()
        self.assertEqual((s["jobs_submitted"], s["jobs_in_flight"]), (2, 2))
        self.assertEqual(s["steps_with_stores_in_flight"], 5)
        self.assertEqual((s["stored_chunks"], s["jobs_reported"]), (0, 0))
        gate.set()
        w.wait({1, 2})  # vLLM's fence before it reuses the blocks: their copies are done
        for t in self.kv:
            t[0:4] = 0
        reported = self.reported(w) + self.reported(w) + self.reported(w)
        self.assertEqual(sorted(reported), [(1, True), (2, True)], "each job once")
        self.load(w, 3, [0, 1], [8, 9, 10, 11])
        self.assertEqual(self.reported(w), [(3, True)])
        self.assert_blocks([8, 9, 10, 11], stored)
        s = w.stats()
        self.assertEqual((s["jobs_reported"], s["jobs_in_flight"]), (3, 0))

    def test_a_reused_chunk_id_holds_the_new_blocks(self):
        _, w = self.worker(host_chunks=4)
        self.store(w, 1, [0, 1], [0])
        second = self.snapshot([4, 5])
        self.store(w, 2, [4, 5], [0])
        self.load(w, 3, [0], [7, 8])
        self.assertEqual(self.reported(w), [(1, True), (2, True), (3, True)])
        self.assert_blocks([7, 8], second)
        self.assertEqual(w.stats()["chunks_held"], 1)

    def test_full_host_tier_moves_chunks_to_disk_and_loads_read_them_back(self):
        _, w = self.worker(host_chunks=2, disk_chunks=6)
        stored = self.snapshot(list(range(12)))
        for c in range(6):
            self.store(w, c, [2 * c, 2 * c + 1], [c])
        self.assertEqual(len(self.reported(w)), 6)
        s = w.stats()
        self.assertGreater(s["disk_used_bytes"], 0)
        self.assertLessEqual(s["host_used_bytes"], s["host_capacity_bytes"])
        for t in self.kv:
            t.zero_()
        for c in range(6):
            self.load(w, 10 + c, [c], [2 * c, 2 * c + 1])
        self.assertEqual(len(self.reported(w)), 6)
        self.assert_blocks(list(range(12)), stored)
        self.assertGreater(w.stats()["disk_read_bytes"], 0)

    def test_hinted_chunks_are_prefetched_before_their_load(self):
        _, w = self.worker(host_chunks=4)
        stored = self.snapshot([0, 1, 2, 3])
        self.store(w, 1, [0, 1, 2, 3], [0, 1])
        w.hint([0, 1, 3])  # chunk 3 was never stored: ignored
        self.assertEqual(self.reported(w), [(1, True)])  # the step's tick hints the chunks
        w.flush()
        s = w.stats()
        self.assertEqual(s["hinted_chunks"], 2)
        self.assertGreater(s["prefetch_hits"], 0)
        self.assertGreater(s["blocks_resident"], 0)
        self.load(w, 2, [0, 1], [8, 9, 10, 11])
        self.assertEqual(self.reported(w), [(2, True)])
        self.assert_blocks([8, 9, 10, 11], stored)
        self.assertEqual(w.stats()["prefetch_misses"], 0)

    def test_hints_reach_a_worker_in_another_process_on_the_connector_metadata(self):
        import pickle

        import strata.vllm.offload as offload
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingConnectorMetadata,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
            OffloadingConnectorWorker,
        )
        from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext

        spec, w = self.worker(host_chunks=4)
        manager = spec.get_manager()  # the scheduler's side
        ctx = ReqContext("r1")
        manager.on_new_request(ctx)
        keys = [offload_key(1), offload_key(2)]
        chunks = [int(c) for c in manager.prepare_store(keys, ctx).store_spec.block_ids]
        self.store(w, 1, [0, 1, 2, 3], chunks)
        self.reported(w)
        manager.complete_store(keys, ctx)
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=["r1"]))
        meta = OffloadingConnectorMetadata(load_jobs={}, store_jobs={})
        setattr(meta, offload.HINTS, manager.take_hints())  # as build_connector_meta does
        self.assertEqual(manager.take_hints(), [], "hints go out once")
        meta = pickle.loads(pickle.dumps(meta))  # how a multiprocess executor sends it
        connector_worker = OffloadingConnectorWorker.__new__(OffloadingConnectorWorker)
        connector_worker.worker, connector_worker._load_jobs = w, {}
        connector_worker._unsubmitted_store_jobs = []
        connector_worker.start_kv_transfers(meta)  # vLLM's worker side, with the hint channel
        self.reported(w)  # the step's tick hints them
        w.flush()
        s = w.stats()
        self.assertEqual(s["hinted_chunks"], 2)
        self.assertGreater(s["prefetch_hits"], 0)

    def test_prefetched_chunks_never_loaded_go_back_to_the_host_tier(self):
        _, w = self.worker(host_chunks=4)
        stored = self.snapshot([0, 1])
        self.store(w, 1, [0, 1], [0])
        w.hint([0])
        self.reported(w)
        w.flush()
        self.assertGreater(w.stats()["blocks_resident"], 0)
        for _ in range(w.prefetch_steps + 1):
            w.get_finished()
        w.flush()
        s = w.stats()
        self.assertEqual(s["blocks_resident"], 0)
        self.assertEqual(s["prefetches_dropped"], 1)
        self.load(w, 2, [0], [5, 6])
        self.assertEqual(self.reported(w), [(2, True)])
        self.assert_blocks([5, 6], stored)

    def test_a_failed_job_raises_its_typed_error_from_get_finished(self):
        import strata

        _, w = self.worker(host_chunks=2)
        self.load(w, 1, [1], [0, 1])  # a chunk never stored
        w.flush()
        with self.assertRaises(strata.InvalidState) as cm:
            w.get_finished()
        self.assertIn("never stored", str(cm.exception))
        self.assertEqual(w.stats()["jobs_in_flight"], 0)

    def test_bad_settings_are_typed_errors(self):
        import strata
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        # one chunk of one layer must fill whole strata pages
        config = offloading_config(2, self.page // 4, 1, host_bytes=1 << 20)
        with self.assertRaises(strata.InvalidArgument) as cm:
            OffloadingSpecFactory.create_spec(config)
        self.assertIn("set blocks_per_chunk to a multiple of 4", str(cm.exception))
        with self.assertRaises(strata.InvalidArgument):
            OffloadingSpecFactory.create_spec(offloading_config(2, self.page, 1, host_bytes=0))
        with self.assertRaises(strata.InvalidArgument):  # a disk tier without a folder
            OffloadingSpecFactory.create_spec(
                offloading_config(2, self.page, 1, host_bytes=1 << 20, disk_bytes=1 << 20)
            )


def start_offload(model_dir, offload, disk_dir=None, elastic=False, args=()):
    """Starts run_offload.py (stock vLLM, or strata's offload with ``disk_dir``; ``elastic``:
    with the elastic KV plugin too, STRATA_VLLM=1)."""
    env = dict(os.environ)
    env.update(
        STRATA_HOST_GRANULARITY="32KiB",  # one block of one layer: chunks of one block
        STRATA_BACKEND="host",
        STRATA_HOST_STRICT="0",
        STRATA_VLLM="1" if elastic else "0",
        STRATA_VLLM_SPARE_GROUPS=str(SPARE_GROUPS),
        # unmapped at once (no trim delay): stores of freed blocks race their group's unmapping
        STRATA_VLLM_TRIM_DELAY="0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        PYTHONPATH=os.path.join(REPO, "python"),
    )
    cmd = [
        sys.executable,
        os.path.join(HERE, "run_offload.py"),
        model_dir,
        "--blocks",
        str(BLOCKS),
        "--max-tokens",
        str(MAX_TOKENS),
    ]
    if offload:
        cmd += ["--offload", "--blocks-per-chunk", "1", "--host-bytes", str(HOST_BYTES)]
        cmd += ["--disk-bytes", str(DISK_BYTES), "--disk-dir", disk_dir]
    cmd += list(args)
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    proc.offload = offload
    return proc


def result_of(proc):
    """run_offload.py's RESULT line, once it exits."""
    try:
        out, err = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"run_offload (offload={proc.offload}) failed, rc {proc.returncode}:\n"
            f"{out[-3000:]}\n{err[-6000:]}"
        )
    return json.loads(lines[-1][len("RESULT "):])


def run_offload(model_dir, offload, disk_dir=None):
    return result_of(start_offload(model_dir, offload, disk_dir))


@unittest.skipUnless(HAVE_VLLM, "vLLM is not installed (.ci/vllm-env installs it)")
class Engine(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.addClassCleanup(cls.tmp.cleanup)
        model = os.path.join(cls.tmp.name, "llama")
        disks = [os.path.join(cls.tmp.name, f"disk{i}") for i in range(2)]
        for d in disks:
            os.makedirs(d)
        write_model(model)  # before the runs start: they would race to write it
        # Side by side: the engines' start-up mostly waits, so several at once take little
        # longer. The third: the offload with the elastic plugin, each store held in flight.
        runs = [
            start_offload(model, False),
            start_offload(model, True, disks[0]),
            start_offload(
                model, True, disks[1], elastic=True, args=["--hold-stores", str(HOLD_STORES)]
            ),
        ]
        try:
            cls.stock, cls.strata, cls.elastic = [result_of(p) for p in runs]
        finally:
            for p in runs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        for name, r in (
            ("stock recompute", cls.stock),
            ("strata offload", cls.strata),
            ("strata offload + elastic KV", cls.elastic),
        ):
            print(
                f"\n{name}: {r['recomputed_tokens']} recomputed tokens "
                f"({r['computed_tokens']} computed, {r['needed_tokens']} needed; "
                f"{r['partial_block_tokens']} in partial blocks at preemption), "
                f"{r['preemptions']} preemptions, {r['tokens_per_s']:.1f} tok/s",
                file=sys.stderr,
            )
        print(f"strata offload figures: {json.dumps(cls.strata['strata'])}", file=sys.stderr)

    def test_the_budget_forces_preemption(self):
        self.assertGreater(self.stock["preemptions"], 0)
        self.assertGreater(self.strata["preemptions"], 0)
        self.assertGreater(self.stock["recomputed_tokens"], 0, "stock vLLM recomputed nothing")

    def test_outputs_are_identical_to_stock_vllm(self):
        stock = self.stock["outputs"]
        self.assertEqual(len(stock), 8)
        self.assertTrue(all(len(o) == MAX_TOKENS for o in stock))
        self.assertEqual(len({tuple(o[:8]) for o in stock}), 8, "requests gave equal outputs")
        self.assertEqual(self.strata["outputs"], stock)

    def test_offload_recomputes_fewer_tokens_than_stock_recompute(self):
        self.assertGreaterEqual(self.strata["recomputed_tokens"], 0)
        self.assertLess(self.strata["recomputed_tokens"], self.stock["recomputed_tokens"])

    def test_offload_recomputes_only_the_partial_blocks_vllm_cannot_offload(self):
        # vLLM offloads whole blocks (keyed by their hashes); the last, partial block of a
        # preempted request is recomputed, and with strata's tiers nothing else is.
        self.assertEqual(self.strata["recomputed_tokens"], self.strata["partial_block_tokens"])
        self.assertGreater(self.stock["recomputed_tokens"], self.stock["partial_block_tokens"])

    def test_with_the_elastic_plugin_outputs_are_identical_and_fewer_tokens_recomputed(self):
        r = self.elastic
        self.assertEqual(r["outputs"], self.stock["outputs"])
        self.assertGreater(r["preemptions"], 0)
        self.assertEqual(r["recomputed_tokens"], r["partial_block_tokens"])
        self.assertLess(r["recomputed_tokens"], self.stock["recomputed_tokens"])
        self.assertGreater(r["strata"]["loaded_chunks"], 0)

    def test_with_the_elastic_plugin_no_store_reads_a_block_strata_unmapped(self):
        # Stores held in flight while vLLM frees their blocks (preemption, finished requests):
        # the plugin keeps those groups mapped until the stores ran.
        r = self.elastic
        self.assertGreater(r["held_stores"], 0)
        self.assertGreater(r["elastic"]["unmaps_deferred"], 0)
        self.assertEqual(r["stores_of_unmapped_blocks"], 0)

    def test_with_the_elastic_plugin_mapped_bytes_follow_the_blocks(self):
        e = self.elastic["elastic"]
        group, per = e["group_bytes"], e["blocks_per_group"]
        steps = e["steps"]
        for in_use, mapped in steps:  # every block in use is mapped
            self.assertGreaterEqual(mapped, math.ceil(in_use / per) * group)
        peak = max(m for _, m in steps)
        self.assertGreater(peak, steps[0][1], "mapped bytes never rose")
        self.assertEqual(steps[-1][0], 0)
        self.assertLess(steps[-1][1], peak, "mapped bytes did not fall")
        self.assertGreater(e["unmaps"], 0)

    def test_blocks_went_through_strata_tiers_and_came_back(self):
        s = self.strata["strata"]
        self.assertGreater(s["stored_chunks"], 0)
        self.assertGreater(s["loaded_chunks"], 0)
        self.assertGreater(s["disk_write_bytes"], 0, "the disk tier was never used")
        self.assertLessEqual(s["host_used_bytes"], HOST_BYTES)
        self.assertGreater(s["hinted_chunks"], 0, "preemptions were not hinted")
        self.assertGreater(s["prefetch_hits"], 0)


if __name__ == "__main__":
    unittest.main()
