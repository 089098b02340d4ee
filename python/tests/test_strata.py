"""Tests of the strata Python package through its ctypes layer (no torch needed).

Run from the repository root with the library built:
    STRATA_BACKEND=host STRATA_HOST_STRICT=1 STRATA_LIB=target/debug/libstrata.so \
        PYTHONPATH=python python3 -m unittest discover -s python/tests -v
(cargo test runs this through ffi/tests/python.rs.)
"""

import ctypes
import importlib.util
import os
import sys
import threading
import unittest

import strata
from strata import _lib


def pattern(seed, n):
    return bytes((seed * 131 + i * 7) % 251 for i in range(n))


class ImportTest(unittest.TestCase):
    def test_import_needs_no_torch_and_finds_the_library(self):
        self.assertEqual(strata.version(), "0.1.0")
        self.assertTrue(_lib.loaded_path().endswith("libstrata.so"))
        if importlib.util.find_spec("torch") is None:
            self.assertNotIn("torch", sys.modules)
        import strata.torch as st  # importing the module itself must not import torch

        self.assertTrue(callable(st.pool))

    def test_missing_library_is_a_clear_error(self):
        saved = os.environ.get("STRATA_LIB")
        os.environ["STRATA_LIB"] = "/nonexistent/libstrata.so"
        try:
            with self.assertRaises(OSError) as ctx:
                _lib.library_path()
            self.assertIn("STRATA_LIB", str(ctx.exception))
        finally:
            if saved is None:
                del os.environ["STRATA_LIB"]
            else:
                os.environ["STRATA_LIB"] = saved


class StatsTest(unittest.TestCase):
    def test_stats_per_device_follow_allocations(self):
        n = strata.device_count()
        self.assertGreaterEqual(n, 1)
        all_stats = strata.stats()
        self.assertEqual(sorted(all_stats), list(range(n)))
        before = strata.stats(0)
        ptrs = [_lib.malloc(size) for size in (100, 5000, 3 << 20)]
        for p in ptrs:
            self.assertEqual(p % 256, 0)
        during = strata.stats(0)
        self.assertEqual(during["allocated_bytes"], before["allocated_bytes"] + 100 + 5000 + (3 << 20))
        self.assertEqual(during["live_allocations"], before["live_allocations"] + 3)
        self.assertEqual(during["initialized"], 1)
        self.assertGreaterEqual(during["reserved_bytes"], during["allocated_block_bytes"])
        for p in ptrs:
            _lib.free(p)
        self.assertEqual(strata.stats(0)["allocated_bytes"], before["allocated_bytes"])
        with self.assertRaises(strata.StrataError) as ctx:
            strata.stats(n + 5)
        self.assertEqual(ctx.exception.status_name, "STRATA_NO_DEVICE")

    def test_errors_carry_status_and_message(self):
        p = _lib.malloc(4096)
        _lib.free(p)
        with self.assertRaises(strata.StrataError) as ctx:
            _lib.free(p)
        self.assertEqual(ctx.exception.status, 5)
        self.assertIn("double free", ctx.exception.message)
        with self.assertRaises(strata.StrataError) as ctx:
            _lib.malloc(1 << 62)
        self.assertIn(ctx.exception.status_name, ("STRATA_OUT_OF_MEMORY", "STRATA_INVALID_ARGUMENT"))
        self.assertEqual(_lib.malloc(0), 0)
        with self.assertRaises(TypeError):
            strata.sleep([b"bytes-tag"])

    def test_python_code_raises_typed_errors_with_a_message_alone(self):
        for cls, status in (
            (strata.OutOfMemory, strata.Status.OUT_OF_MEMORY),
            (strata.InvalidArgument, strata.Status.INVALID_ARGUMENT),
            (strata.InvalidState, strata.Status.INVALID_STATE),
            (strata.Unsupported, strata.Status.UNSUPPORTED),
        ):
            e = cls("what went wrong")
            self.assertEqual(e.status, status)
            self.assertEqual(e.message, "what went wrong")
            self.assertEqual(str(e), "what went wrong")
        with self.assertRaises(TypeError):
            strata.StrataError("a message without a status")


class BackendSelectionTest(unittest.TestCase):
    """A backend that cannot open keeps its status: a malformed STRATA_* variable is
    STRATA_CONFIG (not STRATA_UNSUPPORTED). Each case runs in a fresh process, since the
    library opens its backend once."""

    SCRIPT = (
        "import strata\n"
        "try:\n"
        "    strata.device_count()\n"
        "    print('opened')\n"
        "except strata.StrataError as e:\n"
        "    print(e.status_name, int(e.status) == strata.Status[e.status_name[7:]])\n"
    )

    def status_with(self, **env):
        import subprocess

        child = dict(os.environ)
        child.update({"STRATA_BACKEND": "host", **env})
        out = subprocess.run(
            [sys.executable, "-c", self.SCRIPT], env=child, capture_output=True, text=True
        )
        self.assertEqual(out.returncode, 0, out.stderr)
        return out.stdout.strip()

    def test_malformed_variables_are_config_errors(self):
        self.assertEqual(self.status_with(STRATA_BACKEND="gpu"), "STRATA_CONFIG True")
        self.assertEqual(self.status_with(STRATA_HOST_DEVICES="banana"), "STRATA_CONFIG True")
        self.assertEqual(self.status_with(STRATA_HOST_STRICT="maybe"), "STRATA_CONFIG True")

    def test_status_names_a_message_ends_with(self):
        self.assertEqual(strata.Status.from_message("x: bad (STRATA_CONFIG)"), strata.Status.CONFIG)
        self.assertEqual(strata.Status.from_message("no status here"), strata.Status.INTERNAL)
        self.assertEqual(strata.Status.of(99), strata.Status.INTERNAL)


class TagSleepWakeTest(unittest.TestCase):
    def test_tags_and_sleep_wake_keep_contents(self):
        with strata.tag("py-weights"):
            w = [_lib.malloc(s) for s in (3000, 2 << 20)]
        with strata.tag("py-kv"):
            k = _lib.malloc(70000)
        for i, p in enumerate(w):
            _lib.memcpy_htod(p, pattern(i, 3000))
        _lib.memcpy_htod(k, pattern(9, 4096))
        ts = strata.tag_stats("py-weights")
        self.assertEqual(ts["live_allocations"], 2)
        self.assertEqual(ts["allocated_bytes"], 3000 + (2 << 20))
        reserved = strata.stats(0)["reserved_bytes"]

        strata.sleep(["py-weights", "py-kv"], keep_host_copy=True)
        self.assertEqual(strata.tag_stats("py-weights")["asleep"], 1)
        self.assertLess(strata.stats(0)["reserved_bytes"], reserved)
        with strata.tag("py-weights"):
            with self.assertRaises(strata.StrataError) as ctx:
                _lib.malloc(64)
            self.assertEqual(ctx.exception.status_name, "STRATA_INVALID_STATE")
        strata.wake(["py-weights", "py-kv"])
        for i, p in enumerate(w):
            self.assertEqual(_lib.memcpy_dtoh(p, 3000), pattern(i, 3000))
        self.assertEqual(_lib.memcpy_dtoh(k, 4096), pattern(9, 4096))

        # Without host copies: zeros after wake.
        strata.sleep("py-kv", keep_host_copy=False)
        strata.wake("py-kv")
        self.assertEqual(_lib.memcpy_dtoh(k, 4096), bytes(4096))
        for p in w + [k]:
            _lib.free(p)

    def test_offload_to_host_and_back_keeps_addresses_and_contents(self):
        with strata.tag("py-offload"):
            ps = [_lib.malloc(s) for s in (5000, 3 << 20)]
        for i, p in enumerate(ps):
            _lib.memcpy_htod(p, pattern(20 + i, 4096))
        before = strata.spill_stats("py-offload")
        self.assertEqual(before["host_bytes"], 0)
        strata.offload("py-offload", tier="host")
        off = strata.spill_stats("py-offload")
        self.assertEqual(off["local_bytes"], 0)
        self.assertEqual(off["host_bytes"], before["local_bytes"])
        self.assertGreater(off["migrations_to_host"], 0)
        # Usable at the same addresses while offloaded.
        self.assertEqual(_lib.memcpy_dtoh(ps[0], 4096), pattern(20, 4096))
        _lib.memcpy_htod(ps[1], pattern(33, 4096))
        strata.onload("py-offload")
        on = strata.spill_stats("py-offload")
        self.assertEqual((on["host_bytes"], on["local_bytes"]), (0, before["local_bytes"]))
        self.assertEqual(_lib.memcpy_dtoh(ps[0], 4096), pattern(20, 4096))
        self.assertEqual(_lib.memcpy_dtoh(ps[1], 4096), pattern(33, 4096))
        strata.offload("py-offload", tier="disk")
        self.assertEqual(strata.tag_stats("py-offload")["asleep"], 1)
        strata.onload("py-offload")
        self.assertEqual(_lib.memcpy_dtoh(ps[1], 4096), pattern(33, 4096))
        with self.assertRaises(strata.InvalidArgument):
            strata.offload("py-offload", tier="tape")
        with self.assertRaises(strata.InvalidArgument):
            strata.set_overflow("py-offload", tier="disk")
        strata.set_overflow("py-offload")
        strata.set_overflow("py-offload", tier=None)
        self.assertGreater(strata.spill_stats()["local_bytes"], 0)
        for p in ps:
            _lib.free(p)

    def test_sleep_is_all_or_nothing(self):
        with strata.tag("py-atomic"):
            p = _lib.malloc(1000)
        with self.assertRaises(strata.StrataError):
            strata.sleep(["py-atomic", "py-never-pushed"])
        self.assertEqual(strata.tag_stats("py-atomic")["asleep"], 0)
        with self.assertRaises(strata.StrataError) as ctx:
            strata.wake("py-atomic")
        self.assertEqual(ctx.exception.status_name, "STRATA_INVALID_STATE")
        _lib.free(p)

    def test_device_numbers_beyond_a_c_int_are_refused(self):
        # ctypes wraps them: device 2**32 was device 0, and its figures came back as another's.
        for call in (
            lambda: strata.stats(2**32),
            lambda: strata.tag_stats("py-any", 2**32 + 1),
            lambda: strata.spill_stats(device=-(2**31) - 1),
            lambda: strata.set_memory_fraction(0.5, 2**32),
            lambda: strata.revoke_peer(2**32 + 1),
            lambda: strata.set_overflow_peer("py-any", 2**31),
            lambda: strata.Stream(2**32),
        ):
            with self.assertRaisesRegex(strata.InvalidArgument, "device|lender"):
                call()
        self.assertEqual(strata.stats(0)["limit_set"], strata.stats()[0]["limit_set"])

    def test_tag_names_with_nul_are_refused(self):
        # Issue 15, item 11: "weights\0x" used to put "weights" to sleep.
        with strata.tag("py-nul"):
            p = _lib.malloc(1000)
        for call in (
            lambda: strata.sleep("py-nul\0x"),
            lambda: strata.wake("py-nul\0x"),
            lambda: strata.tag("py-nul\0x").__enter__(),
            lambda: strata.tag_stats("py-nul\0x"),
        ):
            with self.assertRaises(ValueError):
                call()
        self.assertEqual(strata.tag_stats("py-nul")["asleep"], 0)
        self.assertEqual(_lib.lib().strata_tag_depth(), 0)
        _lib.free(p)

    @unittest.skipUnless(sys.platform.startswith("linux"), "RLIMIT_AS as on Linux")
    def test_sleep_without_host_memory_raises_and_keeps_the_tag_awake(self):
        # Issue 15, item 1: the host copy's allocation failing aborted the process.
        import resource

        size = 256 << 20
        with strata.tag("py-oom"):
            p = _lib.malloc(size)
        _lib.memcpy_htod(p, pattern(5, 4096))
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        old = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (mapped + (64 << 20), old[1]))
        try:
            with self.assertRaises(strata.StrataError) as ctx:
                strata.sleep("py-oom", keep_host_copy=True)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, old)
        self.assertEqual(ctx.exception.status_name, "STRATA_OUT_OF_MEMORY")
        self.assertEqual(strata.tag_stats("py-oom")["asleep"], 0)
        self.assertEqual(_lib.memcpy_dtoh(p, 4096), pattern(5, 4096))
        strata.sleep("py-oom", keep_host_copy=True)
        strata.wake("py-oom")
        self.assertEqual(_lib.memcpy_dtoh(p, 4096), pattern(5, 4096))
        _lib.free(p)

    def test_tag_stacks_are_per_thread(self):
        depth = []
        with strata.tag("py-outer"):
            t = threading.Thread(target=lambda: depth.append(_lib.lib().strata_tag_depth()))
            t.start()
            t.join()
            self.assertEqual(_lib.lib().strata_tag_depth(), 1)
        self.assertEqual(depth, [0])
        self.assertEqual(_lib.lib().strata_tag_depth(), 0)

    def test_hook_function_pointers_resolve(self):
        for _, export in __import__("strata.torch").torch.HOOKS:
            self.assertIsInstance(_lib.function_pointer(export), int)
        empty = _lib.function_pointer("strata_empty_cache")
        ctypes.CFUNCTYPE(None)(empty)()  # callable through a bare function pointer, as PyTorch does
        strata.empty_cache()


@unittest.skipIf(importlib.util.find_spec("torch") is None, "PyTorch is not installed: torch routes untested here")
class TorchTest(unittest.TestCase):
    def setUp(self):
        import torch

        if not torch.cuda.is_available():
            self.skipTest("PyTorch has no CUDA device: torch routes need a GPU")

    def test_mem_pool_route_tags_segments(self):
        import torch
        import strata.torch as st

        with st.pool("torch-weights"):
            x = torch.ones(1 << 20, device="cuda")
        self.assertGreater(strata.tag_stats("torch-weights", x.device.index)["allocated_bytes"], 0)
        strata.sleep("torch-weights")
        strata.wake("torch-weights")
        torch.cuda.synchronize()
        self.assertEqual(float(x.sum()), float(1 << 20))


if __name__ == "__main__":
    unittest.main()
