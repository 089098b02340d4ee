"""strata.params through ctypes (strict mode): an idle model's layers remapped under pressure
and reverted, every layer's bytes intact through prepare_layer / layer_done and with the
look-ahead (prepare_next); the prefill budget; reversion once the device has room, though the
pool gave its free pages back; typed errors. The models go on the last device: one of their own
where there are two (the host runs), device 0 on a one-GPU machine."""

import importlib.util
import unittest

import strata
from strata import kv, params

LAYER = 2 << 20
DEVICE = strata.device_count() - 1
# Compute per layer, seconds: far above any layer's measured transfer time (T_T, tens of ms for
# 2 MiB in a debug build on a loaded machine), so that the budget T_T * N <= T_compute allows
# the remapping these tests ask for whatever the machine's timings.
T_C = 1.0


def layer_bytes(i):
    period = bytes((i * 37 + j * 11) % 253 for j in range(253))
    return (period * (LAYER // 253 + 1))[:LAYER]


class ParamsTest(unittest.TestCase):
    def setUp(self):
        # The controller frees pages by remapping only when the pool has none free: other tests
        # of this process may have left some on the device.
        strata.empty_cache()

    def test_remap_prepare_and_revert_keep_every_layer(self):
        model = params.register([layer_bytes(i) for i in range(6)], cap=3, device=DEVICE)
        self.assertEqual(model.stats()["remapped_layers"], 0)
        self.assertEqual(params.step(device=DEVICE, pages_short=2), 0)  # no compute reported yet
        model.report_compute(T_C)
        self.assertGreaterEqual(params.step(device=DEVICE, pages_short=2), 1)
        st = model.stats()
        self.assertGreaterEqual(st["remapped_layers"], 2)
        for _ in range(2):
            for i in range(6):
                model.prepare_layer(i)
                self.assertEqual(model.read(i, 0, LAYER), layer_bytes(i))
                model.layer_done(i)
        params.revert_all(device=DEVICE)
        self.assertEqual(model.stats()["remapped_layers"], 0)
        for i in range(6):
            self.assertEqual(model.read(i, 1000, 5000), layer_bytes(i)[1000:6000])

    def test_look_ahead_and_prefill_budget(self):
        model = params.register([layer_bytes(i) for i in range(6)], cap=2, device=DEVICE)
        self.assertGreater(model.stats()["transfer_ns"], 0)
        self.assertIsNone(model.prepare_next(0))  # nothing streams
        with self.assertRaises(strata.InvalidArgument):
            model.prepare_next(6)
        # An idle model's budget is its prefill when it reported one, else layers x T_c.
        model.report_compute(1e-9)
        self.assertEqual(model.stats()["remap_limit"], 0)
        model.report_prefill(3600)
        self.assertEqual(model.stats()["remap_limit"], 2)
        model.report_compute(T_C)
        model.set_active()  # the most recently active idle model goes first
        model.set_active(False)
        self.assertGreaterEqual(params.step(device=DEVICE, pages_short=1), 1)
        st = model.stats()
        streamed = st["streamed_layers"]
        self.assertGreater(streamed, 0)
        for _ in range(2):
            for i in range(6):
                model.prepare_layer(i)
                self.assertEqual(model.read(i, 0, 4096), layer_bytes(i)[:4096])
                model.layer_done(i)
                after = i
                while (after := model.prepare_next(after)) not in (None, i):
                    pass
        s = model.stats()
        runs = s["streamed_runs"] - st["streamed_runs"]
        self.assertEqual(runs, 2 * streamed)
        self.assertEqual(s["found_prepared"] - st["found_prepared"], runs - 1)
        params.revert_all(device=DEVICE)
        model.unregister()  # no budget left behind for the other tests' steps

    def test_reversion_comes_when_the_device_has_room_though_the_pool_let_its_pages_go(self):
        model = params.register([layer_bytes(i) for i in range(4)], cap=1, device=DEVICE)
        model.report_compute(T_C)
        model.set_active()  # the most recently active idle model goes first
        model.set_active(False)
        params.step(device=DEVICE, pages_short=1)
        self.assertEqual(model.stats()["remapped_layers"], 1)
        strata.empty_cache()  # the pool's free pages (the layer's among them) go to the driver
        self.assertEqual(strata.stats(device=DEVICE)["pool_free_bytes"], 0)
        self.assertGreaterEqual(params.step(device=DEVICE, pages_short=0), 1)
        self.assertEqual(model.stats()["remapped_layers"], 0)
        for i in range(4):
            self.assertEqual(model.read(i, 0, 4096), layer_bytes(i)[:4096])
        model.unregister()

    def test_unregister_gives_the_pages_back_and_waits_for_idle(self):
        before = strata.stats(device=0)["pool_in_use_bytes"]
        model = params.register([layer_bytes(i) for i in range(3)], cap=1, device=0)
        held = strata.stats(device=0)["pool_in_use_bytes"] - before
        self.assertEqual(held, 3 * LAYER)
        model.set_active()
        with self.assertRaises(strata.InvalidState):
            model.unregister()
        model.set_active(False)
        self.assertEqual(model.unregister() * LAYER, held)
        self.assertEqual(strata.stats(device=0)["pool_in_use_bytes"], before)
        with self.assertRaises(strata.StaleHandle):
            model.stats()
        with self.assertRaises(strata.StaleHandle):
            model.unregister()

    def test_bad_input_is_typed(self):
        with self.assertRaises(strata.InvalidArgument):
            params.register([b"a" * 10, b"b" * 11], cap=1)
        with self.assertRaises(strata.NoDevice):
            params.register([b"a" * 4096], cap=1, device=42)
        with self.assertRaises(strata.StaleHandle):
            params.Model(0x7_0000_0009).set_active()
        model = params.register([b"x" * 4096], cap=1)
        with self.assertRaises(strata.InvalidArgument):
            model.read(3, 0, 10)

    def test_integers_and_durations_beyond_the_c_types_are_refused(self):
        # ctypes wraps them silently: layer 2**32 would be layer 0, -1 pages 2**64 - 1.
        model = params.register([layer_bytes(i) for i in range(2)], cap=1)
        before = model.stats()
        calls = [
            (model.layer_ptr, 2**32), (model.prepare_layer, 2**32), (model.layer_done, 2**32 + 1),
            (model.prepare_next, -1), (model.read, 2**32, 0, 16), (model.read, 0, -1, 16),
            (model.read, 0, 0, -1), (model.read, 0, 0, 2**62), (model.report_compute, float("nan")),
            (model.report_compute, float("inf")), (model.report_compute, -1.0),
            (model.report_prefill, float("nan")), (params.step, 0, -1), (params.step, 2**32, 1),
            (params.revert_all, -(2**31) - 1), (params.register, [b"x" * 4096], 2**32),
            (params.register, [b"x" * 4096], 1, 2**31),
        ]
        for fn, *args in calls:
            with self.assertRaises(strata.InvalidArgument, msg=(fn.__name__, args)):
                fn(*args)
        with self.assertRaisesRegex(strata.InvalidArgument, r"layer is 4294967296: expected 0\.\.4294967295"):
            model.layer_ptr(2**32)
        with self.assertRaisesRegex(strata.InvalidArgument, "per_layer_seconds"):
            model.report_compute(float("nan"))
        self.assertEqual(model.stats(), before)  # nothing remapped, nothing reported
        self.assertEqual(model.read(1, 0, LAYER), layer_bytes(1))
        model.unregister()


class MirageStrictTest(unittest.TestCase):
    @unittest.skipUnless(importlib.util.find_spec("torch"), "needs torch")
    def test_memory_torch_cannot_read_is_refused(self):
        with kv.KvSpace(layers=1, kv_heads=1, head_dim=8, max_requests=1, max_tokens=8) as s:
            if s.tensor(0, "k").dlpack_device_type != 0:
                self.skipTest("torch can read strata memory here (not the strict host backend)")
        import torch

        from strata import mirage

        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        with self.assertRaisesRegex(strata.Unsupported, "STRATA_HOST_STRICT"):
            mirage.ModelParams(model)

    @unittest.skipUnless(importlib.util.find_spec("torch"), "needs torch")
    def test_bad_times_and_counts_are_refused_before_anything_moves(self):
        import torch

        from strata import mirage

        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        for kw, name in ((dict(compute_per_layer=float("nan")), "compute_per_layer"),
                         (dict(prefill=float("inf")), "prefill"), (dict(cap=-1), "cap"),
                         (dict(device=2**31), "device")):
            with self.assertRaisesRegex(strata.InvalidArgument, name, msg=kw):
                mirage.ModelParams(model, **kw)
        self.assertIsNone(getattr(model, "_strata_params", None))
        for pages in (-1, 2**64):
            with self.assertRaisesRegex(strata.InvalidArgument, "pages_short"):
                mirage.reclaim(pages)


if __name__ == "__main__":
    unittest.main()
