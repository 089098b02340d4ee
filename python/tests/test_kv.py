"""strata.kv through ctypes, no torch: contents across spills to host and disk (backend copies, so
this runs in strict mode too), typed exceptions, lost-block callbacks exactly once per block.
(cargo test runs this through ffi/tests/python.rs.)"""

import os
import tempfile
import time
import unittest

import strata
from strata import kv

BPT = 4 * 64 * 2  # heads x dim x float16: 4096 tokens per 2 MiB page


def pattern(seed, n):
    return bytes((seed * 131 + i * 7) % 251 for i in range(n))


def space(**kw):
    args = dict(layers=2, kv_heads=4, head_dim=64, dtype="float16", max_requests=4, max_tokens=8192)
    args.update(kw)
    return kv.KvSpace(**args)


class KvSpaceTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.dir.cleanup()

    def test_spill_to_host_and_disk_keeps_every_byte(self):
        with space(host_bytes=64 << 20, disk_bytes=64 << 20, disk_dir=self.dir.name) as s:
            r = s.admit()
            r.append(5000)
            self.assertEqual(r.info()["blocks"], 2)
            data = {}
            for layer in range(2):
                for k in "kv":
                    data[layer, k] = pattern(layer * 2 + (k == "v"), 5000 * BPT)
                    r.write(layer, k, 0, data[layer, k])
            for tier in ("host", "disk"):
                r.spill(tier)
                self.assertEqual(r.residency(), [tier, tier])
                s.make_resident([r])
                self.assertEqual(r.residency(), ["device", "device"])
                for (layer, k), want in data.items():
                    self.assertEqual(r.read(layer, k, 0, 5000), want)
            st = s.stats()
            self.assertGreater(st["bytes_from_device"], 0)
            self.assertGreater(st["disk_write_bytes"], 0)
            self.assertEqual(st["blocks_resident"], 2)
            s.check()

    def test_stage_moves_disk_blocks_up_only_into_free_host_room(self):
        # The host tier holds one request's block (2 layers x K/V x one 2 MiB page).
        with space(host_bytes=8 << 20, disk_bytes=64 << 20, disk_dir=self.dir.name) as s:
            a, b = s.admit(), s.admit()
            for seed, r in enumerate((a, b)):
                r.append(4096)
                r.write(0, "k", 0, pattern(seed, 4096 * BPT))
            s.queue([a, b])
            a.spill("host")
            b.spill("host")  # b runs after a: to disk, not a
            self.assertEqual((a.residency(), b.residency()), (["host"], ["disk"]))
            before = s.stats()
            # No free room: staging b would push a to disk, so nothing moves.
            self.assertEqual(s.stage([b]), 0)
            self.assertEqual((a.residency(), b.residency()), (["host"], ["disk"]))
            after = s.stats()
            self.assertEqual(after["disk_read_bytes"], before["disk_read_bytes"])
            self.assertEqual(after["disk_write_bytes"], before["disk_write_bytes"])
            a.release()
            moved = s.stage([b])
            self.assertGreater(moved, 0)
            self.assertEqual(b.residency(), ["host"])
            s.make_resident([b])  # one hop: nothing more read from disk
            st = s.stats()
            self.assertEqual(st["disk_read_bytes"] - after["disk_read_bytes"], 4 * (2 << 20))
            self.assertEqual((st["staged_objects"], st["staged_evicted"]), (moved, 0))
            self.assertEqual(b.read(0, "k", 0, 4096), pattern(1, 4096 * BPT))
            s.check()

    def test_truncate_returns_pages_and_keeps_the_rest(self):
        with space(host_bytes=64 << 20, disk_bytes=64 << 20, disk_dir=self.dir.name) as s:
            r = s.admit()
            r.append(5000)
            want = pattern(3, 5000 * BPT)
            r.write(0, "k", 0, want)
            with self.assertRaises(strata.InvalidArgument) as ctx:
                r.truncate(5001)
            self.assertIn("above its 5000", str(ctx.exception))
            self.assertEqual(r.tokens, 5000)
            in_use = s.stats()["pool_in_use_pages"]
            r.truncate(4000)
            # The second block's page in each of the 4 tensors went back.
            self.assertEqual(in_use - s.stats()["pool_in_use_pages"], 4)
            self.assertEqual((r.tokens, r.info()["blocks"]), (4000, 1))
            self.assertEqual(r.read(0, "k", 0, 4000), want[: 4000 * BPT])
            r.spill("host")
            r.truncate(100)  # a spilled block: its copy is released
            s.make_resident([r])
            self.assertEqual(r.read(0, "k", 0, 100), want[: 100 * BPT])
            r.append(5000)
            self.assertEqual(r.info()["blocks"], 2)
            with self.assertRaises(strata.InvalidArgument):
                r.truncate(-1)
            self.assertEqual(r.tokens, 5100)
            r.truncate(0)
            self.assertEqual(s.stats()["pool_in_use_pages"], in_use - 8)
            s.check()
            r.release()
            with self.assertRaises(strata.StaleHandle):
                r.truncate(0)
            with self.assertRaises(TypeError):
                r.truncate("ten")

    def test_token_copies_move_engine_blocks_in_and_out_on_a_stream(self):
        import ctypes

        run = 1024  # tokens per copy: one "engine block" of 512 KiB
        blocks = {(layer, k, b): pattern(10 * layer + 5 * (k == "v") + b, run * BPT)
                  for layer in range(2) for k in "kv" for b in range(2)}
        engine = {key: ctypes.create_string_buffer(data, len(data))
                  for key, data in blocks.items()}
        with space(host_bytes=64 << 20) as s, strata.Stream() as stream:
            r = s.admit()
            r.append(2 * run)
            plan = [(r, layer, k, b * run, ctypes.addressof(engine[layer, k, b]))
                    for layer, k, b in engine]
            s.copy_tokens("in", run, plan, stream)
            stream.synchronize()
            for (layer, k, b), want in blocks.items():
                self.assertEqual(r.read(layer, k, b * run, run), want)
            r.spill("host")
            with self.assertRaises(strata.InvalidState):  # spilled: make it resident first
                s.copy_tokens("out", run, plan, stream)
            s.make_resident([r])
            for buf in engine.values():
                ctypes.memset(buf, 0, len(buf))
            s.copy_tokens("out", run, plan, stream)
            stream.synchronize()
            for key, want in blocks.items():
                self.assertEqual(engine[key].raw, want)
            with self.assertRaises(strata.InvalidArgument):
                s.copy_tokens("sideways", run, plan, stream)
            with self.assertRaises(strata.InvalidArgument):  # past the request's tokens
                s.copy_tokens("out", run + 1, plan[1:2], stream)
        with self.assertRaises(strata.StaleHandle):
            stream.synchronize()

    def test_typed_exceptions(self):
        with self.assertRaises(strata.InvalidArgument) as ctx:
            space(layers=0)
        self.assertIsInstance(ctx.exception, ValueError)
        self.assertIn("layers is 0", str(ctx.exception))
        with self.assertRaises(strata.NoDevice):
            space(device=99)
        with space() as s, space() as other:
            r = s.admit()
            with self.assertRaises(strata.InvalidArgument) as ctx:
                r.append(10_000)
            self.assertIn("max_tokens", str(ctx.exception))
            self.assertEqual(r.tokens, 0)
            foreign = other.admit()
            with self.assertRaises(strata.InvalidArgument):
                s.request(foreign.handle).append(1)
            r.release()
            with self.assertRaises(strata.StaleHandle):
                r.append(1)
            with self.assertRaises(strata.OutOfMemory):
                r2 = s.admit()
                r2.append(4096)
                r2.spill("host")  # no host tier
            r3 = s.admit()
            r3.append(100)
            with self.assertRaises(strata.InvalidArgument):
                r3.spill("tape")
            with self.assertRaises(strata.InvalidArgument):
                s.tensor(0, "q")
        with self.assertRaises(strata.StaleHandle):
            s.admit()
        self.assertTrue(issubclass(strata.StaleHandle, strata.StrataError))

    def test_integers_beyond_the_c_types_are_refused_and_lose_nothing(self):
        # ctypes wraps them silently: 2**32 as a uint32_t is 0, 2**32 + 5 is 5.
        for kw, name in ((dict(layers=2**32 + 2), "layers"), (dict(max_tokens=-1), "max_tokens"),
                         (dict(host_bytes=2**64), "host_bytes"), (dict(device=2**31), "device"),
                         (dict(step_time=float("nan")), "step_time"), (dict(durability=7), "durability")):
            with self.assertRaisesRegex(strata.InvalidArgument, name, msg=kw):
                space(**kw)
        with space() as s:
            r = s.admit()
            r.append(100)
            want = pattern(5, 100 * BPT)
            r.write(0, "k", 0, want)
            other = pattern(6, 10 * BPT)
            calls = [
                (r.truncate, 2**32), (r.append, 2**32 + 5), (r.append, -1), (s.tensor, 2**32, "k"),
                (r.write, 2**32, "k", 0, other), (r.write, 0, "k", 2**32, other),
                (r.read, 2**32, "k", 0, 10), (r.read, 0, "k", 2**32, 10), (r.read, 0, "k", 0, -1),
                (r.read, 0, "k", 0, 2**31), (s.advance, -1), (s.spill_idle, 2**64), (s.revoke, -1),
                (s.copy_tokens, "out", 2**32 + 1, [(r, 0, "k", 0, 0)]),
                (s.copy_tokens, "out", 1, [(r, 2**32, "k", 0, 0)]),
                (s.copy_tokens, "out", 1, [(r, 0, "k", 0, -1)]),
            ]
            for fn, *args in calls:
                with self.assertRaises(strata.InvalidArgument, msg=(fn.__name__, args)):
                    fn(*args)
            with self.assertRaisesRegex(strata.InvalidArgument, r"tokens is 4294967296: expected 0\.\.4294967295"):
                r.truncate(2**32)
            with self.assertRaises(TypeError):
                r.append(1.5)
            self.assertEqual(r.tokens, 100)
            self.assertEqual(r.read(0, "k", 0, 100), want)
            s.check()

    def test_lost_callback_fires_exactly_once_per_lost_block(self):
        with space(max_requests=4, host_bytes=64 << 20) as s:
            reqs = [s.admit() for _ in range(3)]
            for i, r in enumerate(reqs):
                r.append(1000 + 3000 * i)  # 1, 1 and 2 blocks, never spilled: no clean copies
            seen = []

            def on_lost(request, block):
                # No strata lock is held: calling back in works.
                self.assertEqual(request.info()["lost"] >= 1, True)
                seen.append((request.handle, block))

            s.on_lost(on_lost)
            with self.assertRaises(strata.OutOfMemory):
                s.revoke(1 << 20)  # more than the device: every block goes
            self.assertEqual(len(seen), len(set(seen)))
            every_block = [(r.handle, b) for r in reqs for b in range(len(r.residency()))]
            self.assertEqual(sorted(seen), sorted(every_block))
            self.assertEqual(s.stats()["lost_blocks"], len(seen))
            for r in reqs:
                self.assertEqual(r.take_lost(), [])
                self.assertEqual(set(r.residency()), {"lost"})
            s.make_resident(reqs)
            for r in reqs:
                self.assertEqual(set(r.residency()), {"device"})
            s.on_lost(None)
            s.check()

    def test_backed_space_loses_nothing(self):
        with space(durability="backed", host_bytes=64 << 20) as s:
            r = s.admit()
            r.append(4096)
            want = pattern(9, 4096 * BPT)
            r.write(1, "v", 0, want)
            s.advance(1)
            with self.assertRaises(strata.OutOfMemory):
                s.revoke(1 << 20)
            self.assertEqual(r.residency(), ["host"])
            self.assertEqual(r.read(1, "v", 0, 4096), want)
            self.assertEqual(s.stats()["lost_blocks"], 0)

    def test_map_ahead_env_grows_a_zero_page_space_from_pages_mapped_ahead(self):
        """STRATA_KV_MAP_AHEAD, read when a space is created, starts its background mapper in a
        space with the zero page too (the default): appends then take pages it mapped ahead."""

        def grow(env):
            old = os.environ.get("STRATA_KV_MAP_AHEAD")
            if env is None:
                os.environ.pop("STRATA_KV_MAP_AHEAD", None)
            else:
                os.environ["STRATA_KV_MAP_AHEAD"] = env
            try:
                s = space(max_tokens=16 * 4096)
            finally:
                if old is None:
                    os.environ.pop("STRATA_KV_MAP_AHEAD", None)
                else:
                    os.environ["STRATA_KV_MAP_AHEAD"] = old
            with s:
                r = s.admit()
                want = pattern(5, 4096 * BPT)
                for step in range(8):
                    # An admitted request gets a row (a page in each of the 4 tensors) ahead;
                    # each append of one page's tokens then takes it, decode steps apart.
                    deadline = time.monotonic() + 10
                    while env and s.stats()["pages_ahead"] < 4 and time.monotonic() < deadline:
                        time.sleep(0.002)
                    r.append(4096)
                    r.write(1, "v", step * 4096, want)
                    s.check()
                for step in range(8):
                    self.assertEqual(r.read(1, "v", step * 4096, 4096), want)
                stats = s.stats()
                r.release()
                s.check()
                return stats

        on = grow("64")
        self.assertEqual(on["pages_from_ahead"], 8 * 4, on)
        off = grow(None)
        self.assertEqual((off["pages_from_ahead"], off["pages_ahead"]), (0, 0), off)


if __name__ == "__main__":
    unittest.main()
