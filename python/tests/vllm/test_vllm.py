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
GRACE_DELAY = 3.0  # STRATA_VLLM_TRIM_DELAY of the runs that keep free groups mapped a while
REQUESTS = 8
MAX_TOKENS = 12
SMALL_DEVICE = 1536 << 10
TWO_ENGINES_KV = 8 << 20
TWO_ENGINES_DEVICE = 12 << 20
PRESSURE_DEVICE = 3 << 20

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False
    if os.environ.get("STRATA_REQUIRE_VLLM") == "1":
        raise


def run_engine(plugin, model_dir, *args, **extra_env):
    return run_script("run_engine.py", plugin, model_dir, *args, **extra_env)


def run_script(script, plugin, model_dir, *args, **extra_env):
    env = dict(os.environ)
    env.update(
        STRATA_VLLM="1" if plugin else "0",
        STRATA_VLLM_SPARE_GROUPS=str(SPARE_GROUPS),
        # free groups beyond the spares unmapped at once, unless a test says otherwise
        STRATA_VLLM_TRIM_DELAY="0",
        STRATA_HOST_GRANULARITY="64KiB",
        STRATA_BACKEND="host",
        STRATA_HOST_STRICT="0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        PYTHONPATH=os.path.join(REPO, "python"),
    )
    env.update({k: v for k, v in extra_env.items() if v is not None})
    for k in [k for k, v in extra_env.items() if v is None]:
        env.pop(k, None)  # None: the library's default
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, script), model_dir,
         "--requests", str(REQUESTS), "--max-tokens", str(MAX_TOKENS), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"{script} (plugin={plugin}) failed, rc {proc.returncode}:\n"
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

    def test_a_vllm_that_renamed_a_private_attribute_the_patches_read_is_refused_up_front(self):
        import importlib
        import inspect

        import strata.vllm
        from vllm.v1.core.block_pool import BlockPool

        offloading = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
        cases = [
            ("vllm.v1.kv_cache_layout", None, "_DIM_N"),  # a module constant
            ("vllm.v1.core.block_pool", "BlockPool", "_reuse_watchers"),  # set in __init__
            (offloading, "OffloadingConnectorScheduler", "_jobs"),
            (offloading, "OffloadingConnectorScheduler", "_req_status"),
        ]
        for module, cls, attr in cases:
            with self.subTest(attr=attr):
                mod = importlib.import_module(module)
                owner = mod if cls is None else getattr(mod, cls)
                name = attr if cls is None else "__init__"
                saved = getattr(owner, name)
                if cls is None:
                    delattr(owner, attr)
                else:
                    # the same signature, an __init__ that sets the attribute under a new name
                    def init(self, *args, **kwargs):
                        self.renamed = {}

                    init.__signature__ = inspect.signature(saved)
                    owner.__init__ = init
                try:
                    with self.assertRaises(strata.vllm.UnsupportedVllm) as cm:
                        strata.vllm.enable(version="0.32.0")
                    self.assertIn(attr, str(cm.exception))
                finally:
                    setattr(owner, name, saved)
                self.assertFalse(getattr(BlockPool, "_strata", False), "nothing was patched")

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
        # two engines of 8 MiB of KV each on a 12 MiB device
        cls.two, _ = run_script(
            "run_two_engines.py", True, model, "--kv-bytes", str(TWO_ENGINES_KV),
            STRATA_HOST_DEVICES="12MiB",
        )
        # the same on a device smaller than one engine's run and another's idle groups
        # together, each keeping its free groups mapped for a minute unless the other needs
        # the pages
        cls.pressure, _ = run_script(
            "run_two_engines.py", True, model, "--kv-bytes", str(TWO_ENGINES_KV),
            STRATA_HOST_DEVICES=str(PRESSURE_DEVICE), STRATA_VLLM_TRIM_DELAY="60",
        )
        # a second wave right after the first, then idle until the trimmer unmaps
        cls.grace, _ = run_engine(
            True, model, "--grace", STRATA_VLLM_TRIM_DELAY=str(GRACE_DELAY)
        )
        # a KV limit set from another process through the control folder
        cls.control_dir = os.path.join(cls.tmp.name, "control")
        cls.limited, _ = run_engine(
            True, model, "--limit", STRATA_VLLM_TRIM_DELAY="60",
            STRATA_VLLM_CONTROL_DIR=cls.control_dir,
        )

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

    def test_a_second_engine_runs_while_the_first_is_idle(self):
        r = self.two
        device, group = r["device_bytes"], r["group_bytes"]
        self.assertEqual(device, TWO_ENGINES_DEVICE)
        self.assertEqual(r["virtual_bytes"], [TWO_ENGINES_KV] * 2)
        # stock vLLM's accounting (each engine holds its whole KV): one fits, two do not ...
        self.assertLessEqual(TWO_ENGINES_KV, device)
        self.assertGreater(2 * TWO_ENGINES_KV, device)
        # ... and so it went on the device: A's whole KV mapped, B's could not be
        self.assertEqual(r["stock_failed_groups_a"], 0)
        self.assertGreater(r["stock_failed_groups_b"], 0)
        self.assertLessEqual(r["stock_pool_bytes"], device)
        # strata: A idle holds the null block's group and its spares; B ran; A ran again
        self.assertLessEqual(r["idle_a"], (SPARE_GROUPS + 1) * group)
        self.assertEqual(r["outputs_a"], self.stock["outputs"])
        self.assertEqual(r["outputs_b"], self.stock["outputs"])
        self.assertEqual(r["outputs_a_again"], self.stock["outputs"])
        self.assertLessEqual(r["peak_mapped_sum"], device)
        # A's sleep returned A's KV (all but the null block's group), not B's spares
        self.assertGreater(r["idle_b"], group)
        self.assertEqual(r["a_asleep"], [group, r["idle_b"]])
        self.assertEqual(r["mapped_after"], [group, group])

    def test_free_groups_stay_mapped_for_the_trim_delay_then_the_trimmer_unmaps_them(self):
        r, group = self.grace, self.grace["group_bytes"]
        self.assertEqual(r["trim_delay_s"], GRACE_DELAY)
        self.assertEqual(r["outputs"], self.stock["outputs"])
        a, g, idle = r["after_a"], r["after_g"], r["idle"]
        # the second wave (same shape, other tokens) ran on the first one's groups: it mapped
        # none, and nothing was unmapped in between
        self.assertGreater(a["groups_mapped"], SPARE_GROUPS + 1)
        self.assertEqual(g["maps"], a["maps"])
        self.assertEqual(g["unmaps"], 0)
        self.assertEqual(g["groups_mapped"], a["groups_mapped"])
        # idle: the trimmer thread unmapped every group beyond the spares (and the null
        # block's), no earlier than the delay after the last step freed them
        self.assertEqual(idle["groups_mapped"], SPARE_GROUPS + 1)
        self.assertEqual(idle["unmaps"], g["groups_mapped"] - SPARE_GROUPS - 1)
        self.assertEqual(idle["mapped_bytes"], (SPARE_GROUPS + 1) * group)
        self.assertEqual(idle["pool_in_use_bytes"], idle["mapped_bytes"])
        self.assertGreaterEqual(r["fell_after_s"], 0.8 * GRACE_DELAY)
        self.assertLess(r["fell_after_s"], GRACE_DELAY + 10)

    def test_an_engine_short_of_pages_takes_back_what_an_idle_one_keeps_for_its_delay(self):
        r = self.pressure
        group, device = r["group_bytes"], r["device_bytes"]
        self.assertEqual(device, PRESSURE_DEVICE)
        # A idle keeps its free groups mapped (a minute's delay), so little room is left ...
        self.assertGreater(r["idle_a"], (SPARE_GROUPS + 1) * group)
        self.assertGreater(r["idle_a"] + r["idle_b"], device)  # B's run needed A's pages
        # ... and B, short of pages, took A's back (down to the null block's group and A's
        # spares) while it ran; then A took B's back to run again
        self.assertGreater(r["a_unmaps_during_b"], 0)
        self.assertLessEqual(r["a_after_b"], (SPARE_GROUPS + 1) * group)
        self.assertEqual(r["outputs_a"], self.stock["outputs"])
        self.assertEqual(r["outputs_b"], self.stock["outputs"])
        self.assertEqual(r["outputs_a_again"], self.stock["outputs"])
        self.assertLessEqual(r["peak_mapped_sum"], device)

    def test_a_limit_set_from_outside_caps_the_mapped_kv(self):
        r, group = self.limited, self.limited["group_bytes"]
        self.assertEqual(r["outputs"], self.stock["outputs"])
        # idle, the engine kept its free groups mapped (a minute's delay) ...
        self.assertEqual(r["held"], r["peak"])
        self.assertGreater(r["peak"], 4 * group)
        # ... until another process halved its limit: applied without an engine step
        self.assertEqual(r["set_rc"], 0)
        self.assertLess(r["applied_after_s"], 5)
        self.assertLessEqual(r["idle_limited"], r["limit"])
        entry = r["listed"][r["name"]]
        self.assertEqual(entry["limit_bytes"], r["limit"])
        self.assertLessEqual(entry["mapped_bytes"], r["limit"])
        self.assertEqual(entry["virtual_bytes"], 512 * group)
        # the same prompts under the limit: the same outputs, never more mapped than allowed
        self.assertEqual(r["outputs_limited"], self.stock["outputs"])
        self.assertTrue(r["limited_steps"])
        self.assertLessEqual(max(r["limited_steps"]), r["limit"])
        # bad requests are refused with a message; the limit lifted
        self.assertEqual(r["unknown"][0], 2)
        self.assertIn("no live engine '1-99'", r["unknown"][1])
        self.assertEqual(r["bad_size"][0], 2)
        self.assertIn("expected bytes", r["bad_size"][1])
        self.assertEqual(r["lift_rc"], 0)
        self.assertTrue(r["lifted"])
        # the engine's process ended without shutting down (os._exit): its files name a dead
        # process, so list leaves it out and removes them
        from strata.vllm import control

        self.assertTrue(os.listdir(self.control_dir))
        self.assertEqual(control.engines(self.control_dir), {})
        self.assertEqual(os.listdir(self.control_dir), [])

    def test_engines_built_out_of_order_attach_to_their_own_kv(self):
        # B was built inside A's construction: B's KV space is the newer one when A's block
        # pool is made; each pool still runs on the space behind its own model runner.
        r = self.two
        self.assertEqual(r["built_order"], ["0", "1"])
        self.assertEqual(r["own_space"], [True, True, True])

    def test_a_shut_down_engine_releases_its_kv_and_leaves_the_metrics(self):
        s, group = self.two["shutdown"], self.two["group_bytes"]
        self.assertEqual(s["labels_before"], ["0", "1"])
        self.assertEqual(s["labels_after"], ["1"])
        self.assertEqual(s["spaces_after"], ["1"])
        self.assertTrue(s["a_closed"])
        # A's last group (the null block's) went back to the pool; B's stayed mapped
        self.assertEqual(s["pool_before"] - s["pool_after"], group)
        self.assertEqual(s["pool_after"], s["b_mapped"])
        self.assertTrue(s["a_destroyed"], "A's KV space outlived its engine")

    def test_unmapping_copies_nothing(self):
        stats = self.strata["stats"]
        self.assertGreater(stats["unmaps"], 0)
        self.assertEqual(stats["bytes_from_device"], 0)
        self.assertEqual(stats["host_used_bytes"], 0)

    def test_stats_are_vllm_metrics(self):
        m, s = self.strata["metrics"], self.strata["stats_with_metrics"]
        self.assertEqual(m["vllm:strata_kv_mapped_bytes"], s["mapped_bytes"])
        self.assertEqual(m["vllm:strata_kv_virtual_bytes"], s["virtual_bytes"])
        self.assertEqual(m["vllm:strata_kv_groups_mapped"], s["groups_mapped"])
        self.assertEqual(m["vllm:strata_kv_pool_in_use_bytes"], s["pool_in_use_bytes"])
        self.assertEqual(m["vllm:strata_kv_maps"], s["maps"])
        self.assertGreater(m["vllm:strata_kv_maps"], 0)
        self.assertEqual(m["vllm:strata_kv_unmaps"], s["unmaps"])
        for name in ("host_tier_bytes", "disk_tier_bytes", "bytes_to_device",
                     "bytes_from_device", "prefetch_hits", "groups_spare"):
            self.assertIn(f"vllm:strata_kv_{name}", m)
        self.assertEqual(self.stock["metrics"], {})

    def test_stats_are_logged(self):
        self.assertIn("strata.vllm: 2 layers, 1024 blocks", self.strata_log)
        self.assertRegex(self.strata_log, r"strata KV: \d+/512 groups mapped")


@unittest.skipUnless(HAVE_VLLM, "vLLM is not installed (.ci/vllm-env installs it)")
class MixtureOfExperts(unittest.TestCase):
    def test_greedy_outputs_are_identical(self):
        with tempfile.TemporaryDirectory() as tmp:
            model = os.path.join(tmp, "mixtral")
            stock, _ = run_engine(False, model, "--kind", "mixtral", "--bench")
            ours, _ = run_engine(True, model, "--kind", "mixtral", "--bench")
        self.assertEqual(len(stock["outputs"]), REQUESTS)
        self.assertGreater(len({tuple(o) for o in stock["outputs"]}), 1)
        self.assertEqual(ours["outputs"], stock["outputs"])
        self.assertGreater(ours["stats"]["maps"], 1)


if __name__ == "__main__":
    unittest.main()
