"""OffloadedStrataCache's layer streaming (`swap="stream"`) on the CPU under a stand-in for
`torch.cuda`: the stream and event logic of a GPU run, checked without a GPU.

The stand-in (`LaggingCuda`) runs the compute stream at once (torch's CPU kernels) and queues
the side stream's copies, running them only when the compute stream waits on an event recorded
after them (or a synchronization drains them): a side stream as slow as can be. A fetch the
compute stream does not wait for, or a write-back ordered after the fetch that needs it, then
reads stale or missing tokens, and greedy tokens differ from DynamicCache's. Every synchronizing
call (`torch.cuda.synchronize`, `Stream.synchronize`, `Event.synchronize`) raises while the
model generates: nothing on a step's path waits for the device. ffi/tests/python_transformers.rs
runs this module (on the host backend outside strict mode, as test_transformers)."""

import unittest
from unittest import mock

from test_transformers import DEVICE, PROMPTS, final_kv_bytes, generate, offload_model, transformers

if transformers:
    import torch
    from transformers import DynamicCache

    from strata._streams import Streams

NEW_TOKENS = 40


class Synchronized(AssertionError):
    pass


class FakeEvent:
    def __init__(self, cuda):
        self.cuda, self.id, self.done, self.stream = cuda, len(cuda.events), False, None
        cuda.events.append(self)

    def record(self, stream):
        self.stream = stream.name
        if stream.name == "compute":  # the compute stream runs at once
            self.done = True
            self.cuda.log.append(("record", "compute", self.id))
        else:
            self.cuda.queue.append(("record", self))
            self.cuda.log.append(("record", "side", self.id))

    def query(self):
        return self.done

    def synchronize(self):
        self.cuda.sync("Event.synchronize")


class FakeStream:
    def __init__(self, cuda, name):
        self.cuda, self.name = cuda, name

    def wait_event(self, event):
        self.cuda.log.append(("wait", self.name, event.id))
        if self.name == "compute" and event.stream == "side":
            self.cuda.run_until(event)

    def synchronize(self):
        self.cuda.sync("Stream.synchronize")


class LaggingCuda:
    """The part of `torch.cuda` `strata._streams.Streams` uses, with a side stream that lags."""

    def __init__(self):
        self.log, self.queue, self.events = [], [], []
        self.compute = FakeStream(self, "compute")
        self.forbid = False  # True while generating: synchronizing raises

    def Stream(self, device=None):  # noqa: N802 - torch.cuda's name
        return FakeStream(self, "side")

    def Event(self):  # noqa: N802
        return FakeEvent(self)

    def current_stream(self, device=None):
        return self.compute

    def stream(self, s):
        raise AssertionError("LaggingStreams queues its copies itself")

    def run_until(self, event=None):
        while self.queue:
            kind, what = self.queue.pop(0)
            if kind == "copy":
                for dst, src in what:
                    dst.copy_(src)
            else:
                what.done = True
                if what is event:
                    return

    def sync(self, name):
        if self.forbid:
            raise Synchronized(f"{name} on a step's path")
        self.run_until()

    def synchronize(self, device=None):
        self.sync("torch.cuda.synchronize")


class LaggingStreams(Streams):
    """`Streams` on the stand-in: its copies join the side stream's queue (logged as issued)."""

    def copy(self, pairs):
        self.cuda.log.append(("copy", pairs[0][0].data_ptr()))
        self.cuda.queue.append(("copy", list(pairs)))


@unittest.skipIf(DEVICE == "cuda", "CPU only: the stand-in replaces CUDA (a GPU run measures the real streams)")
@unittest.skipUnless(transformers, "needs transformers and CPU-readable KV memory")
class LayerStreamingTest(unittest.TestCase):
    def run_lagging(self, budget_fraction):
        from strata.transformers import OffloadedStrataCache

        model = offload_model("Qwen2")
        expected = generate(model, DynamicCache(), new_tokens=NEW_TOKENS)
        budget = int(final_kv_bytes(model, max(PROMPTS) + NEW_TOKENS) * budget_fraction)
        cuda = LaggingCuda()
        cache = OffloadedStrataCache(model.config, max_cache_len=max(PROMPTS) + NEW_TOKENS, device_budget=budget)
        cache._streams_for = lambda device: LaggingStreams(cuda)
        update = cache.update

        def logged(k, v, layer_idx, *args, **kwargs):
            cuda.log.append(("enter", layer_idx))
            out = update(k, v, layer_idx, *args, **kwargs)
            cuda.log.append(("return", layer_idx))
            return out

        cache.update = logged
        cuda.forbid = True
        with mock.patch.object(torch.cuda, "synchronize", cuda.synchronize):
            got = generate(model, cache, new_tokens=NEW_TOKENS)
        cuda.forbid = False
        self.assertTrue(torch.equal(got, expected), f"{(got != expected).sum()} tokens differ")
        off = cache.stats()["offload"]
        streamer = cache._swap
        offloaded = set(streamer.offloaded)
        cache.close()
        return cuda.log, off, offloaded

    def check_order(self, log, offloaded):
        """Each offloaded layer's update waits (compute stream) for the side stream's event after
        its fetch, and that fetch was queued before the update before it returned; returns the
        number of updates checked."""
        side_records = {e: i for i, (kind, *rest) in enumerate(log) if kind == "record" and rest[0] == "side"
                        for e in [rest[1]]}
        checked = 0
        previous_return = None
        i = 0
        while i < len(log):
            entry = log[i]
            if entry[0] == "return":
                previous_return = i
            if entry[0] == "enter" and entry[1] in offloaded:
                end = log.index(("return", entry[1]), i)
                waits = [e for kind, *rest in log[i:end] if kind == "wait" and rest[0] == "compute" for e in [rest[1]]]
                fetched = [side_records[e] for e in waits if e in side_records]
                self.assertEqual(len(fetched), 1, log[i:end])
                record = fetched[0]
                if record < i:  # queued ahead: before the previous update returned
                    self.assertIsNotNone(previous_return)
                    self.assertLess(record, previous_return, log[previous_return - 5 : i + 1])
                    checked += 1
            i += 1
        return checked

    def test_half_the_kv_streams_ahead_without_synchronizing(self):
        """Half the final KV on the device: layers are offloaded as the tokens grow (demotions),
        then every offloaded layer's fetch is queued by the update before it."""
        log, off, offloaded = self.run_lagging(0.5)
        self.assertEqual(off["mode"], "stream")
        self.assertGreaterEqual(len(offloaded), 2, off)
        self.assertGreater(off["demotions"], 0, off)
        checked = self.check_order(log, offloaded)
        self.assertEqual(checked, off["prefetch_hits"], off)
        self.assertGreater(checked, NEW_TOKENS, off)
        self.assertLessEqual(off["stalls"], 1 + off["demotions"], off)

    def test_a_budget_of_one_layer_streams_through_one_slot(self):
        """Room for one layer only: one slot, so each layer's fetch waits for the layer before it
        (fetched at its own update), and the tokens are still DynamicCache's."""
        log, off, offloaded = self.run_lagging(0.26)  # four layers: one fits, not two
        self.assertEqual(off["slots"], 1, off)
        self.assertEqual(len(offloaded), 4, off)
        self.assertEqual(self.check_order(log, offloaded), off["prefetch_hits"])

    def test_swap_modes_and_host_limit_are_checked(self):
        """swap is "stream" or "pie" ("stream" needs no disk tier nor expand); the default is
        "stream" without them. A host limit too small for the streamed layers is a clear
        OutOfMemory."""
        import strata
        from strata.transformers import OffloadedStrataCache

        model = offload_model("Qwen2")
        config, budget = model.config, final_kv_bytes(model, max(PROMPTS) + NEW_TOKENS) // 2
        for bad in (dict(swap="lru"), dict(swap="stream", disk_bytes=1 << 20), dict(swap="stream", expand=True)):
            with self.assertRaises(strata.InvalidArgument):
                OffloadedStrataCache(config, max_cache_len=100, device_budget=budget, **bad)
        self.assertEqual(OffloadedStrataCache(config, max_cache_len=100, device_budget=budget).swap, "stream")
        self.assertEqual(OffloadedStrataCache(config, max_cache_len=100, device_budget=budget, expand=True).swap, "pie")
        with OffloadedStrataCache(config, max_cache_len=100, device_budget=budget, host_bytes=4096) as cache:
            with self.assertRaisesRegex(strata.OutOfMemory, "host_bytes 4096"):
                generate(model, cache, new_tokens=NEW_TOKENS)

    def test_a_synchronizing_call_on_the_path_would_be_caught(self):
        """The stand-in's guard works: a synchronization while generating raises."""
        cuda = LaggingCuda()
        cuda.forbid = True
        with self.assertRaises(Synchronized):
            LaggingStreams(cuda).synchronize()


if __name__ == "__main__":
    unittest.main()
