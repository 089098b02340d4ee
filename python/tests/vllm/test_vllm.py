"""strata.vllm against a real vLLM (the CPU build): run by .ci/run with .ci/vllm-env's Python.

Skips without vLLM unless STRATA_REQUIRE_VLLM=1 (as .ci/run sets), where a missing vLLM fails.
The engine runs in subprocesses (run_engine.py): the patches are process-wide, so the stock run
and the strata run each get a fresh interpreter.
"""

import json
import math
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
SPARE_GROUPS = 2
REQUESTS = 8
MAX_TOKENS = 12
SMALL_DEVICE = 1536 << 10

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False
    if os.environ.get("STRATA_REQUIRE_VLLM") == "1":
        raise


def run_engine(plugin, model_dir, **extra_env):
    env = dict(os.environ)
    env.update(
        STRATA_VLLM="1" if plugin else "0",
        STRATA_VLLM_SPARE_GROUPS=str(SPARE_GROUPS),
        STRATA_HOST_GRANULARITY="64KiB",
        STRATA_BACKEND="host",
        STRATA_HOST_STRICT="0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        PYTHONPATH=os.path.join(REPO, "python"),
    )
    env.update(extra_env)
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "run_engine.py"), model_dir,
         "--requests", str(REQUESTS), "--max-tokens", str(MAX_TOKENS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"run_engine (plugin={plugin}) failed, rc {proc.returncode}:\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return json.loads(lines[-1][len("RESULT "):]), proc.stdout + proc.stderr


@unittest.skipUnless(HAVE_VLLM, "vLLM is not installed (.ci/vllm-env installs it)")
class VersionGate(unittest.TestCase):
    def test_other_versions_are_refused_before_anything_is_patched(self):
        import strata.vllm
        from vllm.v1.core.block_pool import BlockPool

        for version in ("0.31.9", "0.33.0", "1.0.0"):
            with self.assertRaises(strata.vllm.UnsupportedVllm) as cm:
                strata.vllm.enable(version=version)
            self.assertIn("supports vLLM >=0.32.0,<0.33.0", str(cm.exception))
            self.assertIn(version, str(cm.exception))
        self.assertFalse(getattr(BlockPool, "_strata", False))

    def test_the_plugin_hook_refuses_too(self):
        import strata.vllm

        saved = (vllm.__version__, os.environ.get("STRATA_VLLM"))
        vllm.__version__, os.environ["STRATA_VLLM"] = "0.34.1", "1"
        try:
            with self.assertRaises(strata.vllm.UnsupportedVllm):
                strata.vllm.register()
        finally:
            vllm.__version__ = saved[0]
            if saved[1] is None:
                del os.environ["STRATA_VLLM"]
            else:
                os.environ["STRATA_VLLM"] = saved[1]

    def test_the_entry_point_is_registered(self):
        from importlib.metadata import entry_points

        names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
        self.assertEqual(names.get("strata"), "strata.vllm:register")


@unittest.skipUnless(HAVE_VLLM, "vLLM is not installed (.ci/vllm-env installs it)")
class Elastic(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        model = os.path.join(cls.tmp.name, "llama")
        cls.stock, _ = run_engine(False, model)
        cls.strata, cls.strata_log = run_engine(True, model)
        # 64 MiB of virtual KV over a 1.5 MiB device: vLLM must queue and preempt by the pages
        cls.small, _ = run_engine(True, model, STRATA_HOST_DEVICES="1536KiB")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_greedy_outputs_are_identical(self):
        stock, ours = self.stock["outputs"], self.strata["outputs"]
        self.assertEqual(len(stock), REQUESTS)
        self.assertTrue(all(len(o) == MAX_TOKENS for o in stock))
        self.assertGreater(len({tuple(o) for o in stock}), 1, "all requests gave one output")
        self.assertEqual(ours, stock)
        # the second wave (same prompts, prefix cache partly evicted by unmapping) agrees too
        self.assertEqual(self.stock["outputs_again"], stock)
        self.assertEqual(self.strata["outputs_again"], stock)

    def test_mapped_bytes_follow_the_blocks_in_use(self):
        r = self.strata
        group, per = r["group_bytes"], r["blocks_per_group"]
        steps = r["steps"]
        for s in steps:
            # every block in use is mapped; at most its own group each, plus spares and group 0
            self.assertGreaterEqual(s["mapped"], math.ceil(s["blocks"] / per) * group, s)
            self.assertLessEqual(s["mapped"], (s["blocks"] + SPARE_GROUPS + 1) * group, s)
        peak = max(s["mapped"] for s in steps)
        self.assertGreater(peak, steps[0]["mapped"], "mapped bytes never rose")
        self.assertEqual(steps[-1]["blocks"], 0)
        self.assertLess(steps[-1]["mapped"], peak, "mapped bytes did not fall")
        self.assertLessEqual(steps[-1]["mapped"], (SPARE_GROUPS + 1) * group)
        stats = r["stats"]
        # the pool's own count: the pages strata really holds are the groups mapped
        self.assertEqual(stats["pool_in_use_bytes"], stats["mapped_bytes"])
        self.assertLess(peak, stats["virtual_bytes"], "vLLM's capacity is not larger than mapped")
        self.assertGreater(stats["unmaps"], 0)

    def test_sleep_unmaps_the_kv_cache_and_wake_runs_again(self):
        r = self.strata
        self.assertEqual(r["mapped_asleep"], r["group_bytes"])  # only the null block's group
        self.assertEqual(r["outputs_after_sleep"], self.stock["outputs"])
        self.assertEqual(self.stock["outputs_after_sleep"], self.stock["outputs"])

    def test_a_small_device_queues_instead_of_failing(self):
        r = self.small
        self.assertEqual(r["outputs"], self.stock["outputs"])
        self.assertEqual(r["outputs_again"], self.stock["outputs"])
        peak = max(s["mapped"] for s in r["steps"])
        self.assertLessEqual(peak, SMALL_DEVICE)
        # the unconstrained run needed more than the small device holds at its peak
        self.assertGreater(max(s["mapped"] for s in self.strata["steps"]), SMALL_DEVICE)
        self.assertLess(peak, r["stats"]["virtual_bytes"])

    def test_stats_are_logged(self):
        self.assertIn("strata.vllm: 2 layers, 1024 blocks", self.strata_log)
        self.assertRegex(self.strata_log, r"strata KV: \d+/512 groups mapped")


if __name__ == "__main__":
    unittest.main()
